//! Stage 4, read: for the selected boundary only, admit the operation against
//! the byte budget, lease what DRAM already holds, and read the rest from
//! lower tiers into DRAM slots, at most `max_reads_per_group` at a time per
//! group. A group is complete when every page of its range is leased; the
//! operation is `Ready` when every group is.

use bevy_ecs::prelude::*;
use orbitkv_components::StateKey;
use orbitkv_components::api::{Event, LeaseInfo, MissReason, PagePos};
use orbitkv_components::ecs::{
    Instance, NeedState, OpState, Operation, Outcome, Page, PageNeed, Recovery, Transfer,
    TransferKind,
};

use crate::lifecycle::{finish, take_lease};
use crate::resources::{Budget, Clock, Dram, Limits, Metrics, Outbox, Tiers, TransferIndex};

#[allow(clippy::too_many_arguments)]
pub fn read(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut Recovery)>,
    mut instances: Query<&mut Instance>,
    mut pages: Query<&mut Page>,
    mut dram: ResMut<Dram>,
    mut tiers: ResMut<Tiers>,
    mut budget: ResMut<Budget>,
    mut transfers: ResMut<TransferIndex>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    // Admission in arrival order, so an early large query is not starved by
    // later small ones slipping past it forever.
    let mut waiting: Vec<(u64, Entity)> = ops
        .iter()
        .filter(|(_, op, _)| op.state == OpState::Admit)
        .map(|(e, op, _)| (op.command, e))
        .collect();
    waiting.sort_unstable();
    for (_, entity) in waiting {
        let (_, mut op, mut rec) = ops.get_mut(entity).expect("collected above");
        let Ok(mut instance) = instances.get_mut(op.instance) else {
            finish(&mut op, Outcome::Miss(MissReason::Namespace));
            continue;
        };
        admit(&mut op, &mut rec, &mut instance, &mut budget);
    }

    let tiers = tiers.0.get_mut();
    for (entity, mut op, mut rec) in &mut ops {
        if op.state != OpState::Reading {
            continue;
        }
        let instance_formats: Vec<[u8; 32]> = instances
            .get(op.instance)
            .map(|i| i.ranks.iter().map(|r| r.format_digest).collect())
            .unwrap_or_default();
        if instance_formats.is_empty() {
            finish(&mut op, Outcome::Miss(MissReason::Namespace));
            continue;
        }
        let mut reads_in_flight: usize = tiers.iter().map(|t| t.in_flight()).sum();
        let mut failure = None;
        // Per (rank, group): reads in flight, bounded independently.
        let mut group_reads: Vec<((u32, u32), usize)> = Vec::new();
        for need in &rec.needs {
            if need.state == NeedState::Reading {
                bump(&mut group_reads, (need.pos.rank, need.pos.group));
            }
        }
        for need in rec.needs.iter_mut() {
            if need.state != NeedState::Pending {
                continue;
            }
            if let Some(&page_entity) = dram.index.get(&need.key) {
                let Ok(mut page) = pages.get_mut(page_entity) else {
                    continue; // inserted this tick; leased next tick
                };
                need.state = NeedState::Leased(take_lease(
                    &mut commands,
                    &mut dram,
                    page_entity,
                    &mut page,
                    entity,
                ));
                need.residency = Some(page.residency);
                continue;
            }
            if dram.reading.contains_key(&need.key) {
                continue; // another operation's read brings it
            }
            let Some((tier, entry)) = tiers
                .iter()
                .enumerate()
                .find_map(|(i, t)| t.lookup(&need.key).map(|e| (i, e)))
            else {
                // Discovery saw it; it is gone now.
                failure = Some(MissReason::EvictedDuringRead);
                break;
            };
            if entry.bytes != need.bytes {
                failure = Some(MissReason::IncompleteGroup);
                break;
            }
            let slot = (need.pos.rank, need.pos.group);
            if count(&group_reads, slot) >= limits.max_reads_per_group
                || reads_in_flight >= limits.max_inflight_reads
            {
                continue;
            }
            let Some((dram_slot, dram_offset)) = dram.alloc(need.bytes) else {
                continue; // the evict stage makes room; retry next tick
            };
            match tiers[tier].submit_read(&need.key, dram_offset, need.bytes, clock.now_us) {
                Ok(token) => {
                    let transfer = commands
                        .spawn(Transfer {
                            operation: entity,
                            token: token.0,
                            submitted_us: clock.now_us,
                            overdue: false,
                            kind: TransferKind::TierRead {
                                tier,
                                key: need.key,
                                format: instance_formats[need.pos.rank as usize],
                                dram_slot,
                                dram_offset,
                                bytes: need.bytes,
                                checksum: entry.checksum,
                                pos: need.pos,
                            },
                        })
                        .id();
                    transfers.reads.insert((tier, token.0), transfer);
                    dram.reading.insert(need.key, transfer);
                    metrics.tier_reads += 1;
                    op.in_flight += 1;
                    need.state = NeedState::Reading;
                    need.from_tier = true;
                    bump(&mut group_reads, slot);
                    reads_in_flight += 1;
                }
                Err(orbitkv_io::tier::TierError::QueueFull(..)) => dram.free(dram_slot),
                Err(e) => {
                    dram.free(dram_slot);
                    failure = Some(tiers[tier].miss_reason(&e));
                    break;
                }
            }
        }
        if let Some(reason) = failure {
            // A partial result is released (at retire) and becomes a miss.
            finish(&mut op, Outcome::Miss(reason));
            continue;
        }
        if rec
            .needs
            .iter()
            .all(|n| matches!(n.state, NeedState::Leased(_)))
        {
            op.state = OpState::Ready;
            outbox.push(op.origin, ready_event(entity, &rec));
        } else if !op.loading_sent {
            op.loading_sent = true;
            outbox.push(
                op.origin,
                Event::Loading {
                    operation: entity.to_bits(),
                },
            );
        }
    }
}

fn bump(counts: &mut Vec<((u32, u32), usize)>, key: (u32, u32)) {
    match counts.iter_mut().find(|(k, _)| *k == key) {
        Some((_, n)) => *n += 1,
        None => counts.push((key, 1)),
    }
}

fn count(counts: &[((u32, u32), usize)], key: (u32, u32)) -> usize {
    counts
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(0, |(_, n)| *n)
}

/// Builds the page needs of the selected ranges and reserves their bytes, or
/// leaves the operation waiting, or misses with `budget`.
fn admit(op: &mut Operation, rec: &mut Recovery, instance: &mut Instance, budget: &mut Budget) {
    let page = instance.page_tokens;
    let mut needs = Vec::new();
    for (rank, range) in &rec.ranges {
        let state = &instance.ranks[*rank as usize];
        let bytes = state
            .page_bytes(range.group)
            .expect("contract groups have page sizes");
        for index in range.start / page..range.end / page {
            let page_end = (index + 1) * page;
            let native = rec
                .hash_at(range.group, page_end, page)
                .expect("ranges lie within the hashed span");
            needs.push(PageNeed {
                pos: PagePos {
                    rank: *rank,
                    group: range.group,
                    page_end,
                },
                key: StateKey {
                    namespace: state.namespace,
                    group: range.group,
                    native,
                },
                bytes,
                state: NeedState::Pending,
                from_tier: false,
                residency: None,
            });
        }
    }
    let total: u64 = needs.iter().map(|n| n.bytes).sum();
    if total > budget.global_limit.min(budget.instance_limit)
        || (op.speculative && budget.speculative_reserved + total > budget.speculative_limit)
    {
        // Larger than the budget can ever grant, or speculative work past
        // its share: waiting would not help.
        finish(op, Outcome::Miss(MissReason::Budget));
        return;
    }
    if budget.reserved + total > budget.global_limit
        || instance.bytes_reserved + total > budget.instance_limit
    {
        return; // over budget means wait (the deadline bounds it)
    }
    budget.reserved += total;
    instance.bytes_reserved += total;
    if op.speculative {
        budget.speculative_reserved += total;
    }
    op.bytes_reserved = total;
    rec.needs = needs;
    op.state = OpState::Reading;
}

pub fn ready_event(entity: Entity, rec: &Recovery) -> Event {
    let from_tiers = rec.needs.iter().filter(|n| n.from_tier).count() as u64;
    Event::Ready {
        pages_from_dram: rec.needs.len() as u64 - from_tiers,
        pages_from_tiers: from_tiers,
        operation: entity.to_bits(),
        boundary: rec.selected.expect("a ready operation has a boundary"),
        ranges: rec.ranges.clone(),
        leases: rec
            .needs
            .iter()
            .map(|n| {
                let at = n.residency.expect("leased needs record their residency");
                LeaseInfo {
                    lease: match n.state {
                        NeedState::Leased(l) => l.to_bits(),
                        _ => unreachable!("ready means every need is leased"),
                    },
                    pos: n.pos,
                    bytes: n.bytes,
                    slot: at.dram_slot,
                    offset: at.dram_offset,
                }
            })
            .collect(),
    }
}
