//! Stage 6, fence: poll completions (tier reads, device copies), verify and
//! index what landed, unpin device pages, expire deadlines, and retire
//! finished operations only once their submitted I/O drained. This is the
//! only stage that releases leases and byte reservations.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{Event, MissReason};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Instance, ItemState, Lease, NeedState, OpState, Operation, Outcome,
    Page, PublishJob, Recovery, Residency, Session, Transfer, TransferKind, session_handle,
};
use orbitkv_gpu::Completion;
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::tier::{ReadDone, TierError};
use rayon::prelude::*;

use crate::lifecycle::{finish, return_lease, take_lease, unpin_device_page};
use crate::resources::{
    Budget, Clock, Copier, Dram, Limits, Metrics, Outbox, Registry, Tiers, TransferIndex,
};

/// Polls every backend and applies completions.
#[allow(clippy::too_many_arguments)]
pub fn fence(
    mut commands: Commands,
    mut ops: Query<(
        &mut Operation,
        Option<&mut Recovery>,
        Option<&mut PublishJob>,
    )>,
    transfers: Query<&Transfer>,
    mut device_pages: Query<&mut DevicePage>,
    mut regions: Query<&mut DeviceRegion>,
    mut dram: ResMut<Dram>,
    mut tiers: ResMut<Tiers>,
    mut copier: ResMut<Copier>,
    mut index: ResMut<TransferIndex>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    clock: Res<Clock>,
) {
    let mut reads: Vec<(usize, ReadDone)> = Vec::new();
    let mut demoted = Vec::new();
    for (i, tier) in tiers.0.get_mut().iter_mut().enumerate() {
        let mut done = Vec::new();
        tier.poll(clock.now_us, &mut done);
        reads.extend(done.into_iter().map(|d| (i, d)));
        tier.poll_demotions(clock.now_us, &mut demoted);
    }
    for d in demoted {
        let key = if d.is_ok() { "written" } else { "failed" };
        *metrics.demotions.entry(key.to_owned()).or_default() += 1;
    }
    for (tier, done) in reads {
        let Some(entity) = index.reads.remove(&(tier, done.token.0)) else {
            continue; // not ours: a backend bug, reported by the invariants
        };
        let transfer = transfers
            .get(entity)
            .expect("indexed transfers are live")
            .clone();
        commands.entity(entity).despawn();
        let TransferKind::TierRead {
            key,
            format,
            dram_slot,
            dram_offset,
            bytes,
            checksum,
            pos,
            ..
        } = transfer.kind
        else {
            continue;
        };
        dram.reading.remove(&key);
        let mut op = ops.get_mut(transfer.operation).ok();
        if let Some((op, ..)) = op.as_mut() {
            op.in_flight -= 1;
        }
        // Verify right after the read: a page is indexed only with the
        // checksum it was written with.
        let failure = match done.result {
            Ok(()) => match dram.slot_bytes(dram_slot, bytes) {
                Some(b) if page_checksum(b) == checksum => None,
                _ => {
                    metrics.checksum_failures += 1;
                    Some(MissReason::Checksum)
                }
            },
            // The tier's own header or checksum check failed: never served.
            Err(e) => {
                if e == TierError::Corrupt {
                    metrics.checksum_failures += 1;
                }
                let t = &tiers.0.get_mut()[tier];
                Some(t.miss_reason(&e))
            }
        };
        if let Some(reason) = failure {
            dram.free(dram_slot);
            if let Some((op, ..)) = op.as_mut()
                && op.state == OpState::Reading
            {
                finish(op, Outcome::Miss(reason));
            }
            continue;
        }
        metrics.bytes_read += bytes;
        if let Some(t) = tiers.0.get_mut().get(tier) {
            *metrics
                .bytes_read_by_tier
                .entry(t.name().to_owned())
                .or_default() += bytes;
        }
        if dram.index.contains_key(&key) {
            // Published meanwhile: keep the indexed copy, and let the read
            // stage lease that one.
            dram.free(dram_slot);
            if let Some((_, Some(rec), _)) = op.as_mut()
                && let Some(need) = rec
                    .needs
                    .iter_mut()
                    .find(|n| n.pos == pos && n.state == NeedState::Reading)
            {
                need.state = NeedState::Pending;
            }
            continue;
        }
        let wanted = op.as_mut().and_then(|(op, rec, _)| {
            let rec = rec.as_mut()?;
            let need = rec
                .needs
                .iter_mut()
                .find(|n| n.pos == pos && n.state == NeedState::Reading)?;
            (op.state == OpState::Reading).then_some(need)
        });
        let page_entity = commands.spawn_empty().id();
        let mut page = Page {
            key,
            bytes,
            checksum,
            format,
            residency: Residency {
                dram_slot,
                dram_offset,
            },
            leases: 0,
        };
        dram.index.insert(key, page_entity);
        match wanted {
            Some(need) => {
                // Lease at once, so eviction cannot take it before the read
                // stage sees it.
                need.state = NeedState::Leased(take_lease(
                    &mut commands,
                    &mut dram,
                    page_entity,
                    &mut page,
                    transfer.operation,
                ));
                need.residency = Some(page.residency);
            }
            None => dram.make_evictable(page_entity, dram_slot),
        }
        commands.entity(page_entity).insert(page);
    }

    let mut copies: Vec<Completion> = Vec::new();
    copier.0.get_mut().poll(clock.now_us, &mut copies);
    for done in copies {
        let Some(entity) = index.copies.remove(&done.token.0) else {
            continue;
        };
        let transfer = transfers
            .get(entity)
            .expect("indexed transfers are live")
            .clone();
        commands.entity(entity).despawn();
        let Ok((mut op, rec, job)) = ops.get_mut(transfer.operation) else {
            continue;
        };
        op.in_flight -= 1;
        match transfer.kind {
            TransferKind::Restore {
                device_pages: targets,
            } => {
                for target in &targets {
                    if let Ok(mut dp) = device_pages.get_mut(*target) {
                        unpin_device_page(
                            &mut commands,
                            &mut regions,
                            &mut outbox,
                            *target,
                            &mut dp,
                        );
                    }
                }
                if done.result.is_err() && op.outcome.is_none() {
                    op.outcome = Some(Outcome::Miss(MissReason::IoError));
                }
                // Batches may still wait for copy room: the restore stage
                // submits (or abandons) them.
                let all_sent = rec.is_none_or(|r| r.copies_sent == r.copies.len());
                if op.in_flight == 0 && all_sent {
                    finish(&mut op, Outcome::Restored);
                }
            }
            TransferKind::Publish { items } => {
                let mut job = job.expect("publish transfers belong to publish jobs");
                // Checksum the landed pages in parallel: a publish is often
                // hundreds of pages, and this is the tick's largest cost.
                let sums: Vec<u64> = if done.result.is_ok() {
                    let slices: Vec<&[u8]> = items
                        .iter()
                        .map(|&i| {
                            let item = &job.items[i];
                            let slot = item.dram_slot.expect("copying items own a slot");
                            dram.slot_bytes(slot, item.bytes).expect("live slot")
                        })
                        .collect();
                    slices.par_iter().map(|b| page_checksum(b)).collect()
                } else {
                    Vec::new()
                };
                for (n, i) in items.into_iter().enumerate() {
                    let item = &mut job.items[i];
                    let slot = item.dram_slot.take().expect("copying items own a slot");
                    let landed = done.result.is_ok();
                    if !landed || dram.index.contains_key(&item.key) {
                        dram.free(slot);
                        item.state = if landed {
                            ItemState::Duplicate
                        } else {
                            ItemState::Dropped
                        };
                        continue;
                    }
                    // Bytes are complete and checksummed: index them.
                    let checksum = sums[n];
                    let page_entity = commands
                        .spawn(Page {
                            key: item.key,
                            bytes: item.bytes,
                            checksum,
                            format: item.format,
                            residency: Residency {
                                dram_slot: slot,
                                dram_offset: item.dram_offset,
                            },
                            leases: 0,
                        })
                        .id();
                    dram.index.insert(item.key, page_entity);
                    dram.make_evictable(page_entity, slot);
                    metrics.bytes_published += item.bytes;
                    write_through(&mut tiers, &dram, &mut metrics, item, slot, clock.now_us);
                    item.state = ItemState::Inserted;
                }
                let waiting = job.items.iter().any(|i| i.state == ItemState::Waiting);
                if op.in_flight == 0 && !waiting {
                    finish(&mut op, Outcome::Published);
                }
            }
            TransferKind::TierRead { .. } => {}
        }
    }
}

/// Offers a page just published to every tier that shares pages with other
/// hosts (remote, write-through policy); counted by outcome.
fn write_through(
    tiers: &mut Tiers,
    dram: &Dram,
    metrics: &mut Metrics,
    item: &orbitkv_components::ecs::PublishItem,
    slot: u64,
    now_us: u64,
) {
    let Some(bytes) = dram.slot_bytes(slot, item.bytes) else {
        return;
    };
    for t in tiers.0.get_mut().iter_mut() {
        let key = match t.write_through(&item.key, item.format, bytes, now_us) {
            Ok(()) => "submitted",
            Err("not_writable") => continue,
            Err(reason) => reason,
        };
        *metrics.write_through.entry(key.to_owned()).or_default() += 1;
    }
}

/// Expires preparation deadlines and publish waits, and reports transfers
/// that are overdue. An overdue transfer fails its operation but keeps every
/// buffer it owns: a logical timeout is not proof the hardware stopped.
pub fn expire(
    mut ops: Query<&mut Operation>,
    mut transfers: Query<&mut Transfer>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    for mut t in &mut transfers {
        if t.overdue || clock.now_us.saturating_sub(t.submitted_us) < limits.transfer_timeout_us {
            continue;
        }
        t.overdue = true;
        metrics.transfers_overdue += 1;
        let Ok(mut op) = ops.get_mut(t.operation) else {
            unreachable!("an operation retires only after its transfers");
        };
        if op.outcome.is_none() {
            op.outcome = Some(Outcome::Miss(MissReason::IoError));
        }
        outbox.push(
            op.origin,
            Event::TransferOverdue {
                operation: t.operation.to_bits(),
                kind: t.kind.name().to_owned(),
            },
        );
    }
    for mut op in &mut ops {
        if op.deadline_us > clock.now_us {
            continue;
        }
        if op.state.before_restore() {
            finish(&mut op, Outcome::Miss(MissReason::Deadline));
        } else if op.state == OpState::PublishPending {
            finish(&mut op, Outcome::Published);
        }
    }
}

/// Retires finished operations whose I/O drained: returns leases and bytes,
/// unpins publish sources, sends the final reply.
#[allow(clippy::too_many_arguments)]
pub fn retire(
    mut commands: Commands,
    mut ops: Query<(
        Entity,
        &Operation,
        Option<&Recovery>,
        Option<&mut PublishJob>,
    )>,
    leases: Query<&Lease>,
    mut pages: Query<&mut Page>,
    mut instances: Query<&mut Instance>,
    mut device_pages: Query<&mut DevicePage>,
    mut regions: Query<&mut DeviceRegion>,
    mut dram: ResMut<Dram>,
    mut budget: ResMut<Budget>,
    mut registry: ResMut<Registry>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
) {
    for (entity, op, rec, job) in &mut ops {
        if op.state != OpState::Finishing || op.in_flight > 0 {
            continue;
        }
        let handle = entity.to_bits();
        let mut event = None;
        if let Some(rec) = rec {
            for need in &rec.needs {
                if let NeedState::Leased(lease) = need.state {
                    let page_entity = leases.get(lease).expect("needs point at live leases").page;
                    let mut page = pages
                        .get_mut(page_entity)
                        .expect("leases point at live pages");
                    return_lease(&mut commands, &mut dram, lease, page_entity, &mut page);
                }
            }
            event = Some(
                match op.outcome.expect("finishing operations have an outcome") {
                    Outcome::Miss(reason) => {
                        if !op.reported {
                            metrics.miss(reason);
                        }
                        Event::Miss {
                            operation: handle,
                            reason,
                        }
                    }
                    Outcome::Released => Event::Released { operation: handle },
                    Outcome::Restored => {
                        let copied: Vec<_> = rec.restore.iter().collect();
                        let bytes: u64 = copied
                            .iter()
                            .filter_map(|t| rec.needs.iter().find(|n| n.pos == t.pos))
                            .map(|n| n.bytes)
                            .sum();
                        metrics.restores += 1;
                        metrics.hits += 1;
                        metrics.hit_tokens += rec.selected.unwrap_or(0) - rec.origin;
                        metrics.bytes_restored += bytes;
                        Event::RestoreDone {
                            operation: handle,
                            pages: copied.len() as u64,
                            bytes,
                        }
                    }
                    Outcome::Published => unreachable!("recoveries do not publish"),
                },
            );
            if op.reported {
                event = None;
            }
        }
        let mut sources = Vec::new();
        if let Some(mut job) = job {
            for item in job.items.iter_mut() {
                if let Some(slot) = item.dram_slot.take() {
                    dram.free(slot); // allocated, never copied
                    item.state = ItemState::Dropped;
                }
                if item.state == ItemState::Waiting {
                    item.state = ItemState::Dropped;
                }
                sources.push(item.device_page);
            }
            let (inserted, duplicates, dropped) = (
                job.count(ItemState::Inserted),
                job.count(ItemState::Duplicate),
                job.count(ItemState::Dropped),
            );
            metrics.pages_published += inserted;
            metrics.publish_duplicates += duplicates;
            metrics.publish_dropped += dropped;
            event = Some(Event::PublishDone {
                command: op.command,
                request: op.request,
                inserted,
                duplicates,
                dropped,
            });
        }
        if op.bytes_reserved > 0 {
            budget.reserved -= op.bytes_reserved;
            if op.speculative {
                budget.speculative_reserved -= op.bytes_reserved;
            }
            if let Ok(mut instance) = instances.get_mut(op.instance) {
                instance.bytes_reserved -= op.bytes_reserved;
            }
        }
        registry.operations -= 1;
        if let Some(event) = event {
            outbox.push(op.origin, event);
        }
        // Publish sources stay pinned until the reply: a deferred free is
        // reported after it.
        for source in sources {
            if let Ok(mut dp) = device_pages.get_mut(source) {
                unpin_device_page(&mut commands, &mut regions, &mut outbox, source, &mut dp);
            }
        }
        commands.entity(entity).despawn();
    }
}

/// Despawns closing sessions once they own no operations, with their device
/// regions and pages. (No page can be pinned then: pins belong to
/// operations.)
#[allow(clippy::too_many_arguments)]
pub fn close_sessions(
    mut commands: Commands,
    sessions: Query<(Entity, &Session)>,
    ops: Query<&Operation>,
    regions: Query<(Entity, &DeviceRegion)>,
    instances: Query<&Instance>,
    groups: Query<(Entity, &orbitkv_components::ecs::Group)>,
    mut copier: ResMut<Copier>,
    mut registry: ResMut<Registry>,
    mut outbox: ResMut<Outbox>,
) {
    let mut gone = Vec::new();
    for (entity, session) in &sessions {
        if !session.closing || ops.iter().any(|op| op.session == entity) {
            continue;
        }
        gone.push(entity);
        // A retired instance goes with its last session.
        let others = sessions
            .iter()
            .any(|(e, s)| s.instance == session.instance && !gone.contains(&e));
        if !others && instances.get(session.instance).is_ok_and(|i| i.retired) {
            for (g, group) in &groups {
                if group.instance == session.instance {
                    commands.entity(g).despawn();
                }
            }
            commands.entity(session.instance).despawn();
        }
        for (region_entity, region) in regions.iter().filter(|(_, r)| r.session == entity) {
            for page in region.live.iter().flatten() {
                commands.entity(*page).despawn();
            }
            // Nothing targets it any more: no operation of the session is left.
            let _ = copier
                .0
                .get_mut()
                .unregister_device_region(region.engine_region);
            commands.entity(region_entity).despawn();
        }
        registry.sessions -= 1;
        outbox.push(
            session.origin,
            Event::SessionClosed {
                session: session_handle(entity, session.epoch, registry.incarnation),
            },
        );
        commands.entity(entity).despawn();
    }
}
