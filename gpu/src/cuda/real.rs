//! [`CudaDriver`]: the [`Driver`] seam over the CUDA driver API (cudarc's
//! `sys` bindings, loaded at run time). Every call here is `unsafe` FFI;
//! each says which contract it relies on.
//!
//! Contexts: each device uses its primary context (the one PyTorch and the
//! CUDA runtime use), retained while the device is open. Calls make it
//! current only for their duration and restore what the calling thread had,
//! so an engine thread's own CUDA state is left as it was.

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::ptr;

use cudarc::driver::sys;

use super::Unavailable;
use super::driver::{
    Allocation, CopyApi, Driver, DriverError, DriverInfo, EnqueueError, EventId, Ordinal, Pinned,
    Run,
};
use crate::Direction;

type Result<T> = std::result::Result<T, DriverError>;

fn error(code: sys::CUresult, call: &'static str) -> DriverError {
    let mut name: *const std::ffi::c_char = ptr::null();
    // SAFETY: `cuGetErrorName` writes a pointer to a static string or
    // leaves `name` null; it does not need a context.
    let ok = unsafe { sys::cuGetErrorName(code, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    let name = if ok && !name.is_null() {
        // SAFETY: non-null, NUL-terminated and static (driver contract).
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("CUresult {}", code as u32)
    };
    DriverError {
        call,
        code: code as u32,
        name,
    }
}

pub(super) fn check(code: sys::CUresult, call: &'static str) -> Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(error(code, call))
    }
}

/// Loads the driver and reports what it offers, without opening a device.
///
/// `is_culib_present` comes first: cudarc panics on the first call into a
/// library it cannot load, so nothing else may run before this check.
pub fn probe() -> std::result::Result<DriverInfo, Unavailable> {
    // SAFETY: only tries to dlopen the library candidates.
    if !unsafe { sys::is_culib_present() } {
        return Err(Unavailable::NoDriver);
    }
    // SAFETY: the library is present (checked above); cuInit(0) is the
    // documented first call and may be repeated.
    check(unsafe { sys::cuInit(0) }, "cuInit").map_err(Unavailable::Init)?;
    let mut version = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDriverGetVersion(&mut version) },
        "cuDriverGetVersion",
    )
    .map_err(Unavailable::Init)?;
    let mut devices = 0;
    // SAFETY: writes one int; the driver is initialised.
    check(
        unsafe { sys::cuDeviceGetCount(&mut devices) },
        "cuDeviceGetCount",
    )
    .map_err(Unavailable::Init)?;
    // cudarc resolves symbols lazily and panics on a missing one, so look
    // the batch entry point up ourselves before ever calling it. It exists
    // from driver 12.8; a CUDA 13 driver keeps exporting the 12.8 ABI
    // under this name.
    // SAFETY: the library loads (checked above); we only test a symbol's
    // presence, never call through this pointer.
    let exported = unsafe { sys::culib().get::<*const c_void>(b"cuMemcpyBatchAsync") }.is_ok();
    Ok(DriverInfo {
        version,
        devices,
        batch_api: version >= 12080 && exported,
    })
}

struct Device {
    handle: sys::CUdevice,
    context: sys::CUcontext,
    /// One stream per direction: `[HostToDevice, DeviceToHost]`.
    streams: [sys::CUstream; 2],
}

impl Device {
    fn stream(&self, direction: Direction) -> sys::CUstream {
        match direction {
            Direction::HostToDevice => self.streams[0],
            Direction::DeviceToHost => self.streams[1],
        }
    }
}

/// Scratch arrays for `cuMemcpyBatchAsync`, reused across calls so the copy
/// path does not allocate once warm.
#[derive(Default)]
struct Scratch {
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

/// The real driver. Owns two streams per open device.
pub struct CudaDriver {
    info: DriverInfo,
    max_runs_per_call: usize,
    devices: HashMap<Ordinal, Device>,
    scratch: Scratch,
}

// SAFETY: CUDA driver handles (contexts, streams, events) are process-wide
// and may be used from any thread once a context is current; every call
// below makes the device's context current first. The executor is used by
// one thread at a time (`&mut self`).
unsafe impl Send for CudaDriver {}

/// Makes a context current for one call and restores the thread's previous
/// one afterwards.
pub(super) struct Bound {
    previous: sys::CUcontext,
    changed: bool,
}

impl Bound {
    pub(super) fn new(context: sys::CUcontext) -> Result<Self> {
        let mut previous: sys::CUcontext = ptr::null_mut();
        // SAFETY: writes one handle (null when none is current).
        check(
            unsafe { sys::cuCtxGetCurrent(&mut previous) },
            "cuCtxGetCurrent",
        )?;
        let changed = previous != context;
        if changed {
            // SAFETY: `context` is a primary context we retain.
            check(unsafe { sys::cuCtxSetCurrent(context) }, "cuCtxSetCurrent")?;
        }
        Ok(Self { previous, changed })
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restores what the thread had (possibly null, which
            // unbinds); failure leaves our context current, which is
            // harmless for the driver and not worth a panic.
            let _ = unsafe { sys::cuCtxSetCurrent(self.previous) };
        }
    }
}

fn event(id: EventId) -> sys::CUevent {
    id.0 as usize as sys::CUevent
}

impl CudaDriver {
    /// Loads the driver (see [`probe`]). `max_runs_per_call` bounds one
    /// `cuMemcpyBatchAsync` call (and so the scratch arrays).
    pub fn load(max_runs_per_call: usize) -> std::result::Result<Self, Unavailable> {
        Ok(Self {
            info: probe()?,
            max_runs_per_call: max_runs_per_call.max(1),
            devices: HashMap::new(),
            scratch: Scratch::default(),
        })
    }

    fn device(&self, device: Ordinal, call: &'static str) -> Result<&Device> {
        self.devices.get(&device).ok_or(DriverError {
            call,
            code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as u32,
            name: format!("device {device} is not open"),
        })
    }

    fn bind(&self, device: Ordinal, call: &'static str) -> Result<(&Device, Bound)> {
        let d = self.device(device, call)?;
        Ok((d, Bound::new(d.context)?))
    }

    fn enqueue_per_run(
        stream: sys::CUstream,
        direction: Direction,
        runs: &[Run],
    ) -> std::result::Result<(), EnqueueError> {
        for (i, run) in runs.iter().enumerate() {
            let len = run.len as usize;
            // SAFETY: the executor checked both ranges: `host` lies in the
            // pinned pool, `device` in a device allocation on this
            // stream's device; both stay valid until the event recorded
            // after this run completes (the `CopyEngine` contracts).
            let (code, call) = unsafe {
                match direction {
                    Direction::HostToDevice => (
                        sys::cuMemcpyHtoDAsync_v2(
                            run.device,
                            run.host as *const c_void,
                            len,
                            stream,
                        ),
                        "cuMemcpyHtoDAsync",
                    ),
                    Direction::DeviceToHost => (
                        sys::cuMemcpyDtoHAsync_v2(run.host as *mut c_void, run.device, len, stream),
                        "cuMemcpyDtoHAsync",
                    ),
                }
            };
            check(code, call).map_err(|error| EnqueueError { enqueued: i, error })?;
        }
        Ok(())
    }

    fn enqueue_batch(
        &mut self,
        ordinal: Ordinal,
        stream: sys::CUstream,
        direction: Direction,
        runs: &[Run],
    ) -> std::result::Result<(), EnqueueError> {
        let location = |type_, id| sys::CUmemLocation { type_, id };
        let host = location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0);
        let dev = location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ordinal);
        let (src_hint, dst_hint) = match direction {
            Direction::HostToDevice => (host, dev),
            Direction::DeviceToHost => (dev, host),
        };
        let mut attrs = sys::CUmemcpyAttributes {
            // Sources are read in stream order, like cuMemcpyAsync.
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            // Location hints only matter for managed or pageable memory;
            // ours is device memory and pinned host memory.
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let s = &mut self.scratch;
        for (chunk_index, chunk) in runs.chunks(self.max_runs_per_call).enumerate() {
            s.dsts.clear();
            s.srcs.clear();
            s.sizes.clear();
            for run in chunk {
                let (dst, src) = match direction {
                    Direction::HostToDevice => (run.device, run.host),
                    Direction::DeviceToHost => (run.host, run.device),
                };
                s.dsts.push(dst);
                s.srcs.push(src);
                s.sizes.push(run.len as usize);
            }
            let mut attr_index: usize = 0;
            let mut fail_index: usize = usize::MAX;
            // SAFETY: three arrays of `chunk.len()` entries, one attribute
            // applying from copy 0; addresses checked as in
            // `enqueue_per_run`; the stream is ours (not the legacy NULL
            // stream, which this call refuses).
            let code = unsafe {
                sys::cuMemcpyBatchAsync(
                    s.dsts.as_mut_ptr(),
                    s.srcs.as_mut_ptr(),
                    s.sizes.as_mut_ptr(),
                    chunk.len(),
                    &mut attrs,
                    &mut attr_index,
                    1,
                    &mut fail_index,
                    stream,
                )
            };
            check(code, "cuMemcpyBatchAsync").map_err(|error| EnqueueError {
                // Conservative: earlier chunks are queued; of this one, the
                // copies before `fail_index` may be.
                enqueued: chunk_index * self.max_runs_per_call
                    + if fail_index < chunk.len() {
                        fail_index
                    } else {
                        0
                    },
                error,
            })?;
        }
        Ok(())
    }

    fn close(&mut self, ordinal: Ordinal) {
        if let Some(d) = self.devices.remove(&ordinal) {
            if let Ok(_bound) = Bound::new(d.context) {
                for stream in d.streams {
                    // SAFETY: our stream, on its context (current); nothing
                    // is queued (the executor synchronised first).
                    let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
                }
            }
            // SAFETY: balances the retain in `open_device`.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d.handle) };
        }
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let open: Vec<Ordinal> = self.devices.keys().copied().collect();
        for ordinal in open {
            self.close(ordinal);
        }
    }
}

impl Driver for CudaDriver {
    fn info(&self) -> DriverInfo {
        self.info
    }

    fn open_device(&mut self, ordinal: Ordinal) -> Result<()> {
        if self.devices.contains_key(&ordinal) {
            return Ok(());
        }
        let mut handle: sys::CUdevice = 0;
        // SAFETY: writes one handle; an out-of-range ordinal is an error.
        check(
            unsafe { sys::cuDeviceGet(&mut handle, ordinal) },
            "cuDeviceGet",
        )?;
        let mut context: sys::CUcontext = ptr::null_mut();
        // SAFETY: retains (creating if needed) the device's primary
        // context; released in `close`.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, handle) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut streams: [sys::CUstream; 2] = [ptr::null_mut(); 2];
        let created = Bound::new(context).and_then(|_bound| {
            for i in 0..streams.len() {
                // SAFETY: creates a stream on the current (primary)
                // context. Non-blocking: it never serialises with the
                // legacy default stream the engine may use.
                let made = check(
                    unsafe {
                        sys::cuStreamCreate(
                            &mut streams[i],
                            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                        )
                    },
                    "cuStreamCreate",
                );
                if let Err(e) = made {
                    for s in &streams[..i] {
                        // SAFETY: created just above, unused.
                        let _ = unsafe { sys::cuStreamDestroy_v2(*s) };
                    }
                    return Err(e);
                }
            }
            Ok(())
        });
        if let Err(e) = created {
            // SAFETY: balances the retain above.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(handle) };
            return Err(e);
        }
        self.devices.insert(
            ordinal,
            Device {
                handle,
                context,
                streams,
            },
        );
        Ok(())
    }

    fn close_device(&mut self, ordinal: Ordinal) {
        self.close(ordinal);
    }

    fn pin_host(
        &mut self,
        device: Ordinal,
        base: u64,
        len: u64,
        read_only: bool,
    ) -> Result<Pinned> {
        let (_, _bound) = self.bind(device, "cuMemHostRegister")?;
        let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: the caller (register_host_pool's contract) keeps
        // base..base+len mapped until `unpin_host`.
        let code = unsafe { sys::cuMemHostRegister_v2(base as *mut c_void, len as usize, flags) };
        match code {
            sys::CUresult::CUDA_SUCCESS => Ok(Pinned::ByUs),
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => Ok(Pinned::AlreadyPinned),
            other => Err(error(other, "cuMemHostRegister")),
        }
    }

    fn unpin_host(&mut self, device: Ordinal, base: u64) -> Result<()> {
        let (_, _bound) = self.bind(device, "cuMemHostUnregister")?;
        // SAFETY: `base` is what `pin_host` registered; no copy uses it.
        check(
            unsafe { sys::cuMemHostUnregister(base as *mut c_void) },
            "cuMemHostUnregister",
        )
    }

    fn allocation(&mut self, device: Ordinal, ptr: u64) -> Result<Option<Allocation>> {
        let (d, _bound) = self.bind(device, "cuPointerGetAttribute")?;
        let primary = d.context;
        let attribute = |out: *mut c_void, which| {
            // SAFETY: `out` points at storage of the attribute's size
            // (unsigned int for MEMORY_TYPE and IS_MANAGED, int for
            // DEVICE_ORDINAL, a CUcontext for CONTEXT).
            unsafe { sys::cuPointerGetAttribute(out, which, ptr) }
        };
        let mut memory_type: u32 = 0;
        match attribute(
            (&raw mut memory_type).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        ) {
            sys::CUresult::CUDA_SUCCESS => {}
            // Not memory CUDA knows about (plain host memory).
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(None),
            other => return Err(error(other, "cuPointerGetAttribute(MEMORY_TYPE)")),
        }
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(None);
        }
        let mut managed: u32 = 0;
        check(
            attribute(
                (&raw mut managed).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            ),
            "cuPointerGetAttribute(IS_MANAGED)",
        )?;
        if managed != 0 {
            // Managed memory migrates; a region must stay on its device.
            return Ok(None);
        }
        let mut ordinal: i32 = -1;
        check(
            attribute(
                (&raw mut ordinal).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ),
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
        )?;
        let mut context: sys::CUcontext = ptr::null_mut();
        check(
            attribute(
                (&raw mut context).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            ),
            "cuPointerGetAttribute(CONTEXT)",
        )?;
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes the base and size of the allocation `ptr` is in.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) },
            "cuMemGetAddressRange",
        )?;
        Ok(Some(Allocation {
            base,
            len: len as u64,
            device: ordinal,
            primary_context: context.is_null() || context == primary,
        }))
    }

    fn create_event(&mut self, device: Ordinal) -> Result<EventId> {
        let (_, _bound) = self.bind(device, "cuEventCreate")?;
        let mut ev: sys::CUevent = ptr::null_mut();
        // SAFETY: writes one handle. Timing off: cheaper records and
        // queries, and we never time with these.
        check(
            unsafe {
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(EventId(ev as usize as u64))
    }

    fn destroy_event(&mut self, device: Ordinal, id: EventId) {
        if let Ok((_, _bound)) = self.bind(device, "cuEventDestroy") {
            // SAFETY: an event `create_event` made; the executor forgets
            // the id after this.
            let _ = unsafe { sys::cuEventDestroy_v2(event(id)) };
        }
    }

    fn enqueue(
        &mut self,
        device: Ordinal,
        direction: Direction,
        runs: &[Run],
        api: CopyApi,
    ) -> std::result::Result<(), EnqueueError> {
        let (stream, bound) = match self.bind(device, "cuMemcpyAsync") {
            Ok((d, bound)) => (d.stream(direction), bound),
            Err(error) => return Err(EnqueueError { enqueued: 0, error }),
        };
        let result = match api {
            CopyApi::Batch if self.info.batch_api => {
                self.enqueue_batch(device, stream, direction, runs)
            }
            _ => Self::enqueue_per_run(stream, direction, runs),
        };
        drop(bound);
        result
    }

    fn record(&mut self, device: Ordinal, direction: Direction, id: EventId) -> Result<()> {
        let (d, _bound) = self.bind(device, "cuEventRecord")?;
        // SAFETY: our event and stream, same context.
        check(
            unsafe { sys::cuEventRecord(event(id), d.stream(direction)) },
            "cuEventRecord",
        )
    }

    fn query(&mut self, device: Ordinal, id: EventId) -> Result<bool> {
        let (_, _bound) = self.bind(device, "cuEventQuery")?;
        // SAFETY: our event; never blocks.
        match unsafe { sys::cuEventQuery(event(id)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(error(other, "cuEventQuery")),
        }
    }

    fn synchronize(&mut self, device: Ordinal) -> Result<()> {
        let (d, _bound) = self.bind(device, "cuStreamSynchronize")?;
        for stream in d.streams {
            // SAFETY: our stream.
            check(
                unsafe { sys::cuStreamSynchronize(stream) },
                "cuStreamSynchronize",
            )?;
        }
        Ok(())
    }

    fn stream_wait(&mut self, device: Ordinal, id: EventId, stream: u64) -> Result<()> {
        let (_, _bound) = self.bind(device, "cuStreamWaitEvent")?;
        // SAFETY: `stream` is a live CUstream of the caller's (the caller's
        // contract); the wait captures the event's current record, so the
        // event may be reused once it completes.
        check(
            unsafe { sys::cuStreamWaitEvent(stream as usize as sys::CUstream, event(id), 0) },
            "cuStreamWaitEvent",
        )
    }
}
