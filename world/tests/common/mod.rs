//! A deterministic harness: simulated clock, simulated copy engine, and an
//! in-memory lower tier, so every test controls exactly when I/O completes.
#![allow(dead_code)]

use orbitkv_components::api::{
    Addressed, Command, CommandError, Event, GroupHashes, Origin, PagePos, PublishPage, Rank,
    RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::{Namespace, NativeHash, StateKey, StorageLayout, StorageSlot};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::tier::{MemoryTier, MemoryTierHandle};
use orbitkv_world::{Backends, Config, Runtime};

pub const PAGE: u64 = 64;
pub const PAGE_BYTES: u64 = 4096;
pub const TICK_US: u64 = 10;

pub struct Harness {
    pub rt: Runtime,
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
        Harness {
            rt,
            arena,
            tier: handle,
            copies,
            events: Vec::new(),
            last: Vec::new(),
        }
    }

    /// Submits as the embedded caller, ticks once, and returns that tick's
    /// events (also kept). Every event must be addressed to the embedded
    /// caller: it owns every session these tests open.
    pub fn step(&mut self, commands: Vec<Command>) -> Vec<Event> {
        for c in commands {
            self.rt.submit(Origin::EMBEDDED, c).expect("inbox has room");
        }
        let ev = embedded(self.rt.tick());
        self.events.extend(ev.clone());
        self.last = ev.clone();
        ev
    }

    /// Submits each command from its origin, ticks once, and returns the
    /// tick's events with their addressees.
    pub fn step_from(&mut self, commands: Vec<(Origin, Command)>) -> Vec<Addressed> {
        for (origin, c) in commands {
            self.rt.submit(origin, c).expect("inbox has room");
        }
        self.rt.tick()
    }

    /// Advances simulated time one tick and runs it.
    pub fn advance(&mut self) -> Vec<Event> {
        self.step(vec![Command::AdvanceClock { us: TICK_US }])
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
        let ids: Vec<u32> = groups.iter().map(|g| g.id).collect();
        match self.one(register_cmd(name, identity, groups, ranks, &ids)) {
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

    /// Registers a region and returns (region handle, engine region id).
    pub fn region(
        &mut self,
        session: SessionHandle,
        rank: u32,
        group: u32,
        slots: u32,
    ) -> (u64, u32) {
        match self.one(Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
        }) {
            Event::RegionRegistered {
                region,
                engine_region,
                ..
            } => (region, engine_region),
            e => panic!("region: {e:?}"),
        }
    }

    pub fn alloc(&mut self, session: SessionHandle, region: u64, slot: u32) -> u64 {
        match self.one(Command::DevicePageAlloc {
            session,
            region,
            slot,
        }) {
            Event::DevicePageAllocated { device_page, .. } => device_page,
            e => panic!("alloc: {e:?}"),
        }
    }

    /// Like `alloc`, but a refusal is returned, and other events of the tick
    /// are kept in `events` for the caller.
    pub fn try_alloc(
        &mut self,
        session: SessionHandle,
        region: u64,
        slot: u32,
    ) -> Result<u64, CommandError> {
        let id = self
            .rt
            .submit(
                Origin::EMBEDDED,
                Command::DevicePageAlloc {
                    session,
                    region,
                    slot,
                },
            )
            .unwrap();
        let ev = embedded(self.rt.tick());
        self.events.extend(ev.clone());
        self.last = ev.clone();
        for e in ev {
            match e {
                Event::DevicePageAllocated {
                    command,
                    device_page,
                } if command == id => return Ok(device_page),
                Event::Rejected { command, error } if command == id => return Err(error),
                _ => {}
            }
        }
        panic!("no reply to alloc command {id}");
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
        self.rt.check_invariants().unwrap();
        let s = self.rt.stats();
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

pub fn register_cmd(
    name: &str,
    identity: [u8; 32],
    groups: Vec<GroupSpec>,
    ranks: u32,
    group_ids: &[u32],
) -> Command {
    let mut slots = Vec::new();
    for tp in 0..ranks {
        for (layer, g) in group_ids.iter().enumerate() {
            slots.push(StorageSlot {
                layer: layer as u32,
                group: *g,
                tp_rank: tp,
                pp_rank: 0,
                segment_bytes: PAGE_BYTES,
                padded_page_bytes: PAGE_BYTES,
                page_tokens: PAGE as u32,
                dtype: "bfloat16".into(),
                layout: "NHD".into(),
                strides: vec![64, 1],
                device_addr: 0,
            });
        }
    }
    Command::RegisterInstance {
        instance: name.into(),
        identity,
        layout: StorageLayout {
            slots,
            pool_capacity_pages: 0,
        },
        page_tokens: PAGE,
        groups,
        ranks: (0..ranks).map(|tp| Rank { tp, pp: 0 }).collect(),
    }
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

pub fn target(rank: u32, group: u32, page_end: u64, device_page: u64) -> RestoreTarget {
    RestoreTarget {
        pos: PagePos {
            rank,
            group,
            page_end,
        },
        device_page,
    }
}
