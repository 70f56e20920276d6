//! Small state transitions several stages share: finishing an operation,
//! taking and returning leases, and unpinning device pages.

use bevy_ecs::prelude::*;
use orbitkv_components::api::Event;
use orbitkv_components::ecs::{DevicePage, DeviceRegion, Lease, OpState, Operation, Outcome, Page};

use crate::resources::{Dram, Outbox};

/// Moves an operation to `Finishing`. The first outcome wins: a restore whose
/// copies already landed stays restored even if a cancel arrives later.
pub fn finish(op: &mut Operation, outcome: Outcome) {
    if op.outcome.is_none() {
        op.outcome = Some(outcome);
    }
    op.state = OpState::Finishing;
}

/// Pins `page` for `operation` and returns the lease entity.
pub fn take_lease(
    commands: &mut Commands,
    dram: &mut Dram,
    page_entity: Entity,
    page: &mut Page,
    operation: Entity,
) -> Entity {
    if page.leases == 0 {
        dram.pin(page_entity, page.residency.dram_slot);
    }
    page.leases += 1;
    commands
        .spawn(Lease {
            page: page_entity,
            operation,
        })
        .id()
}

/// Returns a lease; the page becomes evictable when its last lease goes.
pub fn return_lease(
    commands: &mut Commands,
    dram: &mut Dram,
    lease: Entity,
    page_entity: Entity,
    page: &mut Page,
) {
    page.leases -= 1;
    if page.leases == 0 {
        dram.make_evictable(page_entity, page.residency.dram_slot);
    }
    commands.entity(lease).despawn();
}

/// Drops one transfer's pin on a device page. A free that arrived while the
/// page was pinned takes effect now.
pub fn unpin_device_page(
    commands: &mut Commands,
    regions: &mut Query<&mut DeviceRegion>,
    outbox: &mut Outbox,
    entity: Entity,
    page: &mut DevicePage,
) {
    page.pins -= 1;
    if page.pins == 0 && page.free_deferred {
        let Some(owner) = regions.get(page.region).ok().map(|r| r.origin) else {
            unreachable!("a pinned device page keeps its region");
        };
        release_device_page(commands, regions, entity, page);
        outbox.push(
            owner,
            Event::DevicePageFreed {
                device_page: entity.to_bits(),
                deferred: true,
            },
        );
    }
}

/// Despawns a device page and clears its slot.
pub fn release_device_page(
    commands: &mut Commands,
    regions: &mut Query<&mut DeviceRegion>,
    entity: Entity,
    page: &DevicePage,
) {
    if let Ok(mut region) = regions.get_mut(page.region)
        && region.live.get(&page.slot) == Some(&entity)
    {
        region.live.remove(&page.slot);
    }
    commands.entity(entity).despawn();
}
