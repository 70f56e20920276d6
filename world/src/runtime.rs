//! [`Runtime`]: commands in, events out, one `tick` at a time.

use std::time::Instant;

use bevy_ecs::prelude::*;
use orbitkv_components::StateKey;
use orbitkv_components::api::{Addressed, Command, CommandId, Origin};
use orbitkv_components::ecs::{
    DevicePage, Handoff, HeldLeases, Instance, Lease, Operation, Session, Transfer, TransferOf,
    Transfers, at,
};
use orbitkv_gpu::CopyEngine;
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
use orbitkv_io::dram::{FirstTouchReport, HostPool, HostPoolConfig, PoolStats};
use orbitkv_io::tier::{BackingTier, TierChange};
use orbitkv_systems::resources::{
    Agents, Budget, Clock, Copier, Dram, Exclusive, Handoffs, Inbound, Inbox, Limits, LoadRates,
    Metrics, Outbox, PageChange, Registry, SimulatedClock, Tiers, TransferIndex,
};
use serde::Serialize;

use crate::config::{Config, ConfigError};
use crate::record::Recorder;
use crate::{invariants, schedule};

/// What the runtime moves bytes with.
pub struct Backends {
    pub copy: Box<dyn CopyEngine>,
    /// Lower tiers, consulted in order after DRAM.
    pub tiers: Vec<Box<dyn BackingTier>>,
    /// Time moves only by `Command::AdvanceClock` (replays, tests).
    pub simulated_clock: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("registering the host pool with {backend}: {reason}")]
    Register { backend: String, reason: String },
    #[error("SSD tier: {0}")]
    Ssd(#[from] orbitkv_io::ssd::SsdError),
    #[error("remote tier: {0}")]
    Remote(#[from] orbitkv_io::remote::RemoteError),
}

/// What [`Runtime::answer_now`] did with a command.
#[derive(Debug)]
pub enum Answer {
    /// Answered: its id and every event it produced (one, terminal).
    Now(CommandId, Vec<Addressed>),
    /// Not answerable between ticks: submit it.
    Queue(Command),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("inbox is full ({0} commands); tick to drain it")]
    InboxFull(usize),
}

/// A snapshot for reports, tests and metrics.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub now_us: u64,
    pub instances: usize,
    pub sessions: usize,
    pub operations: usize,
    /// Live operations per state.
    pub operations_by_state: std::collections::BTreeMap<&'static str, usize>,
    pub pages: usize,
    pub leases: usize,
    pub transfers: usize,
    pub device_pages: usize,
    pub bytes_reserved: u64,
    pub pool_bytes_used: u64,
    pub pool_capacity_bytes: u64,
    pub metrics: Metrics,
    /// What a load reads, measured (`LoadRates`): the copies into device
    /// pages, then each lower tier's reads.
    pub load_rates: Vec<LoadRate>,
    pub handoffs: HandoffStats,
}

/// The P/D handoffs (`Hold`) standing now, and how the ended ones ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HandoffStats {
    pub standing: usize,
    /// Promised pages pinned now, over every standing handoff.
    pub pinned_pages: u64,
    pub reserved_bytes: u64,
    pub budget_bytes: u64,
    pub counts: orbitkv_systems::resources::HandoffCounts,
}

/// A namespace as [`Runtime::namespaces`] describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct NamespaceInfo {
    pub namespace: orbitkv_components::Namespace,
    pub instance: String,
    /// Index of the rank in the instance (sorted by pp, tp).
    pub rank: u32,
    pub page_tokens: u64,
    /// (storage group, its rule).
    pub groups: Vec<(u32, orbitkv_components::Rule)>,
}

/// One source's measured load rate (`[restore] prefill_tokens_per_s`
/// weighs loads against it).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadRate {
    /// `device` (copies from DRAM into device pages) or a tier's name.
    pub source: String,
    /// Smoothed over its busy periods; 0 before the first.
    pub bytes_per_second: u64,
    /// Busy periods measured; the cost gate uses a rate from
    /// `LoadRates::MIN_PERIODS` on.
    pub periods: u64,
}

/// One live operation: what holds it, for liveness checks and operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OperationInfo {
    pub operation: u64,
    pub origin: Origin,
    pub state: &'static str,
    pub deadline_us: u64,
    /// Transfers of it not yet fenced, and of those the overdue ones (a
    /// completion that may never come: they keep holding what they own).
    pub in_flight: u32,
    pub overdue_transfers: usize,
    pub leases: usize,
    pub bytes_reserved: u64,
    /// Its final reply went out (a query's miss, or the outcome once
    /// nothing in flight could change it); what it still holds waits for
    /// overdue transfers.
    pub reported: bool,
}

/// The runtime's `World`: every resource built from a config, the LRU
/// hooks registered, and the backends registered with the DRAM pool.
/// The stages run on it (`Runtime::tick`, or one at a time with
/// `RunSystemOnce` in the stage tests). Dropping it drains the backends
/// before the pool is unmapped.
pub struct RuntimeWorld {
    world: World,
}

impl std::ops::Deref for RuntimeWorld {
    type Target = World;
    fn deref(&self) -> &World {
        &self.world
    }
}

impl std::ops::DerefMut for RuntimeWorld {
    fn deref_mut(&mut self) -> &mut World {
        &mut self.world
    }
}

impl Drop for RuntimeWorld {
    fn drop(&mut self) {
        // Backends go first: dropping them finishes submitted I/O, which
        // writes into the pool the world still owns.
        drop(self.world.remove_resource::<Copier>());
        drop(self.world.remove_resource::<Tiers>());
    }
}

impl RuntimeWorld {
    pub fn build(
        config: &Config,
        mut backends: Backends,
    ) -> Result<(RuntimeWorld, Option<FirstTouchReport>), RuntimeError> {
        config.validate()?;
        let mut pool = HostPool::new(HostPoolConfig {
            capacity_bytes: config.dram.capacity_bytes,
            extent_bytes: config.dram.extent_bytes,
            slot_align: config.dram.slot_align_bytes,
            shared: config.dram.shared,
        })
        .map_err(|e| ConfigError::Pool(e.to_string()))?;
        let first_touch = config.dram.first_touch.then(|| pool.first_touch());
        let (base, len) = (pool.base_ptr(), pool.capacity());
        // SAFETY: the pool's mapping lives in the `Dram` resource and never
        // moves; `Drop for RuntimeWorld` drops the engine and tiers
        // (draining their I/O) before the world drops the pool. Slots under
        // I/O are owned by Transfer entities, so nothing else touches them.
        unsafe {
            let copy = &mut backends.copy;
            copy.register_host_pool(base, len)
                .map_err(|e| RuntimeError::Register {
                    backend: copy.name().to_owned(),
                    reason: e.to_string(),
                })?;
            for tier in backends.tiers.iter_mut() {
                tier.register_host_pool(base, len)
                    .map_err(|e| RuntimeError::Register {
                        backend: tier.name().to_owned(),
                        reason: e.to_string(),
                    })?;
            }
        }
        let mut world = World::new();
        world.insert_resource(Clock::default());
        world.insert_resource(SimulatedClock(backends.simulated_clock));
        world.insert_resource(config.limits.clone());
        world.insert_resource(config.restore);
        world.insert_resource(LoadRates::new(backends.simulated_clock));
        world.insert_resource(Inbox::default());
        world.insert_resource(Outbox::default());
        world.insert_resource(Dram::new(pool));
        world.insert_resource(Copier(Exclusive::new(backends.copy)));
        world.insert_resource(Tiers(Exclusive::new(backends.tiers)));
        world.insert_resource(Budget {
            global_limit: config.query_budget(),
            instance_limit: config.instance_budget(),
            speculative_limit: config.speculative_budget(),
            reserved: 0,
            speculative_reserved: 0,
        });
        world.insert_resource(Handoffs {
            budget: config.handoff_budget(),
            ..Default::default()
        });
        world.insert_resource(Registry {
            incarnation: config.incarnation,
            ..Default::default()
        });
        world.insert_resource(TransferIndex::default());
        world.insert_resource(Agents::new(
            config.dram.extent_bytes,
            config.dram.slot_align_bytes,
        ));
        world.insert_resource(Metrics::default());
        // The LRU holds exactly the unleased pages: leases come and go with
        // the ECS's `Leases` lists (hooks: a call per page, not a system).
        world
            .register_component_hooks::<orbitkv_components::ecs::Leases>()
            .on_add(orbitkv_systems::lifecycle::on_leased)
            .on_remove(orbitkv_systems::lifecycle::on_unleased);
        Ok((RuntimeWorld { world }, first_touch))
    }
}

/// Operations a tick moves on without new input (`Runtime::progressing`).
type Progressing = QueryState<
    (),
    Or<(
        With<at::Reading>,
        With<at::RestorePending>,
        With<at::PublishPending>,
        With<at::Finishing>,
    )>,
>;

pub struct Runtime {
    pub(crate) world: RuntimeWorld,
    /// Built once: a query state costs allocations and archetype matching
    /// to build, and the manager asks every round of its loop.
    progressing: Progressing,
    schedule: Schedule,
    started: Instant,
    simulated: bool,
    check: bool,
    next_command: CommandId,
    max_inbox: usize,
    first_touch: Option<FirstTouchReport>,
    config: Config,
    recorder: Option<Recorder>,
    remote_stats: Option<orbitkv_io::remote::RemoteStatsHandle>,
}

impl Runtime {
    /// A runtime with the host copy engine, the configured SSD and remote
    /// tiers (if any, in that lookup order), and wall time.
    pub fn new(config: Config) -> Result<Self, RuntimeError> {
        let copy = HostCopyEngine::new(HostCopyConfig {
            workers: config.copy.workers,
            max_in_flight_batches: config.copy.max_in_flight_batches,
            shared_regions: config.copy.shared_regions,
        });
        let mut tiers: Vec<Box<dyn BackingTier>> = Vec::new();
        if let Some(ssd) = &config.ssd {
            tiers.push(Box::new(orbitkv_io::ssd::SsdStore::open(ssd.clone())?));
        }
        let mut remote_stats = None;
        if let Some(remote) = &config.remote {
            // Records name the manager incarnation that wrote them.
            let tier = orbitkv_io::remote::RemoteTier::open(remote.clone(), config.incarnation)?;
            remote_stats = Some(tier.stats_handle());
            tiers.push(Box::new(tier));
        }
        let mut rt = Self::with_backends(
            config,
            Backends {
                copy: Box::new(copy),
                tiers,
                simulated_clock: false,
            },
        )?;
        rt.remote_stats = remote_stats;
        Ok(rt)
    }

    /// The remote tier's counters, when `Config::remote` is set.
    pub fn remote_stats(&self) -> Option<orbitkv_io::remote::RemoteStatsSnapshot> {
        self.remote_stats.as_ref().map(|h| h.snapshot())
    }

    /// A handle that reads the remote tier's counters from any thread (the
    /// manager's metrics collector), when `Config::remote` is set.
    pub fn remote_stats_handle(&self) -> Option<orbitkv_io::remote::RemoteStatsHandle> {
        self.remote_stats.clone()
    }

    pub fn with_backends(config: Config, backends: Backends) -> Result<Self, RuntimeError> {
        let simulated = backends.simulated_clock;
        let (mut world, first_touch) = RuntimeWorld::build(&config, backends)?;
        let progressing = Progressing::new(&mut world);
        Ok(Runtime {
            world,
            progressing,
            schedule: schedule::build(),
            started: Instant::now(),
            simulated,
            check: config.check_invariants,
            next_command: 0,
            max_inbox: config.limits.max_inbox,
            first_touch,
            config,
            recorder: None,
            remote_stats: None,
        })
    }

    /// Queues a command from `origin` for the next tick. Its id is echoed
    /// in the events that answer it, and those events are addressed to
    /// `origin`. Commands that name a session, operation, device region or
    /// device page that `origin` does not own are refused (`not_owner`).
    pub fn submit(&mut self, origin: Origin, command: Command) -> Result<CommandId, SubmitError> {
        if self.world.resource::<Inbox>().0.len() >= self.max_inbox {
            return Err(SubmitError::InboxFull(self.max_inbox));
        }
        Ok(self.enqueue(origin, command))
    }

    /// Queues a command the inbox has room for; records it if recording.
    fn enqueue(&mut self, origin: Origin, command: Command) -> CommandId {
        let id = self.next_command;
        self.next_command += 1;
        if let Some(r) = &mut self.recorder {
            let now = self.world.resource::<Clock>().now_us;
            r.command(now, id, origin, &command);
        }
        self.world
            .resource_mut::<Inbox>()
            .0
            .push_back(Inbound::Command {
                id,
                origin,
                command,
            });
        id
    }

    /// Closes every session `origin` opened, in arrival order with its
    /// commands (a command it submitted earlier still applies first), as a
    /// crashed client's sessions close: their operations are cancelled,
    /// and leases, reserved bytes and device pages return once submitted
    /// I/O drained. Never refused: it is how the runtime hears that a
    /// client went away, so it may pass `max_inbox` (by one entry per
    /// departed origin).
    pub fn close_origin(&mut self, origin: Origin) {
        if let Some(r) = &mut self.recorder {
            let now = self.world.resource::<Clock>().now_us;
            r.close_origin(now, origin);
        }
        self.world
            .resource_mut::<Inbox>()
            .0
            .push_back(Inbound::CloseOrigin(origin));
    }

    /// Starts writing every command and tick to `out` as a trace that
    /// `orbitkv replay` runs. `tick_interval_us` is the caller's idle tick
    /// interval, recorded for the replay's drain.
    pub fn record(
        &mut self,
        out: Box<dyn std::io::Write + Send>,
        tick_interval_us: u64,
    ) -> std::io::Result<()> {
        self.recorder = Some(Recorder::start(out, &self.config, tick_interval_us)?);
        Ok(())
    }

    /// Stops recording; returns the first write error, if any.
    pub fn stop_recording(&mut self) -> std::io::Result<()> {
        match self.recorder.take() {
            Some(mut r) => {
                r.flush();
                r.error.map_or(Ok(()), Err)
            }
            None => Ok(()),
        }
    }

    /// Answers a [`Command::Lookup`] between ticks, when nothing is queued
    /// ahead of it: the ingest stage runs on it alone and its events come
    /// back at once, without the rest of the schedule (a lookup reads the
    /// index, holds nothing and moves no operation, so no later stage has
    /// work from it). Its answer is the one the next tick would give: the
    /// ingest stage is first in the tick and the World does not change
    /// between ticks. Any other command, a lookup behind queued commands
    /// (arrival order), or a runtime that records a trace (the replay
    /// reproduces ticks) comes back as [`Answer::Queue`], for
    /// [`Runtime::submit`]. `now`: as for [`Runtime::tick_wall`].
    pub fn answer_now(&mut self, origin: Origin, command: Command, now: Instant) -> Answer {
        let queued = !self.world.resource::<Inbox>().0.is_empty();
        if !matches!(command, Command::Lookup { .. }) || queued || self.recorder.is_some() {
            return Answer::Queue(command);
        }
        self.advance_clock(now);
        let id = self.enqueue(origin, command);
        orbitkv_systems::ingest::ingest(&mut self.world);
        assert!(
            self.world.resource::<Inbox>().0.is_empty(),
            "ingest takes the one command it was given"
        );
        if self.check
            && let Err(violations) = self.check_invariants()
        {
            panic!("runtime invariants violated after a lookup: {violations:#?}");
        }
        Answer::Now(
            id,
            std::mem::take(&mut self.world.resource_mut::<Outbox>().0),
        )
    }

    /// Wall clock only: moves the runtime's clock to `now` (never
    /// backwards).
    fn advance_clock(&mut self, now: Instant) {
        if !self.simulated {
            let now = now.saturating_duration_since(self.started).as_micros() as u64;
            let mut clock = self.world.resource_mut::<Clock>();
            clock.now_us = clock.now_us.max(now);
        }
    }

    /// Simulated clock only: moves time to `now_us` (never backwards) and
    /// ticks. The simulator owns time; on a wall clock this is `tick`.
    pub fn tick_at(&mut self, now_us: u64) -> Vec<Addressed> {
        if self.simulated {
            let mut clock = self.world.resource_mut::<Clock>();
            clock.now_us = clock.now_us.max(now_us);
        }
        self.tick()
    }

    /// Runs every stage once and returns the events it produced, each
    /// addressed to the origin it belongs to.
    pub fn tick(&mut self) -> Vec<Addressed> {
        self.tick_wall(Instant::now())
    }

    /// `tick` at a wall-clock reading the caller already took (the
    /// manager's loop reads the clock once per round). On a simulated
    /// clock `now` is ignored, as in `tick`.
    pub fn tick_wall(&mut self, now: Instant) -> Vec<Addressed> {
        self.advance_clock(now);
        let started_at = self.world.resource::<Clock>().now_us;
        // The evict stage's record is per tick (the invariants read it).
        self.world.resource_mut::<Dram>().evicted.clear();
        self.schedule.run(&mut self.world);
        // No system reads change or removal trackers; without clearing them
        // every despawn is remembered forever (the manager's RSS grew
        // ~200 bytes per engine step in the soak benchmark).
        self.world.clear_trackers();
        if self.check
            && let Err(violations) = self.check_invariants()
        {
            panic!("runtime invariants violated after a tick: {violations:#?}");
        }
        let events = std::mem::take(&mut self.world.resource_mut::<Outbox>().0);
        if let Some(r) = &mut self.recorder {
            r.tick(started_at, &events);
        }
        events
    }

    /// For shutdown and restarts, never inside a tick: blocks until every
    /// tier finished the demotions it accepted, counts them (`written` or
    /// `failed` in `Metrics::demotions`) and frees the slots in-place ones
    /// held, so the totals of a runtime that is about to go add up
    /// (dropping it finishes the writes too, but uncounted).
    pub fn finish_demotions(&mut self) {
        let now_us = self.world.resource::<Clock>().now_us;
        self.world.resource_scope(|world, mut tiers: Mut<Tiers>| {
            let tiers = tiers.0.get_mut();
            for tier in tiers.iter_mut() {
                tier.finish_demotions();
            }
            world.resource_scope(|world, mut dram: Mut<Dram>| {
                let mut metrics = world.resource_mut::<Metrics>();
                orbitkv_systems::fence::settle_demotions(tiers, &mut dram, &mut metrics, now_us);
            });
        });
    }

    /// Checks every invariant of the runtime's state.
    pub fn check_invariants(&mut self) -> Result<(), Vec<String>> {
        let v = invariants::check(&mut self.world);
        if v.is_empty() { Ok(()) } else { Err(v) }
    }

    pub fn now_us(&self) -> u64 {
        self.world.resource::<Clock>().now_us
    }

    /// Whether nothing is queued, in flight or leased.
    pub fn is_idle(&mut self) -> bool {
        let s = self.stats();
        self.world.resource::<Inbox>().0.is_empty()
            && s.operations == 0
            && s.transfers == 0
            && s.leases == 0
    }

    pub fn first_touch(&self) -> Option<FirstTouchReport> {
        self.first_touch
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.world.resource::<Dram>().pool.stats()
    }

    pub fn stats(&mut self) -> Stats {
        let w = &mut self.world;
        let count = |w: &mut World, f: fn(&mut World) -> usize| f(w);
        Stats {
            now_us: w.resource::<Clock>().now_us,
            instances: count(w, |w| w.query::<&Instance>().iter(w).count()),
            sessions: count(w, |w| w.query::<&Session>().iter(w).count()),
            operations: count(w, |w| w.query::<&Operation>().iter(w).count()),
            operations_by_state: w.query::<&Operation>().iter(w).fold(
                Default::default(),
                |mut m, op| {
                    *m.entry(op.state().as_str()).or_default() += 1;
                    m
                },
            ),
            pages: w.resource::<Dram>().index.len(),
            leases: count(w, |w| w.query::<&Lease>().iter(w).count()),
            transfers: count(w, |w| w.query::<&Transfer>().iter(w).count()),
            device_pages: count(w, |w| w.query::<&DevicePage>().iter(w).count()),
            bytes_reserved: w.resource::<Budget>().reserved,
            pool_bytes_used: w.resource::<Dram>().pool.stats().bytes_used,
            pool_capacity_bytes: w.resource::<Dram>().pool.capacity(),
            metrics: w.resource::<Metrics>().clone(),
            load_rates: self.load_rates(),
            handoffs: self.handoff_stats(),
        }
    }

    /// The P/D handoffs standing now, and how many ended each way.
    pub fn handoff_stats(&mut self) -> HandoffStats {
        let w = &mut self.world;
        let pinned = w.query::<&Handoff>().iter(w).map(|h| h.pinned).sum();
        let h = w.resource::<Handoffs>();
        HandoffStats {
            standing: h.by_id.len(),
            pinned_pages: pinned,
            reserved_bytes: h.reserved,
            budget_bytes: h.budget,
            counts: h.counts,
        }
    }

    /// Each load source's measured rate, by name.
    pub fn load_rates(&mut self) -> Vec<LoadRate> {
        let names: Vec<&'static str> = std::iter::once("device")
            .chain(
                self.world
                    .resource_mut::<Tiers>()
                    .0
                    .get_mut()
                    .iter()
                    .map(|t| t.name()),
            )
            .collect();
        let rates = self.world.resource::<LoadRates>().sources().to_vec();
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let r = rates.get(i).copied().unwrap_or_default();
                LoadRate {
                    source: (*name).to_owned(),
                    bytes_per_second: (r.bytes_per_us * 1e6) as u64,
                    periods: r.periods,
                }
            })
            .collect()
    }

    /// Starts recording what DRAM gains and loses ([`PageChange`]), at
    /// most `cap` changes between two [`take_page_changes`](Self::take_page_changes).
    /// Off (0) until a caller asks: nothing is kept for nobody.
    pub fn record_page_changes(&mut self, cap: usize) {
        self.world.resource_mut::<Dram>().journal.start(cap);
        for t in self.world.resource_mut::<Tiers>().0.get_mut() {
            t.record_changes(cap);
        }
    }

    /// Counts the queries that stop at a page removed lately
    /// (`event_races`): the pages are advertised in KV events, and such a
    /// query was likely routed on one gone stale.
    pub fn count_event_races(&mut self) {
        self.world.resource_mut::<Dram>().journal.count_races();
    }

    /// Appends the DRAM page changes since the last call, in order; true
    /// when some were dropped meanwhile (more than the cap): then `out`
    /// lists every page DRAM holds now, as stored, for a subscriber that
    /// forgot what it was told.
    pub fn take_page_changes(&mut self, out: &mut Vec<PageChange>) -> bool {
        let mut dram = self.world.resource_mut::<Dram>();
        let before = out.len();
        let lost = dram.journal.take(out);
        if lost {
            out.truncate(before);
            out.extend(dram.index.keys().map(|k| PageChange::Stored(*k)));
        }
        lost
    }

    /// Calls `f` with every page DRAM and each lower tier hold now (the
    /// manager's presence filter is rebuilt from them). False when a tier
    /// cannot list its pages (`BackingTier::list_keys`); `f` may then have
    /// seen some.
    pub fn list_stored_keys(&mut self, f: &mut dyn FnMut(&StateKey)) -> bool {
        self.world.resource::<Dram>().index.keys().for_each(&mut *f);
        let mut all = true;
        for t in self.world.resource_mut::<Tiers>().0.get_mut() {
            all &= t.list_keys(f);
        }
        all
    }

    /// Some lower tier cannot be reached now: its pages may be there, and
    /// a lookup that finds nothing says so (`remote_unavailable`).
    pub fn some_tier_unavailable(&mut self) -> bool {
        self.world
            .resource_mut::<Tiers>()
            .0
            .get_mut()
            .iter()
            .any(|t| t.unavailable())
    }

    /// Appends every page DRAM holds, as stored (a subscriber forgot).
    pub fn list_pages(&mut self, out: &mut Vec<PageChange>) {
        let dram = self.world.resource::<Dram>();
        out.extend(dram.index.keys().map(|k| PageChange::Stored(*k)));
    }

    /// Makes each lower tier list its whole index again over the next
    /// [`take_tier_changes`](Self::take_tier_changes) (a subscriber forgot).
    pub fn relist_tiers(&mut self) {
        for t in self.world.resource_mut::<Tiers>().0.get_mut() {
            t.relist_changes();
        }
    }

    /// Appends each lower tier's index changes due since the last call,
    /// with the tier's name (see `TierJournal::take`: a restart's rescan
    /// first); true when one lost changes (it lists its whole index again).
    pub fn take_tier_changes(&mut self, out: &mut Vec<(&'static str, TierChange)>) -> bool {
        let mut lost = false;
        let mut changes = Vec::new();
        for t in self.world.resource_mut::<Tiers>().0.get_mut() {
            lost |= t.take_changes(&mut changes);
            let name = t.name();
            out.extend(changes.drain(..).map(|c| (name, c)));
        }
        lost
    }

    /// What a subscriber needs to describe the pages of each namespace:
    /// its instance, tokens per page and group rules (live instances only).
    pub fn namespaces(&mut self) -> Vec<NamespaceInfo> {
        let w = &mut self.world;
        let mut out = Vec::new();
        for inst in w.query::<&Instance>().iter(w) {
            if inst.retired {
                continue;
            }
            for (rank, r) in inst.ranks.iter().enumerate() {
                out.push(NamespaceInfo {
                    namespace: r.namespace,
                    instance: inst.name.clone(),
                    rank: rank as u32,
                    page_tokens: inst.page_tokens,
                    groups: inst.groups.iter().map(|g| (g.id, g.rule)).collect(),
                });
            }
        }
        out
    }

    /// Every live operation, in entity order.
    /// The counters so far (cheap: no walk over the world, unlike `stats`).
    pub fn metrics(&self) -> &Metrics {
        self.world.resource::<Metrics>()
    }

    pub fn operations(&mut self) -> Vec<OperationInfo> {
        let w = &mut self.world;
        let mut overdue: std::collections::HashMap<Entity, usize> = Default::default();
        let mut q = w.query::<(&Transfer, &TransferOf)>();
        for (_, of) in q.iter(w).filter(|(t, _)| t.overdue) {
            *overdue.entry(of.0).or_default() += 1;
        }
        let mut q = w.query::<(Entity, &Operation, Option<&Transfers>, Option<&HeldLeases>)>();
        let mut out: Vec<OperationInfo> = q
            .iter(w)
            .map(|(e, op, transfers, leases)| OperationInfo {
                operation: e.to_bits(),
                origin: op.origin,
                state: op.state().as_str(),
                deadline_us: op.deadline_us,
                in_flight: transfers.map_or(0, |t| t.len()) as u32,
                overdue_transfers: overdue.get(&e).copied().unwrap_or(0),
                leases: leases.map_or(0, |l| l.len()),
                bytes_reserved: op.bytes_reserved,
                reported: op.reported,
            })
            .collect();
        out.sort_by_key(|o| o.operation);
        out
    }

    /// A descriptor for the shared DRAM pool (`DramConfig::shared`), for a
    /// client process to map.
    pub fn export_pool(&self) -> Option<std::os::fd::OwnedFd> {
        self.world.resource::<Dram>().pool.export_fd()
    }

    /// A descriptor for a device region's shared memory
    /// (`CopyConfig::shared_regions`), for the engine that registered it.
    pub fn export_device_region(&mut self, engine_region: u32) -> Option<std::os::fd::OwnedFd> {
        self.world
            .resource_mut::<Copier>()
            .0
            .get_mut()
            .export_region(engine_region)
    }

    /// A descriptor for `origin`'s staging area (it has one once it
    /// registered an agent-owned region), for its copy agent to map
    /// writable: the only memory an agent writes for the runtime.
    pub fn export_staging(&self, origin: Origin) -> Option<std::os::fd::OwnedFd> {
        self.world
            .resource::<Agents>()
            .staging
            .get(&origin)?
            .export_fd()
    }

    /// Bytes of `origin`'s staging area, if it has one.
    pub fn staging_capacity(&self, origin: Origin) -> Option<u64> {
        Some(
            self.world
                .resource::<Agents>()
                .staging
                .get(&origin)?
                .capacity(),
        )
    }

    /// Transfers (lower-tier reads and device copies) in flight: O(1).
    pub fn in_flight(&self) -> usize {
        let t = self.world.resource::<TransferIndex>();
        t.copies.len() + t.reads.len()
    }

    /// Sleeps until the local copy engine finishes a batch, or `timeout`
    /// passes, when nothing else could move meanwhile: the engine's copies
    /// are the only transfers in flight, the inbox is empty and no
    /// operation moves on by itself. `true` if a batch finished (the next
    /// tick lands it); `false` at once otherwise, and the caller yields or
    /// waits as it would. A wall-clock host loop waiting for its own
    /// copies calls this instead of spinning ticks on the cores the
    /// copies run on.
    pub fn wait_io(&mut self, timeout: std::time::Duration) -> bool {
        if self.inbox_len() > 0 || self.progressing() {
            return false;
        }
        let index = self.world.resource::<TransferIndex>();
        let (copies, reads) = (index.copies.len(), index.reads.len());
        let mut copier = self.world.resource_mut::<Copier>();
        let engine = copier.0.get_mut();
        if reads > 0 || copies == 0 || engine.in_flight() != copies {
            return false;
        }
        engine.wait(timeout)
    }

    /// Whether a tick would move some operation on without any new
    /// command or I/O: a read that landed leaves its operation `Reading`
    /// until the next tick's read stage leases the page; a restore or
    /// publish just accepted, or an operation retiring, likewise. A host
    /// loop ticks again soon while this holds, instead of sleeping its idle
    /// wait (it made every lower-tier hit 100 ms slower). Operations that
    /// wait for a client (`Selected`, `Ready`) or for room (`Admit`) do not
    /// count: they would keep the loop spinning. O(1) without operations.
    pub fn progressing(&mut self) -> bool {
        if self.world.resource::<Registry>().operations == 0 {
            return false;
        }
        self.progressing.iter(&self.world).next().is_some()
    }

    /// Each lower tier's (bytes held, capacity), where it says.
    pub fn tier_occupancy(&mut self) -> std::collections::BTreeMap<String, (u64, u64)> {
        self.world
            .resource_mut::<Tiers>()
            .0
            .get_mut()
            .iter()
            .filter_map(|t| Some((t.name().to_owned(), t.occupancy()?)))
            .collect()
    }

    /// Commands queued and not yet taken by a tick.
    pub fn inbox_len(&self) -> usize {
        self.world.resource::<Inbox>().0.len()
    }

    /// Commands the inbox still takes before `submit` refuses.
    pub fn inbox_room(&self) -> usize {
        self.max_inbox.saturating_sub(self.inbox_len())
    }

    /// The id the next submitted command gets (ids are sequential).
    pub fn next_command_id(&self) -> CommandId {
        self.next_command
    }

    /// Bytes of the DRAM pool.
    pub fn pool_capacity(&self) -> u64 {
        self.world.resource::<Dram>().pool.capacity()
    }

    /// The configuration the runtime was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        self.world.resource::<Limits>()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(r) = &mut self.recorder {
            r.flush();
        }
        // The world drains its backends as it drops.
    }
}
