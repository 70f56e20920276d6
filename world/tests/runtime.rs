//! The runtime end to end on the deterministic harness: exact bytes, typed
//! errors, no leaked leases or reserved bytes.

mod common;

use std::time::Duration;

use common::*;
use orbitkv_components::api::{
    Addressed, Command, CommandError, Event, InvalidCommand, LoadRefusal, MissReason, Origin,
    PagePos, RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_world::Runtime;

const ID_A: [u8; 32] = [0xaa; 32];
const ID_B: [u8; 32] = [0xbb; 32];

struct Dense {
    h: Harness,
    ns: orbitkv_components::Namespace,
    s: orbitkv_components::api::SessionHandle,
    region: u64,
    engine_region: u32,
}

/// One dense instance, one rank, one 64-slot device region.
fn dense_setup(dram: u64) -> Dense {
    dense_setup_with(config(dram))
}

fn dense_setup_with(c: orbitkv_world::Config) -> Dense {
    let mut h = Harness::new(c);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    let (region, engine_region) = h.region(s, 0, 0, 64);
    Dense {
        h,
        ns,
        s,
        region,
        engine_region,
    }
}

impl Dense {
    /// Writes pages `0..n` of prompt `seed` into device slots starting at
    /// `first_slot` and publishes them; returns the device handles.
    fn publish(&mut self, seed: u64, n: u64, first_slot: u32) -> Vec<u64> {
        let mut pages = Vec::new();
        let mut handles = Vec::new();
        for i in 0..n {
            let slot = first_slot + i as u32;
            let dp = self.h.alloc(self.s, self.region, slot);
            let native = hash(seed, 0, i);
            self.h
                .write_slot(self.engine_region, slot, &payload(&self.ns, 0, &native));
            pages.push((0, native, dp));
            handles.push(dp);
        }
        self.h.step(vec![publish_cmd(self.s, seed, 0, pages)]);
        let done = self
            .h
            .until("publish", |e| matches!(e, Event::PublishDone { .. }));
        assert_eq!(
            done,
            Event::PublishDone {
                command: match done {
                    Event::PublishDone { command, .. } => command,
                    _ => 0,
                },
                request: seed,
                inserted: n,
                duplicates: 0,
                dropped: 0
            }
        );
        handles
    }

    fn free(&mut self, handles: &[u64]) {
        for &dp in handles {
            self.h.step(vec![Command::DevicePageFree {
                session: self.s,
                device_page: dp,
            }]);
        }
    }

    /// Query + prepare; returns (operation, Ready event).
    fn prepare(&mut self, seed: u64, pages: u64, prompt_len: u64) -> (u64, Event) {
        let ev = self.h.step(vec![query(
            self.s,
            seed,
            seed,
            &[0],
            pages,
            prompt_len,
            true,
        )]);
        let op = match ev.iter().find(|e| matches!(e, Event::QueryResult { .. })) {
            Some(Event::QueryResult {
                operation,
                miss: None,
                ..
            }) => *operation,
            other => panic!("query: {other:?} in {ev:?}"),
        };
        let ready = match ev.iter().find(|e| matches!(e, Event::Ready { .. })) {
            Some(e) => e.clone(),
            None => self.h.until("ready", |e| {
                matches!(e, Event::Ready { .. } | Event::Miss { .. })
            }),
        };
        (op, ready)
    }

    /// Restores `n` pages into fresh slots from `first_slot`; returns the slots.
    fn restore(&mut self, op: u64, n: u64, first_slot: u32) -> Vec<u32> {
        let mut targets = Vec::new();
        for i in 0..n {
            let slot = first_slot + i as u32;
            let dp = self.h.alloc(self.s, self.region, slot);
            targets.push(target(0, 0, (i + 1) * PAGE, dp));
        }
        self.h.step(vec![Command::Restore {
            session: self.s,
            operation: op,
            targets,
            retained: vec![],
        }]);
        let done = self.h.until("restore", |e| {
            matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
        });
        assert_eq!(
            done,
            Event::RestoreDone {
                operation: op,
                pages: n,
                bytes: n * PAGE_BYTES
            }
        );
        (first_slot..first_slot + n as u32).collect()
    }

    fn assert_restored(&self, seed: u64, slots: &[u32]) {
        for (i, slot) in slots.iter().enumerate() {
            let native = hash(seed, 0, i as u64);
            assert_eq!(
                self.h.read_slot(self.engine_region, *slot),
                payload(&self.ns, 0, &native),
                "page {i}"
            );
        }
    }
}

#[test]
fn publish_query_restore_round_trip_exact_bytes() {
    let mut d = dense_setup(16 << 20);
    let sources = d.publish(1, 4, 0);
    d.free(&sources);
    // A 5-page prompt: 4 pages are cached, and the 5th must be computed.
    let (op, ready) = d.prepare(1, 5, 5 * PAGE);
    match &ready {
        Event::Ready {
            boundary, leases, ..
        } => {
            assert_eq!(*boundary, 4 * PAGE);
            assert_eq!(leases.len(), 4);
        }
        e => panic!("{e:?}"),
    }
    let slots = d.restore(op, 4, 10);
    d.assert_restored(1, &slots);
    d.h.assert_idle();
    let m = d.h.rt().stats().metrics;
    assert_eq!(
        (m.hits, m.hit_tokens, m.bytes_restored),
        (1, 4 * PAGE, 4 * PAGE_BYTES)
    );
}

#[test]
fn final_prompt_token_is_never_restored() {
    let mut d = dense_setup(16 << 20);
    d.publish(2, 4, 0);
    // Prompt of exactly 4 pages: the last page would leave nothing to
    // compute, so the boundary is 3 pages.
    let (op, ready) = d.prepare(2, 4, 4 * PAGE);
    assert!(
        matches!(ready, Event::Ready { boundary, .. } if boundary == 3 * PAGE),
        "{ready:?}"
    );
    d.h.step(vec![Command::Release {
        session: d.s,
        operation: op,
    }]);
    d.h.until("released", |e| matches!(e, Event::Released { .. }));
    d.h.assert_idle();
}

#[test]
fn lower_tier_pages_are_read_then_restored() {
    let mut d = dense_setup(16 << 20);
    for i in 0..6 {
        let native = hash(3, 0, i);
        d.h.tier
            .insert(key(d.ns, 0, native), payload(&d.ns, 0, &native));
    }
    let ev = d.h.step(vec![query(d.s, 3, 3, &[0], 7, 7 * PAGE, true)]);
    assert!(
        ev.iter().any(|e| matches!(e, Event::Loading { .. })),
        "{ev:?}"
    );
    assert_eq!(d.h.rt().stats().metrics.tier_reads, 6);
    let op = match &ev[0] {
        Event::QueryResult {
            operation,
            selected: Some(s),
            ..
        } if *s == 6 * PAGE => *operation,
        e => panic!("{e:?}"),
    };
    let ready = d.h.until("ready", |e| {
        matches!(e, Event::Ready { .. } | Event::Miss { .. })
    });
    assert!(matches!(ready, Event::Ready { .. }), "{ready:?}");
    let slots = d.restore(op, 6, 20);
    d.assert_restored(3, &slots);
    assert_eq!(d.h.rt().stats().pages, 6, "read pages stay cached in DRAM");
    d.h.assert_idle();
}

#[test]
fn reads_per_group_are_bounded() {
    let mut c = config(16 << 20);
    c.limits.max_reads_per_group = 3;
    let mut h = Harness::new(c);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    for i in 0..10 {
        let native = hash(4, 0, i);
        h.tier.insert(key(ns, 0, native), payload(&ns, 0, &native));
    }
    h.step(vec![query(s, 4, 4, &[0], 11, 11 * PAGE, true)]);
    assert_eq!(h.rt().stats().transfers, 3);
    let ready = h.until("ready", |e| matches!(e, Event::Ready { .. }));
    assert!(matches!(ready, Event::Ready { ref leases, .. } if leases.len() == 10));
    assert_eq!(h.rt().stats().metrics.tier_reads, 10);
}

#[test]
fn checksum_mismatch_is_a_miss_and_nothing_is_indexed() {
    let mut d = dense_setup(16 << 20);
    for i in 0..3 {
        let native = hash(5, 0, i);
        d.h.tier
            .insert(key(d.ns, 0, native), payload(&d.ns, 0, &native));
    }
    d.h.tier.corrupt(&key(d.ns, 0, hash(5, 0, 1)));
    d.h.step(vec![query(d.s, 5, 5, &[0], 4, 4 * PAGE, true)]);
    let miss = d.h.until("miss", |e| {
        matches!(e, Event::Miss { .. } | Event::Ready { .. })
    });
    assert!(
        matches!(
            miss,
            Event::Miss {
                reason: MissReason::Checksum,
                ..
            }
        ),
        "{miss:?}"
    );
    assert_eq!(d.h.rt().stats().metrics.checksum_failures, 1);
    assert_eq!(d.h.rt().stats().pages, 2, "only verified pages are indexed");
    d.h.assert_idle();
}

#[test]
fn io_errors_and_pages_lost_mid_read_are_misses() {
    let mut d = dense_setup(16 << 20);
    for i in 0..2 {
        let native = hash(6, 0, i);
        d.h.tier
            .insert(key(d.ns, 0, native), payload(&d.ns, 0, &native));
    }
    d.h.tier.fail_next(1);
    d.h.step(vec![query(d.s, 6, 6, &[0], 3, 3 * PAGE, true)]);
    let e = d.h.until("miss", |e| {
        matches!(e, Event::Miss { .. } | Event::Ready { .. })
    });
    assert!(
        matches!(
            e,
            Event::Miss {
                reason: MissReason::IoError,
                ..
            }
        ),
        "{e:?}"
    );
    d.h.assert_idle();

    let native = hash(7, 0, 0);
    d.h.tier
        .insert(key(d.ns, 0, native), payload(&d.ns, 0, &native));
    d.h.step(vec![query(d.s, 7, 7, &[0], 2, 2 * PAGE, true)]);
    d.h.tier.remove(&key(d.ns, 0, native));
    let e = d.h.until("miss", |e| {
        matches!(e, Event::Miss { .. } | Event::Ready { .. })
    });
    assert!(
        matches!(
            e,
            Event::Miss {
                reason: MissReason::EvictedDuringRead,
                ..
            }
        ),
        "{e:?}"
    );
    d.h.assert_idle();
}

#[test]
fn hybrid_selection_uses_the_rank_common_boundary() {
    let mut h = Harness::new(config(32 << 20));
    let ns = h.register("hybrid", ID_A, hybrid(), 2);
    let s = h.open("hybrid");
    // Both ranks hold full attention and window pages for 8 pages; rank 0
    // holds checkpoints at pages 4 and 6, rank 1 only at page 4.
    for (rank, checkpoints) in [(0u32, vec![4u64, 6]), (1, vec![4])] {
        let nsr = ns[rank as usize];
        for i in 0..8 {
            for g in [0u32, 1] {
                let native = hash(9, g, i);
                h.tier
                    .insert(key(nsr, g, native), payload(&nsr, g, &native));
            }
        }
        for c in checkpoints {
            let native = hash(9, 2, c - 1);
            h.tier
                .insert(key(nsr, 2, native), payload(&nsr, 2, &native));
        }
    }
    let ev = h.step(vec![query(s, 9, 9, &[0, 1, 2], 8, 8 * PAGE + 1, false)]);
    match &ev[0] {
        Event::QueryResult {
            common,
            selected,
            miss: None,
            candidates,
            ..
        } => {
            assert_eq!(common, &vec![4 * PAGE]);
            assert_eq!(*selected, Some(4 * PAGE));
            let cp0 = candidates
                .iter()
                .find(|c| c.rank == 0 && c.group == 2)
                .unwrap();
            assert_eq!(cp0.page_ends, vec![4 * PAGE, 6 * PAGE]);
        }
        e => panic!("{e:?}"),
    }
    let op = match &ev[0] {
        Event::QueryResult { operation, .. } => *operation,
        _ => unreachable!(),
    };
    h.step(vec![Command::Prepare {
        session: s,
        operation: op,
    }]);
    let ready = h.until("ready", |e| {
        matches!(e, Event::Ready { .. } | Event::Miss { .. })
    });
    let Event::Ready { leases, ranges, .. } = ready else {
        panic!("{ready:?}")
    };
    // Per rank: 4 prefix pages + 2 window pages (100 past tokens) + 1 checkpoint.
    assert_eq!(leases.len(), 2 * (4 + 2 + 1));
    assert!(ranges.contains(&(
        1,
        orbitkv_components::RequiredRange {
            group: 1,
            start: 2 * PAGE,
            end: 4 * PAGE
        }
    )));
    assert!(ranges.contains(&(
        0,
        orbitkv_components::RequiredRange {
            group: 2,
            start: 3 * PAGE,
            end: 4 * PAGE
        }
    )));
    // Restore every leased page into its rank/group region, check bytes.
    let mut regions = std::collections::HashMap::new();
    let mut targets = Vec::new();
    let mut expect = Vec::new();
    for l in &leases {
        let (region, engine) = *regions
            .entry((l.pos.rank, l.pos.group))
            .or_insert_with(|| h.region(s, l.pos.rank, l.pos.group, 16));
        let slot = targets
            .iter()
            .filter(|(r, _, _): &&(u64, u32, u64)| r == &region)
            .count() as u32;
        let dp = h.alloc(s, region, slot);
        targets.push((region, slot, dp));
        let nsr = ns[l.pos.rank as usize];
        let native = hash(9, l.pos.group, l.pos.page_end / PAGE - 1);
        expect.push((engine, slot, payload(&nsr, l.pos.group, &native)));
        let _ = l;
    }
    let restore_targets = leases
        .iter()
        .zip(&targets)
        .map(|(l, (_, _, dp))| target(l.pos.rank, l.pos.group, l.pos.page_end, *dp))
        .collect();
    h.step(vec![Command::Restore {
        session: s,
        operation: op,
        targets: restore_targets,
        retained: vec![],
    }]);
    let done = h.until("restore", |e| {
        matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
    });
    assert!(
        matches!(done, Event::RestoreDone { pages: 14, .. }),
        "{done:?}"
    );
    for (engine, slot, bytes) in expect {
        assert_eq!(h.read_slot(engine, slot), bytes);
    }
    h.assert_idle();
}

#[test]
fn missing_checkpoint_on_one_rank_is_incomplete() {
    let mut h = Harness::new(config(32 << 20));
    let ns = h.register("hybrid", ID_A, hybrid(), 2);
    let s = h.open("hybrid");
    for rank in 0..2u32 {
        let nsr = ns[rank as usize];
        for i in 0..4 {
            for g in [0u32, 1] {
                let native = hash(10, g, i);
                h.tier
                    .insert(key(nsr, g, native), payload(&nsr, g, &native));
            }
        }
    }
    let native = hash(10, 2, 3);
    h.tier
        .insert(key(ns[0], 2, native), payload(&ns[0], 2, &native));
    let ev = h.step(vec![query(s, 10, 10, &[0, 1, 2], 4, 4 * PAGE + 1, true)]);
    assert!(
        matches!(
            &ev[0],
            Event::QueryResult {
                selected: None,
                miss: Some(MissReason::IncompleteGroup),
                ..
            }
        ),
        "{ev:?}"
    );
    h.assert_idle();
}

#[test]
fn stale_generation_is_refused_and_nothing_is_copied() {
    let mut d = dense_setup(16 << 20);
    d.publish(11, 2, 0);
    let (op, _) = d.prepare(11, 3, 3 * PAGE);
    let old = d.h.alloc(d.s, d.region, 30);
    let fresh_target = d.h.alloc(d.s, d.region, 31);
    // The engine reuses slot 30: the old handle is freed, a new one issued.
    d.h.step(vec![Command::DevicePageFree {
        session: d.s,
        device_page: old,
    }]);
    let reused = d.h.alloc(d.s, d.region, 30);
    assert_ne!(reused, old, "a reused slot gets a new generation");
    d.h.write_slot(d.engine_region, 30, &[0x77; PAGE_BYTES as usize]);
    d.h.write_slot(d.engine_region, 31, &[0x77; PAGE_BYTES as usize]);
    d.h.step(vec![Command::Restore {
        session: d.s,
        operation: op,
        targets: vec![
            target(0, 0, PAGE, fresh_target),
            target(0, 0, 2 * PAGE, old),
        ],
        retained: vec![],
    }]);
    let e = d.h.until("miss", |e| {
        matches!(e, Event::Miss { .. } | Event::RestoreDone { .. })
    });
    assert!(
        matches!(
            e,
            Event::Miss {
                reason: MissReason::StaleGeneration,
                ..
            }
        ),
        "{e:?}"
    );
    for slot in [30, 31] {
        assert_eq!(
            d.h.read_slot(d.engine_region, slot),
            vec![0x77; PAGE_BYTES as usize],
            "slot {slot} was written"
        );
    }
    d.h.assert_idle();
    // Freeing a stale handle is a typed error too.
    let e = d.h.one(Command::DevicePageFree {
        session: d.s,
        device_page: old,
    });
    assert!(
        matches!(e, Event::Rejected { error: CommandError::StaleGeneration(h), .. } if h == old),
        "{e:?}"
    );
}

#[test]
fn free_while_a_copy_targets_the_page_is_deferred_to_the_fence() {
    let mut h = Harness::with_latency(config(16 << 20), 50, 1000);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    let (region, engine) = h.region(s, 0, 0, 8);
    let src = h.alloc(s, region, 0);
    let native = hash(12, 0, 0);
    h.write_slot(engine, 0, &payload(&ns, 0, &native));
    h.step(vec![publish_cmd(s, 1, 0, vec![(0, native, src)])]);
    // The source is pinned while the publish copy is in flight.
    let ev = h.step(vec![Command::DevicePageFree {
        session: s,
        device_page: src,
    }]);
    assert!(ev.is_empty(), "free must wait for the copy: {ev:?}");
    h.rt().check_invariants().unwrap();
    let mut order = Vec::new();
    for _ in 0..1000 {
        for e in h.advance() {
            match e {
                Event::PublishDone { inserted, .. } => order.push(format!("published {inserted}")),
                Event::DevicePageFreed {
                    device_page,
                    deferred,
                    ..
                } => {
                    assert_eq!((device_page, deferred), (src, true));
                    order.push("freed".into());
                }
                _ => {}
            }
        }
        if order.len() == 2 {
            break;
        }
    }
    assert_eq!(order, ["published 1", "freed"]);
    // Restore targets are pinned the same way.
    let ev = h.step(vec![query(s, 2, 12, &[0], 2, 2 * PAGE, true)]);
    let op = match &ev[0] {
        Event::QueryResult { operation, .. } => *operation,
        e => panic!("{e:?}"),
    };
    let dst = h.alloc(s, region, 5);
    h.step(vec![Command::Restore {
        session: s,
        operation: op,
        targets: vec![target(0, 0, PAGE, dst)],
        retained: vec![],
    }]);
    let free = h
        .rt()
        .submit(
            Origin::EMBEDDED,
            Command::DevicePageFree {
                session: s,
                device_page: dst,
            },
        )
        .unwrap();
    let ev = h.rt().tick();
    assert!(ev.is_empty(), "{ev:?}");
    // The free is answered with the copy's last pin, after the restore's
    // reply, and that answer ends the free command.
    let mut out = Vec::new();
    for _ in 0..1000 {
        out.extend(h.step_from(vec![(Origin::EMBEDDED, Command::AdvanceClock { us: 10 })]));
        if out
            .iter()
            .any(|a| matches!(a.event, Event::DevicePageFreed { .. }))
        {
            break;
        }
    }
    let kinds: Vec<&Event> = out.iter().map(|a| &a.event).collect();
    assert!(
        matches!(
            kinds[..],
            [Event::RestoreDone { pages: 1, .. }, Event::DevicePageFreed { command, device_page, deferred: true }]
                if *command == free && *device_page == dst
        ),
        "{out:?}"
    );
    assert!(out[1].terminal, "{out:?}");
    assert_eq!(h.read_slot(engine, 5), payload(&ns, 0, &native));
    h.assert_idle();
    assert_eq!(h.rt().stats().device_pages, 0);
}

#[test]
fn cancel_mid_read_drains_then_releases() {
    let mut h = Harness::with_latency(config(16 << 20), 500, 20);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    for i in 0..8 {
        let native = hash(13, 0, i);
        h.tier.insert(key(ns, 0, native), payload(&ns, 0, &native));
    }
    let ev = h.step(vec![query(s, 13, 13, &[0], 9, 9 * PAGE, true)]);
    let op = match &ev[0] {
        Event::QueryResult { operation, .. } => *operation,
        e => panic!("{e:?}"),
    };
    assert_eq!(h.rt().stats().transfers, 8);
    let reserved = h.rt().stats().bytes_reserved;
    assert_eq!(reserved, 8 * PAGE_BYTES);
    let ev = h.step(vec![Command::Cancel {
        session: s,
        operation: op,
    }]);
    assert!(ev.is_empty(), "submitted reads must drain first: {ev:?}");
    assert_eq!(
        h.rt().stats().bytes_reserved,
        reserved,
        "bytes stay reserved until the reads land"
    );
    let e = h.until("cancelled", |e| matches!(e, Event::Miss { .. }));
    assert_eq!(
        e,
        Event::Miss {
            operation: op,
            reason: MissReason::Cancelled
        }
    );
    h.assert_idle();
    assert_eq!(
        h.rt().stats().metrics.tier_reads,
        8,
        "no read was started after the cancel"
    );
}

#[test]
fn session_close_mid_read_retires_everything() {
    let mut h = Harness::with_latency(config(16 << 20), 500, 20);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    let (region, engine) = h.region(s, 0, 0, 4);
    h.alloc(s, region, 0);
    for i in 0..4 {
        let native = hash(14, 0, i);
        h.tier.insert(key(ns, 0, native), payload(&ns, 0, &native));
    }
    h.step(vec![query(s, 14, 14, &[0], 5, 5 * PAGE, true)]);
    h.step(vec![Command::CloseSession { session: s }]);
    // Old handles are stale at once.
    let e = h.one(query(s, 15, 14, &[0], 5, 5 * PAGE, true));
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{e:?}"
    );
    h.until("closed", |e| matches!(e, Event::SessionClosed { .. }));
    h.assert_idle();
    let st = h.rt().stats();
    assert_eq!((st.sessions, st.device_pages), (0, 0));
    // The copy engine forgot the session's device region.
    assert!(matches!(
        h.arena.read(engine, 0, 1),
        Err(orbitkv_gpu::CopyError::UnknownRegion(_))
    ));
}

#[test]
fn budget_waits_and_oversized_queries_miss() {
    let mut c = config(16 << 20);
    c.budget.query_budget_bytes = Some(6 * PAGE_BYTES);
    let mut d = {
        let mut h = Harness::new(c);
        let ns = h.register("llama", ID_A, dense(), 1)[0];
        let s = h.open("llama");
        let (region, engine_region) = h.region(s, 0, 0, 64);
        Dense {
            h,
            ns,
            s,
            region,
            engine_region,
        }
    };
    d.publish(20, 4, 0);
    d.publish(21, 4, 4);
    d.publish(22, 8, 8);
    // First recovery holds 4 pages of a 6-page budget.
    let (op1, _) = d.prepare(20, 5, 5 * PAGE);
    assert_eq!(d.h.rt().stats().bytes_reserved, 4 * PAGE_BYTES);
    // The second needs 4 more: it waits (no Ready, no Miss).
    let ev = d.h.step(vec![query(d.s, 21, 21, &[0], 5, 5 * PAGE, true)]);
    let op2 = match &ev[0] {
        Event::QueryResult { operation, .. } => *operation,
        e => panic!("{e:?}"),
    };
    assert_eq!(ev.len(), 1, "{ev:?}");
    for _ in 0..5 {
        assert!(d.h.advance().is_empty());
    }
    // A 7-page recovery can never fit: miss at once.
    let ev = d.h.step(vec![query(d.s, 22, 22, &[0], 8, 8 * PAGE, true)]);
    assert!(
        ev.iter().any(|e| matches!(
            e,
            Event::Miss {
                reason: MissReason::Budget,
                ..
            }
        )),
        "{ev:?}"
    );
    // Finishing the first admits the second.
    d.restore(op1, 4, 40);
    let ready =
        d.h.until("second ready", |e| matches!(e, Event::Ready { .. }));
    assert!(matches!(ready, Event::Ready { operation, .. } if operation == op2));
    d.h.step(vec![Command::Release {
        session: d.s,
        operation: op2,
    }]);
    d.h.until("released", |e| matches!(e, Event::Released { .. }));
    d.h.assert_idle();
    assert_eq!(
        d.h.rt().stats().metrics.misses.get(&MissReason::Budget),
        Some(&1)
    );
}

#[test]
fn speculative_work_is_capped_at_a_quarter() {
    let mut c = config(16 << 20);
    c.budget.query_budget_bytes = Some(8 * PAGE_BYTES);
    let mut h = Harness::new(c);
    let ns = h.register("llama", ID_A, dense(), 1)[0];
    let s = h.open("llama");
    for i in 0..3 {
        let native = hash(23, 0, i);
        h.tier.insert(key(ns, 0, native), payload(&ns, 0, &native));
    }
    let mut q = query(s, 23, 23, &[0], 4, 4 * PAGE, true);
    if let Command::Query { speculative, .. } = &mut q {
        *speculative = true;
    }
    let ev = h.step(vec![q]);
    // 3 pages > 8 / 4 = 2 pages of speculative share.
    assert!(
        ev.iter().any(|e| matches!(
            e,
            Event::Miss {
                reason: MissReason::Budget,
                ..
            }
        )),
        "{ev:?}"
    );
    h.assert_idle();
}

/// A dense setup whose copies go `batch` pages at a time, `in_flight`
/// batches at most, with `pages` pages of prompt `seed` published and a
/// recovery of them ready: (setup, operation).
fn ready_under_copy_limits(
    seed: u64,
    pages: u64,
    (batch, in_flight): (usize, usize),
    tune: impl FnOnce(&mut orbitkv_world::Config),
) -> (Dense, u64) {
    let mut c = config(16 << 20);
    c.limits.max_copy_batch_pages = batch;
    c.limits.max_inflight_copies = in_flight;
    tune(&mut c);
    let mut d = dense_setup_with(c);
    let sources = d.publish(seed, pages, 0);
    d.free(&sources);
    let (op, ready) = d.prepare(seed, pages, pages * PAGE + 1);
    assert!(matches!(ready, Event::Ready { .. }), "{ready:?}");
    (d, op)
}

/// Issue 10, finding 3: a speculative recovery of exactly its share (25%
/// of a 65,536-byte budget = 16,384 bytes = 4 pages) is admitted.
#[test]
fn speculative_share_is_exact() {
    let mut c = config(16 << 20);
    c.budget.query_budget_bytes = Some(65_536);
    let mut d = dense_setup_with(c);
    d.publish(31, 4, 0);
    let mut q = query(d.s, 31, 31, &[0], 4, 4 * PAGE + 1, true);
    if let Command::Query { speculative, .. } = &mut q {
        *speculative = true;
    }
    d.h.step(vec![q]);
    let e = d.h.until("ready", |e| {
        matches!(e, Event::Ready { .. } | Event::Miss { .. })
    });
    let Event::Ready {
        operation, leases, ..
    } = e
    else {
        panic!("4 pages are exactly the speculative share: {e:?}");
    };
    assert_eq!(leases.len(), 4);
    assert_eq!(d.h.rt().stats().bytes_reserved, 16_384);
    d.h.step(vec![Command::Release {
        session: d.s,
        operation,
    }]);
    d.h.assert_idle();
}

/// Issue 10, finding 2: with one page per copy batch and two batches in
/// flight, a 4-page publish and a 4-page restore start in pieces and
/// complete with exact bytes; so does a 2-rank recovery needing more
/// batches than may ever be in flight at once (the shape of a TP=2
/// recovery of 32,769 pages per rank under the default limits).
#[test]
fn jobs_larger_than_the_copy_limits_run_in_pieces() {
    let (mut d, op) = ready_under_copy_limits(32, 4, (1, 2), |_| {});
    let slots = d.restore(op, 4, 10);
    d.assert_restored(32, &slots);
    d.h.assert_idle();

    let mut c = config(16 << 20);
    c.limits.max_copy_batch_pages = 4;
    c.limits.max_inflight_copies = 2;
    let mut h = Harness::new(c);
    let ns = h.register("tp2", ID_A, dense(), 2);
    let s = h.open("tp2");
    let pages = 9u64; // 2 ranks x 9 pages = 6 batches of at most 4
    let mut regions = Vec::new();
    for rank in 0..2u32 {
        for i in 0..pages {
            let native = hash(33, 0, i);
            let nsr = ns[rank as usize];
            h.tier
                .insert(key(nsr, 0, native), payload(&nsr, 0, &native));
        }
        regions.push(h.region(s, rank, 0, pages as u32));
    }
    h.step(vec![query(s, 33, 33, &[0], pages, pages * PAGE + 1, true)]);
    let e = h.until("ready", |e| {
        matches!(e, Event::Ready { .. } | Event::Miss { .. })
    });
    let Event::Ready { operation, .. } = e else {
        panic!("{e:?}");
    };
    let mut targets = Vec::new();
    for (rank, (region, _)) in regions.iter().enumerate() {
        for i in 0..pages {
            let dp = h.alloc(s, *region, i as u32);
            targets.push(target(rank as u32, 0, (i + 1) * PAGE, dp));
        }
    }
    h.step(vec![Command::Restore {
        session: s,
        operation,
        targets,
        retained: vec![],
    }]);
    let done = h.until("restore", |e| {
        matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
    });
    assert_eq!(
        done,
        Event::RestoreDone {
            operation,
            pages: 2 * pages,
            bytes: 2 * pages * PAGE_BYTES
        }
    );
    for (rank, (_, engine_region)) in regions.iter().enumerate() {
        let nsr = ns[rank];
        for i in 0..pages {
            assert_eq!(
                h.read_slot(*engine_region, i as u32),
                payload(&nsr, 0, &hash(33, 0, i)),
                "rank {rank} page {i}"
            );
        }
    }
    h.assert_idle();
}

/// Issue 10, finding 2: an accepted restore has a deadline. Batches still
/// waiting for copy room when it passes are abandoned, the submitted one
/// drains, and the leases, bytes and device pins all return.
#[test]
fn accepted_restore_gives_up_its_unsent_batches_at_its_deadline() {
    let (mut d, op) = ready_under_copy_limits(34, 3, (1, 1), |c| {
        c.limits.restore_deadline_us = 1_000;
    });
    let targets: Vec<u64> = (0..3).map(|i| d.h.alloc(d.s, d.region, 10 + i)).collect();
    d.h.copies.hold(true);
    d.h.step(vec![Command::Restore {
        session: d.s,
        operation: op,
        targets: targets
            .iter()
            .enumerate()
            .map(|(i, dp)| target(0, 0, (i as u64 + 1) * PAGE, *dp))
            .collect(),
        retained: vec![],
    }]);
    assert_eq!(d.h.rt().stats().transfers, 1, "one batch fits");
    d.h.step(vec![Command::AdvanceClock { us: 2_000 }]);
    let s = d.h.rt().stats();
    assert_eq!(
        (s.transfers, s.operations),
        (1, 1),
        "the sent batch still holds"
    );
    assert!(s.leases > 0 && s.bytes_reserved > 0);
    d.h.copies.hold(false);
    let e = d.h.until("miss", |e| {
        matches!(e, Event::Miss { .. } | Event::RestoreDone { .. })
    });
    assert_eq!(
        e,
        Event::Miss {
            operation: op,
            reason: MissReason::Deadline
        }
    );
    // No pin is left: each free takes effect at once.
    for dp in targets {
        let ev = d.h.step(vec![Command::DevicePageFree {
            session: d.s,
            device_page: dp,
        }]);
        assert!(
            matches!(
                ev.as_slice(),
                [Event::DevicePageFreed {
                    device_page,
                    deferred: false,
                    ..
                }] if *device_page == dp
            ),
            "{ev:?}"
        );
    }
    d.h.assert_idle();
}

/// A destination the engine frees while its restore is still copying other
/// batches stays the restore's until the reply: the free is reported after
/// `RestoreDone`, and the slot cannot be reallocated before (a fuzzer
/// finding: with per-batch unpinning the engine reused a slot that the
/// reply then counted as restored).
#[test]
fn a_destination_freed_mid_restore_is_released_after_the_reply() {
    let (mut d, op) = ready_under_copy_limits(35, 2, (1, 1), |_| {});
    let targets: Vec<u64> = (0..2).map(|i| d.h.alloc(d.s, d.region, 10 + i)).collect();
    d.h.step(vec![Command::Restore {
        session: d.s,
        operation: op,
        targets: targets
            .iter()
            .enumerate()
            .map(|(i, dp)| target(0, 0, (i as u64 + 1) * PAGE, *dp))
            .collect(),
        retained: vec![],
    }]);
    // The first batch lands (20 µs), the second is not sent yet: the
    // engine frees the first page at once.
    d.h.advance();
    d.h.advance();
    let ops = d.h.rt().operations();
    assert_eq!(
        (ops.len(), ops[0].state, ops[0].in_flight),
        (1, "restoring", 0)
    );
    let ev = d.h.step(vec![Command::DevicePageFree {
        session: d.s,
        device_page: targets[0],
    }]);
    assert!(ev.is_empty(), "deferred while the restore holds it: {ev:?}");
    assert!(matches!(
        d.h.try_alloc(d.s, d.region, 10),
        Err(CommandError::SlotInUse { slot: 10, .. })
    ));
    let mut order = Vec::new();
    d.h.until("reply and free", |e| {
        matches!(e, Event::DevicePageFreed { .. })
    });
    for e in &d.h.events {
        match e {
            Event::RestoreDone { operation, .. } if *operation == op => order.push("done"),
            Event::DevicePageFreed {
                device_page,
                deferred: true,
                ..
            } if *device_page == targets[0] => order.push("freed"),
            _ => {}
        }
    }
    assert_eq!(order, ["done", "freed"]);
    d.assert_restored(35, &[10, 11]);
    d.h.assert_idle();
}

#[test]
fn preparation_deadline_retires_with_deadline() {
    let mut d = dense_setup(16 << 20);
    d.publish(24, 2, 0);
    let ev = d.h.step(vec![query(d.s, 24, 24, &[0], 3, 3 * PAGE, false)]);
    assert!(matches!(
        &ev[0],
        Event::QueryResult {
            selected: Some(_),
            ..
        }
    ));
    assert_eq!(d.h.rt().stats().operations, 1);
    d.h.step(vec![Command::AdvanceClock { us: 4_999_000 }]);
    assert_eq!(d.h.rt().stats().operations, 1);
    let e = d.h.until("deadline", |e| matches!(e, Event::Miss { .. }));
    assert!(
        matches!(
            e,
            Event::Miss {
                reason: MissReason::Deadline,
                ..
            }
        ),
        "{e:?}"
    );
    d.h.assert_idle();
}

#[test]
fn eviction_skips_leased_pages() {
    // 8 slots of DRAM in total: two 16 KiB extents of 4 KiB slots.
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    c.budget.query_budget_bytes = Some(24 << 10);
    let mut d = {
        let mut h = Harness::new(c);
        let ns = h.register("llama", ID_A, dense(), 1)[0];
        let s = h.open("llama");
        let (region, engine_region) = h.region(s, 0, 0, 64);
        Dense {
            h,
            ns,
            s,
            region,
            engine_region,
        }
    };
    d.publish(30, 4, 0);
    let (op, _) = d.prepare(30, 5, 5 * PAGE); // leases all 4
    d.publish(31, 4, 4); // fills DRAM
    // 4 more pages need room: only seed 31's (unleased) pages may go.
    d.publish(32, 4, 8);
    let st = d.h.rt().stats();
    assert_eq!(st.metrics.evictions.values().sum::<u64>(), 4);
    let slots = d.restore(op, 4, 20);
    d.assert_restored(30, &slots);
    d.h.assert_idle();
    // Seed 31 is gone, seed 32 is present.
    let ev = d.h.step(vec![query(d.s, 31, 31, &[0], 2, 2 * PAGE, false)]);
    assert!(
        matches!(
            &ev[0],
            Event::QueryResult {
                miss: Some(MissReason::NotFound),
                ..
            }
        ),
        "{ev:?}"
    );
    let ev = d.h.step(vec![query(d.s, 32, 32, &[0], 2, 2 * PAGE, false)]);
    assert!(
        matches!(
            &ev[0],
            Event::QueryResult {
                selected: Some(_),
                ..
            }
        ),
        "{ev:?}"
    );
}

#[test]
fn namespace_mismatch_is_never_a_hit() {
    let mut h = Harness::new(config(16 << 20));
    let ns_a = h.register("a", ID_A, dense(), 1)[0];
    let ns_b = h.register("b", ID_B, dense(), 1)[0];
    assert_ne!(ns_a, ns_b);
    let sa = h.open("a");
    let sb = h.open("b");
    for i in 0..4 {
        let native = hash(40, 0, i);
        h.tier
            .insert(key(ns_a, 0, native), payload(&ns_a, 0, &native));
    }
    // Same hashes under another identity: nothing.
    let ev = h.step(vec![query(sb, 1, 40, &[0], 5, 5 * PAGE, true)]);
    assert!(
        matches!(
            &ev[0],
            Event::QueryResult {
                selected: None,
                miss: Some(MissReason::NotFound),
                ..
            }
        ),
        "{ev:?}"
    );
    // The adapter's own namespace disagrees with the registration: miss.
    let mut q = query(sa, 2, 40, &[0], 5, 5 * PAGE, true);
    if let Command::Query {
        expect_namespaces, ..
    } = &mut q
    {
        *expect_namespaces = vec![ns_b];
    }
    let ev = h.step(vec![q]);
    assert!(
        matches!(
            &ev[0],
            Event::QueryResult {
                selected: None,
                miss: Some(MissReason::Namespace),
                ..
            }
        ),
        "{ev:?}"
    );
    h.assert_idle();
    let m = h.rt().stats().metrics;
    assert_eq!(
        (
            m.hits,
            m.misses.get(&MissReason::Namespace),
            m.misses.get(&MissReason::NotFound)
        ),
        (0, Some(&1), Some(&1))
    );
}

/// Attention plus a second group of the given shape.
fn two_groups(second: Rule, kind: ComponentKind) -> Vec<GroupSpec> {
    let mut g = dense();
    g.push(GroupSpec {
        id: 1,
        rule: second,
        components: vec![kind],
    });
    g
}

/// Issue 10, finding 1: the same identity and slots with another group
/// shape (a checkpoint where the other has a sliding window; a window of
/// another size) seal to another namespace, so nothing one wrote can hit
/// for the other.
#[test]
fn group_shape_is_sealed_into_the_namespace() {
    let mut h = Harness::new(config(16 << 20));
    let window =
        |past_tokens| two_groups(Rule::Window { past_tokens }, ComponentKind::SlidingWindowKv);
    let checkpoint = two_groups(Rule::Checkpoint, ComponentKind::RecurrentCheckpoint);
    let ns_w = h.register("w", ID_A, window(100), 1)[0];
    let ns_c = h.register("c", ID_A, checkpoint, 1)[0];
    assert_ne!(ns_w, ns_c);
    // Pages the windowed instance stored: 4 pages of both groups.
    for i in 0..4 {
        for g in [0, 1] {
            let native = hash(50, g, i);
            h.tier
                .insert(key(ns_w, g, native), payload(&ns_w, g, &native));
        }
    }
    let sw = h.open("w");
    let sc = h.open("c");
    // The selected boundary (a hit is released at once) or the miss.
    let selected = |h: &mut Harness, s| {
        let q = query(s, 1, 50, &[0, 1], 4, 4 * PAGE + 1, false);
        match h.step(vec![q]).remove(0) {
            Event::QueryResult {
                selected,
                miss,
                operation,
                ..
            } => {
                if selected.is_some() {
                    h.step(vec![Command::Release {
                        session: s,
                        operation,
                    }]);
                }
                (selected, miss)
            }
            e => panic!("{e:?}"),
        }
    };
    assert_eq!(selected(&mut h, sw), (Some(4 * PAGE), None));
    assert_eq!(
        selected(&mut h, sc),
        (None, Some(MissReason::NotFound)),
        "a checkpoint group must never read window pages"
    );
    // Re-registered with a wider window once its engine is gone: a new
    // instance under a new namespace, and the old pages never hit.
    h.step(vec![Command::CloseSession { session: sw }]);
    let e = h.one(register_cmd("w", ID_A, window(200), 1, &[0, 1]));
    let Event::InstanceRegistered {
        namespaces,
        existing: false,
        ..
    } = e
    else {
        panic!("{e:?}");
    };
    assert_ne!(namespaces[0], ns_w);
    let sw = h.open("w");
    assert_eq!(selected(&mut h, sw), (None, Some(MissReason::NotFound)));
    h.assert_idle();
}

#[test]
fn registration_is_idempotent_and_conflicts_are_typed() {
    let mut h = Harness::new(config(16 << 20));
    let first = h.one(register_cmd("x", ID_A, dense(), 1, &[0]));
    let again = h.one(register_cmd("x", ID_A, dense(), 1, &[0]));
    match (first, again) {
        (
            Event::InstanceRegistered {
                instance: a,
                namespaces: na,
                existing: false,
                ..
            },
            Event::InstanceRegistered {
                instance: b,
                namespaces: nb,
                existing: true,
                ..
            },
        ) => assert_eq!((a, na), (b, nb)),
        other => panic!("{other:?}"),
    }
    // While a session uses it, another computation under the name conflicts.
    let s = h.open("x");
    let e = h.one(register_cmd("x", ID_B, dense(), 1, &[0]));
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::InstanceConflict(_),
                ..
            }
        ),
        "{e:?}"
    );
    // Once its engine is gone, a new identity replaces it (an engine restart
    // with new weights); the old namespace can never hit again.
    h.step(vec![Command::CloseSession { session: s }]);
    let e = h.one(register_cmd("x", ID_B, dense(), 1, &[0]));
    assert!(
        matches!(
            e,
            Event::InstanceRegistered {
                existing: false,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(h.rt().stats().instances, 1);
    let e = h.one(register_cmd("y", ID_A, hybrid(), 1, &[0]));
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::Invalid(InvalidCommand::RankWithoutGroup {
                    tp: 0,
                    pp: 0,
                    group: 1
                }),
                ..
            }
        ),
        "slots missing for groups: {e:?}"
    );
    let e = h.one(Command::OpenSession {
        instance: "nope".into(),
    });
    assert!(matches!(
        e,
        Event::Rejected {
            error: CommandError::UnknownInstance(_),
            ..
        }
    ));
}

#[test]
fn bad_commands_are_typed_errors_without_effect() {
    let mut d = dense_setup(16 << 20);
    d.publish(50, 2, 0);
    let s = d.s;
    let stale = orbitkv_components::api::SessionHandle {
        incarnation: 99,
        ..s
    };
    type Check = fn(&CommandError) -> bool;
    let cases: Vec<(Command, Check)> = vec![
        (query(stale, 1, 50, &[0], 3, 3 * PAGE, true), |e| {
            matches!(e, CommandError::StaleSession)
        }),
        (
            orbitkv_components::api::Command::Query {
                session: s,
                request: 1,
                groups: hashes(50, &[0], 3),
                origin: 10,
                prompt_len: 100,
                expect_namespaces: vec![],
                prepare: false,
                speculative: false,
            },
            |e| {
                matches!(
                    e,
                    CommandError::Invalid(InvalidCommand::Origin {
                        origin: 10,
                        end
                    }) if *end == 3 * PAGE
                )
            },
        ),
        (query(s, 1, 50, &[0, 1], 3, 3 * PAGE, true), |e| {
            matches!(e, CommandError::Invalid(InvalidCommand::QueryGroups { .. }))
        }),
        (
            Command::Prepare {
                session: s,
                operation: 12345,
            },
            |e| matches!(e, CommandError::UnknownOperation(_)),
        ),
        (
            Command::DevicePageAlloc {
                session: s,
                region: d.region,
                slot: 64,
            },
            |e| {
                matches!(
                    e,
                    CommandError::Invalid(InvalidCommand::SlotOutOfRange { slot: 64, .. })
                )
            },
        ),
        (
            Command::DevicePageAlloc {
                session: s,
                region: 999,
                slot: 0,
            },
            |e| matches!(e, CommandError::UnknownRegion(_)),
        ),
        (
            Command::RegisterDeviceRegion {
                session: s,
                rank: 3,
                group: 0,
                slots: 4,
                agent: None,
            },
            |e| {
                matches!(
                    e,
                    CommandError::Invalid(InvalidCommand::UnknownRank { rank: 3 })
                )
            },
        ),
        (publish_cmd(s, 1, 0, vec![(0, hash(1, 0, 0), 4242)]), |e| {
            matches!(e, CommandError::StaleGeneration(_))
        }),
        (publish_cmd(s, 1, 0, vec![]), |e| {
            matches!(e, CommandError::Invalid(InvalidCommand::EmptyPublish))
        }),
    ];
    for (cmd, check) in cases {
        let ev = d.h.step(vec![cmd.clone()]);
        assert_eq!(ev.len(), 1, "{cmd:?} gave {ev:?}");
        let e = ev.into_iter().next().unwrap();
        match e {
            Event::Rejected { error, .. } => assert!(check(&error), "{cmd:?} gave {error:?}"),
            e => panic!("{cmd:?} gave {e:?}"),
        }
    }
    // Slot reuse without a free is refused.
    d.h.alloc(s, d.region, 40);
    let e = d.h.one(Command::DevicePageAlloc {
        session: s,
        region: d.region,
        slot: 40,
    });
    assert!(matches!(
        e,
        Event::Rejected {
            error: CommandError::SlotInUse { slot: 40, .. },
            ..
        }
    ));
    // Restore that does not cover the range exactly is refused; the
    // operation stays ready and can be restored properly.
    let (op, _) = d.prepare(50, 3, 3 * PAGE);
    let dp = d.h.alloc(s, d.region, 41);
    let e = d.h.one(Command::Restore {
        session: s,
        operation: op,
        targets: vec![target(0, 0, PAGE, dp)],
        retained: vec![],
    });
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::LoadInvalid(LoadRefusal::Missing { .. }),
                ..
            }
        ),
        "{e:?}"
    );
    let e = d.h.one(Command::Restore {
        session: s,
        operation: op,
        targets: vec![target(0, 0, PAGE, dp)],
        retained: vec![
            PagePos {
                rank: 0,
                group: 0,
                page_end: PAGE,
            },
            PagePos {
                rank: 0,
                group: 0,
                page_end: 2 * PAGE,
            },
        ],
    });
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::LoadInvalid(LoadRefusal::Overlap { .. }),
                ..
            }
        ),
        "overlap: {e:?}"
    );
    // Retaining page 1 and transferring page 2 is an exact cover.
    d.h.step(vec![Command::Restore {
        session: s,
        operation: op,
        targets: vec![target(0, 0, 2 * PAGE, dp)],
        retained: vec![PagePos {
            rank: 0,
            group: 0,
            page_end: PAGE,
        }],
    }]);
    let done = d.h.until("restore", |e| {
        matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
    });
    assert!(
        matches!(done, Event::RestoreDone { pages: 1, .. }),
        "{done:?}"
    );
    d.h.assert_idle();
}

#[test]
fn manager_restart_makes_old_sessions_stale() {
    let mut c = config(16 << 20);
    c.incarnation = 1;
    let mut h = Harness::new(c.clone());
    h.register("llama", ID_A, dense(), 1);
    let s = h.open("llama");
    c.incarnation = 2;
    let mut h2 = Harness::new(c);
    h2.register("llama", ID_A, dense(), 1);
    let e = h2.one(query(s, 1, 1, &[0], 2, 2 * PAGE, false));
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{e:?}"
    );
    let s2 = h2.open("llama");
    assert_eq!(s2.incarnation, 2);
}

#[test]
fn wall_clock_runtime_runs_with_host_engine() {
    let mut c = config(16 << 20);
    c.dram.first_touch = true;
    let mut rt = Runtime::new(c).unwrap();
    assert!(rt.first_touch().is_some_and(|r| r.bytes == 16 << 20));
    rt.submit(Origin::EMBEDDED, Command::AdvanceClock { us: 5 })
        .unwrap();
    let ev = common::embedded(rt.tick());
    assert!(
        matches!(
            &ev[0],
            Event::Rejected {
                error: CommandError::WallClock,
                ..
            }
        ),
        "{ev:?}"
    );
}

/// On a wall clock, `wait_io` sleeps until the host engine's copy lands
/// and the next tick finds it; it answers `false` at once when a command
/// waits in the inbox or nothing is in flight.
#[test]
fn wait_io_sleeps_until_the_host_engines_copy_lands() {
    use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
    use orbitkv_world::Backends;
    use orbitkv_world::driver::{Driver, Embedded, register_command};
    let engine = HostCopyEngine::new(HostCopyConfig::default());
    let arena = engine.arena();
    let rt = Runtime::with_backends(
        config(16 << 20),
        Backends {
            copy: Box::new(engine),
            tiers: Vec::new(),
            simulated_clock: false,
        },
    )
    .unwrap();
    let mut d = Driver::new(Embedded::new(rt, Origin::EMBEDDED, None));
    let ns = d
        .register(register_command("w", ID_A, dense(), 1, PAGE, PAGE_BYTES))
        .unwrap()[0];
    let s = d.open("w").unwrap();
    let region = d.region(s, (0, 0), 4).unwrap();
    let dp = d.alloc(s, region.region, 0).unwrap();
    let native = hash(61, 0, 0);
    let bytes = payload(&ns, 0, &native);
    arena.write(region.engine_region, 0, &bytes).unwrap();
    let rt = &mut d.port.rt;
    assert!(!rt.wait_io(Duration::from_secs(5)), "nothing in flight");
    rt.submit(
        Origin::EMBEDDED,
        Command::Publish {
            session: s,
            request: 1,
            pages: vec![orbitkv_components::api::PublishPage {
                rank: 0,
                group: 0,
                hash: native,
                device_page: dp,
            }],
        },
    )
    .unwrap();
    assert!(!rt.wait_io(Duration::from_secs(5)), "a command waits");
    // The copy may land within the tick that starts it; if it did not,
    // `wait_io` returns when it lands and the next tick reports it.
    // Bounded: a lost completion fails the test instead of hanging it.
    let mut done = None;
    for _ in 0..100 {
        let ev = common::embedded(rt.tick());
        if let Some(e) = ev
            .into_iter()
            .find(|e| matches!(e, Event::PublishDone { .. }))
        {
            done = Some(e);
            break;
        }
        // The copy is still in flight (else the next tick reports it).
        if rt.stats().transfers == 1 {
            assert!(rt.wait_io(Duration::from_secs(5)), "the copy landed");
        }
    }
    assert!(
        matches!(done, Some(Event::PublishDone { inserted: 1, .. })),
        "{done:?}"
    );
    assert_eq!(rt.stats().transfers, 0);
    assert!(!rt.wait_io(Duration::from_secs(5)), "nothing in flight");
}

#[test]
fn multi_rank_publish_pins_every_source_until_one_reply() {
    let mut c = config(16 << 20);
    c.limits.max_copy_batch_pages = 1;
    let mut h = Harness::new(c);
    let ns = h.register("tp2", ID_A, dense(), 2);
    let s = h.open("tp2");
    let mut pages = Vec::new();
    let mut sources = Vec::new();
    for rank in 0..2u32 {
        let (region, engine) = h.region(s, rank, 0, 4);
        let dp = h.alloc(s, region, 0);
        let native = hash(60, 0, 0);
        h.write_slot(engine, 0, &payload(&ns[rank as usize], 0, &native));
        pages.push(orbitkv_components::api::PublishPage {
            rank,
            group: 0,
            hash: native,
            device_page: dp,
        });
        sources.push(dp);
    }
    h.step(vec![Command::Publish {
        session: s,
        request: 7,
        pages,
    }]);
    assert_eq!(h.rt().stats().transfers, 2, "one copy per rank");
    // Rank 0's worker frees its block while rank 1's copy may still run.
    let ev = h.step(vec![Command::DevicePageFree {
        session: s,
        device_page: sources[0],
    }]);
    assert!(ev.is_empty(), "{ev:?}");
    let done = h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    assert!(
        matches!(
            done,
            Event::PublishDone {
                request: 7,
                inserted: 2,
                ..
            }
        ),
        "{done:?}"
    );
    let tail: Vec<&Event> = h.events.iter().rev().take(2).collect();
    assert!(
        matches!(
            tail[0],
            Event::DevicePageFreed {
                device_page,
                deferred: true,
                ..
            } if *device_page == sources[0]
        ),
        "freed after the reply: {tail:?}"
    );
    h.assert_idle();
    assert_eq!(h.rt().stats().pages, 2);
}

#[test]
fn a_lost_copy_completion_is_reported_but_ownership_stays_held() {
    let mut c = config(16 << 20);
    c.limits.transfer_timeout_us = 1_000;
    let mut d = {
        let mut h = Harness::new(c);
        let ns = h.register("llama", ID_A, dense(), 1)[0];
        let s = h.open("llama");
        let (region, engine_region) = h.region(s, 0, 0, 64);
        Dense {
            h,
            ns,
            s,
            region,
            engine_region,
        }
    };
    d.publish(70, 2, 0);
    let (op, _) = d.prepare(70, 3, 3 * PAGE);
    let a = d.h.alloc(d.s, d.region, 20);
    let b = d.h.alloc(d.s, d.region, 21);
    d.h.copies.lose_next(1);
    d.h.step(vec![Command::Restore {
        session: d.s,
        operation: op,
        targets: vec![target(0, 0, PAGE, a), target(0, 0, 2 * PAGE, b)],
        retained: vec![],
    }]);
    let e =
        d.h.until("overdue", |e| matches!(e, Event::TransferOverdue { .. }));
    assert_eq!(
        e,
        Event::TransferOverdue {
            operation: op,
            kind: "restore_copy".into()
        }
    );
    // The engine frees the destination; the free waits, the leases stay.
    let ev = d.h.step(vec![Command::DevicePageFree {
        session: d.s,
        device_page: a,
    }]);
    assert!(ev.is_empty(), "{ev:?}");
    for _ in 0..100 {
        d.h.advance();
    }
    let st = d.h.rt().stats();
    assert_eq!(
        (st.leases, st.transfers, st.bytes_reserved),
        (2, 1, 2 * PAGE_BYTES)
    );
    assert_eq!(st.metrics.transfers_overdue, 1);
    // The slot cannot be reused while the lost copy might still write it.
    let e = d.h.one(Command::DevicePageAlloc {
        session: d.s,
        region: d.region,
        slot: 20,
    });
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::SlotInUse { slot: 20, .. },
                ..
            }
        ),
        "{e:?}"
    );
    d.h.rt().check_invariants().unwrap();
}

#[test]
fn a_page_larger_than_a_dram_extent_is_refused_at_registration() {
    // config() makes 64 KiB extents: a 128 KiB page could never be stored,
    // so registering it is an error that says what to raise.
    let mut h = Harness::new(config(16 << 20));
    let big = orbitkv_world::driver::register_command("big", ID_A, dense(), 1, 16, 128 << 10);
    let e = h.one(big);
    assert_eq!(
        e,
        Event::Rejected {
            command: match &e {
                Event::Rejected { command, .. } => *command,
                other => panic!("{other:?}"),
            },
            error: CommandError::Invalid(InvalidCommand::PageExceedsExtent {
                group: 0,
                page_bytes: 128 << 10,
                extent_bytes: 64 << 10,
            }),
        }
    );
    assert_eq!(h.rt().stats().instances, 0);
    // One extent exactly is fine.
    let fits = orbitkv_world::driver::register_command("fits", ID_A, dense(), 1, 16, 64 << 10);
    assert!(matches!(h.one(fits), Event::InstanceRegistered { .. }));
}

fn lookup(s: SessionHandle, request: u64, seed: u64, pages: u64, prompt_len: u64) -> Command {
    Command::Lookup {
        session: s,
        request,
        groups: hashes(seed, &[0], pages),
        origin: 0,
        prompt_len,
        expect_namespaces: Vec::new(),
    }
}

#[test]
fn a_lookup_ends_with_its_result_and_leaves_nothing_to_release() {
    let mut d = dense_setup(16 << 20);
    d.publish(60, 4, 0);
    // A hit: the boundary below the last prompt token, and the result is
    // the operation's last word (terminal); nothing stays behind.
    let out = d.h.step_from(vec![(
        Origin::EMBEDDED,
        lookup(d.s, 7, 60, 4, 4 * PAGE + 1),
    )]);
    let (op, terminal) = match out.as_slice() {
        [
            Addressed {
                event:
                    Event::QueryResult {
                        operation,
                        request: 7,
                        selected: Some(sel),
                        miss: None,
                        ..
                    },
                terminal,
                ..
            },
        ] if *sel == 4 * PAGE => (*operation, *terminal),
        other => panic!("lookup: {other:?}"),
    };
    assert!(terminal, "a lookup's result ends it");
    // Answered at ingest: it never had an operation.
    assert_eq!(op, 0);
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases, st.bytes_reserved), (0, 0, 0));
    // Nothing more is addressed to it, and it cannot be released or
    // prepared: it is gone.
    for _ in 0..3 {
        assert_eq!(d.h.step(vec![]), vec![]);
    }
    let ev = d.h.step(vec![Command::Release {
        session: d.s,
        operation: op,
    }]);
    assert!(
        matches!(
            ev.as_slice(),
            [Event::Rejected {
                error: CommandError::UnknownOperation(_),
                ..
            }]
        ),
        "{ev:?}"
    );
    // A miss ends it the same way.
    let out = d.h.step_from(vec![(
        Origin::EMBEDDED,
        lookup(d.s, 8, 61, 4, 4 * PAGE + 1),
    )]);
    assert!(
        matches!(
            out.as_slice(),
            [Addressed {
                event: Event::QueryResult {
                    miss: Some(MissReason::NotFound),
                    ..
                },
                terminal: true,
                ..
            }]
        ),
        "{out:?}"
    );
    // A query without prepare still waits for its release: not terminal.
    let out = d.h.step_from(vec![(
        Origin::EMBEDDED,
        query(d.s, 9, 60, &[0], 4, 4 * PAGE + 1, false),
    )]);
    assert!(
        matches!(
            out.as_slice(),
            [Addressed {
                event: Event::QueryResult { miss: None, .. },
                terminal: false,
                ..
            }]
        ),
        "{out:?}"
    );
    assert_eq!(d.h.rt().stats().operations, 1);
    let m = d.h.rt().stats().metrics;
    assert_eq!(m.queries, 3);
    // Counted as a query's are: every hashed token, and the miss's reason.
    assert_eq!(m.queried_tokens, 3 * 4 * PAGE);
    assert_eq!(m.misses.get(&MissReason::NotFound), Some(&1));
}

#[test]
fn a_lookup_sees_the_commands_before_it_in_its_tick() {
    let mut d = dense_setup(16 << 20);
    d.publish(60, 4, 0);
    // Answered where it stands among the tick's commands: the lookup
    // before the namespace is cleared finds the prefix, the one after it
    // finds nothing, and a query sent between them (answered at the
    // validate stage, after every command) misses too.
    let clear = Command::Clear {
        namespaces: vec![d.ns],
    };
    let out = d.h.step_from(vec![
        (Origin::EMBEDDED, lookup(d.s, 1, 60, 4, 4 * PAGE + 1)),
        (
            Origin::EMBEDDED,
            query(d.s, 2, 60, &[0], 4, 4 * PAGE + 1, false),
        ),
        (Origin::EMBEDDED, clear),
        (Origin::EMBEDDED, lookup(d.s, 3, 60, 4, 4 * PAGE + 1)),
    ]);
    let results: Vec<(u64, Option<u64>)> = out
        .iter()
        .filter_map(|a| match &a.event {
            Event::QueryResult {
                request, selected, ..
            } => Some((*request, *selected)),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        vec![(1, Some(4 * PAGE)), (3, None), (2, None)],
        "{out:?}"
    );
}

#[test]
fn a_lookup_with_nothing_queued_is_answered_between_ticks_as_a_tick_would() {
    use orbitkv_world::Answer;
    let mut d = dense_setup(16 << 20);
    d.publish(60, 4, 0);
    let now = std::time::Instant::now();
    // The same lookup, by a tick and between ticks: the same answer (but
    // for the command's id), terminal, and counted the same.
    let asked = lookup(d.s, 1, 60, 4, 4 * PAGE + 1);
    let ticked = d.h.step_from(vec![(Origin::EMBEDDED, asked.clone())]);
    let before = d.h.rt().stats().metrics;
    let (id, now_events) = match d.h.rt().answer_now(Origin::EMBEDDED, asked.clone(), now) {
        Answer::Now(id, events) => (id, events),
        Answer::Queue(c) => panic!("queued: {c:?}"),
    };
    let after = d.h.rt().stats().metrics;
    assert_eq!(after.queries, before.queries + 1);
    assert_eq!(after.queried_tokens, before.queried_tokens + 4 * PAGE);
    let strip = |out: &[Addressed]| -> Vec<(Origin, Event, bool)> {
        out.iter()
            .map(|a| {
                let mut e = a.event.clone();
                if let Event::QueryResult { command, .. } = &mut e {
                    *command = 0;
                }
                (a.to, e, a.terminal)
            })
            .collect()
    };
    assert_eq!(strip(&now_events), strip(&ticked));
    assert!(
        matches!(
            now_events.as_slice(),
            [Addressed { event: Event::QueryResult { command, selected: Some(s), .. }, terminal: true, .. }]
                if *command == id && *s == 4 * PAGE
        ),
        "{now_events:?}"
    );
    // A refused lookup: its typed refusal, at once.
    let mut bad = asked.clone();
    if let Command::Lookup { groups, .. } = &mut bad {
        groups.clear();
    }
    match d.h.rt().answer_now(Origin::EMBEDDED, bad, now) {
        Answer::Now(id, events) => assert!(
            matches!(
                events.as_slice(),
                [Addressed { event: Event::Rejected { command, error: CommandError::Invalid(_) }, terminal: true, .. }]
                    if *command == id
            ),
            "{events:?}"
        ),
        Answer::Queue(c) => panic!("queued: {c:?}"),
    }
    // Queued instead: any other command; a lookup behind a queued command
    // (arrival order); a lookup while a trace is recorded.
    let q = query(d.s, 2, 60, &[0], 4, 4 * PAGE + 1, false);
    assert!(matches!(
        d.h.rt().answer_now(Origin::EMBEDDED, q.clone(), now),
        Answer::Queue(Command::Query { .. })
    ));
    d.h.rt().submit(Origin::EMBEDDED, q).unwrap();
    assert!(matches!(
        d.h.rt().answer_now(Origin::EMBEDDED, asked.clone(), now),
        Answer::Queue(Command::Lookup { .. })
    ));
    assert_eq!(d.h.rt().inbox_len(), 1, "nothing was taken from the inbox");
    d.h.rt().tick();
    d.h.rt().record(Box::new(std::io::sink()), 1_000).unwrap();
    assert!(matches!(
        d.h.rt().answer_now(Origin::EMBEDDED, asked.clone(), now),
        Answer::Queue(Command::Lookup { .. })
    ));
    d.h.rt().stop_recording().unwrap();
    assert!(matches!(
        d.h.rt().answer_now(Origin::EMBEDDED, asked, now),
        Answer::Now(..)
    ));
}

/// The parts of a `Load` plan a test may edit before it is sent.
type Plan<'a> = &'a mut dyn FnMut(&mut Vec<u32>, &mut Vec<RestoreTarget>, &mut Vec<PagePos>);

/// A `Load` of pages `0..pages` of prompt `seed` into slots from
/// `first_slot` (every page named), as an engine sends it, after `edit`.
fn load_with(d: &mut Dense, seed: u64, pages: u64, first_slot: u32, edit: Plan) -> Command {
    let mut targets = (0..pages)
        .map(|i| {
            let dp = d.h.alloc(d.s, d.region, first_slot + i as u32);
            orbitkv_world::driver::target(0, 0, (i + 1) * PAGE, dp)
        })
        .collect();
    let (mut ranks, mut retained) = (vec![0], Vec::new());
    edit(&mut ranks, &mut targets, &mut retained);
    Command::Load {
        session: d.s,
        request: seed,
        groups: hashes(seed, &[0], pages),
        origin: 0,
        prompt_len: pages * PAGE + 1,
        expect_namespaces: Vec::new(),
        ranks,
        targets,
        retained,
        handoff: None,
    }
}

fn load_cmd(d: &mut Dense, seed: u64, pages: u64, first_slot: u32) -> Command {
    load_with(d, seed, pages, first_slot, &mut |_, _, _| {})
}

/// Ticks until the load's last word (terminal); returns every event it got.
fn load_events(d: &mut Dense, load: Command) -> Vec<Addressed> {
    let mut out = d.h.step_from(vec![(Origin::EMBEDDED, load)]);
    for _ in 0..1000 {
        if out.iter().any(|a| a.terminal) {
            return out;
        }
        out.extend(d.h.step_from(vec![(
            Origin::EMBEDDED,
            Command::AdvanceClock { us: 1_000 },
        )]));
    }
    panic!("a load never ended: {out:?}");
}

#[test]
fn a_load_restores_exact_bytes_in_one_round_trip() {
    let mut d = dense_setup(16 << 20);
    let sources = d.publish(70, 4, 0);
    d.free(&sources);
    let load = load_cmd(&mut d, 70, 4, 10);
    let out = load_events(&mut d, load);
    // The result, the leases, then the restore's end: one command, and the
    // only event that ends it is the last.
    let kinds: Vec<(&str, bool)> = out
        .iter()
        .map(|a| {
            let kind = match a.event {
                Event::QueryResult { .. } => "query_result",
                Event::Loading { .. } => "loading",
                Event::Ready { .. } => "ready",
                Event::RestoreDone { .. } => "restore_done",
                _ => "other",
            };
            (kind, a.terminal)
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("query_result", false),
            ("ready", false),
            ("restore_done", true)
        ],
        "{out:?}"
    );
    assert!(matches!(
        out[2].event,
        Event::RestoreDone {
            pages: 4,
            bytes,
            ..
        } if bytes == 4 * PAGE_BYTES
    ));
    d.assert_restored(70, &[10, 11, 12, 13]);
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases, st.bytes_reserved), (0, 0, 0));
    d.h.rt().check_invariants().unwrap();
}

#[test]
fn a_load_restores_only_the_boundary_the_runtime_selected() {
    let mut d = dense_setup(16 << 20);
    // Three of four pages are stored: the engine names four destinations,
    // the runtime selects three pages and copies only those.
    let sources = d.publish(71, 3, 0);
    d.free(&sources);
    let load = load_cmd(&mut d, 71, 4, 20);
    let out = load_events(&mut d, load);
    assert!(
        out.iter().any(|a| matches!(
            a.event,
            Event::QueryResult {
                selected: Some(s),
                ..
            } if s == 3 * PAGE
        )),
        "{out:?}"
    );
    assert!(
        matches!(
            out.last().map(|a| &a.event),
            Some(Event::RestoreDone { pages: 3, .. })
        ),
        "{out:?}"
    );
    d.assert_restored(71, &[20, 21, 22]);
    assert_eq!(
        d.h.read_slot(d.engine_region, 23),
        vec![0; PAGE_BYTES as usize]
    );
    d.h.rt().check_invariants().unwrap();
}

#[test]
fn a_load_that_does_not_cover_its_range_is_refused_and_copies_nothing() {
    let mut d = dense_setup(16 << 20);
    let sources = d.publish(72, 4, 0);
    d.free(&sources);
    // The second page has neither a destination nor the engine's word.
    let load = load_with(&mut d, 72, 4, 30, &mut |_, t, _| {
        t.remove(1);
    });
    let out = load_events(&mut d, load);
    match out.last() {
        Some(Addressed {
            event:
                Event::Rejected {
                    error: CommandError::LoadInvalid(LoadRefusal::Missing { .. }),
                    ..
                },
            terminal: true,
            ..
        }) => {}
        other => panic!("{other:?} in {out:?}"),
    }
    assert_eq!(out.iter().filter(|a| a.terminal).count(), 1, "{out:?}");
    // Counted with the refusals, under its command and reason.
    let refusals = d.h.rt().stats().metrics.refusals;
    assert_eq!(refusals.get("load.load_invalid"), Some(&1), "{refusals:?}");
    for slot in [30, 32, 33] {
        assert_eq!(
            d.h.read_slot(d.engine_region, slot),
            vec![0; PAGE_BYTES as usize]
        );
    }
    // Nothing is left behind, and no late reply follows.
    for _ in 0..3 {
        assert_eq!(d.h.step(vec![]), vec![]);
    }
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases, st.bytes_reserved), (0, 0, 0));
    d.h.rt().check_invariants().unwrap();
}

#[test]
fn a_bad_load_plan_is_refused_before_anything_runs() {
    let mut d = dense_setup(16 << 20);
    d.publish(73, 2, 0);
    type Edit = Box<dyn FnMut(&mut Vec<u32>, &mut Vec<RestoreTarget>, &mut Vec<PagePos>)>;
    let pos = |page_end| PagePos {
        rank: 0,
        group: 0,
        page_end,
    };
    let cases: Vec<(&str, Edit, CommandError)> = vec![
        (
            "unknown rank",
            Box::new(|r, _, _| r.push(5)),
            CommandError::Invalid(InvalidCommand::UnknownRank { rank: 5 }),
        ),
        (
            "rank twice",
            Box::new(|r, _, _| r.push(0)),
            CommandError::Invalid(InvalidCommand::DuplicateRank),
        ),
        (
            "a target of a rank the load does not name",
            Box::new(|r, _, _| r.clear()),
            CommandError::Invalid(InvalidCommand::UnknownRank { rank: 0 }),
        ),
        (
            "a page past the hashes",
            Box::new(move |_, _, k| k.push(pos(3 * PAGE))),
            CommandError::Invalid(InvalidCommand::NoHash { page_end: 3 * PAGE }),
        ),
        (
            "a misaligned page",
            Box::new(move |_, _, k| k.push(pos(PAGE + 1))),
            CommandError::Invalid(InvalidCommand::NoHash { page_end: PAGE + 1 }),
        ),
        (
            "an unknown group",
            Box::new(|_, t, _| t[0].pos.group = 9),
            CommandError::Invalid(InvalidCommand::UnknownGroup { group: 9 }),
        ),
    ];
    for (i, (what, mut edit, want)) in cases.into_iter().enumerate() {
        let load = load_with(&mut d, 73, 2, 40 + 2 * i as u32, &mut *edit);
        match d.h.one(load) {
            Event::Rejected { error, .. } => assert_eq!(error, want, "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        let st = d.h.rt().stats();
        assert_eq!((st.operations, st.leases), (0, 0), "{what}");
    }
    // A destination twice.
    let mut twice = 0;
    let load = load_with(&mut d, 73, 2, 60, &mut |_, t, _| {
        twice = t[0].device_page;
        t[1].device_page = twice;
    });
    let e = d.h.one(load);
    assert!(
        matches!(
            &e,
            Event::Rejected {
                error: CommandError::Invalid(InvalidCommand::DuplicateTarget { device_page }),
                ..
            } if *device_page == twice
        ),
        "{e:?}"
    );
    // Another session's destination.
    let s2 = d.h.open("llama");
    let (region2, _) = d.h.region(s2, 0, 0, 8);
    let theirs = d.h.alloc(s2, region2, 0);
    let load = load_with(&mut d, 73, 2, 62, &mut |_, t, _| t[0].device_page = theirs);
    let e = d.h.one(load);
    assert!(
        matches!(
            e,
            Event::Rejected {
                error: CommandError::NotOwner,
                ..
            }
        ),
        "{e:?}"
    );
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases), (0, 0));
    d.h.rt().check_invariants().unwrap();
}

/// Submits `cmd` from the embedded origin and ticks (advancing the clock)
/// until an event of it is terminal; asserts that exactly one is, that it
/// is the last addressed, and that nothing more comes. Returns the events.
fn ends_once(d: &mut Dense, cmd: Command) -> Vec<Addressed> {
    let kind = cmd.kind();
    let mut out = d.h.step_from(vec![(Origin::EMBEDDED, cmd)]);
    for _ in 0..1000 {
        if out.iter().any(|a| a.terminal) {
            break;
        }
        out.extend(d.h.step_from(vec![(
            Origin::EMBEDDED,
            Command::AdvanceClock { us: 1_000 },
        )]));
    }
    let ends: Vec<usize> = (0..out.len()).filter(|&i| out[i].terminal).collect();
    assert_eq!(ends.len(), 1, "{kind}: one terminal event: {out:?}");
    assert_eq!(
        ends[0],
        out.len() - 1,
        "{kind}: the terminal event is the last: {out:?}"
    );
    for _ in 0..3 {
        let more = d.h.step_from(vec![(
            Origin::EMBEDDED,
            Command::AdvanceClock { us: 1_000 },
        )]);
        assert!(more.is_empty(), "{kind}: after its end: {more:?}");
    }
    out
}

/// One event, not terminal: the operation goes on.
fn goes_on(d: &mut Dense, cmd: Command) -> Event {
    let kind = cmd.kind();
    match d.h.step_from(vec![(Origin::EMBEDDED, cmd)]).as_slice() {
        [
            Addressed {
                event,
                terminal: false,
                ..
            },
        ] => event.clone(),
        other => panic!("{kind}: {other:?}"),
    }
}

fn operation_of(e: &Event) -> u64 {
    e.operation()
        .unwrap_or_else(|| panic!("an operation's event: {e:?}"))
}

#[test]
fn every_command_that_is_answered_ends_with_exactly_one_terminal_event() {
    let mut d = dense_setup(16 << 20);
    let (s, region, ns) = (d.s, d.region, d.ns);
    // register_instance, open_session, register_device_region.
    let reg = register_cmd("other", ID_B, dense(), 1, &[0]);
    ends_once(&mut d, reg);
    let out = ends_once(
        &mut d,
        Command::OpenSession {
            instance: "other".into(),
        },
    );
    let other = match &out[..] {
        [
            Addressed {
                event: Event::SessionOpened { session, .. },
                ..
            },
        ] => *session,
        o => panic!("{o:?}"),
    };
    ends_once(
        &mut d,
        Command::RegisterDeviceRegion {
            session: other,
            rank: 0,
            group: 0,
            slots: 4,
            agent: None,
        },
    );
    // device_page_alloc.
    let out = ends_once(
        &mut d,
        Command::DevicePageAlloc {
            session: s,
            region,
            slot: 40,
        },
    );
    assert!(matches!(
        out[..],
        [Addressed {
            event: Event::DevicePageAllocated { .. },
            ..
        }]
    ));
    // publish (its copies run, then its one reply).
    let pages: Vec<(u32, orbitkv_components::NativeHash, u64)> = (0..4)
        .map(|i| {
            let dp = d.h.alloc(s, d.region, i as u32);
            let native = hash(70, 0, i);
            d.h.write_slot(d.engine_region, i as u32, &payload(&d.ns, 0, &native));
            (0, native, dp)
        })
        .collect();
    let targets: Vec<RestoreTarget> = (0..4u64)
        .map(|i| {
            let dp = d.h.alloc(s, d.region, 8 + i as u32);
            orbitkv_world::driver::target(0, 0, (i + 1) * PAGE, dp)
        })
        .collect();
    let out = ends_once(&mut d, publish_cmd(s, 70, 0, pages));
    assert!(matches!(
        out.last().map(|a| &a.event),
        Some(Event::PublishDone { .. })
    ));
    // lookup: its result, hit or miss.
    ends_once(&mut d, lookup(s, 1, 70, 4, 4 * PAGE + 1));
    ends_once(&mut d, lookup(s, 2, 71, 4, 4 * PAGE + 1));
    // query: a miss ends it; a hit goes on until release.
    ends_once(&mut d, query(s, 3, 71, &[0], 4, 4 * PAGE + 1, false));
    let op = operation_of(&goes_on(
        &mut d,
        query(s, 4, 70, &[0], 4, 4 * PAGE + 1, false),
    ));
    let out = ends_once(
        &mut d,
        Command::Release {
            session: s,
            operation: op,
        },
    );
    assert!(matches!(
        out[..],
        [Addressed {
            event: Event::Released { .. },
            ..
        }]
    ));
    // query, then prepare: ready goes on; restore ends it.
    let op = operation_of(&goes_on(
        &mut d,
        query(s, 5, 70, &[0], 4, 4 * PAGE + 1, false),
    ));
    let mut ready = d.h.step_from(vec![(
        Origin::EMBEDDED,
        Command::Prepare {
            session: s,
            operation: op,
        },
    )]);
    for _ in 0..1000 {
        if ready.iter().any(|a| matches!(a.event, Event::Ready { .. })) {
            break;
        }
        ready.extend(d.h.step_from(vec![(
            Origin::EMBEDDED,
            Command::AdvanceClock { us: 1_000 },
        )]));
    }
    assert!(
        ready.iter().all(|a| !a.terminal),
        "prepare goes on: {ready:?}"
    );
    let out = ends_once(
        &mut d,
        Command::Restore {
            session: s,
            operation: op,
            targets: targets.clone(),
            retained: vec![],
        },
    );
    assert!(matches!(
        out.last().map(|a| &a.event),
        Some(Event::RestoreDone { .. })
    ));
    // query with prepare, then cancel: ends with its release.
    let leased = d.h.step_from(vec![(
        Origin::EMBEDDED,
        query(s, 6, 70, &[0], 4, 4 * PAGE + 1, true),
    )]);
    assert!(
        matches!(
            &leased[..],
            [
                Addressed {
                    event: Event::QueryResult { .. },
                    terminal: false,
                    ..
                },
                Addressed {
                    event: Event::Ready { .. },
                    terminal: false,
                    ..
                }
            ]
        ),
        "{leased:?}"
    );
    let op = operation_of(&leased[0].event);
    ends_once(
        &mut d,
        Command::Cancel {
            session: s,
            operation: op,
        },
    );
    // load: query, lease, copies and its last word in one command.
    let load = load_cmd(&mut d, 70, 4, 16);
    let out = ends_once(&mut d, load);
    assert!(matches!(
        out.last().map(|a| &a.event),
        Some(Event::RestoreDone { .. })
    ));
    // clear.
    ends_once(
        &mut d,
        Command::Clear {
            namespaces: vec![ns],
        },
    );
    // A refusal of any kind is its command's one terminal reply.
    let out = ends_once(
        &mut d,
        Command::Release {
            session: s,
            operation: 1 << 40,
        },
    );
    assert!(matches!(
        out[..],
        [Addressed {
            event: Event::Rejected { .. },
            ..
        }]
    ));
    // device_page_free: its `DevicePageFreed` names it (a free deferred by
    // a copy's pin is answered with the last pin, terminal too: see
    // `restore_then_free_during_copy_defers`).
    let dp = d.h.alloc(s, region, 41);
    let out = ends_once(
        &mut d,
        Command::DevicePageFree {
            session: s,
            device_page: dp,
        },
    );
    assert!(
        matches!(
            &out[..],
            [Addressed {
                event: Event::DevicePageFreed { device_page, deferred: false, .. },
                ..
            }] if *device_page == dp
        ),
        "{out:?}"
    );
    // close_session: its `SessionClosed` names it.
    let out = ends_once(&mut d, Command::CloseSession { session: other });
    assert!(
        matches!(
            out[..],
            [Addressed {
                event: Event::SessionClosed {
                    command: Some(_),
                    ..
                },
                ..
            }]
        ),
        "{out:?}"
    );
    // Not here: advance_clock has no reply; copy_done answers an
    // `AgentCopy` and its operation's terminal event is the load's or
    // publish's (tests/agent*.rs).
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases), (0, 0), "{st:?}");
}

#[test]
fn a_prefix_too_short_to_be_worth_loading_misses_with_its_reason_and_holds_nothing() {
    let mut c = config(16 << 20);
    c.restore.min_load_tokens = 3 * PAGE;
    let mut d = dense_setup_with(c);
    let s = d.s;
    d.publish(80, 4, 0);
    d.publish(81, 2, 8);
    // Two pages found: fewer tokens than the bound, a miss (lookup and
    // query alike), nothing selected.
    for cmd in [
        lookup(s, 1, 81, 2, 2 * PAGE + 1),
        query(s, 2, 81, &[0], 2, 2 * PAGE + 1, true),
    ] {
        let out = d.h.step_from(vec![(Origin::EMBEDDED, cmd)]);
        assert!(
            matches!(
                out.as_slice(),
                [Addressed {
                    event: Event::QueryResult {
                        selected: None,
                        miss: Some(MissReason::NotWorthLoading),
                        ..
                    },
                    terminal: true,
                    ..
                }]
            ),
            "{out:?}"
        );
    }
    // Four pages: worth it, a hit.
    let out =
        d.h.step_from(vec![(Origin::EMBEDDED, lookup(s, 3, 80, 4, 4 * PAGE + 1))]);
    assert!(
        matches!(
            out.as_slice(),
            [Addressed {
                event: Event::QueryResult {
                    selected: Some(b),
                    miss: None,
                    ..
                },
                ..
            }] if *b == 4 * PAGE
        ),
        "{out:?}"
    );
    // What counts is what the load adds: with two pages already held, the
    // other two are not worth it either; a load of them misses, nothing
    // copied into its targets.
    let mut held = lookup(s, 4, 80, 4, 4 * PAGE + 1);
    if let Command::Lookup { origin, .. } = &mut held {
        *origin = 2 * PAGE;
    }
    let out = d.h.step_from(vec![(Origin::EMBEDDED, held)]);
    assert!(
        matches!(
            out.as_slice(),
            [Addressed {
                event: Event::QueryResult {
                    miss: Some(MissReason::NotWorthLoading),
                    ..
                },
                ..
            }]
        ),
        "{out:?}"
    );
    let load = load_cmd(&mut d, 81, 2, 20);
    let out = load_events(&mut d, load);
    assert!(
        matches!(
            out.last().map(|a| &a.event),
            Some(Event::QueryResult {
                miss: Some(MissReason::NotWorthLoading),
                ..
            })
        ),
        "{out:?}"
    );
    for slot in 20..22 {
        assert!(d.h.read_slot(d.engine_region, slot).iter().all(|&b| b == 0));
    }
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases, st.bytes_reserved), (0, 0, 0));
    assert_eq!(
        st.metrics.misses.get(&MissReason::NotWorthLoading),
        Some(&4)
    );
}

#[test]
fn a_load_slower_than_recomputing_misses_once_its_sources_are_measured_and_never_before() {
    // Recomputing is nearly free at this rate: a measured load is slower.
    let mut c = config(16 << 20);
    c.restore.prefill_tokens_per_s = 1_000_000_000;
    let mut d = dense_setup_with(c);
    let s = d.s;
    d.publish(90, 4, 0);
    let device_periods = |d: &mut Dense| d.h.rt().load_rates()[0].periods;
    // The device copies are not measured yet: loads go ahead (a hit is
    // never refused on a guess), and each one measures them.
    let mut round = 0;
    while device_periods(&mut d) < 3 {
        assert!(round < 3, "three loads measure three busy periods");
        let load = load_cmd(&mut d, 90, 4, 16 + 4 * round);
        let out = load_events(&mut d, load);
        assert!(
            matches!(
                out.last().map(|a| &a.event),
                Some(Event::RestoreDone { pages: 4, .. })
            ),
            "round {round}: {out:?}"
        );
        round += 1;
    }
    let rates = d.h.rt().load_rates();
    assert_eq!(rates[0].source, "device");
    assert!(rates[0].bytes_per_second > 0, "{rates:?}");
    assert_eq!(
        (rates[1].source.as_str(), rates[1].periods),
        ("sim", 0),
        "{rates:?}"
    );
    // Measured now: 256 tokens recompute in well under a microsecond here,
    // the copies take longer. A miss with its reason, nothing held.
    let out =
        d.h.step_from(vec![(Origin::EMBEDDED, lookup(s, 9, 90, 4, 4 * PAGE + 1))]);
    assert!(
        matches!(
            out.as_slice(),
            [Addressed {
                event: Event::QueryResult {
                    miss: Some(MissReason::NotWorthLoading),
                    ..
                },
                ..
            }]
        ),
        "{out:?}"
    );
    // A prefix only the lower tier holds: its reads are not measured, so
    // the gate does not judge it; it loads.
    for i in 0..4 {
        let native = hash(91, 0, i);
        d.h.tier
            .insert(key(d.ns, 0, native), payload(&d.ns, 0, &native));
    }
    let load = load_cmd(&mut d, 91, 4, 40);
    let out = load_events(&mut d, load);
    assert!(
        matches!(
            out.last().map(|a| &a.event),
            Some(Event::RestoreDone { pages: 4, .. })
        ),
        "{out:?}"
    );
    assert_eq!(d.h.rt().load_rates()[1].periods, 1, "its read was measured");
    let st = d.h.rt().stats();
    assert_eq!((st.operations, st.leases, st.bytes_reserved), (0, 0, 0));
    assert_eq!(
        st.metrics.misses.get(&MissReason::NotWorthLoading),
        Some(&1)
    );
}

#[test]
fn a_load_faster_than_recomputing_hits_after_its_sources_are_measured() {
    // A slow prefill (1000 tokens/s: 256 ms for the prefix): loading wins.
    let mut c = config(16 << 20);
    c.restore.prefill_tokens_per_s = 1_000;
    let mut d = dense_setup_with(c);
    d.publish(92, 4, 0);
    for round in 0..5u32 {
        let load = load_cmd(&mut d, 92, 4, 16 + 4 * round);
        let out = load_events(&mut d, load);
        assert!(
            matches!(
                out.last().map(|a| &a.event),
                Some(Event::RestoreDone { pages: 4, .. })
            ),
            "round {round}: {out:?}"
        );
    }
    assert!(d.h.rt().load_rates()[0].periods >= 3);
    let st = d.h.rt().stats();
    assert_eq!(st.metrics.misses.get(&MissReason::NotWorthLoading), None);
}

/// The page journal behind the manager's event stream: every page DRAM
/// gains or loses, in order, with why it left; nothing while it is off;
/// a loss past the cap said, never hidden.
#[test]
fn page_changes_follow_the_index_in_order() {
    use orbitkv_components::StateKey;
    use orbitkv_world::{PageChange, Removal};
    // 8 slots of DRAM: a third prompt of 4 pages evicts the first.
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    let mut d = dense_setup_with(c);
    let key = |ns, seed, i| StateKey::new(ns, 0, hash(seed, 0, i).as_bytes()).unwrap();
    let mut out = Vec::new();
    d.publish(30, 1, 0);
    assert!(!d.h.rt().take_page_changes(&mut out));
    assert!(out.is_empty(), "recorded while off: {out:?}");

    d.h.rt().record_page_changes(1024);
    d.publish(31, 4, 4);
    d.publish(32, 3, 8);
    d.publish(33, 4, 12);
    assert!(!d.h.rt().take_page_changes(&mut out));
    // Replayed onto a set, the changes end where the index ends, and
    // never store a stored key or remove an absent one.
    let mut held: std::collections::BTreeSet<StateKey> = [key(d.ns, 30, 0)].into();
    let mut removed = Vec::new();
    for c in &out {
        match *c {
            PageChange::Stored(k) => assert!(held.insert(k), "stored twice: {k:?}"),
            PageChange::Removed(k, why) => {
                assert_eq!(why, Removal::Evicted);
                assert!(held.remove(&k), "removed but not held: {k:?}");
                removed.push(k);
            }
        }
    }
    let stored: Vec<_> = out
        .iter()
        .filter_map(|c| match c {
            PageChange::Stored(k) => Some(*k),
            _ => None,
        })
        .collect();
    let mut want: Vec<StateKey> = (0..4).map(|i| key(d.ns, 31, i)).collect();
    want.extend((0..3).map(|i| key(d.ns, 32, i)));
    want.extend((0..4).map(|i| key(d.ns, 33, i)));
    assert_eq!(stored, want);
    // The least recent went: seed 30's page, then seed 31's first three.
    let mut gone = vec![key(d.ns, 30, 0)];
    gone.extend((0..3).map(|i| key(d.ns, 31, i)));
    assert_eq!(removed, gone);
    assert_eq!(held.len(), d.h.rt().stats().pages);

    // A clear removes what is left, said as cleared.
    out.clear();
    d.h.step(vec![Command::Clear {
        namespaces: vec![d.ns],
    }]);
    assert!(!d.h.rt().take_page_changes(&mut out));
    let mut cleared: Vec<StateKey> = out
        .iter()
        .map(|c| match *c {
            PageChange::Removed(k, Removal::Cleared) => k,
            other => panic!("a clear changed {other:?}"),
        })
        .collect();
    cleared.sort();
    assert_eq!(cleared, held.into_iter().collect::<Vec<_>>());
    assert_eq!(d.h.rt().stats().pages, 0);

    // Past the cap the changes are dropped and the drain says so.
    out.clear();
    d.h.rt().record_page_changes(2);
    d.publish(34, 4, 16);
    assert!(d.h.rt().take_page_changes(&mut out), "a loss went unsaid");
    // What DRAM holds now is listed again, once.
    let mut listed: Vec<_> = out
        .iter()
        .map(|c| match *c {
            PageChange::Stored(k) => k,
            other => panic!("after a loss only stores are listed: {other:?}"),
        })
        .collect();
    listed.sort();
    let mut expect: Vec<_> = (0..4).map(|i| key(d.ns, 34, i)).collect();
    expect.sort();
    assert_eq!(listed, expect);
    out.clear();
    assert!(!d.h.rt().take_page_changes(&mut out), "a loss is said once");
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a_query_stopped_by_a_page_removed_since_it_was_advertised_is_counted_as_a_race() {
    // 8 slots of DRAM, the event journal on.
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    let mut d = dense_setup_with(c);
    d.h.rt().record_page_changes(1024);
    d.h.rt().count_event_races();
    let races = |d: &mut Dense| d.h.rt().stats().metrics.event_races;
    d.publish(40, 4, 0);
    // Stored and there: a hit, no race.
    let ev = d.h.step(vec![lookup(d.s, 1, 40, 4, 4 * PAGE + 1)]);
    assert!(
        matches!(
            ev[0],
            Event::QueryResult {
                selected: Some(_),
                ..
            }
        ),
        "{ev:?}"
    );
    // Never stored: a miss, but no race either.
    d.h.step(vec![lookup(d.s, 2, 41, 4, 4 * PAGE + 1)]);
    assert_eq!(races(&mut d), 0);
    // Two more prompts evict the first: a query for it stops at a page
    // that was advertised and is gone, once per query.
    d.publish(42, 4, 4);
    d.publish(43, 4, 8);
    let ev = d.h.step(vec![lookup(d.s, 3, 40, 4, 4 * PAGE + 1)]);
    assert!(
        matches!(ev[0], Event::QueryResult { selected: None, .. }),
        "{ev:?}"
    );
    assert_eq!(races(&mut d), 1);
    // Stored again: no longer a race when it is there.
    d.publish(40, 4, 12);
    d.h.step(vec![lookup(d.s, 4, 40, 4, 4 * PAGE + 1)]);
    assert_eq!(races(&mut d), 1);
}

#[test]
fn a_journal_read_only_to_mirror_the_index_counts_no_races() {
    // The manager's presence filter drains the journal but advertises
    // nothing: a query stopped by an evicted page is no race then.
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    let mut d = dense_setup_with(c);
    d.h.rt().record_page_changes(1024);
    d.publish(40, 4, 0);
    d.publish(42, 4, 4);
    d.publish(43, 4, 8);
    let ev = d.h.step(vec![lookup(d.s, 3, 40, 4, 4 * PAGE + 1)]);
    assert!(
        matches!(ev[0], Event::QueryResult { selected: None, .. }),
        "{ev:?}"
    );
    assert_eq!(d.h.rt().stats().metrics.event_races, 0);
    let mut out = Vec::new();
    assert!(!d.h.rt().take_page_changes(&mut out));
    assert!(
        out.iter()
            .any(|c| matches!(c, orbitkv_world::PageChange::Removed(..))),
        "the evictions are still recorded: {out:?}"
    );
}

// P/D handoffs -------------------------------------------------------------

/// Eight 4 KiB DRAM slots, one dense instance.
fn small_dense() -> Dense {
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    c.budget.query_budget_bytes = Some(24 << 10);
    c.budget.handoff_bytes = Some(24 << 10);
    dense_setup_with(c)
}

/// Publishes pages `range` of prompt `seed` from slots `first_slot..`
/// and frees the sources once done.
fn publish_pages(d: &mut Dense, seed: u64, range: std::ops::Range<u64>, first_slot: u32) {
    let mut pages = Vec::new();
    for (k, i) in range.enumerate() {
        let slot = first_slot + k as u32;
        let dp = d.h.alloc(d.s, d.region, slot);
        let native = hash(seed, 0, i);
        d.h.write_slot(d.engine_region, slot, &payload(&d.ns, 0, &native));
        pages.push((0, native, dp));
    }
    let sources: Vec<u64> = pages.iter().map(|p| p.2).collect();
    d.h.step(vec![publish_cmd(d.s, seed, 0, pages)]);
    d.h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    d.free(&sources);
}

fn hold_cmd(d: &Dense, handoff: u64, seed: u64, pages: u64, deadline_ms: u64) -> Command {
    Command::Hold {
        session: d.s,
        handoff,
        groups: hashes(seed, &[0], pages),
        deadline_ms,
    }
}

/// Loads pages `0..pages` of prompt `seed` into slots from `first_slot`,
/// naming `handoff`; asserts every page was restored.
fn load_taking(d: &mut Dense, seed: u64, pages: u64, first_slot: u32, handoff: u64) {
    let mut load = load_cmd(d, seed, pages, first_slot);
    if let Command::Load { handoff: h, .. } = &mut load {
        *h = Some(handoff);
    }
    let events = load_events(d, load);
    assert!(
        events
            .iter()
            .any(|a| matches!(a.event, Event::RestoreDone { pages: p, .. } if p == pages)),
        "{events:?}"
    );
}

fn found_pages(d: &mut Dense, seed: u64, pages: u64) -> usize {
    match d.h.one(Command::Lookup {
        session: d.s,
        request: seed,
        groups: hashes(seed, &[0], pages),
        origin: 0,
        prompt_len: pages * PAGE + 1,
        expect_namespaces: Vec::new(),
    }) {
        Event::QueryResult { candidates, .. } => candidates[0].page_ends.len(),
        other => panic!("lookup: {other:?}"),
    }
}

#[test]
fn a_handoff_pins_its_pages_as_they_land_until_the_load_naming_it_took_them() {
    let mut d = small_dense();
    publish_pages(&mut d, 40, 0..2, 0);
    // The producer promises 4 pages; 2 are in DRAM already.
    let held = d.h.one(hold_cmd(&d, 0xfeed, 40, 4, 10_000));
    assert!(
        matches!(
            held,
            Event::Held { handoff: 0xfeed, promised: 4, pinned: 2, bytes, .. } if bytes == 4 * PAGE_BYTES
        ),
        "{held:?}"
    );
    // Another request shares the first two pages: its own promise.
    d.h.one(hold_cmd(&d, 0xbeef, 40, 2, 10_000));
    // The other two land after the promise, and are pinned as they do.
    publish_pages(&mut d, 40, 2..4, 2);
    let st = d.h.rt().stats();
    assert_eq!(
        (st.handoffs.standing, st.handoffs.pinned_pages, st.leases),
        (2, 6, 6)
    );
    assert_eq!(st.handoffs.counts.pinned_late, 2);
    assert_eq!(st.handoffs.reserved_bytes, 6 * PAGE_BYTES);
    // Eight slots, four pinned: two more prompts of four pages evict only
    // each other, never a promised page.
    publish_pages(&mut d, 41, 0..4, 8);
    publish_pages(&mut d, 42, 0..4, 12);
    let st = d.h.rt().stats();
    assert_eq!(st.metrics.evictions.values().sum::<u64>(), 4);
    assert_eq!(found_pages(&mut d, 40, 4), 4);
    assert_eq!(found_pages(&mut d, 41, 4), 0);
    // The decode engine's load takes them: exact bytes, and the pins of
    // this handoff return (the other's stay).
    load_taking(&mut d, 40, 4, 20, 0xfeed);
    d.assert_restored(40, &[20, 21, 22, 23]);
    d.h.advance();
    let st = d.h.rt().stats();
    assert_eq!(
        (st.handoffs.standing, st.handoffs.pinned_pages, st.leases),
        (1, 2, 2)
    );
    assert_eq!(st.handoffs.counts.taken, 1);
    assert_eq!(st.handoffs.reserved_bytes, 2 * PAGE_BYTES);
    // Nobody takes the other: it ends at its deadline, and nothing is
    // left pinned or reserved.
    d.h.step(vec![Command::AdvanceClock { us: 10_000_000 }]);
    d.h.advance();
    let st = d.h.rt().stats();
    assert_eq!(st.handoffs.standing, 0);
    assert_eq!(st.handoffs.counts.expired, 1);
    assert_eq!(st.handoffs.reserved_bytes, 0);
    d.h.assert_idle();
}

#[test]
fn a_handoff_whose_pages_never_land_ends_at_its_deadline_and_pins_nothing_later() {
    let mut d = small_dense();
    let held = d.h.one(hold_cmd(&d, 7, 43, 3, 5));
    assert!(
        matches!(
            held,
            Event::Held {
                pinned: 0,
                promised: 3,
                ..
            }
        ),
        "{held:?}"
    );
    d.h.step(vec![Command::AdvanceClock { us: 6_000 }]);
    d.h.advance();
    let st = d.h.rt().stats();
    assert_eq!(
        (st.handoffs.standing, st.handoffs.counts.expired),
        (1 - 1, 1)
    );
    // Its pages land after the deadline: nothing pins them.
    publish_pages(&mut d, 43, 0..3, 0);
    let st = d.h.rt().stats();
    assert_eq!((st.leases, st.handoffs.pinned_pages), (0, 0));
    // A load naming the ended handoff is an ordinary load.
    load_taking(&mut d, 43, 3, 10, 7);
    d.h.assert_idle();
}

#[test]
fn handoffs_past_their_bounds_are_refused_and_pin_nothing() {
    let mut c = config(32 << 10);
    c.dram.extent_bytes = 16 << 10;
    c.budget.handoff_bytes = Some(4 * PAGE_BYTES);
    c.limits.max_handoffs = 2;
    c.limits.max_handoff_deadline_us = 60_000_000;
    let mut d = dense_setup_with(c);
    publish_pages(&mut d, 44, 0..4, 0);
    let refused = |e: Event| match e {
        Event::Rejected { error, .. } => error,
        other => panic!("expected a refusal, got {other:?}"),
    };
    // More than the budget.
    let e = refused(d.h.one(hold_cmd(&d, 1, 44, 5, 1000)));
    assert!(
        matches!(e, CommandError::Limit { limit, .. } if limit == 4 * PAGE_BYTES),
        "{e:?}"
    );
    assert_eq!(e.reason(), "limit_handoff_bytes");
    // Longer than the deadline bound.
    let e = refused(d.h.one(hold_cmd(&d, 1, 44, 1, 61_000)));
    assert_eq!(e.reason(), "limit_max_handoff_deadline");
    // Nothing promised, or no time.
    let e = refused(d.h.one(hold_cmd(&d, 1, 44, 0, 1000)));
    assert_eq!(e.reason(), "empty_handoff");
    let e = refused(d.h.one(hold_cmd(&d, 1, 44, 1, 0)));
    assert_eq!(e.reason(), "empty_handoff");
    // A group the instance does not have.
    let e = refused(d.h.one(Command::Hold {
        session: d.s,
        handoff: 1,
        groups: hashes(44, &[3], 1),
        deadline_ms: 1000,
    }));
    assert_eq!(e.reason(), "unknown_group");
    // The same id twice, and more handoffs than allowed.
    assert!(matches!(
        d.h.one(hold_cmd(&d, 1, 44, 1, 1000)),
        Event::Held { .. }
    ));
    let e = refused(d.h.one(hold_cmd(&d, 1, 44, 1, 1000)));
    assert_eq!(e.reason(), "handoff_exists");
    assert!(matches!(
        d.h.one(hold_cmd(&d, 2, 44, 1, 1000)),
        Event::Held { .. }
    ));
    let e = refused(d.h.one(hold_cmd(&d, 3, 44, 1, 1000)));
    assert_eq!(e.reason(), "limit_max_handoffs");
    let st = d.h.rt().stats();
    assert_eq!((st.handoffs.standing, st.leases), (2, 2));
    assert_eq!(
        st.metrics.refusals.get("hold.limit_handoff_bytes"),
        Some(&1)
    );
    d.h.step(vec![Command::AdvanceClock { us: 2_000_000 }]);
    d.h.advance();
    d.h.assert_idle();
}

#[test]
fn a_handoff_outlives_its_instance_being_replaced_and_still_ends_at_its_deadline() {
    let mut d = small_dense();
    publish_pages(&mut d, 45, 0..2, 0);
    assert!(matches!(
        d.h.one(hold_cmd(&d, 9, 45, 2, 1000)),
        Event::Held { pinned: 2, .. }
    ));
    // The producer exits and a new computation takes the instance's name:
    // the old instance is gone, its promise stands (the invariants hold
    // after every tick).
    d.h.step(vec![Command::CloseSession { session: d.s }]);
    d.h.advance();
    d.h.register("llama", ID_B, dense(), 1);
    d.h.advance();
    let st = d.h.rt().stats();
    assert_eq!((st.handoffs.standing, st.leases), (1, 2));
    d.h.step(vec![Command::AdvanceClock { us: 2_000_000 }]);
    d.h.advance();
    let st = d.h.rt().stats();
    assert_eq!((st.handoffs.standing, st.handoffs.counts.expired), (0, 1));
    d.h.assert_idle();
}
