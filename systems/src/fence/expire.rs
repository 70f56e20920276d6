//! Time: `expire` reports overdue transfers (and agent copies past
//! `agent_copy_deadline_us`), which finishes their operations, and ends
//! operations whose deadline passed before their copies started.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{Event, MissReason};
use orbitkv_components::ecs::{
    Executor, OpState, Operation, Outcome, Transfer, TransferOf, before_restore,
};

use crate::lifecycle::finish;
use crate::resources::{Clock, Limits, Metrics, Outbox};

/// An overdue transfer fails and finishes its operation, whose reply then
/// goes out (`retire`) without waiting for it, but it keeps every buffer it
/// owns: a logical timeout is not proof the hardware stopped. A
/// preparation past its deadline misses; a publish still waiting for DRAM
/// space is done with what it has (nothing).
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
        // An agent's copy has its own deadline, and passing it fails the
        // copy even if the agent reports success later.
        let (timeout_us, reason) = match t.executor {
            Executor::Local => (limits.transfer_timeout_us, MissReason::IoError),
            Executor::Agent(_) => (limits.agent_copy_deadline_us, MissReason::Deadline),
        };
        if t.overdue || clock.now_us.saturating_sub(t.submitted_us) < timeout_us {
            continue;
        }
        t.overdue = true;
        metrics.transfers_overdue += 1;
        let (entity, mut op) = ops
            .get_mut(of.0)
            .expect("an operation retires only after its transfers");
        finish(&mut commands, entity, &mut op, Outcome::Miss(reason));
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
