//! Simulation fuzzing: random scenarios with every fault kind, replayed with
//! invariants checked every tick and a false-hit oracle; a failing seed is
//! minimized into a trace `orbitkv replay` reproduces.
//!
//! The oracle is independent of the runtime's code paths: it recomputes the
//! pages a boundary requires from the rule definitions with plain
//! arithmetic, knows which keys the scenario made available (their bytes are
//! a function of the key), that a namespace is never shared by two
//! registrations that differ in identity or in what they store (model
//! shape, window, page geometry, rank), that every miss has a reason the
//! scenario's faults (or DRAM churn) can explain, that no operation goes
//! longer than a bound past its deadline without its final reply, and that
//! once the engine goes quiet nothing is left pending or leased except
//! behind a transfer whose completion never came. The replay driver checks
//! every restored byte, and the runtime's invariants (among them that a
//! tick never evicts beyond the pressure) and its demotion totals after
//! every restart.
//!
//! Scenarios draw their copy limits and batch sizes at random, reuse
//! identities across instances of different shapes, and re-register
//! instances with another shape or window after a crash.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use orbitkv_components::api::{MissReason, PagePos};
use orbitkv_components::contract::Rule;
use orbitkv_components::{Namespace, NativeHash, StateKey};
use serde_json::json;

use crate::replay::{Observer, ReadyContext, Replay};
use crate::trace::{
    AgentModel, Body, Fault, Header, Latency, Line, Model, Open, Publish, Register, RemoteModel,
    Request, Then, Ticks, TierPut,
};
use orbitkv_world::OperationInfo;

/// Bounds of one fuzz run.
const MAX_MINIMIZE_REPLAYS: usize = 400;

/// The false-hit, miss-reason and liveness oracle.
#[derive(Default)]
pub struct Oracle {
    available: HashSet<StateKey>,
    /// Namespace → the one stored representation it may name.
    sealed: BTreeMap<Namespace, String>,
    /// Tiers with the remote model (their failures have `remote_*` names).
    remote_tiers: BTreeSet<String>,
    /// Miss reasons the lines run so far can explain.
    explained: BTreeSet<MissReason>,
    /// Instances registered so far (a second registration can retire the
    /// first's namespaces under a running query).
    registered: BTreeSet<String>,
}

/// Reasons any scenario can produce without a fault: what the engine asked
/// (partial publishes, prompt limits), time limits and budgets.
const ALWAYS_EXPLAINED: [MissReason; 5] = [
    MissReason::NotFound,
    MissReason::NoLegalBoundary,
    MissReason::IncompleteGroup,
    MissReason::Budget,
    MissReason::Deadline,
];

impl Oracle {
    /// An oracle for a scenario with this header (which tiers are remote).
    pub fn for_header(header: &Header) -> Oracle {
        let remote_tiers = header
            .latency
            .tiers
            .iter()
            .filter(|t| t.remote.is_some())
            .map(|t| t.name.clone())
            .collect();
        Oracle {
            remote_tiers,
            ..Oracle::default()
        }
    }

    /// The miss reasons a line makes possible from now on.
    fn explains(&self, line: &Line) -> Vec<MissReason> {
        use MissReason as M;
        let remote = |tier: &String| self.remote_tiers.contains(tier);
        match &line.body {
            Body::Fault(f) => match f {
                Fault::TierReadError { tier, .. } if remote(tier) => vec![M::RemoteUnavailable],
                Fault::TierReadError { .. } | Fault::CopyError { .. } => vec![M::IoError],
                // Overdue transfers fail their operations with `io_error`.
                Fault::TierLoseReads { .. } | Fault::CopyLose { .. } => vec![M::IoError],
                Fault::TierDelay { tier, us } if remote(tier) && *us > 0 => {
                    vec![M::RemoteTimeout]
                }
                // A remote read that finds its record gone or bad drops the
                // record's metadata: another operation that discovered the
                // page then finds it in no tier (`evicted_during_read`).
                Fault::CorruptPage { tier, .. } if remote(tier) => {
                    vec![M::RemoteCorrupt, M::EvictedDuringRead]
                }
                Fault::CorruptPage { .. } => vec![M::Checksum],
                Fault::DropPage { tier, .. } if remote(tier) => {
                    vec![M::RemoteMissing, M::EvictedDuringRead]
                }
                Fault::DropPage { .. } => vec![M::EvictedDuringRead],
                Fault::RemoteDown { .. } => vec![M::RemoteUnavailable],
                Fault::RemoteFlush { .. } => vec![M::RemoteMissing, M::EvictedDuringRead],
                Fault::RemoteRewrite { .. } | Fault::RemoteTruncate { .. } => {
                    vec![M::RemoteCorrupt, M::EvictedDuringRead]
                }
                Fault::SessionCrash { .. } => vec![M::Cancelled],
                Fault::ManagerRestart => vec![M::Namespace],
                _ => Vec::new(),
            },
            Body::Request(r) => {
                let mut v = Vec::new();
                if r.cancel_after_us.is_some() {
                    v.push(M::Cancelled);
                }
                if r.free_targets_after_us.is_some() {
                    v.push(M::StaleGeneration);
                }
                v
            }
            // An agent that fails copies (`io_error`) or vanishes (its
            // engine's connection ends: `cancelled`, and its copies fail).
            Body::Open(o) => match o.agent {
                Some(a) if a.vanish_per_mille > 0 => vec![M::IoError, M::Cancelled],
                Some(a) if a.fail_per_mille > 0 => vec![M::IoError],
                _ => Vec::new(),
            },
            Body::Register(r) if self.registered.contains(&r.instance) => vec![M::Namespace],
            _ => Vec::new(),
        }
    }
}

/// What rank `rank` of a registration stores, in words: two registrations
/// may share that rank's namespace only if these are equal.
pub fn stored_representation(r: &Register, rank: u32) -> String {
    let window = match r.model {
        Model::Swa | Model::HybridSwa => format!(" window {}", r.window.max(1)),
        Model::Dense | Model::Hybrid => String::new(),
    };
    format!(
        "identity {:?}, {:?}{window}, {} tokens x {} bytes, rank {rank}",
        r.identity, r.model, r.page_tokens, r.page_bytes
    )
}

impl Observer for Oracle {
    fn available(&mut self, key: StateKey) {
        self.available.insert(key);
    }

    fn line(&mut self, line: &Line) {
        let explained = self.explains(line);
        self.explained.extend(explained);
        if let Body::Register(r) = &line.body {
            self.registered.insert(r.instance.clone());
        }
    }

    /// Each miss's reason is one the scenario so far can explain: always
    /// for limits and what the engine asked; `evicted_during_read` once
    /// DRAM evicted or a tier lost (or dropped a bad) page; every other
    /// reason only after a fault that causes it (a remote outage is never
    /// churn).
    fn miss(&mut self, reason: MissReason, evictions: u64) -> Result<(), String> {
        let churn = reason == MissReason::EvictedDuringRead && evictions > 0;
        if ALWAYS_EXPLAINED.contains(&reason) || churn || self.explained.contains(&reason) {
            return Ok(());
        }
        Err(format!(
            "a miss with reason {reason}, which nothing in the scenario so far explains \
             (explained: {:?}; {evictions} eviction(s))",
            self.explained
        ))
    }

    fn watches_operations(&self) -> bool {
        true
    }

    /// A deadline is a deadline: by `bound_us` past it (the longest a
    /// transfer stays in flight before it is overdue), an operation has
    /// sent its final reply, whatever it still holds.
    fn operations(
        &mut self,
        now_us: u64,
        bound_us: u64,
        live: &[OperationInfo],
    ) -> Result<(), String> {
        let late = live
            .iter()
            .find(|o| !o.reported && now_us >= o.deadline_us.saturating_add(bound_us));
        match late {
            Some(o) => Err(format!(
                "operation {:#x} is still {} at {now_us} µs without its reply, past its \
                 deadline ({} µs) by more than {bound_us} µs",
                o.operation, o.state, o.deadline_us
            )),
            None => Ok(()),
        }
    }

    fn registered(&mut self, r: &Register, namespaces: &[Namespace]) -> Result<(), String> {
        for (rank, ns) in namespaces.iter().enumerate() {
            let what = stored_representation(r, rank as u32);
            match self.sealed.get(ns) {
                Some(other) if *other != what => {
                    return Err(format!("{other} and {what} share a namespace"));
                }
                Some(_) => {}
                None => {
                    self.sealed.insert(*ns, what);
                }
            }
        }
        Ok(())
    }

    /// Liveness: once quiet, every operation left has replied and is held
    /// only by transfers whose completion never came (they keep what they
    /// own, by design); anything else pending, or leasing pages, is stuck.
    fn quiet(&mut self, now_us: u64, live: &[OperationInfo]) -> Result<(), String> {
        let stuck = live.iter().find(|o| {
            !o.reported || o.in_flight == 0 || o.overdue_transfers < o.in_flight as usize
        });
        match stuck {
            Some(o) => Err(format!(
                "operation {:#x} is still {} at {now_us} µs (deadline {} µs, replied: {}) with \
                 {} lease(s), {} byte(s) reserved and {} of {} transfer(s) overdue",
                o.operation,
                o.state,
                o.deadline_us,
                o.reported,
                o.leases,
                o.bytes_reserved,
                o.overdue_transfers,
                o.in_flight
            )),
            None => Ok(()),
        }
    }

    fn ready(&mut self, c: &ReadyContext<'_>) -> Result<(), String> {
        let page = c.page_tokens;
        let b = c.boundary;
        let hashed = c.hashes.len() as u64 * page;
        if !b.is_multiple_of(page) || b <= c.origin || b > hashed || b + 1 > c.prompt_len {
            return Err(format!(
                "boundary {b} is not allowed (origin {}, {hashed} hashed tokens, prompt_len {})",
                c.origin, c.prompt_len
            ));
        }
        // The exact pages each rule requires at b, from the rules alone.
        let mut want: BTreeSet<PagePos> = BTreeSet::new();
        for rank in 0..c.namespaces.len() as u32 {
            for g in c.groups {
                let from = match g.rule {
                    Rule::Prefix => c.origin,
                    Rule::Window { past_tokens } => {
                        let pages = past_tokens.div_ceil(page);
                        b.saturating_sub(pages * page).max(c.origin)
                    }
                    Rule::Checkpoint => b - page,
                };
                let mut end = from + page;
                while end <= b {
                    want.insert(PagePos {
                        rank,
                        group: g.id,
                        page_end: end,
                    });
                    end += page;
                }
            }
        }
        let got: BTreeSet<PagePos> = c.leased.iter().copied().collect();
        if got != want || got.len() != c.leased.len() {
            let extra: Vec<_> = got.difference(&want).take(3).collect();
            let missing: Vec<_> = want.difference(&got).take(3).collect();
            return Err(format!(
                "boundary {b}: leased pages differ from the contract (extra {extra:?}, missing {missing:?})"
            ));
        }
        for p in c.leased {
            let native = NativeHash::from_u64(c.hashes[(p.page_end / page - 1) as usize]);
            let key = StateKey {
                namespace: c.namespaces[p.rank as usize],
                group: p.group,
                native,
            };
            if !self.available.contains(&key) {
                return Err(format!("leased {key:?}, which the scenario never produced"));
            }
        }
        Ok(())
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: small, fast, and the same everywhere.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

struct Inst {
    name: String,
    model: Model,
    ranks: u32,
    /// Shared across instances at random: one weights digest, several
    /// shapes.
    identity: u32,
    window: u64,
    session: u32,
}

const MODELS: [Model; 4] = [Model::Dense, Model::Swa, Model::Hybrid, Model::HybridSwa];

impl Inst {
    fn register(&self) -> Body {
        Body::Register(Register {
            instance: self.name.clone(),
            identity: format!("weights-v{}", self.identity),
            model: self.model,
            ranks: self.ranks,
            page_tokens: 16,
            page_bytes: 4096,
            window: self.window,
        })
    }

    /// After its engine crashed: the same instance may come back with new
    /// weights, another shape of the same weights, or another window.
    fn change(&mut self, rng: &mut Rng) {
        match rng.below(4) {
            0 => self.identity += 10,
            1 => self.model = *rng.pick(&MODELS),
            2 => self.window = random_window(rng),
            _ => {}
        }
    }
}

fn random_window(rng: &mut Rng) -> u64 {
    8 + rng.below(40)
}

/// Copy limits: often tight (one page per batch, one batch in flight, an
/// engine queue shorter than our bound), sometimes the defaults.
fn copy_limits(rng: &mut Rng) -> (u64, u64, u64) {
    let batch = *rng.pick(&[1, 2, 3, 8, 1024]);
    let inflight = *rng.pick(&[1, 2, 4, 64]);
    let engine = *rng.pick(&[1, 2, 64]);
    (batch, inflight, engine)
}

fn session_name(i: &Inst) -> String {
    format!("${}-s{}", i.name, i.session)
}

/// Opens a session of `i`; with `agents`, often with a simulated copy
/// agent that is sometimes late, sometimes fails a copy and sometimes
/// vanishes (drawn from its own stream: the rest of the scenario is the
/// same either way).
fn open_line(i: &Inst, agents: Option<&mut Rng>) -> Body {
    let agent = agents.and_then(|rng| {
        rng.chance(600).then(|| AgentModel {
            copy_us: rng.below(60),
            late_per_mille: *rng.pick(&[0, 50, 300]),
            late_us: rng.below(3000),
            fail_per_mille: *rng.pick(&[0, 20, 100]),
            vanish_per_mille: *rng.pick(&[0, 0, 0, 2, 8]),
            seed: rng.next(),
        })
    });
    Body::Open(Open {
        instance: i.name.clone(),
        name: session_name(i),
        region_slots: 96,
        agent,
    })
}

/// A random scenario of about `ticks` manager ticks.
pub fn generate(seed: u64, ticks: u64) -> (Header, Vec<Line>) {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    // The remote tier's model and faults draw from their own stream, so
    // the rest of a seed's scenario is the same with or without them.
    let mut remote_rng = Rng(seed.wrapping_mul(0xd6e8_feb8_6659_fd93) | 1);
    for _ in 0..4 {
        remote_rng.next(); // nearby seeds start out alike
    }
    let remote = remote_rng.chance(600).then(|| RemoteModel {
        // Mostly above the model's 800 µs reads; delays push them past it.
        read_timeout_us: 900 + remote_rng.below(2000),
        write_through: remote_rng.chance(500),
    });
    // Copy agents draw from a third stream, for the same reason.
    let mut agent_rng = Rng(seed.wrapping_mul(0x8ebc_6af0_9c88_c6e3) | 1);
    for _ in 0..4 {
        agent_rng.next();
    }
    let mut agents = agent_rng.chance(300).then_some(agent_rng);
    // In-place demotion (the SSD tier's direct-I/O path) from a fourth.
    let mut in_place_rng = Rng(seed.wrapping_mul(0xa076_1d64_78bd_642f) | 1);
    for _ in 0..4 {
        in_place_rng.next();
    }
    let in_place = in_place_rng
        .chance(500)
        .then(|| 1 + in_place_rng.below(400));
    let mut latency = Latency::default();
    if let Some(t) = latency.tiers.iter_mut().find(|t| t.name == "remote") {
        t.remote = remote;
    }
    if let Some(t) = latency.tiers.iter_mut().find(|t| t.demote) {
        t.write_in_place_us = in_place;
    }
    let interval = 10;
    let (batch, inflight, engine) = copy_limits(&mut rng);
    let header = Header {
        orbitkv_trace: crate::trace::TRACE_VERSION,
        name: format!("fuzz-{seed}"),
        description: "generated by orbitkv fuzz".into(),
        config: Some(json!({
            "dram": {
                "capacity_bytes": (48 + rng.below(64)) * 4096,
                "extent_bytes": 32768,
                // Agents read the pool through its descriptor.
                "shared": agents.is_some()
            },
            "budget": {"query_budget_bytes": (24 + rng.below(24)) * 4096},
            "limits": {
                "prepare_deadline_us": 500 + rng.below(4000),
                "publish_deadline_us": 500 + rng.below(4000),
                "restore_deadline_us": 500 + rng.below(4000),
                "transfer_timeout_us": 3000,
                "max_reads_per_group": 1 + rng.below(8),
                "max_copy_batch_pages": batch,
                "max_inflight_copies": inflight,
                "agent_copy_deadline_us": 2000,
                "max_staging_bytes": 1 << 20
            },
            "copy": {"max_in_flight_batches": engine}
        })),
        latency,
        ticks: Ticks::Interval,
        tick_interval_us: interval,
        drain_us: 200_000,
    };
    let mut lines = Vec::new();
    let mut t = 0;
    let push = |lines: &mut Vec<Line>, t: u64, body: Body| {
        lines.push(Line {
            number: lines.len() + 2,
            t,
            body,
        });
    };
    let mut insts: Vec<Inst> = (0..1 + rng.below(3))
        .map(|i| Inst {
            name: format!("m{i}"),
            model: *rng.pick(&MODELS),
            ranks: 1 + rng.below(2) as u32,
            // Often the same weights as another instance.
            identity: rng.below(2) as u32,
            window: random_window(&mut rng),
            session: 0,
        })
        .collect();
    for i in &insts {
        push(&mut lines, t, i.register());
        push(&mut lines, t, open_line(i, agents.as_mut()));
    }
    let segments = [
        "system:3", "system:2", "doc-a:2", "doc-b:3", "doc-c:1", "tools:1",
    ];
    let mut request = 0u64;
    let end = ticks * interval;
    while t < end {
        t += rng.below(120);
        let i = rng.below(insts.len() as u64) as usize;
        let session = session_name(&insts[i]);
        let mut prompt: Vec<String> = vec![rng.pick(&segments).to_string()];
        for _ in 0..rng.below(3) {
            prompt.push(rng.pick(&segments[2..]).to_string());
        }
        if rng.chance(500) {
            prompt.push(format!("user-{}:{}", rng.below(6), 1 + rng.below(3)));
        }
        request += 1;
        let roll = rng.below(1000);
        let body = match roll {
            0..=299 => Body::Request(Request {
                session,
                request,
                prompt,
                origin: if rng.chance(200) { 16 } else { 0 },
                prompt_len: rng.chance(150).then(|| 16 * (1 + rng.below(8))),
                then: *rng.pick(&[
                    Then::Restore,
                    Then::Restore,
                    Then::Load,
                    Then::Load,
                    Then::Release,
                    Then::Nothing,
                ]),
                cancel_after_us: rng.chance(100).then(|| rng.below(200)),
                speculative: rng.chance(50),
                name: None,
                free_targets_after_us: rng.chance(80).then(|| rng.below(40)),
            }),
            300..=549 => Body::Publish(Publish {
                session,
                request,
                prompt,
                ranks: rng.chance(150).then(|| vec![0]),
                groups: None,
                from_page: 0,
                to_page: rng.chance(200).then(|| 1 + rng.below(4)),
                checkpoint_every: rng.chance(500).then(|| 1 + rng.below(3)),
            }),
            550..=649 => Body::TierPut(TierPut {
                tier: rng.pick(&["ssd", "remote"]).to_string(),
                instance: insts[i].name.clone(),
                prompt,
                ranks: None,
                groups: None,
                from_page: 0,
                to_page: None,
            }),
            650..=999 => {
                let tier = rng.pick(&["ssd", "remote"]).to_string();
                let instance = insts[i].name.clone();
                let pages = crate::trace::chained_hashes(&prompt).map_or(1, |h| h.len() as u64);
                let page = rng.below(pages);
                let fault = match rng.below(13) {
                    0 => Fault::TierReadError {
                        tier,
                        count: 1 + rng.below(2) as usize,
                    },
                    1 => Fault::TierLoseReads { tier, count: 1 },
                    2 => Fault::TierDelay {
                        tier,
                        us: rng.below(500),
                    },
                    3 => Fault::CorruptPage {
                        tier,
                        instance,
                        prompt,
                        page,
                        rank: 0,
                        group: 0,
                    },
                    4 => Fault::DropPage {
                        tier,
                        instance,
                        prompt,
                        page,
                        rank: 0,
                        group: 0,
                    },
                    5 => Fault::CopyError { count: 1 },
                    6 => Fault::CopyLose { count: 1 },
                    7 => Fault::CopyDelay { us: rng.below(300) },
                    8 => Fault::CopyReorder {
                        max_us: rng.below(200),
                        seed: rng.next(),
                    },
                    9 | 10 => {
                        // The engine process dies and restarts; sometimes with
                        // new weights, which must never hit the old cache.
                        push(
                            &mut lines,
                            t,
                            Body::Fault(Fault::SessionCrash {
                                session: session.clone(),
                            }),
                        );
                        t += 50;
                        let inst = &mut insts[i];
                        inst.session += 1;
                        if rng.chance(500) {
                            inst.change(&mut rng);
                            push(&mut lines, t, inst.register());
                        }
                        push(&mut lines, t, open_line(inst, agents.as_mut()));
                        continue;
                    }
                    11 if rng.chance(300) => {
                        push(&mut lines, t, Body::Fault(Fault::ManagerRestart));
                        for inst in insts.iter_mut() {
                            inst.session += 1;
                            push(&mut lines, t, inst.register());
                            push(&mut lines, t, open_line(inst, agents.as_mut()));
                        }
                        continue;
                    }
                    _ if remote.is_some() => {
                        // A page only the remote tier holds (another
                        // host's), a fault on it, then a request for it:
                        // so remote faults are reached, not only injected.
                        request += 1;
                        let own = vec![
                            prompt[0].clone(),
                            format!("remote-{request}:{}", 1 + remote_rng.below(3)),
                        ];
                        let put = Body::TierPut(TierPut {
                            tier: "remote".into(),
                            instance: instance.clone(),
                            prompt: own.clone(),
                            ranks: None,
                            groups: None,
                            from_page: 0,
                            to_page: None,
                        });
                        push(&mut lines, t, put);
                        let last =
                            crate::trace::chained_hashes(&own).map_or(1, |h| h.len() as u64) - 1;
                        let tier = "remote".to_string();
                        let (before, after) = match remote_rng.below(6) {
                            0 => (
                                None,
                                Some(Fault::RemoteDown {
                                    tier,
                                    us: 200 + remote_rng.below(3000),
                                }),
                            ),
                            1 if remote_rng.chance(300) => {
                                (Some(Fault::RemoteFlush { tier }), None)
                            }
                            1 | 2 => (
                                Some(Fault::RemoteRewrite {
                                    tier,
                                    instance,
                                    prompt: own.clone(),
                                    page: last,
                                    rank: 0,
                                    group: 0,
                                }),
                                None,
                            ),
                            3 => (
                                Some(Fault::RemoteTruncate {
                                    tier,
                                    instance,
                                    prompt: own.clone(),
                                    page: last,
                                    rank: 0,
                                    group: 0,
                                }),
                                None,
                            ),
                            // Slower than the read deadline for a while.
                            4 => (
                                Some(Fault::TierDelay {
                                    tier: tier.clone(),
                                    us: 1500 + remote_rng.below(3000),
                                }),
                                Some(Fault::TierDelay { tier, us: 0 }),
                            ),
                            // Gone from the store, still in the metadata.
                            _ => (
                                Some(Fault::DropPage {
                                    tier,
                                    instance,
                                    prompt: own.clone(),
                                    page: last,
                                    rank: 0,
                                    group: 0,
                                }),
                                None,
                            ),
                        };
                        if let Some(f) = before {
                            push(&mut lines, t, Body::Fault(f));
                        }
                        let ask = Body::Request(Request {
                            session,
                            request,
                            prompt: own,
                            origin: 0,
                            prompt_len: None,
                            then: Then::Restore,
                            cancel_after_us: None,
                            speculative: false,
                            name: None,
                            free_targets_after_us: None,
                        });
                        t += 1;
                        push(&mut lines, t, ask);
                        if let Some(f) = after {
                            // Lands while the reads are in flight.
                            t += 1 + remote_rng.below(600);
                            push(&mut lines, t, Body::Fault(f));
                        }
                        continue;
                    }
                    _ => Fault::CopyDelay { us: 0 },
                };
                Body::Fault(fault)
            }
            _ => unreachable!("roll is below 1000"),
        };
        push(&mut lines, t, body);
    }
    (header, lines)
}

/// How one replay ended, for the fuzzer.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Clean { ticks: u64 },
    Failed { why: String, ticks: u64 },
}

/// Replays lines with the oracle; panics (the runtime's or the replay
/// driver's own) count as failures.
pub fn check(header: &Header, lines: &[Line]) -> Verdict {
    check_with(header, lines, &|| Box::new(Oracle::for_header(header)))
}

/// `check` with another observer (made afresh for every replay).
pub fn check_with(
    header: &Header,
    lines: &[Line],
    observer: &dyn Fn() -> Box<dyn Observer>,
) -> Verdict {
    let trace = crate::trace::Trace {
        header: header.clone(),
        lines: lines.to_vec(),
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let replay = Replay::with_observer(header, observer())?;
        replay.run(&trace, &mut |_, _| {})
    }));
    match outcome {
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Verdict::Failed {
                why: format!("panic: {why}"),
                ticks: 0,
            }
        }
        Ok(Err(e)) => Verdict::Failed {
            why: format!("replay error: {e}"),
            ticks: 0,
        },
        Ok(Ok((report, _))) => {
            if report.invariant_violations > 0 || report.byte_mismatches > 0 {
                let first = report.violations.first().cloned().unwrap_or_default();
                Verdict::Failed {
                    why: format!(
                        "{} invariant violation(s), {} byte mismatch(es); first: {first}",
                        report.invariant_violations, report.byte_mismatches
                    ),
                    ticks: report.ticks,
                }
            } else {
                Verdict::Clean {
                    ticks: report.ticks,
                }
            }
        }
    }
}

/// Removes lines while `fails` still holds (delta debugging, bounded).
pub fn minimize(lines: Vec<Line>, fails: &mut dyn FnMut(&[Line]) -> bool) -> Vec<Line> {
    let mut current = lines;
    let mut chunk = current.len().div_ceil(2).max(1);
    let mut replays = 0;
    while chunk >= 1 && replays < MAX_MINIMIZE_REPLAYS {
        let mut start = 0;
        let mut removed = false;
        while start < current.len() && replays < MAX_MINIMIZE_REPLAYS {
            let candidate: Vec<Line> = current[..start]
                .iter()
                .chain(&current[(start + chunk).min(current.len())..])
                .cloned()
                .collect();
            replays += 1;
            if !candidate.is_empty() && fails(&candidate) {
                current = candidate;
                removed = true;
            } else {
                start += chunk;
            }
        }
        if !removed {
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
    }
    renumber(&mut current);
    current
}

fn renumber(lines: &mut [Line]) {
    for (i, l) in lines.iter_mut().enumerate() {
        l.number = i + 2;
    }
}

/// The class of a failure, for minimization: the first violation's text
/// without its time and handle values (numbers, and `0x` handles).
fn failure_kind(why: &str) -> String {
    let first = why.split("first: ").nth(1).unwrap_or(why);
    let first = first.split_once(": ").map_or(first, |(_, rest)| rest);
    first
        .split(' ')
        .filter(|word| !word.starts_with("0x"))
        .flat_map(|word| word.chars().filter(|c| !c.is_ascii_digit()).chain([' ']))
        .collect()
}

/// One seed's result.
pub struct SeedResult {
    pub seed: u64,
    pub verdict: Verdict,
    /// The minimized failing trace, when the seed failed.
    pub minimized: Option<String>,
}

pub fn run_seed(seed: u64, ticks: u64) -> SeedResult {
    let (header, lines) = generate(seed, ticks);
    let mut result = run_case(&header, lines, &|| Box::new(Oracle::for_header(&header)));
    result.seed = seed;
    result
}

/// Checks one scenario and, when it fails (a panic included), minimizes it
/// to a trace that fails the same way.
pub fn run_case(
    header: &Header,
    lines: Vec<Line>,
    observer: &dyn Fn() -> Box<dyn Observer>,
) -> SeedResult {
    let verdict = check_with(header, &lines, observer);
    let minimized = match &verdict {
        Verdict::Clean { .. } => None,
        Verdict::Failed { why, .. } => {
            // Keep the same failure: a candidate that breaks differently (say,
            // by losing the line that registered an instance) is not smaller
            // evidence of this bug.
            let kind = failure_kind(why);
            let small = minimize(lines, &mut |candidate| match check_with(
                header, candidate, observer,
            ) {
                Verdict::Failed { why, .. } => failure_kind(&why) == kind,
                Verdict::Clean { .. } => false,
            });
            Some(crate::trace::render(header, &small))
        }
    };
    SeedResult {
        seed: 0,
        verdict,
        minimized,
    }
}

/// For tests: the body kinds a generated scenario contains.
pub fn kinds(lines: &[Line]) -> BTreeSet<String> {
    lines
        .iter()
        .map(|l| match &l.body {
            Body::Fault(f) => format!(
                "fault:{}",
                serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v["kind"].as_str().map(String::from))
                    .unwrap_or_default()
            ),
            Body::Cmd { .. } => "cmd".into(),
            Body::Tick => "tick".into(),
            Body::TierPut(_) => "tier_put".into(),
            Body::Register(_) => "register".into(),
            Body::Open(_) => "open".into(),
            Body::Publish(_) => "publish".into(),
            Body::Request(_) => "request".into(),
        })
        .collect()
}
