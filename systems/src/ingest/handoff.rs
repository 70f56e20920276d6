//! `Hold`: a prefill engine promises a decode engine the pages of a prompt
//! (the P/D handoff). The plan checks the bounds and computes every
//! promised key; the apply reserves the bytes, pins what is already in
//! DRAM and watches for the rest (the handoff stage pins it as it lands).

use bevy_ecs::prelude::*;
use orbitkv_components::StateKey;
use orbitkv_components::api::{
    CommandError, Event, GroupHashes, InvalidCommand, LimitName, SessionHandle,
};
use orbitkv_components::ecs::{Handoff, HeldBy, Instance, Lease, LeaseOf};

use super::resolve::{self, invalid, limit};
use super::{Ctx, Result, emit};
use crate::resources::{Clock, Dram, Handoffs, Limits};

pub(super) struct Args {
    pub handoff: u64,
    pub groups: Vec<GroupHashes>,
    pub deadline_ms: u64,
}

struct Plan {
    instance: Entity,
    deadline_us: u64,
    promised: Vec<StateKey>,
    bytes: u64,
}

fn plan(world: &World, ctx: Ctx, session: SessionHandle, args: &Args) -> Result<Plan> {
    let owned = resolve::session(world, ctx.origin, session)?;
    let limits = world.resource::<Limits>();
    let handoffs = world.resource::<Handoffs>();
    let pages: usize = args.groups.iter().map(|g| g.hashes.len()).sum();
    if pages == 0 || args.deadline_ms == 0 {
        return Err(invalid(InvalidCommand::EmptyHandoff));
    }
    if handoffs.by_id.contains_key(&args.handoff) {
        return Err(invalid(InvalidCommand::HandoffExists {
            handoff: args.handoff,
        }));
    }
    if handoffs.by_id.len() >= limits.max_handoffs {
        return Err(limit(LimitName::MaxHandoffs, limits.max_handoffs));
    }
    let deadline = args.deadline_ms.saturating_mul(1000);
    if deadline > limits.max_handoff_deadline_us {
        return Err(CommandError::Limit {
            name: LimitName::MaxHandoffDeadline,
            limit: limits.max_handoff_deadline_us / 1000,
        });
    }
    let Some(instance) = world.get::<Instance>(owned.instance) else {
        unreachable!("sessions point at live instances");
    };
    for g in &args.groups {
        if args.groups.iter().filter(|o| o.group == g.group).count() > 1 {
            return Err(invalid(InvalidCommand::DuplicateGroup { group: g.group }));
        }
        if g.hashes.len() > limits.max_query_pages {
            return Err(limit(LimitName::MaxQueryPages, limits.max_query_pages));
        }
    }
    // The bytes first: the budget bounds what the keys below may take.
    let mut bytes = 0u64;
    for rank in &instance.ranks {
        for g in &args.groups {
            let Some(page_bytes) = rank.page_bytes(g.group) else {
                return Err(invalid(InvalidCommand::UnknownGroup { group: g.group }));
            };
            bytes = bytes.saturating_add(page_bytes.saturating_mul(g.hashes.len() as u64));
        }
    }
    if handoffs.reserved.saturating_add(bytes) > handoffs.budget {
        return Err(CommandError::Limit {
            name: LimitName::HandoffBytes,
            limit: handoffs.budget,
        });
    }
    let mut promised = Vec::with_capacity(pages.saturating_mul(instance.ranks.len()));
    for rank in &instance.ranks {
        for g in &args.groups {
            promised.extend(g.hashes.iter().map(|h| StateKey {
                namespace: rank.namespace,
                group: g.group,
                native: *h,
            }));
        }
    }
    let now = world.resource::<Clock>().now_us;
    Ok(Plan {
        instance: owned.instance,
        deadline_us: now.saturating_add(deadline),
        promised,
        bytes,
    })
}

pub(super) fn hold(world: &mut World, ctx: Ctx, session: SessionHandle, args: Args) -> Result<()> {
    let plan = plan(world, ctx, session, &args)?;
    let promised = plan.promised.len() as u64;
    let handoff = world
        .spawn(Handoff {
            id: args.handoff,
            origin: ctx.origin,
            instance: plan.instance,
            deadline_us: plan.deadline_us,
            promised: Vec::new(),
            pinned: 0,
            bytes: plan.bytes,
            taker: None,
        })
        .id();
    let mut present = Vec::new();
    let mut absent = Vec::new();
    {
        let dram = world.resource::<Dram>();
        for key in &plan.promised {
            match dram.index.get(key) {
                Some(&page) => present.push(page),
                None => absent.push(*key),
            }
        }
    }
    for page in &present {
        world.spawn((Lease, LeaseOf(*page), HeldBy(handoff)));
    }
    {
        let mut handoffs = world.resource_mut::<Handoffs>();
        handoffs.by_id.insert(args.handoff, handoff);
        handoffs.reserved = handoffs.reserved.saturating_add(plan.bytes);
        handoffs.counts.held += 1;
        for key in &absent {
            handoffs.wanted.entry(*key).or_default().push(handoff);
        }
    }
    if !absent.is_empty() {
        world.resource_mut::<Dram>().watch_landings = true;
    }
    if let Some(mut h) = world.get_mut::<Handoff>(handoff) {
        h.pinned = present.len() as u64;
        h.promised = plan.promised;
    }
    emit(
        world,
        ctx.origin,
        Event::Held {
            command: ctx.id,
            handoff: args.handoff,
            promised,
            pinned: present.len() as u64,
            bytes: plan.bytes,
        },
    );
    Ok(())
}

/// A `Load` naming `handoff` takes its pages: the handoff stage returns
/// the pins once `op` is past reading (it holds its own leases) or gone.
pub(super) fn take(world: &mut World, handoff: u64, op: Entity) {
    let Some(&entity) = world.resource::<Handoffs>().by_id.get(&handoff) else {
        return;
    };
    if let Some(mut h) = world.get_mut::<Handoff>(entity)
        && h.taker.is_none()
    {
        h.taker = Some(op);
    }
}
