//! Shared setup for the runtime benchmarks: instance registration with a
//! chosen page size, deterministic hashes, a small command/event driver for
//! the simulated and wall-clock runtimes, and interleaved own timing.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use orbitkv_components::api::{
    Command, CommandId, Event, Origin, PublishPage, Rank, SessionHandle,
};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::{Namespace, NativeHash, StorageLayout, StorageSlot};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_world::{Backends, Config, Runtime};

pub const IDENTITY: [u8; 32] = [0x5a; 32];

/// A bench config: no first touch, no invariant checks, the given pool.
pub fn config(capacity_bytes: u64, slot_align_bytes: u64, extent_bytes: u64) -> Config {
    let mut c = Config::default();
    c.dram.capacity_bytes = capacity_bytes;
    c.dram.slot_align_bytes = slot_align_bytes;
    c.dram.extent_bytes = extent_bytes;
    c.dram.first_touch = false;
    c.check_invariants = false;
    c
}

pub fn dense() -> Vec<GroupSpec> {
    vec![GroupSpec {
        id: 0,
        rule: Rule::Prefix,
        components: vec![ComponentKind::AttentionKv],
    }]
}

/// Full attention + sliding window (100 past tokens) + recurrent checkpoint.
pub fn hybrid() -> Vec<GroupSpec> {
    vec![
        GroupSpec {
            id: 0,
            rule: Rule::Prefix,
            components: vec![ComponentKind::AttentionKv],
        },
        GroupSpec {
            id: 1,
            rule: Rule::Window { past_tokens: 100 },
            components: vec![ComponentKind::SlidingWindowKv],
        },
        GroupSpec {
            id: 2,
            rule: Rule::Checkpoint,
            components: vec![
                ComponentKind::RecurrentCheckpoint,
                ComponentKind::ConvolutionState,
            ],
        },
    ]
}

/// One layer per group per rank, each `page_bytes` per page, so a group's
/// page is exactly `page_bytes`.
pub fn register_cmd(
    name: &str,
    groups: Vec<GroupSpec>,
    ranks: u32,
    page_tokens: u64,
    page_bytes: u64,
) -> Command {
    let mut slots = Vec::new();
    for tp in 0..ranks {
        for (layer, g) in groups.iter().enumerate() {
            slots.push(StorageSlot {
                layer: layer as u32,
                group: g.id,
                tp_rank: tp,
                pp_rank: 0,
                segment_bytes: page_bytes,
                padded_page_bytes: page_bytes,
                page_tokens: page_tokens as u32,
                dtype: "bfloat16".into(),
                layout: "NHD".into(),
                strides: vec![64, 1],
                device_addr: 0,
            });
        }
    }
    Command::RegisterInstance {
        instance: name.into(),
        identity: IDENTITY,
        layout: StorageLayout {
            slots,
            pool_capacity_pages: 0,
        },
        page_tokens,
        groups,
        ranks: (0..ranks).map(|tp| Rank { tp, pp: 0 }).collect(),
    }
}

/// The engine's chained hash of page `i` of prompt `seed` in `group`.
pub fn hash(seed: u64, group: u32, i: u64) -> NativeHash {
    NativeHash::from_u64(seed.wrapping_mul(1_000_003) ^ ((group as u64) << 48) ^ i)
}

/// Deterministic page bytes.
pub fn payload(seed: u64, slot: u64, len: u64) -> Vec<u8> {
    let mut state = (seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(slot | 1) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Drives a runtime: submits commands, ticks, and finds events. With a
/// simulated clock, waiting advances time; with a wall clock, it yields.
pub struct Driver {
    pub rt: Runtime,
    pub arena: DeviceArena,
    pub simulated: bool,
    /// Ticks run so far.
    pub ticks: u64,
    /// Events not yet consumed by `wait`.
    pending: Vec<Event>,
}

impl Driver {
    /// A simulated-clock runtime with the deterministic copy engine
    /// (`latency_us` per batch, infinitely fast) and no lower tiers.
    pub fn sim(config: Config, latency_us: u64) -> Self {
        let copy = SimCopyEngine::new(SimCopyConfig {
            latency_us,
            bytes_per_us: 0,
            max_in_flight_batches: 64,
        });
        let arena = copy.arena();
        let rt = Runtime::with_backends(
            config,
            Backends {
                copy: Box::new(copy),
                tiers: Vec::new(),
                simulated_clock: true,
            },
        )
        .expect("runtime");
        Driver {
            rt,
            arena,
            simulated: true,
            ticks: 0,
            pending: Vec::new(),
        }
    }

    pub fn new(rt: Runtime, arena: DeviceArena, simulated: bool) -> Self {
        Driver {
            rt,
            arena,
            simulated,
            ticks: 0,
            pending: Vec::new(),
        }
    }

    pub fn submit(&mut self, c: Command) -> CommandId {
        self.rt.submit(Origin::EMBEDDED, c).expect("inbox has room")
    }

    /// Ticks once and keeps the events for `wait`.
    pub fn tick(&mut self) -> &[Event] {
        let start = self.pending.len();
        self.ticks += 1;
        let ev = self.rt.tick();
        self.pending.extend(ev.into_iter().map(|a| a.event));
        &self.pending[start..]
    }

    /// Removes and returns the first pending event matching `pred`, ticking
    /// (and advancing simulated time, or yielding) until one arrives.
    pub fn wait(&mut self, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        for round in 0..10_000_000u64 {
            if let Some(i) = self.pending.iter().position(&pred) {
                return self.pending.remove(i);
            }
            if let Some(e) = self
                .pending
                .iter()
                .find(|e| matches!(e, Event::Rejected { .. }))
            {
                panic!("waiting for {what}: {e:?}");
            }
            if self.simulated {
                assert!(round < 100_000, "no event for {what} after 100000 ticks");
                self.submit(Command::AdvanceClock { us: 1 });
            } else {
                std::thread::yield_now();
            }
            self.ticks += 1;
            let ev = self.rt.tick();
            self.pending.extend(ev.into_iter().map(|a| a.event));
        }
        panic!(
            "no event for {what}; pending: {:?}",
            self.pending.iter().rev().take(5).collect::<Vec<_>>()
        );
    }

    /// Drops events nobody waits for; panics on a rejection among them.
    pub fn clear(&mut self) {
        if let Some(e) = self
            .pending
            .iter()
            .find(|e| matches!(e, Event::Rejected { .. }))
        {
            panic!("a command was rejected: {e:?}");
        }
        self.pending.clear();
    }

    /// Submits `c`, ticks, and returns the event answering it.
    pub fn one(&mut self, c: Command) -> Event {
        let id = self.submit(c);
        self.tick();
        self.wait("reply", |e| command_of(e) == Some(id))
    }

    pub fn register(&mut self, c: Command) -> Vec<Namespace> {
        match self.one(c) {
            Event::InstanceRegistered { namespaces, .. } => namespaces,
            e => panic!("register: {e:?}"),
        }
    }

    pub fn open(&mut self, name: &str) -> SessionHandle {
        match self.one(Command::OpenSession {
            instance: name.into(),
        }) {
            Event::SessionOpened { session, .. } => session,
            e => panic!("open: {e:?}"),
        }
    }

    /// (region handle, engine region id, page bytes).
    pub fn region(
        &mut self,
        session: SessionHandle,
        rank: u32,
        group: u32,
        slots: u32,
    ) -> (u64, u32, u64) {
        match self.one(Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
        }) {
            Event::RegionRegistered {
                region,
                engine_region,
                page_bytes,
                ..
            } => (region, engine_region, page_bytes),
            e => panic!("region: {e:?}"),
        }
    }

    /// Allocates device pages for `slots` of `region` in one tick.
    pub fn alloc_many(
        &mut self,
        session: SessionHandle,
        region: u64,
        slots: impl IntoIterator<Item = u32>,
    ) -> Vec<u64> {
        let ids: Vec<CommandId> = slots
            .into_iter()
            .map(|slot| {
                self.submit(Command::DevicePageAlloc {
                    session,
                    region,
                    slot,
                })
            })
            .collect();
        self.tick();
        let mut by_id: HashMap<CommandId, u64> = HashMap::with_capacity(ids.len());
        let mut rest = Vec::new();
        for e in self.pending.drain(..) {
            match e {
                Event::DevicePageAllocated {
                    command,
                    device_page,
                } => {
                    by_id.insert(command, device_page);
                }
                Event::Rejected { .. } => panic!("alloc: {e:?}"),
                e => rest.push(e),
            }
        }
        self.pending = rest;
        ids.iter()
            .map(|id| *by_id.get(id).expect("every alloc answered in its tick"))
            .collect()
    }

    /// Publishes and waits for `PublishDone`; returns `inserted`.
    pub fn publish(
        &mut self,
        session: SessionHandle,
        request: u64,
        pages: Vec<PublishPage>,
    ) -> u64 {
        let id = self.submit(Command::Publish {
            session,
            request,
            pages,
        });
        self.tick();
        match self.wait("publish", |e| {
            matches!(e, Event::PublishDone { command, .. } if *command == id)
                || matches!(e, Event::Rejected { command, .. } if *command == id)
        }) {
            Event::PublishDone {
                inserted,
                duplicates: 0,
                dropped: 0,
                ..
            } => inserted,
            e => panic!("publish: {e:?}"),
        }
    }
}

pub fn command_of(e: &Event) -> Option<CommandId> {
    match e {
        Event::Rejected { command, .. }
        | Event::InstanceRegistered { command, .. }
        | Event::SessionOpened { command, .. }
        | Event::RegionRegistered { command, .. }
        | Event::DevicePageAllocated { command, .. }
        | Event::QueryResult { command, .. }
        | Event::PublishDone { command, .. } => Some(*command),
        _ => None,
    }
}

/// Interleaved own timing of two sides. Each side is `f(n)`: run `n`
/// iterations and return the time that counts. Iteration counts are
/// calibrated once so a side takes about `per_side`; then `rounds` rounds
/// time `a` then `b`. Returns (median ns per iteration of a, of b, n_a, n_b).
pub fn interleaved(
    rounds: usize,
    per_side: Duration,
    mut a: impl FnMut(u64) -> Duration,
    mut b: impl FnMut(u64) -> Duration,
) -> (f64, f64, u64, u64) {
    fn calibrate(f: &mut dyn FnMut(u64) -> Duration, per_side: Duration) -> u64 {
        let mut n = 1u64;
        loop {
            let t = f(n);
            if t >= per_side / 8 || n >= 1 << 30 {
                let per = t.as_secs_f64() / n as f64;
                return ((per_side.as_secs_f64() / per.max(1e-12)) as u64).clamp(1, 1 << 32);
            }
            n *= 2;
        }
    }
    let na = calibrate(&mut a, per_side);
    let nb = calibrate(&mut b, per_side);
    let mut ta = Vec::with_capacity(rounds);
    let mut tb = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        ta.push(a(na).as_nanos() as f64 / na as f64);
        tb.push(b(nb).as_nanos() as f64 / nb as f64);
    }
    (median(&mut ta), median(&mut tb), na, nb)
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Seconds since `t`, for progress lines.
pub fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}
