//! Stage 3, validate: candidates → legal boundaries per rank (the compiled
//! contract) → intersection across ranks → the selected boundary, clamped so
//! the engine still computes the final prompt token.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{Candidates, Event, MissReason};
use orbitkv_components::contract::{GroupEvidence, StateBundle};
use orbitkv_components::ecs::{Instance, OpState, Operation, Outcome, Recovery, at};
use orbitkv_components::{common_boundaries, prompt_limit, select_boundary};

use crate::lifecycle::{finish, set_state};
use crate::resources::{Metrics, Outbox, RestorePolicy};

pub fn validate(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut Recovery), With<at::Validate>>,
    instances: Query<&Instance>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    policy: Res<RestorePolicy>,
) {
    for (entity, mut op, mut rec) in &mut ops {
        metrics.queried_tokens += rec.end - rec.origin;
        // Nothing after this stage reads the evidence: it moves into the
        // event.
        let mut candidates = std::mem::take(&mut rec.candidates);
        let (selected, common, miss) = match (rec.miss, instances.get(op.instance)) {
            (Some(reason), _) => (None, Vec::new(), Some(reason)),
            (None, Err(_)) => (None, Vec::new(), Some(MissReason::Namespace)),
            (None, Ok(instance)) => select(instance, &mut rec, &mut candidates),
        };
        let (selected, miss) = match selected {
            Some(b) if b.saturating_sub(rec.origin) < policy.min_load_tokens => {
                // Found, but too little to be worth a load: nothing is
                // selected, so nothing is leased or read.
                rec.selected = None;
                rec.ranges.clear();
                (None, Some(MissReason::NotWorthLoading))
            }
            _ => (selected, miss),
        };
        // A lookup's result ends it whatever it says; a query's only with
        // a miss (a hit goes on to prepare, or waits for its release).
        let terminal = rec.peek || miss.is_some();
        outbox.push_ending(
            op.origin,
            Event::QueryResult {
                command: op.command,
                request: op.request,
                operation: entity.to_bits(),
                candidates: candidates
                    .into_iter()
                    .map(|(rank, group, page_ends)| Candidates {
                        rank,
                        group,
                        page_ends,
                    })
                    .collect(),
                common,
                selected,
                miss,
            },
            terminal,
        );
        let next = match miss {
            Some(reason) => {
                metrics.miss(reason);
                op.reported = true;
                finish(&mut commands, entity, &mut op, Outcome::Miss(reason));
                continue;
            }
            None if rec.peek => {
                // Its result was its last word: no `Released` follows.
                op.reported = true;
                finish(&mut commands, entity, &mut op, Outcome::Released);
                continue;
            }
            None if rec.prepare => OpState::Admit,
            None => OpState::Selected,
        };
        set_state(&mut commands, entity, &mut op, next);
    }
}

/// Returns (selected, common boundaries, miss reason). `candidates` are
/// lent to each rank's bundle and given back.
fn select(
    instance: &Instance,
    rec: &mut Recovery,
    candidates: &mut [(u32, u32, Vec<u64>)],
) -> (Option<u64>, Vec<u64>, Option<MissReason>) {
    if candidates.iter().all(|(_, _, ends)| ends.is_empty()) {
        return (None, Vec::new(), Some(MissReason::NotFound));
    }
    let mut per_rank = Vec::with_capacity(instance.ranks.len());
    for (index, rank) in instance.ranks.iter().enumerate() {
        let of_rank = |c: &&mut (u32, u32, Vec<u64>)| c.0 as usize == index;
        let bundle = StateBundle {
            namespace: rank.namespace,
            start: rec.origin,
            end: rec.end,
            groups: candidates
                .iter_mut()
                .filter(of_rank)
                .map(|(_, group, ends)| GroupEvidence {
                    group: *group,
                    page_ends: std::mem::take(ends),
                })
                .collect(),
        };
        let legal = rank.contract.restorable_boundaries(&bundle);
        for (c, ev) in candidates.iter_mut().filter(of_rank).zip(bundle.groups) {
            c.2 = ev.page_ends;
        }
        match legal {
            Ok(b) if b.is_empty() => return (None, Vec::new(), Some(MissReason::IncompleteGroup)),
            Ok(b) => per_rank.push(b),
            // Discovery builds well-formed bundles; if one is not, the
            // evidence cannot be trusted.
            Err(_) => return (None, Vec::new(), Some(MissReason::IncompleteGroup)),
        }
    }
    let common = common_boundaries(&per_rank);
    let Some(selected) = select_boundary(&common, prompt_limit(rec.prompt_len)) else {
        return (None, common, Some(MissReason::NoLegalBoundary));
    };
    rec.selected = Some(selected);
    rec.ranges = instance
        .ranks
        .iter()
        .enumerate()
        .flat_map(|(index, rank)| {
            rank.contract
                .required_ranges(rank.namespace, rec.origin, selected)
                .expect("selected boundary is aligned and within the span")
                .into_iter()
                .map(move |r| (index as u32, r))
        })
        .collect();
    (Some(selected), common, None)
}
