//! The executor: everything the CUDA engine decides, over any [`Driver`].
//!
//! A batch is validated whole, coalesced into runs, split per device, and
//! queued on each device's stream for its direction, followed by one event
//! record. `poll` queries only the oldest event of each stream (a stream
//! completes in order), so a poll costs one `cuEventQuery` per stream with
//! work pending.
//! Nothing here blocks the host on the copy path; only `unregister`
//! (fencing), error recovery and drop wait for a stream.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::driver::{CopyApi, Driver, DriverError, DriverInfo, EventId, Ordinal, Pinned, Run};
use super::runs::{self, Resolved};
use super::{CudaConfig, CudaStats, TokenState, Unavailable};
use crate::{
    Completion, CompletionToken, CopyError, Direction, ExternalMemory, HostSpan, PageCopy,
    RegionId, check_bounds,
};

/// The registered host range and how each of its spans is page-locked.
struct HostPin {
    base: u64,
    len: u64,
    /// Sorted by offset, disjoint; copies go only inside one of them.
    spans: Vec<PinnedSpan>,
}

struct PinnedSpan {
    /// Offset from `HostPin::base`.
    offset: u64,
    len: u64,
    pinned: Pinned,
    read_only: bool,
}

impl HostPin {
    /// The span holding all of `[offset, +len)`.
    fn span(&self, offset: u64, len: u64) -> Option<&PinnedSpan> {
        let end = offset.checked_add(len)?;
        self.spans
            .iter()
            .find(|s| offset >= s.offset && end <= s.offset + s.len)
    }
}

struct Region {
    device: Ordinal,
    ptr: u64,
    len: u64,
    /// Batches submitted against this region and not yet finished.
    in_flight: usize,
    /// Unregistered: new copies are refused; the entry goes once
    /// `in_flight` reaches zero.
    fenced: bool,
}

#[derive(Clone, Copy)]
struct Pending {
    token: u64,
    event: EventId,
}

#[derive(Default)]
struct DeviceState {
    /// Set when a fatal driver error made the device unusable.
    lost: Option<String>,
    /// Events not recorded on anything pending; one per possible batch.
    free: Vec<EventId>,
    /// Recorded events in stream order, one queue per direction's stream
    /// (`lane`).
    queues: [VecDeque<Pending>; 2],
}

struct Batch {
    /// Device parts still pending (one event each).
    parts: Vec<(Ordinal, EventId)>,
    /// `submit` is still queueing parts: a part failing meanwhile must not
    /// finish the batch before its other parts are queued.
    submitting: bool,
    error: Option<CopyError>,
    regions: Vec<RegionId>,
}

pub(crate) struct Executor<D: Driver> {
    driver: D,
    config: CudaConfig,
    info: DriverInfo,
    host: Option<HostPin>,
    /// Indexed by `RegionId`; ids are never reused.
    regions: Vec<Option<Region>>,
    devices: BTreeMap<Ordinal, DeviceState>,
    batches: HashMap<u64, Batch>,
    /// Finished batches `poll` has not reported yet.
    ready: VecDeque<Completion>,
    next_token: u64,
    scratch: Scratch,
    stats: CudaStats,
}

#[derive(Default)]
struct Scratch {
    runs: Vec<Resolved>,
    device_runs: Vec<Run>,
    devices: Vec<Ordinal>,
}

fn lane(direction: Direction) -> usize {
    match direction {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
    }
}

const LANES: [Direction; 2] = [Direction::HostToDevice, Direction::DeviceToHost];

/// Verified bytes below which one thread hashes: splitting costs more.
const PARALLEL_VERIFY_BYTES: u64 = 4 << 20;

/// Checks each restore's source pool page against the checksum it carries,
/// before anything is queued: a page altered in memory fails the batch
/// (`CopyError::Checksum`) and never reaches the device. The pool pages of
/// a restore are leased, so nothing changes them between this check and
/// the DMA that reads them.
fn verify_sources(host_base: u64, copies: &[PageCopy]) -> Result<(), CopyError> {
    use rayon::prelude::*;
    let mismatch = |c: &PageCopy| {
        let expected = c.expect_checksum?;
        // SAFETY: `validate` checked the range lies in the registered pool,
        // which the `register_host_pool` contract keeps mapped; the
        // runtime's leases keep restore sources unchanged while copies run.
        let bytes = unsafe {
            std::slice::from_raw_parts((host_base + c.host_offset) as *const u8, c.len as usize)
        };
        (crate::page_checksum(bytes) != expected).then_some(c.host_offset)
    };
    let verified: u64 = copies
        .iter()
        .filter(|c| c.expect_checksum.is_some())
        .map(|c| c.len)
        .sum();
    let bad = if verified >= PARALLEL_VERIFY_BYTES {
        copies.par_iter().find_map_first(mismatch)
    } else {
        copies.iter().find_map(mismatch)
    };
    match bad {
        Some(host_offset) => Err(CopyError::Checksum { host_offset }),
        None => Ok(()),
    }
}

fn failed(what: &str, e: &DriverError) -> CopyError {
    CopyError::Failed(format!("{what}: {e}"))
}

impl<D: Driver> Executor<D> {
    /// Opens the home device (its stream and events). Fails when the
    /// driver has no usable device: the caller falls back.
    pub(crate) fn open(driver: D, config: CudaConfig) -> Result<Self, Unavailable> {
        let info = driver.info();
        if info.devices <= 0 {
            return Err(Unavailable::NoDevice);
        }
        if config.home_device < 0 || config.home_device >= info.devices {
            return Err(Unavailable::DeviceMissing {
                device: config.home_device,
                count: info.devices,
            });
        }
        let mut exec = Self {
            driver,
            config,
            info,
            host: None,
            regions: Vec::new(),
            devices: BTreeMap::new(),
            batches: HashMap::new(),
            ready: VecDeque::new(),
            next_token: 0,
            scratch: Scratch::default(),
            stats: CudaStats::default(),
        };
        exec.open_device(config.home_device)
            .map_err(Unavailable::Init)?;
        Ok(exec)
    }

    pub(crate) fn info(&self) -> DriverInfo {
        self.info
    }

    pub(crate) fn copy_api(&self) -> CopyApi {
        if self.config.prefer_batch_api && self.info.batch_api {
            CopyApi::Batch
        } else {
            CopyApi::PerRun
        }
    }

    pub(crate) fn stats(&self) -> CudaStats {
        self.stats
    }

    /// Opens a device with its stream and a full set of events, so the
    /// copy path never creates one.
    fn open_device(&mut self, device: Ordinal) -> Result<(), DriverError> {
        if self.devices.contains_key(&device) {
            return Ok(());
        }
        self.driver.open_device(device)?;
        let mut state = DeviceState::default();
        for _ in 0..self.config.max_in_flight_batches.max(1) {
            match self.driver.create_event(device) {
                Ok(e) => state.free.push(e),
                Err(e) => {
                    for ev in state.free.drain(..) {
                        self.driver.destroy_event(device, ev);
                    }
                    self.driver.close_device(device);
                    return Err(e);
                }
            }
        }
        self.devices.insert(device, state);
        Ok(())
    }

    /// The whole range as one span, writable unless the configuration
    /// says the pool is mapped read-only.
    pub(crate) fn register_host_pool(&mut self, base: u64, len: u64) -> Result<(), CopyError> {
        let span = HostSpan {
            offset: 0,
            len,
            writable: !self.config.host_read_only,
        };
        self.register_host_window(base, len, &[span])
    }

    /// Pins each span with its access (`cuMemHostRegister`, portable; read
    /// only where it is not writable or the configuration says so), after
    /// unpinning what was registered before. Nothing stays pinned when a
    /// span fails.
    pub(crate) fn register_host_window(
        &mut self,
        base: u64,
        len: u64,
        spans: &[HostSpan],
    ) -> Result<(), CopyError> {
        let refuse = |m: String| Err(CopyError::Failed(m));
        if base == 0 || len == 0 || base.checked_add(len).is_none() {
            return refuse(format!(
                "host pool [{base:#x}, +{len}) must be non-null, non-empty and not wrap"
            ));
        }
        let mut sorted: Vec<HostSpan> = spans.to_vec();
        sorted.sort_by_key(|s| s.offset);
        let mut end = 0u64;
        for s in &sorted {
            if s.len == 0 || s.offset < end || s.offset.checked_add(s.len).is_none_or(|e| e > len) {
                return refuse(format!(
                    "host span [{}, +{}) is empty, overlaps another or leaves the {len}-byte \
                     range",
                    s.offset, s.len
                ));
            }
            end = s.offset + s.len;
        }
        if sorted.is_empty() {
            return refuse("a host range needs at least one span".into());
        }
        if !self.batches.is_empty() {
            return refuse("the host pool cannot change while copies are in flight".into());
        }
        self.unpin_host();
        let mut pin = HostPin {
            base,
            len,
            spans: Vec::with_capacity(sorted.len()),
        };
        for s in sorted {
            let read_only = self.config.host_read_only || !s.writable;
            match self
                .driver
                .pin_host(self.config.home_device, base + s.offset, s.len, read_only)
            {
                Ok(pinned) => {
                    if pinned == Pinned::AlreadyPinned {
                        tracing::info!(
                            base = base + s.offset,
                            len = s.len,
                            "host memory was already page-locked; using it as is"
                        );
                    }
                    pin.spans.push(PinnedSpan {
                        offset: s.offset,
                        len: s.len,
                        pinned,
                        read_only,
                    });
                }
                Err(e) => {
                    self.host = Some(pin);
                    self.unpin_host();
                    let what = if read_only {
                        "pinning host memory read-only (CU_MEMHOSTREGISTER_READ_ONLY)"
                    } else {
                        "pinning host memory"
                    };
                    return Err(failed(what, &e));
                }
            }
        }
        self.host = Some(pin);
        Ok(())
    }

    fn unpin_host(&mut self) {
        let Some(pin) = self.host.take() else {
            return;
        };
        for s in pin.spans.iter().filter(|s| s.pinned == Pinned::ByUs) {
            if let Err(e) = self
                .driver
                .unpin_host(self.config.home_device, pin.base + s.offset)
            {
                tracing::warn!(error = %e, "unregistering pinned host memory failed");
            }
        }
    }

    pub(crate) fn attach(&mut self, memory: ExternalMemory) -> Result<RegionId, CopyError> {
        let (device, ptr, len) = match memory {
            ExternalMemory::Cuda { device, ptr, len } => (device, ptr, len),
            ExternalMemory::Host { len, .. } => {
                return Err(CopyError::RegionRejected(
                    len,
                    "the cuda copy engine attaches CUDA memory only; host memory goes to the \
                     host engine"
                        .into(),
                ));
            }
        };
        let reject = |why: String| CopyError::RegionRejected(len, why);
        if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
            return Err(reject(format!(
                "device range [{ptr:#x}, +{len}) must be non-null, non-empty and not wrap"
            )));
        }
        if device < 0 || device >= self.info.devices {
            return Err(reject(format!(
                "device {device} does not exist ({} visible)",
                self.info.devices
            )));
        }
        if let Some(reason) = self.devices.get(&device).and_then(|d| d.lost.as_ref()) {
            return Err(reject(format!("device {device} is lost: {reason}")));
        }
        self.open_device(device)
            .map_err(|e| reject(format!("opening device {device}: {e}")))?;
        let allocation = self
            .driver
            .allocation(device, ptr)
            .map_err(|e| reject(e.to_string()))?
            .ok_or_else(|| reject(format!("{ptr:#x} is not device memory")))?;
        if allocation.device != device {
            return Err(reject(format!(
                "{ptr:#x} is on device {}, not {device}",
                allocation.device
            )));
        }
        if !allocation.primary_context {
            return Err(reject(format!(
                "{ptr:#x} belongs to a CUDA context other than device {device}'s primary \
                 context, which the copy streams run on"
            )));
        }
        let alloc_end = allocation.base.saturating_add(allocation.len);
        if ptr < allocation.base || ptr + len > alloc_end {
            return Err(reject(format!(
                "[{ptr:#x}, +{len}) is not inside its allocation [{:#x}, +{}) on device \
                 {device}",
                allocation.base, allocation.len
            )));
        }
        let id = RegionId::try_from(self.regions.len())
            .map_err(|_| reject("too many regions".into()))?;
        self.regions.push(Some(Region {
            device,
            ptr,
            len,
            in_flight: 0,
            fenced: false,
        }));
        Ok(id)
    }

    fn live_region(&self, region: RegionId) -> Result<&Region, CopyError> {
        match self.regions.get(region as usize) {
            Some(Some(r)) if !r.fenced => Ok(r),
            _ => Err(CopyError::UnknownRegion(region)),
        }
    }

    /// Refuses new copies against `region` at once, then waits (bounded by
    /// `unregister_wait_ms`) until every batch already submitted against it
    /// has finished. `Ok` means no copy will touch the region's memory (or
    /// the pool pages those batches named) any more. `Err` means some are
    /// still in flight: the region stays fenced and the caller must keep
    /// the memory alive and call again.
    pub(crate) fn unregister(&mut self, region: RegionId) -> Result<(), CopyError> {
        match self.regions.get_mut(region as usize) {
            Some(Some(r)) => r.fenced = true,
            _ => return Err(CopyError::UnknownRegion(region)),
        }
        let deadline = Instant::now() + Duration::from_millis(self.config.unregister_wait_ms);
        loop {
            self.progress();
            let slot = &mut self.regions[region as usize];
            match slot {
                Some(r) if r.in_flight > 0 => {}
                _ => {
                    *slot = None;
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                let left = slot.as_ref().map_or(0, |r| r.in_flight);
                return Err(CopyError::Failed(format!(
                    "region {region} is fenced but {left} batches still copy to or from it after \
                     {} ms; keep its memory alive and unregister again",
                    self.config.unregister_wait_ms
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.batches.len() + self.ready.len()
    }

    /// Checks the whole batch; nothing is queued unless all of it is valid.
    fn validate(&self, direction: Direction, copies: &[PageCopy]) -> Result<(), CopyError> {
        if copies.is_empty() {
            return Err(CopyError::EmptyBatch);
        }
        let host = self.host.as_ref().ok_or(CopyError::NoHostPool)?;
        for copy in copies {
            let region = self.live_region(copy.region)?;
            check_bounds(copy, host.len, region.len)?;
            let span = host
                .span(copy.host_offset, copy.len)
                .ok_or(CopyError::OutOfBounds {
                    what: "pinned host spans",
                    offset: copy.host_offset,
                    len: copy.len,
                    size: host.len,
                })?;
            if direction == Direction::DeviceToHost && span.read_only {
                return Err(CopyError::Failed(format!(
                    "host memory at offset {} is registered read-only; device → host copies \
                     need a writable span",
                    copy.host_offset
                )));
            }
            if let Some(reason) = self
                .devices
                .get(&region.device)
                .and_then(|d| d.lost.as_ref())
            {
                return Err(CopyError::Failed(format!(
                    "device {} is lost: {reason}",
                    region.device
                )));
            }
        }
        let in_flight = self.in_flight();
        if in_flight >= self.config.max_in_flight_batches {
            return Err(CopyError::QueueFull(
                in_flight,
                self.config.max_in_flight_batches,
            ));
        }
        if direction == Direction::HostToDevice {
            verify_sources(host.base, copies)?;
        }
        Ok(())
    }

    pub(crate) fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
    ) -> Result<CompletionToken, CopyError> {
        self.validate(direction, copies)?;
        let host_base = self.host.as_ref().map_or(0, |h| h.base);
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.runs.clear();
        let resolved = copies.iter().map(|c| {
            // Validated above: the region is live and both ranges are in
            // bounds, so these additions cannot overflow.
            let r = self.regions[c.region as usize].as_ref();
            let (device, ptr) = r.map_or((0, 0), |r| (r.device, r.ptr));
            Resolved {
                device,
                run: Run {
                    host: host_base + c.host_offset,
                    device: ptr + c.device_offset,
                    len: c.len,
                },
            }
        });
        runs::coalesce(resolved, &mut scratch.runs);
        runs::devices(&scratch.runs, &mut scratch.devices);

        let token = self.next_token;
        self.next_token += 1;
        let mut regions: Vec<RegionId> = copies.iter().map(|c| c.region).collect();
        regions.sort_unstable();
        regions.dedup();
        for &id in &regions {
            if let Some(Some(r)) = self.regions.get_mut(id as usize) {
                r.in_flight += 1;
            }
        }
        self.batches.insert(
            token,
            Batch {
                parts: Vec::with_capacity(scratch.devices.len()),
                submitting: true,
                error: None,
                regions,
            },
        );
        self.stats.batches += 1;
        self.stats.copies += copies.len() as u64;
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        match direction {
            Direction::HostToDevice => self.stats.bytes_to_device += bytes,
            Direction::DeviceToHost => self.stats.bytes_to_host += bytes,
        }
        for &device in &scratch.devices {
            scratch.device_runs.clear();
            scratch.device_runs.extend(
                scratch
                    .runs
                    .iter()
                    .filter(|r| r.device == device)
                    .map(|r| r.run),
            );
            self.submit_part(token, device, direction, &scratch.device_runs);
        }
        self.scratch = scratch;
        // A batch of only empty copies, or whose parts all finished or
        // failed while being queued, is finished now; `poll` reports it.
        if let Some(b) = self.batches.get_mut(&token) {
            b.submitting = false;
            if b.parts.is_empty() {
                self.finish_batch(token);
            }
        }
        Ok(CompletionToken(token))
    }

    /// Queues one device's runs and the event that says they landed.
    fn submit_part(&mut self, token: u64, device: Ordinal, direction: Direction, runs: &[Run]) {
        let api = self.copy_api();
        let Some(event) = self.devices.get_mut(&device).and_then(|d| d.free.pop()) else {
            // Each batch takes at most one event per device and `validate`
            // bounds the batches in flight by the events created per
            // device; only a driver that failed to replace a retired event
            // gets here.
            tracing::error!(device, "no free copy event");
            self.fail_batch(
                token,
                CopyError::Failed(format!("no free event on device {device}")),
            );
            return;
        };
        self.stats.runs += runs.len() as u64;
        self.stats.driver_calls += match api {
            CopyApi::PerRun => runs.len() as u64,
            CopyApi::Batch => runs.len().div_ceil(self.config.max_runs_per_call.max(1)) as u64,
        };
        let mut fatal = None;
        if let Err(e) = self.driver.enqueue(device, direction, runs, api) {
            tracing::warn!(device, token, enqueued = e.enqueued, error = %e.error, "copy enqueue failed");
            self.fail_batch(token, failed("queueing copies", &e.error));
            if e.error.is_fatal() {
                fatal = Some(e.error);
            }
        }
        match self.driver.record(device, direction, event) {
            Ok(()) => {
                if let Some(d) = self.devices.get_mut(&device) {
                    d.queues[lane(direction)].push_back(Pending { token, event });
                }
                if let Some(b) = self.batches.get_mut(&token) {
                    b.parts.push((device, event));
                }
            }
            Err(e) => {
                // Runs may be queued with nothing to tell us when they
                // land: wait for the stream (an error path, not the copy
                // path) so the caller may reuse the memory once told.
                self.fail_batch(token, failed("recording the completion event", &e));
                if let Some(d) = self.devices.get_mut(&device) {
                    d.free.push(event);
                }
                if let Err(se) = self.driver.synchronize(device) {
                    fatal.get_or_insert(se);
                } else if e.is_fatal() {
                    fatal.get_or_insert(e);
                }
            }
        }
        if let Some(e) = fatal {
            self.lose_device(device, &e);
        }
    }

    fn fail_batch(&mut self, token: u64, error: CopyError) {
        if let Some(b) = self.batches.get_mut(&token) {
            b.error.get_or_insert(error);
        }
    }

    /// A fatal error: the context is gone, so nothing queued on it will run
    /// or complete. Every pending batch on the device fails; later submits
    /// naming its regions are refused.
    fn lose_device(&mut self, device: Ordinal, error: &DriverError) {
        let Some(state) = self.devices.get_mut(&device) else {
            return;
        };
        if state.lost.is_none() {
            tracing::error!(device, %error, "CUDA device lost; its pending copies fail");
            self.stats.devices_lost += 1;
            state.lost = Some(error.to_string());
        }
        let pending: Vec<Pending> = state.queues.iter_mut().flat_map(|q| q.drain(..)).collect();
        for p in pending {
            // Events of a dead context are not reused (nor destroyable).
            self.finish_part(
                p.token,
                device,
                p.event,
                Err(failed(&format!("device {device} lost"), error)),
            );
        }
    }

    fn finish_part(
        &mut self,
        token: u64,
        device: Ordinal,
        event: EventId,
        result: Result<(), CopyError>,
    ) {
        let Some(batch) = self.batches.get_mut(&token) else {
            debug_assert!(false, "event for unknown batch {token}");
            return;
        };
        let before = batch.parts.len();
        batch.parts.retain(|&p| p != (device, event));
        assert_eq!(
            batch.parts.len() + 1,
            before,
            "batch {token}: part finished twice"
        );
        if let Err(e) = result {
            batch.error.get_or_insert(e);
        }
        if batch.parts.is_empty() && !batch.submitting {
            self.finish_batch(token);
        }
    }

    fn finish_batch(&mut self, token: u64) {
        let Some(batch) = self.batches.remove(&token) else {
            return;
        };
        for id in batch.regions {
            let slot = &mut self.regions[id as usize];
            if let Some(r) = slot {
                assert!(r.in_flight > 0, "region {id}: in-flight count underflow");
                r.in_flight -= 1;
                if r.fenced && r.in_flight == 0 {
                    *slot = None;
                }
            }
        }
        let result = match batch.error {
            Some(e) => {
                self.stats.failed_batches += 1;
                Err(e)
            }
            None => Ok(()),
        };
        // Device → host checksums are left to the runtime, which hashes
        // the landed pool pages when a backend reports none: this engine
        // never reads the bytes its DMA moved.
        self.ready.push_back(Completion {
            token: CompletionToken(token),
            result,
            checksums: Vec::new(),
        });
    }

    /// Retires every batch whose events completed. Never blocks.
    pub(crate) fn progress(&mut self) {
        let devices: Vec<Ordinal> = self.devices.keys().copied().collect();
        for device in devices {
            for direction in LANES {
                self.progress_lane(device, lane(direction));
            }
        }
    }

    fn progress_lane(&mut self, device: Ordinal, lane: usize) {
        while let Some(&Pending { token, event }) = self
            .devices
            .get(&device)
            .and_then(|d| d.queues[lane].front())
        {
            match self.driver.query(device, event) {
                Ok(false) => break,
                Ok(true) => {
                    if let Some(d) = self.devices.get_mut(&device) {
                        d.queues[lane].pop_front();
                        d.free.push(event);
                    }
                    self.finish_part(token, device, event, Ok(()));
                }
                Err(e) if e.is_fatal() => {
                    self.lose_device(device, &e);
                    break;
                }
                Err(e) => {
                    // The event is in an unknown state: retire it.
                    if let Some(d) = self.devices.get_mut(&device) {
                        d.queues[lane].pop_front();
                    }
                    self.driver.destroy_event(device, event);
                    if let Ok(fresh) = self.driver.create_event(device)
                        && let Some(d) = self.devices.get_mut(&device)
                    {
                        d.free.push(fresh);
                    }
                    self.finish_part(token, device, event, Err(failed("copy", &e)));
                }
            }
        }
    }

    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) {
        self.progress();
        out.extend(self.ready.drain(..));
    }

    pub(crate) fn query(&mut self, token: CompletionToken) -> TokenState {
        self.progress();
        if self.batches.contains_key(&token.0) {
            return TokenState::Pending;
        }
        match self.ready.iter().find(|c| c.token == token) {
            Some(c) => TokenState::Done(c.result.clone()),
            None => TokenState::Unknown,
        }
    }

    /// Makes later work on `stream` wait on the GPU for the batch.
    pub(crate) fn stream_wait(
        &mut self,
        token: CompletionToken,
        stream: u64,
    ) -> Result<(), CopyError> {
        let parts = match self.batches.get(&token.0) {
            Some(Batch { error: Some(e), .. }) => return Err(e.clone()),
            Some(b) => b.parts.clone(),
            None => {
                return match self.ready.iter().find(|c| c.token == token) {
                    Some(c) => c.result.clone(),
                    None => Err(CopyError::Failed(format!(
                        "token {} is unknown or already reported by poll",
                        token.0
                    ))),
                };
            }
        };
        for (device, event) in parts {
            self.driver
                .stream_wait(device, event, stream)
                .map_err(|e| failed("making the stream wait", &e))?;
        }
        Ok(())
    }
}

impl<D: Driver> Drop for Executor<D> {
    /// Waits for every stream before unpinning the pool, so no copy outlives
    /// the memory the caller promised to keep until now.
    fn drop(&mut self) {
        let devices: Vec<Ordinal> = self.devices.keys().copied().collect();
        for &device in &devices {
            let lost = self.devices.get(&device).is_some_and(|d| d.lost.is_some());
            if !lost && let Err(e) = self.driver.synchronize(device) {
                tracing::warn!(device, error = %e, "waiting for copies at shutdown failed");
            }
        }
        self.unpin_host();
        for device in devices {
            if let Some(state) = self.devices.remove(&device) {
                if state.lost.is_none() {
                    let events = state
                        .free
                        .into_iter()
                        .chain(state.queues.into_iter().flatten().map(|p| p.event));
                    for event in events {
                        self.driver.destroy_event(device, event);
                    }
                }
                self.driver.close_device(device);
            }
        }
    }
}
