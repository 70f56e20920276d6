//! `Clear`: drop every stored page of some namespaces (`orbitkv clear`).
//! The plan refuses the whole command while a page of them is leased or a
//! lower-tier read of one is in flight (a reader would lose what it holds);
//! the apply frees their DRAM slots, forgets them in the index and the LRU,
//! despawns them, and asks every lower tier to forget the namespaces,
//! reporting per tier what it dropped or why it could not.

use bevy_ecs::prelude::*;
use orbitkv_components::Namespace;
use orbitkv_components::api::{CommandError, Event, InvalidCommand, TierCleared};
use orbitkv_components::ecs::{Leases, Page};

use super::{Ctx, Result, emit};
use crate::resources::{Dram, Removal, Tiers};

/// The most namespaces one clear names (an instance has one per rank).
pub const MAX_CLEAR_NAMESPACES: usize = 1024;

/// What a clear removes from DRAM: each page and its slot.
struct Plan {
    pages: Vec<(Entity, u64)>,
}

fn plan(world: &mut World, namespaces: &[Namespace]) -> Result<Plan> {
    if namespaces.is_empty() || namespaces.len() > MAX_CLEAR_NAMESPACES {
        return Err(CommandError::Invalid(InvalidCommand::ClearNamespaces {
            count: namespaces.len(),
            max: MAX_CLEAR_NAMESPACES,
        }));
    }
    let reading = world
        .resource::<Dram>()
        .reading
        .keys()
        .filter(|k| namespaces.contains(&k.namespace))
        .count() as u64;
    let mut q = world.query::<(Entity, &Page, Has<Leases>)>();
    let mut pages = Vec::new();
    let mut leased = 0;
    for (e, page, is_leased) in q.iter(world) {
        if namespaces.contains(&page.key.namespace) {
            leased += u64::from(is_leased);
            pages.push((e, page.residency.dram_slot));
        }
    }
    if leased > 0 || reading > 0 {
        return Err(CommandError::Invalid(InvalidCommand::ClearBusy {
            leased,
            reading,
        }));
    }
    Ok(Plan { pages })
}

fn apply(world: &mut World, ctx: Ctx, namespaces: &[Namespace], plan: Plan) {
    for (e, slot) in &plan.pages {
        let key = world.get::<Page>(*e).map(|p| p.key);
        let mut dram = world.resource_mut::<Dram>();
        // Unleased, so in the LRU: out of it, the index and the pool.
        dram.pin(*e, *slot);
        if let Some(key) = key {
            dram.unindex_page(&key, Removal::Cleared);
        }
        dram.free(*slot);
        world.despawn(*e);
    }
    let mut tiers = world.resource_mut::<Tiers>();
    let cleared: Vec<TierCleared> = tiers
        .0
        .get_mut()
        .iter_mut()
        .map(|t| {
            let mut pages = 0;
            let mut error = None;
            for ns in namespaces {
                match t.clear_namespace(ns) {
                    Ok(n) => pages += n,
                    Err(e) => error = Some(e),
                }
            }
            TierCleared {
                tier: t.name().to_owned(),
                pages: error.is_none().then_some(pages),
                error,
            }
        })
        .collect();
    let event = Event::Cleared {
        command: ctx.id,
        dram_pages: plan.pages.len() as u64,
        tiers: cleared,
    };
    emit(world, ctx.origin, event);
}

pub(super) fn clear(world: &mut World, ctx: Ctx, namespaces: Vec<Namespace>) -> Result<()> {
    let plan = plan(world, &namespaces)?;
    apply(world, ctx, &namespaces, plan);
    Ok(())
}
