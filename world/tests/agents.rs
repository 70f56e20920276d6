//! Copy agents: regions an engine process owns, copied by its agent on the
//! runtime's instruction. The runtime never maps them; it sends
//! `AgentCopy` events to the owning origin and waits for `CopyDone`.
//!
//! Most tests run the real in-process agent (`gpu::agent::CopyAgent` on
//! the host copy engine) through the embedded driver; the refusal, loss and
//! deadline tests play the agent by hand so they control when (and
//! whether) a copy is reported.

mod common;

use common::*;
use orbitkv_components::api::{
    AgentDirection, AgentRegion, Command, CommandError, CopyFailure, Event, MissReason, Origin,
    SessionHandle,
};
use orbitkv_gpu::agent::{Chunk, CopyAgent, MemoryKind};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
use orbitkv_world::Config;

/// A page is two runs: 1 KiB of "K" (slots 2 KiB apart, gaps between) and
/// 3 KiB of "V" (back to back), as a layer-split KV cache lays them out.
const K_RUN: u64 = 1024;
const K_STRIDE: u64 = 2048;
const V_RUN: u64 = PAGE_BYTES - K_RUN;
const SLOTS: u32 = 8;

/// Engine-owned KV memory: what the agent copies into and out of.
struct EngineMemory {
    k: Vec<u8>,
    v: Vec<u8>,
}

impl EngineMemory {
    fn new() -> Self {
        EngineMemory {
            k: vec![0xEE; (K_STRIDE * (SLOTS as u64 - 1) + K_RUN) as usize],
            v: vec![0xEE; (V_RUN * SLOTS as u64) as usize],
        }
    }

    fn chunks(&mut self) -> [Chunk; 2] {
        [
            Chunk {
                kind: MemoryKind::Host,
                ptr: self.k.as_mut_ptr() as u64,
                stride: K_STRIDE,
                len: K_RUN,
            },
            Chunk {
                kind: MemoryKind::Host,
                ptr: self.v.as_mut_ptr() as u64,
                stride: V_RUN,
                len: V_RUN,
            },
        ]
    }

    fn write(&mut self, slot: u32, page: &[u8]) {
        let (k, v) = page.split_at(K_RUN as usize);
        let ks = (slot as u64 * K_STRIDE) as usize;
        let vs = (slot as u64 * V_RUN) as usize;
        self.k[ks..ks + k.len()].copy_from_slice(k);
        self.v[vs..vs + v.len()].copy_from_slice(v);
    }

    fn read(&self, slot: u32) -> Vec<u8> {
        let ks = (slot as u64 * K_STRIDE) as usize;
        let vs = (slot as u64 * V_RUN) as usize;
        [
            &self.k[ks..ks + K_RUN as usize],
            &self.v[vs..vs + V_RUN as usize],
        ]
        .concat()
    }
}

fn agent_config() -> Config {
    let mut c = config(4 << 20);
    c.dram.shared = true; // the agent maps the pool read-only
    c.limits.max_staging_bytes = 1 << 20;
    c
}

fn host_agent() -> CopyAgent {
    CopyAgent::new(Box::new(HostCopyEngine::new(HostCopyConfig {
        workers: 2,
        max_in_flight_batches: 8,
        shared_regions: false,
    })))
}

/// A harness with an in-process agent, an instance `m` and a session.
fn with_agent(config: Config) -> (Harness, SessionHandle, orbitkv_components::Namespace) {
    let mut h = Harness::new(config);
    h.d.port.agent = Some(host_agent());
    let ns = h.register("m", [7; 32], dense(), 1)[0];
    let s = h.open("m");
    (h, s, ns)
}

/// Registers `mem` as an agent region of (0, 0); returns its handle.
fn agent_region(h: &mut Harness, s: SessionHandle, mem: &mut EngineMemory) -> u64 {
    let chunks = mem.chunks();
    // SAFETY: `mem` outlives the harness's use of it in every test (it is
    // declared before the harness is dropped, and every copy is fenced).
    let r = unsafe { h.d.agent_region(s, (0, 0), SLOTS, &chunks) }.expect("agent region");
    assert_eq!(r.page_bytes, PAGE_BYTES);
    r.region
}

fn allocs(h: &mut Harness, s: SessionHandle, region: u64, slots: std::ops::Range<u32>) -> Vec<u64> {
    slots.map(|slot| h.alloc(s, region, slot)).collect()
}

/// Saves page `i` of prompt `seed` from `pages[i]` (slot `i`) through the
/// agent; every page is stored. Returns the bytes.
fn save_through_agent(
    h: &mut Harness,
    s: SessionHandle,
    ns: orbitkv_components::Namespace,
    mem: &mut EngineMemory,
    pages: &[u64],
    seed: u64,
) -> Vec<Vec<u8>> {
    let n = pages.len() as u64;
    let bytes: Vec<Vec<u8>> = (0..n).map(|i| payload(&ns, 0, &hash(seed, 0, i))).collect();
    for (slot, b) in bytes.iter().enumerate() {
        mem.write(slot as u32, b);
    }
    let items = (0..n).map(|i| (0, hash(seed, 0, i), pages[i as usize]));
    h.step(vec![publish_cmd(s, seed, 0, items.collect())]);
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(done, Event::PublishDone { inserted, dropped: 0, .. } if inserted == n),
        "{done:?}"
    );
    bytes
}

/// Restores prompt `seed`'s first `targets.len()` pages into `targets`
/// through the agent, every page leased and copied.
fn restore_through_agent(h: &mut Harness, s: SessionHandle, targets: &[u64], seed: u64) {
    let n = targets.len() as u64;
    let q =
        h.d.query(query(s, 100 + seed, seed, &[0], n, n * PAGE + 1, true))
            .expect("query");
    assert_eq!(q.selected, Some(n * PAGE));
    let Event::Ready { leases, .. } = h.d.ready(q.operation).expect("ready") else {
        panic!("not ready");
    };
    assert_eq!(leases.len() as u64, n);
    let targets: Vec<_> = (0..n)
        .map(|i| target(0, 0, (i + 1) * PAGE, targets[i as usize]))
        .collect();
    let done =
        h.d.restore(s, q.operation, targets, vec![])
            .expect("restore");
    assert!(
        matches!(done, Event::RestoreDone { pages, .. } if pages == n),
        "{done:?}"
    );
}

#[test]
fn publish_and_restore_through_the_agent_move_exact_bytes() {
    let mut mem = EngineMemory::new();
    let (mut h, s, ns) = with_agent(agent_config());
    let region = agent_region(&mut h, s, &mut mem);
    let pages = allocs(&mut h, s, region, 0..SLOTS);
    // Save three pages from slots 0..3.
    let bytes = save_through_agent(&mut h, s, ns, &mut mem, &pages[..3], 1);
    h.assert_idle();
    assert_eq!(h.rt().staging_capacity(Origin::EMBEDDED), Some(1 << 20));
    // The agent writes the staging area but cannot resize it under the
    // runtime's reads.
    let staging = std::fs::File::from(h.rt().export_staging(Origin::EMBEDDED).unwrap());
    assert!(staging.set_len(0).is_err() && staging.set_len(2 << 20).is_err());
    // Restore them into slots 5..8 of the same region.
    for slot in 5..8 {
        mem.write(slot, &[0u8; PAGE_BYTES as usize]);
    }
    restore_through_agent(&mut h, s, &pages[5..8], 1);
    for (i, b) in bytes.iter().enumerate() {
        assert_eq!(&mem.read(5 + i as u32), b, "restored page {i}");
    }
    // The slots the engine did not target were not touched.
    assert_eq!(mem.read(4), vec![0xEE; PAGE_BYTES as usize]);
    h.assert_idle();
    let m = h.rt().stats().metrics;
    assert_eq!(m.agent_copies, 2, "one batch each way");
    assert!(m.agent_copy_failures.is_empty(), "{m:?}");
    // Closing the session drops the staging area with it.
    h.step(vec![Command::CloseSession { session: s }]);
    h.until("closed", |e| matches!(e, Event::SessionClosed { .. }));
    assert!(h.rt().export_staging(Origin::EMBEDDED).is_none());
    h.assert_idle();
}

/// An agent's publish is staged in batches of at most a quarter of its
/// staging area, so the agent fills one while the manager moves another
/// into the pool; every page still lands, byte for byte.
#[test]
fn an_agent_publish_is_staged_in_quarters_of_the_staging_area() {
    let mut mem = EngineMemory::new();
    let mut c = agent_config();
    // One extent, 16 pages: a quarter is 4.
    c.limits.max_staging_bytes = c.dram.extent_bytes;
    assert_eq!(c.limits.max_staging_bytes, 16 * PAGE_BYTES);
    let (mut h, s, ns) = with_agent(c);
    let region = agent_region(&mut h, s, &mut mem);
    let pages = allocs(&mut h, s, region, 0..SLOTS);
    let bytes = save_through_agent(&mut h, s, ns, &mut mem, &pages, 3);
    let m = h.rt().stats().metrics;
    assert_eq!(m.agent_copies, 2, "8 pages in batches of 4");
    h.assert_idle();
    // Every page reads back exactly.
    for slot in 0..SLOTS {
        mem.write(slot, &[0u8; PAGE_BYTES as usize]);
    }
    restore_through_agent(&mut h, s, &pages, 3);
    for (i, b) in bytes.iter().enumerate() {
        assert_eq!(&mem.read(i as u32), b, "page {i}");
    }
    h.assert_idle();
}

/// Plays the agent by hand: no agent in the port, so `AgentCopy` events
/// reach the test.
fn manual(config: Config) -> (Harness, SessionHandle, orbitkv_components::Namespace, u64) {
    let mut h = Harness::new(config);
    let ns = h.register("m", [7; 32], dense(), 1)[0];
    let s = h.open("m");
    let e = h.one(Command::RegisterDeviceRegion {
        session: s,
        rank: 0,
        group: 0,
        slots: SLOTS,
        agent: Some(AgentRegion {
            region: 42,
            page_bytes: PAGE_BYTES,
        }),
    });
    let Event::RegionRegistered {
        region,
        engine_region,
        ..
    } = e
    else {
        panic!("{e:?}");
    };
    assert_eq!(engine_region, 42, "the agent's own id is echoed");
    (h, s, ns, region)
}

fn agent_copy(
    h: &mut Harness,
) -> (
    u64,
    AgentDirection,
    Vec<orbitkv_components::api::AgentPageCopy>,
) {
    match h.until("agent copy", |e| matches!(e, Event::AgentCopy { .. })) {
        Event::AgentCopy {
            copy,
            direction,
            pages,
        } => (copy, direction, pages),
        _ => unreachable!(),
    }
}

/// The embedded origin's staging area, mapped writable: the agent's side.
fn staging_map(h: &mut Harness) -> memmap2::MmapMut {
    let fd = h
        .rt()
        .export_staging(Origin::EMBEDDED)
        .expect("staging area");
    unsafe { memmap2::MmapMut::map_mut(&std::fs::File::from(fd)) }.unwrap()
}

/// Plays the agent for a publish copy of one page: writes `bytes` into its
/// staging slot and reports the copy done.
fn land_publish(
    h: &mut Harness,
    copy: u64,
    staged: &orbitkv_components::api::AgentPageCopy,
    bytes: &[u8],
) -> Vec<Event> {
    let mut map = staging_map(h);
    let at = staged.host_offset as usize;
    map[at..at + bytes.len()].copy_from_slice(bytes);
    // The checksum a real agent takes from its own memory as it copies.
    h.step(vec![Command::CopyDone {
        copy,
        failure: None,
        checksums: vec![xxhash_rust::xxh3::xxh3_64(bytes)],
    }])
}

/// Publishes `bytes` as the page of `hash(1, 0, 0)` from `device_page`
/// through a hand-played agent, and waits until it is stored.
fn store_one(h: &mut Harness, s: SessionHandle, request: u64, device_page: u64, bytes: &[u8]) {
    h.step(vec![publish_cmd(
        s,
        request,
        0,
        vec![(0, hash(1, 0, 0), device_page)],
    )]);
    let (copy, _, staged) = agent_copy(h);
    land_publish(h, copy, &staged[0], bytes);
    h.until("publish", |e| {
        matches!(e, Event::PublishDone { inserted: 1, .. })
    });
}

/// Waits for the deferred free of `device_page`, reported with its pin.
fn deferred_free_reported(h: &mut Harness, device_page: u64) {
    let freed = h.until("freed", |e| matches!(e, Event::DevicePageFreed { .. }));
    assert!(
        matches!(
            freed,
            Event::DevicePageFreed { device_page: d, deferred: true, .. } if d == device_page
        ),
        "{freed:?}"
    );
}

fn rejected(events: &[Event]) -> Option<CommandError> {
    events.iter().find_map(|e| match e {
        Event::Rejected { error, .. } => Some(error.clone()),
        _ => None,
    })
}

#[test]
fn copy_reports_are_refused_from_another_origin_or_for_unknown_copies() {
    let (mut h, s, ns, region) = manual(agent_config());
    let page = h.alloc(s, region, 3);
    let publish = publish_cmd(s, 1, 0, vec![(0, hash(1, 0, 0), page)]);
    h.step(vec![publish]);
    let (copy, direction, pages) = agent_copy(&mut h);
    assert_eq!(direction, AgentDirection::RegionToStaging);
    assert_eq!(pages.len(), 1);
    assert_eq!(
        (pages[0].region, pages[0].region_offset, pages[0].len),
        (42, 3 * PAGE_BYTES, PAGE_BYTES)
    );
    let stats = h.rt().stats();
    // Another origin reports it: refused, nothing changes.
    let other = Origin(9);
    let ev = h.step_from(vec![(
        other,
        Command::CopyDone {
            copy,
            failure: None,
            checksums: Vec::new(),
        },
    )]);
    assert!(
        ev.iter().any(|a| a.to == other
            && matches!(
                &a.event,
                Event::Rejected {
                    error: CommandError::NotOwner,
                    ..
                }
            )),
        "{ev:?}"
    );
    // An unknown copy id: refused.
    let ev = h.step(vec![Command::CopyDone {
        copy: copy + 1000,
        failure: None,
        checksums: Vec::new(),
    }]);
    assert_eq!(rejected(&ev), Some(CommandError::UnknownCopy(copy + 1000)));
    let after = h.rt().stats();
    assert_eq!(
        (after.operations, after.transfers, after.pool_bytes_used),
        (stats.operations, stats.transfers, stats.pool_bytes_used)
    );
    // The agent writes the page into its staging slot and reports it.
    let bytes = payload(&ns, 0, &hash(1, 0, 0));
    let ev = land_publish(&mut h, copy, &pages[0], &bytes);
    assert!(rejected(&ev).is_none(), "{ev:?}");
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(done, Event::PublishDone { inserted: 1, .. }),
        "{done:?}"
    );
    // The same report again: the copy is finished.
    let ev = h.step(vec![Command::CopyDone {
        copy,
        failure: None,
        checksums: Vec::new(),
    }]);
    assert_eq!(rejected(&ev), Some(CommandError::UnknownCopy(copy)));
    // The pool holds exactly what the agent staged, under its checksum.
    let q =
        h.d.query(query(s, 2, 1, &[0], 1, PAGE + 1, true))
            .expect("query");
    let Event::Ready { leases, .. } = h.d.ready(q.operation).expect("ready") else {
        panic!();
    };
    let pool = h.rt().export_pool().unwrap();
    let pool = unsafe { memmap2::Mmap::map(&std::fs::File::from(pool)) }.unwrap();
    let off = leases[0].offset as usize;
    assert_eq!(&pool[off..off + bytes.len()], &bytes[..]);
    h.step(vec![Command::Release {
        session: s,
        operation: q.operation,
    }]);
    h.until("released", |e| matches!(e, Event::Released { .. }));
    h.assert_idle();
}

#[test]
fn a_failed_agent_copy_drops_the_publish_and_fails_the_restore() {
    let (mut h, s, ns, region) = manual(agent_config());
    let pages: Vec<u64> = (0..2).map(|slot| h.alloc(s, region, slot)).collect();
    h.step(vec![publish_cmd(
        s,
        1,
        0,
        vec![(0, hash(1, 0, 0), pages[0])],
    )]);
    let (copy, ..) = agent_copy(&mut h);
    let failure = CopyFailure::Executor("device lost".into());
    h.step(vec![Command::CopyDone {
        copy,
        failure: Some(failure),
        checksums: Vec::new(),
    }]);
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(
            done,
            Event::PublishDone {
                inserted: 0,
                dropped: 1,
                ..
            }
        ),
        "{done:?}"
    );
    assert_eq!(
        h.rt().stats().metrics.agent_copy_failures.get("executor"),
        Some(&1)
    );
    h.assert_idle();
    // Now store it for real, then fail the restore's copy.
    let bytes = payload(&ns, 0, &hash(1, 0, 0));
    store_one(&mut h, s, 2, pages[0], &bytes);
    let q =
        h.d.query(query(s, 3, 1, &[0], 1, PAGE + 1, true))
            .expect("query");
    h.d.ready(q.operation).expect("ready");
    h.step(vec![Command::Restore {
        session: s,
        operation: q.operation,
        targets: vec![target(0, 0, PAGE, pages[1])],
        retained: vec![],
    }]);
    let (copy, direction, _) = agent_copy(&mut h);
    assert_eq!(direction, AgentDirection::PoolToRegion);
    assert!(h.rt().stats().leases > 0, "leased until the agent reports");
    h.step(vec![Command::CopyDone {
        copy,
        failure: Some(CopyFailure::OutOfBounds("slot 1".into())),
        checksums: Vec::new(),
    }]);
    let miss = h.until("miss", |e| matches!(e, Event::Miss { .. }));
    assert!(
        matches!(
            miss,
            Event::Miss {
                reason: MissReason::IoError,
                ..
            }
        ),
        "{miss:?}"
    );
    h.assert_idle();
}

#[test]
fn a_lost_agent_fails_its_copies_and_everything_returns() {
    let (mut h, s, ns, region) = manual(agent_config());
    let pages: Vec<u64> = (0..3).map(|slot| h.alloc(s, region, slot)).collect();
    // Store a page, then leave a restore and a publish in flight.
    let bytes = payload(&ns, 0, &hash(1, 0, 0));
    store_one(&mut h, s, 1, pages[0], &bytes);
    let q =
        h.d.query(query(s, 2, 1, &[0], 1, PAGE + 1, true))
            .expect("query");
    h.d.ready(q.operation).expect("ready");
    h.step(vec![
        Command::Restore {
            session: s,
            operation: q.operation,
            targets: vec![target(0, 0, PAGE, pages[1])],
            retained: vec![],
        },
        publish_cmd(s, 3, 0, vec![(0, hash(2, 0, 0), pages[2])]),
    ]);
    let mut sent = 0;
    for _ in 0..10 {
        sent += h
            .advance()
            .iter()
            .filter(|e| matches!(e, Event::AgentCopy { .. }))
            .count();
        if sent >= 1 && h.rt().stats().transfers == 2 {
            break;
        }
    }
    let s1 = h.rt().stats();
    assert_eq!(s1.transfers, 2, "{s1:#?}");
    assert!(s1.leases > 0 && s1.device_pages == 3);
    // The engine process goes away without reporting.
    h.rt().close_origin(Origin::EMBEDDED);
    for _ in 0..5 {
        h.advance();
    }
    let s2 = h.rt().stats();
    assert_eq!(
        (
            s2.operations,
            s2.leases,
            s2.transfers,
            s2.bytes_reserved,
            s2.sessions,
            s2.device_pages
        ),
        (0, 0, 0, 0, 0, 0),
        "{s2:#?}"
    );
    assert_eq!(s2.metrics.agent_copy_failures.get("lost"), Some(&2));
    assert!(
        h.rt().export_staging(Origin::EMBEDDED).is_none(),
        "staging goes with the origin"
    );
    // Only the stored page remains; the lost publish stored nothing.
    assert_eq!(s2.pages, 1);
    h.rt().check_invariants().unwrap();
}

/// Advances until a tick has an event matching `pred`; that tick's events.
fn tick_of(h: &mut Harness, pred: impl Fn(&Event) -> bool) -> Vec<Event> {
    for _ in 0..10_000 {
        let tick = h.advance();
        if tick.iter().any(&pred) {
            return tick;
        }
    }
    panic!("no such event in 10000 ticks");
}

#[test]
fn an_agent_past_its_deadline_fails_the_copy_but_holds_everything_until_it_reports() {
    let mut c = agent_config();
    c.limits.agent_copy_deadline_us = 200;
    let (mut h, s, ns, region) = manual(c);
    let pages: Vec<u64> = (0..2).map(|slot| h.alloc(s, region, slot)).collect();
    // A publish reported late stores nothing, even if the agent says ok.
    h.step(vec![publish_cmd(
        s,
        1,
        0,
        vec![(0, hash(1, 0, 0), pages[0])],
    )]);
    let (copy, _, staged) = agent_copy(&mut h);
    let tick = tick_of(&mut h, |e| matches!(e, Event::TransferOverdue { .. }));
    assert!(
        tick.iter()
            .any(|e| matches!(e, Event::TransferOverdue { kind, .. } if kind == "publish_copy")),
        "{tick:?}"
    );
    // The reply goes out at the deadline, in the same tick: the page the
    // overdue batch was copying counts as dropped.
    assert!(
        tick.iter().any(|e| matches!(
            e,
            Event::PublishDone {
                inserted: 0,
                dropped: 1,
                ..
            }
        )),
        "{tick:?}"
    );
    for _ in 0..5 {
        h.advance();
    }
    let st = h.rt().stats();
    assert_eq!(
        (st.operations, st.transfers),
        (1, 1),
        "held until the agent reports"
    );
    // The engine frees the source meanwhile: deferred, the copy may still read it.
    let ev = h.step(vec![Command::DevicePageFree {
        session: s,
        device_page: pages[0],
    }]);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::DevicePageFreed { .. })),
        "{ev:?}"
    );
    let bytes = payload(&ns, 0, &hash(1, 0, 0));
    let ev = land_publish(&mut h, copy, &staged[0], &bytes);
    // No second reply; the deferred free is reported now.
    assert!(
        !ev.iter().any(|e| matches!(e, Event::PublishDone { .. })),
        "{ev:?}"
    );
    deferred_free_reported(&mut h, pages[0]);
    assert_eq!(h.rt().stats().pages, 0);
    let m = h.rt().stats().metrics;
    assert_eq!(m.agent_copy_failures.get("lost"), Some(&1));
    assert_eq!(
        (m.publish_dropped, m.pages_published),
        (1, 0),
        "counted once"
    );
    h.assert_idle();
}

/// Issue 22, finding 2: a restore whose agent hangs misses (`deadline`) at
/// the agent deadline, not whenever the agent reports (which may be never);
/// its leases, reserved bytes and destination pins stay with the operation
/// until the report, and nothing more is sent then.
#[test]
fn a_hung_agent_restore_misses_at_the_deadline_and_holds_until_it_reports() {
    let mut c = agent_config();
    c.limits.agent_copy_deadline_us = 200;
    let (mut h, s, ns, region) = manual(c);
    let pages: Vec<u64> = (0..2).map(|slot| h.alloc(s, region, slot)).collect();
    let bytes = payload(&ns, 0, &hash(1, 0, 0));
    store_one(&mut h, s, 1, pages[0], &bytes);
    let q =
        h.d.query(query(s, 2, 1, &[0], 1, PAGE + 1, true))
            .expect("query");
    h.d.ready(q.operation).expect("ready");
    h.step(vec![Command::Restore {
        session: s,
        operation: q.operation,
        targets: vec![target(0, 0, PAGE, pages[1])],
        retained: vec![],
    }]);
    let (copy, direction, _) = agent_copy(&mut h);
    assert_eq!(direction, AgentDirection::PoolToRegion);
    let sent_us = h.rt().now_us();
    let tick = tick_of(&mut h, |e| matches!(e, Event::TransferOverdue { .. }));
    let waited = h.rt().now_us() - sent_us;
    assert!(
        (200..200 + 2 * TICK_US).contains(&waited),
        "overdue {waited} µs after the copy was sent"
    );
    let miss = Event::Miss {
        operation: q.operation,
        reason: MissReason::Deadline,
    };
    assert!(tick.contains(&miss), "missed in the same tick: {tick:?}");
    assert_eq!(
        h.rt().stats().metrics.misses.get(&MissReason::Deadline),
        Some(&1)
    );
    for _ in 0..20 {
        h.advance();
    }
    let st = h.rt().stats();
    assert_eq!(
        (st.operations, st.transfers, st.leases, st.bytes_reserved),
        (1, 1, 1, PAGE_BYTES),
        "everything the copy may touch is held until the agent reports"
    );
    // The engine frees the destination meanwhile: deferred.
    let ev = h.step(vec![Command::DevicePageFree {
        session: s,
        device_page: pages[1],
    }]);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::DevicePageFreed { .. })),
        "{ev:?}"
    );
    // The agent reports at last: the operation goes, without a second reply.
    let ev = h.step(vec![Command::CopyDone {
        copy,
        failure: None,
        checksums: Vec::new(),
    }]);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::Miss { .. } | Event::RestoreDone { .. })),
        "{ev:?}"
    );
    deferred_free_reported(&mut h, pages[1]);
    let m = h.rt().stats().metrics;
    assert_eq!(
        m.misses.get(&MissReason::Deadline),
        Some(&1),
        "counted once"
    );
    assert_eq!(m.agent_copy_failures.get("lost"), Some(&1));
    h.assert_idle();
}

#[test]
fn agent_copies_in_flight_per_origin_are_bounded() {
    let mut c = agent_config();
    c.limits.max_agent_copies_per_origin = 1;
    c.limits.max_copy_batch_pages = 1;
    let (mut h, s, ns, region) = manual(c);
    let pages: Vec<u64> = (0..3).map(|slot| h.alloc(s, region, slot)).collect();
    let items = (0..3)
        .map(|i| (0, hash(1, 0, i), pages[i as usize]))
        .collect();
    h.step(vec![publish_cmd(s, 1, 0, items)]);
    let mut map = staging_map(&mut h);
    for i in 0..3u64 {
        let (copy, _, staged) = agent_copy(&mut h);
        assert_eq!(staged.len(), 1, "one page per batch");
        // Only one batch is out at a time.
        for _ in 0..3 {
            assert!(
                !h.advance()
                    .iter()
                    .any(|e| matches!(e, Event::AgentCopy { .. }))
            );
        }
        assert_eq!(h.rt().stats().transfers, 1);
        let bytes = payload(&ns, 0, &hash(1, 0, i));
        let at = staged[0].host_offset as usize;
        map[at..at + bytes.len()].copy_from_slice(&bytes);
        h.step(vec![Command::CopyDone {
            copy,
            failure: None,
            checksums: vec![xxhash_rust::xxh3::xxh3_64(&bytes)],
        }]);
    }
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(done, Event::PublishDone { inserted: 3, .. }),
        "{done:?}"
    );
    h.assert_idle();
}

#[test]
fn agent_regions_are_refused_when_their_pages_do_not_match() {
    let mut h = Harness::new(agent_config());
    h.register("m", [7; 32], dense(), 1);
    let s = h.open("m");
    let ev = h.step(vec![Command::RegisterDeviceRegion {
        session: s,
        rank: 0,
        group: 0,
        slots: 4,
        agent: Some(AgentRegion {
            region: 0,
            page_bytes: PAGE_BYTES - 1,
        }),
    }]);
    assert!(
        matches!(rejected(&ev), Some(CommandError::Invalid(_))),
        "{ev:?}"
    );
    assert!(
        h.rt().export_staging(Origin::EMBEDDED).is_none(),
        "a refusal creates nothing"
    );
    // A report with no copy sent.
    let ev = h.step(vec![Command::CopyDone {
        copy: 1,
        failure: None,
        checksums: Vec::new(),
    }]);
    assert_eq!(rejected(&ev), Some(CommandError::UnknownCopy(1)));
    h.assert_idle();
}

#[test]
fn one_publish_from_a_manager_region_and_an_agent_region_splits_by_executor() {
    let mut mem = EngineMemory::new();
    let (mut h, s, ns) = with_agent(agent_config());
    let agent = agent_region(&mut h, s, &mut mem);
    let (local, engine) = h.region(s, 0, 0, 4);
    let a = h.alloc(s, agent, 0);
    let l = h.alloc(s, local, 0);
    let (ba, bl) = (
        payload(&ns, 0, &hash(1, 0, 0)),
        payload(&ns, 0, &hash(1, 0, 1)),
    );
    mem.write(0, &ba);
    h.write_slot(engine, 0, &bl);
    let publish = publish_cmd(s, 1, 0, vec![(0, hash(1, 0, 0), a), (0, hash(1, 0, 1), l)]);
    h.step(vec![publish]);
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(done, Event::PublishDone { inserted: 2, .. }),
        "{done:?}"
    );
    // Restore both crosswise: the agent's page into the manager region and
    // the other way round.
    let q =
        h.d.query(query(s, 2, 1, &[0], 2, 2 * PAGE + 1, true))
            .expect("query");
    h.d.ready(q.operation).expect("ready");
    let l1 = h.alloc(s, local, 1);
    let a1 = h.alloc(s, agent, 1);
    let targets = vec![target(0, 0, PAGE, l1), target(0, 0, 2 * PAGE, a1)];
    let done =
        h.d.restore(s, q.operation, targets, vec![])
            .expect("restore");
    assert!(
        matches!(done, Event::RestoreDone { pages: 2, .. }),
        "{done:?}"
    );
    assert_eq!(h.read_slot(engine, 1), ba);
    assert_eq!(mem.read(1), bl);
    h.assert_idle();
}

/// Issue 23: a process that could write an engine's staging area between
/// the agent's copy and the manager's copy-in used to get its bytes
/// stored and served under a valid checksum. The agent now reports each
/// page's checksum taken from its own memory; a staged page that differs
/// is refused (typed, counted), never stored, and a publish report with
/// no checksums stores nothing.
#[test]
fn a_staging_slot_rewritten_after_the_agents_copy_is_refused_never_stored() {
    let (mut h, s, ns, region) = manual(agent_config());
    let page = h.alloc(s, region, 0);
    let honest = payload(&ns, 0, &hash(1, 0, 0));
    let forged = vec![0xEE; honest.len()];
    // The agent copies the honest bytes and takes their checksum; the
    // slot is rewritten before the manager copies it in.
    h.step(vec![publish_cmd(s, 1, 0, vec![(0, hash(1, 0, 0), page)])]);
    let (copy, _, staged) = agent_copy(&mut h);
    let mut map = staging_map(&mut h);
    let at = staged[0].host_offset as usize;
    map[at..at + honest.len()].copy_from_slice(&forged);
    h.step(vec![Command::CopyDone {
        copy,
        failure: None,
        checksums: vec![xxhash_rust::xxh3::xxh3_64(&honest)],
    }]);
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(
            done,
            Event::PublishDone {
                inserted: 0,
                dropped: 1,
                ..
            }
        ),
        "{done:?}"
    );
    let m = h.rt().stats().metrics;
    assert_eq!((m.publish_checksum_refused, m.checksum_failures), (1, 1));
    assert_eq!(h.rt().stats().pages, 0, "nothing stored");
    // A report without checksums: refused the same way.
    h.step(vec![publish_cmd(s, 2, 0, vec![(0, hash(1, 0, 0), page)])]);
    let (copy, _, staged) = agent_copy(&mut h);
    let at = staged[0].host_offset as usize;
    map[at..at + honest.len()].copy_from_slice(&honest);
    h.step(vec![Command::CopyDone {
        copy,
        failure: None,
        checksums: Vec::new(),
    }]);
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(
            done,
            Event::PublishDone {
                inserted: 0,
                dropped: 1,
                ..
            }
        ),
        "{done:?}"
    );
    assert_eq!(h.rt().stats().metrics.publish_checksum_refused, 2);
    // The honest report stores the honest bytes, and only they are served.
    store_one(&mut h, s, 3, page, &honest);
    let q =
        h.d.query(query(s, 4, 1, &[0], 1, PAGE + 1, true))
            .expect("query");
    let Event::Ready { leases, .. } = h.d.ready(q.operation).expect("ready") else {
        panic!("the honest page is a hit");
    };
    let pool = h.rt().export_pool().unwrap();
    let pool = unsafe { memmap2::Mmap::map(&std::fs::File::from(pool)) }.unwrap();
    let off = leases[0].offset as usize;
    assert_eq!(&pool[off..off + honest.len()], &honest[..]);
    h.step(vec![Command::Release {
        session: s,
        operation: q.operation,
    }]);
    h.until("released", |e| matches!(e, Event::Released { .. }));
    h.assert_idle();
}
