//! Deterministic copy engine for replays and runtime tests: completion time
//! is a pure function of the submit time, the batch size and the config, and
//! nothing happens between calls. Fault hooks let simulations inject failed,
//! slow or stalled copies reproducibly.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::host::{DeviceArena, HostPool};
use crate::{Completion, CompletionToken, CopyEngine, CopyError, Direction, PageCopy, RegionId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimCopyConfig {
    /// Fixed cost of every batch.
    pub latency_us: u64,
    /// Transfer rate; 0 means infinitely fast.
    pub bytes_per_us: u64,
    pub max_in_flight_batches: usize,
}

impl Default for SimCopyConfig {
    fn default() -> Self {
        Self {
            latency_us: 10,
            bytes_per_us: 10_000,
            max_in_flight_batches: 64,
        }
    }
}

struct Pending {
    direction: Direction,
    host: HostPool,
    copies: Vec<PageCopy>,
}

/// Injected faults, shared between the engine and its [`SimCopyControl`]s.
#[derive(Debug, Default)]
struct Faults {
    fail_next: usize,
    lose_next: usize,
    extra_latency_us: u64,
    /// Up to this much extra latency per batch, drawn from `jitter_state`:
    /// batches then complete out of submission order.
    jitter_us: u64,
    jitter_state: u64,
    held: bool,
}

/// Completes batches in simulated time; bytes move only when `poll` reports
/// the batch, so nothing is visible early.
pub struct SimCopyEngine {
    config: SimCopyConfig,
    arena: DeviceArena,
    host: Option<HostPool>,
    /// Keyed by (due_us, token): iteration order is completion order.
    pending: BTreeMap<(u64, CompletionToken), Pending>,
    /// Batches whose completion was lost: never reported, still in flight.
    lost: usize,
    next_token: u64,
    faults: Arc<Mutex<Faults>>,
}

/// Fault injection into a [`SimCopyEngine`] that something else owns (the
/// runtime), for replays and the fuzzer.
#[derive(Clone)]
pub struct SimCopyControl(Arc<Mutex<Faults>>);

fn faults(f: &Mutex<Faults>) -> MutexGuard<'_, Faults> {
    // Plain counters: a panic elsewhere cannot leave them inconsistent.
    f.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimCopyControl {
    /// The next `n` batches to complete report `Failed("injected")` and copy
    /// nothing.
    pub fn fail_next(&self, n: usize) {
        faults(&self.0).fail_next = n;
    }

    /// The next `n` batches submitted never complete: their completion is
    /// lost, and they stay in flight.
    pub fn lose_next(&self, n: usize) {
        faults(&self.0).lose_next = n;
    }

    /// Batches submitted from now on take `extra_us` longer.
    pub fn delay_all(&self, extra_us: u64) {
        faults(&self.0).extra_latency_us = extra_us;
    }

    /// Batches submitted from now on get up to `max_us` of extra latency,
    /// drawn deterministically from `seed`, so they complete reordered.
    pub fn jitter(&self, max_us: u64, seed: u64) {
        let mut f = faults(&self.0);
        f.jitter_us = max_us;
        f.jitter_state = seed | 1;
    }

    /// While held, `poll` reports nothing.
    pub fn hold(&self, held: bool) {
        faults(&self.0).held = held;
    }
}

impl SimCopyEngine {
    pub fn new(config: SimCopyConfig) -> Self {
        Self {
            config,
            arena: DeviceArena::default(),
            host: None,
            pending: BTreeMap::new(),
            lost: 0,
            next_token: 0,
            faults: Arc::default(),
        }
    }

    /// A handle for injecting faults after the engine is handed away.
    pub fn control(&self) -> SimCopyControl {
        SimCopyControl(self.faults.clone())
    }

    /// A handle to the device regions.
    pub fn arena(&self) -> DeviceArena {
        self.arena.clone()
    }

    /// The next `n` batches to complete (in completion order) report
    /// `Failed("injected")` and copy nothing.
    pub fn fail_next(&mut self, n: usize) {
        self.control().fail_next(n);
    }

    /// Batches submitted from now on take `extra_us` longer; replaces any
    /// earlier delay (0 removes it). Batches already in flight keep theirs.
    pub fn delay_all(&mut self, extra_us: u64) {
        self.control().delay_all(extra_us);
    }

    /// While held, `poll` reports nothing; due batches complete at the
    /// first poll after release.
    pub fn hold(&mut self, held: bool) {
        self.control().hold(held);
    }

    fn due_us(&self, now_us: u64, copies: &[PageCopy]) -> u64 {
        let bytes = copies.iter().fold(0u64, |sum, c| sum.saturating_add(c.len));
        let transfer_us = bytes.checked_div(self.config.bytes_per_us).unwrap_or(0);
        let mut f = faults(&self.faults);
        let jitter = if f.jitter_us > 0 {
            f.jitter_state ^= f.jitter_state << 13;
            f.jitter_state ^= f.jitter_state >> 7;
            f.jitter_state ^= f.jitter_state << 17;
            f.jitter_state % (f.jitter_us + 1)
        } else {
            0
        };
        now_us
            .saturating_add(self.config.latency_us)
            .saturating_add(f.extra_latency_us)
            .saturating_add(jitter)
            .saturating_add(transfer_us)
    }
}

impl CopyEngine for SimCopyEngine {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn register_device_region(&mut self, bytes: u64) -> Result<RegionId, CopyError> {
        self.arena.register(bytes)
    }

    fn unregister_device_region(&mut self, region: RegionId) -> Result<(), CopyError> {
        self.arena.unregister(region)
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
        now_us: u64,
    ) -> Result<CompletionToken, CopyError> {
        self.arena.validate(self.host.as_ref(), copies)?;
        let host = self.host.ok_or(CopyError::NoHostPool)?;
        let limit = self.config.max_in_flight_batches;
        if self.in_flight() >= limit {
            return Err(CopyError::QueueFull(self.in_flight(), limit));
        }
        let token = CompletionToken(self.next_token);
        self.next_token += 1;
        {
            let mut f = faults(&self.faults);
            if f.lose_next > 0 {
                f.lose_next -= 1;
                self.lost += 1;
                return Ok(token);
            }
        }
        let pending = Pending {
            direction,
            host,
            copies: copies.to_vec(),
        };
        self.pending
            .insert((self.due_us(now_us, copies), token), pending);
        Ok(token)
    }

    fn poll(&mut self, now_us: u64, out: &mut Vec<Completion>) {
        if faults(&self.faults).held {
            return;
        }
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now_us {
                break;
            }
            let ((_, token), batch) = entry.remove_entry();
            let fail = {
                let mut f = faults(&self.faults);
                let fail = f.fail_next > 0;
                f.fail_next = f.fail_next.saturating_sub(1);
                fail
            };
            let copied = if fail {
                Err(CopyError::Failed("injected".into()))
            } else {
                self.arena
                    .copy_batch(&batch.host, batch.direction, &batch.copies)
            };
            let (result, checksums) = match copied {
                Ok(sums) => (Ok(()), sums),
                Err(e) => (Err(e), Vec::new()),
            };
            out.push(Completion {
                token,
                result,
                checksums,
            });
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.lost
    }
}
