//! The copy agent: the part of an engine process that touches engine
//! memory on the runtime's instruction.
//!
//! The runtime never maps an engine's KV memory. The engine registers it
//! here ([`CopyAgent::attach`]: one region per (rank, group), each page
//! laid out as chunks, e.g. every layer's K and V block of vLLM), and
//! registers the region with the runtime as agent-owned. The runtime sends
//! [`Event::AgentCopy`] batches (pool or staging offsets, region offsets,
//! lengths); [`CopyAgent::execute`] checks every page against the agent's
//! own memory and submits it to the executor (any [`CopyEngine`]: host
//! memcpy workers for host memory, the CUDA engine for CUDA memory, see
//! [`executor_for`]), and [`CopyAgent::poll`] turns
//! completions into [`Command::CopyDone`]s to submit back.
//!
//! Host memory the executor sees is one [`HostWindow`]: the runtime's pool
//! mapped **read-only** followed by the origin's staging area (writable).
//! Restores read the pool part; publishes write only the staging part, and
//! a copy that would write the pool is refused before it starts (and the
//! mapping would fault anyway).
//!
//! Layer-wise restores: a region attached with a layer per chunk
//! ([`CopyAgent::attach_layered`]) has each restore split into one executor
//! batch per layer, submitted in layer order, and counts per layer the
//! pages whose bytes landed or failed ([`CopyAgent::layer_counts`]), so an
//! engine can start a layer's compute once that layer's copies landed while
//! later layers still copy. The copy is reported (`CopyDone`) once all its
//! layers are done; one failed layer fails it.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;

use orbitkv_components::api::{AgentDirection, AgentPageCopy, Command, CopyFailure, Event};

use crate::cuda::{CudaConfig, CudaCopyEngine, Unavailable};
use crate::host::{HostCopyConfig, HostCopyEngine};
use crate::{
    Completion, CompletionToken, CopyEngine, CopyError, Direction, ExternalMemory, HostSpan,
    PageCopy, RegionId,
};

/// What memory a chunk lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    Host,
    Cuda { device: i32 },
}

/// One run of a page's bytes in engine memory: slot `s`'s run starts at
/// `ptr + s * stride` and is `len` bytes. A page is its chunks' runs,
/// concatenated in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub kind: MemoryKind,
    pub ptr: u64,
    pub stride: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("region layout: {0}")]
    Layout(String),
    #[error("executor: {0}")]
    Executor(#[from] CopyError),
    #[error("host window: {0}")]
    Window(String),
    #[error("too many agent regions")]
    TooManyRegions,
    /// CUDA memory was offered and this process cannot copy to it: never
    /// a host memcpy on a device pointer.
    #[error(
        "agent memory on cuda:{device} needs the CUDA copy engine, which is unavailable: {reason}"
    )]
    CudaUnavailable { device: i32, reason: Unavailable },
}

/// The executor for an agent whose memory is of `kind`: the host engine
/// (memcpy workers) for host memory; for CUDA memory the CUDA engine with
/// `kind`'s device as its home (the one whose context pins the host
/// window), or [`AgentError::CudaUnavailable`] where this process cannot
/// use CUDA (no libcuda, no such device). There is no fallback for CUDA
/// memory: the host engine cannot address it.
pub fn executor_for(
    kind: MemoryKind,
    host: HostCopyConfig,
    cuda: CudaConfig,
) -> Result<Box<dyn CopyEngine>, AgentError> {
    match kind {
        MemoryKind::Host => Ok(Box::new(HostCopyEngine::new(host))),
        MemoryKind::Cuda { device } => CudaCopyEngine::open(CudaConfig {
            home_device: device,
            ..cuda
        })
        .map(|e| Box::new(e) as Box<dyn CopyEngine>)
        .map_err(|reason| AgentError::CudaUnavailable { device, reason }),
    }
}

/// Pages of one layer of one region that landed or failed, counted since
/// the region was attached (restores only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerCount {
    pub landed: u64,
    pub failed: u64,
}

/// A layer's part of a restore: (agent region, layer, pages).
type LayerPart = (u32, u32, u64);

/// One executor batch of a copy: the whole copy, or one layer of it.
struct Part {
    copy: u64,
    direction: Direction,
    copies: Vec<PageCopy>,
    layer: Option<LayerPart>,
    /// A publish's pages, in order: what their checksums are taken from.
    pages: Vec<StagedPage>,
    /// A restore's pages the executor verifies as it copies them: each
    /// page's range in the executor's host window and its pool offset, to
    /// name the page whose checksum failed.
    verified: Vec<(u64, u64, u64)>,
}

/// One page a publish writes into the staging area.
#[derive(Debug, Clone, Copy)]
struct StagedPage {
    /// Its last copy in the part: the executor's checksum of that copy,
    /// hashed from the source, covers the whole page.
    last: usize,
    /// Where it lands in the window, and its length.
    at: u64,
    len: u64,
}

/// A running part: its copy, layer and pages.
struct Running {
    copy: u64,
    layer: Option<LayerPart>,
    pages: Vec<StagedPage>,
    verified: Vec<(u64, u64, u64)>,
    copies: usize,
}

/// A copy whose parts are not all done.
struct CopyState {
    parts: usize,
    failure: Option<CopyFailure>,
    /// A publish's page checksums, from the agent's source memory.
    checksums: Vec<u64>,
}

/// An attached region: its page size and where each chunk lives.
#[derive(Debug, Clone)]
struct Region {
    slots: u32,
    page_bytes: u64,
    /// (executor region, offset of the chunk in the page, stride, len,
    /// layer).
    chunks: Vec<(RegionId, u64, u64, u64, Option<u32>)>,
    /// Per layer, for a region attached with layers.
    layers: Vec<LayerCount>,
}

/// The runtime's pool (read-only) and the origin's staging area (writable),
/// mapped side by side in one address range.
pub struct HostWindow {
    base: *mut u8,
    len: usize,
    pool_len: u64,
    /// Where the staging area starts in the window (the pool length
    /// rounded up to the OS page size).
    staging_at: u64,
    staging_len: u64,
}

// SAFETY: the window is a private mapping this value owns until drop; it
// hands out no references, only its base for the executor's host range.
unsafe impl Send for HostWindow {}

const OS_PAGE: u64 = 4096;

impl HostWindow {
    /// Maps `pool` (read-only; a sealed pool cannot be mapped otherwise)
    /// and `staging` (read-write) side by side.
    pub fn map(
        pool: impl AsFd,
        pool_len: u64,
        staging: impl AsFd,
        staging_len: u64,
    ) -> Result<HostWindow, AgentError> {
        use rustix::mm::{MapFlags, ProtFlags, mmap, mmap_anonymous, munmap};
        let bad = |e: &dyn std::fmt::Display| AgentError::Window(e.to_string());
        if pool_len == 0 || staging_len == 0 {
            return Err(AgentError::Window("empty pool or staging area".into()));
        }
        let staging_at = pool_len.next_multiple_of(OS_PAGE);
        let total = staging_at
            .checked_add(staging_len)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| AgentError::Window("window larger than the address space".into()))?;
        // SAFETY: a fresh reservation nothing else uses; the two fixed
        // mappings below replace parts of it, and on failure it is unmapped.
        unsafe {
            let base = mmap_anonymous(
                std::ptr::null_mut(),
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE,
            )
            .map_err(|e| bad(&e))?;
            let pool_map = mmap(
                base,
                pool_len as usize,
                ProtFlags::READ,
                MapFlags::SHARED | MapFlags::FIXED,
                pool,
                0,
            );
            let staging_map = pool_map.and_then(|_| {
                mmap(
                    base.cast::<u8>().add(staging_at as usize).cast(),
                    staging_len as usize,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED | MapFlags::FIXED,
                    staging,
                    0,
                )
            });
            if let Err(e) = staging_map {
                let _ = munmap(base, total);
                return Err(bad(&e));
            }
            Ok(HostWindow {
                base: base.cast(),
                len: total,
                pool_len,
                staging_at,
                staging_len,
            })
        }
    }

    pub fn pool_len(&self) -> u64 {
        self.pool_len
    }

    pub fn staging_len(&self) -> u64 {
        self.staging_len
    }
}

impl Drop for HostWindow {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the reservation `map` made; the agent
        // drops its executor (draining copies) before its window.
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), self.len) };
    }
}

/// A copy agent: an executor, the regions attached to it, the host window,
/// and the copies it runs.
pub struct CopyAgent {
    /// The executor's name (`host`, `cuda`).
    engine: &'static str,
    /// Declared before `window`: dropped first, so in-flight copies finish
    /// while the window is still mapped.
    executor: Box<dyn CopyEngine>,
    window: Option<HostWindow>,
    regions: HashMap<u32, Region>,
    next_region: u32,
    /// Executor token → the copy and layer part it carries.
    running: HashMap<CompletionToken, Running>,
    /// Parts of accepted copies the executor had no room for yet (bounded
    /// by the runtime's `max_agent_copies_per_origin` times the layers).
    waiting: VecDeque<Part>,
    /// Accepted copies with parts running or waiting.
    copies: HashMap<u64, CopyState>,
    /// Finished copies not reported yet, with a publish's page checksums.
    finished: Vec<(u64, Option<CopyFailure>, Vec<u64>)>,
}

impl CopyAgent {
    pub fn new(executor: Box<dyn CopyEngine>) -> Self {
        CopyAgent {
            engine: executor.name(),
            executor,
            window: None,
            regions: HashMap::new(),
            next_region: 0,
            running: HashMap::new(),
            waiting: VecDeque::new(),
            copies: HashMap::new(),
            finished: Vec::new(),
        }
    }

    /// Sets the host window (once the pool and staging descriptors are
    /// known). Refused while copies run.
    pub fn set_window(&mut self, window: HostWindow) -> Result<(), AgentError> {
        if self.busy() {
            return Err(AgentError::Window("copies are running".into()));
        }
        let len = window.len as u64;
        // The pool part is mapped read-only: an executor that page-locks
        // host memory pins it read-only and the staging area writable.
        let spans = [
            HostSpan {
                offset: 0,
                len: window.pool_len,
                writable: false,
            },
            HostSpan {
                offset: window.staging_at,
                len: window.staging_len,
                writable: true,
            },
        ];
        // SAFETY: the window stays mapped and unmoved while the agent
        // holds it, and the executor is dropped before it.
        unsafe {
            self.executor
                .register_host_window(window.base, len, &spans)?
        };
        self.window = Some(window);
        Ok(())
    }

    /// The executor's name (`host`, `cuda`).
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    pub fn has_window(&self) -> bool {
        self.window.is_some()
    }

    /// Attaches engine memory laid out as `chunks` (per page) over `slots`
    /// slots; returns the agent's region id, to register with the runtime
    /// (`AgentRegion { region, page_bytes }`, `page_bytes` the sum of the
    /// chunk lengths).
    ///
    /// # Safety
    /// Every chunk's memory (`ptr + s * stride .. + len` for each slot)
    /// must stay valid and unmoved until [`CopyAgent::detach`] and every
    /// copy submitted against it completed, and nothing else may write a
    /// slot while a copy covers it (the runtime's pins guarantee that for
    /// engines that follow the protocol).
    pub unsafe fn attach(
        &mut self,
        slots: u32,
        chunks: &[Chunk],
    ) -> Result<(u32, u64), AgentError> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.attach_layered(slots, chunks, None) }
    }

    /// [`CopyAgent::attach`], with the model layer each chunk belongs to
    /// (`layers[n]` for `chunks[n]`, e.g. a layer's K and V chunks share
    /// one): restores into the region then run layer by layer and are
    /// counted per layer ([`CopyAgent::layer_counts`]).
    ///
    /// # Safety
    /// As for [`CopyAgent::attach`].
    pub unsafe fn attach_layered(
        &mut self,
        slots: u32,
        chunks: &[Chunk],
        layers: Option<&[u32]>,
    ) -> Result<(u32, u64), AgentError> {
        let bad = |m: String| AgentError::Layout(m);
        if slots == 0 || chunks.is_empty() {
            return Err(bad("a region needs slots and at least one chunk".into()));
        }
        const MAX_LAYERS: u32 = 4096;
        let mut layer_count = 0usize;
        if let Some(layers) = layers {
            if layers.len() != chunks.len() {
                return Err(bad(format!(
                    "{} layers for {} chunks: one layer per chunk",
                    layers.len(),
                    chunks.len()
                )));
            }
            if let Some(&l) = layers.iter().find(|&&l| l >= MAX_LAYERS) {
                return Err(bad(format!("layer {l} is not below {MAX_LAYERS}")));
            }
            layer_count = layers.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
        }
        let mut attached: Vec<(RegionId, u64, u64, u64, Option<u32>)> =
            Vec::with_capacity(chunks.len());
        let mut page_bytes = 0u64;
        for (n, c) in chunks.iter().enumerate() {
            let extent = chunk_extent(c, slots).map_err(|m| bad(format!("chunk {n}: {m}")))?;
            let memory = match c.kind {
                MemoryKind::Host => ExternalMemory::Host {
                    base: c.ptr as usize as *mut u8,
                    len: extent,
                },
                MemoryKind::Cuda { device } => ExternalMemory::Cuda {
                    device,
                    ptr: c.ptr,
                    len: extent,
                },
            };
            // SAFETY: forwarded from this method's contract.
            let layer = layers.and_then(|l| l.get(n).copied());
            match unsafe { self.executor.attach_region(memory) } {
                Ok(id) => attached.push((id, page_bytes, c.stride, c.len, layer)),
                Err(e) => {
                    for (id, ..) in attached {
                        let _ = self.executor.unregister_device_region(id);
                    }
                    return Err(e.into());
                }
            }
            page_bytes += c.len;
        }
        let id = self.next_region;
        self.next_region = self
            .next_region
            .checked_add(1)
            .ok_or(AgentError::TooManyRegions)?;
        self.regions.insert(
            id,
            Region {
                slots,
                page_bytes,
                chunks: attached,
                layers: vec![LayerCount::default(); layer_count],
            },
        );
        Ok((id, page_bytes))
    }

    /// Per layer of a region attached with layers: the pages restored into
    /// it whose bytes of that layer landed, and those whose copy failed,
    /// since the region was attached. `None` for an unknown region; empty
    /// for a region attached without layers.
    pub fn layer_counts(&self, region: u32) -> Option<&[LayerCount]> {
        self.regions.get(&region).map(|r| &r.layers[..])
    }

    /// Forgets a region (its session closed). Copies already running
    /// finish; later ones fail `unknown_region`.
    pub fn detach(&mut self, region: u32) -> bool {
        let Some(r) = self.regions.remove(&region) else {
            return false;
        };
        for (id, ..) in r.chunks {
            let _ = self.executor.unregister_device_region(id);
        }
        true
    }

    /// Takes an `AgentCopy` event and starts it; other events are not the
    /// agent's (returns false). A copy that cannot run is reported failed
    /// by the next `poll`, never dropped.
    pub fn handle(&mut self, event: &Event) -> bool {
        let Event::AgentCopy {
            copy,
            direction,
            pages,
        } = event
        else {
            return false;
        };
        match self.plan(*copy, *direction, pages) {
            Ok(parts) => {
                self.copies.insert(
                    *copy,
                    CopyState {
                        parts: parts.len(),
                        failure: None,
                        checksums: Vec::new(),
                    },
                );
                self.waiting.extend(parts);
            }
            Err(f) => self.finished.push((*copy, Some(f), Vec::new())),
        }
        self.start_waiting();
        true
    }

    /// Translates a batch into executor batches (one per layer of a
    /// layered region's restore, in layer order; one for the rest),
    /// checking every page against the region, the pool and the staging
    /// area, and a restore's pool pages against their checksums: in the
    /// copy's own pass where the executor verifies chains of source-hashed
    /// copies (the host engine; a page that fails is named by its pool
    /// offset, and the destination is the engine's to recompute), else
    /// before anything is copied (the pool is read-only here and its pages
    /// leased until the copy is reported: bytes that match now are the
    /// bytes copied).
    fn plan(
        &self,
        copy: u64,
        direction: AgentDirection,
        pages: &[AgentPageCopy],
    ) -> Result<Vec<Part>, CopyFailure> {
        let window = self.window.as_ref().ok_or(CopyFailure::Shutdown)?;
        let oob = |m: String| CopyFailure::OutOfBounds(m);
        let (dir, host_base, host_len) = match direction {
            AgentDirection::PoolToRegion => (Direction::HostToDevice, 0, window.pool_len),
            AgentDirection::RegionToStaging => (
                Direction::DeviceToHost,
                window.staging_at,
                window.staging_len,
            ),
        };
        let restore = direction == AgentDirection::PoolToRegion;
        let mut whole = Vec::new();
        // (layer, region) → its copies and pages.
        let mut layered: std::collections::BTreeMap<(u32, u32), (Vec<PageCopy>, u64)> =
            std::collections::BTreeMap::new();
        let mut verify = Vec::new();
        let mut verified = Vec::new();
        let fused = self.executor.verifies_source_chains();
        let mut staged = Vec::new();
        for p in pages {
            let r = self
                .regions
                .get(&p.region)
                .ok_or(CopyFailure::UnknownRegion(p.region))?;
            if p.len != r.page_bytes || p.region_offset % r.page_bytes != 0 {
                return Err(oob(format!(
                    "region {} copies whole pages of {} bytes, not [{}, +{})",
                    p.region, r.page_bytes, p.region_offset, p.len
                )));
            }
            let slot = p.region_offset / r.page_bytes;
            if slot >= u64::from(r.slots) {
                return Err(oob(format!(
                    "slot {slot} of region {} ({} slots)",
                    p.region, r.slots
                )));
            }
            if p.host_offset
                .checked_add(p.len)
                .is_none_or(|end| end > host_len)
            {
                return Err(oob(format!(
                    "[{}, +{}) of a {host_len}-byte {direction:?} host area",
                    p.host_offset, p.len
                )));
            }
            // A restored page's checksum covers all its chunks. Copied
            // whole by an executor that verifies chains, it is verified in
            // the copy's pass (one pass over the pool page); else (a
            // layered region's per-layer parts, CUDA) before, below.
            let in_pass = restore && fused && r.chunks.iter().all(|c| c.4.is_none());
            let expect = match (restore, p.checksum) {
                (true, Some(sum)) if in_pass => {
                    verified.push((host_base + p.host_offset, p.len, p.host_offset));
                    Some(sum)
                }
                (true, Some(sum)) => {
                    verify.push((p.host_offset, p.len, sum));
                    None
                }
                _ => None,
            };
            let last = r.chunks.len().saturating_sub(1);
            let mut counted: Vec<u32> = Vec::new();
            for (n, &(id, at, stride, len, layer)) in r.chunks.iter().enumerate() {
                // A publish's page checksum is taken from the engine's own
                // memory as it is read, chunk after chunk (end to end: the
                // manager verifies the staged page against it); a restore
                // verified in the pass hashes the pool page the same way.
                let sum = match (restore && !in_pass, n) {
                    (true, _) => crate::SumOf::Destination,
                    (false, 0) => crate::SumOf::SourceStart,
                    (false, _) => crate::SumOf::SourceContinue,
                };
                let c = PageCopy {
                    host_offset: host_base + p.host_offset + at,
                    region: id,
                    device_offset: slot * stride,
                    len,
                    expect_checksum: expect.filter(|_| n == last),
                    sum,
                };
                match layer {
                    Some(l) if restore => {
                        let entry = layered.entry((l, p.region)).or_default();
                        entry.0.push(c);
                        if !counted.contains(&l) {
                            counted.push(l);
                            entry.1 += 1;
                        }
                    }
                    _ => whole.push(c),
                }
            }
            if !restore {
                staged.push(StagedPage {
                    last: whole.len() - 1,
                    at: host_base + p.host_offset,
                    len: p.len,
                });
            }
        }
        if whole.is_empty() && layered.is_empty() {
            return Err(oob("an empty copy".into()));
        }
        if let Some(f) = self.verify(&verify) {
            return Err(f);
        }
        let mut parts = Vec::with_capacity(layered.len() + 1);
        if !whole.is_empty() {
            parts.push(Part {
                copy,
                direction: dir,
                copies: whole,
                layer: None,
                pages: staged,
                verified,
            });
        }
        for ((layer, region), (copies, pages)) in layered {
            parts.push(Part {
                copy,
                direction: dir,
                copies,
                layer: Some((region, layer, pages)),
                pages: Vec::new(),
                verified: Vec::new(),
            });
        }
        Ok(parts)
    }

    /// Checks the pool pages a restore reads against their checksums.
    fn verify(&self, pages: &[(u64, u64, u64)]) -> Option<CopyFailure> {
        let window = self.window.as_ref()?;
        for &(offset, len, sum) in pages {
            // In bounds: `plan` checked it against the pool's length.
            // SAFETY: the pool part of the window is mapped (read-only)
            // while the agent holds the window.
            let bytes = unsafe {
                std::slice::from_raw_parts(window.base.add(offset as usize), len as usize)
            };
            if crate::page_checksum(bytes) != sum {
                return Some(CopyFailure::Checksum(offset));
            }
        }
        None
    }

    fn start_waiting(&mut self) {
        while let Some(part) = self.waiting.pop_front() {
            match self.executor.submit(part.direction, &part.copies, 0) {
                Ok(token) => {
                    let running = Running {
                        copy: part.copy,
                        layer: part.layer,
                        copies: part.copies.len(),
                        pages: part.pages,
                        verified: part.verified,
                    };
                    self.running.insert(token, running);
                }
                Err(CopyError::QueueFull(..)) if !self.running.is_empty() => {
                    self.waiting.push_front(part);
                    return;
                }
                Err(e) => self.part_done(
                    part.copy,
                    part.layer,
                    Err(CopyFailure::Executor(e.to_string())),
                ),
            }
        }
    }

    /// One part of `copy` finished (`failure` if it failed): counts its
    /// layer, and finishes the copy with its last part.
    fn part_done(
        &mut self,
        copy: u64,
        layer: Option<LayerPart>,
        result: Result<Vec<u64>, CopyFailure>,
    ) {
        let (failure, sums) = match result {
            Ok(sums) => (None, sums),
            Err(f) => (Some(f), Vec::new()),
        };
        if let Some((region, l, pages)) = layer
            && let Some(count) = self
                .regions
                .get_mut(&region)
                .and_then(|r| r.layers.get_mut(l as usize))
        {
            match failure {
                None => count.landed += pages,
                Some(_) => count.failed += pages,
            }
        }
        let Some(state) = self.copies.get_mut(&copy) else {
            debug_assert!(false, "a part of unknown copy {copy}");
            return;
        };
        assert!(
            state.parts > 0,
            "copy {copy}: more parts finished than submitted"
        );
        state.parts -= 1;
        if state.failure.is_none() {
            state.failure = failure;
        }
        state.checksums.extend(sums);
        if state.parts == 0
            && let Some(state) = self.copies.remove(&copy)
        {
            let sums = if state.failure.is_none() {
                state.checksums
            } else {
                Vec::new()
            };
            self.finished.push((copy, state.failure, sums));
        }
    }

    /// Takes the executor's completions (counting layers, finishing
    /// copies) and starts parts that waited for room; the reports wait for
    /// the next [`CopyAgent::poll`]. Never blocks.
    pub fn progress(&mut self) {
        let mut done: Vec<Completion> = Vec::new();
        self.executor.poll(0, &mut done);
        for c in done {
            if let Some(r) = self.running.remove(&c.token) {
                let result = match c.result {
                    Ok(()) => Ok(self.page_sums(&r, &c.checksums)),
                    // A page verified in the copy's pass: named by its
                    // pool offset, as a page verified before it.
                    Err(CopyError::Checksum { host_offset }) => {
                        match r
                            .verified
                            .iter()
                            .find(|(at, len, _)| host_offset >= *at && host_offset - at < *len)
                        {
                            Some(&(_, _, pool_offset)) => Err(CopyFailure::Checksum(pool_offset)),
                            None => Err(CopyFailure::Executor(
                                CopyError::Checksum { host_offset }.to_string(),
                            )),
                        }
                    }
                    Err(e) => Err(CopyFailure::Executor(e.to_string())),
                };
                self.part_done(r.copy, r.layer, result);
            }
        }
        self.start_waiting();
    }

    /// The checksums of a finished part's staged pages: from the executor,
    /// which hashed each page's source as it copied it (the host engine);
    /// an executor that did not (CUDA: the device's bytes are read only by
    /// the DMA) has the agent hash the staged bytes right after they
    /// landed, before anything is reported.
    fn page_sums(&self, r: &Running, executor: &[u64]) -> Vec<u64> {
        if executor.len() == r.copies {
            return r
                .pages
                .iter()
                .filter_map(|p| executor.get(p.last).copied())
                .collect();
        }
        let Some(window) = self.window.as_ref() else {
            return Vec::new();
        };
        r.pages
            .iter()
            .map(|p| {
                // In bounds: `plan` checked each page against the staging
                // area. SAFETY: the window stays mapped while the agent
                // holds it, and the staging slot is this copy's until it
                // is reported.
                let bytes = unsafe {
                    std::slice::from_raw_parts(window.base.add(p.at as usize), p.len as usize)
                };
                crate::page_checksum(bytes)
            })
            .collect()
    }

    /// Collects finished copies as `CopyDone` commands (to submit to the
    /// runtime), and starts copies that waited for executor room. A
    /// publish's carries its pages' checksums, taken from the engine's own
    /// memory as it was copied.
    pub fn poll(&mut self, out: &mut Vec<Command>) {
        self.progress();
        out.extend(
            self.finished
                .drain(..)
                .map(|(copy, failure, checksums)| Command::CopyDone {
                    copy,
                    failure,
                    checksums,
                }),
        );
    }

    /// Copies accepted and not reported by `poll` yet.
    pub fn in_flight(&self) -> usize {
        self.copies.len() + self.finished.len()
    }

    /// Whether a copy is running or waiting to run.
    pub fn busy(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Waits (polling, at most `timeout`) until no copy runs: what an agent
    /// does when its connection is lost, before the engine may reuse the
    /// memory. Returns whether it drained.
    pub fn drain(&mut self, timeout: std::time::Duration, out: &mut Vec<Command>) -> bool {
        let until = std::time::Instant::now() + timeout;
        loop {
            self.poll(out);
            if !self.busy() {
                return true;
            }
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

/// Bytes from a chunk's first slot to the end of its last.
fn chunk_extent(c: &Chunk, slots: u32) -> Result<u64, String> {
    if c.len == 0 || c.ptr == 0 {
        return Err("empty or null".into());
    }
    if c.stride < c.len {
        return Err(format!(
            "stride {} is shorter than the run ({})",
            c.stride, c.len
        ));
    }
    let extent = c
        .stride
        .checked_mul(u64::from(slots) - 1)
        .and_then(|x| x.checked_add(c.len))
        .ok_or("extent overflows")?;
    c.ptr
        .checked_add(extent)
        .ok_or("extent wraps the address space")?;
    Ok(extent)
}
