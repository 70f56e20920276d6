//! Time and drained I/O: `expire` reports overdue transfers and ends
//! operations whose deadline passed before their copies started; `settle`
//! finishes restores and publishes whose every copy was sent and drained.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{Event, MissReason};
use orbitkv_components::ecs::{
    ItemState, OpState, Operation, Outcome, PublishJob, Recovery, Transfer, TransferOf, Transfers,
    at, before_restore,
};

use crate::lifecycle::finish;
use crate::resources::{Clock, Limits, Metrics, Outbox};

/// An overdue transfer fails its operation but keeps every buffer it owns:
/// a logical timeout is not proof the hardware stopped. A preparation past
/// its deadline misses; a publish still waiting for DRAM space is done
/// with what it has (nothing).
pub fn expire(
    mut commands: Commands,
    mut ops: Query<(Entity, &mut Operation)>,
    mut transfers: Query<(&mut Transfer, &TransferOf)>,
    mut outbox: ResMut<Outbox>,
    mut metrics: ResMut<Metrics>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    for (mut t, of) in &mut transfers {
        if t.overdue || clock.now_us.saturating_sub(t.submitted_us) < limits.transfer_timeout_us {
            continue;
        }
        t.overdue = true;
        metrics.transfers_overdue += 1;
        let (_, mut op) = ops
            .get_mut(of.0)
            .expect("an operation retires only after its transfers");
        op.outcome.get_or_insert(Outcome::Miss(MissReason::IoError));
        let event = Event::TransferOverdue {
            operation: of.0.to_bits(),
            kind: t.kind.name().to_owned(),
        };
        outbox.push(op.origin, event);
    }
    for (entity, mut op) in &mut ops {
        if op.deadline_us > clock.now_us {
            continue;
        }
        let outcome = match op.state() {
            s if before_restore(s) => Outcome::Miss(MissReason::Deadline),
            OpState::PublishPending => Outcome::Published,
            _ => continue,
        };
        finish(&mut commands, entity, &mut op, outcome);
    }
}

type Draining<'a> = (
    Entity,
    &'a mut Operation,
    Option<&'a Recovery>,
    Option<&'a PublishJob>,
);

/// Restoring or publishing, with nothing in flight.
type DrainedCopying = (
    Or<(With<at::Restoring>, With<at::Publishing>)>,
    Without<Transfers>,
);

/// Restores and publishes with no transfer left: finished once nothing is
/// left to send (a restore keeps an earlier failure as its outcome).
pub fn settle(mut commands: Commands, mut ops: Query<Draining, DrainedCopying>) {
    for (entity, mut op, rec, job) in &mut ops {
        let unsent = rec.is_some_and(|r| r.copies_sent < r.copies.len())
            || job.is_some_and(|j| j.items.iter().any(|i| i.state == ItemState::Waiting));
        if unsent {
            continue; // the copy stages send it, or abandon it
        }
        let outcome = if rec.is_some() {
            Outcome::Restored
        } else {
            Outcome::Published
        };
        finish(&mut commands, entity, &mut op, outcome);
    }
}
