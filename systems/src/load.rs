//! What a restore must cover, checked once for both ways in: a `Restore`
//! command (checked at ingest, against its `Ready` operation) and a
//! `Load` (checked by the read stage the moment its operation is ready).

use std::collections::HashSet;

use orbitkv_components::api::{CommandError, InvalidCommand, LoadRefusal, PagePos, RestoreTarget};
use orbitkv_components::ecs::{Instance, LoadPlan, Recovery};
use orbitkv_components::{KeyHasher, StateKey};

/// The transferred and retained keys must exactly cover every required
/// range of the ranks `checked` accepts (`validate_load`), no target twice,
/// nothing outside the ranges.
pub(crate) fn check(
    instance: &Instance,
    rec: &Recovery,
    targets: &[RestoreTarget],
    retained: &[PagePos],
    checked: impl Fn(u32) -> bool,
) -> Result<(), CommandError> {
    let invalid = CommandError::Invalid;
    let mut seen = HashSet::with_capacity_and_hasher(targets.len(), KeyHasher::default());
    if let Some(t) = targets.iter().find(|t| !seen.insert(t.device_page)) {
        return Err(invalid(InvalidCommand::DuplicateTarget {
            device_page: t.device_page,
        }));
    }
    let page = instance.page_tokens;
    for (rank, range) in rec.ranges.iter().filter(|(r, _)| checked(*r)) {
        let Some(state) = instance.ranks.get(*rank as usize) else {
            unreachable!("ranges are computed for the instance's ranks");
        };
        let key_at = |p: &PagePos| -> Result<StateKey, CommandError> {
            let native = rec.hash_at(p.group, p.page_end, page).ok_or_else(|| {
                invalid(InvalidCommand::NoHash {
                    page_end: p.page_end,
                })
            })?;
            Ok(StateKey {
                namespace: state.namespace,
                group: p.group,
                native,
            })
        };
        let in_range = |p: &&PagePos| p.rank == *rank && p.group == range.group;
        let range_keys = (range.start / page..range.end / page)
            .map(|i| {
                key_at(&PagePos {
                    rank: *rank,
                    group: range.group,
                    page_end: (i + 1) * page,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The usual load names the range's pages in order, one each: its
        // keys are the range's keys, not built a second time.
        let mut named = targets.iter().map(|t| &t.pos).filter(in_range);
        let in_order = (range.start / page..range.end / page)
            .all(|i| named.next().is_some_and(|p| p.page_end == (i + 1) * page))
            && named.next().is_none();
        let moved: Vec<StateKey> = if in_order {
            Vec::new()
        } else {
            targets
                .iter()
                .map(|t| &t.pos)
                .filter(in_range)
                .map(key_at)
                .collect::<Result<_, _>>()?
        };
        let kept: Vec<StateKey> = retained
            .iter()
            .filter(in_range)
            .map(key_at)
            .collect::<Result<_, _>>()?;
        let moved = if in_order { &range_keys } else { &moved };
        state
            .contract
            .validate_load(range, &range_keys, moved, &kept)
            .map_err(|e| CommandError::LoadInvalid(e.into()))?;
    }
    // Positions outside every range were not counted above.
    match targets
        .iter()
        .map(|t| &t.pos)
        .chain(retained)
        .find(|p| !covered(rec, p))
    {
        Some(p) => Err(CommandError::LoadInvalid(LoadRefusal::OutsideRanges {
            pos: *p,
        })),
        None => Ok(()),
    }
}

/// Whether `p` is a page of one of the selected ranges.
fn covered(rec: &Recovery, p: &PagePos) -> bool {
    rec.ranges.iter().any(|(r, g)| {
        *r == p.rank && g.group == p.group && p.page_end > g.start && p.page_end <= g.end
    })
}

/// A ready `Load`'s restore: of the engine's targets and attested
/// positions, those in the selected ranges of its ranks, checked as a
/// `Restore` of exactly those would be.
pub(crate) fn accept(
    instance: &Instance,
    rec: &Recovery,
    plan: LoadPlan,
) -> Result<(Vec<RestoreTarget>, Vec<PagePos>), CommandError> {
    let ours = |p: &PagePos| plan.ranks.contains(&p.rank) && covered(rec, p);
    let targets: Vec<RestoreTarget> = plan.targets.into_iter().filter(|t| ours(&t.pos)).collect();
    let retained: Vec<PagePos> = plan.retained.into_iter().filter(|p| ours(p)).collect();
    check(instance, rec, &targets, &retained, |r| {
        plan.ranks.contains(&r)
    })?;
    Ok((targets, retained))
}
