//! Sessions: open, close, and close every session of a departed origin.
//! Closing cancels the session's operations; submitted I/O drains, and the
//! fence stage despawns the session (with its regions and device pages)
//! once it owns no operation.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{CommandId, Event, LimitName, MissReason, Origin, SessionHandle};
use orbitkv_components::ecs::{
    OpState, Operation, Operations, Outcome, Session, SessionOf, session_handle,
};

use super::resolve::{self, limit};
use super::{Ctx, Result, emit};
use crate::lifecycle::set_state_now;
use crate::resources::{Agents, Limits, Registry};

pub(super) fn open(world: &mut World, ctx: Ctx, instance: &str) -> Result<()> {
    // Plan.
    let max = world.resource::<Limits>().max_sessions;
    let registry = world.resource::<Registry>();
    let Some(&inst) = registry.instances.get(instance) else {
        return Err(orbitkv_components::api::CommandError::UnknownInstance(
            instance.to_owned(),
        ));
    };
    if registry.sessions >= max {
        return Err(limit(LimitName::MaxSessions, max));
    }
    // Apply.
    let mut registry = world.resource_mut::<Registry>();
    registry.next_epoch += 1;
    registry.sessions += 1;
    let (epoch, incarnation) = (registry.next_epoch, registry.incarnation);
    let session = Session {
        origin: ctx.origin,
        epoch,
        closing: false,
        closed_by: None,
    };
    let entity = world.spawn((session, SessionOf(inst))).id();
    let event = Event::SessionOpened {
        command: ctx.id,
        session: session_handle(entity, epoch, incarnation),
    };
    emit(world, ctx.origin, event);
    Ok(())
}

pub(super) fn close(world: &mut World, ctx: Ctx, handle: SessionHandle) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    begin_close(world, owned.session, Some(ctx.id));
    Ok(())
}

/// Closes every open session of `origin`, as `close` would. Copies its
/// agent had in flight have failed: nobody is left to report them.
pub(super) fn close_origin(world: &mut World, origin: Origin) {
    world.resource_mut::<Agents>().lose(origin);
    let open: Vec<Entity> = world
        .query::<(Entity, &Session)>()
        .iter(world)
        .filter(|(_, s)| s.origin == origin && !s.closing)
        .map(|(e, _)| e)
        .collect();
    for entity in open {
        begin_close(world, entity, None);
    }
}

/// Marks the session closing and cancels everything it owns.
fn begin_close(world: &mut World, session: Entity, command: Option<CommandId>) {
    let mut s = world.get_mut::<Session>(session).expect("resolved");
    s.closing = true;
    s.closed_by = command;
    let ops: Vec<Entity> = world
        .get::<Operations>(session)
        .map(|o| o.iter().collect())
        .unwrap_or_default();
    for op in ops {
        cancel(world, op);
    }
}

/// Cancels one operation. Copies in flight cannot be recalled: a restoring
/// or publishing operation records the outcome and drains first.
pub(super) fn cancel(world: &mut World, entity: Entity) {
    let cancelled = Outcome::Miss(MissReason::Cancelled);
    match resolve::state_of(world, entity) {
        OpState::Finishing => {}
        OpState::Restoring | OpState::Publishing => {
            let mut op = world
                .get_mut::<Operation>(entity)
                .expect("a live operation");
            op.outcome.get_or_insert(cancelled);
        }
        _ => finish_now(world, entity, cancelled),
    }
}

/// `lifecycle::finish` for the exclusive stage.
pub(super) fn finish_now(world: &mut World, entity: Entity, outcome: Outcome) {
    world
        .get_mut::<Operation>(entity)
        .expect("a live operation")
        .outcome
        .get_or_insert(outcome);
    set_state_now(world, entity, OpState::Finishing);
}
