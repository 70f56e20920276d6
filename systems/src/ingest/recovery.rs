//! Recoveries: query (discovery and boundary selection follow in this
//! tick), prepare, restore, release and cancel.

use std::collections::HashSet;

use bevy_ecs::prelude::*;
use orbitkv_components::api::{
    CommandError, GroupHashes, InvalidCommand, LimitName, PagePos, RestoreTarget, SessionHandle,
};
use orbitkv_components::ecs::{
    Instance, LoadPlan, OpState, Operation, OperationOf, Outcome, Recovery, at,
};
use orbitkv_components::{KeyHasher, Namespace};

use super::resolve::{self, Owned, invalid, limit, wrong_state};
use super::sessions::{self, finish_now};
use super::{Ctx, Result};
use crate::discover;
use crate::lifecycle::set_state_now;
use crate::resources::{
    Clock, Dram, Limits, LoadRates, Metrics, Outbox, Registry, RestorePolicy, Tiers,
};
use crate::validate::{Judge, conclude};

pub(super) struct QueryArgs {
    pub request: u64,
    pub groups: Vec<GroupHashes>,
    pub origin: u64,
    pub prompt_len: u64,
    pub expect_namespaces: Vec<Namespace>,
    pub prepare: bool,
    pub speculative: bool,
    /// A `Lookup`: ends with its result (`Recovery::peek`).
    pub peek: bool,
    /// A `Load`: restores by itself once ready.
    pub load: Option<LoadPlan>,
    /// The P/D handoff a `Load` takes.
    pub handoff: Option<u64>,
}

pub(super) fn query(
    world: &mut World,
    ctx: Ctx,
    handle: SessionHandle,
    q: QueryArgs,
) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let (mut q, end) = plan_query(world, owned, q)?;
    if q.peek && q.load.is_none() && q.handoff.is_none() {
        lookup_now(world, ctx, owned, q, end);
        return Ok(());
    }
    if let Some(plan) = &q.load {
        check_plan(world, owned, plan, end)?;
    }
    // Apply.
    let now = world.resource::<Clock>().now_us;
    let deadline = now.saturating_add(world.resource::<Limits>().prepare_deadline_us);
    world.resource_mut::<Registry>().operations += 1;
    world.resource_mut::<Metrics>().queries += 1;
    let op = Operation::new(
        ctx.id,
        ctx.origin,
        owned.instance,
        q.request,
        OpState::Discover,
        deadline,
        q.speculative,
    );
    let recovery = Recovery {
        expect_namespaces: q.expect_namespaces,
        prepare: q.prepare,
        peek: q.peek,
        load: q.load.take(),
        ..Recovery::new(q.groups, q.origin, end, q.prompt_len)
    };
    let op = world
        .spawn((op, at::Discover, OperationOf(owned.session), recovery))
        .id();
    if let Some(handoff) = q.handoff {
        super::handoff::take(world, handoff, op);
    }
    Ok(())
}

/// A `Lookup`, answered here: discovery and selection exactly as the
/// discover and validate stages run them for a query, against the index
/// as this command finds it. It holds nothing and parks nothing, so it
/// needs no operation entity (spawning and retiring one was most of a
/// lookup's tick); its result names operation 0, and ends it.
fn lookup_now(world: &mut World, ctx: Ctx, owned: Owned, q: QueryArgs, end: u64) {
    let mut rec = Recovery {
        expect_namespaces: q.expect_namespaces,
        peek: true,
        ..Recovery::new(q.groups, q.origin, end, q.prompt_len)
    };
    // The resources it reads and the two it updates, borrowed side by
    // side. `resource_scope` would take each resource out of the world
    // and put it back: resources are components, so each is two
    // archetype moves, about 3.5k instructions of a lookup's 12k.
    let cell = world.as_unsafe_world_cell();
    // SAFETY: `Metrics` and `Tiers` are the only resources borrowed
    // mutably, each once; every other borrow is shared and of another
    // resource or of a component (`Instance`), and nothing else touches
    // the world until they end with this block.
    let (result, miss) = unsafe {
        let (Some(mut metrics), Some(mut tiers), Some(dram), Some(policy), Some(rates)) = (
            cell.get_resource_mut::<Metrics>(),
            cell.get_resource_mut::<Tiers>(),
            cell.get_resource::<Dram>(),
            cell.get_resource::<RestorePolicy>(),
            cell.get_resource::<LoadRates>(),
        ) else {
            unreachable!("the runtime inserts every resource at build");
        };
        let instance = cell
            .get_entity(owned.instance)
            .ok()
            .and_then(|e| e.get::<Instance>());
        let tiers = tiers.0.get_mut();
        metrics.queries += 1;
        discover::discover_one(&mut rec, instance, dram, tiers, &mut metrics);
        let judge = Judge {
            policy,
            rates,
            dram,
            tiers,
        };
        conclude(
            (ctx.id, q.request),
            0,
            &mut rec,
            instance,
            &judge,
            &mut metrics,
        )
    };
    if let Some(reason) = miss {
        world.resource_mut::<Metrics>().miss(reason);
    }
    world
        .resource_mut::<Outbox>()
        .push_ending(ctx.origin, result, true);
}

/// Checks the hashes against the instance's groups and bounds; returns the
/// query with its groups sorted, and the hashed span's end.
fn plan_query(world: &World, owned: Owned, mut q: QueryArgs) -> Result<(QueryArgs, u64)> {
    let limits = world.resource::<Limits>();
    if world.resource::<Registry>().operations >= limits.max_operations {
        return Err(limit(LimitName::MaxOperations, limits.max_operations));
    }
    let instance = world
        .get::<Instance>(owned.instance)
        .expect("sessions point at live instances");
    q.groups.sort_by_key(|g| g.group);
    let declared = instance.ranks[0].contract.groups();
    // Compared in place; the lists are built only for the refusal.
    if !declared
        .iter()
        .map(|g| g.id)
        .eq(q.groups.iter().map(|g| g.group))
    {
        return Err(invalid(InvalidCommand::QueryGroups {
            given: q.groups.iter().map(|g| g.group).collect(),
            declared: declared.iter().map(|g| g.id).collect(),
        }));
    }
    let pages = q.groups[0].hashes.len();
    if q.groups.iter().any(|g| g.hashes.len() != pages) {
        return Err(invalid(InvalidCommand::UnevenHashes));
    }
    if pages > limits.max_query_pages {
        return Err(limit(LimitName::MaxQueryPages, limits.max_query_pages));
    }
    let page = instance.page_tokens;
    let end = pages as u64 * page;
    if !q.origin.is_multiple_of(page) || q.origin > end {
        return Err(invalid(InvalidCommand::Origin {
            origin: q.origin,
            end,
        }));
    }
    if !q.expect_namespaces.is_empty() && q.expect_namespaces.len() != instance.ranks.len() {
        return Err(invalid(InvalidCommand::ExpectNamespaces));
    }
    Ok((q, end))
}

/// A `Load`'s plan, before anything runs: known ranks, each named once;
/// every position one the query hashed, of a named rank and a declared
/// group; destinations this session's (as a `Restore`'s), none twice.
fn check_plan(world: &World, owned: Owned, plan: &LoadPlan, end: u64) -> Result<()> {
    let instance = world
        .get::<Instance>(owned.instance)
        .expect("sessions point at live instances");
    let ranks = instance.ranks.len();
    let mut named = HashSet::new();
    for &rank in &plan.ranks {
        if rank as usize >= ranks {
            return Err(invalid(InvalidCommand::UnknownRank { rank }));
        }
        if !named.insert(rank) {
            return Err(invalid(InvalidCommand::DuplicateRank));
        }
    }
    let page = instance.page_tokens;
    let groups = instance.ranks[0].contract.groups();
    for pos in plan.targets.iter().map(|t| &t.pos).chain(&plan.retained) {
        if !named.contains(&pos.rank) {
            return Err(invalid(InvalidCommand::UnknownRank { rank: pos.rank }));
        }
        if !groups.iter().any(|g| g.id == pos.group) {
            return Err(invalid(InvalidCommand::UnknownGroup { group: pos.group }));
        }
        if pos.page_end == 0 || pos.page_end > end || !pos.page_end.is_multiple_of(page) {
            return Err(invalid(InvalidCommand::NoHash {
                page_end: pos.page_end,
            }));
        }
    }
    let mut seen = HashSet::with_capacity_and_hasher(plan.targets.len(), KeyHasher::default());
    for t in &plan.targets {
        if !seen.insert(t.device_page) {
            return Err(invalid(InvalidCommand::DuplicateTarget {
                device_page: t.device_page,
            }));
        }
        if let Err(CommandError::NotOwner) =
            resolve::device_page(world, owned.session, t.device_page)
        {
            return Err(CommandError::NotOwner);
        }
    }
    Ok(())
}

pub(super) fn prepare(world: &mut World, ctx: Ctx, handle: SessionHandle, bits: u64) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let op = resolve::operation(world, owned.session, bits)?;
    let state = resolve::state_of(world, op);
    if state != OpState::Selected {
        return Err(wrong_state(op, state, &[OpState::Selected]));
    }
    set_state_now(world, op, OpState::Admit);
    Ok(())
}

pub(super) fn restore(
    world: &mut World,
    ctx: Ctx,
    handle: SessionHandle,
    bits: u64,
    targets: Vec<RestoreTarget>,
    retained: Vec<PagePos>,
) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let op = resolve::operation(world, owned.session, bits)?;
    // A destination that is live but another session's is refused here; a
    // dead one fails the restore when its copies are resolved
    // (`stale_generation`), as it may die between now and then anyway.
    for t in &targets {
        if let Err(CommandError::NotOwner) =
            resolve::device_page(world, owned.session, t.device_page)
        {
            return Err(CommandError::NotOwner);
        }
    }
    let state = resolve::state_of(world, op);
    if state != OpState::Ready {
        return Err(wrong_state(op, state, &[OpState::Ready]));
    }
    let rec = world
        .get::<Recovery>(op)
        .ok_or_else(|| invalid(InvalidCommand::NotRecovery))?;
    let instance = world
        .get::<Instance>(owned.instance)
        .expect("sessions point at live instances");
    crate::load::check(instance, rec, &targets, &retained, |_| true)?;
    // Apply.
    let deadline = world
        .resource::<Clock>()
        .now_us
        .saturating_add(world.resource::<Limits>().restore_deadline_us);
    let mut rec = world.get_mut::<Recovery>(op).expect("checked");
    rec.restore = targets;
    rec.retained = retained;
    world.get_mut::<Operation>(op).expect("checked").deadline_us = deadline;
    set_state_now(world, op, OpState::RestorePending);
    Ok(())
}

pub(super) fn release(world: &mut World, ctx: Ctx, handle: SessionHandle, bits: u64) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let op = resolve::operation(world, owned.session, bits)?;
    const RELEASABLE: [OpState; 4] = [
        OpState::Selected,
        OpState::Admit,
        OpState::Reading,
        OpState::Ready,
    ];
    let state = resolve::state_of(world, op);
    if !RELEASABLE.contains(&state) {
        return Err(wrong_state(op, state, &RELEASABLE));
    }
    finish_now(world, op, Outcome::Released);
    Ok(())
}

pub(super) fn cancel(world: &mut World, ctx: Ctx, handle: SessionHandle, bits: u64) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let op = resolve::operation(world, owned.session, bits)?;
    sessions::cancel(world, op);
    Ok(())
}
