//! Zero-copy views of shared memory for Python: [`Mapping`], a second
//! mapping of pages the IPC client mapped (the manager's pool, a device
//! region) or of an embedded runtime's device region file, and `orbitkv.SharedBuffer`, a buffer-protocol exporter over a
//! byte range of one. [`memoryview`] wraps an exporter in a `memoryview`.
//!
//! Why a hand-built type: the package is abi3 for Python 3.9+, and the
//! buffer slots joined the limited API only in 3.11, so PyO3 does not
//! generate `__getbuffer__` for this build. CPython has accepted
//! `Py_bf_getbuffer` in `PyType_FromSpec` since 3.9 (bpo-40724), and
//! `Py_buffer`'s layout is the same in every CPython 3 release, so the type
//! below is built from a spec with the slot by hand.
//!
//! Lifetimes: every exporter holds an `Arc<Mapping>`, and a `memoryview`
//! (and every slice of it, and numpy arrays over it) holds its exporter, so
//! the bytes stay mapped as long as anything can reach them, even after the
//! client is closed or dropped. The mapping is our own (a duplicate, see
//! [`Mapping::duplicate`]), so closing the client never unmaps it.

use std::ffi::{c_int, c_void};
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// A shared mapping this module owns; unmapped when the last view goes.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, valid from any thread until
// `Drop` unmaps it; concurrent access through views is the caller's
// business, as with any shared memory.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A second mapping of the shared pages at `[ptr, ptr + len)`:
    /// `mremap(ptr, 0, len, MREMAP_MAYMOVE)`, which for a shared mapping
    /// (`MAP_SHARED`, as memfd mappings are) maps the same pages again, with
    /// the same protection, at a new address. No byte is copied, and the
    /// duplicate lives independently of the original (which the client
    /// unmaps when it is dropped).
    ///
    /// # Safety
    ///
    /// `ptr` must be the start of a live shared mapping at least `len` bytes
    /// long.
    pub unsafe fn duplicate(ptr: *const u8, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        // SAFETY: the caller guarantees a live shared mapping at `ptr`.
        let p = unsafe { libc::mremap(ptr as *mut c_void, 0, len, libc::MREMAP_MAYMOVE) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p as *mut u8).expect("mremap returned a null mapping"),
            len,
        })
    }

    /// A new shared, writable mapping of the first `len` bytes of the
    /// memory file `fd` (a device region's memfd). The mapping holds the
    /// pages on its own: closing `fd`, or the owner unmapping its mapping,
    /// leaves it valid.
    pub fn map_shared(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Ok(Mapping {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        // SAFETY: a fresh mapping chosen by the kernel; nothing else is at
        // the returned address. The file is a shared-memory file whose
        // writers (the copy engine) and readers agree through the
        // runtime's pins and leases, as with device memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p as *mut u8)
                .ok_or_else(|| io::Error::other("mmap returned null"))?,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: our own mapping; nothing reaches it any more (the last
            // `Arc` is gone).
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut c_void, self.len) };
        }
    }
}

/// CPython's `Py_buffer`; `pyo3::ffi` only declares it for abi3 ≥ 3.11.
#[repr(C)]
struct PyBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut std::ffi::c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyBuffer_FillInfo(
        view: *mut PyBuffer,
        o: *mut ffi::PyObject,
        buf: *mut c_void,
        len: ffi::Py_ssize_t,
        readonly: c_int,
        flags: c_int,
    ) -> c_int;
}

/// The instance layout of `orbitkv.SharedBuffer`.
#[repr(C)]
struct SharedBufferObject {
    ob_base: ffi::PyObject,
    /// `Arc::into_raw` of the mapping; released in `dealloc`.
    mapping: *const Mapping,
    ptr: *mut u8,
    len: ffi::Py_ssize_t,
    readonly: c_int,
}

unsafe extern "C" fn getbuffer(obj: *mut ffi::PyObject, view: *mut c_void, flags: c_int) -> c_int {
    let o = obj as *mut SharedBufferObject;
    // SAFETY: `obj` is a SharedBufferObject (this is its type's slot);
    // FillInfo raises BufferError for a writable request on a read-only
    // range, and takes a reference to `obj` for the view.
    unsafe {
        PyBuffer_FillInfo(
            view as *mut PyBuffer,
            obj,
            (*o).ptr as *mut c_void,
            (*o).len,
            (*o).readonly,
            flags,
        )
    }
}

unsafe extern "C" fn dealloc(obj: *mut ffi::PyObject) {
    let o = obj as *mut SharedBufferObject;
    // SAFETY: the last reference is gone; no buffer view remains (each holds
    // a reference). The mapping pointer came from `Arc::into_raw` (or is
    // null if construction failed half-way).
    unsafe {
        if !(*o).mapping.is_null() {
            drop(Arc::from_raw((*o).mapping));
            (*o).mapping = std::ptr::null();
        }
        let tp = ffi::Py_TYPE(obj);
        let free: ffi::freefunc = std::mem::transmute(ffi::PyType_GetSlot(tp, ffi::Py_tp_free));
        free(obj as *mut c_void);
        // Heap type instances own a reference to their type.
        ffi::Py_DECREF(tp as *mut ffi::PyObject);
    }
}

unsafe extern "C" fn refuse_new(
    _tp: *mut ffi::PyTypeObject,
    _args: *mut ffi::PyObject,
    _kwds: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: setting an exception with the GIL held (a tp_new slot).
    unsafe {
        ffi::PyErr_SetString(
            ffi::PyExc_TypeError,
            c"orbitkv.SharedBuffer cannot be created directly; use Client.page, Client.region or Runtime.device_view"
                .as_ptr(),
        )
    };
    std::ptr::null_mut()
}

static TYPE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The `orbitkv.SharedBuffer` type, created on first use.
pub fn shared_buffer_type(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    let tp = TYPE.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        let mut slots = [
            ffi::PyType_Slot {
                slot: ffi::Py_bf_getbuffer,
                pfunc: getbuffer as *mut c_void,
            },
            ffi::PyType_Slot {
                slot: ffi::Py_tp_dealloc,
                pfunc: dealloc as *mut c_void,
            },
            ffi::PyType_Slot {
                slot: ffi::Py_tp_new,
                pfunc: refuse_new as *mut c_void,
            },
            ffi::PyType_Slot {
                slot: ffi::Py_tp_doc,
                pfunc: c"Shared memory of an orbitkv.Client (the manager's pool or a device \
                         region) or of an orbitkv.Runtime's device region, exported zero-copy through the buffer protocol; wrap it in \
                         memoryview() or numpy.frombuffer()."
                    .as_ptr() as *mut c_void,
            },
            ffi::PyType_Slot {
                slot: 0,
                pfunc: std::ptr::null_mut(),
            },
        ];
        let mut spec = ffi::PyType_Spec {
            // Static: CPython < 3.12 keeps this pointer as tp_name.
            name: c"orbitkv.SharedBuffer".as_ptr(),
            basicsize: std::mem::size_of::<SharedBufferObject>() as c_int,
            itemsize: 0,
            flags: ffi::Py_TPFLAGS_DEFAULT as std::ffi::c_uint,
            slots: slots.as_mut_ptr(),
        };
        // SAFETY: a valid spec; the slot values are copied into the type.
        unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyType_FromSpec(&mut spec)) }
            .map(Bound::unbind)
    })?;
    Ok(tp.bind(py))
}

/// A `memoryview` of `len` bytes at `offset` in `mapping`, zero-copy;
/// read-only when `readonly`. The caller checks the bounds.
pub fn memoryview<'py>(
    py: Python<'py>,
    mapping: Arc<Mapping>,
    offset: usize,
    len: usize,
    readonly: bool,
) -> PyResult<Bound<'py, PyAny>> {
    assert!(
        offset
            .checked_add(len)
            .is_some_and(|end| end <= mapping.len),
        "view [{offset}, +{len}) outside a {}-byte mapping",
        mapping.len
    );
    let tp = shared_buffer_type(py)?;
    // SAFETY: allocating an instance of our heap type through its tp_alloc
    // (zeroed memory, a new reference, the type's refcount taken), then
    // filling its fields before anything else can see it.
    unsafe {
        let tp_ptr = tp.as_ptr() as *mut ffi::PyTypeObject;
        let alloc: ffi::allocfunc =
            std::mem::transmute(ffi::PyType_GetSlot(tp_ptr, ffi::Py_tp_alloc));
        let obj = Bound::from_owned_ptr_or_err(py, alloc(tp_ptr, 0))?;
        let o = obj.as_ptr() as *mut SharedBufferObject;
        (*o).ptr = mapping.ptr.as_ptr().add(offset);
        (*o).len = len as ffi::Py_ssize_t;
        (*o).readonly = c_int::from(readonly);
        (*o).mapping = Arc::into_raw(mapping);
        Bound::from_owned_ptr_or_err(py, ffi::PyMemoryView_FromObject(obj.as_ptr()))
    }
}
