//! Device regions and pages: the engine's GPU page slots. A page handle is
//! fresh on every allocation, so a stale one never reaches the slot's next
//! page.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{
    AgentRegion, CommandError, CopyRefusal, Event, InvalidCommand, SessionHandle,
};
use orbitkv_components::ecs::{DevicePage, DeviceRegion, Executor, Instance, PageOf, RegionOf};

use super::resolve::{self, invalid};
use super::{Ctx, Result, emit};
use crate::resources::{Agents, Copier, Limits};

/// The copy engine's refusal of a region, typed for the engine.
fn copy_refusal(bytes: u64, e: orbitkv_gpu::CopyError) -> CopyRefusal {
    match e {
        orbitkv_gpu::CopyError::RegionRejected(_, reason) => {
            CopyRefusal::RegionRejected { bytes, reason }
        }
        e => CopyRefusal::Failed {
            reason: e.to_string(),
        },
    }
}

pub(super) fn register_region(
    world: &mut World,
    ctx: Ctx,
    handle: SessionHandle,
    (rank, group): (u32, u32),
    slots: u32,
    agent: Option<AgentRegion>,
) -> Result<()> {
    // Plan.
    let owned = resolve::session(world, ctx.origin, handle)?;
    let max = world.resource::<Limits>().max_region_slots;
    if slots == 0 || slots > max {
        return Err(invalid(InvalidCommand::RegionSlots { slots, max }));
    }
    let instance = world
        .get::<Instance>(owned.instance)
        .expect("sessions point at live instances");
    let page_bytes = instance
        .rank(rank)
        .ok_or_else(|| invalid(InvalidCommand::UnknownRank { rank }))?
        .page_bytes(group)
        .ok_or_else(|| invalid(InvalidCommand::UnknownGroup { group }))?;
    let bytes = page_bytes
        .checked_mul(u64::from(slots))
        .ok_or_else(|| invalid(InvalidCommand::RegionTooLarge))?;
    if agent.is_none() {
        within_region_bytes(world, bytes)?;
    }
    if let Some(a) = agent
        && a.page_bytes != page_bytes
    {
        return Err(invalid(InvalidCommand::AgentPageBytes {
            agent: a.page_bytes,
            rank,
            group,
            page_bytes,
        }));
    }
    // Apply: the executor first, the one step that can still refuse.
    let (engine_region, executor) = match agent {
        // The manager never maps it: only the origin's staging area is
        // made here, the one memory the agent writes for the manager.
        Some(a) => {
            let staging_bytes = world.resource::<Limits>().max_staging_bytes;
            world
                .resource_mut::<Agents>()
                .ensure_staging(ctx.origin, staging_bytes)
                .map_err(|e| {
                    CommandError::Copy(CopyRefusal::Failed {
                        reason: format!("staging area: {e}"),
                    })
                })?;
            (a.region, Executor::Agent(ctx.origin))
        }
        None => {
            let id = world
                .resource_mut::<Copier>()
                .0
                .get_mut()
                .register_device_region(bytes)
                .map_err(|e| CommandError::Copy(copy_refusal(bytes, e)))?;
            (id, Executor::Local)
        }
    };
    let region = DeviceRegion {
        origin: ctx.origin,
        rank,
        group,
        slots,
        page_bytes,
        engine_region,
        executor,
        by_slot: Default::default(),
    };
    let entity = world.spawn((region, RegionOf(owned.session))).id();
    let event = Event::RegionRegistered {
        command: ctx.id,
        region: entity.to_bits(),
        engine_region,
        page_bytes,
        agent: executor != Executor::Local,
    };
    emit(world, ctx.origin, event);
    Ok(())
}

/// Refuses a manager-owned region that would take the live ones past
/// `max_region_bytes`. Summed from the regions themselves (no count kept
/// by hand): registrations are rare, and a closed session's regions are
/// unmapped when they despawn.
fn within_region_bytes(world: &mut World, bytes: u64) -> Result<()> {
    let max = world.resource::<Limits>().max_region_bytes;
    let live: u64 = world
        .query::<&DeviceRegion>()
        .iter(world)
        .filter(|r| r.executor == Executor::Local)
        .map(|r| r.page_bytes.saturating_mul(u64::from(r.slots)))
        .fold(0, u64::saturating_add);
    if live.saturating_add(bytes) > max {
        return Err(CommandError::Limit {
            name: orbitkv_components::api::LimitName::MaxRegionBytes,
            limit: max,
        });
    }
    Ok(())
}

pub(super) fn alloc(
    world: &mut World,
    ctx: Ctx,
    handle: SessionHandle,
    region_bits: u64,
    slot: u32,
) -> Result<()> {
    // Plan.
    let owned = resolve::session(world, ctx.origin, handle)?;
    let region_entity = resolve::region(world, owned.session, region_bits)?;
    let region = world.get::<DeviceRegion>(region_entity).expect("resolved");
    if slot >= region.slots {
        return Err(invalid(InvalidCommand::SlotOutOfRange {
            slot,
            slots: region.slots,
        }));
    }
    if region.by_slot.contains_key(&slot) {
        return Err(CommandError::SlotInUse {
            region: region_bits,
            slot,
        });
    }
    // Apply.
    let page = DevicePage {
        slot,
        pins: 0,
        free_deferred: None,
    };
    let page = world.spawn((page, PageOf(region_entity))).id();
    world
        .get_mut::<DeviceRegion>(region_entity)
        .expect("resolved")
        .by_slot
        .insert(slot, page);
    let event = Event::DevicePageAllocated {
        command: ctx.id,
        device_page: page.to_bits(),
    };
    emit(world, ctx.origin, event);
    Ok(())
}

pub(super) fn free(world: &mut World, ctx: Ctx, handle: SessionHandle, bits: u64) -> Result<()> {
    // Plan.
    let owned = resolve::session(world, ctx.origin, handle)?;
    let (entity, region) = resolve::device_page(world, owned.session, bits)?;
    // Apply.
    let mut page = world.get_mut::<DevicePage>(entity).expect("resolved");
    if page.pins > 0 {
        // A copy still uses it: it is freed with the last pin.
        page.free_deferred = Some(ctx.id);
        return Ok(());
    }
    let slot = page.slot;
    world.despawn(entity);
    let mut region = world.get_mut::<DeviceRegion>(region).expect("resolved");
    if region.by_slot.get(&slot) == Some(&entity) {
        region.by_slot.remove(&slot);
    }
    let event = Event::DevicePageFreed {
        command: ctx.id,
        device_page: bits,
        deferred: false,
    };
    emit(world, ctx.origin, event);
    Ok(())
}
