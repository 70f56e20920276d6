//! Tests of the compiled recovery contract (spec: "Compiled hybrid recovery").
//!
//! Every rule is tested against hand-written expectations, and legality is
//! additionally checked by proptest against a naive brute-force checker that
//! uses only plain arithmetic (no library internals).

use std::collections::BTreeSet;

use orbitkv_components::contract::RuleKind;
use orbitkv_components::{
    ComponentKind, ContractError, ContractSpec, GroupEvidence, GroupSpec, LoadError, Namespace,
    RecoveryContract, RequiredRange, Rule, StateBundle, StateKey, common_boundaries, prompt_limit,
    select_boundary, vllm_window_past_tokens,
};
use proptest::prelude::*;

use ComponentKind::{
    AttentionKv, Auxiliary, ConvolutionState, Draft, Dsa, MlaKv, RecurrentCheckpoint,
    SlidingWindowKv,
};

const ALL_KINDS: [ComponentKind; 8] = [
    AttentionKv,
    MlaKv,
    SlidingWindowKv,
    RecurrentCheckpoint,
    ConvolutionState,
    Dsa,
    Draft,
    Auxiliary,
];

fn ns() -> Namespace {
    Namespace([0xab; 32])
}

fn other_ns() -> Namespace {
    Namespace([0xcd; 32])
}

fn group(id: u32, rule: Rule, components: &[ComponentKind]) -> GroupSpec {
    GroupSpec {
        id,
        rule,
        components: components.to_vec(),
    }
}

fn spec(page_tokens: u64, groups: Vec<GroupSpec>) -> ContractSpec {
    ContractSpec {
        namespace: ns(),
        page_tokens,
        groups,
    }
}

/// Full attention (0) + sliding window of 100 past tokens (1) + recurrent
/// checkpoint (2), 64-token pages.
fn hybrid_spec() -> ContractSpec {
    spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(1, Rule::Window { past_tokens: 100 }, &[SlidingWindowKv]),
            group(
                2,
                Rule::Checkpoint,
                &[RecurrentCheckpoint, ConvolutionState],
            ),
        ],
    )
}

fn hybrid() -> RecoveryContract {
    RecoveryContract::compile(&hybrid_spec()).expect("hybrid contract compiles")
}

fn rr(group: u32, start: u64, end: u64) -> RequiredRange {
    RequiredRange { group, start, end }
}

fn bundle(start: u64, end: u64, groups: &[(u32, &[u64])]) -> StateBundle {
    StateBundle {
        namespace: ns(),
        start,
        end,
        groups: groups
            .iter()
            .map(|&(group, ends)| GroupEvidence {
                group,
                page_ends: ends.to_vec(),
            })
            .collect(),
    }
}

/// Every page end in `(start, end]`, stepping by `page`.
fn all_ends(start: u64, end: u64, page: u64) -> Vec<u64> {
    (1..=(end - start) / page)
        .map(|i| start + i * page)
        .collect()
}

fn compile_err(s: &ContractSpec) -> ContractError {
    RecoveryContract::compile(s).expect_err("contract must be rejected")
}

// ---------------------------------------------------------------------------
// Required ranges: the known-range example and the three rules.
// ---------------------------------------------------------------------------

#[test]
fn known_range_example() {
    let c = hybrid();
    assert_eq!(
        c.required_ranges(ns(), 128, 512).unwrap(),
        vec![rr(0, 128, 512), rr(1, 384, 512), rr(2, 448, 512)]
    );
}

#[test]
fn known_range_example_short_tail_caps_window_at_origin() {
    let c = hybrid();
    assert_eq!(
        c.required_ranges(ns(), 128, 192).unwrap(),
        vec![rr(0, 128, 192), rr(1, 128, 192), rr(2, 128, 192)]
    );
    // Two pages past the origin: the two-page window fits exactly.
    assert_eq!(
        c.required_ranges(ns(), 128, 256).unwrap(),
        vec![rr(0, 128, 256), rr(1, 128, 256), rr(2, 192, 256)]
    );
}

#[test]
fn window_rounds_past_tokens_up_to_whole_pages() {
    for (past, pages) in [(1, 1), (63, 1), (64, 1), (65, 2), (128, 2), (129, 3)] {
        let c = RecoveryContract::compile(&spec(
            64,
            vec![
                group(0, Rule::Prefix, &[AttentionKv]),
                group(1, Rule::Window { past_tokens: past }, &[SlidingWindowKv]),
            ],
        ))
        .unwrap();
        assert_eq!(
            c.required_ranges(ns(), 0, 1024).unwrap(),
            vec![rr(0, 0, 1024), rr(1, 1024 - pages * 64, 1024)],
            "past_tokens {past} needs {pages} pages"
        );
    }
}

#[test]
fn empty_span_gives_start_start_for_every_group() {
    let c = hybrid();
    for start in [0, 128, 512] {
        assert_eq!(
            c.required_ranges(ns(), start, start).unwrap(),
            vec![
                rr(0, start, start),
                rr(1, start, start),
                rr(2, start, start)
            ]
        );
        assert!(
            c.required_ranges(ns(), start, start)
                .unwrap()
                .iter()
                .all(RequiredRange::is_empty)
        );
    }
}

#[test]
fn required_ranges_follow_group_order_not_declaration_order() {
    let c = RecoveryContract::compile(&spec(
        16,
        vec![
            group(7, Rule::Checkpoint, &[ConvolutionState]),
            group(3, Rule::Window { past_tokens: 20 }, &[SlidingWindowKv]),
            group(0, Rule::Prefix, &[MlaKv]),
        ],
    ))
    .unwrap();
    assert_eq!(
        c.groups().iter().map(|g| g.id).collect::<Vec<_>>(),
        vec![0, 3, 7]
    );
    assert_eq!(
        c.required_ranges(ns(), 32, 128).unwrap(),
        vec![rr(0, 32, 128), rr(3, 96, 128), rr(7, 112, 128)]
    );
}

#[test]
fn required_ranges_errors() {
    let c = hybrid();
    assert_eq!(
        c.required_ranges(other_ns(), 128, 512),
        Err(ContractError::NamespaceMismatch {
            expected: ns(),
            got: other_ns()
        })
    );
    assert_eq!(
        c.required_ranges(ns(), 100, 512),
        Err(ContractError::Misaligned {
            what: "start",
            value: 100,
            page_tokens: 64
        })
    );
    assert_eq!(
        c.required_ranges(ns(), 128, 500),
        Err(ContractError::Misaligned {
            what: "end",
            value: 500,
            page_tokens: 64
        })
    );
    assert_eq!(
        c.required_ranges(ns(), 512, 128),
        Err(ContractError::InvertedSpan {
            start: 512,
            end: 128
        })
    );
}

#[test]
fn huge_non_overflowing_window_is_capped_at_origin() {
    // ceil((u64::MAX - 63) / 64) * 64 == u64::MAX - 63: no overflow.
    let c = RecoveryContract::compile(&spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(
                1,
                Rule::Window {
                    past_tokens: u64::MAX - 63,
                },
                &[SlidingWindowKv],
            ),
        ],
    ))
    .unwrap();
    assert_eq!(
        c.required_ranges(ns(), 128, 512).unwrap(),
        vec![rr(0, 128, 512), rr(1, 128, 512)]
    );
}

// ---------------------------------------------------------------------------
// Compilation errors.
// ---------------------------------------------------------------------------

#[test]
fn compile_accepts_hybrid_and_keeps_namespace_and_page() {
    let c = hybrid();
    assert_eq!(c.namespace(), ns());
    assert_eq!(c.page_tokens(), 64);
    assert_eq!(c.groups().len(), 3);
    assert_eq!(c.group(1).unwrap().rule, Rule::Window { past_tokens: 100 });
    assert!(c.group(3).is_none());
}

#[test]
fn compile_rejects_empty_namespace() {
    let mut s = hybrid_spec();
    s.namespace = Namespace::EMPTY;
    assert_eq!(compile_err(&s), ContractError::EmptyNamespace);
}

#[test]
fn compile_rejects_zero_page_tokens() {
    let mut s = hybrid_spec();
    s.page_tokens = 0;
    assert_eq!(compile_err(&s), ContractError::ZeroPageTokens);
}

#[test]
fn compile_rejects_no_groups() {
    assert_eq!(compile_err(&spec(64, vec![])), ContractError::NoGroups);
}

#[test]
fn compile_rejects_group_without_components() {
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(1, Rule::Checkpoint, &[]),
        ],
    );
    assert_eq!(compile_err(&s), ContractError::EmptyGroup(1));
    let s = spec(64, vec![group(0, Rule::Prefix, &[])]);
    assert_eq!(compile_err(&s), ContractError::EmptyGroup(0));
}

#[test]
fn compile_rejects_zero_window() {
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(2, Rule::Window { past_tokens: 0 }, &[SlidingWindowKv]),
        ],
    );
    assert_eq!(compile_err(&s), ContractError::ZeroWindow(2));
}

#[test]
fn compile_rejects_overflowing_window() {
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(
                1,
                Rule::Window {
                    past_tokens: u64::MAX,
                },
                &[SlidingWindowKv],
            ),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::WindowOverflow {
            group: 1,
            past_tokens: u64::MAX
        }
    );
    // One token past the largest representable whole-page window.
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(
                1,
                Rule::Window {
                    past_tokens: u64::MAX - 62,
                },
                &[SlidingWindowKv],
            ),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::WindowOverflow {
            group: 1,
            past_tokens: u64::MAX - 62
        }
    );
}

#[test]
fn compile_rejects_duplicate_group_ids() {
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(1, Rule::Checkpoint, &[RecurrentCheckpoint]),
            group(1, Rule::Window { past_tokens: 10 }, &[SlidingWindowKv]),
        ],
    );
    assert_eq!(compile_err(&s), ContractError::DuplicateGroup(1));
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(0, Rule::Prefix, &[MlaKv]),
        ],
    );
    assert_eq!(compile_err(&s), ContractError::DuplicateGroup(0));
}

#[test]
fn compile_rejects_group_zero_not_prefix() {
    let s = spec(
        64,
        vec![
            group(0, Rule::Window { past_tokens: 100 }, &[SlidingWindowKv]),
            group(1, Rule::Prefix, &[AttentionKv]),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::GroupZeroNotPrefix(RuleKind::Window)
    );
    let s = spec(
        64,
        vec![
            group(0, Rule::Checkpoint, &[RecurrentCheckpoint]),
            group(1, Rule::Prefix, &[AttentionKv]),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::GroupZeroNotPrefix(RuleKind::Checkpoint)
    );
}

#[test]
fn compile_rejects_missing_group_zero() {
    let s = spec(
        64,
        vec![
            group(1, Rule::Prefix, &[AttentionKv]),
            group(2, Rule::Checkpoint, &[RecurrentCheckpoint]),
        ],
    );
    assert_eq!(compile_err(&s), ContractError::MissingGroupZero);
}

#[test]
fn compile_rejects_duplicate_component() {
    let s = spec(
        64,
        vec![group(0, Rule::Prefix, &[AttentionKv, MlaKv, AttentionKv])],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::DuplicateComponent {
            group: 0,
            kind: AttentionKv
        }
    );
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(
                4,
                Rule::Checkpoint,
                &[ConvolutionState, RecurrentCheckpoint, ConvolutionState],
            ),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::DuplicateComponent {
            group: 4,
            kind: ConvolutionState
        }
    );
}

#[test]
fn compile_never_accepts_unsupported_components() {
    let rules = [
        Rule::Prefix,
        Rule::Window { past_tokens: 100 },
        Rule::Checkpoint,
    ];
    for kind in [Dsa, Draft, Auxiliary] {
        assert_eq!(kind.rule_kind(), None, "{kind} has no rule");
        // Never as attention KV in the prefix group 0, alone or alongside
        // real attention KV.
        for comps in [vec![kind], vec![AttentionKv, kind], vec![kind, MlaKv]] {
            let s = spec(64, vec![group(0, Rule::Prefix, &comps)]);
            assert_eq!(
                compile_err(&s),
                ContractError::UnsupportedComponent { group: 0, kind },
                "{comps:?}"
            );
        }
        // Nor in any other group under any rule.
        for rule in rules {
            let s = spec(
                64,
                vec![
                    group(0, Rule::Prefix, &[AttentionKv]),
                    group(5, rule, &[kind]),
                ],
            );
            assert_eq!(
                compile_err(&s),
                ContractError::UnsupportedComponent { group: 5, kind },
                "{kind} under {rule:?}"
            );
        }
    }
}

#[test]
fn compile_pairs_rules_only_with_their_components() {
    let allowed = |rule: RuleKind, kind: ComponentKind| match rule {
        RuleKind::Prefix => matches!(kind, AttentionKv | MlaKv),
        RuleKind::Window => matches!(kind, SlidingWindowKv),
        RuleKind::Checkpoint => matches!(kind, RecurrentCheckpoint | ConvolutionState),
    };
    let unsupported = |kind: ComponentKind| matches!(kind, Dsa | Draft | Auxiliary);
    let mut accepted = 0;
    for rule in [
        Rule::Prefix,
        Rule::Window { past_tokens: 100 },
        Rule::Checkpoint,
    ] {
        for kind in ALL_KINDS {
            let s = spec(
                64,
                vec![
                    group(0, Rule::Prefix, &[AttentionKv]),
                    group(1, rule, &[kind]),
                ],
            );
            let got = RecoveryContract::compile(&s);
            if unsupported(kind) {
                assert_eq!(
                    got.unwrap_err(),
                    ContractError::UnsupportedComponent { group: 1, kind }
                );
            } else if allowed(rule.kind(), kind) {
                assert!(got.is_ok(), "{kind} under {rule:?}: {got:?}");
                accepted += 1;
            } else {
                assert_eq!(
                    got.unwrap_err(),
                    ContractError::RuleMismatch {
                        group: 1,
                        kind,
                        rule: rule.kind()
                    },
                    "{kind} under {rule:?}"
                );
            }
        }
    }
    assert_eq!(accepted, 5);
    // A mismatch in group 0 itself is reported as a mismatch.
    let s = spec(
        64,
        vec![group(0, Rule::Prefix, &[AttentionKv, SlidingWindowKv])],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::RuleMismatch {
            group: 0,
            kind: SlidingWindowKv,
            rule: RuleKind::Prefix
        }
    );
    // A mixed checkpoint group with a window component is rejected.
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(2, Rule::Checkpoint, &[RecurrentCheckpoint, SlidingWindowKv]),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::RuleMismatch {
            group: 2,
            kind: SlidingWindowKv,
            rule: RuleKind::Checkpoint
        }
    );
    // Window groups cannot hold attention KV.
    let s = spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(
                1,
                Rule::Window { past_tokens: 4 },
                &[SlidingWindowKv, MlaKv],
            ),
        ],
    );
    assert_eq!(
        compile_err(&s),
        ContractError::RuleMismatch {
            group: 1,
            kind: MlaKv,
            rule: RuleKind::Window
        }
    );
}

// ---------------------------------------------------------------------------
// Restorable boundaries.
// ---------------------------------------------------------------------------

#[test]
fn full_evidence_makes_every_boundary_legal() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let b = bundle(128, 512, &[(0, &full), (1, &full), (2, &full)]);
    assert_eq!(
        c.restorable_boundaries(&b).unwrap(),
        vec![192, 256, 320, 384, 448, 512]
    );
}

#[test]
fn empty_span_has_no_boundaries() {
    let c = hybrid();
    let b = bundle(256, 256, &[(0, &[]), (1, &[]), (2, &[])]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), Vec::<u64>::new());
}

#[test]
fn prefix_gap_stops_boundaries() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    // Group 0 lacks the page ending at 320: nothing past 256 is reachable,
    // even though later prefix pages are held.
    let b = bundle(
        128,
        512,
        &[(0, &[192, 256, 384, 448, 512]), (1, &full), (2, &full)],
    );
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![192, 256]);
    // Missing the first page: nothing at all.
    let b = bundle(128, 512, &[(0, &[256, 320, 384]), (1, &full), (2, &full)]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), Vec::<u64>::new());
}

#[test]
fn window_needs_only_its_trailing_pages() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    // SWA evicted old pages; only the two-page window before each boundary
    // matters.
    let b = bundle(128, 512, &[(0, &full), (1, &[384, 448, 512]), (2, &full)]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![448, 512]);
    // Window lacks 448: 448 (needs 384, 448) and 512 (needs 448, 512) fail.
    let b = bundle(
        128,
        512,
        &[(0, &full), (1, &[192, 256, 320, 384, 512]), (2, &full)],
    );
    assert_eq!(
        c.restorable_boundaries(&b).unwrap(),
        vec![192, 256, 320, 384]
    );
    // At 192 the window is capped at the origin, so one page suffices.
    let b = bundle(128, 512, &[(0, &full), (1, &[192]), (2, &full)]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![192]);
}

#[test]
fn checkpoint_needs_the_page_ending_exactly_at_the_boundary() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let b = bundle(128, 512, &[(0, &full), (1, &full), (2, &[256, 448])]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![256, 448]);
    let b = bundle(128, 512, &[(0, &full), (1, &full), (2, &[])]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), Vec::<u64>::new());
}

/// A model without full attention (Mistral: every layer sliding; a pure
/// recurrent model) leads with its window or checkpoint group.
#[test]
fn window_or_checkpoint_group_zero_without_a_prefix_group() {
    let window_only = RecoveryContract::compile(&spec(
        64,
        vec![group(
            0,
            Rule::Window { past_tokens: 100 },
            &[SlidingWindowKv],
        )],
    ))
    .unwrap();
    assert_eq!(
        window_only.required_ranges(ns(), 0, 512).unwrap(),
        vec![rr(0, 384, 512)]
    );
    // Window pages without the page 192..256: boundaries 256 and 320 need
    // it, 128 and 384.. do not.
    let b = bundle(0, 512, &[(0, &[64, 128, 192, 320, 384, 448, 512])]);
    assert_eq!(
        window_only.restorable_boundaries(&b).unwrap(),
        vec![64, 128, 192, 384, 448, 512]
    );

    let mut recurrent = spec(
        64,
        vec![group(
            0,
            Rule::Checkpoint,
            &[RecurrentCheckpoint, ConvolutionState],
        )],
    );
    let c = RecoveryContract::compile(&recurrent).unwrap();
    assert_eq!(
        c.required_ranges(ns(), 0, 512).unwrap(),
        vec![rr(0, 448, 512)]
    );
    let b = bundle(0, 512, &[(0, &[128, 448])]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![128, 448]);
    // With a window group 1 beside it, still legal: no group is a prefix.
    recurrent.groups.push(group(
        1,
        Rule::Window { past_tokens: 64 },
        &[SlidingWindowKv],
    ));
    let c = RecoveryContract::compile(&recurrent).unwrap();
    let b = bundle(0, 512, &[(0, &[128, 448]), (1, &[128, 512])]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![128]);
}

#[test]
fn bundle_group_order_does_not_matter() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let b = bundle(128, 512, &[(2, &[384, 512]), (0, &full), (1, &full)]);
    assert_eq!(c.restorable_boundaries(&b).unwrap(), vec![384, 512]);
}

/// Full + SWA + checkpoint: rank 0 has checkpoints at 384 and 512, rank 1
/// only at 384. The common boundary is 384.
#[test]
fn worked_scenario_common_boundary_is_384() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let swa: &[u64] = &[320, 384, 448, 512];
    let rank0 = bundle(128, 512, &[(0, &full), (1, swa), (2, &[384, 512])]);
    let rank1 = bundle(128, 512, &[(0, &full), (1, swa), (2, &[384])]);
    let set0 = c.restorable_boundaries(&rank0).unwrap();
    let set1 = c.restorable_boundaries(&rank1).unwrap();
    assert_eq!(set0, vec![384, 512]);
    assert_eq!(set1, vec![384]);
    assert_eq!(common_boundaries(&[set0.clone(), set1.clone()]), vec![384]);
    let common = c
        .common_restorable(&[rank0.clone(), rank1.clone()])
        .unwrap();
    assert_eq!(common, vec![384]);
    assert_eq!(
        c.common_restorable(&[rank1.clone(), rank0.clone()])
            .unwrap(),
        vec![384]
    );
    // A 600-token prompt can restore up to 599: the common 384 is chosen,
    // not rank 0's 512.
    assert_eq!(select_boundary(&common, prompt_limit(600)), Some(384));
    assert_eq!(select_boundary(&common, prompt_limit(385)), Some(384));
    assert_eq!(select_boundary(&common, prompt_limit(384)), None);
    // The selected boundary's demand.
    assert_eq!(
        c.required_ranges(ns(), 128, 384).unwrap(),
        vec![rr(0, 128, 384), rr(1, 256, 384), rr(2, 320, 384)]
    );
}

/// The minimum of per-rank maxima would pick 384, which rank 0 cannot
/// restore. The intersection is empty.
#[test]
fn min_of_maxima_would_be_wrong() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let rank0 = bundle(128, 512, &[(0, &full), (1, &full), (2, &[256, 512])]);
    let rank1 = bundle(128, 512, &[(0, &full), (1, &full), (2, &[384])]);
    let set0 = c.restorable_boundaries(&rank0).unwrap();
    let set1 = c.restorable_boundaries(&rank1).unwrap();
    assert_eq!(set0, vec![256, 512]);
    assert_eq!(set1, vec![384]);
    let min_of_maxima = (*set0.last().unwrap()).min(*set1.last().unwrap());
    assert_eq!(min_of_maxima, 384);
    assert!(!set0.contains(&min_of_maxima));
    let common = c.common_restorable(&[rank0, rank1]).unwrap();
    assert_eq!(common, Vec::<u64>::new());
    assert_eq!(common_boundaries(&[set0, set1]), Vec::<u64>::new());
    assert_eq!(select_boundary(&common, u64::MAX), None);
}

#[test]
fn restorable_rejects_namespace_and_span_errors() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let mut b = bundle(128, 512, &[(0, &full), (1, &full), (2, &full)]);
    b.namespace = other_ns();
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::NamespaceMismatch {
            expected: ns(),
            got: other_ns()
        })
    );
    let b = bundle(100, 512, &[(0, &[]), (1, &[]), (2, &[])]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::Misaligned {
            what: "start",
            value: 100,
            page_tokens: 64
        })
    );
    let b = bundle(128, 513, &[(0, &[]), (1, &[]), (2, &[])]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::Misaligned {
            what: "end",
            value: 513,
            page_tokens: 64
        })
    );
    let b = bundle(512, 128, &[(0, &[]), (1, &[]), (2, &[])]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::InvertedSpan {
            start: 512,
            end: 128
        })
    );
}

#[test]
fn restorable_rejects_malformed_group_lists() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let b = bundle(128, 512, &[(0, &full), (1, &full), (2, &full), (3, &full)]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::UnknownGroup(3))
    );
    let b = bundle(128, 512, &[(0, &full), (2, &full)]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::MissingGroup(1))
    );
    // Missing prefix group 0 is reported as such, not as a panic.
    let b = bundle(128, 512, &[(1, &full), (2, &full)]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::MissingGroup(0))
    );
    let b = bundle(128, 512, &[(0, &full), (1, &full), (2, &full), (1, &[])]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::DuplicateBundleGroup(1))
    );
}

#[test]
fn restorable_rejects_malformed_page_ends() {
    let c = hybrid();
    let full = all_ends(128, 512, 64);
    let with_ckpt = |ends: &[u64]| bundle(128, 512, &[(0, &full), (1, &full), (2, ends)]);
    assert_eq!(
        c.restorable_boundaries(&with_ckpt(&[256, 256])),
        Err(ContractError::PageEndsNotIncreasing {
            group: 2,
            prev: 256,
            next: 256
        })
    );
    assert_eq!(
        c.restorable_boundaries(&with_ckpt(&[192, 384, 320])),
        Err(ContractError::PageEndsNotIncreasing {
            group: 2,
            prev: 384,
            next: 320
        })
    );
    assert_eq!(
        c.restorable_boundaries(&with_ckpt(&[192, 200])),
        Err(ContractError::PageEndMisaligned {
            group: 2,
            page_end: 200
        })
    );
    for bad in [0, 64, 128, 576] {
        assert_eq!(
            c.restorable_boundaries(&with_ckpt(&[bad])),
            Err(ContractError::PageEndOutOfSpan {
                group: 2,
                page_end: bad,
                start: 128,
                end: 512
            }),
            "page end {bad}"
        );
    }
    // The same checks apply to the prefix group.
    let b = bundle(128, 512, &[(0, &[192, 640]), (1, &full), (2, &full)]);
    assert_eq!(
        c.restorable_boundaries(&b),
        Err(ContractError::PageEndOutOfSpan {
            group: 0,
            page_end: 640,
            start: 128,
            end: 512
        })
    );
}

// ---------------------------------------------------------------------------
// Cross-rank intersection and selection.
// ---------------------------------------------------------------------------

#[test]
fn common_boundaries_is_set_intersection() {
    assert_eq!(common_boundaries(&[]), Vec::<u64>::new());
    assert_eq!(common_boundaries(&[vec![5, 3, 3, 1]]), vec![1, 3, 5]);
    assert_eq!(
        common_boundaries(&[vec![1, 2, 3, 9], vec![9, 3, 7], vec![3, 9, 10]]),
        vec![3, 9]
    );
    assert_eq!(
        common_boundaries(&[vec![1, 2, 3], vec![]]),
        Vec::<u64>::new()
    );
    // Not min of maxima: {256, 512} and {384} share nothing.
    assert_eq!(
        common_boundaries(&[vec![256, 512], vec![384]]),
        Vec::<u64>::new()
    );
}

#[test]
fn common_restorable_edge_cases() {
    let c = hybrid();
    assert_eq!(c.common_restorable(&[]).unwrap(), Vec::<u64>::new());
    let full = all_ends(128, 512, 64);
    let rank0 = bundle(128, 512, &[(0, &full), (1, &full), (2, &full)]);
    let short: Vec<u64> = all_ends(128, 448, 64);
    let rank1 = bundle(128, 448, &[(0, &short), (1, &short), (2, &short)]);
    assert_eq!(
        c.common_restorable(&[rank0.clone(), rank1.clone()]),
        Err(ContractError::RankSpanMismatch(128, 512, 128, 448))
    );
    let rank2 = bundle(192, 512, &[(0, &[]), (1, &[]), (2, &[])]);
    assert_eq!(
        c.common_restorable(&[rank0.clone(), rank2]),
        Err(ContractError::RankSpanMismatch(128, 512, 192, 512))
    );
    // A malformed rank fails the whole intersection.
    let bad = bundle(128, 512, &[(0, &full), (1, &full)]);
    assert_eq!(
        c.common_restorable(&[rank0.clone(), bad]),
        Err(ContractError::MissingGroup(2))
    );
    assert_eq!(
        c.common_restorable(&[rank0]).unwrap(),
        vec![192, 256, 320, 384, 448, 512]
    );
}

#[test]
fn select_boundary_is_largest_at_or_below_limit() {
    let common = [192, 384, 512];
    assert_eq!(select_boundary(&common, 1000), Some(512));
    assert_eq!(select_boundary(&common, 512), Some(512));
    assert_eq!(select_boundary(&common, 511), Some(384));
    assert_eq!(select_boundary(&common, 192), Some(192));
    assert_eq!(select_boundary(&common, 191), None);
    assert_eq!(select_boundary(&[], u64::MAX), None);
}

#[test]
fn prompt_limit_leaves_the_final_token() {
    assert_eq!(prompt_limit(0), 0);
    assert_eq!(prompt_limit(1), 0);
    assert_eq!(prompt_limit(513), 512);
    assert_eq!(prompt_limit(512), 511);
    // A 512-token prompt cannot restore the boundary at 512.
    assert_eq!(select_boundary(&[448, 512], prompt_limit(512)), Some(448));
}

#[test]
fn vllm_window_keeps_w_minus_one_past_tokens() {
    assert_eq!(
        vllm_window_past_tokens(0),
        Err(ContractError::WindowTooSmall(0))
    );
    assert_eq!(
        vllm_window_past_tokens(1),
        Err(ContractError::WindowTooSmall(1))
    );
    assert_eq!(vllm_window_past_tokens(2), Ok(1));
    assert_eq!(vllm_window_past_tokens(101), Ok(100));
    assert_eq!(vllm_window_past_tokens(4096), Ok(4095));
    // W = 129 keeps 128 past tokens: exactly 2 pages of 64, not 3.
    let past = vllm_window_past_tokens(129).unwrap();
    let c = RecoveryContract::compile(&spec(
        64,
        vec![
            group(0, Rule::Prefix, &[AttentionKv]),
            group(1, Rule::Window { past_tokens: past }, &[SlidingWindowKv]),
        ],
    ))
    .unwrap();
    assert_eq!(c.required_ranges(ns(), 0, 512).unwrap()[1], rr(1, 384, 512));
}

// ---------------------------------------------------------------------------
// Load validation.
// ---------------------------------------------------------------------------

fn key(namespace: Namespace, group: u32, n: u8) -> StateKey {
    StateKey::new(namespace, group, &[n, 0xee]).unwrap()
}

#[test]
fn validate_load_accepts_exact_disjoint_covers() {
    let c = hybrid();
    let range = rr(1, 384, 512);
    let (a, b) = (key(ns(), 1, 1), key(ns(), 1, 2));
    let keys = [a, b];
    assert_eq!(c.validate_load(&range, &keys, &[a, b], &[]), Ok(()));
    assert_eq!(c.validate_load(&range, &keys, &[], &[b, a]), Ok(()));
    assert_eq!(c.validate_load(&range, &keys, &[b], &[a]), Ok(()));
    assert_eq!(c.validate_load(&range, &keys, &[a], &[b]), Ok(()));
    // An empty range needs no keys.
    assert_eq!(c.validate_load(&rr(2, 512, 512), &[], &[], &[]), Ok(()));
}

#[test]
fn validate_load_errors() {
    let c = hybrid();
    let range = rr(1, 384, 512);
    let (a, b, x) = (key(ns(), 1, 1), key(ns(), 1, 2), key(ns(), 1, 3));
    let keys = [a, b];

    assert_eq!(
        c.validate_load(&range, &[a], &[a], &[]),
        Err(LoadError::RangeKeyCount {
            group: 1,
            start: 384,
            end: 512,
            expected: 2,
            got: 1
        })
    );
    assert_eq!(
        c.validate_load(&range, &[a, b, x], &[a, b, x], &[]),
        Err(LoadError::RangeKeyCount {
            group: 1,
            start: 384,
            end: 512,
            expected: 2,
            got: 3
        })
    );

    let wrong_group = key(ns(), 0, 2);
    assert_eq!(
        c.validate_load(&range, &[a, wrong_group], &[a, wrong_group], &[]),
        Err(LoadError::ForeignKey(wrong_group))
    );
    let wrong_ns = key(other_ns(), 1, 2);
    assert_eq!(
        c.validate_load(&range, &[a, wrong_ns], &[a, wrong_ns], &[]),
        Err(LoadError::ForeignKey(wrong_ns))
    );

    assert_eq!(
        c.validate_load(&range, &[a, a], &[a], &[]),
        Err(LoadError::DuplicateKey(a))
    );
    // The in-order load (every page taken, none held) still refuses a
    // range whose keys repeat.
    assert_eq!(
        c.validate_load(&range, &[a, a], &[a, a], &[]),
        Err(LoadError::DuplicateKey(a))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[a, a, b], &[]),
        Err(LoadError::DuplicateKey(a))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[a], &[b, b]),
        Err(LoadError::DuplicateKey(b))
    );

    assert_eq!(
        c.validate_load(&range, &keys, &[a, b], &[a]),
        Err(LoadError::Overlap(a))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[b], &[a, b]),
        Err(LoadError::Overlap(b))
    );

    assert_eq!(
        c.validate_load(&range, &keys, &[a], &[]),
        Err(LoadError::Missing(b))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[], &[]),
        Err(LoadError::Missing(a))
    );

    assert_eq!(
        c.validate_load(&range, &keys, &[a, b, x], &[]),
        Err(LoadError::Unexpected(x))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[a], &[b, x]),
        Err(LoadError::Unexpected(x))
    );
    // A key of another namespace or group in the load is not in the range.
    assert_eq!(
        c.validate_load(&range, &keys, &[a, b], &[wrong_ns]),
        Err(LoadError::Unexpected(wrong_ns))
    );
    assert_eq!(
        c.validate_load(&range, &keys, &[wrong_group], &[a, b]),
        Err(LoadError::Unexpected(wrong_group))
    );
}

// ---------------------------------------------------------------------------
// JSON forms.
// ---------------------------------------------------------------------------

fn ns_hex() -> String {
    "ab".repeat(32)
}

fn contract_json() -> String {
    format!(
        r#"{{"namespace": "{}", "page_tokens": 64, "groups": [
            {{"id":0,"rule":"prefix","components":["attention_kv"]}},
            {{"id":1,"rule":{{"window":100}},"components":["sliding_window_kv"]}},
            {{"id":2,"rule":"checkpoint","components":["recurrent_checkpoint","convolution_state"]}}
        ]}}"#,
        ns_hex()
    )
}

fn bundle_json() -> String {
    format!(
        r#"{{"namespace": "{}", "start":128, "end":512, "groups":[
            {{"group":0,"page_ends":[192,256,320,384,448,512]}},
            {{"group":1,"page_ends":[320,384,448,512]}},
            {{"group":2,"page_ends":[384,512]}}
        ]}}"#,
        ns_hex()
    )
}

#[test]
fn contract_json_parses_and_compiles() {
    let s: ContractSpec = serde_json::from_str(&contract_json()).unwrap();
    assert_eq!(s, hybrid_spec());
    let c = RecoveryContract::compile(&s).unwrap();
    assert_eq!(
        c.required_ranges(ns(), 128, 512).unwrap(),
        vec![rr(0, 128, 512), rr(1, 384, 512), rr(2, 448, 512)]
    );
    // Round trip.
    let back: ContractSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(back, s);
    assert_eq!(
        serde_json::to_value(Rule::Window { past_tokens: 100 }).unwrap(),
        serde_json::json!({"window": 100})
    );
    assert_eq!(
        serde_json::to_value(Rule::Prefix).unwrap(),
        serde_json::json!("prefix")
    );
    assert_eq!(
        serde_json::to_value(Rule::Checkpoint).unwrap(),
        serde_json::json!("checkpoint")
    );
}

#[test]
fn bundle_json_parses_and_validates() {
    let b: StateBundle = serde_json::from_str(&bundle_json()).unwrap();
    assert_eq!(b.namespace, ns());
    assert_eq!((b.start, b.end), (128, 512));
    assert_eq!(
        b.groups[2],
        GroupEvidence {
            group: 2,
            page_ends: vec![384, 512]
        }
    );
    assert_eq!(hybrid().restorable_boundaries(&b).unwrap(), vec![384, 512]);
}

#[test]
fn json_rejects_unknown_fields() {
    let mut contract: serde_json::Value = serde_json::from_str(&contract_json()).unwrap();
    contract["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<ContractSpec>(contract).is_err());

    let mut contract: serde_json::Value = serde_json::from_str(&contract_json()).unwrap();
    contract["groups"][0]["extra"] = serde_json::json!(true);
    assert!(serde_json::from_value::<ContractSpec>(contract).is_err());

    let mut contract: serde_json::Value = serde_json::from_str(&contract_json()).unwrap();
    contract["groups"][1]["rule"] = serde_json::json!({"window": 100, "extra": 1});
    assert!(serde_json::from_value::<ContractSpec>(contract).is_err());

    let mut contract: serde_json::Value = serde_json::from_str(&contract_json()).unwrap();
    contract["groups"][1]["rule"] = serde_json::json!("sliding");
    assert!(serde_json::from_value::<ContractSpec>(contract).is_err());

    let mut contract: serde_json::Value = serde_json::from_str(&contract_json()).unwrap();
    contract["groups"][0]["components"] = serde_json::json!(["attention"]);
    assert!(serde_json::from_value::<ContractSpec>(contract).is_err());

    let mut bundle: serde_json::Value = serde_json::from_str(&bundle_json()).unwrap();
    bundle["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<StateBundle>(bundle).is_err());

    let mut bundle: serde_json::Value = serde_json::from_str(&bundle_json()).unwrap();
    bundle["groups"][1]["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<StateBundle>(bundle).is_err());

    // The unmodified documents still parse (the mutations above are what fail).
    assert!(serde_json::from_str::<ContractSpec>(&contract_json()).is_ok());
    assert!(serde_json::from_str::<StateBundle>(&bundle_json()).is_ok());
}

#[test]
fn json_dsa_parses_but_compile_rejects() {
    let json = format!(
        r#"{{"namespace": "{}", "page_tokens": 64, "groups": [
            {{"id":0,"rule":"prefix","components":["attention_kv","dsa"]}}
        ]}}"#,
        ns_hex()
    );
    let s: ContractSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(s.groups[0].components, vec![AttentionKv, Dsa]);
    assert_eq!(
        compile_err(&s),
        ContractError::UnsupportedComponent {
            group: 0,
            kind: Dsa
        }
    );
    for (name, kind) in [("draft", Draft), ("auxiliary", Auxiliary)] {
        let parsed: ComponentKind = serde_json::from_str(&format!("\"{name}\"")).unwrap();
        assert_eq!(parsed, kind);
    }
}

#[test]
fn json_empty_namespace_is_rejected_at_parse() {
    let json = contract_json().replace(&ns_hex(), &"0".repeat(64));
    assert!(serde_json::from_str::<ContractSpec>(&json).is_err());
}

// ---------------------------------------------------------------------------
// Property tests against a brute-force checker.
// ---------------------------------------------------------------------------

/// A naive model of a group's rule.
#[derive(Debug, Clone, Copy)]
enum NaiveRule {
    Prefix,
    Window(u64),
    Checkpoint,
}

/// The range a group needs to resume at `b` from origin `start`, computed
/// with plain arithmetic straight from the rules.
fn naive_range(rule: NaiveRule, page: u64, start: u64, b: u64) -> (u64, u64) {
    if b == start {
        return (start, start);
    }
    match rule {
        NaiveRule::Prefix => (start, b),
        NaiveRule::Window(past) => {
            let pages = past / page + u64::from(past % page != 0);
            let span = pages * page;
            let from = if b >= start + span { b - span } else { start };
            (from, b)
        }
        NaiveRule::Checkpoint => (b - page, b),
    }
}

/// Every legal boundary in `(start, end]` for one rank, by brute force.
fn naive_legal(
    rules: &[(u32, NaiveRule)],
    page: u64,
    start: u64,
    end: u64,
    held: &[(u32, BTreeSet<u64>)],
) -> Vec<u64> {
    let mut out = Vec::new();
    let mut b = start + page;
    while b <= end {
        let legal = rules.iter().all(|&(id, rule)| {
            let set = &held.iter().find(|(g, _)| *g == id).unwrap().1;
            let (rs, re) = naive_range(rule, page, start, b);
            let mut e = rs + page;
            while e <= re {
                if !set.contains(&e) {
                    return false;
                }
                e += page;
            }
            true
        });
        if legal {
            out.push(b);
        }
        b += page;
    }
    out
}

#[derive(Debug, Clone)]
struct Case {
    page: u64,
    /// Declared groups, in declaration (shuffled) order.
    groups: Vec<GroupSpec>,
    start: u64,
    end: u64,
    /// ranks[r][i]: page ends held by declared group i on rank r.
    ranks: Vec<Vec<Vec<u64>>>,
    limit: u64,
    query_end: u64,
}

fn rule_and_components() -> impl Strategy<Value = (Rule, Vec<ComponentKind>)> {
    prop_oneof![
        prop::sample::subsequence(vec![AttentionKv, MlaKv], 1..=2).prop_map(|c| (Rule::Prefix, c)),
        prop_oneof![1u64..=8, 1u64..=300]
            .prop_map(|past_tokens| (Rule::Window { past_tokens }, vec![SlidingWindowKv])),
        prop::sample::subsequence(vec![RecurrentCheckpoint, ConvolutionState], 1..=2)
            .prop_map(|c| (Rule::Checkpoint, c)),
    ]
}

fn evidence(n_pages: usize) -> impl Strategy<Value = Vec<bool>> {
    (
        prop::sample::select(vec![40u8, 80, 95, 100]),
        prop::collection::vec(0u8..100, n_pages),
    )
        .prop_map(|(density, rolls)| rolls.into_iter().map(|r| r < density).collect())
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1u64, 2, 4, 16, 64]),
        prop::sample::subsequence((1u32..12).collect::<Vec<_>>(), 0..=3),
        prop::collection::vec(rule_and_components(), 3),
        prop::collection::vec(
            prop::sample::subsequence(vec![AttentionKv, MlaKv], 1..=2),
            1,
        ),
        0u64..8,
        0usize..=24,
        1usize..=3,
    )
        .prop_flat_map(
            |(page, other_ids, other_rules, g0_comps, start_pages, n_pages, n_ranks)| {
                let mut groups = vec![group(0, Rule::Prefix, &g0_comps[0])];
                for (i, &id) in other_ids.iter().enumerate() {
                    let (rule, comps) = &other_rules[i];
                    groups.push(group(id, *rule, comps));
                }
                let n_groups = groups.len();
                let start = start_pages * page;
                let end = start + n_pages as u64 * page;
                (
                    Just(groups).prop_shuffle(),
                    Just((page, start, end, n_pages)),
                    prop::collection::vec(
                        prop::collection::vec(evidence(n_pages), n_groups),
                        n_ranks,
                    ),
                    0..=end + 2 * page,
                    0..=n_pages as u64,
                )
            },
        )
        .prop_map(
            |(groups, (page, start, end, _), ranks, limit, query_pages)| Case {
                page,
                groups,
                start,
                end,
                ranks: ranks
                    .into_iter()
                    .map(|rank| {
                        rank.into_iter()
                            .map(|bits| {
                                bits.iter()
                                    .enumerate()
                                    .filter(|&(_, &held)| held)
                                    .map(|(i, _)| start + (i as u64 + 1) * page)
                                    .collect()
                            })
                            .collect()
                    })
                    .collect(),
                limit,
                query_end: start + query_pages * page,
            },
        )
}

fn naive_rules(groups: &[GroupSpec]) -> Vec<(u32, NaiveRule)> {
    let mut out: Vec<(u32, NaiveRule)> = groups
        .iter()
        .map(|g| {
            let r = match g.rule {
                Rule::Prefix => NaiveRule::Prefix,
                Rule::Window { past_tokens } => NaiveRule::Window(past_tokens),
                Rule::Checkpoint => NaiveRule::Checkpoint,
            };
            (g.id, r)
        })
        .collect();
    out.sort_by_key(|&(id, _)| id);
    out
}

fn rank_bundle(case: &Case, rank: usize) -> StateBundle {
    let mut groups: Vec<GroupEvidence> = case
        .groups
        .iter()
        .zip(&case.ranks[rank])
        .map(|(g, ends)| GroupEvidence {
            group: g.id,
            page_ends: ends.clone(),
        })
        .collect();
    if rank % 2 == 1 {
        groups.reverse();
    }
    StateBundle {
        namespace: ns(),
        start: case.start,
        end: case.end,
        groups,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn prop_boundaries_match_brute_force(case in case()) {
        let s = ContractSpec { namespace: ns(), page_tokens: case.page, groups: case.groups.clone() };
        let c = RecoveryContract::compile(&s).expect("generated contracts are valid");
        let rules = naive_rules(&case.groups);
        let page = case.page;

        // Required ranges: aligned, within [start, end], one per group in
        // ascending group order, ending at the queried end, and equal to the
        // naive rule arithmetic.
        for q in [case.start, case.query_end, case.end] {
            let ranges = c.required_ranges(ns(), case.start, q).unwrap();
            prop_assert_eq!(ranges.len(), rules.len());
            for (r, &(id, rule)) in ranges.iter().zip(&rules) {
                prop_assert_eq!(r.group, id);
                prop_assert_eq!(r.end, q);
                prop_assert_eq!(r.start % page, 0);
                prop_assert_eq!(r.end % page, 0);
                prop_assert!(case.start <= r.start && r.start <= r.end && r.end <= case.end);
                prop_assert_eq!((r.start, r.end), naive_range(rule, page, case.start, q));
            }
        }

        // Per-rank legal sets equal the brute-force sets exactly.
        let mut sets = Vec::new();
        let mut bundles = Vec::new();
        for rank in 0..case.ranks.len() {
            let held: Vec<(u32, BTreeSet<u64>)> = case
                .groups
                .iter()
                .zip(&case.ranks[rank])
                .map(|(g, ends)| (g.id, ends.iter().copied().collect()))
                .collect();
            let bundle = rank_bundle(&case, rank);
            let got = c.restorable_boundaries(&bundle).unwrap();
            let want = naive_legal(&rules, page, case.start, case.end, &held);
            prop_assert_eq!(&got, &want, "rank {}", rank);
            sets.push(got);
            bundles.push(bundle);
        }

        // Intersection: naive, commutative, a subset of every rank's set.
        let naive_common: Vec<u64> = sets[0]
            .iter()
            .copied()
            .filter(|b| sets.iter().all(|s| s.contains(b)))
            .collect();
        let common = common_boundaries(&sets);
        prop_assert_eq!(&common, &naive_common);
        let mut reversed = sets.clone();
        reversed.reverse();
        prop_assert_eq!(&common_boundaries(&reversed), &common);
        let mut rotated = sets.clone();
        rotated.rotate_left(1);
        prop_assert_eq!(&common_boundaries(&rotated), &common);
        for s in &sets {
            prop_assert!(common.iter().all(|b| s.contains(b)));
        }
        prop_assert_eq!(&c.common_restorable(&bundles).unwrap(), &common);
        let mut rev_bundles = bundles.clone();
        rev_bundles.reverse();
        prop_assert_eq!(&c.common_restorable(&rev_bundles).unwrap(), &common);

        // Selection: the largest common boundary at or below the limit.
        let want_sel = naive_common.iter().copied().filter(|&b| b <= case.limit).max();
        prop_assert_eq!(select_boundary(&common, case.limit), want_sel);
        if let Some(b) = want_sel {
            prop_assert!(common.contains(&b));
        }
    }

    #[test]
    fn prop_common_boundaries_is_commutative_intersection(
        sets in prop::collection::vec(prop::collection::vec(0u64..40, 0..20), 0..5)
    ) {
        let got = common_boundaries(&sets);
        let want: Vec<u64> = match sets.first() {
            None => Vec::new(),
            Some(first) => first
                .iter()
                .copied()
                .collect::<BTreeSet<u64>>()
                .into_iter()
                .filter(|b| sets.iter().all(|s| s.contains(b)))
                .collect(),
        };
        prop_assert_eq!(&got, &want);
        let mut reversed = sets.clone();
        reversed.reverse();
        prop_assert_eq!(&common_boundaries(&reversed), &got);
        if !sets.is_empty() {
            let mut rotated = sets.clone();
            rotated.rotate_left(1);
            prop_assert_eq!(&common_boundaries(&rotated), &got);
        }
        for s in &sets {
            prop_assert!(got.iter().all(|b| s.contains(b)));
        }
    }
}
