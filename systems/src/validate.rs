//! Stage 3, validate: candidates → legal boundaries per rank (the compiled
//! contract) → intersection across ranks → the selected boundary, clamped so
//! the engine still computes the final prompt token.

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::api::{Candidates, CommandId, Event, MissReason};
use orbitkv_components::contract::{GroupEvidence, RequiredRange, StateBundle};
use orbitkv_components::ecs::{Instance, OpState, Operation, Outcome, Recovery, at};
use orbitkv_components::{StateKey, common_boundaries, prompt_limit, select_boundary};
use orbitkv_io::tier::BackingTier;

use crate::lifecycle::{finish, set_state};
use crate::resources::{Dram, LoadRates, Metrics, Outbox, RestorePolicy, Tiers};

pub fn validate(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut Recovery), With<at::Validate>>,
    instances: Query<&Instance>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    mut worth: Worth,
) {
    let Worth {
        policy,
        rates,
        dram,
        tiers,
    } = &mut worth;
    let tiers = tiers.0.get_mut();
    for (entity, mut op, mut rec) in &mut ops {
        let judge = Judge {
            policy,
            rates,
            dram,
            tiers,
        };
        let (result, miss) = conclude(
            (op.command, op.request),
            entity.to_bits(),
            &mut rec,
            instances.get(op.instance).ok(),
            &judge,
            &mut metrics,
        );
        // A lookup's result ends it whatever it says; a query's only with
        // a miss (a hit goes on to prepare, or waits for its release).
        let terminal = rec.peek || miss.is_some();
        outbox.push_ending(op.origin, result, terminal);
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

/// What `conclude` reads besides the recovery: whether a found prefix is
/// worth loading, and where its pages are.
pub struct Judge<'a> {
    pub policy: &'a RestorePolicy,
    pub rates: &'a LoadRates,
    pub dram: &'a Dram,
    pub tiers: &'a [Box<dyn BackingTier>],
}

/// One discovered recovery's `QueryResult` (answering `(command,
/// request)`, for the operation named `operation`)
/// and its miss reason, if it missed: candidates → legal boundaries →
/// the selected boundary (`rec.selected`, `rec.ranges`), or nothing when
/// it is too little to be worth a load. Counts the queried tokens; the
/// caller counts the miss. Also answers a `Lookup` inline, at ingest.
pub fn conclude(
    (command, request): (CommandId, u64),
    operation: u64,
    rec: &mut Recovery,
    instance: Option<&Instance>,
    judge: &Judge,
    metrics: &mut Metrics,
) -> (Event, Option<MissReason>) {
    let Judge {
        policy,
        rates,
        dram,
        tiers,
    } = *judge;
    metrics.queried_tokens += rec.end - rec.origin;
    // Nothing after this stage reads the evidence: it moves into the
    // event.
    let mut candidates = std::mem::take(&mut rec.candidates);
    let (selected, common, miss) = match (rec.miss, instance) {
        (Some(reason), _) => (None, Vec::new(), Some(reason)),
        (None, None) => (None, Vec::new(), Some(MissReason::Namespace)),
        (None, Some(instance)) => select(instance, rec, &mut candidates),
    };
    // The ranges a selected boundary needs: what a later prepare or load
    // leases, and what the cost gate weighs. A lookup that no gate weighs
    // ends here, and they would be built only to be dropped.
    if let (Some(b), Some(instance)) = (selected, instance)
        && (!rec.peek || policy.prefill_tokens_per_s > 0)
    {
        rec.ranges = required_ranges(instance, rec.origin, b);
    }
    let slower = |rec: &Recovery| {
        instance.is_some_and(|instance| {
            slower_than_recompute(policy, rates, rec, instance, dram, tiers)
        })
    };
    let (selected, miss) = match selected {
        Some(b)
            if b.saturating_sub(rec.origin) < policy.min_load_tokens
                || (policy.prefill_tokens_per_s > 0 && slower(rec)) =>
        {
            // Found, but too little to be worth a load: nothing is
            // selected, so nothing is leased or read.
            rec.selected = None;
            rec.ranges.clear();
            (None, Some(MissReason::NotWorthLoading))
        }
        _ => (selected, miss),
    };
    let result = Event::QueryResult {
        command,
        request,
        operation,
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
    };
    (result, miss)
}

/// What decides whether a found prefix is worth loading.
#[derive(SystemParam)]
pub struct Worth<'w> {
    policy: Res<'w, RestorePolicy>,
    rates: Res<'w, LoadRates>,
    dram: Res<'w, Dram>,
    tiers: ResMut<'w, Tiers>,
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
    (Some(selected), common, None)
}

/// Every rank's `required_ranges` for `[origin, selected)`.
fn required_ranges(instance: &Instance, origin: u64, selected: u64) -> Vec<(u32, RequiredRange)> {
    instance
        .ranks
        .iter()
        .enumerate()
        .flat_map(|(index, rank)| {
            rank.contract
                .required_ranges(rank.namespace, origin, selected)
                .expect("selected boundary is aligned and within the span")
                .into_iter()
                .map(move |r| (index as u32, r))
        })
        .collect()
}

/// Whether loading `rec`'s selected ranges would take longer than the
/// engine recomputing their new tokens (`prefill_tokens_per_s`): each page
/// is read from the first tier that holds it unless DRAM does, then copied
/// into a device page, at each source's measured rate. `false` while a
/// source the load needs is not measured yet: a hit is never refused on a
/// guess.
fn slower_than_recompute(
    policy: &RestorePolicy,
    rates: &LoadRates,
    rec: &Recovery,
    instance: &Instance,
    dram: &Dram,
    tiers: &[Box<dyn BackingTier>],
) -> bool {
    let Some(selected) = rec.selected else {
        return false;
    };
    if policy.prefill_tokens_per_s == 0 {
        return false;
    }
    let tokens = selected.saturating_sub(rec.origin);
    let recompute_us = tokens as f64 * 1e6 / policy.prefill_tokens_per_s as f64;
    let mut bytes = vec![0u64; 1 + tiers.len()];
    let page = instance.page_tokens.max(1);
    for (rank, range) in &rec.ranges {
        let Some(rank) = instance.ranks.get(*rank as usize) else {
            continue;
        };
        let Some(hashes) = rec.groups.iter().find(|g| g.group == range.group) else {
            continue;
        };
        let page_bytes = rank
            .page_bytes
            .iter()
            .find(|(g, _)| *g == range.group)
            .map_or(0, |(_, b)| *b);
        for index in range.start / page..range.end / page {
            let Some(native) = hashes.hashes.get(index as usize) else {
                continue;
            };
            let key = StateKey {
                namespace: rank.namespace,
                group: range.group,
                native: *native,
            };
            if !dram.index.contains_key(&key)
                && let Some(tier) = tiers.iter().position(|t| t.lookup(&key).is_some())
            {
                bytes[1 + tier] += page_bytes;
            }
            bytes[LoadRates::DEVICE] += page_bytes;
        }
    }
    let mut load_us = 0.0;
    for (source, &b) in bytes.iter().enumerate() {
        if b == 0 {
            continue;
        }
        let Some(rate) = rates.bytes_per_us(source) else {
            return false;
        };
        load_us += b as f64 / rate;
    }
    load_us > recompute_us
}
