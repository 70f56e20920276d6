//! Metrics: typed `prometheus-client` counters, gauges and latency
//! histograms, refreshed from the runtime's snapshot by the event loop and
//! served at `/metrics` by [`crate::http`]; and the windows `orbitkv
//! inspect` shows (the last minute, from per-second samples).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv_components::api::{Command, CommandError, CommandId, Event, MissReason};
use orbitkv_io::remote::RemoteStatsHandle;
use orbitkv_ipc::Window;
use orbitkv_world::Stats;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::remote_metrics::RemoteCollector;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Refusal {
    pub command: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Stage {
    pub stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Tier {
    pub tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Source {
    pub source: String,
}

/// Per tier (`dram`, and each lower tier by name: `ssd`, `remote`): what
/// the dashboard's occupancy and bytes-moved panels read.
struct Tiers {
    bytes_used: Family<Tier, Gauge>,
    capacity_bytes: Family<Tier, Gauge>,
    /// Mirrored from the runtime's `bytes_read_by_tier`.
    read_bytes: Family<Tier, Counter>,
    /// Pages leased to recoveries, by where they were when leased: `dram`
    /// (resident) or `tiers` (read from a lower tier), from `ready` events.
    leased_pages: Family<Source, Counter>,
    /// What a load reads, measured (`Stats::load_rates`): `device` (copies
    /// from DRAM into device pages) and each lower tier's reads.
    load_rate: Family<Source, Gauge>,
}

/// The runtime's cumulative counters, mirrored into Prometheus counters by
/// their increase since the last refresh.
struct Mirrored {
    queries: Counter,
    hits: Counter,
    hit_tokens: Counter,
    queried_tokens: Counter,
    bytes_restored: Counter,
    bytes_published: Counter,
    bytes_read: Counter,
    checksum_failures: Counter,
    publish_checksum_refusals: Counter,
    kv_events_races: Counter,
    transfers_overdue: Counter,
    commands_rejected: Counter,
    refusals: Family<Refusal, Counter>,
    misses: Family<Reason, Counter>,
    evictions: Family<Reason, Counter>,
    demotions: Family<Outcome, Counter>,
    write_through: Family<Outcome, Counter>,
    /// P/D handoffs: `held`, then `taken` or `expired`.
    handoffs: Family<Outcome, Counter>,
}

struct Gauges {
    pages: Gauge,
    dram_bytes_used: Gauge,
    dram_capacity_bytes: Gauge,
    bytes_reserved: Gauge,
    leases: Gauge,
    operations: Gauge,
    sessions: Gauge,
    transfers: Gauge,
    connections: Gauge,
    outbox_bytes: Gauge,
    hot_open_requests: Gauge,
    handoffs_standing: Gauge,
    handoff_pinned_pages: Gauge,
    handoff_reserved_bytes: Gauge,
}

/// Manager-side counters (the loop's own events).
pub struct Counters {
    /// Rounds of the event loop (its wake-ups): a few per second when idle.
    pub loop_rounds: Counter,
    /// Hot-path lookups answered between ticks (`Runtime::answer_now`).
    pub answered_between_ticks: Counter,
    pub hot_warmed: Counter,
    pub disconnects: Family<Reason, Counter>,
    pub protocol_errors: Counter,
    pub hot_requests: Counter,
    pub hot_errors: Counter,
    pub hot_responses: Counter,
    pub hot_fallbacks: Counter,
    pub hot_wakes: Counter,
    /// Lookups (`orbitkv lookup`, routers' `POST /lookup`), by outcome:
    /// `answered`, `refused` (by the runtime: unknown instance, too many
    /// hashes), and the endpoint's own `rate_limited`, `busy`,
    /// `too_large`, `bad_request`, `timeout`.
    pub lookups: Family<Outcome, Counter>,
    /// Lookups the engines answered as misses (`not_found`) from the
    /// presence filter, without asking (not in `queries` or `misses`).
    pub presence_misses: Counter,
    /// Rebuilds of the presence filter, by reason.
    pub presence_rebuilds: Family<Reason, Counter>,
    /// 1 while the presence filter may answer lookups.
    pub presence_open: Gauge,
    /// Bits set in the presence filter, in thousandths of its bits.
    pub presence_fill_permille: Gauge,
}

/// A clock a command starts: its own (answered by a command's reply), or
/// its operation's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartClock {
    Command(Timed),
    Operation(u64, Timed),
}

/// What a pending latency measurement is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timed {
    Query,
    Prepare,
    Restore,
    Publish,
}

impl Timed {
    fn name(self) -> &'static str {
        match self {
            Timed::Query => "query",
            Timed::Prepare => "prepare",
            Timed::Restore => "restore",
            Timed::Publish => "publish",
        }
    }
}

/// The `stage` labels of `latency_seconds`.
const STAGES: [&str; 5] = ["query", "prepare", "restore", "publish", "tick"];

/// Latency measurements in flight, bounded: past the bound the oldest are
/// forgotten (a missed sample, never unbounded memory).
const MAX_TIMED: usize = 1 << 17;

pub struct Metrics {
    pub registry: Arc<Registry>,
    mirrored: Mirrored,
    gauges: Gauges,
    tiers: Tiers,
    pub counters: Counters,
    /// The KV event stream's counters (registered whether or not it runs).
    pub events: crate::events::EventCounters,
    /// Each stage's histogram of `latency_seconds`, looked up once: an
    /// observation is then an atomic add, not a label lookup.
    stage_latency: [Histogram; 5],
    last: Option<orbitkv_world::Stats>,
    by_command: HashMap<CommandId, (Timed, Instant)>,
    by_operation: HashMap<(u64, Timed), Instant>,
    order: VecDeque<CommandId>,
    /// Per-second samples of the cumulative counters, the last minute.
    samples: VecDeque<(Instant, Window)>,
    started: Instant,
    total: Window,
    hot_last: orbitkv_ipc::hot_server::HotStats,
}

fn latency_buckets() -> Histogram {
    // 1 us .. ~8 s.
    Histogram::new(exponential_buckets(1e-6, 2.0, 24))
}

impl Metrics {
    /// The registry, with the remote tier's counters when the runtime has
    /// one (read at each scrape).
    pub fn new(remote: Option<RemoteStatsHandle>) -> Metrics {
        let mut r = Registry::with_prefix("orbitkv");
        if let Some(handle) = remote {
            r.sub_registry_with_prefix("remote")
                .register_collector(Box::new(RemoteCollector(handle)));
        }
        let counter = |r: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            r.register(name, help, c.clone());
            c
        };
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let mirrored = Mirrored {
            queries: counter(&mut r, "queries", "Queries validated"),
            hits: counter(&mut r, "hits", "Recoveries restored"),
            hit_tokens: counter(
                &mut r,
                "hit_tokens",
                "Tokens restored instead of recomputed",
            ),
            queried_tokens: counter(&mut r, "queried_tokens", "Tokens queried past the origin"),
            bytes_restored: counter(&mut r, "bytes_restored", "Bytes copied DRAM to device"),
            bytes_published: counter(&mut r, "bytes_published", "Bytes copied device to DRAM"),
            bytes_read: counter(&mut r, "bytes_read", "Bytes read from lower tiers"),
            checksum_failures: counter(
                &mut r,
                "checksum_failures",
                "Pages whose bytes failed verification (never served)",
            ),
            kv_events_races: counter(
                &mut r,
                "kv_events_races",
                "Queries that stopped at a page this host advertised in its KV events and removed \
                 lately: a router routed on an event gone stale (a miss, never a false hit)",
            ),
            publish_checksum_refusals: counter(
                &mut r,
                "publish_checksum_refusals",
                "Published pages whose staged bytes differ from the agent's checksum (never stored)",
            ),
            transfers_overdue: counter(&mut r, "transfers_overdue", "Transfers past their timeout"),
            commands_rejected: counter(&mut r, "commands_rejected", "Commands refused"),
            refusals: Family::default(),
            misses: Family::default(),
            evictions: Family::default(),
            demotions: Family::default(),
            write_through: Family::default(),
            handoffs: Family::default(),
        };
        r.register("misses", "Misses by reason", mirrored.misses.clone());
        r.register(
            "handoffs",
            "P/D handoffs (a prefill engine's promise of a prompt's pages to a decode engine), by \
             outcome: held, then taken (a decode engine's load took the pages) or expired (its \
             deadline passed first: the decode engine recomputes)",
            mirrored.handoffs.clone(),
        );
        for outcome in ["held", "taken", "expired"] {
            let _ = mirrored.handoffs.get_or_create(&Outcome {
                outcome: outcome.into(),
            });
        }
        r.register(
            "refusals",
            "Commands refused, by command and reason (a refusal is not unavailability)",
            mirrored.refusals.clone(),
        );
        r.register(
            "evictions",
            "Evictions by reason",
            mirrored.evictions.clone(),
        );
        r.register(
            "demotions",
            "Evicted pages offered to a lower tier, by outcome",
            mirrored.demotions.clone(),
        );
        r.register(
            "write_through",
            "Published pages offered to a tier that shares them (write-through), by outcome",
            mirrored.write_through.clone(),
        );
        // Every reason shows, at 0 until it happens: a dashboard's rate()
        // and an alert's increase() see a series from the first scrape on.
        for reason in MissReason::ALL {
            let _ = mirrored.misses.get_or_create(&Reason {
                reason: reason.as_str().into(),
            });
        }
        // `EvictReason::Capacity`, the one reason there is.
        let _ = mirrored.evictions.get_or_create(&Reason {
            reason: "capacity".into(),
        });
        for outcome in ["submitted", "written", "failed"] {
            let _ = mirrored.demotions.get_or_create(&Outcome {
                outcome: outcome.into(),
            });
        }
        let _ = mirrored.write_through.get_or_create(&Outcome {
            outcome: "submitted".into(),
        });
        let tiers = Tiers {
            bytes_used: Family::default(),
            capacity_bytes: Family::default(),
            read_bytes: Family::default(),
            leased_pages: Family::default(),
            load_rate: Family::default(),
        };
        r.register(
            "load_rate_bytes_per_second",
            "Measured rate of what a load reads, by source: device (DRAM to device pages) or a \
             lower tier's reads; 0 until measured ([restore] prefill_tokens_per_s weighs loads \
             against it)",
            tiers.load_rate.clone(),
        );
        r.register(
            "tier_bytes_used",
            "Bytes stored, by tier (dram, ssd, remote)",
            tiers.bytes_used.clone(),
        );
        r.register(
            "tier_capacity_bytes",
            "Capacity, by tier (dram, ssd, remote)",
            tiers.capacity_bytes.clone(),
        );
        r.register(
            "tier_read_bytes",
            "Bytes read into DRAM from a lower tier, by tier",
            tiers.read_bytes.clone(),
        );
        r.register(
            "leased_pages",
            "Pages leased to recoveries, by source: dram (resident) or tiers (read from a lower \
             tier)",
            tiers.leased_pages.clone(),
        );
        for source in ["dram", "tiers"] {
            let _ = tiers.leased_pages.get_or_create(&Source {
                source: source.into(),
            });
        }
        let gauges = Gauges {
            pages: gauge(&mut r, "pages", "Pages resident in DRAM"),
            dram_bytes_used: gauge(&mut r, "dram_bytes_used", "DRAM pool bytes in use"),
            dram_capacity_bytes: gauge(&mut r, "dram_capacity_bytes", "DRAM pool capacity"),
            bytes_reserved: gauge(&mut r, "bytes_reserved", "Recovery bytes reserved"),
            leases: gauge(&mut r, "leases", "Live leases"),
            operations: gauge(&mut r, "operations", "Live operations"),
            sessions: gauge(&mut r, "sessions", "Open sessions"),
            transfers: gauge(&mut r, "transfers", "Transfers in flight"),
            connections: gauge(&mut r, "connections", "Connected clients"),
            outbox_bytes: gauge(&mut r, "outbox_bytes", "Bytes queued for clients, unread"),
            hot_open_requests: gauge(&mut r, "hot_open_requests", "Hot requests open"),
            handoffs_standing: gauge(
                &mut r,
                "handoffs_standing",
                "P/D handoffs whose pages are promised now",
            ),
            handoff_pinned_pages: gauge(
                &mut r,
                "handoff_pinned_pages",
                "Pages pinned in DRAM for standing P/D handoffs (never evicted or demoted)",
            ),
            handoff_reserved_bytes: gauge(
                &mut r,
                "handoff_reserved_bytes",
                "Bytes standing P/D handoffs reserved from [budget] handoff_bytes",
            ),
        };
        let counters = Counters {
            loop_rounds: counter(
                &mut r,
                "loop_rounds",
                "Rounds of the manager's event loop (wake-ups)",
            ),
            hot_warmed: counter(
                &mut r,
                "hot_warmed",
                "Times the manager was woken through its hot wake eventfd with no request to take: a client warming it ahead of its requests (Session.warm)",
            ),
            answered_between_ticks: counter(
                &mut r,
                "answered_between_ticks",
                "Hot-path lookups answered at once, with nothing queued ahead of them, \
                 without a tick",
            ),
            disconnects: Family::default(),
            lookups: Family::default(),
            protocol_errors: counter(
                &mut r,
                "protocol_errors",
                "Connections closed for a malformed or out-of-order frame",
            ),
            hot_requests: counter(&mut r, "hot_requests", "Hot-path requests received"),
            hot_errors: counter(
                &mut r,
                "hot_errors",
                "Hot-path requests refused as malformed",
            ),
            hot_responses: counter(&mut r, "hot_responses", "Hot-path responses sent"),
            hot_fallbacks: counter(
                &mut r,
                "hot_fallbacks",
                "Answers to hot requests sent on the socket",
            ),
            hot_wakes: counter(
                &mut r,
                "hot_wakes",
                "Wake-ups signalled to hot clients that blocked waiting for a response",
            ),
            presence_misses: counter(
                &mut r,
                "presence_misses",
                "Lookups the engines answered as misses (reason not_found) from the presence \
                 filter, without a round trip; not counted in queries or misses",
            ),
            presence_rebuilds: Family::default(),
            presence_open: Gauge::default(),
            presence_fill_permille: Gauge::default(),
        };
        r.register(
            "presence_rebuilds",
            "Rebuilds of the presence filter from the indexes, by reason: start, full (half its \
             bits set, most by pages since removed), journal_full (page changes were lost)",
            counters.presence_rebuilds.clone(),
        );
        r.register(
            "presence_open",
            "1 while engines may answer certain misses from the presence filter; 0 when it is off \
             ([serve] presence_filter = 0), a tier cannot list its pages (remote), or a tier is \
             unreachable",
            counters.presence_open.clone(),
        );
        r.register(
            "presence_fill_permille",
            "Bits set in the presence filter, in thousandths",
            counters.presence_fill_permille.clone(),
        );
        r.register(
            "disconnects",
            "Connections closed, by reason",
            counters.disconnects.clone(),
        );
        r.register(
            "lookups",
            "Lookups of where a prompt's pages are (orbitkv lookup, POST /lookup), by outcome",
            counters.lookups.clone(),
        );
        let latency =
            Family::<Stage, Histogram>::new_with_constructor(latency_buckets as fn() -> _);
        r.register(
            "latency_seconds",
            "Time from a command's arrival to its answer, by stage (query: query_result; \
             prepare: ready or miss; restore: restore_done; publish: publish_done; tick: a loop \
             round's commands taken and its runtime tick)",
            latency.clone(),
        );
        // The families' histograms share their state with these clones.
        let stage_latency = STAGES.map(|stage| {
            latency
                .get_or_create(&Stage {
                    stage: stage.into(),
                })
                .clone()
        });
        let now = Instant::now();
        let events = crate::events::EventCounters::register(&mut r);
        Metrics {
            events,
            registry: Arc::new(r),
            mirrored,
            gauges,
            tiers,
            counters,
            stage_latency,
            last: None,
            by_command: HashMap::new(),
            by_operation: HashMap::new(),
            order: VecDeque::new(),
            samples: VecDeque::new(),
            started: now,
            total: Window::default(),
            hot_last: Default::default(),
        }
    }

    /// Mirrors the hot server's cumulative counters.
    pub fn hot(&mut self, st: orbitkv_ipc::hot_server::HotStats) {
        let p = std::mem::replace(&mut self.hot_last, st);
        let c = &self.counters;
        c.hot_requests
            .inc_by(st.requests.saturating_sub(p.requests));
        c.hot_errors.inc_by(st.errors.saturating_sub(p.errors));
        c.hot_responses
            .inc_by(st.responses.saturating_sub(p.responses));
        c.hot_fallbacks
            .inc_by(st.fallbacks.saturating_sub(p.fallbacks));
        c.hot_wakes.inc_by(st.wakes.saturating_sub(p.wakes));
    }

    pub fn disconnected(&self, reason: &str) {
        self.counters
            .disconnects
            .get_or_create(&Reason {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn tick_took(&self, d: Duration) {
        self.observe("tick", d);
    }

    fn observe(&self, stage: &str, d: Duration) {
        if let Some(i) = STAGES.iter().position(|s| *s == stage) {
            self.stage_latency[i].observe(d.as_secs_f64());
        }
    }

    /// What clock a command starts, if any (taken before the command moves
    /// into the runtime, so nothing of it is copied).
    pub fn clock_of(command: &Command) -> Option<StartClock> {
        Some(match command {
            // A load's query part: until its result.
            Command::Query { .. } | Command::Load { .. } => StartClock::Command(Timed::Query),
            Command::Publish { .. } => StartClock::Command(Timed::Publish),
            Command::Prepare { operation, .. } => StartClock::Operation(*operation, Timed::Prepare),
            Command::Restore { operation, .. } => StartClock::Operation(*operation, Timed::Restore),
            _ => return None,
        })
    }

    /// A command was queued (in the round whose clock read `now`): start
    /// the clock of what answers it.
    /// A command refused before it was queued (a per-connection, per-uid
    /// or per-process quota, a full inbox): counted with the runtime's
    /// refusals, by command and reason.
    pub fn refused_at_submit(&mut self, command: &str, error: &CommandError) {
        self.mirrored
            .refusals
            .get_or_create(&Refusal {
                command: command.to_owned(),
                reason: error.reason(),
            })
            .inc();
    }

    pub fn submitted(&mut self, cid: CommandId, clock: StartClock, now: Instant) {
        match clock {
            StartClock::Operation(op, t) => {
                if self.by_operation.len() >= MAX_TIMED {
                    self.by_operation.clear();
                }
                self.by_operation.insert((op, t), now);
            }
            StartClock::Command(t) => {
                self.by_command.insert(cid, (t, now));
                self.order.push_back(cid);
                while self.order.len() > MAX_TIMED {
                    if let Some(old) = self.order.pop_front() {
                        self.by_command.remove(&old);
                    }
                }
            }
        }
    }

    /// An event came out of a tick that ended at `now`: stop the clocks it
    /// answers.
    pub fn event(&mut self, e: &Event, now: Instant) {
        match e {
            Event::QueryResult {
                command,
                operation,
                miss,
                ..
            } => {
                if let Some((_, at)) = self.by_command.remove(command) {
                    self.observe(Timed::Query.name(), now - at);
                    if miss.is_none() {
                        self.by_operation.insert((*operation, Timed::Prepare), at);
                    }
                }
            }
            Event::PublishDone { command, .. } | Event::Rejected { command, .. } => {
                if let Some((t, at)) = self.by_command.remove(command)
                    && t == Timed::Publish
                {
                    self.observe(t.name(), now - at);
                }
            }
            Event::Ready {
                operation,
                pages_from_dram,
                pages_from_tiers,
                ..
            } => {
                let leased = &self.tiers.leased_pages;
                for (source, n) in [("dram", pages_from_dram), ("tiers", pages_from_tiers)] {
                    leased
                        .get_or_create(&Source {
                            source: source.into(),
                        })
                        .inc_by(*n);
                }
                if let Some(at) = self.by_operation.remove(&(*operation, Timed::Prepare)) {
                    self.observe(Timed::Prepare.name(), now - at);
                }
            }
            Event::RestoreDone { operation, .. } => {
                if let Some(at) = self.by_operation.remove(&(*operation, Timed::Restore)) {
                    self.observe(Timed::Restore.name(), now - at);
                }
            }
            Event::Miss { operation, .. } | Event::Released { operation } => {
                self.by_operation.remove(&(*operation, Timed::Prepare));
                self.by_operation.remove(&(*operation, Timed::Restore));
            }
            _ => {}
        }
    }

    /// Each tier's bytes used and capacity (`Runtime::tier_occupancy`,
    /// DRAM from the snapshot).
    pub fn occupancy(&self, s: &Stats, lower: &BTreeMap<String, (u64, u64)>) {
        let set = |f: &Family<Tier, Gauge>, tier: &str, v: u64| {
            f.get_or_create(&Tier { tier: tier.into() })
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        let t = &self.tiers;
        set(&t.bytes_used, "dram", s.pool_bytes_used);
        set(&t.capacity_bytes, "dram", s.pool_capacity_bytes);
        for r in &s.load_rates {
            t.load_rate
                .get_or_create(&Source {
                    source: r.source.clone(),
                })
                .set(i64::try_from(r.bytes_per_second).unwrap_or(i64::MAX));
        }
        for (tier, (used, capacity)) in lower {
            set(&t.bytes_used, tier, *used);
            set(&t.capacity_bytes, tier, *capacity);
            // At 0 from the start, as the misses are.
            let _ = t.read_bytes.get_or_create(&Tier { tier: tier.clone() });
        }
    }

    /// Refreshes counters and gauges from the runtime's snapshot.
    pub fn refresh(&mut self, s: &Stats, connections: usize, outbox_bytes: usize, hot_open: usize) {
        let m = &s.metrics;
        let prev = self.last.as_ref().map(|p| &p.metrics);
        let inc = |c: &Counter, now: u64, before: Option<u64>| {
            c.inc_by(now.saturating_sub(before.unwrap_or(0)));
        };
        let x = &self.mirrored;
        inc(&x.queries, m.queries, prev.map(|p| p.queries));
        inc(&x.hits, m.hits, prev.map(|p| p.hits));
        inc(&x.hit_tokens, m.hit_tokens, prev.map(|p| p.hit_tokens));
        inc(
            &x.queried_tokens,
            m.queried_tokens,
            prev.map(|p| p.queried_tokens),
        );
        inc(
            &x.bytes_restored,
            m.bytes_restored,
            prev.map(|p| p.bytes_restored),
        );
        inc(
            &x.bytes_published,
            m.bytes_published,
            prev.map(|p| p.bytes_published),
        );
        inc(&x.bytes_read, m.bytes_read, prev.map(|p| p.bytes_read));
        inc(
            &x.checksum_failures,
            m.checksum_failures,
            prev.map(|p| p.checksum_failures),
        );
        inc(
            &x.publish_checksum_refusals,
            m.publish_checksum_refused,
            prev.map(|p| p.publish_checksum_refused),
        );
        inc(
            &x.kv_events_races,
            m.event_races,
            prev.map(|p| p.event_races),
        );
        inc(
            &x.transfers_overdue,
            m.transfers_overdue,
            prev.map(|p| p.transfers_overdue),
        );
        inc(
            &x.commands_rejected,
            m.commands_rejected,
            prev.map(|p| p.commands_rejected),
        );
        for (k, v) in &m.refusals {
            let before = prev.and_then(|p| p.refusals.get(k).copied());
            let (command, reason) = k.split_once('.').unwrap_or((k.as_str(), ""));
            let labels = Refusal {
                command: command.to_owned(),
                reason: reason.to_owned(),
            };
            inc(&x.refusals.get_or_create(&labels), *v, before);
        }
        for (r, v) in &m.misses {
            let before = prev.and_then(|p| p.misses.get(r).copied());
            inc(
                &x.misses.get_or_create(&Reason {
                    reason: r.as_str().into(),
                }),
                *v,
                before,
            );
        }
        for (r, v) in &m.evictions {
            let before = prev.and_then(|p| p.evictions.get(r).copied());
            inc(
                &x.evictions.get_or_create(&Reason { reason: label(r) }),
                *v,
                before,
            );
        }
        for (k, v) in &m.demotions {
            let before = prev.and_then(|p| p.demotions.get(k).copied());
            inc(
                &x.demotions.get_or_create(&Outcome { outcome: k.clone() }),
                *v,
                before,
            );
        }
        for (tier, v) in &m.bytes_read_by_tier {
            let before = prev.and_then(|p| p.bytes_read_by_tier.get(tier).copied());
            inc(
                &self
                    .tiers
                    .read_bytes
                    .get_or_create(&Tier { tier: tier.clone() }),
                *v,
                before,
            );
        }
        for (k, v) in &m.write_through {
            let before = prev.and_then(|p| p.write_through.get(k).copied());
            inc(
                &x.write_through
                    .get_or_create(&Outcome { outcome: k.clone() }),
                *v,
                before,
            );
        }
        let (h, before) = (
            &s.handoffs.counts,
            self.last.as_ref().map(|p| p.handoffs.counts),
        );
        for (outcome, now, was) in [
            ("held", h.held, before.map(|b| b.held)),
            ("taken", h.taken, before.map(|b| b.taken)),
            ("expired", h.expired, before.map(|b| b.expired)),
        ] {
            inc(
                &x.handoffs.get_or_create(&Outcome {
                    outcome: outcome.into(),
                }),
                now,
                was,
            );
        }
        let g = &self.gauges;
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&g.handoffs_standing, s.handoffs.standing as u64);
        set(&g.handoff_pinned_pages, s.handoffs.pinned_pages);
        set(&g.handoff_reserved_bytes, s.handoffs.reserved_bytes);
        set(&g.pages, s.pages as u64);
        set(&g.dram_bytes_used, s.pool_bytes_used);
        set(&g.dram_capacity_bytes, s.pool_capacity_bytes);
        set(&g.bytes_reserved, s.bytes_reserved);
        set(&g.leases, s.leases as u64);
        set(&g.operations, s.operations as u64);
        set(&g.sessions, s.sessions as u64);
        set(&g.transfers, s.transfers as u64);
        set(&g.connections, connections as u64);
        set(&g.outbox_bytes, outbox_bytes as u64);
        set(&g.hot_open_requests, hot_open as u64);
        self.total = window(s, self.started.elapsed());
        self.last = Some(s.clone());
        let now = Instant::now();
        if self
            .samples
            .back()
            .is_none_or(|(at, _)| now - *at >= Duration::from_secs(1))
        {
            self.samples.push_back((now, self.total.clone()));
            while self
                .samples
                .front()
                .is_some_and(|(at, _)| now - *at > Duration::from_secs(61))
            {
                self.samples.pop_front();
            }
        }
    }

    /// Totals since start and over the last minute.
    pub fn windows(&self) -> (Window, Window) {
        let now = Instant::now();
        let base = self
            .samples
            .iter()
            .find(|(at, _)| now - *at <= Duration::from_secs(60))
            .map(|(at, w)| (now - *at, w.clone()));
        let last = match base {
            Some((age, w)) => diff(&self.total, &w, age),
            None => self.total.clone(),
        };
        (self.total.clone(), last)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(None)
    }
}

fn label<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

fn window(s: &Stats, age: Duration) -> Window {
    let m = &s.metrics;
    let mut w = Window {
        seconds: age.as_secs_f64(),
        queries: m.queries,
        hits: m.hits,
        hit_rate: 0.0,
        hit_tokens: m.hit_tokens,
        queried_tokens: m.queried_tokens,
        bytes_restored: m.bytes_restored,
        bytes_published: m.bytes_published,
        misses: m
            .misses
            .iter()
            .map(|(r, v)| (r.as_str().to_owned(), *v))
            .collect(),
        evictions: m.evictions.iter().map(|(r, v)| (label(r), *v)).collect(),
        refusals: m.refusals.clone(),
        checksum_failures: m.checksum_failures,
    };
    w.hit_rate = rate(w.hits, w.queries);
    w
}

fn rate(hits: u64, queries: u64) -> f64 {
    if queries == 0 {
        0.0
    } else {
        hits as f64 / queries as f64
    }
}

fn diff(now: &Window, then: &Window, age: Duration) -> Window {
    let sub = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
        a.iter()
            .map(|(k, v)| (k.clone(), v.saturating_sub(b.get(k).copied().unwrap_or(0))))
            .filter(|(_, v)| *v > 0)
            .collect()
    };
    let mut w = Window {
        seconds: age.as_secs_f64(),
        queries: now.queries.saturating_sub(then.queries),
        hits: now.hits.saturating_sub(then.hits),
        hit_rate: 0.0,
        hit_tokens: now.hit_tokens.saturating_sub(then.hit_tokens),
        queried_tokens: now.queried_tokens.saturating_sub(then.queried_tokens),
        bytes_restored: now.bytes_restored.saturating_sub(then.bytes_restored),
        bytes_published: now.bytes_published.saturating_sub(then.bytes_published),
        misses: sub(&now.misses, &then.misses),
        evictions: sub(&now.evictions, &then.evictions),
        refusals: sub(&now.refusals, &then.refusals),
        checksum_failures: now.checksum_failures.saturating_sub(then.checksum_failures),
    };
    w.hit_rate = rate(w.hits, w.queries);
    w
}
