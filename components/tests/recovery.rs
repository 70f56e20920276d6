//! `Recovery::needs_at`: each position's need, whatever order the engine
//! names its targets in, and `None` for a position nothing needs.

use orbitkv_components::api::PagePos;
use orbitkv_components::ecs::{NeedState, PageNeed, Recovery};
use orbitkv_components::{Namespace, StateKey};

fn pos(rank: u32, group: u32, page: u64) -> PagePos {
    PagePos {
        rank,
        group,
        page_end: page * 16,
    }
}

/// Needs for pages 1..=n of groups 0 and 1 on one rank, each a distinct
/// size so a wrong match shows.
fn recovery(n: u64) -> Recovery {
    let mut rec = Recovery::new(Vec::new(), 0, n * 16, n * 16 + 1);
    for group in 0..2u32 {
        for page in 1..=n {
            rec.needs.push(PageNeed {
                pos: pos(0, group, page),
                key: StateKey::new(Namespace([1; 32]), group, &page.to_le_bytes()).unwrap(),
                bytes: u64::from(group) * 1000 + page,
                state: NeedState::Pending,
                from_tier: false,
                residency: None,
                checksum: 0,
            });
        }
    }
    rec
}

fn bytes_at(rec: &Recovery, positions: &[PagePos]) -> Vec<Option<u64>> {
    rec.needs_at(positions)
        .map(|n| n.map(|n| n.bytes))
        .collect()
}

#[test]
fn in_need_order() {
    let rec = recovery(64);
    let positions: Vec<PagePos> = rec.needs.iter().map(|n| n.pos).collect();
    let got = bytes_at(&rec, &positions);
    let want: Vec<Option<u64>> = rec.needs.iter().map(|n| Some(n.bytes)).collect();
    assert_eq!(got, want);
}

#[test]
fn in_any_order_and_with_gaps() {
    let rec = recovery(64);
    // Group 1 first, descending, then some of group 0: no target sits at
    // its need's index.
    let mut positions: Vec<PagePos> = (1..=64).rev().map(|p| pos(0, 1, p)).collect();
    positions.extend((1..=64).step_by(3).map(|p| pos(0, 0, p)));
    let got = bytes_at(&rec, &positions);
    let want: Vec<Option<u64>> = positions
        .iter()
        .map(|p| Some(u64::from(p.group) * 1000 + p.page_end / 16))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn a_position_nothing_needs_is_none() {
    let rec = recovery(8);
    let positions = [
        pos(0, 0, 1),
        pos(1, 0, 1),
        pos(0, 2, 1),
        pos(0, 0, 9),
        pos(0, 1, 8),
    ];
    assert_eq!(
        bytes_at(&rec, &positions),
        vec![Some(1), None, None, None, Some(1008)]
    );
}
