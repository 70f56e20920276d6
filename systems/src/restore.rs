//! Stage 5, restore: device copies. DRAM → device for restores, device →
//! DRAM for publishes. Every destination handle is checked live right before
//! the copy is submitted; a stale one fails the restore and nothing is
//! copied. Copied pages stay pinned (device side) and leased (DRAM side)
//! until the fence sees the copy complete.

use bevy_ecs::prelude::*;
use orbitkv_components::api::MissReason;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, ItemState, Lease, NeedState, OpState, Operation, Outcome, Page,
    PublishJob, Recovery, Transfer, TransferKind,
};
use orbitkv_gpu::{Direction, PageCopy};

use crate::lifecycle::finish;
use crate::resources::{Clock, Copier, Dram, Limits, TransferIndex};

#[allow(clippy::too_many_arguments)]
pub fn restore(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &Recovery)>,
    leases: Query<&Lease>,
    pages: Query<&Page>,
    mut device_pages: Query<&mut DevicePage>,
    regions: Query<&DeviceRegion>,
    mut copier: ResMut<Copier>,
    mut transfers: ResMut<TransferIndex>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    let engine = copier.0.get_mut();
    for (entity, mut op, rec) in &mut ops {
        if op.state != OpState::RestorePending {
            continue;
        }
        // Resolve every destination first: all live, or nothing is copied.
        let mut plan = Vec::with_capacity(rec.restore.len());
        let mut stale = false;
        for target in &rec.restore {
            let live = Entity::try_from_bits(target.device_page)
                .and_then(|e| device_pages.get(e).ok().map(|p| (e, p)))
                .filter(|(_, p)| !p.free_deferred)
                .and_then(|(e, p)| regions.get(p.region).ok().map(|r| (e, p, r)))
                .filter(|(_, _, r)| {
                    r.session == op.session
                        && r.rank == target.pos.rank
                        && r.group == target.pos.group
                });
            let Some((device_entity, device_page, region)) = live else {
                stale = true;
                break;
            };
            let need = rec
                .needs
                .iter()
                .find(|n| n.pos == target.pos)
                .expect("validated at ingest");
            let NeedState::Leased(lease) = need.state else {
                unreachable!("restore is accepted only when ready");
            };
            let page = leases
                .get(lease)
                .and_then(|l| pages.get(l.page))
                .expect("a lease points at a live page");
            if page.bytes != region.page_bytes {
                stale = true; // a region of another shape cannot hold it
                break;
            }
            plan.push((
                device_entity,
                PageCopy {
                    host_offset: page.residency.dram_offset,
                    region: region.engine_region,
                    device_offset: u64::from(device_page.slot) * region.page_bytes,
                    len: page.bytes,
                },
            ));
        }
        if stale {
            finish(&mut op, Outcome::Miss(MissReason::StaleGeneration));
            continue;
        }
        if plan.is_empty() {
            // Everything required is retained by the engine.
            finish(&mut op, Outcome::Restored);
            continue;
        }
        let batches = plan.chunks(limits.max_copy_batch_pages.max(1));
        if engine.in_flight() + batches.len() > limits.max_inflight_copies {
            continue; // wait for room; the whole restore goes in one tick
        }
        for batch in batches {
            let copies: Vec<PageCopy> = batch.iter().map(|(_, c)| *c).collect();
            match engine.submit(Direction::HostToDevice, &copies, clock.now_us) {
                Ok(token) => {
                    let targets: Vec<Entity> = batch.iter().map(|(e, _)| *e).collect();
                    for e in &targets {
                        device_pages.get_mut(*e).expect("resolved above").pins += 1;
                    }
                    let t = commands
                        .spawn(Transfer {
                            operation: entity,
                            token: token.0,
                            submitted_us: clock.now_us,
                            overdue: false,
                            kind: TransferKind::Restore {
                                device_pages: targets,
                            },
                        })
                        .id();
                    transfers.copies.insert(token.0, t);
                    op.in_flight += 1;
                }
                Err(_) => {
                    // Batches already submitted drain; the rest are not sent.
                    if op.outcome.is_none() {
                        op.outcome = Some(Outcome::Miss(MissReason::IoError));
                    }
                    break;
                }
            }
        }
        if op.outcome.is_none() {
            op.state = OpState::Restoring;
        } else {
            op.state = OpState::Finishing;
        }
    }
}

/// Publish: allocate DRAM slots for new keys (all or none this tick) and
/// copy the source device pages into them.
#[allow(clippy::too_many_arguments)]
pub fn publish(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut PublishJob)>,
    device_pages: Query<&DevicePage>,
    regions: Query<&DeviceRegion>,
    mut dram: ResMut<Dram>,
    mut copier: ResMut<Copier>,
    mut transfers: ResMut<TransferIndex>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    let engine = copier.0.get_mut();
    for (entity, mut op, mut job) in &mut ops {
        if op.state != OpState::PublishPending {
            continue;
        }
        // More than DRAM can ever hold: waiting would not help.
        let wanted: u64 = job
            .items
            .iter()
            .filter(|i| i.state == ItemState::Waiting)
            .map(|i| i.bytes.next_multiple_of(dram.pool.slot_align()))
            .sum();
        if wanted > dram.pool.capacity() {
            for item in job
                .items
                .iter_mut()
                .filter(|i| i.state == ItemState::Waiting)
            {
                item.state = ItemState::Dropped;
            }
            finish(&mut op, Outcome::Published);
            continue;
        }
        let mut fresh = Vec::new();
        let mut short = false;
        for (index, item) in job.items.iter_mut().enumerate() {
            if item.state != ItemState::Waiting || item.dram_slot.is_some() {
                continue;
            }
            if dram.index.contains_key(&item.key) || dram.reading.contains_key(&item.key) {
                item.state = ItemState::Duplicate;
                continue;
            }
            match dram.alloc(item.bytes) {
                Some((slot, offset)) => {
                    item.dram_slot = Some(slot);
                    item.dram_offset = offset;
                    fresh.push(index);
                }
                None => {
                    short = true;
                    break;
                }
            }
        }
        if short {
            // Ask the evict stage for everything still missing at once, not
            // one slot per tick.
            let missing: Vec<u64> = job
                .items
                .iter()
                .filter(|i| i.state == ItemState::Waiting && i.dram_slot.is_none())
                .map(|i| i.bytes.next_multiple_of(dram.pool.slot_align()))
                .collect();
            for class in missing.into_iter().skip(1) {
                *dram.pressure.entry(class).or_default() += 1;
            }
            // All or none, so two publishes cannot each hold half of the
            // space the other needs; the evict stage makes room meanwhile.
            for index in fresh {
                let item = &mut job.items[index];
                dram.free(item.dram_slot.take().expect("allocated above"));
            }
            continue;
        }
        let todo: Vec<usize> = (0..job.items.len())
            .filter(|&i| job.items[i].state == ItemState::Waiting)
            .collect();
        if todo.is_empty() {
            finish(&mut op, Outcome::Published);
            continue;
        }
        let batches: Vec<&[usize]> = todo.chunks(limits.max_copy_batch_pages.max(1)).collect();
        if engine.in_flight() + batches.len() > limits.max_inflight_copies {
            continue; // slots stay held; the deadline bounds the wait
        }
        for batch in batches {
            let copies: Vec<PageCopy> = batch
                .iter()
                .map(|&i| {
                    let item = &job.items[i];
                    let page = device_pages
                        .get(item.device_page)
                        .expect("sources are pinned");
                    let region = regions
                        .get(page.region)
                        .expect("pinned pages keep their region");
                    PageCopy {
                        host_offset: item.dram_offset,
                        region: region.engine_region,
                        device_offset: u64::from(page.slot) * region.page_bytes,
                        len: item.bytes,
                    }
                })
                .collect();
            match engine.submit(Direction::DeviceToHost, &copies, clock.now_us) {
                Ok(token) => {
                    for &i in batch {
                        job.items[i].state = ItemState::Copying;
                    }
                    let t = commands
                        .spawn(Transfer {
                            operation: entity,
                            token: token.0,
                            submitted_us: clock.now_us,
                            overdue: false,
                            kind: TransferKind::Publish {
                                items: batch.to_vec(),
                            },
                        })
                        .id();
                    transfers.copies.insert(token.0, t);
                    op.in_flight += 1;
                }
                Err(_) => {
                    for &i in batch {
                        let item = &mut job.items[i];
                        dram.free(item.dram_slot.take().expect("allocated"));
                        item.state = ItemState::Dropped;
                    }
                }
            }
        }
        op.state = if op.in_flight > 0 {
            OpState::Publishing
        } else {
            OpState::Finishing
        };
        if op.in_flight == 0 {
            finish(&mut op, Outcome::Published);
        }
    }
}
