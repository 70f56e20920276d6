//! The driver seam: every CUDA call the executor makes goes through
//! [`Driver`], so the batching logic above it (runs, events, bounds, error
//! mapping, the fallback decision) is tested on a fake that records calls and
//! completes events on command. [`super::real::CudaDriver`] is the one
//! implementation over the CUDA driver API.

use crate::Direction;

/// A CUDA device ordinal, as the process sees it (after
/// `CUDA_VISIBLE_DEVICES`).
pub type Ordinal = i32;

/// An event created on one device's context; opaque outside the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct EventId(pub u64);

/// One contiguous copy, in absolute addresses: `host` is a pointer into the
/// pinned pool, `device` a device pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub host: u64,
    pub device: u64,
    pub len: u64,
}

/// What the driver knows about the allocation a device pointer lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub base: u64,
    pub len: u64,
    pub device: Ordinal,
    /// The allocation belongs to the device's primary context (the one the
    /// engine's PyTorch uses and our streams run on), or to none (virtual
    /// memory management mappings). Memory of another context is not
    /// addressable from our streams.
    pub primary_context: bool,
}

/// How host memory ended up page-locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pinned {
    /// We registered it and unregister it when done.
    ByUs,
    /// Someone else in the process had already registered it (the driver
    /// said `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`); we leave it alone.
    AlreadyPinned,
}

/// What the loaded driver offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8.
    pub version: i32,
    pub devices: i32,
    /// The driver exports `cuMemcpyBatchAsync` (12.8 and later).
    pub batch_api: bool,
}

/// A failed driver call: which call, the `CUresult` code and its name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code})")]
pub struct DriverError {
    pub call: &'static str,
    pub code: u32,
    pub name: String,
}

impl DriverError {
    /// Errors after which the context (or the whole device) can no longer
    /// be used: CUDA makes them sticky, every later call on the context
    /// fails, and no copy on it will run. The executor treats the device
    /// as lost.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self.code,
            3 // NOT_INITIALIZED
            | 4 // DEINITIALIZED
            | 46 // DEVICE_UNAVAILABLE
            | 100 // NO_DEVICE
            | 201 // INVALID_CONTEXT
            | 214 // ECC_UNCORRECTABLE
            | 220 // NVLINK_UNCORRECTABLE
            | 700 // ILLEGAL_ADDRESS
            | 702 // LAUNCH_TIMEOUT
            | 709 // CONTEXT_IS_DESTROYED
            | 714 // HARDWARE_STACK_ERROR
            | 715 // ILLEGAL_INSTRUCTION
            | 716 // MISALIGNED_ADDRESS
            | 717 // INVALID_ADDRESS_SPACE
            | 718 // INVALID_PC
            | 719 // LAUNCH_FAILED
            | 999 // UNKNOWN
        )
    }
}

/// An enqueue that stopped part-way: runs before `enqueued` may be on the
/// stream already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EnqueueError {
    pub enqueued: usize,
    pub error: DriverError,
}

/// Which call moves the runs of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyApi {
    /// One `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync` per run.
    PerRun,
    /// `cuMemcpyBatchAsync`, chunks of at most `max_runs_per_call` runs.
    Batch,
}

/// Every driver call the executor makes. Each device has two dedicated
/// non-blocking streams, one per [`Direction`] (so restores and publishes
/// use both copy engines at once), created by `open_device`; copies and
/// event records go on their direction's stream in call order, so events of
/// one stream complete in the order recorded.
pub(crate) trait Driver: Send {
    fn info(&self) -> DriverInfo;

    /// Makes the device usable: its context, its streams. Idempotent.
    fn open_device(&mut self, device: Ordinal) -> Result<(), DriverError>;

    /// Destroys the device's streams and releases its context. Best effort:
    /// called on drop, after `synchronize`.
    fn close_device(&mut self, device: Ordinal);

    /// Page-locks `base..base+len` for every context (portable).
    fn pin_host(
        &mut self,
        device: Ordinal,
        base: u64,
        len: u64,
        read_only: bool,
    ) -> Result<Pinned, DriverError>;

    fn unpin_host(&mut self, device: Ordinal, base: u64) -> Result<(), DriverError>;

    /// The allocation `ptr` lies in; `None` when `ptr` is not device
    /// memory (host, managed, or unknown to CUDA).
    fn allocation(&mut self, device: Ordinal, ptr: u64) -> Result<Option<Allocation>, DriverError>;

    fn create_event(&mut self, device: Ordinal) -> Result<EventId, DriverError>;

    fn destroy_event(&mut self, device: Ordinal, event: EventId);

    /// Queues `runs` on the device's `direction` stream, in order.
    fn enqueue(
        &mut self,
        device: Ordinal,
        direction: Direction,
        runs: &[Run],
        api: CopyApi,
    ) -> Result<(), EnqueueError>;

    /// Records `event` on the device's `direction` stream: it completes when
    /// everything queued there before it has.
    fn record(
        &mut self,
        device: Ordinal,
        direction: Direction,
        event: EventId,
    ) -> Result<(), DriverError>;

    /// `Ok(true)` once the work before the event's last record finished.
    /// Never blocks.
    fn query(&mut self, device: Ordinal, event: EventId) -> Result<bool, DriverError>;

    /// Blocks until both of the device's streams are idle. Only on error paths,
    /// fencing and drop: never on the copy path.
    fn synchronize(&mut self, device: Ordinal) -> Result<(), DriverError>;

    /// Makes work queued later on `stream` (another party's raw `CUstream`,
    /// e.g. PyTorch's current stream) wait for `event`, without blocking the
    /// host.
    fn stream_wait(
        &mut self,
        device: Ordinal,
        event: EventId,
        stream: u64,
    ) -> Result<(), DriverError>;
}
