//! Stage 5, restore: DRAM → device copies. Every destination handle is
//! checked live when the restore's copies are resolved; a stale one fails
//! the restore and nothing is copied. Destinations stay pinned (device side)
//! and sources leased (DRAM side) until the restore retires, after its
//! last copy: an engine that frees a destination meanwhile hears of the
//! free only after the restore's reply, so it can never reuse a page the
//! reply still counts as restored.
//!
//! A restore needing more copy batches than there is room for starts in
//! pieces: each tick submits what `max_inflight_copies` (and the engine's
//! own queue) allows, and the rest waits for earlier batches to complete,
//! until the restore's deadline.

use bevy_ecs::prelude::*;
use orbitkv_components::api::MissReason;
use orbitkv_components::ecs::{
    LeaseOf, NeedState, OpState, Operation, OperationOf, Outcome, Page, PlannedCopy, Recovery,
    TransferKind, Transfers, at,
};
use orbitkv_gpu::{Direction, PageCopy};

use crate::copies::{Copies, Devices, Refused};
use crate::lifecycle::{finish, set_state};

type RestoreOps<'a> = (
    Entity,
    &'a mut Operation,
    &'a mut Recovery,
    &'a OperationOf,
    Option<&'a Transfers>,
);

type Restores = Or<(With<at::RestorePending>, With<at::Restoring>)>;

pub fn restore(
    mut commands: Commands,
    mut ops: Query<RestoreOps, Restores>,
    leases: Query<&LeaseOf>,
    pages: Query<&Page>,
    mut devices: Devices,
    mut copies: Copies,
) {
    for (entity, mut op, mut rec, session, in_flight) in &mut ops {
        if op.state() == OpState::RestorePending {
            match plan(session.0, &rec, &leases, &pages, &devices) {
                Err(reason) => finish(&mut commands, entity, &mut op, Outcome::Miss(reason)),
                // Everything required is retained by the engine.
                Ok(plan) if plan.is_empty() => {
                    finish(&mut commands, entity, &mut op, Outcome::Restored);
                }
                Ok(plan) => {
                    plan.iter().for_each(|c| devices.pin(c.device_page));
                    rec.copies = plan;
                    set_state(&mut commands, entity, &mut op, OpState::Restoring);
                }
            }
        }
        if op.state() == OpState::Restoring && rec.copies_sent < rec.copies.len() {
            let mut job = RestoreJob {
                entity,
                op: &mut op,
                rec: &mut rec,
                in_flight: in_flight.map_or(0, |t| t.len()),
            };
            job.send(&mut commands, &mut copies);
        }
    }
}

/// Resolves every destination: all live, of this session, of the right
/// rank, group and page size, or the restore fails `stale_generation`.
fn plan(
    session: Entity,
    rec: &Recovery,
    leases: &Query<&LeaseOf>,
    pages: &Query<&Page>,
    devices: &Devices,
) -> Result<Vec<PlannedCopy>, MissReason> {
    let mut plan = Vec::with_capacity(rec.restore.len());
    let needs = rec.needs_at(rec.restore.iter().map(|t| &t.pos));
    for (target, need) in rec.restore.iter().zip(needs) {
        let at = (target.pos.rank, target.pos.group);
        let Some((device_page, dp, region)) = devices.destination(target.device_page, session, at)
        else {
            return Err(MissReason::StaleGeneration);
        };
        let need = need.expect("validated at ingest");
        let NeedState::Leased(lease) = need.state else {
            unreachable!("restore is accepted only when ready");
        };
        let page = leases
            .get(lease)
            .and_then(|l| pages.get(l.0))
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
            executor: region.executor,
        });
    }
    Ok(plan)
}

/// A restore whose copies are being submitted.
struct RestoreJob<'a> {
    entity: Entity,
    op: &'a mut Operation,
    rec: &'a mut Recovery,
    /// Its batches in flight (this tick's included).
    in_flight: usize,
}

impl RestoreJob<'_> {
    /// Submits the next batches while there is room. Past its deadline, or
    /// once it failed, the rest is abandoned; the fence finishes it once
    /// what was sent drained, and retiring unpins every destination.
    fn send(&mut self, commands: &mut Commands, copies: &mut Copies) {
        let (op, rec) = (&mut *self.op, &mut *self.rec);
        if op.outcome.is_none() && copies.now_us() >= op.deadline_us {
            op.outcome = Some(Outcome::Miss(MissReason::Deadline));
        }
        while op.outcome.is_none() && rec.copies_sent < rec.copies.len() {
            // A batch goes to one executor: the copy engine, or one agent.
            let executor = rec.copies[rec.copies_sent].executor;
            let end = (rec.copies_sent + copies.batch_pages()).min(rec.copies.len());
            let end = rec.copies[rec.copies_sent..end]
                .iter()
                .position(|c| c.executor != executor)
                .map_or(end, |n| rec.copies_sent + n);
            let batch = &rec.copies[rec.copies_sent..end];
            let page_copies: Vec<PageCopy> = batch.iter().map(page_copy).collect();
            let kind = TransferKind::Restore {
                device_pages: batch.iter().map(|c| c.device_page).collect(),
            };
            let to_device = Direction::HostToDevice;
            match copies.submit(
                commands,
                self.entity,
                to_device,
                &page_copies,
                kind,
                executor,
            ) {
                Ok(()) => {
                    self.in_flight += 1;
                    rec.copies_sent = end;
                }
                Err(Refused::Full) => return,
                Err(Refused::Failed) => op.outcome = Some(Outcome::Miss(MissReason::IoError)),
            }
        }
        // Failed, cancelled or out of time: what was not submitted never
        // will be.
        rec.copies_sent = rec.copies.len();
        if self.in_flight == 0 && op.outcome.is_some() {
            set_state(commands, self.entity, op, OpState::Finishing);
        }
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
        sum: orbitkv_gpu::SumOf::Destination,
    }
}
