//! Handles to entities, checked: live, of this incarnation and epoch, and
//! owned by the submitting origin (through its session). A dead handle is
//! its kind's stale or unknown error; a live one of another origin or
//! session is `NotOwner`.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{CommandError, InvalidCommand, LimitName, Origin, SessionHandle};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, OpState, Operation, OperationOf, PageOf, RegionOf, Session, SessionOf,
};

use super::Result;
use crate::resources::Registry;

pub(super) fn invalid(why: InvalidCommand) -> CommandError {
    CommandError::Invalid(why)
}

pub(super) fn limit(name: LimitName, limit: usize) -> CommandError {
    CommandError::Limit {
        name,
        limit: limit as u64,
    }
}

pub(super) fn wrong_state(op: Entity, state: OpState, expected: &[OpState]) -> CommandError {
    CommandError::WrongState {
        operation: op.to_bits(),
        state,
        expected: expected.to_vec(),
    }
}

/// A resolved session: its entity and its instance.
#[derive(Debug, Clone, Copy)]
pub(super) struct Owned {
    pub session: Entity,
    pub instance: Entity,
}

/// Same incarnation, live entity, same epoch, not closing (else
/// `StaleSession`), opened by `origin` (else `NotOwner`).
pub(super) fn session(world: &World, origin: Origin, handle: SessionHandle) -> Result<Owned> {
    if handle.incarnation != world.resource::<Registry>().incarnation {
        return Err(CommandError::StaleSession);
    }
    let entity = Entity::try_from_bits(handle.id).ok_or(CommandError::StaleSession)?;
    let e = world
        .get_entity(entity)
        .map_err(|_| CommandError::StaleSession)?;
    let (Some(s), Some(of)) = (e.get::<Session>(), e.get::<SessionOf>()) else {
        return Err(CommandError::StaleSession);
    };
    if s.epoch != handle.epoch || s.closing {
        return Err(CommandError::StaleSession);
    }
    if s.origin != origin {
        return Err(CommandError::NotOwner);
    }
    Ok(Owned {
        session: entity,
        instance: of.0,
    })
}

/// A live operation (else `UnknownOperation`) of `session` (else
/// `NotOwner`).
pub(super) fn operation(world: &World, session: Entity, bits: u64) -> Result<Entity> {
    let unknown = CommandError::UnknownOperation(bits);
    let entity = Entity::try_from_bits(bits).ok_or(unknown.clone())?;
    let e = world.get_entity(entity).map_err(|_| unknown.clone())?;
    match (e.get::<Operation>(), e.get::<OperationOf>()) {
        (Some(_), Some(of)) if of.0 == session => Ok(entity),
        (Some(_), _) => Err(CommandError::NotOwner),
        _ => Err(unknown),
    }
}

/// The state of a resolved operation.
pub(super) fn state_of(world: &World, op: Entity) -> OpState {
    world
        .get::<Operation>(op)
        .expect("resolved operations are live")
        .state()
}

/// A live device region (else `UnknownRegion`) of `session` (else
/// `NotOwner`).
pub(super) fn region(world: &World, session: Entity, bits: u64) -> Result<Entity> {
    let unknown = CommandError::UnknownRegion(bits);
    let entity = Entity::try_from_bits(bits).ok_or(unknown.clone())?;
    let e = world.get_entity(entity).map_err(|_| unknown.clone())?;
    match (e.get::<DeviceRegion>(), e.get::<RegionOf>()) {
        (Some(_), Some(of)) if of.0 == session => Ok(entity),
        (Some(_), _) => Err(CommandError::NotOwner),
        _ => Err(unknown),
    }
}

/// A live device page the engine has not freed (else `StaleGeneration`),
/// of a region of `session` (else `NotOwner`): (page, region).
pub(super) fn device_page(world: &World, session: Entity, bits: u64) -> Result<(Entity, Entity)> {
    // Built only on the error path: this runs for every page of a
    // publish and a restore.
    let stale = || CommandError::StaleGeneration(bits);
    let entity = Entity::try_from_bits(bits).ok_or_else(stale)?;
    let e = world.get_entity(entity).map_err(|_| stale())?;
    let (Some(page), Some(of)) = (e.get::<DevicePage>(), e.get::<PageOf>()) else {
        return Err(stale());
    };
    if page.free_deferred.is_some() {
        return Err(stale());
    }
    match world.get::<RegionOf>(of.0) {
        Some(owner) if owner.0 == session => Ok((entity, of.0)),
        Some(_) => Err(CommandError::NotOwner),
        None => Err(stale()),
    }
}
