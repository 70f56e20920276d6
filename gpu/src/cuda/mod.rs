//! The CUDA copy engine: page copies between the pinned host pool and CUDA
//! memory an engine process lends (`ExternalMemory::Cuda`), on the CUDA
//! driver API through cudarc, loaded at run time.
//!
//! Always compiled: with dynamic loading nothing CUDA is needed to build,
//! and [`best_engine`] tries CUDA at run time, falling back to the host
//! engine with a logged reason ([`Unavailable`]) where there is no driver or
//! no device. Design and guarantees: `docs/gpu.md`.
//!
//! - The host pool is page-locked with `cuMemHostRegister` (portable) when
//!   registered and unregistered when the engine drops.
//! - A region is a device pointer, size and ordinal, validated against the
//!   allocation it lies in (`cuPointerGetAttribute`,
//!   `cuMemGetAddressRange`).
//! - Each device has two dedicated non-blocking streams, one per direction.
//!   A batch is coalesced into contiguous runs and queued with
//!   `cuMemcpyBatchAsync` where the driver exports it, else one async copy
//!   per run; one event recorded after it says it landed. `poll` queries
//!   events and never blocks.
//! - A driver error fails the batch (the runtime keeps ownership of every
//!   page it named); a fatal one marks the device lost.
//!
//! Every driver call goes through [`driver::Driver`], so the logic in
//! `exec.rs` is tested on a fake driver (`tests.rs`); `real.rs` is the only
//! engine code that calls CUDA (`testing.rs` allocates device memory for
//! GPU tests and benchmarks).

pub mod driver;
mod exec;
#[cfg(test)]
mod fake;
mod real;
mod runs;
pub mod testing;
#[cfg(test)]
mod tests;

pub use driver::{CopyApi, DriverError, DriverInfo, Ordinal};
pub use real::probe;

use crate::host::{HostCopyConfig, HostCopyEngine};
use crate::{Completion, CompletionToken, CopyEngine, CopyError, Direction, PageCopy, RegionId};
use exec::Executor;
use real::CudaDriver;

/// Every bound and choice of the CUDA engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaConfig {
    /// Try CUDA at all (`false` makes [`best_engine`] pick the host engine).
    pub enabled: bool,
    /// The device whose context pins the host pool (ordinal after
    /// `CUDA_VISIBLE_DEVICES`; an engine worker usually sees one device,
    /// 0). Other devices open when a region on them is attached.
    pub home_device: Ordinal,
    /// Batches submitted and not yet reported by `poll`; beyond it
    /// `submit` returns `QueueFull`. Also the number of events created per
    /// device.
    pub max_in_flight_batches: usize,
    /// Runs per `cuMemcpyBatchAsync` call (bounds its argument arrays).
    pub max_runs_per_call: usize,
    /// Use `cuMemcpyBatchAsync` when the driver has it (12.8+).
    pub prefer_batch_api: bool,
    /// Register the pool read-only (`CU_MEMHOSTREGISTER_READ_ONLY`), for a
    /// pool mapped without write access; device → host copies are then
    /// refused.
    pub host_read_only: bool,
    /// How long `unregister_device_region` waits for copies still in
    /// flight against the region before it reports that they are.
    pub unregister_wait_ms: u64,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            home_device: 0,
            max_in_flight_batches: 64,
            max_runs_per_call: 4096,
            prefer_batch_api: true,
            host_read_only: false,
            unregister_wait_ms: 10_000,
        }
    }
}

/// Why CUDA is not used; logged, and returned by [`best_engine`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("CUDA is disabled by configuration")]
    Disabled,
    #[error("the CUDA driver library (libcuda) is not installed")]
    NoDriver,
    #[error("the CUDA driver failed to initialise: {0}")]
    Init(DriverError),
    #[error("no CUDA device is visible")]
    NoDevice,
    #[error("CUDA device {device} does not exist ({count} visible)")]
    DeviceMissing { device: Ordinal, count: i32 },
}

impl Unavailable {
    fn from_init(e: Unavailable) -> Unavailable {
        match e {
            // cuInit says NO_DEVICE when the driver is there and no GPU is.
            Unavailable::Init(DriverError { code: 100, .. }) => Unavailable::NoDevice,
            other => other,
        }
    }
}

/// Where one batch stands, without waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenState {
    /// Its copies are queued or running.
    Pending,
    /// Finished; `poll` has not reported it yet (and will).
    Done(Result<(), CopyError>),
    /// Never issued, or already reported by `poll`.
    Unknown,
}

/// Counters since the engine opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaStats {
    pub batches: u64,
    /// Page copies submitted.
    pub copies: u64,
    /// Contiguous runs after coalescing.
    pub runs: u64,
    /// Driver copy calls (one per run, or one per batch call).
    pub driver_calls: u64,
    pub bytes_to_device: u64,
    pub bytes_to_host: u64,
    pub failed_batches: u64,
    pub devices_lost: u64,
}

/// The CUDA copy engine over the real driver.
pub struct CudaCopyEngine {
    exec: Executor<CudaDriver>,
}

impl CudaCopyEngine {
    /// Loads the driver, opens the home device (stream, events). Never
    /// panics for lack of CUDA: that is an [`Unavailable`].
    pub fn open(config: CudaConfig) -> Result<Self, Unavailable> {
        if !config.enabled {
            return Err(Unavailable::Disabled);
        }
        let driver = CudaDriver::load(config.max_runs_per_call).map_err(Unavailable::from_init)?;
        let exec = Executor::open(driver, config).map_err(Unavailable::from_init)?;
        Ok(Self { exec })
    }

    pub fn info(&self) -> DriverInfo {
        self.exec.info()
    }

    /// The copy call in use.
    pub fn copy_api(&self) -> CopyApi {
        self.exec.copy_api()
    }

    pub fn stats(&self) -> CudaStats {
        self.exec.stats()
    }

    /// Where `token`'s batch stands; never blocks. A layer-wise loader
    /// submits one batch per layer and checks (or spins on) that layer's
    /// token only.
    pub fn query(&mut self, token: CompletionToken) -> TokenState {
        self.exec.query(token)
    }

    /// Makes work queued later on `stream` (a raw `CUstream`, e.g.
    /// `torch.cuda.current_stream().cuda_stream`) wait on the GPU until
    /// `token`'s copies landed: the host does not block. Errs when the
    /// batch already failed (or is unknown): then the caller must not use
    /// the pages.
    ///
    /// # Safety
    /// `stream` must be a live stream of a context on the batch's device.
    pub unsafe fn stream_wait(
        &mut self,
        token: CompletionToken,
        stream: u64,
    ) -> Result<(), CopyError> {
        self.exec.stream_wait(token, stream)
    }
}

impl CopyEngine for CudaCopyEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// The CUDA engine copies to memory an engine process owns; it never
    /// allocates regions itself.
    fn register_device_region(&mut self, bytes: u64) -> Result<RegionId, CopyError> {
        Err(CopyError::RegionRejected(
            bytes,
            "the cuda copy engine only attaches engine-owned CUDA memory (attach_region)".into(),
        ))
    }

    unsafe fn attach_region(
        &mut self,
        memory: crate::ExternalMemory,
    ) -> Result<RegionId, CopyError> {
        self.exec.attach(memory)
    }

    /// Refuses new copies against the region at once and waits (bounded by
    /// `unregister_wait_ms`) until the ones in flight finished: on `Ok`,
    /// nothing copies to or from the region's memory any more and the
    /// engine may free it.
    fn unregister_device_region(&mut self, region: RegionId) -> Result<(), CopyError> {
        self.exec.unregister(region)
    }

    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), CopyError> {
        self.exec.register_host_pool(base as u64, len)
    }

    /// Pins each span with its own access: a copy agent's pool (mapped
    /// read-only) with `CU_MEMHOSTREGISTER_READ_ONLY`, its staging area
    /// writable. Copies must lie inside one span; device → host copies
    /// only in a writable one.
    unsafe fn register_host_window(
        &mut self,
        base: *mut u8,
        len: u64,
        spans: &[crate::HostSpan],
    ) -> Result<(), CopyError> {
        self.exec.register_host_window(base as u64, len, spans)
    }

    fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
        _now_us: u64,
    ) -> Result<CompletionToken, CopyError> {
        self.exec.submit(direction, copies)
    }

    fn poll(&mut self, _now_us: u64, out: &mut Vec<Completion>) {
        self.exec.poll(out)
    }

    fn in_flight(&self) -> usize {
        self.exec.in_flight()
    }
}

/// The CUDA engine if this process can use one, else the host engine and
/// why not (also logged at `warn`).
pub fn best_engine(
    cuda: CudaConfig,
    host: HostCopyConfig,
) -> (Box<dyn CopyEngine>, Option<Unavailable>) {
    choose(CudaCopyEngine::open(cuda), host)
}

fn choose<E: CopyEngine + 'static>(
    opened: Result<E, Unavailable>,
    host: HostCopyConfig,
) -> (Box<dyn CopyEngine>, Option<Unavailable>) {
    match opened {
        Ok(engine) => (Box::new(engine), None),
        Err(reason) => {
            tracing::warn!(%reason, "CUDA copy engine unavailable; using the host copy engine");
            (Box::new(HostCopyEngine::new(host)), Some(reason))
        }
    }
}
