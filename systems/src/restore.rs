//! Stage 5, restore: device copies. DRAM → device for restores, device →
//! DRAM for publishes. Every destination handle is checked live when the
//! restore is accepted; a stale one fails the restore and nothing is copied.
//! Destinations stay pinned (device side) and sources leased (DRAM side)
//! until the fence sees their copy complete.
//!
//! A job needing more copy batches than there is room for starts in pieces:
//! each tick submits what `max_inflight_copies` (and the engine's own queue)
//! allows, and the rest waits for earlier batches to complete, until the
//! job's deadline.

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::api::MissReason;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, ItemState, Lease, NeedState, OpState, Operation, Outcome, Page,
    PlannedCopy, PublishJob, Recovery, Transfer, TransferKind,
};
use orbitkv_gpu::{CopyError, Direction, PageCopy};

use crate::lifecycle::{finish, unpin_device_page};
use crate::resources::{Clock, Copier, Dram, Limits, Outbox, TransferIndex};

/// The copy engine with its bounds: what submitting a batch needs.
#[derive(SystemParam)]
pub struct Copies<'w> {
    copier: ResMut<'w, Copier>,
    index: ResMut<'w, TransferIndex>,
    limits: Res<'w, Limits>,
    clock: Res<'w, Clock>,
}

/// Why a batch was not submitted.
enum Refused {
    /// No room now (our bound or the engine's queue): try next tick.
    Full,
    /// The engine refused the batch itself.
    Failed,
}

impl Copies<'_> {
    fn now_us(&self) -> u64 {
        self.clock.now_us
    }

    fn batch_pages(&self) -> usize {
        self.limits.max_copy_batch_pages.max(1)
    }

    /// Submits one batch and spawns its Transfer, or says why not.
    fn submit(
        &mut self,
        commands: &mut Commands,
        operation: Entity,
        direction: Direction,
        copies: &[PageCopy],
        kind: TransferKind,
    ) -> Result<(), Refused> {
        let engine = self.copier.0.get_mut();
        if engine.in_flight() >= self.limits.max_inflight_copies {
            return Err(Refused::Full);
        }
        let now_us = self.clock.now_us;
        let token = match engine.submit(direction, copies, now_us) {
            Ok(token) => token,
            Err(CopyError::QueueFull(..)) => return Err(Refused::Full),
            Err(_) => return Err(Refused::Failed),
        };
        let transfer = commands
            .spawn(Transfer {
                operation,
                token: token.0,
                submitted_us: now_us,
                overdue: false,
                kind,
            })
            .id();
        self.index.copies.insert(token.0, transfer);
        Ok(())
    }
}

/// Device pages and their regions, for pinning and unpinning.
#[derive(SystemParam)]
pub struct Devices<'w, 's> {
    pages: Query<'w, 's, &'static mut DevicePage>,
    regions: Query<'w, 's, &'static mut DeviceRegion>,
    outbox: ResMut<'w, Outbox>,
}

impl Devices<'_, '_> {
    fn unpin(&mut self, commands: &mut Commands, page: Entity) {
        let Ok(mut dp) = self.pages.get_mut(page) else {
            unreachable!("a pinned device page is live");
        };
        unpin_device_page(commands, &mut self.regions, &mut self.outbox, page, &mut dp);
    }
}

pub fn restore(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut Recovery)>,
    leases: Query<&Lease>,
    pages: Query<&Page>,
    mut devices: Devices,
    mut copies: Copies,
) {
    for (entity, mut op, mut rec) in &mut ops {
        match op.state {
            OpState::RestorePending => {
                match plan_restore(&op, &rec, &leases, &pages, &devices) {
                    Err(reason) => finish(&mut op, Outcome::Miss(reason)),
                    // Everything required is retained by the engine.
                    Ok(plan) if plan.is_empty() => finish(&mut op, Outcome::Restored),
                    Ok(plan) => {
                        for c in &plan {
                            devices.pages.get_mut(c.device_page).expect("planned").pins += 1;
                        }
                        rec.copies = plan;
                        op.state = OpState::Restoring;
                    }
                }
            }
            OpState::Restoring => {}
            _ => continue,
        }
        if op.state == OpState::Restoring && rec.copies_sent < rec.copies.len() {
            send_restore(
                &mut commands,
                entity,
                &mut op,
                &mut rec,
                &mut devices,
                &mut copies,
            );
        }
    }
}

/// Resolves every destination: all live, of this session, of the right
/// rank, group and page size, or the restore fails `stale_generation`.
fn plan_restore(
    op: &Operation,
    rec: &Recovery,
    leases: &Query<&Lease>,
    pages: &Query<&Page>,
    devices: &Devices,
) -> Result<Vec<PlannedCopy>, MissReason> {
    let mut plan = Vec::with_capacity(rec.restore.len());
    for target in &rec.restore {
        let live = Entity::try_from_bits(target.device_page)
            .and_then(|e| devices.pages.get(e).ok().map(|p| (e, p)))
            .filter(|(_, p)| !p.free_deferred)
            .and_then(|(e, p)| devices.regions.get(p.region).ok().map(|r| (e, p, r)))
            .filter(|(_, _, r)| {
                r.session == op.session && r.rank == target.pos.rank && r.group == target.pos.group
            });
        let Some((device_page, dp, region)) = live else {
            return Err(MissReason::StaleGeneration);
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
            return Err(MissReason::StaleGeneration); // another shape
        }
        plan.push(PlannedCopy {
            device_page,
            host_offset: page.residency.dram_offset,
            region: region.engine_region,
            device_offset: u64::from(dp.slot) * region.page_bytes,
            len: page.bytes,
            checksum: page.checksum,
        });
    }
    Ok(plan)
}

/// Submits the restore's next batches while there is room. Past its
/// deadline, or once it failed, the rest is abandoned (unpinned).
fn send_restore(
    commands: &mut Commands,
    entity: Entity,
    op: &mut Operation,
    rec: &mut Recovery,
    devices: &mut Devices,
    copies: &mut Copies,
) {
    if op.outcome.is_none() && copies.now_us() >= op.deadline_us {
        op.outcome = Some(Outcome::Miss(MissReason::Deadline));
    }
    while op.outcome.is_none() && rec.copies_sent < rec.copies.len() {
        let end = (rec.copies_sent + copies.batch_pages()).min(rec.copies.len());
        let batch = &rec.copies[rec.copies_sent..end];
        let page_copies: Vec<PageCopy> = batch.iter().map(page_copy).collect();
        let kind = TransferKind::Restore {
            device_pages: batch.iter().map(|c| c.device_page).collect(),
        };
        let sent = copies.submit(
            commands,
            entity,
            Direction::HostToDevice,
            &page_copies,
            kind,
        );
        match sent {
            Ok(()) => {
                op.in_flight += 1;
                rec.copies_sent = end;
            }
            Err(Refused::Full) => return,
            Err(Refused::Failed) => op.outcome = Some(Outcome::Miss(MissReason::IoError)),
        }
    }
    // Failed, cancelled or out of time: what was not submitted never will be.
    for c in rec.copies.drain(rec.copies_sent..) {
        devices.unpin(commands, c.device_page);
    }
    rec.copies_sent = rec.copies.len();
    if op.in_flight == 0 && op.outcome.is_some() {
        op.state = OpState::Finishing;
    }
}

fn page_copy(c: &PlannedCopy) -> PageCopy {
    PageCopy {
        host_offset: c.host_offset,
        region: c.region,
        device_offset: c.device_offset,
        len: c.len,
        // Verified in the copy's pass: altered bytes are a miss.
        expect_checksum: Some(c.checksum),
    }
}

/// Publish: allocate DRAM slots for new keys (all or none), then copy the
/// source device pages into them in batches as copy room allows.
pub fn publish(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation, &mut PublishJob)>,
    devices: Query<&DevicePage>,
    regions: Query<&DeviceRegion>,
    mut dram: ResMut<Dram>,
    mut copies: Copies,
) {
    for (entity, mut op, mut job) in &mut ops {
        match op.state {
            OpState::PublishPending => {
                if !allocate(&mut op, &mut job, &mut dram) {
                    continue;
                }
                op.state = OpState::Publishing;
            }
            OpState::Publishing => {}
            _ => continue,
        }
        // Past the deadline, or cancelled, or failed: pages still waiting
        // for copy room are dropped.
        if copies.now_us() >= op.deadline_us || op.outcome.is_some() {
            drop_unsent(&mut job, &mut dram);
        }
        send_publish(
            &mut commands,
            entity,
            &mut op,
            &mut job,
            &devices,
            &regions,
            &mut dram,
            &mut copies,
        );
        if op.in_flight == 0 && !job.items.iter().any(|i| i.state == ItemState::Waiting) {
            finish(&mut op, Outcome::Published);
        }
    }
}

/// Allocates a DRAM slot for every new key, all or none; returns whether
/// the job may go on to copy.
fn allocate(op: &mut Operation, job: &mut PublishJob, dram: &mut Dram) -> bool {
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
        finish(op, Outcome::Published);
        return false;
    }
    let mut fresh = Vec::new();
    for (index, item) in job.items.iter_mut().enumerate() {
        if item.state != ItemState::Waiting || item.dram_slot.is_some() {
            continue;
        }
        if dram.index.contains_key(&item.key) || dram.reading.contains_key(&item.key) {
            item.state = ItemState::Duplicate;
            continue;
        }
        let Some((slot, offset)) = dram.alloc(item.bytes) else {
            give_back(job, fresh, dram);
            return false;
        };
        item.dram_slot = Some(slot);
        item.dram_offset = offset;
        fresh.push(index);
    }
    true
}

/// All or none, so two publishes cannot each hold half of the space the
/// other needs: frees this tick's slots, and asks the evict stage for
/// everything still missing at once, not one slot per tick.
fn give_back(job: &mut PublishJob, fresh: Vec<usize>, dram: &mut Dram) {
    let align = dram.pool.slot_align();
    let missing: Vec<u64> = job
        .items
        .iter()
        .filter(|i| i.state == ItemState::Waiting && i.dram_slot.is_none())
        .map(|i| i.bytes.next_multiple_of(align))
        .collect();
    // The failed allocation already recorded the first.
    for class in missing.into_iter().skip(1) {
        *dram.pressure.entry(class).or_default() += 1;
    }
    for index in fresh {
        let item = &mut job.items[index];
        dram.free(item.dram_slot.take().expect("allocated above"));
    }
}

fn drop_unsent(job: &mut PublishJob, dram: &mut Dram) {
    for item in job
        .items
        .iter_mut()
        .filter(|i| i.state == ItemState::Waiting)
    {
        if let Some(slot) = item.dram_slot.take() {
            dram.free(slot);
        }
        item.state = ItemState::Dropped;
    }
}

/// Submits batches of allocated pages while there is room.
#[allow(clippy::too_many_arguments)]
fn send_publish(
    commands: &mut Commands,
    entity: Entity,
    op: &mut Operation,
    job: &mut PublishJob,
    devices: &Query<&DevicePage>,
    regions: &Query<&DeviceRegion>,
    dram: &mut Dram,
    copies: &mut Copies,
) {
    loop {
        let batch: Vec<usize> = (0..job.items.len())
            .filter(|&i| job.items[i].state == ItemState::Waiting)
            .take(copies.batch_pages())
            .collect();
        if batch.is_empty() {
            return;
        }
        let page_copies: Vec<PageCopy> = batch
            .iter()
            .map(|&i| source_copy(&job.items[i], devices, regions))
            .collect();
        let kind = TransferKind::Publish {
            items: batch.clone(),
        };
        match copies.submit(
            commands,
            entity,
            Direction::DeviceToHost,
            &page_copies,
            kind,
        ) {
            Ok(()) => {
                op.in_flight += 1;
                for &i in &batch {
                    job.items[i].state = ItemState::Copying;
                }
            }
            Err(Refused::Full) => return,
            Err(Refused::Failed) => {
                for &i in &batch {
                    let item = &mut job.items[i];
                    dram.free(item.dram_slot.take().expect("allocated"));
                    item.state = ItemState::Dropped;
                }
            }
        }
    }
}

fn source_copy(
    item: &orbitkv_components::ecs::PublishItem,
    devices: &Query<&DevicePage>,
    regions: &Query<&DeviceRegion>,
) -> PageCopy {
    let page = devices.get(item.device_page).expect("sources are pinned");
    let region = regions
        .get(page.region)
        .expect("pinned pages keep their region");
    PageCopy {
        host_offset: item.dram_offset,
        region: region.engine_region,
        device_offset: u64::from(page.slot) * region.page_bytes,
        len: item.bytes,
        expect_checksum: None,
    }
}
