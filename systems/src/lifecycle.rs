//! State transitions several stages share: moving an operation to another
//! state (its field and its marker together), finishing it, taking leases,
//! unpinning device pages, and the hooks that keep the LRU to exactly
//! the unleased pages.

use bevy_ecs::lifecycle::HookContext;
use bevy_ecs::prelude::*;
use bevy_ecs::world::DeferredWorld;
use orbitkv_components::api::Event;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, HeldBy, Lease, LeaseOf, OpState, Operation, Outcome, Page, PageOf,
    mark_state,
};

use crate::resources::{Dram, Outbox, decrement};

/// Moves an operation to `to`: the field now, the marker when the stage's
/// commands apply (before the next stage runs).
pub fn set_state(commands: &mut Commands, entity: Entity, op: &mut Operation, to: OpState) {
    if op.record_state(to) {
        mark_state(&mut commands.entity(entity), to);
    }
}

/// `set_state` for the exclusive ingest stage: both at once.
pub fn set_state_now(world: &mut World, entity: Entity, to: OpState) {
    let mut e = world.entity_mut(entity);
    let changed = e
        .get_mut::<Operation>()
        .expect("a live operation")
        .record_state(to);
    if changed {
        mark_state(&mut e, to);
    }
}

/// Moves an operation to `Finishing`. The first outcome wins: a restore
/// whose copies already landed stays restored even if a cancel arrives
/// later.
pub fn finish(commands: &mut Commands, entity: Entity, op: &mut Operation, outcome: Outcome) {
    op.outcome.get_or_insert(outcome);
    set_state(commands, entity, op, OpState::Finishing);
}

/// Pins `page` for `operation` and returns the lease. The page leaves the
/// LRU when the lease lands (`on_leased`); despawning the operation returns
/// it.
pub fn take_lease(commands: &mut Commands, page: Entity, operation: Entity) -> Entity {
    commands
        .spawn((Lease, LeaseOf(page), HeldBy(operation)))
        .id()
}

/// Hook (`Leases` added): a page's first lease takes it out of the LRU.
/// Hooks, not observers: they run for every page of every load, and a
/// hook is a plain call where an observer runs a system.
pub fn on_leased(mut world: DeferredWorld, ctx: HookContext) {
    let entity = ctx.entity;
    let Some(slot) = world.get::<Page>(entity).map(|p| p.residency.dram_slot) else {
        return;
    };
    world.resource_mut::<Dram>().pin(entity, slot);
}

/// Hook (`Leases` removed): once its last lease is gone, a page may be
/// evicted, least recent first. (An evicted page leaves the index first,
/// and is never leased then.)
pub fn on_unleased(mut world: DeferredWorld, ctx: HookContext) {
    let entity = ctx.entity;
    let Some((key, slot)) = world
        .get::<Page>(entity)
        .map(|p| (p.key, p.residency.dram_slot))
    else {
        return;
    };
    let mut dram = world.resource_mut::<Dram>();
    if dram.index.get(&key) == Some(&entity) {
        dram.make_evictable(entity, slot);
    }
}

/// Drops one pin on a device page. A free that arrived while the page was
/// pinned takes effect with the last pin.
pub fn unpin_device_page(
    commands: &mut Commands,
    regions: &mut Query<&mut DeviceRegion>,
    outbox: &mut Outbox,
    entity: Entity,
    page: &mut DevicePage,
    of: PageOf,
) {
    decrement(&mut page.pins, 1, "device page pins");
    if page.pins > 0 {
        return;
    }
    let Some(command) = page.free_deferred else {
        return;
    };
    let Ok(mut region) = regions.get_mut(of.0) else {
        unreachable!("a pinned device page keeps its region");
    };
    let owner = region.origin;
    release_device_page(commands, &mut region, entity, page);
    outbox.push(
        owner,
        Event::DevicePageFreed {
            command,
            device_page: entity.to_bits(),
            deferred: true,
        },
    );
}

/// Despawns a device page and frees its slot in the region's index.
pub fn release_device_page(
    commands: &mut Commands,
    region: &mut DeviceRegion,
    entity: Entity,
    page: &DevicePage,
) {
    assert_eq!(page.pins, 0, "a pinned device page is never released");
    if region.by_slot.get(&page.slot) == Some(&entity) {
        region.by_slot.remove(&page.slot);
    }
    commands.entity(entity).despawn();
}
