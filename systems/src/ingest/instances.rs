//! `RegisterInstance`: compile a registration (seal each rank's namespace,
//! compile its contract), then attach to the same instance, replace one of
//! another computation under the name, or spawn a new one.

use std::collections::HashSet;

use bevy_ecs::prelude::*;
use orbitkv_components::api::{CommandError, Event, InvalidCommand, LimitName, Rank};
use orbitkv_components::ecs::{Group, GroupOf, Instance, RankState, Session, Sessions};
use orbitkv_components::{ContractSpec, GroupSpec, RecoveryContract, StorageLayout, seal};

use super::resolve::{invalid, limit};
use super::{Ctx, Result, emit};
use crate::resources::{Dram, Limits, Registry};

/// A rank's layout that cannot be sealed or encoded.
fn layout_error(rank: Rank, e: &orbitkv_components::layout::LayoutError) -> CommandError {
    invalid(InvalidCommand::Layout {
        tp: rank.tp,
        pp: rank.pp,
        reason: e.to_string(),
    })
}

pub(super) struct Args {
    pub name: String,
    pub identity: [u8; 32],
    pub layout: StorageLayout,
    pub page_tokens: u64,
    pub groups: Vec<GroupSpec>,
    pub ranks: Vec<Rank>,
}

/// What registering changes.
enum Plan {
    /// The same computation is registered: nothing.
    Existing(Entity),
    /// A new instance, first taking an old one of the name out of use:
    /// despawned now, or (while sessions still drain against it) retired,
    /// to go with the last of them.
    Fresh { replaces: Option<(Entity, bool)> },
}

pub(super) fn register(world: &mut World, ctx: Ctx, args: Args) -> Result<()> {
    let limits = world.resource::<Limits>();
    check_shape(limits, &args)?;
    let mut args = args;
    args.ranks.sort_by_key(|r| (r.pp, r.tp));
    let states = rank_states(&args)?;
    check_page_sizes(&states, world.resource::<Dram>().pool.extent_bytes())?;
    let plan = plan(world, &args, &states)?;
    apply(world, ctx, args, states, plan);
    Ok(())
}

/// Counts, duplicate ranks, and every slot naming a registered rank, a
/// declared group and the instance's page size.
fn check_shape(limits: &Limits, a: &Args) -> Result<()> {
    if a.name.is_empty() {
        return Err(invalid(InvalidCommand::EmptyInstanceName));
    }
    if a.ranks.is_empty() {
        return Err(invalid(InvalidCommand::NoRanks));
    }
    if a.ranks.len() > limits.max_ranks {
        return Err(limit(LimitName::MaxRanks, limits.max_ranks));
    }
    if a.groups.len() > limits.max_groups {
        return Err(limit(LimitName::MaxGroups, limits.max_groups));
    }
    let ranks: HashSet<Rank> = a.ranks.iter().copied().collect();
    if ranks.len() != a.ranks.len() {
        return Err(invalid(InvalidCommand::DuplicateRank));
    }
    let group_ids: HashSet<u32> = a.groups.iter().map(|g| g.id).collect();
    for slot in &a.layout.slots {
        let (layer, group) = (slot.layer, slot.group);
        if !ranks.contains(&Rank {
            tp: slot.tp_rank,
            pp: slot.pp_rank,
        }) {
            return Err(invalid(InvalidCommand::SlotRank {
                layer,
                tp: slot.tp_rank,
                pp: slot.pp_rank,
            }));
        }
        if !group_ids.contains(&group) {
            return Err(invalid(InvalidCommand::SlotGroup { layer, group }));
        }
        if u64::from(slot.page_tokens) != a.page_tokens {
            return Err(invalid(InvalidCommand::SlotPageTokens {
                layer,
                slot: slot.page_tokens,
                instance: a.page_tokens,
            }));
        }
    }
    Ok(())
}

/// Every group's page fits in one DRAM extent (the pool's largest slot).
fn check_page_sizes(states: &[RankState], extent_bytes: u64) -> Result<()> {
    for state in states {
        for &(group, page_bytes) in &state.page_bytes {
            if page_bytes > extent_bytes {
                return Err(invalid(InvalidCommand::PageExceedsExtent {
                    group,
                    page_bytes,
                    extent_bytes,
                }));
            }
        }
    }
    Ok(())
}

/// Per rank: the sealed namespace, compiled contract, page sizes and
/// format digest.
fn rank_states(a: &Args) -> Result<Vec<RankState>> {
    a.ranks.iter().map(|rank| rank_state(a, *rank)).collect()
}

fn rank_state(a: &Args, rank: Rank) -> Result<RankState> {
    let own = a.layout.for_rank(rank.tp, rank.pp);
    let namespace = seal(&a.identity, &own, &a.groups).map_err(|e| layout_error(rank, &e))?;
    let contract = RecoveryContract::compile(&ContractSpec {
        namespace,
        page_tokens: a.page_tokens,
        groups: a.groups.clone(),
    })
    .map_err(|e| {
        invalid(InvalidCommand::Contract {
            reason: e.to_string(),
        })
    })?;
    let mut page_bytes = Vec::new();
    for g in contract.groups() {
        let bytes: u64 = own
            .slots
            .iter()
            .filter(|s| s.group == g.id)
            .map(|s| s.padded_page_bytes)
            .sum();
        if bytes == 0 {
            return Err(invalid(InvalidCommand::RankWithoutGroup {
                tp: rank.tp,
                pp: rank.pp,
                group: g.id,
            }));
        }
        page_bytes.push((g.id, bytes));
    }
    let encoded = own.encode().map_err(|e| layout_error(rank, &e))?;
    Ok(RankState {
        rank,
        namespace,
        contract,
        page_bytes,
        format_digest: orbitkv_components::encoding::sha256(&encoded),
    })
}

fn plan(world: &World, a: &Args, states: &[RankState]) -> Result<Plan> {
    let registry = world.resource::<Registry>();
    let max = world.resource::<Limits>().max_instances;
    let Some(&existing) = registry.instances.get(&a.name) else {
        if registry.instances.len() >= max {
            return Err(limit(LimitName::MaxInstances, max));
        }
        return Ok(Plan::Fresh { replaces: None });
    };
    let inst = world
        .get::<Instance>(existing)
        .expect("registry points at live instances");
    let same = inst
        .ranks
        .iter()
        .map(|r| r.namespace)
        .eq(states.iter().map(|s| s.namespace))
        && inst.groups == a.groups
        && inst.page_tokens == a.page_tokens;
    if same {
        return Ok(Plan::Existing(existing));
    }
    // A new computation under the same name (new weights, new settings)
    // replaces the old instance once no open session uses it. Its pages
    // stay under the old namespace, where nothing can hit them.
    let (open, closing) = sessions_of(world, existing);
    if open {
        return Err(CommandError::InstanceConflict(a.name.clone()));
    }
    Ok(Plan::Fresh {
        replaces: Some((existing, closing)),
    })
}

/// Whether the instance has open sessions, and closing ones.
fn sessions_of(world: &World, instance: Entity) -> (bool, bool) {
    let Some(sessions) = world.get::<Sessions>(instance) else {
        return (false, false);
    };
    sessions
        .iter()
        .filter_map(|s| world.get::<Session>(s))
        .fold((false, false), |(o, c), s| {
            (o || !s.closing, c || s.closing)
        })
}

fn apply(world: &mut World, ctx: Ctx, a: Args, states: Vec<RankState>, plan: Plan) {
    let namespaces = states.iter().map(|s| s.namespace).collect();
    let (entity, existing) = match plan {
        Plan::Existing(entity) => (entity, true),
        Plan::Fresh { replaces } => {
            if let Some((old, draining)) = replaces {
                retire(world, old, draining);
            }
            (spawn(world, a, states), false)
        }
    };
    let event = Event::InstanceRegistered {
        command: ctx.id,
        instance: entity.to_bits(),
        namespaces,
        existing,
    };
    emit(world, ctx.origin, event);
}

/// Takes an instance out of the registry: despawned (with its groups) now,
/// or with its last draining session.
fn retire(world: &mut World, instance: Entity, draining: bool) {
    let name = world
        .get::<Instance>(instance)
        .expect("registry points at live instances")
        .name
        .clone();
    world.resource_mut::<Registry>().instances.remove(&name);
    if draining {
        world.get_mut::<Instance>(instance).expect("live").retired = true;
    } else {
        world.despawn(instance);
    }
}

fn spawn(world: &mut World, a: Args, states: Vec<RankState>) -> Entity {
    let group_bytes = states[0].page_bytes.clone();
    let name = a.name.clone();
    let entity = world
        .spawn(Instance {
            name: a.name,
            identity: a.identity,
            layout: a.layout,
            page_tokens: a.page_tokens,
            ranks: states,
            groups: a.groups,
            bytes_reserved: 0,
            retired: false,
        })
        .id();
    for (id, page_bytes) in group_bytes {
        world.spawn((Group { id, page_bytes }, GroupOf(entity)));
    }
    world
        .resource_mut::<Registry>()
        .instances
        .insert(name, entity);
    entity
}
