//! Resources the stages share: time, the command inbox and event outbox, the
//! DRAM tier and its index, backing tiers, the copy engine, budgets, limits
//! and metrics.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bevy_ecs::prelude::*;
use orbitkv_components::api::{
    Addressed, Command, CommandId, CopyFailure, Event, MissReason, Origin,
};
use orbitkv_components::{KeyMap, StateKey};
use orbitkv_gpu::CopyEngine;
use orbitkv_io::dram::{HostPool, HostPoolConfig, SlotKey};
use orbitkv_io::lru::LruOrder;
use orbitkv_io::tier::BackingTier;
use serde::{Deserialize, Serialize};

/// Simulated or wall time, sampled once per tick by the runtime. Systems read
/// this and nothing else.
#[derive(Resource, Debug, Clone, Copy, Default)]
pub struct Clock {
    pub now_us: u64,
}

/// What a load reads, measured: index 0 the copies from DRAM into device
/// pages ([`LoadRates::DEVICE`]), index `1 + i` lower tier `i`'s reads into
/// DRAM. Each source's rate is taken over its busy periods (from the first
/// transfer in flight to the moment none is), so transfers that overlap
/// count as the bandwidth they reach together, and smoothed across
/// periods. Nothing is estimated before [`LoadRates::MIN_PERIODS`] periods
/// were measured.
///
/// Timed by the tick clock when it is simulated (deterministic), and by
/// the wall clock otherwise: a copy often lands within the tick it was
/// submitted in, shorter than the tick clock can see.
#[derive(Resource, Debug, Default)]
pub struct LoadRates {
    sources: Vec<Rate>,
    /// The wall clock's origin, when time is real.
    wall: Option<std::time::Instant>,
}

/// One source's measurement.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Rate {
    in_flight: u64,
    busy_since_ns: u64,
    bytes: u64,
    /// Smoothed bytes per microsecond over the measured periods.
    pub bytes_per_us: f64,
    /// Busy periods measured.
    pub periods: u64,
}

impl LoadRates {
    pub const DEVICE: usize = 0;
    /// Periods measured before a rate is used.
    pub const MIN_PERIODS: u64 = 3;
    /// Weight of a new period in the smoothed rate.
    const WEIGHT: f64 = 0.25;

    /// Timed by the tick clock (`simulated`) or by the wall clock.
    pub fn new(simulated: bool) -> LoadRates {
        LoadRates {
            sources: Vec::new(),
            wall: (!simulated).then(std::time::Instant::now),
        }
    }

    fn now_ns(&self, tick_now_us: u64) -> u64 {
        match self.wall {
            Some(t0) => u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX),
            None => tick_now_us.saturating_mul(1_000),
        }
    }

    fn source(&mut self, source: usize) -> &mut Rate {
        if self.sources.len() <= source {
            self.sources.resize(source + 1, Rate::default());
        }
        &mut self.sources[source]
    }

    /// A transfer of `source` started at `now_us`.
    pub fn started(&mut self, source: usize, now_us: u64) {
        let now = self.now_ns(now_us);
        let r = self.source(source);
        if r.in_flight == 0 {
            r.busy_since_ns = now;
            r.bytes = 0;
        }
        r.in_flight += 1;
    }

    /// A transfer of `source` ended at `now_us`, having moved `bytes` (0
    /// when it failed).
    pub fn finished(&mut self, source: usize, bytes: u64, now_us: u64) {
        let now = self.now_ns(now_us);
        let r = self.source(source);
        assert!(
            r.in_flight > 0,
            "a transfer of source {source} ended that never started"
        );
        r.in_flight -= 1;
        r.bytes += bytes;
        let busy = now.saturating_sub(r.busy_since_ns);
        if r.in_flight > 0 || busy == 0 || r.bytes == 0 {
            return;
        }
        let rate = r.bytes as f64 * 1_000.0 / busy as f64;
        r.bytes_per_us = if r.periods == 0 {
            rate
        } else {
            r.bytes_per_us + Self::WEIGHT * (rate - r.bytes_per_us)
        };
        r.periods += 1;
    }

    /// `source`'s rate once measured enough.
    pub fn bytes_per_us(&self, source: usize) -> Option<f64> {
        self.sources
            .get(source)
            .filter(|r| r.periods >= Self::MIN_PERIODS && r.bytes_per_us > 0.0)
            .map(|r| r.bytes_per_us)
    }

    /// Every source's measurement, by index.
    pub fn sources(&self) -> &[Rate] {
        &self.sources
    }
}

/// When a found prefix is worth loading (`[restore]`).
#[derive(Resource, Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RestorePolicy {
    /// A hit that would load fewer new tokens than this (the selected
    /// boundary less what the engine holds) misses `not_worth_loading`:
    /// the engine recomputes them, which costs less than a load's round
    /// trips and copies for a few tokens. 0 (the default) turns it off.
    pub min_load_tokens: u64,
    /// The engine's prefill throughput in tokens per second (0, the
    /// default: unknown, no cost gate). With it, a hit whose load would
    /// take longer than recomputing its new tokens misses
    /// `not_worth_loading`: the load's time is estimated from each source's
    /// measured rate ([`LoadRates`]: the lower tiers its pages are read
    /// from, then the copies into device pages), and a load from a source
    /// not measured yet is never refused on a guess.
    pub prefill_tokens_per_s: u64,
}

/// Every bound the stages enforce, by name.
#[derive(Resource, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Commands taken from the inbox per tick.
    pub max_commands_per_tick: usize,
    /// Commands waiting in the inbox; `submit` refuses beyond it.
    pub max_inbox: usize,
    /// Independent reads in flight per (operation, rank, group).
    pub max_reads_per_group: usize,
    /// Lower-tier reads in flight in total.
    pub max_inflight_reads: usize,
    /// Pages in one device copy batch.
    pub max_copy_batch_pages: usize,
    /// Device copy batches in flight.
    pub max_inflight_copies: usize,
    /// Pages per group in one query.
    pub max_query_pages: usize,
    /// Pages in one publish.
    pub max_publish_pages: usize,
    pub max_instances: usize,
    pub max_sessions: usize,
    pub max_ranks: usize,
    pub max_groups: usize,
    pub max_operations: usize,
    /// Page slots in one device region.
    pub max_region_slots: u32,
    /// Bytes of all manager-owned device regions together. Each is mapped
    /// in full (sparse, but address space all the same), so without this
    /// bound clients could fill the manager's address space and the next
    /// allocation would abort it. Agent-owned regions are the engine's
    /// memory and do not count.
    pub max_region_bytes: u64,
    /// Preparation limit: from query to restore submission.
    pub prepare_deadline_us: u64,
    /// Time a publish may wait for DRAM space and copy room; pages not
    /// submitted by then are dropped.
    pub publish_deadline_us: u64,
    /// Time from a restore's acceptance to the submission of its last copy
    /// batch; batches not submitted by then are abandoned and the restore
    /// misses with `deadline` once the submitted ones drained.
    pub restore_deadline_us: u64,
    pub max_evictions_per_tick: usize,
    /// A transfer not complete after this long is reported overdue and has
    /// failed: its operation replies then (`io_error`), while what the
    /// transfer may still touch stays held until it completes.
    pub transfer_timeout_us: u64,
    /// Agent copy batches in flight per origin (sent, not yet reported by
    /// `CopyDone`); more wait for room like local copies do.
    pub max_agent_copies_per_origin: usize,
    /// Time an agent has to report a copy. Past it the copy has failed and
    /// its operation replies at once (a restore misses with `deadline`),
    /// but its pins, leases and staging stay held until the agent reports
    /// or its origin closes: a late agent may still be touching them.
    pub agent_copy_deadline_us: u64,
    /// Size of each origin's staging area, the only memory an agent writes
    /// for the manager (publishes from agent-owned regions land there
    /// before the manager moves them into the pool).
    pub max_staging_bytes: u64,
    /// P/D handoffs (`Hold`) standing at once.
    pub max_handoffs: usize,
    /// The longest a handoff may pin its pages.
    pub max_handoff_deadline_us: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_commands_per_tick: 4096,
            max_inbox: 65536,
            max_reads_per_group: 8,
            max_inflight_reads: 256,
            max_copy_batch_pages: 1024,
            max_inflight_copies: 64,
            max_query_pages: 1 << 16,
            max_publish_pages: 4096,
            max_instances: 64,
            max_sessions: 1024,
            max_ranks: 64,
            max_groups: 16,
            max_operations: 1 << 16,
            max_region_slots: 1 << 22,
            max_region_bytes: 1 << 40,
            prepare_deadline_us: 5_000_000,
            publish_deadline_us: 5_000_000,
            restore_deadline_us: 5_000_000,
            max_evictions_per_tick: 4096,
            transfer_timeout_us: 10_000_000,
            max_agent_copies_per_origin: 64,
            agent_copy_deadline_us: 10_000_000,
            max_staging_bytes: 64 << 20,
            max_handoffs: 4096,
            max_handoff_deadline_us: 120_000_000,
        }
    }
}

/// Whether the clock is simulated (time moves only by `AdvanceClock`).
#[derive(Resource, Debug, Clone, Copy, Default)]
pub struct SimulatedClock(pub bool);

/// One entry of the inbox, taken in arrival order.
#[derive(Debug, Clone)]
pub enum Inbound {
    Command {
        id: CommandId,
        origin: Origin,
        command: Command,
    },
    /// The origin went away (a client disconnected): close every session it
    /// opened, as `CloseSession` would.
    CloseOrigin(Origin),
}

#[derive(Resource, Default)]
pub struct Inbox(pub VecDeque<Inbound>);

/// Events of the tick, each addressed to the origin it belongs to.
#[derive(Resource, Default)]
pub struct Outbox(pub Vec<Addressed>);

impl Outbox {
    /// Sends `event`, terminal as `Event::ends_by_default` says.
    pub fn push(&mut self, to: Origin, event: Event) {
        let terminal = event.ends_by_default();
        self.0.push(Addressed {
            to,
            event,
            terminal,
        });
    }

    /// Sends `event`, terminal as the caller decided.
    pub fn push_ending(&mut self, to: Origin, event: Event, terminal: bool) {
        self.0.push(Addressed {
            to,
            event,
            terminal,
        });
    }
}

/// Makes a `Send` value `Sync` by only ever handing out `&mut` access, so no
/// two threads can observe it at once.
pub struct Exclusive<T>(T);

// SAFETY: `Exclusive` exposes no `&T`, only `&mut T` through `&mut self`;
// shared references to it are useless, so sharing them across threads is
// sound for any `T: Send`.
unsafe impl<T: Send> Sync for Exclusive<T> {}

impl<T> Exclusive<T> {
    pub fn new(value: T) -> Self {
        Exclusive(value)
    }

    pub fn get_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

#[derive(Resource)]
pub struct Copier(pub Exclusive<Box<dyn CopyEngine>>);

#[derive(Resource)]
pub struct Tiers(pub Exclusive<Vec<Box<dyn BackingTier>>>);

/// The DRAM tier: the pool, the key index and per-class LRU of unleased
/// pages.
#[derive(Resource)]
pub struct Dram {
    pub pool: HostPool,
    pub index: KeyMap<Entity>,
    /// Keys with a lower-tier read in flight, so concurrent operations share
    /// one read instead of issuing two.
    pub reading: KeyMap<Entity>,
    /// Unleased resident pages per slot class. Leased pages are not in it,
    /// so eviction never has to skip one.
    pub lru: BTreeMap<u64, LruOrder<Entity>>,
    /// Slot classes an allocation failed for this tick, and how many slots.
    pub pressure: BTreeMap<u64, u64>,
    /// Slots of evicted pages a tier is writing straight from (in-place
    /// demotion), by (tier index, token): no page owns them any more, and
    /// they are freed only when the tier releases the token.
    pub demoting: BTreeMap<(usize, u64), u64>,
    /// `demoting`, counted per slot class: slots that will come free
    /// without evicting anything else.
    pub demoting_by_class: BTreeMap<u64, u64>,
    /// What the evict stage did in the current tick, per slot class
    /// (cleared when a tick starts): the invariants check it never evicted
    /// more than the allocations waiting for that class needed.
    pub evicted: BTreeMap<u64, Evicted>,
    /// Every change of `index`, in order, for the manager's event stream;
    /// kept only while one is on. Change `index` through
    /// [`Dram::index_page`] and [`Dram::unindex_page`] so none is missed.
    pub journal: PageJournal,
    /// Keys indexed since the handoff stage last looked, kept only while a
    /// handoff waits for pages (`watch_landings`).
    pub landed: Vec<StateKey>,
    pub watch_landings: bool,
}

/// One change of what DRAM holds: a page became restorable (its bytes and
/// checksum landed and it is in the index) or stopped being so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageChange {
    Stored(StateKey),
    Removed(StateKey, Removal),
}

/// Why a page left DRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Removal {
    /// Evicted for room (demoted to a lower tier first where one takes it).
    Evicted,
    /// Its namespace was cleared (`orbitkv clear`).
    Cleared,
}

/// The changes of the DRAM index since the last [`PageJournal::take`], at
/// most `cap` of them: past that they are dropped and the drain says so,
/// and the stream tells subscribers to forget what they were told (an
/// undercount, never a page advertised that is not here).
#[derive(Debug, Default)]
pub struct PageJournal {
    cap: usize,
    changes: Vec<PageChange>,
    lost: bool,
    /// The last [`RECENT_REMOVALS`] pages removed (and not stored again):
    /// a query that stops at one of them was likely routed on an event
    /// that had gone stale (a race the metrics count).
    recent: orbitkv_components::KeyMap<()>,
    recent_order: std::collections::VecDeque<StateKey>,
    /// Whether `recent` is kept: only while the pages are advertised (KV
    /// events), not for a reader that only mirrors the index (the
    /// manager's presence filter).
    races: bool,
}

/// Removed pages remembered for counting races, at most.
pub const RECENT_REMOVALS: usize = 65_536;

impl PageJournal {
    /// Starts recording, at most `cap` changes between drains.
    pub fn start(&mut self, cap: usize) {
        self.cap = cap;
    }

    pub fn is_on(&self) -> bool {
        self.cap > 0
    }

    /// Keeps the recent removals from now on: the pages are advertised,
    /// and a query that stops at one removed lately is counted as a race.
    pub fn count_races(&mut self) {
        self.races = true;
    }

    /// Whether a query's stop at a page removed lately is a race to count.
    pub fn counts_races(&self) -> bool {
        self.races && self.cap > 0
    }

    fn push(&mut self, change: PageChange) {
        if self.cap == 0 {
            return;
        }
        if !self.races {
            return self.record(change);
        }
        match change {
            PageChange::Stored(k) => {
                self.recent.remove(&k);
            }
            PageChange::Removed(k, _) => {
                if self.recent.insert(k, ()).is_none() {
                    self.recent_order.push_back(k);
                }
                while self.recent.len() > RECENT_REMOVALS {
                    let Some(old) = self.recent_order.pop_front() else {
                        break;
                    };
                    self.recent.remove(&old);
                }
                // Keys stored again leave stale order entries; bounded.
                if self.recent_order.len() > 2 * RECENT_REMOVALS {
                    let recent = &self.recent;
                    self.recent_order.retain(|k| recent.contains_key(k));
                }
            }
        }
        self.record(change);
    }

    /// Keeps `change` for the next drain, or notes the loss past `cap`.
    fn record(&mut self, change: PageChange) {
        if self.changes.len() >= self.cap {
            self.changes.clear();
            self.lost = true;
            return;
        }
        self.changes.push(change);
    }

    /// Whether `key` left DRAM lately (among the last
    /// [`RECENT_REMOVALS`] removals) and was not stored again.
    pub fn removed_lately(&self, key: &orbitkv_components::KeyRef<'_>) -> bool {
        self.recent.contains_key(key)
    }

    /// Moves the recorded changes to `out`; true when some were lost
    /// since the last drain (then `out` holds only what came after).
    pub fn take(&mut self, out: &mut Vec<PageChange>) -> bool {
        out.append(&mut self.changes);
        std::mem::take(&mut self.lost)
    }
}

/// The evict stage's work on one slot class in one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    /// Slots the failed allocations of the tick asked for.
    pub pressure: u64,
    /// Pages evicted for them.
    pub pages: u64,
}

impl Dram {
    pub fn new(pool: HostPool) -> Self {
        Dram {
            pool,
            index: KeyMap::default(),
            reading: KeyMap::default(),
            lru: BTreeMap::new(),
            pressure: BTreeMap::new(),
            demoting: BTreeMap::new(),
            demoting_by_class: BTreeMap::new(),
            evicted: BTreeMap::new(),
            journal: PageJournal::default(),
            landed: Vec::new(),
            watch_landings: false,
        }
    }

    /// Indexes a page whose bytes and checksum landed: from now on a query
    /// finds it.
    pub fn index_page(&mut self, key: StateKey, page: Entity) {
        let previous = self.index.insert(key, page);
        assert!(previous.is_none(), "a key was indexed twice");
        self.journal.push(PageChange::Stored(key));
        if self.watch_landings {
            self.landed.push(key);
        }
    }

    /// Takes a page out of the index: no query finds it from now on.
    pub fn unindex_page(&mut self, key: &StateKey, why: Removal) -> Option<Entity> {
        let page = self.index.remove(key)?;
        self.journal.push(PageChange::Removed(*key, why));
        Some(page)
    }

    /// An evicted page's slot stays allocated while `tier` writes from it.
    pub fn hold_for_demotion(&mut self, tier: usize, token: u64, slot: u64) {
        let class = self.class_of(slot);
        let previous = self.demoting.insert((tier, token), slot);
        assert!(
            previous.is_none(),
            "tier {tier} reused in-place demotion token {token}"
        );
        *self.demoting_by_class.entry(class).or_default() += 1;
    }

    /// The tier no longer reads the slot behind `token`: free it. A token
    /// the runtime does not hold is a tier bug; it is ignored here (never
    /// a double free) and returned as `false` for the caller to count.
    pub fn release_demotion(&mut self, tier: usize, token: u64) -> bool {
        let Some(slot) = self.demoting.remove(&(tier, token)) else {
            return false;
        };
        let class = self.class_of(slot);
        let held = self.demoting_by_class.entry(class).or_default();
        decrement(held, 1, "dram.demoting_by_class");
        if *held == 0 {
            self.demoting_by_class.remove(&class);
        }
        self.free(slot);
        true
    }

    /// Slots of `class` that in-place demotions will give back.
    pub fn demoting_in(&self, class: u64) -> u64 {
        self.demoting_by_class.get(&class).copied().unwrap_or(0)
    }

    /// Slots that will serve an allocation of `class` without evicting
    /// anything more: free ones (including those freed earlier in the tick)
    /// and those in-place demotions will give back.
    pub fn coming_free(&self, class: u64) -> u64 {
        self.pool.free_slots(class) + self.demoting_in(class)
    }

    /// Allocates a slot; on failure records pressure for the evict stage.
    pub fn alloc(&mut self, bytes: u64) -> Option<(u64, u64)> {
        match self.pool.alloc(bytes) {
            Ok(key) => {
                let offset = self.pool.offset(key).expect("fresh slot has an offset");
                Some((key.to_bits(), offset))
            }
            Err(_) => {
                let class = bytes.next_multiple_of(self.pool.slot_align());
                *self.pressure.entry(class).or_default() += 1;
                None
            }
        }
    }

    pub fn free(&mut self, slot: u64) {
        // A slot is freed exactly once by its owner; a failure here is a bug
        // the invariant checks report.
        let _ = self.pool.free(SlotKey::from_bits(slot));
    }

    pub fn class_of(&self, slot: u64) -> u64 {
        self.pool.slot_len(SlotKey::from_bits(slot)).unwrap_or(0)
    }

    /// The page became unleased: it may be evicted, least recent first.
    pub fn make_evictable(&mut self, page: Entity, slot: u64) {
        let class = self.class_of(slot);
        self.lru.entry(class).or_default().touch(page);
    }

    pub fn pin(&mut self, page: Entity, slot: u64) {
        let class = self.class_of(slot);
        if let Some(lru) = self.lru.get_mut(&class) {
            lru.remove(page);
        }
    }

    pub fn slot_bytes(&self, slot: u64, len: u64) -> Option<&[u8]> {
        self.pool.bytes(SlotKey::from_bits(slot), len)
    }
}

/// One agent copy the runtime sent and has not fenced yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentCopyEntry {
    /// The origin it was sent to: the only one that may report it.
    pub origin: Origin,
    /// Its Transfer entity.
    pub transfer: Entity,
}

/// Copy agents: the copies sent to them, what they reported, and each
/// origin's staging area. The runtime never maps an agent's region; it
/// sends `Event::AgentCopy` and waits for `Command::CopyDone`.
#[derive(Resource)]
pub struct Agents {
    next_copy: u64,
    /// Sent and not reported, by copy id.
    pub sent: HashMap<u64, AgentCopyEntry>,
    /// Reported (or failed by the runtime), for the fence to land; a
    /// success carries the agent's page checksums (publishes).
    pub reported: Vec<(u64, Entity, Result<Vec<u64>, CopyFailure>)>,
    /// This tick's copy events, moved to the outbox after the copy stages.
    pub events: Vec<Addressed>,
    /// Each origin's staging area, created with its first agent region.
    pub staging: HashMap<Origin, HostPool>,
    /// The shape of a staging area: extent and slot alignment of the DRAM
    /// pool (so every page that fits the pool fits it), and its size.
    pub staging_shape: (u64, u64),
}

impl Agents {
    pub fn new(extent_bytes: u64, slot_align: u64) -> Self {
        Agents {
            next_copy: 1,
            sent: HashMap::new(),
            reported: Vec::new(),
            events: Vec::new(),
            staging: HashMap::new(),
            staging_shape: (extent_bytes, slot_align),
        }
    }

    /// Copies of `origin` sent and not reported.
    pub fn in_flight(&self, origin: Origin) -> usize {
        self.sent.values().filter(|e| e.origin == origin).count()
    }

    /// A fresh copy id (never reused: a late report of a fenced copy is
    /// `unknown_copy`, never another copy's).
    pub fn next_id(&mut self) -> u64 {
        let id = self.next_copy;
        self.next_copy += 1;
        id
    }

    /// Creates `origin`'s staging area of `bytes` if it has none.
    pub fn ensure_staging(&mut self, origin: Origin, bytes: u64) -> Result<(), String> {
        if self.staging.contains_key(&origin) {
            return Ok(());
        }
        let (extent_bytes, slot_align) = self.staging_shape;
        let pool = HostPool::staging(HostPoolConfig {
            capacity_bytes: bytes,
            extent_bytes,
            slot_align,
            shared: true,
        })
        .map_err(|e| e.to_string())?;
        self.staging.insert(origin, pool);
        Ok(())
    }

    /// Fails every copy sent to `origin` (it went away): the fence lands
    /// them as failed.
    pub fn lose(&mut self, origin: Origin) {
        let mut lost: Vec<u64> = self
            .sent
            .iter()
            .filter(|(_, e)| e.origin == origin)
            .map(|(id, _)| *id)
            .collect();
        lost.sort_unstable();
        for id in lost {
            let entry = self.sent.remove(&id).expect("collected above");
            self.reported
                .push((id, entry.transfer, Err(CopyFailure::Lost)));
        }
    }
}

/// Adds `n` to the counter of `name`, allocating its name only the first
/// time (counters by outcome are bumped per page on the tick thread).
pub fn add_named(counters: &mut BTreeMap<String, u64>, name: &str, n: u64) {
    match counters.get_mut(name) {
        Some(c) => *c += n,
        None => {
            counters.insert(name.to_owned(), n);
        }
    }
}

/// Subtracts `n` from a counter kept by hand, asserting it holds that much:
/// a double return is a bug that must stop here, not wrap into a budget
/// that is full forever.
pub fn decrement<T>(counter: &mut T, n: T, what: &str)
where
    T: Copy + PartialOrd + std::ops::SubAssign + std::fmt::Debug,
{
    assert!(
        *counter >= n,
        "{what}: returning {n:?} of {:?} held",
        *counter
    );
    *counter -= n;
}

/// Byte budget for recovery: reserved from admission until retire.
#[derive(Resource, Debug, Clone, Default)]
pub struct Budget {
    pub global_limit: u64,
    pub instance_limit: u64,
    /// Speculative work may hold at most this much.
    pub speculative_limit: u64,
    pub reserved: u64,
    pub speculative_reserved: u64,
}

impl Budget {
    pub fn reserve(&mut self, bytes: u64, speculative: bool) {
        self.reserved += bytes;
        if speculative {
            self.speculative_reserved += bytes;
        }
    }

    pub fn release(&mut self, bytes: u64, speculative: bool) {
        decrement(&mut self.reserved, bytes, "budget.reserved");
        if speculative {
            decrement(
                &mut self.speculative_reserved,
                bytes,
                "budget.speculative_reserved",
            );
        }
    }
}

/// Instances by name, the identity of this manager incarnation, and the
/// live session and operation counts `max_sessions` and `max_operations`
/// bound (asserted on every decrement).
#[derive(Resource, Debug, Default)]
pub struct Registry {
    pub instances: HashMap<String, Entity>,
    pub incarnation: u64,
    pub next_epoch: u64,
    pub sessions: usize,
    pub operations: usize,
}

/// The standing P/D handoffs (`Handoff` entities): by id, the promised
/// keys not yet in DRAM (each may be promised by several handoffs: prompts
/// share prefixes), and the bytes they reserved.
#[derive(Resource, Debug, Default)]
pub struct Handoffs {
    pub by_id: HashMap<u64, Entity>,
    pub wanted: KeyMap<Vec<Entity>>,
    pub reserved: u64,
    pub budget: u64,
    pub counts: HandoffCounts,
}

/// How handoffs ended (`orbitkv_handoffs_total{outcome}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HandoffCounts {
    pub held: u64,
    /// A load naming it took the pages.
    pub taken: u64,
    /// Its deadline passed first.
    pub expired: u64,
    /// Promised pages pinned as they landed after the `Hold`.
    pub pinned_late: u64,
}

/// In-flight transfers by completion token.
#[derive(Resource, Debug, Default)]
pub struct TransferIndex {
    pub copies: HashMap<u64, Entity>,
    pub reads: HashMap<(usize, u64), Entity>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictReason {
    /// DRAM was full and an allocation needed the slot.
    Capacity,
}

/// Counters for reports and `/metrics`.
#[derive(Resource, Debug, Clone, Default, Serialize)]
pub struct Metrics {
    pub queries: u64,
    /// Tokens past the origin that queries asked about.
    pub queried_tokens: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub misses: BTreeMap<MissReason, u64>,
    pub restores: u64,
    pub bytes_restored: u64,
    pub publishes: u64,
    pub pages_published: u64,
    pub publish_duplicates: u64,
    pub publish_dropped: u64,
    pub bytes_published: u64,
    pub tier_reads: u64,
    pub bytes_read: u64,
    /// Bytes read into DRAM, per lower tier.
    pub bytes_read_by_tier: BTreeMap<String, u64>,
    pub checksum_failures: u64,
    /// Published pages an agent copied whose staged bytes did not match
    /// the checksum the agent took from its own memory (or came without
    /// one): refused, never stored. Counted in `checksum_failures` too.
    pub publish_checksum_refused: u64,
    pub evictions: BTreeMap<EvictReason, u64>,
    pub commands_rejected: u64,
    /// Refused commands by `"<command>.<reason>"` (`Command::kind`,
    /// `CommandError::reason`): a refusal is never counted as a miss or as
    /// unavailability. Bounded: both parts come from fixed sets.
    pub refusals: BTreeMap<String, u64>,
    pub transfers_overdue: u64,
    /// Queries (with the KV event stream on) whose prefix stopped at a page
    /// DRAM held and removed lately: a router that sent the request there
    /// trusted an event that had gone stale (a race, never a false hit).
    pub event_races: u64,
    /// Copy batches sent to copy agents, and those that failed, by reason.
    pub agent_copies: u64,
    pub agent_copy_failures: BTreeMap<String, u64>,
    /// Evicted pages offered to a lower tier: `submitted`, or the refusal
    /// reason; then `written` or `failed` as the writes finish.
    pub demotions: BTreeMap<String, u64>,
    /// Published pages offered to a tier that shares them (write-through):
    /// `submitted`, or the refusal reason.
    pub write_through: BTreeMap<String, u64>,
}

impl Metrics {
    pub fn miss(&mut self, reason: MissReason) {
        *self.misses.entry(reason).or_default() += 1;
    }

    pub fn refused(&mut self, command: &str, error: &orbitkv_components::api::CommandError) {
        self.commands_rejected += 1;
        *self
            .refusals
            .entry(format!("{command}.{}", error.reason()))
            .or_default() += 1;
    }
}
