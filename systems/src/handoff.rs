//! The P/D handoffs' part of the fence stage: promised pages are pinned as
//! they land, and a handoff ends (its pins and reserved bytes returned)
//! once the load that names it has retired (its own leases held the pages
//! until then), or
//! when its deadline passes.

use bevy_ecs::prelude::*;
use orbitkv_components::ecs::{Handoff, Operation};

use crate::lifecycle::take_lease;
use crate::resources::{Clock, Dram, Handoffs, decrement};

/// Pins the promised pages indexed since the last tick.
pub fn pin(
    mut commands: Commands,
    mut dram: ResMut<Dram>,
    mut handoffs: ResMut<Handoffs>,
    mut held: Query<&mut Handoff>,
) {
    let landed = std::mem::take(&mut dram.landed);
    for key in landed {
        let Some(waiting) = handoffs.wanted.remove(&key) else {
            continue;
        };
        let Some(&page) = dram.index.get(&key) else {
            continue; // indexed and dropped again in this tick
        };
        for handoff in waiting {
            if let Ok(mut h) = held.get_mut(handoff) {
                take_lease(&mut commands, page, handoff);
                h.pinned += 1;
                handoffs.counts.pinned_late += 1;
            }
        }
    }
    dram.watch_landings = !handoffs.wanted.is_empty();
}

/// Ends the handoffs that were taken or whose deadline passed.
pub fn sweep(
    mut commands: Commands,
    clock: Res<Clock>,
    mut handoffs: ResMut<Handoffs>,
    mut dram: ResMut<Dram>,
    held: Query<(Entity, &Handoff)>,
    operations: Query<&Operation>,
) {
    let now = clock.now_us;
    for (entity, h) in &held {
        // Taken once the load that named it has retired: every rank's
        // loads of a tensor-parallel engine start together, so the pins
        // stand while the first one's leases do, and the others have
        // leased the pages by then (a page lost meanwhile is a failed load
        // the engine recomputes, never a wrong one).
        let taken = h.taker.is_some_and(|t| operations.get(t).is_err());
        let expired = now >= h.deadline_us;
        if !(taken || expired) {
            continue;
        }
        if taken {
            handoffs.counts.taken += 1;
        } else {
            handoffs.counts.expired += 1;
        }
        end(&mut commands, &mut handoffs, entity, h);
    }
    dram.watch_landings = !handoffs.wanted.is_empty();
}

/// Despawns a handoff (its leases go with it) and forgets it.
fn end(commands: &mut Commands, handoffs: &mut Handoffs, entity: Entity, h: &Handoff) {
    let removed = handoffs.by_id.remove(&h.id);
    assert_eq!(
        removed,
        Some(entity),
        "a standing handoff is indexed by its id"
    );
    decrement(&mut handoffs.reserved, h.bytes, "handoffs.reserved");
    for key in &h.promised {
        if let Some(waiting) = handoffs.wanted.get_mut(key) {
            waiting.retain(|&e| e != entity);
            if waiting.is_empty() {
                handoffs.wanted.remove(key);
            }
        }
    }
    commands.entity(entity).despawn();
}
