//! Deterministic copy engine for replays and runtime tests: completion time
//! is a pure function of the submit time, the batch size and the config, and
//! nothing happens between calls. Fault hooks let simulations inject failed,
//! slow or stalled copies reproducibly.

use std::collections::BTreeMap;

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

/// Completes batches in simulated time; bytes move only when `poll` reports
/// the batch, so nothing is visible early.
pub struct SimCopyEngine {
    config: SimCopyConfig,
    arena: DeviceArena,
    host: Option<HostPool>,
    /// Keyed by (due_us, token): iteration order is completion order.
    pending: BTreeMap<(u64, CompletionToken), Pending>,
    next_token: u64,
    fail_next: usize,
    extra_latency_us: u64,
    held: bool,
}

impl SimCopyEngine {
    pub fn new(config: SimCopyConfig) -> Self {
        Self {
            config,
            arena: DeviceArena::default(),
            host: None,
            pending: BTreeMap::new(),
            next_token: 0,
            fail_next: 0,
            extra_latency_us: 0,
            held: false,
        }
    }

    /// A handle to the device regions.
    pub fn arena(&self) -> DeviceArena {
        self.arena.clone()
    }

    /// The next `n` batches to complete (in completion order) report
    /// `Failed("injected")` and copy nothing.
    pub fn fail_next(&mut self, n: usize) {
        self.fail_next = n;
    }

    /// Batches submitted from now on take `extra_us` longer; replaces any
    /// earlier delay (0 removes it). Batches already in flight keep theirs.
    pub fn delay_all(&mut self, extra_us: u64) {
        self.extra_latency_us = extra_us;
    }

    /// While held, `poll` reports nothing; due batches complete at the
    /// first poll after release.
    pub fn hold(&mut self, held: bool) {
        self.held = held;
    }

    fn due_us(&self, now_us: u64, copies: &[PageCopy]) -> u64 {
        let bytes = copies.iter().fold(0u64, |sum, c| sum.saturating_add(c.len));
        let transfer_us = bytes.checked_div(self.config.bytes_per_us).unwrap_or(0);
        now_us
            .saturating_add(self.config.latency_us)
            .saturating_add(self.extra_latency_us)
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
        if self.pending.len() >= limit {
            return Err(CopyError::QueueFull(self.pending.len(), limit));
        }
        let token = CompletionToken(self.next_token);
        self.next_token += 1;
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
        if self.held {
            return;
        }
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now_us {
                break;
            }
            let ((_, token), batch) = entry.remove_entry();
            let result = if self.fail_next > 0 {
                self.fail_next -= 1;
                Err(CopyError::Failed("injected".into()))
            } else {
                self.arena
                    .copy_batch(&batch.host, batch.direction, &batch.copies)
            };
            out.push(Completion { token, result });
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}
