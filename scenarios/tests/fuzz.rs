//! The fuzzer: a fixed seed set runs clean, the generator covers every fault
//! kind, the oracle rejects what it must, and minimization shrinks.

use orbitkv_components::api::PagePos;
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::{Namespace, NativeHash, StateKey};
use orbitkv_scenarios::fuzz::{Oracle, Verdict, check, generate, kinds, minimize};
use orbitkv_scenarios::replay::{Observer, ReadyContext};
use orbitkv_scenarios::trace::{Body, Line};

#[test]
fn fixed_seeds_run_clean() {
    for seed in 1..=4 {
        let (header, lines) = generate(seed, 1500);
        match check(&header, &lines) {
            Verdict::Clean { ticks } => assert!(ticks >= 1500, "seed {seed}: {ticks} ticks"),
            Verdict::Failed { why, .. } => panic!("seed {seed}: {why}"),
        }
    }
}

#[test]
fn the_generator_covers_every_fault_kind() {
    let mut all = std::collections::BTreeSet::new();
    for seed in 1..=40 {
        all.extend(kinds(&generate(seed, 2000).1));
    }
    for k in [
        "request",
        "publish",
        "tier_put",
        "register",
        "open",
        "fault:tier_read_error",
        "fault:tier_lose_reads",
        "fault:tier_delay",
        "fault:corrupt_page",
        "fault:drop_page",
        "fault:copy_error",
        "fault:copy_lose",
        "fault:copy_delay",
        "fault:copy_reorder",
        "fault:session_crash",
        "fault:manager_restart",
    ] {
        assert!(all.contains(k), "no seed generated {k}: {all:?}");
    }
}

fn groups() -> Vec<GroupSpec> {
    vec![
        GroupSpec {
            id: 0,
            rule: Rule::Prefix,
            components: vec![ComponentKind::AttentionKv],
        },
        GroupSpec {
            id: 1,
            rule: Rule::Window { past_tokens: 20 },
            components: vec![ComponentKind::SlidingWindowKv],
        },
        GroupSpec {
            id: 2,
            rule: Rule::Checkpoint,
            components: vec![ComponentKind::RecurrentCheckpoint],
        },
    ]
}

fn pos(group: u32, page_end: u64) -> PagePos {
    PagePos {
        rank: 0,
        group,
        page_end,
    }
}

#[test]
fn the_oracle_allows_exactly_the_contract() {
    let ns = [Namespace([5; 32])];
    let hashes: Vec<u64> = (1..=6).collect();
    let mut oracle = Oracle::default();
    for g in 0..3 {
        for h in &hashes {
            oracle.available(StateKey {
                namespace: ns[0],
                group: g,
                native: NativeHash::from_u64(*h),
            });
        }
    }
    let g = groups();
    // Boundary 64 with 16-token pages: prefix 16..64, window ceil(20/16)=2
    // pages (48, 64), checkpoint 64.
    let good = vec![
        pos(0, 16),
        pos(0, 32),
        pos(0, 48),
        pos(0, 64),
        pos(1, 48),
        pos(1, 64),
        pos(2, 64),
    ];
    let ctx = |leased: &[PagePos], boundary: u64, prompt_len: u64| -> Result<(), String> {
        let mut o = Oracle::default();
        for gr in 0..3 {
            for h in &hashes {
                o.available(StateKey {
                    namespace: ns[0],
                    group: gr,
                    native: NativeHash::from_u64(*h),
                });
            }
        }
        o.ready(&ReadyContext {
            instance: "m",
            namespaces: &ns,
            groups: &g,
            page_tokens: 16,
            origin: 0,
            prompt_len,
            hashes: &hashes,
            boundary,
            leased,
        })
    };
    assert_eq!(ctx(&good, 64, 97), Ok(()));
    // The final prompt token must be computed.
    assert!(ctx(&good, 64, 64).unwrap_err().contains("not allowed"));
    // A missing checkpoint, an extra window page, a misaligned boundary.
    assert!(ctx(&good[..6], 64, 97).unwrap_err().contains("missing"));
    let mut extra = good.clone();
    extra.push(pos(1, 32));
    assert!(ctx(&extra, 64, 97).unwrap_err().contains("extra"));
    assert!(ctx(&good, 60, 97).is_err());
    // A key the scenario never produced.
    let mut stranger = Oracle::default();
    let e = stranger.ready(&ReadyContext {
        instance: "m",
        namespaces: &ns,
        groups: &g,
        page_tokens: 16,
        origin: 0,
        prompt_len: 97,
        hashes: &hashes,
        boundary: 64,
        leased: &good,
    });
    assert!(e.unwrap_err().contains("never produced"));
    // Two identities may never share a namespace.
    assert!(oracle.registered("m", "v1", &ns).is_ok());
    assert!(
        oracle
            .registered("m", "v2", &ns)
            .unwrap_err()
            .contains("share a namespace")
    );
}

#[test]
fn minimization_keeps_only_what_the_failure_needs() {
    let lines: Vec<Line> = (0..50)
        .map(|i| Line {
            number: i + 2,
            t: i as u64,
            body: Body::Tick,
        })
        .collect();
    // "Fails" while lines 17 and 33 are both present.
    let small = minimize(lines, &mut |c| {
        c.iter().any(|l| l.t == 17) && c.iter().any(|l| l.t == 33)
    });
    let ts: Vec<u64> = small.iter().map(|l| l.t).collect();
    assert_eq!(ts, [17, 33]);
}
