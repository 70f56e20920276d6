//! Device memory and raw copies for GPU tests and benchmarks (and the copy
//! agent's tests): what an engine process would own, allocated through the
//! same primary context the engine uses. Needs a working driver: call
//! [`super::probe`] first, or these return the driver's error.

use std::ffi::c_void;
use std::ptr;
use std::time::Instant;

use cudarc::driver::sys;

use super::driver::{DriverError, Ordinal};
use super::real::{Bound, check};
use crate::Direction;

type Result<T> = std::result::Result<T, DriverError>;

struct Primary {
    handle: sys::CUdevice,
    context: sys::CUcontext,
}

impl Primary {
    fn retain(device: Ordinal) -> Result<Self> {
        // SAFETY: cuInit may be repeated; the probe loaded the library.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut handle = 0;
        // SAFETY: writes one handle.
        check(
            unsafe { sys::cuDeviceGet(&mut handle, device) },
            "cuDeviceGet",
        )?;
        let mut context = ptr::null_mut();
        // SAFETY: retains the primary context; released on drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, handle) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Self { handle, context })
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        // SAFETY: balances the retain.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.handle) };
    }
}

/// A device allocation (`cuMemAlloc`), freed on drop.
pub struct DeviceMemory {
    primary: Primary,
    ptr: u64,
    len: u64,
}

// SAFETY: a device pointer and a retained context, usable from any thread
// with the context made current (every method does).
unsafe impl Send for DeviceMemory {}

impl DeviceMemory {
    pub fn alloc(device: Ordinal, len: u64) -> Result<Self> {
        let primary = Primary::retain(device)?;
        let mut ptr = 0;
        {
            let _bound = Bound::new(primary.context)?;
            // SAFETY: allocates on the current context.
            check(
                unsafe { sys::cuMemAlloc_v2(&mut ptr, len as usize) },
                "cuMemAlloc",
            )?;
        }
        Ok(Self { primary, ptr, len })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, offset: u64, len: usize) -> Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(self.ptr + offset),
            _ => Err(DriverError {
                call: "DeviceMemory",
                code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as u32,
                name: format!("[{offset}, +{len}) is outside {} bytes", self.len),
            }),
        }
    }

    /// Synchronous write (waits for the context first, so it lands after
    /// every copy already queued).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.range(offset, data.len())?;
        let _bound = Bound::new(self.primary.context)?;
        // SAFETY: in bounds; `data` is readable for its length.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Synchronous read, as the engine would see the bytes now.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let src = self.range(offset, len)?;
        let mut out = vec![0u8; len];
        let _bound = Bound::new(self.primary.context)?;
        // SAFETY: in bounds; `out` is writable for `len` bytes.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, len) },
            "cuMemcpyDtoH",
        )?;
        Ok(out)
    }

    /// Sets every byte, and waits for it.
    pub fn fill(&self, byte: u8) -> Result<()> {
        let _bound = Bound::new(self.primary.context)?;
        // SAFETY: the whole allocation; then wait for the context.
        check(
            unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.len as usize) },
            "cuMemsetD8",
        )?;
        // SAFETY: waits for the current context.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(_bound) = Bound::new(self.primary.context) {
            // SAFETY: our allocation; callers drop it only after their
            // copies finished (as an engine frees its tensors).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// The baseline for benchmarks: one `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync`
/// of `len` bytes between `host` and `device_ptr` on a fresh non-blocking
/// stream, then waited for. `host` should be pinned (registered or
/// `cuMemAllocHost`), or the copy is not asynchronous. Returns seconds per
/// copy, the best of `repeats`.
///
/// # Safety
/// `host..host+len` must be valid and `device_ptr..+len` a device range on
/// `device`.
pub unsafe fn raw_copy_seconds(
    device: Ordinal,
    direction: Direction,
    host: *mut u8,
    device_ptr: u64,
    len: u64,
    repeats: usize,
) -> Result<f64> {
    let primary = Primary::retain(device)?;
    let _bound = Bound::new(primary.context)?;
    let mut stream: sys::CUstream = ptr::null_mut();
    // SAFETY: creates a stream on the current context; destroyed below.
    check(
        unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        },
        "cuStreamCreate",
    )?;
    let mut best = f64::INFINITY;
    let mut result = Ok(());
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        // SAFETY: ranges per this function's contract.
        let code = unsafe {
            match direction {
                Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                    device_ptr,
                    host as *const c_void,
                    len as usize,
                    stream,
                ),
                Direction::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(host.cast(), device_ptr, len as usize, stream)
                }
            }
        };
        result = check(code, "cuMemcpyAsync")
            // SAFETY: our stream.
            .and_then(|()| {
                check(
                    unsafe { sys::cuStreamSynchronize(stream) },
                    "cuStreamSynchronize",
                )
            });
        if result.is_err() {
            break;
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    // SAFETY: our stream, now idle.
    let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
    result.map(|()| best)
}

/// Page-locked host memory from `cuMemAllocHost` (the baseline's buffer).
pub struct PinnedHost {
    _primary: Primary,
    ptr: *mut u8,
    len: u64,
}

impl PinnedHost {
    pub fn alloc(device: Ordinal, len: u64) -> Result<Self> {
        let primary = Primary::retain(device)?;
        let _bound = Bound::new(primary.context)?;
        let mut ptr: *mut c_void = ptr::null_mut();
        // SAFETY: allocates `len` pinned bytes; freed on drop.
        check(
            unsafe { sys::cuMemAllocHost_v2(&mut ptr, len as usize) },
            "cuMemAllocHost",
        )?;
        drop(_bound);
        Ok(Self {
            _primary: primary,
            ptr: ptr.cast(),
            len,
        })
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if let Ok(_bound) = Bound::new(self._primary.context) {
            // SAFETY: from cuMemAllocHost; no copy uses it any more.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}
