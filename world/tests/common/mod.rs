//! A deterministic harness: simulated clock, simulated copy engine, and an
//! in-memory lower tier, so every test controls exactly when I/O completes.
//! The engine side is the shared driver (`orbitkv_world::driver`).
#![allow(dead_code)]

use orbitkv_components::api::{
    Addressed, Command, CommandError, Event, GroupHashes, Origin, PublishPage, SessionHandle,
};
use orbitkv_components::contract::GroupSpec;
use orbitkv_components::{Namespace, NativeHash, StateKey};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::tier::{MemoryTier, MemoryTierHandle};
#[allow(unused_imports)]
pub use orbitkv_world::driver::target;
use orbitkv_world::driver::{Driver, DriverError, Embedded, register_command};
use orbitkv_world::{Backends, Config, Runtime};

pub const PAGE: u64 = 64;
pub const PAGE_BYTES: u64 = 4096;
pub const TICK_US: u64 = 10;

/// The deterministic runtime, driven by the shared engine-side driver
/// (`orbitkv_world::driver`) as the embedded caller, plus the test's own
/// log of events.
pub struct Harness {
    pub d: Driver<Embedded>,
    pub arena: DeviceArena,
    pub tier: MemoryTierHandle,
    pub copies: orbitkv_gpu::sim::SimCopyControl,
    pub events: Vec<Event>,
    /// Events of the latest tick, searched first by `until`.
    last: Vec<Event>,
}

pub fn config(dram_bytes: u64) -> Config {
    let mut c = Config::default();
    c.dram.capacity_bytes = dram_bytes;
    c.dram.extent_bytes = 64 << 10;
    c.dram.first_touch = false;
    c.check_invariants = true;
    c
}

impl Harness {
    pub fn new(config: Config) -> Self {
        Self::with_latency(config, 50, 20)
    }

    /// `tier_latency_us` for lower-tier reads, `copy_latency_us` for device copies.
    pub fn with_latency(config: Config, tier_latency_us: u64, copy_latency_us: u64) -> Self {
        let copy = SimCopyEngine::new(SimCopyConfig {
            latency_us: copy_latency_us,
            bytes_per_us: 0,
            max_in_flight_batches: 64,
        });
        let arena = copy.arena();
        let copies = copy.control();
        let tier = MemoryTier::new("sim", tier_latency_us, 1024);
        let handle = tier.handle();
        let rt = Runtime::with_backends(
            config,
            Backends {
                copy: Box::new(copy),
                tiers: vec![Box::new(tier)],
                simulated_clock: true,
            },
        )
        .expect("runtime");
        let port = Embedded::new(rt, Origin::EMBEDDED, Some(TICK_US));
        Harness {
            d: Driver::new(port),
            arena,
            tier: handle,
            copies,
            events: Vec::new(),
            last: Vec::new(),
        }
    }

    pub fn rt(&mut self) -> &mut Runtime {
        &mut self.d.port.rt
    }

    /// Keeps what the driver's last steps produced in the test's log.
    fn log(&mut self) -> Vec<Event> {
        let ev: Vec<Event> = std::mem::take(&mut self.d.pending).into();
        self.events.extend(ev.clone());
        self.last = ev.clone();
        ev
    }

    /// Submits as the embedded caller, ticks once, and returns that tick's
    /// events (also kept). Every event must be addressed to the embedded
    /// caller: it owns every session these tests open.
    pub fn step(&mut self, commands: Vec<Command>) -> Vec<Event> {
        for c in commands {
            self.d.submit(c).expect("inbox has room");
        }
        self.d.tick().expect("tick");
        self.log()
    }

    /// Submits each command from its origin, ticks once, and returns the
    /// tick's events with their addressees.
    pub fn step_from(&mut self, commands: Vec<(Origin, Command)>) -> Vec<Addressed> {
        for (origin, c) in commands {
            self.rt().submit(origin, c).expect("inbox has room");
        }
        self.rt().tick()
    }

    /// Advances simulated time one tick and runs it.
    pub fn advance(&mut self) -> Vec<Event> {
        self.d.advance().expect("tick");
        self.log()
    }

    /// The first event matching `pred` from the latest tick on, advancing
    /// time as needed (bounded).
    pub fn until(&mut self, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        if let Some(e) = std::mem::take(&mut self.last).into_iter().find(|e| pred(e)) {
            return e;
        }
        for _ in 0..10_000 {
            if let Some(e) = self.advance().into_iter().find(|e| pred(e)) {
                return e;
            }
        }
        panic!(
            "no event for {what} after 10000 ticks; last events: {:?}",
            self.events.iter().rev().take(5).collect::<Vec<_>>()
        );
    }

    pub fn one(&mut self, command: Command) -> Event {
        let ev = self.step(vec![command]);
        assert_eq!(ev.len(), 1, "expected one event, got {ev:?}");
        ev.into_iter().next().unwrap()
    }

    pub fn register(
        &mut self,
        name: &str,
        identity: [u8; 32],
        groups: Vec<GroupSpec>,
        ranks: u32,
    ) -> Vec<Namespace> {
        let ns = self
            .d
            .register(register_command(
                name, identity, groups, ranks, PAGE, PAGE_BYTES,
            ))
            .expect("register");
        self.log();
        ns
    }

    pub fn open(&mut self, name: &str) -> SessionHandle {
        let s = self.d.open(name).expect("open");
        self.log();
        s
    }

    /// Registers a region and returns (region handle, engine region id).
    pub fn region(
        &mut self,
        session: SessionHandle,
        rank: u32,
        group: u32,
        slots: u32,
    ) -> (u64, u32) {
        let r = self
            .d
            .region(session, (rank, group), slots)
            .expect("region");
        self.log();
        (r.region, r.engine_region)
    }

    pub fn alloc(&mut self, session: SessionHandle, region: u64, slot: u32) -> u64 {
        self.try_alloc(session, region, slot).expect("alloc")
    }

    /// Like `alloc`, but a refusal is returned, and other events of the tick
    /// are kept in `events` for the caller.
    pub fn try_alloc(
        &mut self,
        session: SessionHandle,
        region: u64,
        slot: u32,
    ) -> Result<u64, CommandError> {
        let page = self.d.alloc(session, region, slot);
        self.log();
        match page {
            Ok(page) => Ok(page),
            Err(DriverError::Rejected { error, .. }) => Err(error),
            Err(e) => panic!("alloc: {e}"),
        }
    }

    pub fn write_slot(&self, engine_region: u32, slot: u32, bytes: &[u8]) {
        self.arena
            .write(engine_region, slot as u64 * PAGE_BYTES, bytes)
            .unwrap();
    }

    pub fn read_slot(&self, engine_region: u32, slot: u32) -> Vec<u8> {
        self.arena
            .read(engine_region, slot as u64 * PAGE_BYTES, PAGE_BYTES)
            .unwrap()
    }

    /// Asserts nothing leaked: no operations, leases, transfers or bytes.
    pub fn assert_idle(&mut self) {
        self.rt().check_invariants().unwrap();
        let s = self.rt().stats();
        assert_eq!(
            (s.operations, s.leases, s.transfers, s.bytes_reserved),
            (0, 0, 0, 0),
            "{s:#?}"
        );
    }
}

/// The events of a tick whose every event is addressed to the embedded
/// caller (asserted).
pub fn embedded(events: Vec<Addressed>) -> Vec<Event> {
    events
        .into_iter()
        .map(|a| {
            assert_eq!(a.to, Origin::EMBEDDED, "{a:?}");
            a.event
        })
        .collect()
}

/// A register command whose layout has slots only for `group_ids` (the
/// others' slots are missing: registration must refuse it).
pub fn register_cmd(
    name: &str,
    identity: [u8; 32],
    groups: Vec<GroupSpec>,
    ranks: u32,
    group_ids: &[u32],
) -> Command {
    let mut c = register_command(name, identity, groups, ranks, PAGE, PAGE_BYTES);
    if let Command::RegisterInstance { layout, .. } = &mut c {
        layout.slots.retain(|s| group_ids.contains(&s.group));
    }
    c
}

#[allow(unused_imports)]
pub use orbitkv_world::driver::{dense, hybrid};

/// The engine's chained hash of page `i` of a prompt: distinct per prompt
/// seed, group and page.
pub fn hash(seed: u64, group: u32, i: u64) -> NativeHash {
    NativeHash::from_u64(seed.wrapping_mul(1_000_003) ^ ((group as u64) << 48) ^ i)
}

pub fn hashes(seed: u64, groups: &[u32], pages: u64) -> Vec<GroupHashes> {
    groups
        .iter()
        .map(|&g| GroupHashes {
            group: g,
            hashes: (0..pages).map(|i| hash(seed, g, i)).collect(),
        })
        .collect()
}

/// Deterministic page bytes for a key.
pub fn payload(ns: &Namespace, group: u32, native: &NativeHash) -> Vec<u8> {
    let mut state =
        xxhash_rust::xxh3::xxh3_64(&[&ns.0[..], &group.to_le_bytes(), native.as_bytes()].concat());
    (0..PAGE_BYTES)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub fn key(ns: Namespace, group: u32, native: NativeHash) -> StateKey {
    StateKey {
        namespace: ns,
        group,
        native,
    }
}

pub fn query(
    session: SessionHandle,
    request: u64,
    seed: u64,
    groups: &[u32],
    pages: u64,
    prompt_len: u64,
    prepare: bool,
) -> Command {
    Command::Query {
        session,
        request,
        groups: hashes(seed, groups, pages),
        origin: 0,
        prompt_len,
        expect_namespaces: Vec::new(),
        prepare,
        speculative: false,
    }
}

pub fn publish_cmd(
    session: SessionHandle,
    request: u64,
    rank: u32,
    pages: Vec<(u32, NativeHash, u64)>,
) -> Command {
    Command::Publish {
        session,
        request,
        pages: pages
            .into_iter()
            .map(|(group, hash, device_page)| PublishPage {
                rank,
                group,
                hash,
                device_page,
            })
            .collect(),
    }
}
