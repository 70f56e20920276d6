//! Host-memory copy engine: lets the runtime run its real asynchronous copy
//! path on machines without a GPU. Device regions are plain host
//! allocations, and copies run on worker threads so completion is genuinely
//! out of band, exactly as with a device queue.
//!
//! [`DeviceArena`] (the region store) is shared with [`crate::sim`], so both
//! backends expose device bytes to tests the same way.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::{self, JoinHandle};
use std::{fmt, ptr};

use crate::{
    Completion, CompletionToken, CopyEngine, CopyError, Direction, PageCopy, RegionId, SumOf,
    check_bounds,
};

/// Device regions held in host memory, shared by an engine and its callers.
///
/// Every region sits behind its own lock, so reading or writing device
/// bytes through this handle is safe even while copies are in flight: it
/// waits for the copy touching that region, never races it.
#[derive(Clone, Default)]
pub struct DeviceArena {
    /// Back regions with shared-memory files (`orbitkv serve`: the engine
    /// process maps its regions).
    shared: bool,
    /// Indexed by `RegionId`; `None` once unregistered (ids are not reused,
    /// so a stale id can never address a newer region).
    regions: Arc<RwLock<Vec<Option<Arc<Region>>>>>,
}

/// One device region. Its bytes are reached through `base` only, like
/// device memory: copies to disjoint pages run concurrently without a lock,
/// and the runtime's pins and leases keep anyone from touching a page while
/// a copy covers it.
struct Region {
    len: u64,
    base: *mut u8,
    backing: Backing,
}

/// What `base` points into.
enum Backing {
    /// A heap allocation owned by the region (freed on drop).
    Heap,
    /// Memory the engine process owns ([`crate::ExternalMemory::Host`]);
    /// never freed here.
    External,
    /// A shared-memory file an engine process maps too.
    Shared {
        _map: memmap2::MmapMut,
        file: std::fs::File,
    },
}

// SAFETY: `base` points into memory the region owns for its whole life (a
// leaked heap allocation freed in `Drop`, or a mapping kept in `backing`);
// concurrent access is to disjoint pages by the copy protocol.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        if let Backing::Heap = self.backing {
            // SAFETY: `base`/`len` came from `Box::into_raw` of a boxed slice
            // of exactly `len` bytes, and nothing else frees it.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    self.base,
                    self.len as usize,
                ))
            });
        }
    }
}

/// An anonymous shared-memory file of `len` bytes (memfd), mapped. Its
/// size is sealed: the engine process that maps it writes its bytes but
/// cannot shrink it under the copy workers (which would fault them).
pub fn shared_memory(name: &str, len: u64) -> std::io::Result<(std::fs::File, memmap2::MmapMut)> {
    let fd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .allow_sealing(true)
        .create(name)
        .map_err(std::io::Error::other)?;
    fd.as_file().set_len(len)?;
    fd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealSeal,
    ])
    .map_err(std::io::Error::other)?;
    let file = fd.into_file();
    // SAFETY: the file is ours; processes that map it share the bytes by
    // design, and the slot and lease protocol decides who writes what.
    let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
    Ok((file, map))
}

// Lock poisoning only means another thread panicked mid-copy; the bytes are
// still plain bytes, so carrying on is sound.
fn read_lock<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write_lock<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// `offset..offset+len` as an index range, if it lies within `size`.
fn device_range(offset: u64, len: u64, size: u64) -> Result<std::ops::Range<usize>, CopyError> {
    match offset.checked_add(len) {
        // Both ends are <= size, which is a real allocation's length, so
        // they fit in usize.
        Some(end) if end <= size => Ok(offset as usize..end as usize),
        _ => Err(CopyError::OutOfBounds {
            what: "device region",
            offset,
            len,
            size,
        }),
    }
}

impl DeviceArena {
    /// Allocates a zeroed region. Allocation failure is a typed error, not
    /// an abort, because region sizes come from configuration.
    pub(crate) fn register(&self, bytes: u64) -> Result<RegionId, CopyError> {
        let reject = |why: &str| CopyError::RegionRejected(bytes, why.to_string());
        if bytes == 0 {
            return Err(reject("a region must not be empty"));
        }
        let size = usize::try_from(bytes).map_err(|_| reject("larger than the address space"))?;
        let (base, backing) = if self.shared {
            let (file, mut map) = shared_memory("orbitkv-device-region", bytes)
                .map_err(|e| reject(&e.to_string()))?;
            (map.as_mut_ptr(), Backing::Shared { _map: map, file })
        } else {
            let mut buf = Vec::new();
            buf.try_reserve_exact(size)
                .map_err(|e| reject(&e.to_string()))?;
            buf.resize(size, 0);
            let raw = Box::into_raw(buf.into_boxed_slice());
            (raw as *mut u8, Backing::Heap)
        };
        let mut regions = write_lock(&self.regions);
        let id = RegionId::try_from(regions.len()).map_err(|_| reject("too many regions"))?;
        regions.push(Some(Arc::new(Region {
            len: bytes,
            base,
            backing,
        })));
        Ok(id)
    }

    /// Adds a region over memory the caller owns.
    ///
    /// # Safety
    /// `base..base+len` must stay valid and unmoved until the region is
    /// unregistered and every copy submitted against it has completed.
    pub(crate) unsafe fn attach(&self, base: *mut u8, len: u64) -> Result<RegionId, CopyError> {
        if base.is_null() || len == 0 {
            return Err(CopyError::RegionRejected(
                len,
                "external memory must be non-null and non-empty".to_string(),
            ));
        }
        if usize::try_from(len).is_err() || (base as usize).checked_add(len as usize).is_none() {
            return Err(CopyError::RegionRejected(
                len,
                "external memory wraps the address space".to_string(),
            ));
        }
        let mut regions = write_lock(&self.regions);
        let id = RegionId::try_from(regions.len())
            .map_err(|_| CopyError::RegionRejected(len, "too many regions".to_string()))?;
        regions.push(Some(Arc::new(Region {
            len,
            base,
            backing: Backing::External,
        })));
        Ok(id)
    }

    /// Forgets a region. Copies already submitted keep it alive until they
    /// finish; new ones get `UnknownRegion`.
    pub(crate) fn unregister(&self, region: RegionId) -> Result<(), CopyError> {
        match write_lock(&self.regions).get_mut(region as usize) {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(CopyError::UnknownRegion(region)),
        }
    }

    fn region(&self, region: RegionId) -> Result<Arc<Region>, CopyError> {
        read_lock(&self.regions)
            .get(region as usize)
            .cloned()
            .flatten()
            .ok_or(CopyError::UnknownRegion(region))
    }

    /// A new descriptor for a shared region's memory file, to hand to the
    /// engine process that owns the region. `None` for heap regions.
    pub fn region_fd(&self, region: RegionId) -> Option<std::os::fd::OwnedFd> {
        let r = self.region(region).ok()?;
        match &r.backing {
            Backing::Shared { file, .. } => file.try_clone().ok().map(std::os::fd::OwnedFd::from),
            Backing::Heap | Backing::External => None,
        }
    }

    /// Size of `region` in bytes, if it exists.
    pub fn region_len(&self, region: RegionId) -> Option<u64> {
        self.region(region).ok().map(|r| r.len)
    }

    /// Writes device bytes directly, e.g. to seed a region in a test.
    pub fn write(&self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), CopyError> {
        let region = self.region(region)?;
        let range = device_range(offset, data.len() as u64, region.len)?;
        // SAFETY: in bounds (checked); like device memory, the caller must
        // not write a page a copy is covering.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), region.base.add(range.start), range.len())
        };
        Ok(())
    }

    /// Reads device bytes directly, e.g. to check what a copy delivered.
    pub fn read(&self, region: RegionId, offset: u64, len: u64) -> Result<Vec<u8>, CopyError> {
        let region = self.region(region)?;
        let range = device_range(offset, len, region.len)?;
        let mut out = vec![0u8; range.len()];
        // SAFETY: in bounds (checked).
        unsafe {
            ptr::copy_nonoverlapping(region.base.add(range.start), out.as_mut_ptr(), range.len())
        };
        Ok(out)
    }

    /// Checks a whole batch against the host pool and the regions, so a bad
    /// batch is rejected before any of it starts.
    pub(crate) fn validate(
        &self,
        host: Option<&HostPool>,
        copies: &[PageCopy],
    ) -> Result<(), CopyError> {
        self.resolve(host, copies).map(drop)
    }

    fn resolve(
        &self,
        host: Option<&HostPool>,
        copies: &[PageCopy],
    ) -> Result<Vec<Arc<Region>>, CopyError> {
        if copies.is_empty() {
            return Err(CopyError::EmptyBatch);
        }
        let host = host.ok_or(CopyError::NoHostPool)?;
        copies
            .iter()
            .map(|copy| {
                let region = self.region(copy.region)?;
                check_bounds(copy, host.len, region.len)?;
                Ok(region)
            })
            .collect()
    }

    /// Moves the bytes of one batch. Validates again rather than trusting
    /// the caller, so the raw-pointer copies below are only ever in bounds;
    /// a batch that fails here was broken by a bug, hence `Failed`.
    pub(crate) fn copy_batch(
        &self,
        host: &HostPool,
        direction: Direction,
        copies: &[PageCopy],
    ) -> Result<Vec<u64>, CopyError> {
        let regions = self
            .resolve(Some(host), copies)
            .map_err(|e| CopyError::Failed(format!("batch invalid at copy time: {e}")))?;
        let mut sums = Vec::with_capacity(copies.len());
        // The page a chain of source-hashed copies is building.
        let mut page = crate::PageHasher::new();
        for (copy, region) in copies.iter().zip(&regions) {
            let range = device_range(copy.device_offset, copy.len, region.len)?;
            let len = range.len();
            // SAFETY: `resolve` checked host_offset + len <= host.len, and
            // `HostPool` guarantees base..base+len is valid memory.
            let host_ptr = unsafe { host.base.add(copy.host_offset as usize) };
            // SAFETY: the device range is in bounds of a region this batch
            // keeps alive (`Arc`); the host side is in bounds (above). Per the
            // `register_host_pool` contract and the runtime's pins, nobody
            // else touches either range while this copy is in flight, and
            // the two cannot overlap (regions are never inside the pool).
            let dev_ptr = unsafe { region.base.add(range.start) };
            let (src, dst) = match direction {
                Direction::HostToDevice => (host_ptr as *const u8, dev_ptr),
                Direction::DeviceToHost => (dev_ptr as *const u8, host_ptr),
            };
            let sum = match copy.sum {
                // SAFETY: as above; both ranges are in bounds and disjoint.
                SumOf::Destination => unsafe { crate::copy_and_checksum(src, dst, len) },
                SumOf::SourceStart | SumOf::SourceContinue => {
                    if copy.sum == SumOf::SourceStart {
                        page.reset();
                    }
                    // SAFETY: as above.
                    unsafe { crate::copy_hashing_source(src, dst, len, &mut page) };
                    page.digest()
                }
            };
            if copy.expect_checksum.is_some_and(|e| e != sum) {
                return Err(CopyError::Checksum {
                    host_offset: copy.host_offset,
                });
            }
            sums.push(sum);
        }
        Ok(sums)
    }
}

impl fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sizes: Vec<Option<u64>> = read_lock(&self.regions)
            .iter()
            .map(|r| r.as_ref().map(|r| r.len))
            .collect();
        f.debug_struct("DeviceArena")
            .field("region_bytes", &sizes)
            .finish()
    }
}

/// The registered host pool: a raw range that worker threads copy through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostPool {
    base: *mut u8,
    len: u64,
}

// SAFETY: `CopyEngine::register_host_pool` makes the caller promise that
// base..base+len stays valid until the engine is dropped and that nobody
// else touches a range while a copy covering it is in flight. Under that
// promise, using the pointer from another thread is sound.
unsafe impl Send for HostPool {}
// SAFETY: as for Send; shared access only ever copies bytes the contract
// reserves for the in-flight batch.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// # Safety
    /// The `register_host_pool` contract must hold for `base..base+len`.
    pub(crate) unsafe fn new(base: *mut u8, len: u64) -> Result<Self, CopyError> {
        if base.is_null() {
            return Err(CopyError::Failed("host pool base pointer is null".into()));
        }
        if usize::try_from(len).is_err() {
            return Err(CopyError::Failed(format!(
                "host pool of {len} bytes exceeds the address space"
            )));
        }
        Ok(Self { base, len })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCopyConfig {
    /// Copy threads; 0 is treated as 1.
    pub workers: usize,
    pub max_in_flight_batches: usize,
    /// Back device regions with shared-memory files that engine processes
    /// map (`DeviceArena::region_fd`).
    pub shared_regions: bool,
}

/// The most copy threads a default takes, however many CPUs there are: a
/// copy saturates memory bandwidth with a few threads, and every engine
/// process on a host carries its own agent.
pub const MAX_DEFAULT_COPY_WORKERS: usize = 8;

/// Default copy threads: one per CPU this process may run on, at least 1
/// and at most [`MAX_DEFAULT_COPY_WORKERS`].
pub fn default_copy_workers() -> usize {
    thread::available_parallelism()
        .map_or(2, usize::from)
        .clamp(1, MAX_DEFAULT_COPY_WORKERS)
}

impl Default for HostCopyConfig {
    fn default() -> Self {
        Self {
            workers: default_copy_workers(),
            max_in_flight_batches: 64,
            shared_regions: false,
        }
    }
}

/// A large batch is split across the workers; the part that finishes last
/// reports the batch.
struct Batch {
    token: CompletionToken,
    parts_left: AtomicUsize,
    error: Mutex<Option<CopyError>>,
    /// Per copy, in batch order; each part fills its own range.
    checksums: Mutex<Vec<u64>>,
}

struct Job {
    batch: Arc<Batch>,
    direction: Direction,
    host: HostPool,
    copies: Vec<PageCopy>,
    /// The batch index of `copies[0]`.
    first: usize,
}

/// Batches smaller than this stay on one worker: splitting costs more than
/// it saves.
const SPLIT_MIN_BYTES: u64 = 1 << 20;

/// Copies on worker threads; "device" regions live in host memory.
pub struct HostCopyEngine {
    config: HostCopyConfig,
    arena: DeviceArena,
    host: Option<HostPool>,
    jobs: Sender<Job>,
    done: Receiver<Completion>,
    /// Completions `wait` took, reported by the next `poll`.
    waited: Vec<Completion>,
    workers: Vec<JoinHandle<()>>,
    next_token: u64,
    in_flight: usize,
}

impl HostCopyEngine {
    pub fn new(config: HostCopyConfig) -> Self {
        let arena = DeviceArena {
            shared: config.shared_regions,
            ..DeviceArena::default()
        };
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        let job_rx = Arc::new(Mutex::new(job_rx));
        // If no thread can be spawned, the job receiver is dropped with the
        // last clone and `submit` reports that workers have stopped.
        let workers = (0..config.workers.max(1))
            .map_while(|i| {
                let (jobs, done, arena) = (job_rx.clone(), done_tx.clone(), arena.clone());
                thread::Builder::new()
                    .name(format!("orbitkv-copy-{i}"))
                    .spawn(move || worker(&jobs, &done, &arena))
                    .ok()
            })
            .collect();
        Self {
            config,
            arena,
            host: None,
            jobs: job_tx,
            done,
            waited: Vec::new(),
            workers,
            next_token: 0,
            in_flight: 0,
        }
    }

    /// A handle to the device regions, usable while the engine runs.
    pub fn arena(&self) -> DeviceArena {
        self.arena.clone()
    }
}

fn worker(jobs: &Mutex<Receiver<Job>>, done: &Sender<Completion>, arena: &DeviceArena) {
    loop {
        // The guard is a temporary, so the lock is released before copying.
        let job = match jobs.lock().unwrap_or_else(PoisonError::into_inner).recv() {
            Ok(job) => job,
            Err(_) => return, // engine dropped and queue drained
        };
        // A panic must still produce a completion, or `in_flight` never
        // drains and the caller waits forever.
        let result = catch_unwind(AssertUnwindSafe(|| {
            arena.copy_batch(&job.host, job.direction, &job.copies)
        }))
        .unwrap_or_else(|_| Err(CopyError::Failed("copy worker panicked".into())));
        let batch = &job.batch;
        match result {
            Ok(sums) => {
                let mut all = batch
                    .checksums
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some(dst) = all.get_mut(job.first..job.first + sums.len()) {
                    dst.copy_from_slice(&sums);
                }
            }
            Err(e) => {
                batch
                    .error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(e);
            }
        }
        if batch.parts_left.fetch_sub(1, Ordering::AcqRel) != 1 {
            continue; // another part finishes the batch
        }
        let result = match batch
            .error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            Some(e) => Err(e),
            None => Ok(()),
        };
        // The engine may already be gone; then nobody wants the completion.
        let checksums = if result.is_ok() {
            std::mem::take(
                &mut *batch
                    .checksums
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner),
            )
        } else {
            Vec::new()
        };
        let _ = done.send(Completion {
            token: batch.token,
            result,
            checksums,
        });
    }
}

/// Where each of (at most) `parts` parts of a batch starts: evenly by copy
/// count, but never inside a page whose copies are hashed as one chain
/// (`SumOf::SourceContinue` stays with the copy before it).
fn part_starts(copies: &[PageCopy], parts: usize) -> Vec<usize> {
    let per_part = copies.len().div_ceil(parts.max(1)).max(1);
    let mut starts = vec![0];
    let mut at = per_part;
    while at < copies.len() {
        while copies
            .get(at)
            .is_some_and(|c| c.sum == SumOf::SourceContinue)
        {
            at += 1;
        }
        if at >= copies.len() {
            break;
        }
        starts.push(at);
        at += per_part;
    }
    starts
}

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    fn verifies_source_chains(&self) -> bool {
        true
    }

    fn unregister_device_region(&mut self, region: RegionId) -> Result<(), CopyError> {
        self.arena.unregister(region)
    }

    fn export_region(&self, region: RegionId) -> Option<std::os::fd::OwnedFd> {
        self.arena.region_fd(region)
    }

    fn register_device_region(&mut self, bytes: u64) -> Result<RegionId, CopyError> {
        self.arena.register(bytes)
    }

    unsafe fn attach_region(
        &mut self,
        memory: crate::ExternalMemory,
    ) -> Result<RegionId, CopyError> {
        match memory {
            // SAFETY: forwarded from this method's contract.
            crate::ExternalMemory::Host { base, len } => unsafe { self.arena.attach(base, len) },
            crate::ExternalMemory::Cuda { len, .. } => Err(CopyError::RegionRejected(
                len,
                "the host copy engine cannot address CUDA memory".to_string(),
            )),
        }
    }

    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), CopyError> {
        // SAFETY: the caller upholds this method's contract, which is
        // exactly `HostPool::new`'s.
        self.host = Some(unsafe { HostPool::new(base, len) }?);
        Ok(())
    }

    fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
        _now_us: u64,
    ) -> Result<CompletionToken, CopyError> {
        self.arena.validate(self.host.as_ref(), copies)?;
        let host = self.host.ok_or(CopyError::NoHostPool)?;
        if self.in_flight >= self.config.max_in_flight_batches {
            return Err(CopyError::QueueFull(
                self.in_flight,
                self.config.max_in_flight_batches,
            ));
        }
        let token = CompletionToken(self.next_token);
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        let parts = if bytes >= SPLIT_MIN_BYTES {
            self.workers.len().min(copies.len()).max(1)
        } else {
            1
        };
        let cuts = part_starts(copies, parts);
        let batch = Arc::new(Batch {
            token,
            parts_left: AtomicUsize::new(cuts.len()),
            error: Mutex::new(None),
            checksums: Mutex::new(vec![0; copies.len()]),
        });
        for (n, &first) in cuts.iter().enumerate() {
            let end = cuts.get(n + 1).copied().unwrap_or(copies.len());
            let job = Job {
                batch: batch.clone(),
                direction,
                host,
                copies: copies[first..end].to_vec(),
                first,
            };
            // Workers only stop when the engine is dropped, so either every
            // part is queued or the first send already failed.
            self.jobs
                .send(job)
                .map_err(|_| CopyError::Failed("copy workers have stopped".into()))?;
        }
        self.next_token += 1;
        self.in_flight += 1;
        Ok(token)
    }

    fn poll(&mut self, _now_us: u64, out: &mut Vec<Completion>) {
        let waited = self.waited.drain(..);
        for completion in waited.chain(std::iter::from_fn(|| self.done.try_recv().ok())) {
            assert!(self.in_flight > 0, "a completion without a batch in flight");
            self.in_flight -= 1;
            out.push(completion);
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn wait(&mut self, timeout: std::time::Duration) -> bool {
        if !self.waited.is_empty() {
            return true;
        }
        if self.in_flight == 0 {
            return false;
        }
        match self.done.recv_timeout(timeout) {
            Ok(completion) => {
                self.waited.push(completion);
                true
            }
            Err(_) => false,
        }
    }
}

impl Drop for HostCopyEngine {
    /// Hangs up and waits: workers finish every submitted batch first, so
    /// no copy outlives the buffers the caller promised to keep alive.
    fn drop(&mut self) {
        // Swapping in a dead sender drops the real one, which ends the
        // workers' `recv` loop once the queue is empty.
        self.jobs = mpsc::channel().0;
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch is split across workers only where a page starts: a chain of
    /// source-hashed copies stays in one part, in order.
    #[test]
    fn parts_never_start_inside_a_page() {
        let copy = |sum| PageCopy {
            host_offset: 0,
            region: 0,
            device_offset: 0,
            len: 1,
            expect_checksum: None,
            sum,
        };
        // Pages of three copies each: 7 pages, 21 copies.
        let copies: Vec<PageCopy> = (0..21)
            .map(|i| match i % 3 {
                0 => copy(SumOf::SourceStart),
                _ => copy(SumOf::SourceContinue),
            })
            .collect();
        for parts in 1..=8 {
            let starts = part_starts(&copies, parts);
            assert_eq!(starts[0], 0);
            assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
            for &s in &starts {
                assert_eq!(copies[s].sum, SumOf::SourceStart, "{parts}: {starts:?}");
            }
            assert!(starts.len() <= parts.max(1));
        }
        // Plain copies split evenly, as before.
        let plain = vec![copy(SumOf::Destination); 10];
        assert_eq!(part_starts(&plain, 3), vec![0, 4, 8]);
    }
}
