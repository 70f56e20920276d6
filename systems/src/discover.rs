//! Stage 2, discover: which required pages exist, per rank and group.
//! Metadata only: the DRAM index and each lower tier's index; no payload
//! reads and no byte reservations. A query that finds nothing while a tier
//! cannot be reached misses with that tier's reason (`remote_unavailable`):
//! its pages may be there, and an outage is not `not_found`.

use bevy_ecs::prelude::*;
use orbitkv_components::api::MissReason;
use orbitkv_components::contract::Rule;
use orbitkv_components::ecs::{Instance, OpState, Operation, RankState, Recovery, at};
use orbitkv_components::{KeyRef, NativeHash, StateKey};
use orbitkv_io::tier::{BackingTier, TierError};

use crate::lifecycle::set_state;
use crate::resources::{Dram, Metrics, Tiers};

pub fn discover(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut Recovery), With<at::Discover>>,
    instances: Query<&Instance>,
    dram: Res<Dram>,
    mut tiers: ResMut<Tiers>,
    mut metrics: ResMut<Metrics>,
) {
    let tiers = tiers.0.get_mut();
    for (entity, mut op, mut rec) in &mut ops {
        set_state(&mut commands, entity, &mut op, OpState::Validate);
        discover_one(
            &mut rec,
            instances.get(op.instance).ok(),
            &dram,
            tiers,
            &mut metrics,
        );
    }
}

/// One recovery's discovery: its candidates per (rank, group), or the
/// miss it already is (`rec.miss`). `instance`: the operation's, `None`
/// once it is gone. Also answers a `Lookup` inline, at ingest.
pub fn discover_one(
    rec: &mut Recovery,
    instance: Option<&Instance>,
    dram: &Dram,
    tiers: &[Box<dyn BackingTier>],
    metrics: &mut Metrics,
) {
    let Some(instance) = instance else {
        rec.miss = Some(MissReason::Namespace);
        return;
    };
    let namespaces = instance.ranks.iter().map(|r| r.namespace);
    if !rec.expect_namespaces.is_empty() && !namespaces.eq(rec.expect_namespaces.iter().copied()) {
        rec.miss = Some(MissReason::Namespace);
        return;
    }
    let mut candidates = Vec::new();
    let mut raced = false;
    for (index, rank) in instance.ranks.iter().enumerate() {
        let hashes = |group: u32| {
            let g = rec.groups.iter().find(|g| g.group == group);
            &g.expect("validated at ingest").hashes[..]
        };
        let span = (rec.origin, rec.end);
        let found = rank_candidates(&hashes, span, instance.page_tokens, rank, dram, tiers);
        if dram.journal.counts_races() && !raced {
            raced =
                stopped_at_a_removed_page(&found, &hashes, span, instance.page_tokens, rank, dram);
        }
        candidates.extend(found.into_iter().map(|(g, ends)| (index as u32, g, ends)));
    }
    if candidates.iter().all(|(_, _, ends)| ends.is_empty()) {
        rec.miss = unreachable(tiers);
    }
    if raced {
        metrics.event_races += 1;
    }
    rec.candidates = candidates;
}

/// Whether the prefix group's pages on this rank stop short at a page DRAM
/// removed lately (see `PageJournal::removed_lately`).
fn stopped_at_a_removed_page<'h>(
    found: &[(u32, Vec<u64>)],
    hashes: &dyn Fn(u32) -> &'h [NativeHash],
    span: (u64, u64),
    page: u64,
    rank: &RankState,
    dram: &Dram,
) -> bool {
    let Some(group) = rank.contract.groups().first() else {
        return false;
    };
    if group.rule != Rule::Prefix || page == 0 {
        return false;
    }
    let Some((_, ends)) = found.iter().find(|(g, _)| *g == group.id) else {
        return false;
    };
    let gap = span.0 / page + ends.len() as u64;
    if gap >= span.1 / page {
        return false;
    }
    hashes(group.id).get(gap as usize).is_some_and(|native| {
        dram.journal.removed_lately(&KeyRef {
            namespace: &rank.namespace,
            group: group.id,
            native,
        })
    })
}

/// The reason of the first tier that cannot be reached now, if one cannot.
pub fn unreachable(tiers: &[Box<dyn BackingTier>]) -> Option<MissReason> {
    let down = TierError::Unavailable("unreachable at discovery".into());
    tiers
        .iter()
        .find(|t| t.unavailable())
        .map(|t| t.miss_reason(&down))
}

/// Page ends present for each group of one rank within `span` (absolute
/// tokens, page-aligned), ascending. `hashes` gives each group's chained
/// hashes, at least `span.1 / page` of them (the caller checked).
pub fn rank_candidates<'h>(
    hashes: &dyn Fn(u32) -> &'h [NativeHash],
    span: (u64, u64),
    page: u64,
    rank: &RankState,
    dram: &Dram,
    tiers: &[Box<dyn BackingTier>],
) -> Vec<(u32, Vec<u64>)> {
    let first = span.0 / page;
    // Groups are sorted, so group 0 comes first (the prefix group when there
    // is one); every rule needs the page ending at a legal boundary, so pages
    // past group 0's last found page can never be part of one.
    let mut last = span.1 / page;
    let mut out = Vec::new();
    for group in rank.contract.groups() {
        let hashes = hashes(group.id);
        let mut ends = Vec::with_capacity(last.saturating_sub(first) as usize);
        for index in first..last {
            // The caller gave at least `span.1 / page` hashes; a shorter list
            // ends the group here rather than panicking.
            let Some(native) = hashes.get(index as usize) else {
                break;
            };
            // The DRAM index by borrowed parts; a whole key only for the
            // lower tiers, and only when DRAM lacks the page.
            let parts = KeyRef {
                namespace: &rank.namespace,
                group: group.id,
                native,
            };
            let held = dram.index.contains_key(&parts) || {
                let key = StateKey {
                    namespace: rank.namespace,
                    group: group.id,
                    native: *native,
                };
                tiers.iter().any(|t| t.lookup(&key).is_some())
            };
            if held {
                ends.push((index + 1) * page);
            } else if group.rule == Rule::Prefix {
                break;
            }
        }
        if group.id == 0 {
            last = ends.last().map_or(first, |e| e / page);
        }
        out.push((group.id, ends));
    }
    out
}
