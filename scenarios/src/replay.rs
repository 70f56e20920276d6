//! The replay driver: runs a trace against a runtime with a simulated clock
//! and simulated backends, plays the engine side (device pages, payload
//! bytes, restores), and builds the [`Report`].
//!
//! Determinism: time moves only by the trace; backends complete I/O at
//! modelled times; the driver's own state is ordered. The same trace and
//! options give the same report, byte for byte.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use orbitkv_components::api::{
    Addressed, AgentDirection, AgentPageCopy, AgentRegion, Command, CommandId, CopyFailure, Event,
    GroupHashes, MissReason, Origin, PagePos, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::{GroupSpec, Rule};
use orbitkv_components::{Namespace, NativeHash, StateKey};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyControl, SimCopyEngine};
use orbitkv_io::tier::{BackingTier, MemoryTier, MemoryTierHandle, SimRemote};
use orbitkv_world::driver::register_command;
use orbitkv_world::{Backends, Config, OperationInfo, Runtime};
use serde_json::Value;

use crate::payload::payload;
use crate::report::{Occupancy, Percentiles, Report, RequestReport, Sample};
use crate::trace::{
    AgentModel, Body, Fault, Header, Line, Model, Open, Publish, Register, Request, Then, Ticks,
    TierPut, Trace, chained_hashes,
};

/// Bounds of the driver itself.
const MAX_TIERS: usize = 8;
const MAX_SAMPLES: usize = 4096;
const MAX_VIOLATIONS_KEPT: usize = 20;
const TIER_MAX_IN_FLIGHT: usize = 4096;
/// Drain step when nothing is in flight.
const DRAIN_QUIET_STEP_US: u64 = 1_000;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("trace header: {0}")]
    Header(String),
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
}

/// Checks the driver runs on every event; the fuzzer's oracle is one.
pub trait Observer {
    /// A `Ready` for a request the driver issued.
    fn ready(&mut self, _ctx: &ReadyContext<'_>) -> Result<(), String> {
        Ok(())
    }
    /// Keys the trace made available (published or put in a tier).
    fn available(&mut self, _key: StateKey) {}
    /// An instance was registered by this `register` line and sealed to
    /// these namespaces (one per rank).
    fn registered(&mut self, _line: &Register, _namespaces: &[Namespace]) -> Result<(), String> {
        Ok(())
    }
    /// The engine went quiet and the runtime drained (end of the trace):
    /// the operations still alive.
    fn quiet(&mut self, _now_us: u64, _live: &[OperationInfo]) -> Result<(), String> {
        Ok(())
    }
    /// After every tick: the operations alive. `bound_us` is how long past
    /// its deadline an operation may take to reply (the longest time a
    /// transfer may stay in flight before it is overdue).
    fn operations(
        &mut self,
        _now_us: u64,
        _bound_us: u64,
        _live: &[OperationInfo],
    ) -> Result<(), String> {
        Ok(())
    }
    /// Whether `operations` is wanted (it costs a walk over the runtime's
    /// operations every tick).
    fn watches_operations(&self) -> bool {
        false
    }
    /// A line the driver is about to run (its faults and requests are what
    /// can explain a miss).
    fn line(&mut self, _line: &Line) {}
    /// A miss the runtime reported (in a query's result or a recovery's
    /// `miss`), with the pages DRAM evicted so far in this replay (churn
    /// explains some reasons).
    fn miss(&mut self, _reason: MissReason, _evictions: u64) -> Result<(), String> {
        Ok(())
    }
}

/// What an observer sees of a `Ready` reply.
pub struct ReadyContext<'a> {
    pub instance: &'a str,
    pub namespaces: &'a [Namespace],
    pub groups: &'a [GroupSpec],
    pub page_tokens: u64,
    pub origin: u64,
    pub prompt_len: u64,
    pub hashes: &'a [u64],
    pub boundary: u64,
    pub leased: &'a [PagePos],
}

struct NoObserver;
impl Observer for NoObserver {}

#[derive(Clone)]
struct InstanceInfo {
    namespaces: Vec<Namespace>,
    groups: Vec<GroupSpec>,
    page_tokens: u64,
    /// Page bytes per group (rank 0's layout).
    page_bytes: BTreeMap<u32, u64>,
    ranks: u32,
}

impl InstanceInfo {
    fn bytes(&self, group: u32) -> u64 {
        self.page_bytes.get(&group).copied().unwrap_or(0)
    }
}

struct RegionInfo {
    handle: u64,
    /// The copy engine's region id, or the simulated agent's.
    engine: u32,
    /// Agent-owned: its memory is in `SimAgents::memory`, not the arena.
    agent: bool,
    slots: u32,
    page_bytes: u64,
    live: BTreeSet<u32>,
}

/// Raw commands whose replies the driver must learn from.
enum RawPending {
    Register {
        instance: String,
        info: InstanceInfo,
    },
    Open {
        instance: String,
    },
    Region {
        session: u64,
        rank: u32,
        group: u32,
        slots: u32,
        /// Agent-owned (a raw agent region: no simulated agent runs it).
        agent: bool,
    },
    Alloc {
        session: u64,
        region: u64,
        slot: u32,
    },
}

struct SessionInfo {
    handle: SessionHandle,
    /// The engine process's connection: every session an `open` line opens
    /// has its own, closed when the engine crashes.
    origin: Origin,
    instance: String,
    regions: BTreeMap<(u32, u32), RegionInfo>,
}

struct DevicePageInfo {
    session: u64,
    rank: u32,
    group: u32,
    slot: u32,
}

/// A request the driver plays the engine for.
struct RequestState {
    session: u64,
    instance: String,
    spec: Request,
    hashes: Vec<u64>,
    prompt_len: u64,
    submitted_us: u64,
    operation: Option<u64>,
    report: usize,
}

/// One restored page: the key it must hold and where it went.
struct RestoredPage {
    key: StateKey,
    engine_region: u32,
    agent: bool,
    offset: u64,
    bytes: u64,
    device_page: u64,
}

/// A restore in flight.
struct RestoreState {
    submitted_us: u64,
    session: u64,
    targets: Vec<RestoredPage>,
}

enum Timer {
    Cancel {
        session: u64,
        operation: u64,
    },
    Free {
        session: u64,
        pages: Vec<u64>,
    },
    /// A simulated agent reports a copy.
    AgentDone {
        session: u64,
        copy: u64,
        failure: Option<CopyFailure>,
        /// A publish's page checksums, taken from the agent's memory.
        checksums: Vec<u64>,
    },
}

enum Todo {
    Restore(u64),
    Free {
        session: u64,
        pages: Vec<u64>,
    },
    /// The session's agent vanished: its connection drops.
    Crash(u64),
}

/// A session's simulated copy agent: its model and where it stands.
struct SimAgent {
    model: AgentModel,
    rng: u64,
    vanished: bool,
}

impl SimAgent {
    /// One draw in [0, 1000) (xorshift64*, deterministic per seed).
    fn roll(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % 1000
    }
}

/// The simulated copy agents of the trace's sessions. The engine memory of
/// agent regions lives here (the runtime never maps it); the agent reads
/// the runtime's pool and writes the origin's staging area through their
/// exported descriptors, as a real agent's mapping does.
#[derive(Default)]
struct SimAgents {
    next_region: u32,
    /// Agent region id → (owning session, engine memory).
    memory: HashMap<u32, (u64, Vec<u8>)>,
    /// Session → its agent.
    agents: HashMap<u64, SimAgent>,
    /// The runtime's pool (one per runtime). The staging area is exported
    /// afresh for each copy: it goes with the origin's last session and a
    /// later agent region gets a new one (a real agent remaps its window
    /// when the area changes).
    pool: Option<std::fs::File>,
}

pub struct Replay<'o> {
    header: Header,
    config: Config,
    rt: Runtime,
    arena: DeviceArena,
    copies: SimCopyControl,
    tiers: Vec<(String, MemoryTierHandle, u64, bool)>,
    incarnation: u64,
    observer: Box<dyn Observer + 'o>,
    sim_agents: SimAgents,

    names: HashMap<String, Value>,
    binds: HashMap<CommandId, (String, usize)>,
    instances: BTreeMap<String, InstanceInfo>,
    sessions: BTreeMap<u64, SessionInfo>,
    session_names: HashMap<String, u64>,
    /// The origin each session was opened from (kept after a crash, so a
    /// late command names the session's own origin and is refused as
    /// stale, not as another origin's).
    session_origins: HashMap<u64, Origin>,
    /// The next origin an `open` line gets (`Origin::EMBEDDED` is the raw
    /// lines' one).
    next_origin: u64,
    device_pages: HashMap<u64, DevicePageInfo>,
    requests: BTreeMap<CommandId, RequestState>,
    op_requests: HashMap<u64, CommandId>,
    restores: HashMap<u64, RestoreState>,
    /// `then: "load"` requests: the load's targets, by command until its
    /// operation is known, then by operation until its pages are leased.
    load_plans: HashMap<CommandId, (u64, Vec<RestoreTarget>)>,
    load_targets: HashMap<u64, (u64, Vec<RestoreTarget>)>,
    publishes: HashMap<CommandId, (u64, u64, Vec<u64>)>,
    queries_at: HashMap<CommandId, u64>,
    raw: HashMap<CommandId, RawPending>,
    ready_positions: HashMap<u64, Vec<PagePos>>,
    timers: BTreeMap<(u64, u64), Timer>,
    timer_seq: u64,
    todo: Vec<Todo>,

    report: Report,
    latencies: BTreeMap<&'static str, Vec<u64>>,
    samples: Vec<Sample>,
    sample_stride: u64,
    ticks: u64,
    /// Explicit ticking: the time of the next `tick` line.
    pending_time: u64,
    /// Every runtime event, when asked for (tests compare replays).
    event_log: Option<Vec<Event>>,
}

fn line_err(line: usize, message: impl Into<String>) -> ReplayError {
    ReplayError::Line {
        line,
        message: message.into(),
    }
}

/// Tier names must be `&'static str` (they label metrics); each distinct
/// name is allocated once per process, however many replays run.
fn intern(name: &str) -> &'static str {
    static NAMES: std::sync::Mutex<BTreeSet<&'static str>> = std::sync::Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.get(name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(leaked);
    leaked
}

fn build_runtime(
    config: &Config,
    header: &Header,
    tiers: &[(String, MemoryTierHandle, u64, bool)],
    incarnation: u64,
) -> Result<(Runtime, DeviceArena, SimCopyControl), ReplayError> {
    let copy = SimCopyEngine::new(SimCopyConfig {
        latency_us: header.latency.copy_us,
        bytes_per_us: header.latency.copy_bytes_per_us,
        max_in_flight_batches: config.copy.max_in_flight_batches,
    });
    let arena = copy.arena();
    let control = copy.control();
    let backends = Backends {
        copy: Box::new(copy),
        tiers: tiers
            .iter()
            .map(|(name, handle, latency, demote)| {
                let tier =
                    MemoryTier::from_handle(intern(name), handle, *latency, TIER_MAX_IN_FLIGHT);
                Box::new(if *demote { tier.writable() } else { tier }) as Box<dyn BackingTier>
            })
            .collect(),
        simulated_clock: true,
    };
    let mut config = config.clone();
    config.incarnation = incarnation;
    config.check_invariants = false; // counted by the driver instead
    let rt =
        Runtime::with_backends(config, backends).map_err(|e| ReplayError::Header(e.to_string()))?;
    Ok((rt, arena, control))
}

impl<'o> Replay<'o> {
    pub fn new(header: &Header) -> Result<Self, ReplayError> {
        Self::with_observer(header, Box::new(NoObserver))
    }

    pub fn with_observer(
        header: &Header,
        observer: Box<dyn Observer + 'o>,
    ) -> Result<Self, ReplayError> {
        let mut config: Config = match &header.config {
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| ReplayError::Header(format!("config: {e}")))?,
            None => Config::default(),
        };
        if header
            .config
            .as_ref()
            .and_then(|c| c.get("dram"))
            .and_then(|d| d.get("first_touch"))
            .is_none()
        {
            config.dram.first_touch = false; // replays need no warm pool
        }
        if header.latency.tiers.len() > MAX_TIERS {
            return Err(ReplayError::Header(format!("at most {MAX_TIERS} tiers")));
        }
        if header.tick_interval_us == 0 {
            return Err(ReplayError::Header(
                "tick_interval_us must be positive".into(),
            ));
        }
        let tiers: Vec<(String, MemoryTierHandle, u64, bool)> = header
            .latency
            .tiers
            .iter()
            .map(|t| {
                let handle = MemoryTier::new("tier", 0, 1).handle();
                if let Some(r) = t.remote {
                    handle.set_remote(SimRemote {
                        read_timeout_us: r.read_timeout_us,
                        write_through: r.write_through,
                    });
                }
                if t.demote {
                    handle.set_in_place(t.write_in_place_us);
                }
                (t.name.clone(), handle, t.read_us, t.demote)
            })
            .collect();
        let (rt, arena, copies) = build_runtime(&config, header, &tiers, 1)?;
        Ok(Replay {
            header: header.clone(),
            config,
            rt,
            arena,
            copies,
            tiers,
            incarnation: 1,
            observer,
            sim_agents: SimAgents::default(),
            names: HashMap::new(),
            binds: HashMap::new(),
            instances: BTreeMap::new(),
            sessions: BTreeMap::new(),
            session_names: HashMap::new(),
            session_origins: HashMap::new(),
            next_origin: 1,
            device_pages: HashMap::new(),
            requests: BTreeMap::new(),
            op_requests: HashMap::new(),
            restores: HashMap::new(),
            load_plans: HashMap::new(),
            load_targets: HashMap::new(),
            publishes: HashMap::new(),
            queries_at: HashMap::new(),
            raw: HashMap::new(),
            ready_positions: HashMap::new(),
            timers: BTreeMap::new(),
            timer_seq: 0,
            todo: Vec::new(),
            report: Report {
                report_version: crate::report::REPORT_VERSION,
                trace: header.name.clone(),
                ..Default::default()
            },
            latencies: BTreeMap::new(),
            samples: Vec::new(),
            sample_stride: 1,
            ticks: 0,
            pending_time: 0,
            event_log: None,
        })
    }

    /// Keeps every runtime event; `run_logged` returns them.
    pub fn log_events(mut self) -> Self {
        self.event_log = Some(Vec::new());
        self
    }

    /// Like `run`, also returning the runtime's events in order.
    pub fn run_logged(mut self, trace: &Trace) -> Result<(Report, Vec<Event>), ReplayError> {
        self.event_log.get_or_insert_with(Vec::new);
        for line in &trace.lines {
            self.advance_to(line.t);
            self.observer.line(line);
            self.apply(line)?;
        }
        let log = self.event_log.take().unwrap_or_default();
        let (report, _) = self.finish();
        Ok((report, log))
    }

    /// Replays a whole trace; `progress(done, total)` is called per line.
    pub fn run(
        mut self,
        trace: &Trace,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Report, Vec<Sample>), ReplayError> {
        let total = trace.lines.len();
        for (i, line) in trace.lines.iter().enumerate() {
            self.advance_to(line.t);
            self.observer.line(line);
            self.apply(line)?;
            progress(i + 1, total);
        }
        self.drain();
        let (now, live) = (self.now(), self.rt.operations());
        if let Err(why) = self.observer.quiet(now, &live) {
            self.violation(format!("oracle: {why}"));
        }
        Ok(self.finish())
    }

    fn now(&self) -> u64 {
        self.rt.now_us()
    }

    /// Ticks at the idle interval until simulated time reaches `t` (in
    /// explicit mode, time moves only at `tick` lines).
    fn advance_to(&mut self, t: u64) {
        if self.header.ticks == Ticks::Explicit {
            self.pending_time = t;
            return;
        }
        while self.now() < t {
            let step = self.header.tick_interval_us.min(t - self.now());
            self.tick_with(vec![Command::AdvanceClock { us: step }]);
        }
    }

    /// Runs until nothing is in flight, or `drain_us` passes.
    fn drain(&mut self) {
        let limit = self.now().saturating_add(self.header.drain_us);
        self.tick_with(Vec::new());
        let mut step = self.header.tick_interval_us;
        while self.now() < limit
            && !(self.rt.is_idle() && self.timers.is_empty() && self.todo.is_empty())
        {
            // What is left waits on deadlines, timers or I/O that may never
            // complete (a lost completion): while ticks bring nothing, step
            // ever more coarsely (up to 1 ms), never past the next timer.
            let now = self.now();
            let mut this = step;
            if let Some(((at, _), _)) = self.timers.first_key_value() {
                this = this.min(at.saturating_sub(now).max(1));
            }
            let events = self.tick_with(vec![Command::AdvanceClock {
                us: this.min(limit - now),
            }]);
            step = if events.is_empty() {
                (step * 2).min(DRAIN_QUIET_STEP_US.max(self.header.tick_interval_us))
            } else {
                self.header.tick_interval_us
            };
        }
    }

    /// Submits, ticks once, handles the events and any follow-up work.
    fn tick_with(&mut self, commands: Vec<Command>) -> Vec<(CommandId, Event)> {
        let ids: Vec<CommandId> = commands.into_iter().map(|c| self.submit(c)).collect();
        let events = self.tick();
        self.run_todo();
        let _ = ids;
        events
    }

    /// Submits from the origin of the session the command names (its
    /// engine's connection), or from the raw lines' origin.
    fn submit(&mut self, command: Command) -> CommandId {
        let origin = session_of(&command)
            .and_then(|id| self.session_origins.get(&id).copied())
            .unwrap_or(Origin::EMBEDDED);
        self.submit_as(origin, command)
    }

    fn submit_as(&mut self, origin: Origin, command: Command) -> CommandId {
        match self.rt.submit(origin, command.clone()) {
            Ok(id) => id,
            Err(_) => {
                // The inbox is bounded: a tick drains it.
                self.tick();
                self.rt.submit(origin, command).unwrap_or(u64::MAX)
            }
        }
    }

    fn tick(&mut self) -> Vec<(CommandId, Event)> {
        let events = self.rt.tick();
        self.after_tick(events)
    }

    fn after_tick(&mut self, events: Vec<Addressed>) -> Vec<(CommandId, Event)> {
        self.ticks += 1;
        let mut misaddressed = Vec::new();
        let events: Vec<Event> = events
            .into_iter()
            .map(|a| {
                // Only to the raw lines' origin or one an `open` line made.
                if a.to.0 >= self.next_origin {
                    misaddressed.push(format!("event addressed to {}: {:?}", a.to, a.event));
                }
                a.event
            })
            .collect();
        for v in misaddressed {
            self.violation(v);
        }
        if let Some(log) = &mut self.event_log {
            log.extend(events.iter().cloned());
        }
        if let Err(v) = self.rt.check_invariants() {
            self.report.invariant_violations += v.len() as u64;
            for s in v {
                if self.report.violations.len() < MAX_VIOLATIONS_KEPT {
                    self.report
                        .violations
                        .push(format!("t={}: {s}", self.now()));
                }
            }
        }
        self.fire_timers();
        let now = self.now();
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            let id = e.command();
            self.observe_miss(&e);
            self.handle(&e, now);
            out.push((id.unwrap_or(u64::MAX), e));
        }
        self.observe_operations();
        if self.ticks.is_multiple_of(self.sample_stride) {
            self.sample();
        }
        out
    }

    /// Shows the observer a miss the runtime reported.
    fn observe_miss(&mut self, e: &Event) {
        let reason = match e {
            Event::QueryResult {
                miss: Some(reason), ..
            }
            | Event::Miss { reason, .. } => *reason,
            _ => return,
        };
        let evictions: u64 = self.report.totals.evictions.values().sum::<u64>()
            + self.rt.metrics().evictions.values().sum::<u64>();
        if let Err(why) = self.observer.miss(reason, evictions) {
            self.violation(format!("oracle: {why}"));
        }
    }

    /// Shows the observer the live operations, if it watches them.
    fn observe_operations(&mut self) {
        if !self.observer.watches_operations() {
            return;
        }
        let limits = &self.config.limits;
        let bound_us = limits
            .transfer_timeout_us
            .max(limits.agent_copy_deadline_us);
        let (now, live) = (self.now(), self.rt.operations());
        if let Err(why) = self.observer.operations(now, bound_us, &live) {
            self.violation(format!("oracle: {why}"));
        }
    }

    fn sample(&mut self) {
        let s = self.rt.stats();
        let m = &s.metrics;
        let decided = m.hits + m.misses.values().sum::<u64>();
        self.samples.push(Sample {
            t_us: s.now_us,
            hit_rate: if decided > 0 {
                m.hits as f64 / decided as f64
            } else {
                0.0
            },
            dram_bytes_used: s.pool_bytes_used,
            tier_pages: self.tiers.iter().map(|(_, h, _, _)| h.len() as u64).sum(),
            bytes_reserved: s.bytes_reserved,
        });
        if self.samples.len() >= MAX_SAMPLES {
            // Keep memory bounded on long traces: halve the resolution.
            let mut i = 0;
            self.samples.retain(|_| {
                i += 1;
                i % 2 == 1
            });
            self.sample_stride *= 2;
        }
    }

    fn fire_timers(&mut self) {
        let now = self.now();
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Timer::Cancel { session, operation } => {
                    // Sent even after the request finished: a late cancel is
                    // refused (`unknown_operation`), which the report shows.
                    // Not to a crashed or closed session the driver forgot.
                    if let Some(s) = self.sessions.get(&session) {
                        let handle = s.handle;
                        self.submit(Command::Cancel {
                            session: handle,
                            operation,
                        });
                    }
                }
                Timer::Free { session, pages } => self.todo.push(Todo::Free { session, pages }),
                Timer::AgentDone {
                    session,
                    copy,
                    failure,
                    checksums,
                } => {
                    // A dead engine reports nothing.
                    if let Some(origin) = self.sessions.get(&session).map(|s| s.origin) {
                        self.submit_as(
                            origin,
                            Command::CopyDone {
                                copy,
                                failure,
                                checksums,
                            },
                        );
                    }
                }
            }
        }
    }

    fn add_timer(&mut self, at: u64, timer: Timer) {
        self.timer_seq += 1;
        self.timers.insert((at, self.timer_seq), timer);
    }

    // ---- lines ---------------------------------------------------------

    fn apply(&mut self, line: &Line) -> Result<(), ReplayError> {
        match &line.body {
            Body::Tick => {
                if self.header.ticks == Ticks::Explicit {
                    let events = self.rt.tick_at(self.pending_time);
                    self.after_tick(events);
                    self.run_todo();
                } else {
                    self.tick_with(Vec::new());
                }
            }
            Body::Cmd { cmd, bind } => self.raw_command(line.number, cmd, bind.as_deref())?,
            Body::Fault(f) => self.fault(line.number, f)?,
            Body::TierPut(p) => self.tier_put(line.number, p)?,
            Body::Register(r) => self.register(line.number, r)?,
            Body::Open(o) => self.open(line.number, o)?,
            Body::Publish(p) => self.publish_macro(line.number, p)?,
            Body::Request(r) => self.request(line.number, r)?,
        }
        Ok(())
    }

    /// Resolves `$name` strings anywhere in a command.
    fn resolve(&mut self, v: &Value) -> Value {
        match v {
            Value::String(s) if s.starts_with('$') => match self.names.get(s) {
                Some(bound) => bound.clone(),
                None => {
                    self.report.totals.unbound_references += 1;
                    // An invalid handle: the runtime refuses it with a type.
                    Value::from(u64::MAX)
                }
            },
            Value::Array(items) => Value::Array(items.iter().map(|i| self.resolve(i)).collect()),
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (k.clone(), self.resolve(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    fn raw_command(
        &mut self,
        line: usize,
        cmd: &Value,
        bind: Option<&str>,
    ) -> Result<(), ReplayError> {
        let resolved = self.resolve(cmd);
        let command: Command = match serde_json::from_value(resolved) {
            Ok(c) => c,
            Err(e) => {
                // A session handle that was never bound resolves to a number:
                // the command cannot even be built, so it counts as refused.
                if cmd.to_string().contains('$') {
                    *self
                        .report
                        .totals
                        .rejected
                        .entry("unbound_handle".into())
                        .or_default() += 1;
                    return Ok(());
                }
                return Err(line_err(line, format!("cmd: {e}")));
            }
        };
        // The engine side of a publish: the source pages hold the key's bytes.
        if let Command::Publish { session, pages, .. } = &command {
            self.fill_sources(session.id, pages);
        }
        let restore = match &command {
            Command::Restore {
                session,
                operation,
                targets,
                ..
            } => Some((session.id, *operation, targets.clone())),
            _ => None,
        };
        let pending = self.raw_pending(&command);
        let timed = matches!(command, Command::Query { .. } | Command::Publish { .. });
        let id = self.submit(command);
        if let Some((session, operation, targets)) = restore {
            self.track_restore(session, operation, &targets);
        }
        if let Some(p) = pending {
            self.raw.insert(id, p);
        }
        if let Some(name) = bind {
            self.binds.insert(id, (name.to_owned(), line));
        }
        if timed {
            self.queries_at.insert(id, self.now());
        }
        Ok(())
    }

    /// What the driver must remember to follow a raw command's reply.
    fn raw_pending(&self, command: &Command) -> Option<RawPending> {
        match command {
            Command::RegisterInstance {
                instance,
                layout,
                page_tokens,
                groups,
                ranks,
                ..
            } => {
                let mut page_bytes = BTreeMap::new();
                let first = ranks.iter().min_by_key(|r| (r.pp, r.tp))?;
                for s in layout
                    .slots
                    .iter()
                    .filter(|s| s.tp_rank == first.tp && s.pp_rank == first.pp)
                {
                    *page_bytes.entry(s.group).or_default() += s.padded_page_bytes;
                }
                Some(RawPending::Register {
                    instance: instance.clone(),
                    info: InstanceInfo {
                        namespaces: Vec::new(),
                        groups: groups.clone(),
                        page_tokens: *page_tokens,
                        page_bytes,
                        ranks: ranks.len() as u32,
                    },
                })
            }
            Command::OpenSession { instance } => Some(RawPending::Open {
                instance: instance.clone(),
            }),
            Command::RegisterDeviceRegion {
                session,
                rank,
                group,
                slots,
                agent,
            } => Some(RawPending::Region {
                session: session.id,
                rank: *rank,
                group: *group,
                slots: *slots,
                agent: agent.is_some(),
            }),
            Command::DevicePageAlloc {
                session,
                region,
                slot,
            } => Some(RawPending::Alloc {
                session: session.id,
                region: *region,
                slot: *slot,
            }),
            _ => None,
        }
    }

    /// Learns from the reply to a raw command.
    fn raw_reply(&mut self, pending: RawPending, e: &Event) {
        match (pending, e) {
            (
                RawPending::Register { instance, mut info },
                Event::InstanceRegistered { namespaces, .. },
            ) => {
                info.namespaces = namespaces.clone();
                self.instances.insert(instance, info);
            }
            (RawPending::Open { instance }, Event::SessionOpened { session, .. }) => {
                self.sessions.insert(
                    session.id,
                    SessionInfo {
                        handle: *session,
                        origin: Origin::EMBEDDED,
                        instance,
                        regions: BTreeMap::new(),
                    },
                );
            }
            (
                RawPending::Region {
                    session,
                    rank,
                    group,
                    slots,
                    agent,
                },
                Event::RegionRegistered {
                    region,
                    engine_region,
                    page_bytes,
                    ..
                },
            ) => {
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.regions.insert(
                        (rank, group),
                        RegionInfo {
                            handle: *region,
                            engine: *engine_region,
                            agent,
                            slots,
                            page_bytes: *page_bytes,
                            live: BTreeSet::new(),
                        },
                    );
                }
            }
            (
                RawPending::Alloc {
                    session,
                    region,
                    slot,
                },
                Event::DevicePageAllocated { device_page, .. },
            ) => {
                let found = self
                    .sessions
                    .get_mut(&session)
                    .and_then(|s| s.regions.iter_mut().find(|(_, r)| r.handle == region));
                if let Some((&(rank, group), r)) = found {
                    r.live.insert(slot);
                    self.device_pages.insert(
                        *device_page,
                        DevicePageInfo {
                            session,
                            rank,
                            group,
                            slot,
                        },
                    );
                }
            }
            _ => {}
        }
    }

    fn fault(&mut self, line: usize, f: &Fault) -> Result<(), ReplayError> {
        self.report.totals.faults_injected += 1;
        let tier = |me: &Self, name: &str| {
            me.tiers
                .iter()
                .find(|(n, _, _, _)| n == name)
                .map(|(_, h, _, _)| h.clone())
                .ok_or_else(|| line_err(line, format!("unknown tier {name:?}")))
        };
        match f {
            Fault::TierReadError { tier: t, count } => tier(self, t)?.fail_next(*count),
            Fault::TierLoseReads { tier: t, count } => tier(self, t)?.lose_next(*count),
            Fault::TierDelay { tier: t, us } => tier(self, t)?.delay(*us),
            Fault::CorruptPage {
                tier: t,
                instance,
                prompt,
                page,
                rank,
                group,
            }
            | Fault::DropPage {
                tier: t,
                instance,
                prompt,
                page,
                rank,
                group,
            } => {
                let h = tier(self, t)?;
                let key = self.prompt_key(line, instance, prompt, *page, *rank, *group)?;
                if matches!(f, Fault::CorruptPage { .. }) {
                    h.corrupt(&key);
                } else {
                    h.remove(&key);
                }
            }
            Fault::RemoteDown { tier: t, .. }
            | Fault::RemoteFlush { tier: t }
            | Fault::RemoteRewrite { tier: t, .. }
            | Fault::RemoteTruncate { tier: t, .. }
                if !tier(self, t)?.is_remote() =>
            {
                return Err(line_err(
                    line,
                    format!("tier {t:?} has no `remote` model; remote_* faults need one"),
                ));
            }
            Fault::RemoteDown { tier: t, us } => {
                let until = self.now() + us;
                tier(self, t)?.down_until(until);
            }
            Fault::RemoteFlush { tier: t } => {
                tier(self, t)?.flush();
            }
            Fault::RemoteRewrite {
                tier: t,
                instance,
                prompt,
                page,
                rank,
                group,
            }
            | Fault::RemoteTruncate {
                tier: t,
                instance,
                prompt,
                page,
                rank,
                group,
            } => {
                let h = tier(self, t)?;
                let key = self.prompt_key(line, instance, prompt, *page, *rank, *group)?;
                if matches!(f, Fault::RemoteRewrite { .. }) {
                    h.rewrite(&key);
                } else {
                    h.truncate(&key);
                }
            }
            Fault::CopyError { count } => self.copies.fail_next(*count),
            Fault::CopyLose { count } => self.copies.lose_next(*count),
            Fault::CopyDelay { us } => self.copies.delay_all(*us),
            Fault::CopyReorder { max_us, seed } => self.copies.jitter(*max_us, *seed),
            Fault::SessionCrash { session } => {
                if let Some(id) = self.session_names.remove(session) {
                    self.crash(id);
                }
            }
            Fault::ManagerRestart => self.restart()?,
        }
        Ok(())
    }

    /// The engine process dies: the manager sees its connection drop
    /// (`close_origin`: its session closes, the copies its agent had in
    /// flight fail as lost); the dead engine sends nothing more.
    fn crash(&mut self, id: u64) {
        self.session_names.retain(|_, s| *s != id);
        let Some(s) = self.sessions.remove(&id) else {
            return;
        };
        self.rt.close_origin(s.origin);
        self.device_pages.retain(|_, d| d.session != id);
        self.restores.retain(|_, r| r.session != id);
        self.sim_agents.agents.remove(&id);
        self.sim_agents.memory.retain(|_, (owner, _)| *owner != id);
        let orphaned: Vec<CommandId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.session == id)
            .map(|(c, _)| *c)
            .collect();
        for c in orphaned {
            if let Some(r) = self.requests.remove(&c) {
                self.report.requests[r.report].outcome = "engine_crashed".into();
                if let Some(op) = r.operation {
                    self.op_requests.remove(&op);
                }
            }
        }
    }

    /// A simulated agent takes an `AgentCopy`: it vanishes, fails it, or
    /// copies the bytes (pool → engine memory, checked against the
    /// checksum each pool page carries; engine memory → staging) and
    /// reports after `copy_us` (plus `late_us` when late).
    fn agent_copy(&mut self, copy: u64, direction: AgentDirection, pages: &[AgentPageCopy]) {
        let Some(&(session, _)) = pages
            .first()
            .and_then(|p| self.sim_agents.memory.get(&p.region))
        else {
            return; // not a simulated agent's region
        };
        let Some(origin) = self.sessions.get(&session).map(|s| s.origin) else {
            return; // its engine is gone
        };
        let Some(agent) = self.sim_agents.agents.get_mut(&session) else {
            return;
        };
        if agent.vanished {
            return;
        }
        let m = agent.model;
        let roll = agent.roll();
        let late = agent.roll() < m.late_per_mille;
        let outcome = if roll < m.vanish_per_mille {
            agent.vanished = true;
            self.todo.push(Todo::Crash(session));
            "vanished"
        } else if roll < m.vanish_per_mille + m.fail_per_mille {
            let at = self.now() + m.copy_us;
            self.add_timer(
                at,
                Timer::AgentDone {
                    session,
                    copy,
                    failure: Some(CopyFailure::Executor("injected by the trace".into())),
                    checksums: Vec::new(),
                },
            );
            "failed"
        } else {
            let (failure, checksums) = match self.agent_run(origin, direction, pages) {
                Ok(sums) => (None, sums),
                Err(f) => (Some(f), Vec::new()),
            };
            let at = self.now() + m.copy_us + if late { m.late_us } else { 0 };
            self.add_timer(
                at,
                Timer::AgentDone {
                    session,
                    copy,
                    failure,
                    checksums,
                },
            );
            if late { "late" } else { "done" }
        };
        *self
            .report
            .totals
            .agent_copies
            .entry(outcome.into())
            .or_default() += 1;
    }

    /// The bytes of one agent copy; a publish's page checksums, taken from
    /// the agent's memory as a real agent does.
    fn agent_run(
        &mut self,
        origin: Origin,
        direction: AgentDirection,
        pages: &[AgentPageCopy],
    ) -> Result<Vec<u64>, CopyFailure> {
        use std::os::unix::fs::FileExt;
        let oob = |m: String| CopyFailure::OutOfBounds(m);
        let io = |e: std::io::Error| CopyFailure::Executor(e.to_string());
        let a = &mut self.sim_agents;
        if a.pool.is_none() {
            a.pool = self.rt.export_pool().map(std::fs::File::from);
        }
        let staging = match direction {
            AgentDirection::RegionToStaging => {
                self.rt.export_staging(origin).map(std::fs::File::from)
            }
            AgentDirection::PoolToRegion => None,
        };
        let mut sums = Vec::new();
        for p in pages {
            let (_, mem) = a
                .memory
                .get_mut(&p.region)
                .ok_or(CopyFailure::UnknownRegion(p.region))?;
            let span = mem
                .get_mut(p.region_offset as usize..p.region_offset.saturating_add(p.len) as usize)
                .ok_or_else(|| {
                    oob(format!(
                        "[{}, +{}) of region {}",
                        p.region_offset, p.len, p.region
                    ))
                })?;
            match direction {
                AgentDirection::PoolToRegion => {
                    let pool = a.pool.as_ref().ok_or(CopyFailure::Shutdown)?;
                    pool.read_exact_at(span, p.host_offset).map_err(io)?;
                    if let Some(sum) = p.checksum
                        && xxhash_rust::xxh3::xxh3_64(span) != sum
                    {
                        return Err(CopyFailure::Checksum(p.host_offset));
                    }
                }
                AgentDirection::RegionToStaging => {
                    let staging = staging.as_ref().ok_or(CopyFailure::Shutdown)?;
                    staging.write_all_at(span, p.host_offset).map_err(io)?;
                    sums.push(xxhash_rust::xxh3::xxh3_64(span));
                }
            }
        }
        Ok(sums)
    }

    fn restart(&mut self) -> Result<(), ReplayError> {
        // The old manager's writes finish as it goes; they count in its
        // totals.
        self.rt.finish_demotions();
        self.fold_metrics();
        self.incarnation += 1;
        let (rt, arena, copies) =
            build_runtime(&self.config, &self.header, &self.tiers, self.incarnation)?;
        let now = self.now();
        self.rt = rt;
        self.arena = arena;
        self.copies = copies;
        // The new manager starts at the same simulated time.
        self.tick_with(vec![Command::AdvanceClock { us: now }]);
        self.sessions.clear();
        self.session_origins.clear();
        self.sim_agents = SimAgents::default();
        self.device_pages.clear();
        self.restores.clear();
        self.timers.clear();
        self.todo.clear();
        for r in self.requests.values() {
            if self.report.requests[r.report].outcome == "pending" {
                self.report.requests[r.report].outcome = "lost_in_restart".into();
            }
        }
        self.requests.clear();
        self.op_requests.clear();
        self.publishes.clear();
        self.instances.clear();
        self.raw.clear();
        self.ready_positions.clear();
        self.binds.clear();
        Ok(())
    }

    fn prompt_key(
        &self,
        line: usize,
        instance: &str,
        prompt: &[String],
        page: u64,
        rank: u32,
        group: u32,
    ) -> Result<StateKey, ReplayError> {
        let info = self
            .instances
            .get(instance)
            .ok_or_else(|| line_err(line, format!("unknown instance {instance:?}")))?;
        let hashes = chained_hashes(&prompt.to_vec()).map_err(|e| line_err(line, e))?;
        let native = *hashes
            .get(page as usize)
            .ok_or_else(|| line_err(line, format!("prompt has no page {page}")))?;
        let ns = *info
            .namespaces
            .get(rank as usize)
            .ok_or_else(|| line_err(line, format!("no rank {rank}")))?;
        Ok(StateKey {
            namespace: ns,
            group,
            native: NativeHash::from_u64(native),
        })
    }

    fn tier_put(&mut self, line: usize, p: &TierPut) -> Result<(), ReplayError> {
        let handle = self
            .tiers
            .iter()
            .find(|(n, _, _, _)| *n == p.tier)
            .map(|(_, h, _, _)| h.clone())
            .ok_or_else(|| line_err(line, format!("unknown tier {:?}", p.tier)))?;
        let info = self
            .instances
            .get(&p.instance)
            .cloned()
            .ok_or_else(|| line_err(line, format!("unknown instance {:?}", p.instance)))?;
        let hashes = chained_hashes(&p.prompt).map_err(|e| line_err(line, e))?;
        let to = p
            .to_page
            .unwrap_or(hashes.len() as u64)
            .min(hashes.len() as u64);
        for rank in p.ranks.clone().unwrap_or_else(|| (0..info.ranks).collect()) {
            let Some(&ns) = info.namespaces.get(rank as usize) else {
                continue;
            };
            for g in p
                .groups
                .clone()
                .unwrap_or_else(|| info.groups.iter().map(|g| g.id).collect())
            {
                for i in p.from_page..to {
                    let key = StateKey {
                        namespace: ns,
                        group: g,
                        native: NativeHash::from_u64(hashes[i as usize]),
                    };
                    handle.insert(key, payload(&key, info.bytes(g)));
                    self.observer.available(key);
                }
            }
        }
        Ok(())
    }

    fn register(&mut self, line: usize, r: &Register) -> Result<(), ReplayError> {
        let groups = model_groups(r.model, r.window);
        let identity = orbitkv_components::encoding::sha256(r.identity.as_bytes());
        let command = register_command(
            &r.instance,
            identity,
            groups.clone(),
            r.ranks,
            r.page_tokens,
            r.page_bytes,
        );
        let id = self.submit(command);
        let events = self.tick_with(Vec::new());
        match events.iter().find(|(c, _)| *c == id) {
            Some((_, Event::InstanceRegistered { namespaces, .. })) => {
                if let Err(why) = self.observer.registered(r, namespaces) {
                    self.violation(format!("oracle: {why}"));
                }
                let page_bytes = groups.iter().map(|g| (g.id, r.page_bytes)).collect();
                self.instances.insert(
                    r.instance.clone(),
                    InstanceInfo {
                        namespaces: namespaces.clone(),
                        groups,
                        page_tokens: r.page_tokens,
                        page_bytes,
                        ranks: r.ranks,
                    },
                );
                Ok(())
            }
            Some(_) => Ok(()), // refused: counted, and later lines see an unknown instance
            None => Err(line_err(line, "register got no reply")),
        }
    }

    fn open(&mut self, line: usize, o: &Open) -> Result<(), ReplayError> {
        let Some(info) = self.instances.get(&o.instance).cloned() else {
            return Err(line_err(
                line,
                format!("open: unknown instance {:?}", o.instance),
            ));
        };
        // A new engine process: its own connection.
        let origin = Origin(self.next_origin);
        self.next_origin += 1;
        let id = self.submit_as(
            origin,
            Command::OpenSession {
                instance: o.instance.clone(),
            },
        );
        let events = self.tick_with(Vec::new());
        let Some((_, Event::SessionOpened { session, .. })) = events.iter().find(|(c, _)| *c == id)
        else {
            return Ok(()); // refused (e.g. limits): counted
        };
        let handle = *session;
        self.session_origins.insert(handle.id, origin);
        self.names.insert(
            o.name.clone(),
            serde_json::to_value(handle).expect("plain data"),
        );
        self.session_names.insert(o.name.clone(), handle.id);
        let mut ids = Vec::new();
        if let Some(model) = o.agent {
            self.sim_agents.agents.insert(
                handle.id,
                SimAgent {
                    model,
                    rng: model.seed | 1,
                    vanished: false,
                },
            );
        }
        for rank in 0..info.ranks {
            for g in &info.groups {
                let agent = o.agent.map(|_| {
                    let region = self.sim_agents.next_region;
                    self.sim_agents.next_region += 1;
                    let bytes = info.bytes(g.id);
                    let memory = vec![0xEE; (bytes * u64::from(o.region_slots)) as usize];
                    self.sim_agents.memory.insert(region, (handle.id, memory));
                    AgentRegion {
                        region,
                        page_bytes: bytes,
                    }
                });
                let id = self.submit(Command::RegisterDeviceRegion {
                    session: handle,
                    rank,
                    group: g.id,
                    slots: o.region_slots,
                    agent,
                });
                ids.push((id, rank, g.id));
            }
        }
        let events = self.tick_with(Vec::new());
        let mut regions = BTreeMap::new();
        for (id, rank, group) in ids {
            if let Some((
                _,
                Event::RegionRegistered {
                    region,
                    engine_region,
                    page_bytes,
                    ..
                },
            )) = events.iter().find(|(c, _)| *c == id)
            {
                regions.insert(
                    (rank, group),
                    RegionInfo {
                        handle: *region,
                        engine: *engine_region,
                        agent: o.agent.is_some(),
                        slots: o.region_slots,
                        page_bytes: *page_bytes,
                        live: BTreeSet::new(),
                    },
                );
            }
        }
        self.sessions.insert(
            handle.id,
            SessionInfo {
                handle,
                origin,
                instance: o.instance.clone(),
                regions,
            },
        );
        Ok(())
    }

    fn session_for(&self, line: usize, name: &str) -> Result<Option<u64>, ReplayError> {
        if !name.starts_with('$') {
            return Err(line_err(
                line,
                format!("session {name:?} must be a `$name`"),
            ));
        }
        // A crashed or restarted session is gone: its lines are skipped, as
        // a dead engine process would not send them.
        Ok(self
            .session_names
            .get(name)
            .copied()
            .filter(|id| self.sessions.contains_key(id)))
    }

    /// Allocates device pages; returns handle and slot per request (None
    /// when the region is out of free slots or refused).
    fn alloc(&mut self, session: u64, wants: &[(u32, u32)]) -> Vec<Option<(u64, u32)>> {
        let Some(s) = self.sessions.get_mut(&session) else {
            return vec![None; wants.len()];
        };
        let handle = s.handle;
        let mut planned = Vec::new();
        for &(rank, group) in wants {
            let slot = s.regions.get_mut(&(rank, group)).and_then(|r| {
                let free = (0..r.slots).find(|x| !r.live.contains(x))?;
                r.live.insert(free);
                Some((r.handle, free))
            });
            planned.push(slot);
        }
        let mut ids = Vec::new();
        for p in &planned {
            ids.push(p.map(|(region, slot)| {
                self.submit(Command::DevicePageAlloc {
                    session: handle,
                    region,
                    slot,
                })
            }));
        }
        let events = self.tick_with(Vec::new());
        if !self.sessions.contains_key(&session) {
            // The engine died during that tick (its agent vanished): what
            // it allocated went with its session.
            return vec![None; wants.len()];
        }
        let mut out = Vec::new();
        for ((want, plan), id) in wants.iter().zip(planned).zip(ids) {
            let got = id.and_then(|id| match events.iter().find(|(c, _)| *c == id) {
                Some((_, Event::DevicePageAllocated { device_page, .. })) => Some(*device_page),
                _ => None,
            });
            match (plan, got) {
                (Some((_, slot)), Some(dp)) => {
                    self.device_pages.insert(
                        dp,
                        DevicePageInfo {
                            session,
                            rank: want.0,
                            group: want.1,
                            slot,
                        },
                    );
                    out.push(Some((dp, slot)));
                }
                (Some((_, slot)), None) => {
                    // Refused (a deferred free still holds it): not ours yet.
                    if let Some(r) = self
                        .sessions
                        .get_mut(&session)
                        .and_then(|s| s.regions.get_mut(want))
                    {
                        r.live.remove(&slot);
                    }
                    out.push(None);
                }
                _ => out.push(None),
            }
        }
        out
    }

    fn key_for(
        &self,
        instance: &str,
        rank: u32,
        group: u32,
        native: NativeHash,
    ) -> Option<StateKey> {
        let ns = *self
            .instances
            .get(instance)?
            .namespaces
            .get(rank as usize)?;
        Some(StateKey {
            namespace: ns,
            group,
            native,
        })
    }

    /// Writes each publish source's key bytes into its device slot.
    fn fill_sources(&mut self, session: u64, pages: &[PublishPage]) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let instance = s.instance.clone();
        for p in pages {
            let (Some(dp), Some(key)) = (
                self.device_pages.get(&p.device_page),
                self.key_for(&instance, p.rank, p.group, p.hash),
            ) else {
                continue;
            };
            if let Some(region) = self
                .sessions
                .get(&session)
                .and_then(|s| s.regions.get(&(dp.rank, dp.group)))
            {
                let bytes = region.page_bytes;
                let at = u64::from(dp.slot) * bytes;
                if region.agent {
                    if let Some((_, mem)) = self.sim_agents.memory.get_mut(&region.engine)
                        && let Some(dst) = mem.get_mut(at as usize..(at + bytes) as usize)
                    {
                        dst.copy_from_slice(&payload(&key, bytes));
                    }
                } else {
                    let _ = self.arena.write(region.engine, at, &payload(&key, bytes));
                }
                self.observer.available(key);
            }
        }
    }

    fn publish_macro(&mut self, line: usize, p: &Publish) -> Result<(), ReplayError> {
        let Some(session) = self.session_for(line, &p.session)? else {
            return Ok(());
        };
        let instance = self.sessions[&session].instance.clone();
        let Some(info) = self.instances.get(&instance).cloned() else {
            return Ok(());
        };
        let hashes = chained_hashes(&p.prompt).map_err(|e| line_err(line, e))?;
        let to = p
            .to_page
            .unwrap_or(hashes.len() as u64)
            .min(hashes.len() as u64);
        let mut wants = Vec::new();
        for rank in p.ranks.clone().unwrap_or_else(|| (0..info.ranks).collect()) {
            for g in &info.groups {
                if p.groups.as_ref().is_some_and(|gs| !gs.contains(&g.id)) {
                    continue;
                }
                for i in p.from_page..to {
                    let every = p.checkpoint_every.unwrap_or(1).max(1);
                    if g.rule == Rule::Checkpoint && (i + 1) % every != 0 {
                        continue;
                    }
                    wants.push((rank, g.id, i));
                }
            }
        }
        let slots = self.alloc(
            session,
            &wants.iter().map(|&(r, g, _)| (r, g)).collect::<Vec<_>>(),
        );
        let mut pages = Vec::new();
        let mut sources = Vec::new();
        for (&(rank, group, i), got) in wants.iter().zip(slots) {
            if let Some((dp, _)) = got {
                pages.push(PublishPage {
                    rank,
                    group,
                    hash: NativeHash::from_u64(hashes[i as usize]),
                    device_page: dp,
                });
                sources.push(dp);
            }
        }
        if pages.is_empty() {
            return Ok(());
        }
        // The allocation ticked: the engine may have died meanwhile (its
        // agent vanished during that tick), and a dead engine sends nothing.
        let Some(handle) = self.sessions.get(&session).map(|s| s.handle) else {
            return Ok(());
        };
        self.fill_sources(session, &pages);
        let id = self.submit(Command::Publish {
            session: handle,
            request: p.request,
            pages,
        });
        self.publishes.insert(id, (session, self.now(), sources));
        Ok(())
    }

    fn request(&mut self, line: usize, r: &Request) -> Result<(), ReplayError> {
        let Some(session) = self.session_for(line, &r.session)? else {
            return Ok(());
        };
        let s = &self.sessions[&session];
        let (handle, instance) = (s.handle, s.instance.clone());
        let Some(info) = self.instances.get(&instance).cloned() else {
            return Ok(());
        };
        let hashes = chained_hashes(&r.prompt).map_err(|e| line_err(line, e))?;
        let tokens = hashes.len() as u64 * info.page_tokens;
        let prompt_len = r.prompt_len.unwrap_or(tokens + 1);
        let natives: Vec<NativeHash> = hashes.iter().map(|h| NativeHash::from_u64(*h)).collect();
        let groups: Vec<GroupHashes> = info
            .groups
            .iter()
            .map(|g| GroupHashes {
                group: g.id,
                hashes: natives.clone(),
            })
            .collect();
        let id = if r.then == Then::Load {
            let Some(targets) = self.load_plan(session, &info, hashes.len() as u64) else {
                return Ok(()); // no room for its targets: the engine does not ask
            };
            let id = self.submit(Command::Load {
                session: handle,
                request: r.request,
                groups,
                origin: r.origin,
                prompt_len,
                expect_namespaces: info.namespaces.clone(),
                ranks: (0..info.ranks).collect(),
                targets: targets.clone(),
                retained: vec![],
                handoff: None,
            });
            self.load_plans.insert(id, (session, targets));
            id
        } else {
            self.submit(Command::Query {
                session: handle,
                request: r.request,
                groups,
                origin: r.origin,
                prompt_len,
                expect_namespaces: info.namespaces.clone(),
                prepare: true,
                speculative: r.speculative,
            })
        };
        self.report.requests.push(RequestReport {
            line,
            request: r.request,
            instance: instance.clone(),
            tokens: tokens.saturating_sub(r.origin),
            outcome: "pending".into(),
            ..Default::default()
        });
        if let Some(name) = &r.name {
            self.binds.insert(id, (name.clone(), line));
        }
        self.requests.insert(
            id,
            RequestState {
                session,
                instance,
                spec: r.clone(),
                hashes,
                prompt_len,
                submitted_us: self.now(),
                operation: None,
                report: self.report.requests.len() - 1,
            },
        );
        Ok(())
    }

    // ---- events --------------------------------------------------------

    fn handle(&mut self, e: &Event, now: u64) {
        if let Some(id) = e.command() {
            if let Some((name, _)) = self.binds.remove(&id)
                && let Some(v) = event_handle(e)
            {
                self.names.insert(name, v);
            }
            if let Some(p) = self.raw.remove(&id) {
                self.raw_reply(p, e);
            }
        }
        match e {
            Event::Rejected { command, error } => {
                *self
                    .report
                    .totals
                    .rejected
                    .entry(error.kind().into())
                    .or_default() += 1;
                if let Some(r) = self.requests.remove(command) {
                    self.report.requests[r.report].outcome = "rejected".into();
                    // A load whose plan was refused once its pages were
                    // leased: nothing was copied into its targets.
                    if let Some(op) = r.operation {
                        self.op_requests.remove(&op);
                        self.ready_positions.remove(&op);
                        let plan = self.load_targets.remove(&op);
                        self.free_load(plan);
                        if let Some(st) = self.restores.remove(&op) {
                            let pages = st.targets.iter().map(|t| t.device_page).collect();
                            self.todo.push(Todo::Free {
                                session: st.session,
                                pages,
                            });
                        }
                    }
                }
                let plan = self.load_plans.remove(command);
                self.free_load(plan);
                // A refused publish leaves its source pages to the engine.
                if let Some((session, _, sources)) = self.publishes.remove(command) {
                    self.todo.push(Todo::Free {
                        session,
                        pages: sources,
                    });
                }
            }
            Event::InstanceRegistered { .. }
            | Event::SessionOpened { .. }
            | Event::RegionRegistered { .. }
            | Event::DevicePageAllocated { .. }
            | Event::Held { .. }
            | Event::Cleared { .. } => {}
            Event::DevicePageFreed { device_page, .. } => {
                if let Some(dp) = self.device_pages.remove(device_page)
                    && let Some(r) = self
                        .sessions
                        .get_mut(&dp.session)
                        .and_then(|s| s.regions.get_mut(&(dp.rank, dp.group)))
                {
                    r.live.remove(&dp.slot);
                }
            }
            Event::SessionClosed { session, .. } => {
                if let Some(s) = self.sessions.remove(&session.id) {
                    let _ = s;
                    self.device_pages.retain(|_, d| d.session != session.id);
                }
            }
            Event::QueryResult {
                command,
                operation,
                selected,
                miss,
                ..
            } => {
                if let Some(at) = self.queries_at.remove(command) {
                    self.latencies.entry("query").or_default().push(now - at);
                }
                if let Some(plan) = self.load_plans.remove(command) {
                    if miss.is_some() {
                        self.free_load(Some(plan));
                    } else {
                        self.load_targets.insert(*operation, plan);
                    }
                }
                if let Some(r) = self.requests.get_mut(command) {
                    self.latencies
                        .entry("query")
                        .or_default()
                        .push(now - r.submitted_us);
                    r.operation = Some(*operation);
                    self.op_requests.insert(*operation, *command);
                    let rep = &mut self.report.requests[r.report];
                    rep.selected = *selected;
                    if let Some(m) = miss {
                        rep.outcome = "miss".into();
                        rep.miss_reason = Some(*m);
                        self.requests.remove(command);
                        self.op_requests.remove(operation);
                    } else if let Some(after) = r.spec.cancel_after_us {
                        let (session, at) = (r.session, r.submitted_us + after);
                        self.add_timer(
                            at,
                            Timer::Cancel {
                                session,
                                operation: *operation,
                            },
                        );
                    }
                }
            }
            Event::Ready {
                operation,
                boundary,
                leases,
                pages_from_dram,
                pages_from_tiers,
                ..
            } => {
                self.ready_positions
                    .insert(*operation, leases.iter().map(|l| l.pos).collect());
                let Some(&cmd) = self.op_requests.get(operation) else {
                    return;
                };
                let Some(r) = self.requests.get(&cmd) else {
                    return;
                };
                self.latencies
                    .entry("prepare")
                    .or_default()
                    .push(now - r.submitted_us);
                let info = self.instances.get(&r.instance).cloned();
                let rep = &mut self.report.requests[r.report];
                rep.pages_from_dram = *pages_from_dram;
                rep.pages_from_tiers = *pages_from_tiers;
                if let Some(info) = info {
                    let leased: Vec<PagePos> = leases.iter().map(|l| l.pos).collect();
                    let ctx = ReadyContext {
                        instance: &r.instance,
                        namespaces: &info.namespaces,
                        groups: &info.groups,
                        page_tokens: info.page_tokens,
                        origin: r.spec.origin,
                        prompt_len: r.prompt_len,
                        hashes: &r.hashes,
                        boundary: *boundary,
                        leased: &leased,
                    };
                    if let Err(why) = self.observer.ready(&ctx) {
                        self.report.invariant_violations += 1;
                        if self.report.violations.len() < MAX_VIOLATIONS_KEPT {
                            self.report
                                .violations
                                .push(format!("t={now}: oracle: {why}"));
                        }
                    }
                }
                match r.spec.then {
                    Then::Restore => self.todo.push(Todo::Restore(*operation)),
                    Then::Load => {
                        // The runtime restores into the targets of what it
                        // leased; the others are free again.
                        if let Some((session, targets)) = self.load_targets.remove(operation) {
                            let leased: std::collections::HashSet<PagePos> =
                                leases.iter().map(|l| l.pos).collect();
                            let (used, unused): (Vec<RestoreTarget>, Vec<RestoreTarget>) =
                                targets.into_iter().partition(|t| leased.contains(&t.pos));
                            self.track_restore(session, *operation, &used);
                            self.free_load(Some((session, unused)));
                        }
                    }
                    Then::Release => {
                        let handle = self.sessions.get(&r.session).map(|s| s.handle);
                        if let Some(h) = handle {
                            self.submit(Command::Release {
                                session: h,
                                operation: *operation,
                            });
                        }
                    }
                    Then::Nothing => {}
                }
            }
            Event::Loading { .. } => {}
            Event::Miss { operation, reason } => {
                let plan = self.load_targets.remove(operation);
                self.free_load(plan);
                let is_load = self
                    .op_requests
                    .get(operation)
                    .and_then(|c| self.requests.get(c))
                    .is_some_and(|r| r.spec.then == Then::Load);
                if let Some(st) = self.restores.remove(operation)
                    && is_load
                {
                    let pages = st.targets.iter().map(|t| t.device_page).collect();
                    self.todo.push(Todo::Free {
                        session: st.session,
                        pages,
                    });
                }
                self.ready_positions.remove(operation);
                if let Some(cmd) = self.op_requests.remove(operation)
                    && let Some(r) = self.requests.remove(&cmd)
                {
                    let rep = &mut self.report.requests[r.report];
                    rep.outcome = "miss".into();
                    rep.miss_reason = Some(*reason);
                }
            }
            Event::Released { operation } => {
                self.ready_positions.remove(operation);
                if let Some(cmd) = self.op_requests.remove(operation)
                    && let Some(r) = self.requests.remove(&cmd)
                {
                    self.report.requests[r.report].outcome = "released".into();
                }
            }
            Event::RestoreDone { operation, .. } => {
                self.ready_positions.remove(operation);
                if let Some(st) = self.restores.remove(operation) {
                    self.latencies
                        .entry("restore")
                        .or_default()
                        .push(now - st.submitted_us);
                    self.verify(&st);
                    let pages: Vec<u64> = st.targets.iter().map(|t| t.device_page).collect();
                    self.todo.push(Todo::Free {
                        session: st.session,
                        pages,
                    });
                }
                if let Some(cmd) = self.op_requests.remove(operation)
                    && let Some(r) = self.requests.remove(&cmd)
                {
                    let rep = &mut self.report.requests[r.report];
                    rep.outcome = "restored".into();
                    rep.hit_tokens = rep.selected.unwrap_or(0).saturating_sub(r.spec.origin);
                }
            }
            Event::PublishDone { command, .. } => {
                if let Some((session, at, sources)) = self.publishes.remove(command) {
                    self.latencies.entry("publish").or_default().push(now - at);
                    self.todo.push(Todo::Free {
                        session,
                        pages: sources,
                    });
                } else if let Some(at) = self.queries_at.remove(command) {
                    self.latencies.entry("publish").or_default().push(now - at);
                }
            }
            Event::TransferOverdue { .. } => {}
            // Copies for the regions of sessions opened with `agent` are
            // the simulated agent's; a raw `cmd` line that asks for an
            // agent region gets copies nobody runs, which fail at their
            // deadline like a lost agent's.
            Event::AgentCopy {
                copy,
                direction,
                pages,
            } => self.agent_copy(*copy, *direction, pages),
        }
    }

    fn violation(&mut self, what: String) {
        self.report.invariant_violations += 1;
        if self.report.violations.len() < MAX_VIOLATIONS_KEPT {
            self.report
                .violations
                .push(format!("t={}: {what}", self.now()));
        }
    }

    /// Restored bytes must be exactly what each key holds.
    fn verify(&mut self, st: &RestoreState) {
        let agent_pages = st.targets.iter().filter(|t| t.agent).count() as u64;
        if agent_pages > 0 {
            *self
                .report
                .totals
                .agent_copies
                .entry("pages_verified".into())
                .or_default() += agent_pages;
        }
        for t in &st.targets {
            let got = if t.agent {
                self.sim_agents
                    .memory
                    .get(&t.engine_region)
                    .and_then(|(_, m)| m.get(t.offset as usize..(t.offset + t.bytes) as usize))
                    .map(<[u8]>::to_vec)
            } else {
                self.arena.read(t.engine_region, t.offset, t.bytes).ok()
            };
            if got.as_deref() != Some(&payload(&t.key, t.bytes)[..]) {
                self.report.byte_mismatches += 1;
                if self.report.violations.len() < MAX_VIOLATIONS_KEPT {
                    self.report.violations.push(format!(
                        "t={}: restored bytes of {:?} differ",
                        self.now(),
                        t.key
                    ));
                }
            }
        }
    }

    /// Remembers where a restore's pages go and which key each must hold.
    /// Keys come from the request's prompt, so only requests the driver
    /// issued are byte-checked.
    fn track_restore(&mut self, session: u64, operation: u64, targets: &[RestoreTarget]) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let instance = s.instance.clone();
        let Some(r) = self
            .op_requests
            .get(&operation)
            .and_then(|c| self.requests.get(c))
        else {
            return;
        };
        let Some(info) = self.instances.get(&instance) else {
            return;
        };
        let mut list = Vec::new();
        for t in targets {
            let index = (t.pos.page_end / info.page_tokens).saturating_sub(1) as usize;
            let (Some(&h), Some(dp)) = (r.hashes.get(index), self.device_pages.get(&t.device_page))
            else {
                continue;
            };
            let Some(region) = s.regions.get(&(dp.rank, dp.group)) else {
                continue;
            };
            if let Some(key) =
                self.key_for(&instance, t.pos.rank, t.pos.group, NativeHash::from_u64(h))
            {
                list.push(RestoredPage {
                    key,
                    engine_region: region.engine,
                    agent: region.agent,
                    offset: u64::from(dp.slot) * region.page_bytes,
                    bytes: region.page_bytes,
                    device_page: t.device_page,
                });
            }
        }
        self.restores.insert(
            operation,
            RestoreState {
                submitted_us: self.now(),
                session,
                targets: list,
            },
        );
    }

    fn run_todo(&mut self) {
        // Bounded: each round's work comes from the previous round's events.
        for _ in 0..64 {
            if self.todo.is_empty() {
                return;
            }
            let work = std::mem::take(&mut self.todo);
            for item in work {
                match item {
                    Todo::Restore(op) => self.restore(op),
                    Todo::Crash(session) => self.crash(session),
                    Todo::Free { session, pages } => {
                        let Some(handle) = self.sessions.get(&session).map(|s| s.handle) else {
                            continue;
                        };
                        for p in pages {
                            if self.device_pages.contains_key(&p) {
                                self.submit(Command::DevicePageFree {
                                    session: handle,
                                    device_page: p,
                                });
                            }
                        }
                    }
                }
            }
        }
    }

    /// A `load`'s targets: a device page for every page of every rank and
    /// group of the prompt (allocated now, one tick); `None`, with what it
    /// got freed, when a region is full or the engine died meanwhile.
    fn load_plan(
        &mut self,
        session: u64,
        info: &InstanceInfo,
        pages: u64,
    ) -> Option<Vec<RestoreTarget>> {
        let mut positions = Vec::new();
        for rank in 0..info.ranks {
            for g in &info.groups {
                for k in 0..pages {
                    positions.push(PagePos {
                        rank,
                        group: g.id,
                        page_end: (k + 1) * info.page_tokens,
                    });
                }
            }
        }
        let wants: Vec<(u32, u32)> = positions.iter().map(|p| (p.rank, p.group)).collect();
        let slots = self.alloc(session, &wants);
        if !self.sessions.contains_key(&session) {
            return None;
        }
        let got: Vec<u64> = slots.iter().flatten().map(|(dp, _)| *dp).collect();
        if got.len() != positions.len() {
            self.todo.push(Todo::Free {
                session,
                pages: got,
            });
            return None;
        }
        Some(
            positions
                .into_iter()
                .zip(got)
                .map(|(pos, device_page)| RestoreTarget { pos, device_page })
                .collect(),
        )
    }

    /// Frees a `load`'s targets once it ended.
    fn free_load(&mut self, plan: Option<(u64, Vec<RestoreTarget>)>) {
        if let Some((session, targets)) = plan {
            self.todo.push(Todo::Free {
                session,
                pages: targets.iter().map(|t| t.device_page).collect(),
            });
        }
    }

    /// The engine restores a ready recovery into fresh device pages.
    fn restore(&mut self, op: u64) {
        let Some(&cmd) = self.op_requests.get(&op) else {
            return;
        };
        let Some(r) = self.requests.get(&cmd) else {
            return;
        };
        let session = r.session;
        let Some(handle) = self.sessions.get(&session).map(|s| s.handle) else {
            return;
        };
        let free_after = r.spec.free_targets_after_us;
        // The lease positions are in the last Ready for this operation,
        // recomputed here from the ranges the engine was given.
        let Some(positions) = self.last_ready_positions(op) else {
            return;
        };
        let slots = self.alloc(
            session,
            &positions
                .iter()
                .map(|p| (p.rank, p.group))
                .collect::<Vec<_>>(),
        );
        if !self.sessions.contains_key(&session) {
            return; // the engine died during the allocation's tick
        }
        if slots.iter().any(Option::is_none) {
            // Out of device pages: the engine gives the recovery up.
            let got: Vec<u64> = slots.iter().flatten().map(|(dp, _)| *dp).collect();
            self.todo.push(Todo::Free {
                session,
                pages: got,
            });
            self.submit(Command::Release {
                session: handle,
                operation: op,
            });
            return;
        }
        let targets: Vec<RestoreTarget> = positions
            .iter()
            .zip(&slots)
            .map(|(pos, s)| RestoreTarget {
                pos: *pos,
                device_page: s.expect("checked").0,
            })
            .collect();
        self.track_restore(session, op, &targets);
        if let Some(after) = free_after {
            let pages = targets.iter().map(|t| t.device_page).collect();
            self.add_timer(self.now() + after, Timer::Free { session, pages });
        }
        self.submit(Command::Restore {
            session: handle,
            operation: op,
            targets,
            retained: vec![],
        });
    }

    fn last_ready_positions(&self, op: u64) -> Option<Vec<PagePos>> {
        self.ready_positions.get(&op).cloned()
    }

    /// Adds this incarnation's counters to the report's totals. Its
    /// demotions must have finished (`finish_demotions`): every one it
    /// submitted was then written or failed, which is checked here, so the
    /// totals across restarts add up as well.
    fn fold_metrics(&mut self) {
        let m = self.rt.metrics().clone();
        let count = |k: &str| m.demotions.get(k).copied().unwrap_or(0);
        let (submitted, written, failed) = (count("submitted"), count("written"), count("failed"));
        if submitted != written + failed {
            self.violation(format!(
                "incarnation {}: {submitted} demotion(s) submitted, {written} written and \
                 {failed} failed once its writes finished",
                self.incarnation
            ));
        }
        let t = &mut self.report.totals;
        t.queries += m.queries;
        t.hits += m.hits;
        t.hit_tokens += m.hit_tokens;
        t.queried_tokens += m.queried_tokens;
        for (k, v) in &m.misses {
            *t.misses.entry(*k).or_default() += v;
        }
        for (k, v) in &m.evictions {
            *t.evictions
                .entry(
                    serde_json::to_value(k)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        .unwrap_or_default(),
                )
                .or_default() += v;
        }
        *t.bytes.entry("device_to_dram".into()).or_default() += m.bytes_published;
        *t.bytes.entry("dram_to_device".into()).or_default() += m.bytes_restored;
        for (tier, b) in &m.bytes_read_by_tier {
            *t.bytes.entry(format!("{tier}_to_dram")).or_default() += b;
        }
        *t.publish_pages.entry("inserted".into()).or_default() += m.pages_published;
        *t.publish_pages.entry("duplicate".into()).or_default() += m.publish_duplicates;
        *t.publish_pages.entry("dropped".into()).or_default() += m.publish_dropped;
        t.transfers_overdue += m.transfers_overdue;
        for (k, v) in &m.demotions {
            *t.demotions.entry(k.clone()).or_default() += v;
        }
    }

    fn finish(mut self) -> (Report, Vec<Sample>) {
        self.rt.finish_demotions();
        self.fold_metrics();
        let s = self.rt.stats();
        self.report.final_occupancy = Occupancy {
            dram_pages: s.pages as u64,
            dram_bytes_used: s.pool_bytes_used,
            dram_capacity_bytes: s.pool_capacity_bytes,
            tier_pages: self
                .tiers
                .iter()
                .map(|(n, h, _, _)| (n.clone(), h.len() as u64))
                .collect(),
            operations: s.operations as u64,
            leases: s.leases as u64,
            bytes_reserved: s.bytes_reserved,
        };
        for (stage, mut v) in std::mem::take(&mut self.latencies) {
            self.report
                .latency_us
                .insert(stage.to_owned(), Percentiles::of(&mut v));
        }
        self.report.sim_time_us = s.now_us;
        self.report.ticks = self.ticks;
        self.sample();
        (self.report, self.samples)
    }
}

/// The session a command names, if any.
fn session_of(command: &Command) -> Option<u64> {
    match command {
        Command::CloseSession { session }
        | Command::RegisterDeviceRegion { session, .. }
        | Command::DevicePageAlloc { session, .. }
        | Command::DevicePageFree { session, .. }
        | Command::Query { session, .. }
        | Command::Lookup { session, .. }
        | Command::Load { session, .. }
        | Command::Hold { session, .. }
        | Command::Prepare { session, .. }
        | Command::Restore { session, .. }
        | Command::Publish { session, .. }
        | Command::Release { session, .. }
        | Command::Cancel { session, .. } => Some(session.id),
        Command::RegisterInstance { .. }
        | Command::OpenSession { .. }
        | Command::CopyDone { .. }
        | Command::Clear { .. }
        | Command::AdvanceClock { .. } => None,
    }
}

fn model_groups(model: Model, window: u64) -> Vec<GroupSpec> {
    let (prefix, swa) = (
        GroupSpec::attention(0),
        GroupSpec::sliding_window(1, window.max(1)),
    );
    match model {
        Model::Dense => vec![prefix],
        Model::Swa => vec![prefix, swa],
        Model::Hybrid => vec![prefix, GroupSpec::recurrent(1)],
        Model::HybridSwa => vec![prefix, swa, GroupSpec::recurrent(2)],
    }
}

/// The handle a reply binds, as it appears in commands.
fn event_handle(e: &Event) -> Option<Value> {
    match e {
        Event::SessionOpened { session, .. } => serde_json::to_value(session).ok(),
        Event::RegionRegistered { region, .. } => Some((*region).into()),
        Event::DevicePageAllocated { device_page, .. } => Some((*device_page).into()),
        Event::QueryResult { operation, .. } => Some((*operation).into()),
        Event::InstanceRegistered { instance, .. } => Some((*instance).into()),
        _ => None,
    }
}

/// Replays trace text: parse, run, report.
pub fn replay_text(
    text: &str,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Report, Vec<Sample>), Vec<String>> {
    let trace = crate::trace::parse(text, 20)
        .map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>())?;
    let replay = Replay::new(&trace.header).map_err(|e| vec![e.to_string()])?;
    replay
        .run(&trace, progress)
        .map_err(|e| vec![e.to_string()])
}
