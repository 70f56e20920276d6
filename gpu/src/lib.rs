//! Device copy engines: move pages between the host pool and engine device
//! memory, asynchronously.
//!
//! [`CopyEngine`] is the one interface. Backends:
//! - [`host::HostCopyEngine`]: the "device" is host memory; copies run on
//!   worker threads and complete through tokens. Used where no GPU exists.
//! - [`sim::SimCopyEngine`]: deterministic; a copy completes after a set
//!   number of simulated microseconds. Used by replays and runtime tests.
//! - [`cuda::CudaCopyEngine`]: CUDA memory an engine process lends, through
//!   the CUDA driver (cudarc, loaded at run time); [`cuda::best_engine`]
//!   falls back to the host engine where CUDA is unavailable.
//!
//! The trait never assumes synchronous completion: `submit` returns a token,
//! and only `poll` reports that the bytes landed.
//!
//! # Codemap
//!
//! - `lib.rs`: `CopyEngine` (register device region, register host pool or
//!   a host window of `HostSpan`s with their own access,
//!   `submit` → `CompletionToken`, `poll`, `wait`: sleep until a batch
//!   lands, for engines that can), `PageCopy` (a restore's carries
//!   `expect_checksum`; `sum: SumOf` says whether its reported checksum is of
//!   what landed or of the source, a page's chunks chained), `Completion`
//!   (with those checksums), `CopyError` (`Checksum` for a restore whose
//!   bytes do not match), `check_bounds`, `copy_and_checksum` (hashes
//!   exactly what lands), `copy_hashing_source` (each source chunk hashed
//!   right after it is read); both are `orbitkv_components::checksum`'s
//!   fused copies, which stream copies of 256 KiB and more past the cache
//!   (AVX2 non-temporal stores, fenced before the copy reports). Nothing
//!   assumes synchronous completion.
//! - `host.rs`: `HostCopyEngine`, worker threads; the "device" is host memory
//!   in a `DeviceArena`.
//! - `agent.rs`: `CopyAgent`, the engine-process side of a copy: `attach`
//!   registers engine memory as a region laid out as `Chunk`s per page (a
//!   run of `len` bytes every `stride`, e.g. each layer's K and V block),
//!   `handle` takes an `Event::AgentCopy`, checks every page against its own
//!   regions, the pool and the staging area (`CopyFailure` otherwise) and
//!   submits it to any `CopyEngine` (the executor); `poll` turns completions
//!   into `Command::CopyDone`; `drain` waits for running copies (a lost
//!   connection). `HostWindow`: the pool mapped read-only and the origin's
//!   staging area writable, side by side in one reservation, registered as
//!   two `HostSpan`s (a CUDA executor pins the pool read-only and the staging
//!   area writable); a publish can only write the staging part.
//!   `executor_for(MemoryKind)`: the host engine for host memory, the CUDA
//!   engine for CUDA memory or `AgentError::CudaUnavailable` (never the host
//!   engine for a device pointer). `attach_layered`: a layer per chunk; a
//!   restore then goes out as one executor batch per layer, in layer order,
//!   and `layer_counts` counts per layer the pages landed or failed (vLLM's
//!   layer-wise loads). Restores' pool pages are verified against their
//!   checksums: in the copy's own pass where the executor
//!   `verifies_source_chains` (the host engine, whole pages), else before
//!   anything is submitted. Invariant: a copy is reported once, after its
//!   last part completed.
//! - `sim.rs`: `SimCopyEngine`, deterministic completion at a modelled time,
//!   with fault hooks (`fail_next`, `hold`, `delay_all`).
//! - `cuda/`: `CudaCopyEngine` (`docs/gpu.md`), always compiled (cudarc,
//!   driver API loaded at run time). `mod.rs`: `CudaConfig` (every bound),
//!   `best_engine` (CUDA, else the host engine and an `Unavailable` reason),
//!   `TokenState` (`query`), `stream_wait`, `CudaStats`. `driver.rs`: the
//!   `Driver` seam, every CUDA call the executor makes; `DriverError::is_fatal`
//!   (sticky errors = device lost). `exec.rs`: `Executor<D: Driver>`, the
//!   logic: pool pinning, region validation against its allocation, batch
//!   validation, restores' source checksums verified before queueing
//!   (`verify_sources`), `runs.rs` coalescing, two streams per device (one per
//!   direction), events polled in stream order, in-flight bound, fencing
//!   `unregister`, error mapping. `real.rs`: `CudaDriver` and `probe` (the only
//!   engine code calling CUDA; `is_culib_present` first). `testing.rs`:
//!   `DeviceMemory`, `PinnedHost`, `raw_copy_seconds` for GPU tests and
//!   benchmarks. `fake.rs`/`tests.rs`: the fake driver and the unit tests.
//!   Invariants: a batch is refused whole or queued whole; a completion is
//!   reported only when nothing of its batch can still be copying; events are
//!   created at device open, never on the copy path; nothing blocks the host
//!   on the copy path.

pub mod agent;
pub mod cuda;
pub mod host;
pub mod sim;

/// A registered device region (one engine KV pool per rank and group).
pub type RegionId = u32;

/// Identifies one submitted batch until `poll` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CompletionToken(pub u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Restore: host pool → device.
    HostToDevice,
    /// Publish: device → host pool.
    DeviceToHost,
}

/// One contiguous copy between the host pool and a device region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// Byte offset into the registered host pool.
    pub host_offset: u64,
    pub region: RegionId,
    /// Byte offset into the device region.
    pub device_offset: u64,
    pub len: u64,
    /// Host → device: the checksum the source page carries since its bytes
    /// landed. The bytes delivered are hashed in the copy's pass and a
    /// mismatch fails the batch ([`CopyError::Checksum`]): a page altered
    /// in memory is never handed back.
    pub expect_checksum: Option<u64>,
    /// What the checksum reported for this copy covers: its destination
    /// bytes (the default), or its source bytes, alone or after the
    /// previous copy's (a page made of several chunks).
    pub sum: SumOf,
}

/// What a copy's reported checksum covers ([`PageCopy::sum`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SumOf {
    /// The bytes that landed (the runtime's own copies: a page carries the
    /// checksum of what is in the pool).
    #[default]
    Destination,
    /// The source bytes, starting a page: a copy agent's publish, whose
    /// checksum is the end-to-end one from the engine's own memory.
    SourceStart,
    /// The source bytes, continuing the previous copy's page (the same
    /// batch, next in order): the reported checksum covers the page so far.
    SourceContinue,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("no host pool is registered")]
    NoHostPool,
    #[error("unknown device region {0}")]
    UnknownRegion(RegionId),
    #[error("copy [{offset}, +{len}) is outside the {what} ({size} bytes)")]
    OutOfBounds {
        what: &'static str,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("copy batch is empty")]
    EmptyBatch,
    #[error("{0} batches in flight; the limit is {1}")]
    QueueFull(usize, usize),
    #[error("device region of {0} bytes cannot be registered: {1}")]
    RegionRejected(u64, String),
    #[error("copy failed: {0}")]
    Failed(String),
    #[error("the page at host offset {host_offset} does not match its checksum")]
    Checksum { host_offset: u64 },
}

/// Memory an engine process owns and lends to its copy agent as a device
/// region. The agent never frees it; the engine keeps it alive until the
/// region is unregistered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalMemory {
    /// Host memory (CPU tensors of a CPU engine, or an engine's host pool).
    Host { base: *mut u8, len: u64 },
    /// A CUDA allocation: device pointer, size and device ordinal (from
    /// `tensor.data_ptr()` in the bridge).
    Cuda { device: i32, ptr: u64, len: u64 },
}

impl ExternalMemory {
    pub fn len(&self) -> u64 {
        match *self {
            ExternalMemory::Host { len, .. } | ExternalMemory::Cuda { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Part of a host window ([`CopyEngine::register_host_window`]):
/// `[offset, offset + len)` from the window's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSpan {
    pub offset: u64,
    pub len: u64,
    /// Device → host copies may write it (false: mapped read-only).
    pub writable: bool,
}

/// A finished batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub token: CompletionToken,
    pub result: Result<(), CopyError>,
    /// On success, the [`page_checksum`] of each copy's destination bytes,
    /// in batch order, computed in the copy's pass (a publish's pages carry
    /// it from here on; nothing hashes them again).
    pub checksums: Vec<u64>,
}

/// The page checksum, XXH3-64 (seed 0), streamed here chunk by chunk right
/// behind the copy, while the bytes are in cache.
pub use orbitkv_components::checksum::{PageHasher, page_checksum};

/// Copies `len` bytes from `src` to `dst`, hashing each source chunk right
/// after it was read (still in cache) into `h`: one pass over the source.
/// Long copies stream their writes past the cache
/// (`orbitkv_components::checksum::copy_hashing_read`).
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and must not overlap.
pub unsafe fn copy_hashing_source(src: *const u8, dst: *mut u8, len: usize, h: &mut PageHasher) {
    // SAFETY: the caller's contract.
    unsafe { orbitkv_components::checksum::copy_hashing_read(src, dst, len, h) }
}

/// Copies `len` bytes from `src` to `dst`, hashing what lands chunk by
/// chunk; returns the XXH3-64 of all of `dst`
/// (`orbitkv_components::checksum::copy_hashing_written`).
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and must not overlap.
pub unsafe fn copy_and_checksum(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    let mut h = PageHasher::new();
    // SAFETY: the caller's contract.
    unsafe { orbitkv_components::checksum::copy_hashing_written(src, dst, len, &mut h) };
    h.digest()
}

/// Asynchronous page copies between the host pool and device regions.
pub trait CopyEngine: Send {
    /// Short backend name for reports (`host`, `sim`, `cuda`).
    fn name(&self) -> &'static str;

    /// Whether a batch's `expect_checksum` is checked against a chain of
    /// source-hashed copies (`SumOf::SourceStart` then `SourceContinue`,
    /// the expectation on the chain's last copy) in the copy's own pass.
    /// A copy agent then verifies a restored page while copying it, not in
    /// a pass of its own before.
    fn verifies_source_chains(&self) -> bool {
        false
    }

    /// Registers a device region of `bytes` bytes. The host and simulated
    /// backends allocate it themselves.
    fn register_device_region(&mut self, bytes: u64) -> Result<RegionId, CopyError>;

    /// Registers memory the engine process owns (a copy agent's regions).
    /// Backends that cannot address that kind of memory refuse it.
    ///
    /// # Safety
    /// The memory must stay valid and unmoved until the region is
    /// unregistered and every copy submitted against it has completed.
    unsafe fn attach_region(&mut self, memory: ExternalMemory) -> Result<RegionId, CopyError> {
        Err(CopyError::RegionRejected(
            memory.len(),
            format!("the {} copy engine cannot attach {memory:?}", self.name()),
        ))
    }

    /// Forgets a region (its session closed). Copies already submitted
    /// finish; later ones get `UnknownRegion`.
    fn unregister_device_region(&mut self, region: RegionId) -> Result<(), CopyError>;

    /// Registers the host pool every `host_offset` is relative to.
    ///
    /// # Safety
    /// `base..base+len` must stay valid, and must not be moved or unmapped,
    /// until the engine is dropped. The caller must not touch a byte range
    /// while a submitted copy covers it (the runtime's Transfer entities and
    /// leases guarantee this).
    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), CopyError>;

    /// Registers a host range made of spans with their own access (a copy
    /// agent's window: the pool mapped read-only, the staging area
    /// writable), every `host_offset` relative to `base`. A backend that
    /// page-locks host memory pins each span with its access and copies only
    /// inside them (device → host only into writable spans); the others
    /// treat the whole range as one pool.
    ///
    /// # Safety
    /// As for [`CopyEngine::register_host_pool`], for every span.
    unsafe fn register_host_window(
        &mut self,
        base: *mut u8,
        len: u64,
        spans: &[HostSpan],
    ) -> Result<(), CopyError> {
        let _ = spans;
        // SAFETY: forwarded from this method's contract.
        unsafe { self.register_host_pool(base, len) }
    }

    /// Validates and submits one batch. Bounds are checked here, so a bad
    /// copy is a typed error and nothing of the batch is started.
    fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
        now_us: u64,
    ) -> Result<CompletionToken, CopyError>;

    /// Appends finished batches to `out`; never blocks.
    fn poll(&mut self, now_us: u64, out: &mut Vec<Completion>);

    /// Batches submitted and not yet reported by `poll`.
    fn in_flight(&self) -> usize;

    /// Blocks until a batch in flight finishes or `timeout` passes; `true`
    /// if one did (the next `poll` reports it). An engine that cannot
    /// block answers `false` at once and its caller polls. Lets a host loop
    /// with nothing but copies to wait for sleep instead of spinning on
    /// cores the copies need.
    fn wait(&mut self, _timeout: std::time::Duration) -> bool {
        false
    }

    /// A descriptor for a region's memory, for the engine process that owns
    /// it, when the backend keeps regions in shared memory.
    fn export_region(&self, _region: RegionId) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// Checks one copy against the pool and region sizes.
pub fn check_bounds(copy: &PageCopy, host_len: u64, region_len: u64) -> Result<(), CopyError> {
    let oob = |what, offset: u64, size| CopyError::OutOfBounds {
        what,
        offset,
        len: copy.len,
        size,
    };
    if copy
        .host_offset
        .checked_add(copy.len)
        .is_none_or(|end| end > host_len)
    {
        return Err(oob("host pool", copy.host_offset, host_len));
    }
    if copy
        .device_offset
        .checked_add(copy.len)
        .is_none_or(|end| end > region_len)
    {
        return Err(oob("device region", copy.device_offset, region_len));
    }
    Ok(())
}
