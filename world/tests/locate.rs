//! `Runtime::locate`'s router answer (`restorable`): what a load of a
//! prompt would restore now, by every rank's contract, per tier, holding
//! nothing. The runtime's own query is the oracle: for the same hashes the
//! two must select the same boundary.

mod common;

use common::*;
use orbitkv_components::admin::{LookupRequest, Restorable};
use orbitkv_components::api::{Command, Event, GroupHashes, MissReason};
use orbitkv_components::{Namespace, NativeHash};

const ID: [u8; 32] = [0x1c; 32];

/// The router's hashes: one list for every group (vLLM's block hashes).
fn router_hash(seed: u64, i: u64) -> NativeHash {
    hash(seed, 0, i)
}

fn request(instance: Option<&str>, ns: Option<Namespace>, seed: u64, pages: u64) -> LookupRequest {
    LookupRequest {
        instance: instance.map(str::to_owned),
        namespace: ns,
        group: 0,
        hashes: (0..pages).map(|i| router_hash(seed, i)).collect(),
        prompt_len: None,
    }
}

fn restorable(h: &mut Harness, req: &LookupRequest) -> Restorable {
    let (_, r) = h.rt().locate(req).expect("answered");
    r.expect("a registered instance decides")
}

fn tiers(r: &Restorable) -> Vec<(&str, u64)> {
    r.by_tier.iter().map(|(t, n)| (t.as_str(), *n)).collect()
}

/// Stores page `i` of every group in `groups` for `seed` on one rank's
/// namespace, in the simulated lower tier.
fn store(h: &mut Harness, ns: Namespace, groups: &[u32], seed: u64, pages: &[u64]) {
    for &g in groups {
        for &i in pages {
            let native = router_hash(seed, i);
            h.tier.insert(key(ns, g, native), payload(&ns, g, &native));
        }
    }
}

/// The runtime's own selection for the same prompt (a `Lookup` query,
/// every group given the router's hashes).
fn selected_by_query(
    h: &mut Harness,
    groups: &[u32],
    seed: u64,
    pages: u64,
    prompt: u64,
) -> Option<u64> {
    let s = h.open("hybrid");
    let ev = h.step(vec![Command::Lookup {
        session: s,
        request: seed,
        groups: groups
            .iter()
            .map(|&group| GroupHashes {
                group,
                hashes: (0..pages).map(|i| router_hash(seed, i)).collect(),
            })
            .collect(),
        origin: 0,
        prompt_len: prompt,
        expect_namespaces: Vec::new(),
    }]);
    h.step(vec![Command::CloseSession { session: s }]);
    match ev.iter().find(|e| matches!(e, Event::QueryResult { .. })) {
        Some(Event::QueryResult { selected, .. }) => *selected,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_hybrid_prefix_counts_only_where_every_rank_holds_its_checkpoint() {
    let mut h = Harness::new(config(32 << 20));
    let ns = h.register("hybrid", ID, hybrid(), 2);
    // Both ranks: attention and window pages for 8 pages; checkpoints at
    // page ends 4 and 6 on rank 0, at 4 only on rank 1.
    for (rank, checkpoints) in [(0usize, vec![3u64, 5]), (1, vec![3])] {
        store(&mut h, ns[rank], &[0, 1], 7, &(0..8).collect::<Vec<_>>());
        store(&mut h, ns[rank], &[2], 7, &checkpoints);
    }
    let r = restorable(&mut h, &request(Some("hybrid"), None, 7, 8));
    assert_eq!((r.tokens, r.miss), (4 * PAGE, None));
    assert_eq!(tiers(&r), vec![("sim", 4 * PAGE)]);
    assert_eq!(
        selected_by_query(&mut h, &[0, 1, 2], 7, 8, 8 * PAGE + 1),
        Some(r.tokens),
        "the router's answer is the runtime's own selection"
    );

    // Rank 0 alone (its namespace) resumes at its later checkpoint.
    let r = restorable(&mut h, &request(None, Some(ns[0]), 7, 8));
    assert_eq!((r.tokens, r.miss), (6 * PAGE, None));

    // The prompt caps it: a load ends before the last prompt token.
    let mut capped = request(Some("hybrid"), None, 7, 8);
    capped.prompt_len = Some(4 * PAGE);
    let r = restorable(&mut h, &capped);
    assert_eq!((r.tokens, r.miss), (0, Some(MissReason::NoLegalBoundary)));
    assert!(r.by_tier.is_empty());

    // Without rank 1's checkpoint the attention prefix alone is nothing.
    assert!(h.tier.remove(&key(ns[1], 2, router_hash(7, 3))));
    let r = restorable(&mut h, &request(Some("hybrid"), None, 7, 8));
    assert_eq!((r.tokens, r.miss), (0, Some(MissReason::IncompleteGroup)));
    assert_eq!(
        selected_by_query(&mut h, &[0, 1, 2], 7, 8, 8 * PAGE + 1),
        None
    );

    // A prompt nobody stored.
    let r = restorable(&mut h, &request(Some("hybrid"), None, 99, 8));
    assert_eq!((r.tokens, r.miss), (0, Some(MissReason::NotFound)));
    h.assert_idle();
}

#[test]
fn a_prefix_stored_on_one_rank_only_is_not_restorable() {
    let mut h = Harness::new(config(32 << 20));
    let ns = h.register("tp2", ID, dense(), 2);
    store(&mut h, ns[0], &[0], 3, &[0, 1, 2, 3]);
    let r = restorable(&mut h, &request(Some("tp2"), None, 3, 4));
    assert_eq!((r.tokens, r.miss), (0, Some(MissReason::IncompleteGroup)));
    // The rank that holds it, asked alone, could.
    let r = restorable(&mut h, &request(None, Some(ns[0]), 3, 4));
    assert_eq!(r.tokens, 4 * PAGE);
    // Rank 1 gets the first two: the instance's answer is the common part.
    store(&mut h, ns[1], &[0], 3, &[0, 1]);
    let r = restorable(&mut h, &request(Some("tp2"), None, 3, 4));
    assert_eq!((r.tokens, r.miss), (2 * PAGE, None));
    // A namespace no instance registered: pages, but no contract to decide.
    let (pages, r) = h
        .rt()
        .locate(&request(None, Some(Namespace([9; 32])), 3, 4))
        .unwrap();
    assert_eq!((pages.len(), r), (1, None));
    h.assert_idle();
}

#[test]
fn each_page_position_counts_in_the_slowest_tier_it_is_read_from() {
    let mut h = Harness::new(config(32 << 20));
    let ns = h.register("llama", ID, dense(), 1)[0];
    let s = h.open("llama");
    let (region, engine) = h.region(s, 0, 0, 8);
    // Pages 0..3 published into DRAM, pages 3..6 only in the lower tier.
    let mut pages = Vec::new();
    for i in 0..3u64 {
        let dp = h.alloc(s, region, i as u32);
        let native = router_hash(5, i);
        h.write_slot(engine, i as u32, &payload(&ns, 0, &native));
        pages.push((0, native, dp));
    }
    h.step(vec![publish_cmd(s, 1, 0, pages)]);
    h.until("publish", |e| matches!(e, Event::PublishDone { .. }));
    store(&mut h, ns, &[0], 5, &[3, 4, 5, 7]);
    let r = restorable(&mut h, &request(Some("llama"), None, 5, 8));
    // Page 6 is missing: the prefix stops there, page 7 does not count.
    assert_eq!((r.tokens, r.miss), (6 * PAGE, None));
    assert_eq!(tiers(&r), vec![("dram", 3 * PAGE), ("sim", 3 * PAGE)]);
    // The per-group view agrees.
    let (found, _) = h.rt().locate(&request(Some("llama"), None, 5, 8)).unwrap();
    assert_eq!(found[0].prefix_pages, 6);
    // A page in both tiers counts as DRAM.
    store(&mut h, ns, &[0], 5, &[0]);
    let r = restorable(&mut h, &request(Some("llama"), None, 5, 8));
    assert_eq!(tiers(&r), vec![("dram", 3 * PAGE), ("sim", 3 * PAGE)]);
    h.step(vec![Command::CloseSession { session: s }]);
    h.assert_idle();
}

#[test]
fn a_load_worth_less_than_min_load_tokens_is_reported_as_a_miss() {
    let mut c = config(32 << 20);
    c.restore.min_load_tokens = 3 * PAGE;
    let mut h = Harness::new(c);
    let ns = h.register("llama", ID, dense(), 1)[0];
    store(&mut h, ns, &[0], 4, &[0, 1]);
    let r = restorable(&mut h, &request(Some("llama"), None, 4, 4));
    assert_eq!((r.tokens, r.miss), (0, Some(MissReason::NotWorthLoading)));
    store(&mut h, ns, &[0], 4, &[2]);
    let r = restorable(&mut h, &request(Some("llama"), None, 4, 4));
    assert_eq!((r.tokens, r.miss), (3 * PAGE, None));
}
