//! One stage at a time: each test builds a runtime `World`, spawns by hand
//! the entities a stage works on, runs that one system with
//! `RunSystemOnce`, and checks exactly what it changed.

use bevy_ecs::prelude::*;
use bevy_ecs::system::RunSystemOnce;
use orbitkv_components::api::{
    Addressed, Command, CommandError, Event, GroupHashes, MissReason, Origin, PagePos, Rank,
    RestoreTarget,
};
use orbitkv_components::contract::{ContractSpec, GroupSpec, RecoveryContract};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, HeldBy, Instance, Lease, LeaseOf, Leases, NeedState, OpState,
    Operation, OperationOf, Outcome, Page, PageNeed, PageOf, RankState, Recovery, RegionOf,
    Residency, Session, SessionOf, Transfer, TransferKind, TransferOf, at, mark_state,
};
use orbitkv_components::{Namespace, NativeHash, RequiredRange, StateKey, StorageLayout, seal};
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::tier::{MemoryTier, MemoryTierHandle};
use orbitkv_systems::resources::{
    Budget, Clock, Copier, Dram, Evicted, Inbound, Inbox, Metrics, Outbox, Registry, decrement,
};
use orbitkv_systems::{discover, evict, fence, ingest, read, restore, validate};
use orbitkv_world::{Backends, Config, RuntimeWorld};

const PAGE: u64 = 16;
const BYTES: u64 = 4096;
const ORIGIN: Origin = Origin(7);

struct Bench {
    w: RuntimeWorld,
    tier: MemoryTierHandle,
    ns: Namespace,
    instance: Entity,
    session: Entity,
}

fn bench(tune: impl FnOnce(&mut Config)) -> Bench {
    let mut c = Config::default();
    c.dram.capacity_bytes = 64 * BYTES;
    c.dram.extent_bytes = 64 << 10;
    c.dram.first_touch = false;
    tune(&mut c);
    let copy = SimCopyEngine::new(SimCopyConfig {
        latency_us: 10,
        bytes_per_us: 0,
        max_in_flight_batches: 64,
    });
    let tier = MemoryTier::new("sim", 10, 64).writable();
    let handle = tier.handle();
    let backends = Backends {
        copy: Box::new(copy),
        tiers: vec![Box::new(tier)],
        simulated_clock: true,
    };
    let (mut w, _) = RuntimeWorld::build(&c, backends).unwrap();
    let (instance, ns) = spawn_instance(&mut w);
    let session = Session {
        origin: ORIGIN,
        epoch: 1,
        closing: false,
        closed_by: None,
    };
    let session = w.spawn((session, SessionOf(instance))).id();
    w.resource_mut::<Registry>().sessions = 1;
    Bench {
        w,
        tier: handle,
        ns,
        instance,
        session,
    }
}

/// A one-rank dense instance "m", spawned as ingest would.
fn spawn_instance(w: &mut World) -> (Entity, Namespace) {
    let groups = vec![GroupSpec::attention(0)];
    let layout = StorageLayout::uniform(&[Rank { tp: 0, pp: 0 }], &groups, PAGE, BYTES);
    let namespace = seal(&[1; 32], &layout, &groups).unwrap();
    let contract = RecoveryContract::compile(&ContractSpec {
        namespace,
        page_tokens: PAGE,
        groups: groups.clone(),
    })
    .unwrap();
    let rank = RankState {
        rank: Rank { tp: 0, pp: 0 },
        namespace,
        contract,
        page_bytes: vec![(0, BYTES)],
        format_digest: [2; 32],
    };
    let instance = Instance {
        name: "m".into(),
        identity: [1; 32],
        layout,
        page_tokens: PAGE,
        ranks: vec![rank],
        groups,
        bytes_reserved: 0,
        retired: false,
    };
    let e = w.spawn(instance).id();
    w.resource_mut::<Registry>().instances.insert("m".into(), e);
    (e, namespace)
}

fn key(ns: Namespace, i: u64) -> StateKey {
    StateKey {
        namespace: ns,
        group: 0,
        native: NativeHash::from_u64(100 + i),
    }
}

impl Bench {
    /// Page `i` resident in DRAM and unleased (so in the LRU), carrying the
    /// checksum of its slot's bytes (restores and demotions verify it).
    fn resident(&mut self, i: u64) -> Entity {
        let key = key(self.ns, i);
        let (slot, offset) = self.w.resource_mut::<Dram>().alloc(BYTES).unwrap();
        let checksum = page_checksum(self.w.resource::<Dram>().slot_bytes(slot, BYTES).unwrap());
        let page = Page {
            key,
            bytes: BYTES,
            checksum,
            format: [2; 32],
            residency: Residency {
                dram_slot: slot,
                dram_offset: offset,
            },
        };
        let e = self.w.spawn(page).id();
        let mut dram = self.w.resource_mut::<Dram>();
        dram.index.insert(key, e);
        dram.make_evictable(e, slot);
        e
    }

    fn op(&mut self, command: u64, state: OpState, rec: Recovery) -> Entity {
        let op = Operation::new(command, ORIGIN, self.instance, 9, state, u64::MAX, false);
        let e = self.w.spawn((op, OperationOf(self.session), rec)).id();
        mark_state(&mut self.w.entity_mut(e), state);
        self.w.resource_mut::<Registry>().operations += 1;
        e
    }

    /// The page leased to need `i` of a recovery.
    fn page_of_need(&self, op: Entity, i: usize) -> Entity {
        let NeedState::Leased(lease) = self.w.get::<Recovery>(op).unwrap().needs[i].state else {
            panic!("need {i} is not leased");
        };
        self.w.get::<LeaseOf>(lease).unwrap().0
    }

    fn lease(&mut self, page: Entity, op: Entity) -> Entity {
        self.w.spawn((Lease, LeaseOf(page), HeldBy(op))).id()
    }

    /// A region of `slots` pages, all allocated.
    fn region(&mut self, slots: u32) -> (Entity, Vec<Entity>) {
        let engine_region = self
            .w
            .resource_mut::<Copier>()
            .0
            .get_mut()
            .register_device_region(u64::from(slots) * BYTES)
            .unwrap();
        let region = DeviceRegion {
            origin: ORIGIN,
            rank: 0,
            group: 0,
            slots,
            page_bytes: BYTES,
            engine_region,
            executor: orbitkv_components::ecs::Executor::Local,
            by_slot: Default::default(),
        };
        let r = self.w.spawn((region, RegionOf(self.session))).id();
        let mut pages = Vec::new();
        for slot in 0..slots {
            let page = DevicePage {
                slot,
                pins: 0,
                free_deferred: None,
            };
            let p = self.w.spawn((page, PageOf(r))).id();
            let mut region = self.w.get_mut::<DeviceRegion>(r).unwrap();
            region.by_slot.insert(slot, p);
            pages.push(p);
        }
        (r, pages)
    }

    fn run<M>(&mut self, system: impl IntoSystem<(), (), M>) {
        self.w.run_system_once(system).unwrap();
    }

    fn events(&mut self) -> Vec<Addressed> {
        std::mem::take(&mut self.w.resource_mut::<Outbox>().0)
    }

    /// The one event of the run, which must go to the owner.
    fn only_event(&mut self) -> Event {
        let mut events = self.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let a = events.remove(0);
        assert_eq!(a.to, ORIGIN, "{a:?}");
        a.event
    }

    fn state(&self, op: Entity) -> OpState {
        self.w.get::<Operation>(op).unwrap().state()
    }

    fn in_lru(&self, page: Entity) -> bool {
        self.w
            .resource::<Dram>()
            .lru
            .values()
            .any(|l| l.contains(&page))
    }

    fn check(&mut self) {
        let v = orbitkv_world::invariants::check(&mut self.w);
        assert!(v.is_empty(), "{v:#?}");
    }
}

fn recovery(pages: u64) -> Recovery {
    let hashes = GroupHashes {
        group: 0,
        hashes: (0..pages).map(|i| NativeHash::from_u64(100 + i)).collect(),
    };
    Recovery::new(vec![hashes], 0, pages * PAGE, pages * PAGE + 1)
}

fn pos(page_end: u64) -> PagePos {
    PagePos {
        rank: 0,
        group: 0,
        page_end,
    }
}

fn need(ns: Namespace, i: u64, state: NeedState) -> PageNeed {
    PageNeed {
        pos: pos((i + 1) * PAGE),
        key: key(ns, i),
        bytes: BYTES,
        state,
        from_tier: false,
        residency: None,
        checksum: 0,
    }
}

#[test]
fn ingest_refuses_a_conflicting_registration_without_effect() {
    let mut b = bench(|_| {});
    let groups = b.w.get::<Instance>(b.instance).unwrap().groups.clone();
    let ranks = [Rank { tp: 0, pp: 0 }];
    let command = Command::RegisterInstance {
        instance: "m".into(),
        identity: [9; 32],
        layout: StorageLayout::uniform(&ranks, &groups, PAGE, BYTES),
        page_tokens: PAGE,
        groups,
        ranks: ranks.to_vec(),
    };
    let inbound = Inbound::Command {
        id: 5,
        origin: ORIGIN,
        command,
    };
    b.w.resource_mut::<Inbox>().0.push_back(inbound);
    b.run(ingest::ingest);
    let e = b.only_event();
    assert!(
        matches!(
            e,
            Event::Rejected {
                command: 5,
                error: CommandError::InstanceConflict(_)
            }
        ),
        "{e:?}"
    );
    // The open session keeps its instance, still registered and live.
    assert_eq!(b.w.resource::<Registry>().instances["m"], b.instance);
    assert!(!b.w.get::<Instance>(b.instance).unwrap().retired);
}

#[test]
fn discover_stops_a_prefix_at_its_first_gap() {
    let mut b = bench(|_| {});
    b.resident(0);
    b.resident(1);
    // Page 2 is missing; page 3 (in a tier) cannot extend the prefix.
    b.tier.insert(key(b.ns, 3), vec![0; BYTES as usize]);
    let op = b.op(1, OpState::Discover, recovery(4));
    b.run(discover::discover);
    assert_eq!(b.state(op), OpState::Validate);
    assert!(b.w.entity(op).contains::<at::Validate>());
    let rec = b.w.get::<Recovery>(op).unwrap();
    assert_eq!(rec.candidates, vec![(0, 0, vec![PAGE, 2 * PAGE])]);
    b.check();
}

#[test]
fn validate_selects_below_the_prompt_limit_and_replies_to_the_owner() {
    let mut b = bench(|_| {});
    let mut rec = recovery(4);
    rec.candidates = vec![(0, 0, vec![PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE])];
    rec.prompt_len = 4 * PAGE; // the final token must be computed
    let op = b.op(1, OpState::Validate, rec);
    b.run(validate::validate);
    assert_eq!(b.state(op), OpState::Selected);
    let e = b.only_event();
    assert!(
        matches!(
            e,
            Event::QueryResult {
                selected: Some(48),
                miss: None,
                ..
            }
        ),
        "{e:?}"
    );
    let rec = b.w.get::<Recovery>(op).unwrap();
    let want = RequiredRange {
        group: 0,
        start: 0,
        end: 48,
    };
    assert_eq!(rec.ranges, vec![(0, want)]);
}

#[test]
fn read_admits_in_arrival_order_and_refuses_what_can_never_fit() {
    let mut b = bench(|c| c.budget.query_budget_bytes = Some(3 * BYTES));
    let ranged = |pages| {
        let mut rec = recovery(pages);
        rec.selected = Some(pages * PAGE);
        let range = RequiredRange {
            group: 0,
            start: 0,
            end: pages * PAGE,
        };
        rec.ranges = vec![(0, range)];
        rec
    };
    b.resident(0);
    b.resident(1);
    // Spawned out of order: admission goes by command id.
    let second = b.op(2, OpState::Admit, ranged(2));
    let first = b.op(1, OpState::Admit, ranged(2));
    let huge = b.op(3, OpState::Admit, ranged(4));
    b.run(read::read);
    // Admitted and read in the same run: both pages were resident.
    assert_eq!(b.state(first), OpState::Ready);
    assert_eq!(
        b.w.get::<Operation>(first).unwrap().bytes_reserved,
        2 * BYTES
    );
    assert_eq!(b.w.get::<Recovery>(first).unwrap().needs.len(), 2);
    assert_eq!(b.state(second), OpState::Admit, "waits for budget");
    assert_eq!(b.state(huge), OpState::Finishing);
    let outcome = b.w.get::<Operation>(huge).unwrap().outcome;
    assert_eq!(outcome, Some(Outcome::Miss(MissReason::Budget)));
    assert_eq!(b.w.resource::<Budget>().reserved, 2 * BYTES);
    assert_eq!(
        b.w.get::<Instance>(b.instance).unwrap().bytes_reserved,
        2 * BYTES
    );
}

#[test]
fn read_leases_resident_pages_and_reads_the_rest_from_a_tier() {
    let mut b = bench(|_| {});
    let resident = b.resident(0);
    b.tier.insert(key(b.ns, 1), vec![7; BYTES as usize]);
    let mut rec = recovery(2);
    rec.needs = vec![
        need(b.ns, 0, NeedState::Pending),
        need(b.ns, 1, NeedState::Pending),
    ];
    let op = b.op(1, OpState::Reading, rec);
    assert!(b.in_lru(resident));
    b.run(read::read);
    let rec = b.w.get::<Recovery>(op).unwrap();
    let NeedState::Leased(lease) = rec.needs[0].state else {
        panic!("{:?}", rec.needs[0]);
    };
    assert_eq!(rec.needs[1].state, NeedState::Reading);
    assert_eq!(b.w.get::<LeaseOf>(lease), Some(&LeaseOf(resident)));
    assert_eq!(b.w.get::<HeldBy>(lease), Some(&HeldBy(op)));
    // Leased: out of the LRU (the observer saw the page's first lease).
    assert!(b.w.get::<Leases>(resident).is_some());
    assert!(!b.in_lru(resident));
    let mut reads = b.w.query::<(&Transfer, &TransferOf)>();
    let reads: Vec<_> = reads.iter(&b.w).collect();
    assert_eq!(reads.len(), 1);
    assert_eq!(reads[0].1, &TransferOf(op));
    assert!(matches!(reads[0].0.kind, TransferKind::TierRead { .. }));
    assert_eq!(
        b.events(),
        vec![Addressed {
            to: ORIGIN,
            event: Event::Loading {
                operation: op.to_bits()
            },
            terminal: false,
        }]
    );
    b.check();
}

/// A recovery past its deadline starts no read and is not admitted: every
/// transfer an operation has was submitted before its deadline, so it
/// replies by its deadline plus the transfer timeout (the fuzzer's
/// liveness bound). `expire` ends it in the same tick.
#[test]
fn read_starts_nothing_for_a_recovery_past_its_deadline() {
    let mut b = bench(|_| {});
    b.tier.insert(key(b.ns, 0), vec![7; BYTES as usize]);
    let mut rec = recovery(1);
    rec.needs = vec![need(b.ns, 0, NeedState::Pending)];
    let reading = b.op(1, OpState::Reading, rec);
    let mut rec = recovery(1);
    rec.selected = Some(PAGE);
    rec.ranges = vec![(
        0,
        RequiredRange {
            group: 0,
            start: 0,
            end: PAGE,
        },
    )];
    let waiting = b.op(2, OpState::Admit, rec);
    for op in [reading, waiting] {
        b.w.get_mut::<Operation>(op).unwrap().deadline_us = 10;
    }
    b.w.resource_mut::<Clock>().now_us = 10;
    b.run(read::read);
    assert_eq!(
        b.w.query::<&Transfer>().iter(&b.w).count(),
        0,
        "no read started"
    );
    assert_eq!(b.state(waiting), OpState::Admit, "not admitted");
    assert_eq!(b.w.resource::<Budget>().reserved, 0);
    b.run(fence::expire);
    for op in [reading, waiting] {
        let o = b.w.get::<Operation>(op).unwrap();
        assert_eq!(o.outcome, Some(Outcome::Miss(MissReason::Deadline)));
    }
    // A microsecond earlier, both would have gone ahead.
    b.w.resource_mut::<Clock>().now_us = 9;
    let mut rec = recovery(1);
    rec.needs = vec![need(b.ns, 0, NeedState::Pending)];
    let early = b.op(3, OpState::Reading, rec);
    b.w.get_mut::<Operation>(early).unwrap().deadline_us = 10;
    b.run(read::read);
    assert_eq!(b.w.query::<&Transfer>().iter(&b.w).count(), 1);
}

/// A ready recovery of 3 resident pages, restoring into a 3-page region.
fn restoring(b: &mut Bench) -> (Entity, Vec<Entity>) {
    let pages: Vec<Entity> = (0..3).map(|i| b.resident(i)).collect();
    let (_, targets) = b.region(3);
    let mut rec = recovery(3);
    rec.selected = Some(3 * PAGE);
    let op = b.op(1, OpState::RestorePending, rec);
    let mut needs = Vec::new();
    for (i, page) in pages.iter().enumerate() {
        let lease = b.lease(*page, op);
        let mut n = need(b.ns, i as u64, NeedState::Leased(lease));
        n.residency = Some(b.w.get::<Page>(*page).unwrap().residency);
        needs.push(n);
    }
    let mut rec = b.w.get_mut::<Recovery>(op).unwrap();
    rec.needs = needs;
    rec.restore = targets
        .iter()
        .enumerate()
        .map(|(i, dp)| RestoreTarget {
            pos: pos((i as u64 + 1) * PAGE),
            device_page: dp.to_bits(),
        })
        .collect();
    (op, targets)
}

/// A bench with `batch` pages per copy batch and `in_flight` batches.
fn copy_limited(batch: usize, in_flight: usize) -> Bench {
    bench(|c| {
        c.limits.max_copy_batch_pages = batch;
        c.limits.max_inflight_copies = in_flight;
    })
}

#[test]
fn restore_pins_every_destination_and_sends_what_the_copy_limit_allows() {
    let mut b = copy_limited(1, 2);
    let (op, targets) = restoring(&mut b);
    b.run(restore::restore);
    assert_eq!(b.state(op), OpState::Restoring);
    for dp in &targets {
        assert_eq!(b.w.get::<DevicePage>(*dp).unwrap().pins, 1, "pinned once");
    }
    assert_eq!(b.w.get::<Recovery>(op).unwrap().copies_sent, 2);
    assert_eq!(b.w.query::<&Transfer>().iter(&b.w).count(), 2);
    // No room: nothing more this tick.
    b.run(restore::restore);
    assert_eq!(b.w.get::<Recovery>(op).unwrap().copies_sent, 2);
    b.check();
}

#[test]
fn retire_settles_a_drained_restore_and_unpins_after_the_reply() {
    let mut b = copy_limited(2, 1);
    let (op, targets) = restoring(&mut b);
    b.run(restore::restore);
    b.w.resource_mut::<Clock>().now_us += 100;
    b.run(fence::land);
    b.run(fence::retire);
    assert_eq!(b.state(op), OpState::Restoring, "a batch is still unsent");
    // Landed or not, destinations stay pinned until the restore retires.
    let pinned = |b: &Bench| {
        targets
            .iter()
            .all(|dp| b.w.get::<DevicePage>(*dp).unwrap().pins == 1)
    };
    assert!(pinned(&b));
    b.run(restore::restore);
    b.w.resource_mut::<Clock>().now_us += 100;
    b.run(fence::land);
    assert!(pinned(&b));
    b.check();
    // The engine freed a destination meanwhile: the free takes effect, and
    // is reported, only after the restore's reply.
    b.w.get_mut::<DevicePage>(targets[0]).unwrap().free_deferred = Some(1);
    b.run(fence::retire);
    assert!(b.w.get_entity(op).is_err(), "settled and retired");
    let events: Vec<Event> = b.events().into_iter().map(|a| a.event).collect();
    assert!(
        matches!(
            &events[..],
            [
                Event::RestoreDone { pages: 3, .. },
                Event::DevicePageFreed { deferred: true, .. }
            ]
        ),
        "{events:?}"
    );
    assert!(b.w.get_entity(targets[0]).is_err());
    assert!(
        targets[1..]
            .iter()
            .all(|dp| b.w.get::<DevicePage>(*dp).unwrap().pins == 0)
    );
    b.check();
}

#[test]
fn expire_misses_a_preparation_past_its_deadline_only() {
    let mut b = bench(|_| {});
    let selected = b.op(1, OpState::Selected, recovery(1));
    let restoring = b.op(2, OpState::Restoring, recovery(1));
    for op in [selected, restoring] {
        b.w.get_mut::<Operation>(op).unwrap().deadline_us = 5;
    }
    b.w.resource_mut::<Clock>().now_us = 10;
    b.run(fence::expire);
    assert_eq!(b.state(selected), OpState::Finishing);
    let outcome = b.w.get::<Operation>(selected).unwrap().outcome;
    assert_eq!(outcome, Some(Outcome::Miss(MissReason::Deadline)));
    assert_eq!(b.state(restoring), OpState::Restoring, "copies drain first");
}

#[test]
fn retire_returns_leases_and_bytes_and_replies() {
    let mut b = bench(|_| {});
    let page = b.resident(0);
    let op = b.op(1, OpState::Finishing, recovery(1));
    b.lease(page, op);
    {
        let mut o = b.w.get_mut::<Operation>(op).unwrap();
        o.outcome = Some(Outcome::Released);
        o.bytes_reserved = BYTES;
    }
    b.w.resource_mut::<Budget>().reserve(BYTES, false);
    b.w.get_mut::<Instance>(b.instance).unwrap().bytes_reserved = BYTES;
    assert!(!b.in_lru(page));
    b.run(fence::retire);
    assert!(b.w.get_entity(op).is_err(), "despawned");
    assert_eq!(b.w.query::<&Lease>().iter(&b.w).count(), 0);
    assert!(b.in_lru(page), "unleased again");
    assert_eq!(b.w.resource::<Budget>().reserved, 0);
    assert_eq!(b.w.get::<Instance>(b.instance).unwrap().bytes_reserved, 0);
    assert_eq!(b.w.resource::<Registry>().operations, 0);
    assert_eq!(
        b.events(),
        vec![Addressed {
            to: ORIGIN,
            event: Event::Released {
                operation: op.to_bits()
            },
            terminal: true,
        }]
    );
    b.check();
}

#[test]
fn a_closed_session_goes_with_its_regions_and_device_pages() {
    let mut b = bench(|_| {});
    let (region, pages) = b.region(4);
    b.w.get_mut::<Session>(b.session).unwrap().closing = true;
    b.run(fence::close_sessions);
    for e in [b.session, region].iter().chain(&pages) {
        assert!(b.w.get_entity(*e).is_err(), "{e:?} is despawned");
    }
    assert_eq!(b.w.resource::<Registry>().sessions, 0);
    let e = b.only_event();
    assert!(matches!(e, Event::SessionClosed { .. }), "{e:?}");
    b.check();
}

/// A bench whose DRAM holds `pages` pages, all resident (0 the oldest):
/// no slot is free, so an allocation's pressure must be met by eviction.
fn full(pages: u64) -> (Bench, Vec<Entity>) {
    let mut b = bench(|c| {
        c.dram.capacity_bytes = pages * BYTES;
        c.dram.extent_bytes = pages * BYTES;
    });
    let resident = (0..pages).map(|i| b.resident(i)).collect();
    assert_eq!(b.w.resource::<Dram>().pool.free_slots(BYTES), 0);
    (b, resident)
}

/// Allocations of `n` pages that fail (a full pool), as a stage records
/// them.
fn short_by(b: &mut Bench, n: u64) {
    for _ in 0..n {
        assert!(b.w.resource_mut::<Dram>().alloc(BYTES).is_none());
    }
}

fn alive(b: &Bench, pages: &[Entity]) -> usize {
    pages.iter().filter(|p| b.w.get_entity(**p).is_ok()).count()
}

#[test]
fn evict_demotes_the_least_recent_unleased_page() {
    let (mut b, pages) = full(4);
    let (old, leased, young) = (pages[0], pages[1], pages[2]);
    let op = b.op(1, OpState::Ready, recovery(1));
    b.lease(leased, op);
    b.w.resource_mut::<Dram>().pressure.insert(BYTES, 2);
    b.run(evict::evict);
    assert!(b.w.get_entity(old).is_err());
    assert!(b.w.get_entity(young).is_err());
    assert!(
        b.w.get_entity(leased).is_ok(),
        "a leased page is never evicted"
    );
    assert!(b.w.get_entity(pages[3]).is_ok(), "the youngest stays");
    let m = b.w.resource::<Metrics>();
    assert_eq!(m.demotions.get("submitted"), Some(&2));
    assert!(b.tier.contains(&key(b.ns, 0)));
    b.check();
}

/// Issue 22, finding 1: slots an in-place demotion gives back earlier in
/// the tick (the fence stage runs before evict) serve the allocation that
/// is still waiting; the tick evicts nothing more for the same shortage.
#[test]
fn evict_counts_slots_freed_earlier_in_the_tick_and_slots_held() {
    let (mut b, pages) = full(8);
    b.tier.set_in_place(Some(50));
    // Tick 1: four slots are missing; four pages go to the tier in place,
    // their slots held until it releases them.
    short_by(&mut b, 4);
    b.run(evict::evict);
    assert_eq!(alive(&b, &pages), 4);
    assert_eq!(b.w.resource::<Dram>().demoting_in(BYTES), 4);
    b.check();
    // Tick 2: still short by four, before the release: the held slots
    // will serve it.
    b.w.resource_mut::<Dram>().evicted.clear();
    short_by(&mut b, 4);
    b.run(evict::evict);
    assert_eq!(
        alive(&b, &pages),
        4,
        "held slots count against the pressure"
    );
    b.check();
    // Tick 3: the allocation fails once more, then the fence sees the tier
    // release the four slots; they are free when evict runs.
    b.w.resource_mut::<Dram>().evicted.clear();
    short_by(&mut b, 4);
    b.w.resource_mut::<Clock>().now_us = 100;
    b.run(fence::land);
    let dram = b.w.resource::<Dram>();
    assert_eq!(
        (dram.demoting_in(BYTES), dram.pool.free_slots(BYTES)),
        (0, 4)
    );
    b.run(evict::evict);
    assert_eq!(
        alive(&b, &pages),
        4,
        "one shortage of four evicts four pages"
    );
    let m = b.w.resource::<Metrics>();
    assert_eq!(m.evictions.values().sum::<u64>(), 4);
    assert_eq!(
        (m.demotions.get("in_place"), m.demotions.get("written")),
        (Some(&4), Some(&4))
    );
    b.check();
}

/// The invariant the fuzzer relies on: eviction beyond what the failed
/// allocations lacked is reported.
#[test]
fn the_invariants_catch_an_eviction_beyond_the_pressure() {
    let (mut b, _) = full(4);
    short_by(&mut b, 1);
    b.run(evict::evict);
    b.check();
    // Evicting one more page than the shortage leaves a slot free for
    // nothing.
    let extra = Evicted {
        pressure: 1,
        pages: 2,
    };
    let victim =
        b.w.resource_mut::<Dram>()
            .lru
            .get_mut(&BYTES)
            .unwrap()
            .pop_oldest()
            .unwrap();
    let page = b.w.get::<Page>(victim).unwrap().clone();
    let mut dram = b.w.resource_mut::<Dram>();
    dram.index.remove(&page.key);
    dram.free(page.residency.dram_slot);
    dram.evicted.insert(BYTES, extra);
    b.w.despawn(victim);
    let v = orbitkv_world::invariants::check(&mut b.w);
    assert_eq!(
        v,
        vec![format!(
            "evicted 2 page(s) of class {BYTES} for a pressure of 1, leaving 2 slot(s) free and 0 held"
        )]
    );
}

#[test]
fn a_restore_of_a_page_altered_since_it_landed_is_a_checksum_miss() {
    let mut b = copy_limited(4, 1);
    let (op, _) = restoring(&mut b);
    // The second page's bytes no longer match the checksum it carries.
    let page = b.page_of_need(op, 1);
    b.w.get_mut::<Page>(page).unwrap().checksum ^= 1;
    b.run(restore::restore);
    b.w.resource_mut::<Clock>().now_us += 100;
    b.run(fence::land);
    let o = b.w.get::<Operation>(op).unwrap().outcome;
    assert_eq!(o, Some(Outcome::Miss(MissReason::Checksum)));
    assert_eq!(b.w.resource::<Metrics>().checksum_failures, 1);
    b.run(fence::retire);
    let events: Vec<Event> = b.events().into_iter().map(|a| a.event).collect();
    assert!(
        matches!(
            &events[..],
            [Event::Miss {
                reason: MissReason::Checksum,
                ..
            }]
        ),
        "{events:?}"
    );
    b.check();
}

#[test]
fn evict_refuses_to_demote_bytes_that_changed_since_they_landed() {
    let (mut b, pages) = full(1);
    let page = pages[0];
    b.w.get_mut::<Page>(page).unwrap().checksum ^= 1;
    b.w.resource_mut::<Dram>().pressure.insert(BYTES, 1);
    b.run(evict::evict);
    assert!(b.w.get_entity(page).is_err(), "evicted either way");
    let m = b.w.resource::<Metrics>();
    assert_eq!(m.demotions.get("checksum"), Some(&1));
    assert_eq!(m.demotions.get("submitted"), None);
    assert!(!b.tier.contains(&key(b.ns, 0)), "never stored");
    b.check();
}

#[test]
#[should_panic(expected = "budget.reserved: returning 1 of 0 held")]
fn returning_bytes_never_reserved_stops_at_the_assertion() {
    Budget::default().release(1, false);
}

#[test]
#[should_panic(expected = "device page pins")]
fn unpinning_an_unpinned_page_stops_at_the_assertion() {
    let mut pins = 0u32;
    decrement(&mut pins, 1, "device page pins");
}
