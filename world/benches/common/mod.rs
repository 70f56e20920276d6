//! Shared setup for the runtime benchmarks: instance registration with a
//! chosen page size, deterministic hashes, the shared engine-side driver
//! for the simulated and wall-clock runtimes, and interleaved own timing.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use orbitkv_components::api::{Command, CommandId, Event, Origin, PublishPage, SessionHandle};
use orbitkv_components::contract::GroupSpec;
use orbitkv_components::{Namespace, NativeHash};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_world::driver::{self, Embedded, register_command};
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

#[allow(unused_imports)]
pub use orbitkv_world::driver::{dense, hybrid};

/// One layer per group per rank, each `page_bytes` per page, so a group's
/// page is exactly `page_bytes`.
pub fn register_cmd(
    name: &str,
    groups: Vec<GroupSpec>,
    ranks: u32,
    page_tokens: u64,
    page_bytes: u64,
) -> Command {
    register_command(name, IDENTITY, groups, ranks, page_tokens, page_bytes)
}

/// The engine's chained hash of page `i` of prompt `seed` in `group`.
pub fn hash(seed: u64, group: u32, i: u64) -> NativeHash {
    NativeHash::from_u64(seed.wrapping_mul(1_000_003) ^ ((group as u64) << 48) ^ i)
}

/// Page `i`'s hash as vLLM computes it by default (`sha256_cbor`): 32
/// bytes, uniform. Sequential integers would flatter a multiplicative
/// hasher (consecutive keys land in evenly strided buckets, which the
/// prefetcher follows); engine hashes are digests.
#[allow(dead_code)]
pub fn digest(seed: u64, group: u32, i: u64) -> NativeHash {
    let mut input = [0u8; 20];
    input[..8].copy_from_slice(&seed.to_le_bytes());
    input[8..12].copy_from_slice(&group.to_le_bytes());
    input[12..].copy_from_slice(&i.to_le_bytes());
    let lo = xxhash_rust::xxh3::xxh3_128_with_seed(&input, 1).to_le_bytes();
    let hi = xxhash_rust::xxh3::xxh3_128_with_seed(&input, 2).to_le_bytes();
    NativeHash::new(&[lo, hi].concat()).expect("32 bytes fit")
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

/// The shared engine-side driver (`orbitkv_world::driver`) on the
/// embedded runtime, with the copy engine's device memory. With a
/// simulated clock, waiting advances time by 1 µs a step; with a wall
/// clock, it yields. Benchmarks want a refusal to stop them, so these
/// unwrap.
pub struct Driver {
    pub d: driver::Driver<Embedded>,
    pub arena: DeviceArena,
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
        Self::new(rt, arena, true)
    }

    pub fn new(rt: Runtime, arena: DeviceArena, simulated: bool) -> Self {
        let port = Embedded::new(rt, Origin::EMBEDDED, simulated.then_some(1));
        Driver {
            d: driver::Driver::new(port),
            arena,
        }
    }

    pub fn rt(&mut self) -> &mut Runtime {
        &mut self.d.port.rt
    }

    /// Ticks run so far.
    pub fn ticks(&self) -> u64 {
        self.d.port.ticks
    }

    pub fn submit(&mut self, c: Command) -> CommandId {
        self.d.submit(c).expect("inbox has room")
    }

    pub fn tick(&mut self) {
        self.d.tick().expect("tick");
    }

    pub fn wait(&mut self, what: &'static str, pred: impl Fn(&Event) -> bool) -> Event {
        self.d.wait(what, pred).expect(what)
    }

    /// Drops events nobody waits for; panics on a rejection among them.
    pub fn clear(&mut self) {
        let rejected = self
            .d
            .pending
            .iter()
            .find(|e| matches!(e, Event::Rejected { .. }));
        assert!(rejected.is_none(), "a command was rejected: {rejected:?}");
        self.d.pending.clear();
    }

    pub fn register(&mut self, c: Command) -> Vec<Namespace> {
        self.d.register(c).expect("register")
    }

    pub fn open(&mut self, name: &str) -> SessionHandle {
        self.d.open(name).expect("open")
    }

    /// (region handle, engine region id, page bytes).
    pub fn region(
        &mut self,
        session: SessionHandle,
        rank: u32,
        group: u32,
        slots: u32,
    ) -> (u64, u32, u64) {
        let r = self
            .d
            .region(session, (rank, group), slots)
            .expect("region");
        (r.region, r.engine_region, r.page_bytes)
    }

    /// Allocates device pages for `slots` of `region` in one tick.
    pub fn alloc_many(
        &mut self,
        session: SessionHandle,
        region: u64,
        slots: impl IntoIterator<Item = u32>,
    ) -> Vec<u64> {
        self.d.alloc_many(session, region, slots).expect("alloc")
    }

    /// Publishes and waits for `PublishDone`; returns `inserted`.
    pub fn publish(
        &mut self,
        session: SessionHandle,
        request: u64,
        pages: Vec<PublishPage>,
    ) -> u64 {
        let done = self.d.publish(session, request, pages).expect("publish");
        assert_eq!((done.duplicates, done.dropped), (0, 0), "{done:?}");
        done.inserted
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
