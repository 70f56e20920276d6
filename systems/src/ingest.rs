//! Stage 1, ingest: engine commands become entities, in arrival order.
//!
//! This is the one exclusive system: commands of every kind must apply in
//! the order they were submitted (an alloc before the restore that targets
//! it), and a refused command must have no effect at all, so each handler
//! checks everything before it changes anything.

use std::collections::HashSet;

use bevy_ecs::prelude::*;
use orbitkv_components::api::{
    Command, CommandError, CommandId, Event, GroupHashes, Origin, PagePos, PublishPage, Rank,
    RestoreTarget, SessionHandle,
};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Group, Instance, ItemState, OpState, Operation, Outcome, PublishItem,
    PublishJob, RankState, Recovery, Session, session_handle,
};
use orbitkv_components::{
    ContractSpec, GroupSpec, Namespace, RecoveryContract, StateKey, StorageLayout, seal,
};

use crate::lifecycle::finish;
use crate::resources::{
    Clock, Copier, Inbound, Inbox, Limits, Metrics, Outbox, Registry, SimulatedClock,
};

type Result<T> = std::result::Result<T, CommandError>;

pub fn ingest(world: &mut World) {
    let max = world.resource::<Limits>().max_commands_per_tick;
    for _ in 0..max {
        let Some(inbound) = world.resource_mut::<Inbox>().0.pop_front() else {
            break;
        };
        let (id, origin, command) = match inbound {
            Inbound::Command {
                id,
                origin,
                command,
            } => (id, origin, command),
            Inbound::CloseOrigin(origin) => {
                close_origin(world, origin);
                continue;
            }
        };
        if let Err(error) = handle(world, id, origin, command) {
            world.resource_mut::<Metrics>().commands_rejected += 1;
            emit(world, origin, Event::Rejected { command: id, error });
        }
    }
}

fn emit(world: &mut World, to: Origin, event: Event) {
    world.resource_mut::<Outbox>().push(to, event);
}

fn invalid(msg: impl Into<String>) -> CommandError {
    CommandError::Invalid(msg.into())
}

fn limit(name: &str, limit: usize) -> CommandError {
    CommandError::Limit {
        name: name.to_owned(),
        limit: limit as u64,
    }
}

fn handle(world: &mut World, id: CommandId, origin: Origin, command: Command) -> Result<()> {
    match command {
        Command::RegisterInstance {
            instance,
            identity,
            layout,
            page_tokens,
            groups,
            ranks,
        } => register_instance(
            world,
            id,
            origin,
            instance,
            identity,
            layout,
            page_tokens,
            groups,
            ranks,
        ),
        Command::OpenSession { instance } => open_session(world, id, origin, &instance),
        Command::CloseSession { session } => close_session(world, origin, session),
        Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
        } => register_region(world, id, origin, session, rank, group, slots),
        Command::DevicePageAlloc {
            session,
            region,
            slot,
        } => alloc_device_page(world, id, origin, session, region, slot),
        Command::DevicePageFree {
            session,
            device_page,
        } => free_device_page(world, origin, session, device_page),
        Command::Query {
            session,
            request,
            groups,
            origin: hbm_origin,
            prompt_len,
            expect_namespaces,
            prepare,
            speculative,
        } => {
            let q = QueryArgs {
                request,
                groups,
                origin: hbm_origin,
                prompt_len,
                expect_namespaces,
                prepare,
                speculative,
            };
            query(world, id, origin, session, q)
        }
        Command::Prepare { session, operation } => prepare(world, origin, session, operation),
        Command::Restore {
            session,
            operation,
            targets,
            retained,
        } => restore(world, origin, session, operation, targets, retained),
        Command::Publish {
            session,
            request,
            pages,
        } => publish(world, id, origin, session, request, pages),
        Command::Release { session, operation } => release(world, origin, session, operation),
        Command::Cancel { session, operation } => cancel(world, origin, session, operation),
        Command::AdvanceClock { us } => {
            if !world.resource::<SimulatedClock>().0 {
                return Err(CommandError::WallClock);
            }
            let mut clock = world.resource_mut::<Clock>();
            clock.now_us = clock.now_us.saturating_add(us);
            Ok(())
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn register_instance(
    world: &mut World,
    id: CommandId,
    origin: Origin,
    name: String,
    identity: [u8; 32],
    layout: StorageLayout,
    page_tokens: u64,
    groups: Vec<GroupSpec>,
    ranks: Vec<Rank>,
) -> Result<()> {
    let limits = world.resource::<Limits>().clone();
    if name.is_empty() {
        return Err(invalid("instance name is empty"));
    }
    if ranks.is_empty() {
        return Err(invalid("instance declares no ranks"));
    }
    if ranks.len() > limits.max_ranks {
        return Err(limit("max_ranks", limits.max_ranks));
    }
    if groups.len() > limits.max_groups {
        return Err(limit("max_groups", limits.max_groups));
    }
    let mut ranks = ranks;
    ranks.sort_by_key(|r| (r.pp, r.tp));
    if ranks.windows(2).any(|w| w[0] == w[1]) {
        return Err(invalid("a rank is listed twice"));
    }
    let group_ids: HashSet<u32> = groups.iter().map(|g| g.id).collect();
    for slot in &layout.slots {
        if !ranks.contains(&Rank {
            tp: slot.tp_rank,
            pp: slot.pp_rank,
        }) {
            return Err(invalid(format!(
                "slot of layer {} names rank (tp {}, pp {}), which is not registered",
                slot.layer, slot.tp_rank, slot.pp_rank
            )));
        }
        if !group_ids.contains(&slot.group) {
            return Err(invalid(format!(
                "slot of layer {} names unknown group {}",
                slot.layer, slot.group
            )));
        }
        if u64::from(slot.page_tokens) != page_tokens {
            return Err(invalid(format!(
                "slot of layer {} has {} tokens per page, the instance {page_tokens}",
                slot.layer, slot.page_tokens
            )));
        }
    }
    let mut states = Vec::with_capacity(ranks.len());
    for rank in &ranks {
        let own = layout.for_rank(rank.tp, rank.pp);
        let namespace =
            seal(&identity, &own, &groups).map_err(|e| invalid(format!("rank {rank:?}: {e}")))?;
        let contract = RecoveryContract::compile(&ContractSpec {
            namespace,
            page_tokens,
            groups: groups.clone(),
        })
        .map_err(|e| invalid(e.to_string()))?;
        let mut page_bytes = Vec::new();
        for g in contract.groups() {
            let bytes: u64 = own
                .slots
                .iter()
                .filter(|s| s.group == g.id)
                .map(|s| s.padded_page_bytes)
                .sum();
            if bytes == 0 {
                return Err(invalid(format!(
                    "rank {rank:?} has no slots for group {}",
                    g.id
                )));
            }
            page_bytes.push((g.id, bytes));
        }
        let format_digest = orbitkv_components::encoding::sha256(
            &own.encode()
                .map_err(|e| invalid(format!("rank {rank:?}: {e}")))?,
        );
        states.push(RankState {
            rank: *rank,
            namespace,
            contract,
            page_bytes,
            format_digest,
        });
    }
    let namespaces: Vec<Namespace> = states.iter().map(|s| s.namespace).collect();

    if let Some(&existing) = world.resource::<Registry>().instances.get(&name) {
        let inst = world
            .get::<Instance>(existing)
            .expect("registry points at live instances");
        let same = inst
            .ranks
            .iter()
            .map(|r| r.namespace)
            .eq(namespaces.iter().copied())
            && inst.groups == groups
            && inst.page_tokens == page_tokens;
        if !same {
            // A new computation under the same name (new weights, new
            // settings) replaces the old instance once nothing uses it. Its
            // pages stay under the old namespace, where nothing can hit them.
            let (open, closing) = world
                .query::<&Session>()
                .iter(world)
                .filter(|s| s.instance == existing)
                .fold((false, false), |(o, c), s| {
                    (o || !s.closing, c || s.closing)
                });
            if open {
                return Err(CommandError::InstanceConflict(name));
            }
            if closing {
                // Sessions still drain their I/O against it: it retires with
                // the last of them.
                world
                    .get_mut::<Instance>(existing)
                    .expect("registry points at live instances")
                    .retired = true;
            } else {
                despawn_instance(world, existing);
            }
            world.resource_mut::<Registry>().instances.remove(&name);
            return register_instance(
                world,
                id,
                origin,
                name,
                identity,
                layout,
                page_tokens,
                groups,
                ranks,
            );
        }
        emit(
            world,
            origin,
            Event::InstanceRegistered {
                command: id,
                instance: existing.to_bits(),
                namespaces,
                existing: true,
            },
        );
        return Ok(());
    }
    if world.resource::<Registry>().instances.len() >= limits.max_instances {
        return Err(limit("max_instances", limits.max_instances));
    }
    let group_bytes: Vec<(u32, u64)> = states[0].page_bytes.clone();
    let entity = world
        .spawn(Instance {
            name: name.clone(),
            identity,
            layout,
            page_tokens,
            ranks: states,
            groups,
            bytes_reserved: 0,
            retired: false,
        })
        .id();
    for (g, bytes) in group_bytes {
        world.spawn(Group {
            instance: entity,
            id: g,
            page_bytes: bytes,
        });
    }
    world
        .resource_mut::<Registry>()
        .instances
        .insert(name, entity);
    emit(
        world,
        origin,
        Event::InstanceRegistered {
            command: id,
            instance: entity.to_bits(),
            namespaces,
            existing: false,
        },
    );
    Ok(())
}

/// Despawns an instance and its groups.
pub fn despawn_instance(world: &mut World, instance: Entity) {
    let groups: Vec<Entity> = world
        .query::<(Entity, &Group)>()
        .iter(world)
        .filter(|(_, g)| g.instance == instance)
        .map(|(e, _)| e)
        .collect();
    for g in groups {
        world.despawn(g);
    }
    world.despawn(instance);
}

fn open_session(world: &mut World, id: CommandId, origin: Origin, instance: &str) -> Result<()> {
    let max = world.resource::<Limits>().max_sessions;
    let registry = world.resource::<Registry>();
    let Some(&inst) = registry.instances.get(instance) else {
        return Err(CommandError::UnknownInstance(instance.to_owned()));
    };
    if registry.sessions >= max {
        return Err(limit("max_sessions", max));
    }
    let mut registry = world.resource_mut::<Registry>();
    registry.next_epoch += 1;
    registry.sessions += 1;
    let (epoch, incarnation) = (registry.next_epoch, registry.incarnation);
    let entity = world
        .spawn(Session {
            instance: inst,
            origin,
            epoch,
            closing: false,
        })
        .id();
    emit(
        world,
        origin,
        Event::SessionOpened {
            command: id,
            session: session_handle(entity, epoch, incarnation),
        },
    );
    Ok(())
}

/// Resolves a session handle: same incarnation, live entity, same epoch,
/// not closing (else `StaleSession`), opened by `origin` (else `NotOwner`).
fn session(world: &World, origin: Origin, handle: SessionHandle) -> Result<(Entity, Entity)> {
    if handle.incarnation != world.resource::<Registry>().incarnation {
        return Err(CommandError::StaleSession);
    }
    let entity = Entity::try_from_bits(handle.id).ok_or(CommandError::StaleSession)?;
    match world.get::<Session>(entity) {
        Some(s) if s.epoch == handle.epoch && !s.closing => {
            if s.origin != origin {
                return Err(CommandError::NotOwner);
            }
            Ok((entity, s.instance))
        }
        _ => Err(CommandError::StaleSession),
    }
}

/// Resolves an operation handle: live (else `UnknownOperation`) and owned by
/// `session` (else `NotOwner`).
fn operation(world: &World, session: Entity, bits: u64) -> Result<Entity> {
    let entity = Entity::try_from_bits(bits).ok_or(CommandError::UnknownOperation(bits))?;
    match world.get::<Operation>(entity) {
        Some(op) if op.session == session => Ok(entity),
        Some(_) => Err(CommandError::NotOwner),
        None => Err(CommandError::UnknownOperation(bits)),
    }
}

fn wrong_state(op: Entity, state: OpState, expected: &str) -> CommandError {
    CommandError::WrongState {
        operation: op.to_bits(),
        state: state.name().to_owned(),
        expected: expected.to_owned(),
    }
}

fn close_session(world: &mut World, origin: Origin, handle: SessionHandle) -> Result<()> {
    let (entity, _) = session(world, origin, handle)?;
    begin_close(world, entity);
    Ok(())
}

/// Closes every open session of `origin`, as `CloseSession` would.
fn close_origin(world: &mut World, origin: Origin) {
    let open: Vec<Entity> = world
        .query::<(Entity, &Session)>()
        .iter(world)
        .filter(|(_, s)| s.origin == origin && !s.closing)
        .map(|(e, _)| e)
        .collect();
    for entity in open {
        begin_close(world, entity);
    }
}

fn begin_close(world: &mut World, entity: Entity) {
    world.get_mut::<Session>(entity).expect("resolved").closing = true;
    // Retire everything the session owns; submitted I/O keeps its buffers
    // until it completes, and the fence stage despawns the session after.
    let mut ops = world.query::<&mut Operation>();
    for mut op in ops.iter_mut(world) {
        if op.session == entity {
            cancel_op(&mut op);
        }
    }
}

fn cancel_op(op: &mut Operation) {
    match op.state {
        OpState::Finishing => {}
        // Copies in flight cannot be recalled: they drain, then retire.
        OpState::Restoring | OpState::Publishing => {
            if op.outcome.is_none() {
                op.outcome = Some(Outcome::Miss(
                    orbitkv_components::api::MissReason::Cancelled,
                ));
            }
        }
        _ => finish(
            op,
            Outcome::Miss(orbitkv_components::api::MissReason::Cancelled),
        ),
    }
}

fn register_region(
    world: &mut World,
    id: CommandId,
    origin: Origin,
    handle: SessionHandle,
    rank: u32,
    group: u32,
    slots: u32,
) -> Result<()> {
    let (session, inst) = session(world, origin, handle)?;
    let max = world.resource::<Limits>().max_region_slots;
    if slots == 0 || slots > max {
        return Err(invalid(format!(
            "a region needs 1..={max} slots, got {slots}"
        )));
    }
    let instance = world
        .get::<Instance>(inst)
        .expect("sessions point at live instances");
    let rank_state = instance
        .rank(rank)
        .ok_or_else(|| invalid(format!("unknown rank index {rank}")))?;
    let page_bytes = rank_state
        .page_bytes(group)
        .ok_or_else(|| invalid(format!("unknown group {group}")))?;
    let bytes = page_bytes
        .checked_mul(u64::from(slots))
        .ok_or_else(|| invalid("region size overflows"))?;
    let engine_region = world
        .resource_mut::<Copier>()
        .0
        .get_mut()
        .register_device_region(bytes)
        .map_err(|e| CommandError::Copy(e.to_string()))?;
    let entity = world
        .spawn(DeviceRegion {
            session,
            origin,
            rank,
            group,
            slots,
            page_bytes,
            engine_region,
            live: Default::default(),
        })
        .id();
    emit(
        world,
        origin,
        Event::RegionRegistered {
            command: id,
            region: entity.to_bits(),
            engine_region,
            page_bytes,
        },
    );
    Ok(())
}

fn alloc_device_page(
    world: &mut World,
    id: CommandId,
    origin: Origin,
    handle: SessionHandle,
    region_bits: u64,
    slot: u32,
) -> Result<()> {
    let (session, _) = session(world, origin, handle)?;
    let unknown = CommandError::UnknownRegion(region_bits);
    let region_entity = Entity::try_from_bits(region_bits).ok_or(unknown.clone())?;
    let region = world
        .get::<DeviceRegion>(region_entity)
        .ok_or(unknown.clone())?;
    if region.session != session {
        return Err(CommandError::NotOwner);
    }
    if slot >= region.slots {
        return Err(invalid(format!(
            "slot {slot} is outside the region's {} slots",
            region.slots
        )));
    }
    if region.live.contains_key(&slot) {
        return Err(CommandError::SlotInUse {
            region: region_bits,
            slot,
        });
    }
    let page = world
        .spawn(DevicePage {
            region: region_entity,
            slot,
            pins: 0,
            free_deferred: false,
        })
        .id();
    world
        .get_mut::<DeviceRegion>(region_entity)
        .expect("checked")
        .live
        .insert(slot, page);
    emit(
        world,
        origin,
        Event::DevicePageAllocated {
            command: id,
            device_page: page.to_bits(),
        },
    );
    Ok(())
}

/// A live, not-yet-freed device page (else `StaleGeneration`) of `session`
/// (else `NotOwner`), with its region.
fn live_device_page(world: &World, session: Entity, bits: u64) -> Result<(Entity, DeviceRegion)> {
    let stale = CommandError::StaleGeneration(bits);
    let entity = Entity::try_from_bits(bits).ok_or(stale.clone())?;
    let page = world.get::<DevicePage>(entity).ok_or(stale.clone())?;
    if page.free_deferred {
        return Err(stale);
    }
    let region = world
        .get::<DeviceRegion>(page.region)
        .ok_or(stale.clone())?;
    if region.session != session {
        return Err(CommandError::NotOwner);
    }
    Ok((entity, region.clone()))
}

fn free_device_page(
    world: &mut World,
    origin: Origin,
    handle: SessionHandle,
    bits: u64,
) -> Result<()> {
    let (session, _) = session(world, origin, handle)?;
    let (entity, _) = live_device_page(world, session, bits)?;
    let mut page = world.get_mut::<DevicePage>(entity).expect("checked");
    if page.pins > 0 {
        // A copy still targets it: the fence frees it when the copy lands.
        page.free_deferred = true;
        return Ok(());
    }
    let (region, slot) = (page.region, page.slot);
    world.despawn(entity);
    if let Some(mut r) = world.get_mut::<DeviceRegion>(region) {
        r.live.remove(&slot);
    }
    emit(
        world,
        origin,
        Event::DevicePageFreed {
            device_page: bits,
            deferred: false,
        },
    );
    Ok(())
}

struct QueryArgs {
    request: u64,
    groups: Vec<GroupHashes>,
    origin: u64,
    prompt_len: u64,
    expect_namespaces: Vec<Namespace>,
    prepare: bool,
    speculative: bool,
}

fn query(
    world: &mut World,
    id: CommandId,
    origin: Origin,
    handle: SessionHandle,
    q: QueryArgs,
) -> Result<()> {
    let (session, inst) = session(world, origin, handle)?;
    let limits = world.resource::<Limits>().clone();
    if world.resource::<Registry>().operations >= limits.max_operations {
        return Err(limit("max_operations", limits.max_operations));
    }
    let instance = world
        .get::<Instance>(inst)
        .expect("sessions point at live instances");
    let contract = &instance.ranks[0].contract;
    let mut groups = q.groups;
    groups.sort_by_key(|g| g.group);
    let declared: Vec<u32> = contract.groups().iter().map(|g| g.id).collect();
    let given: Vec<u32> = groups.iter().map(|g| g.group).collect();
    if declared != given {
        return Err(invalid(format!(
            "query gives hashes for groups {given:?}; the instance has {declared:?}"
        )));
    }
    let pages = groups[0].hashes.len();
    if groups.iter().any(|g| g.hashes.len() != pages) {
        return Err(invalid(
            "every group must give the same number of page hashes",
        ));
    }
    if pages > limits.max_query_pages {
        return Err(limit("max_query_pages", limits.max_query_pages));
    }
    let page = instance.page_tokens;
    let end = pages as u64 * page;
    if !q.origin.is_multiple_of(page) || q.origin > end {
        return Err(invalid(format!(
            "origin {} must be page-aligned and within the {end} hashed tokens",
            q.origin
        )));
    }
    if !q.expect_namespaces.is_empty() && q.expect_namespaces.len() != instance.ranks.len() {
        return Err(invalid(
            "expect_namespaces must give one namespace per rank",
        ));
    }
    let now = world.resource::<Clock>().now_us;
    world.resource_mut::<Registry>().operations += 1;
    world.resource_mut::<Metrics>().queries += 1;
    world.spawn((
        Operation {
            command: id,
            session,
            origin,
            instance: inst,
            request: q.request,
            state: OpState::Discover,
            deadline_us: now.saturating_add(limits.prepare_deadline_us),
            bytes_reserved: 0,
            speculative: q.speculative,
            in_flight: 0,
            outcome: None,
            loading_sent: false,
            reported: false,
        },
        Recovery {
            miss: None,
            groups,
            origin: q.origin,
            end,
            prompt_len: q.prompt_len,
            expect_namespaces: q.expect_namespaces,
            prepare: q.prepare,
            candidates: Vec::new(),
            selected: None,
            ranges: Vec::new(),
            needs: Vec::new(),
            restore: Vec::new(),
            retained: Vec::new(),
            copies: Vec::new(),
            copies_sent: 0,
        },
    ));
    Ok(())
}

fn prepare(world: &mut World, origin: Origin, handle: SessionHandle, bits: u64) -> Result<()> {
    let (session, _) = session(world, origin, handle)?;
    let entity = operation(world, session, bits)?;
    let mut op = world.get_mut::<Operation>(entity).expect("checked");
    if op.state != OpState::Selected {
        return Err(wrong_state(entity, op.state, "selected"));
    }
    op.state = OpState::Admit;
    Ok(())
}

fn restore(
    world: &mut World,
    origin: Origin,
    handle: SessionHandle,
    bits: u64,
    targets: Vec<RestoreTarget>,
    retained: Vec<PagePos>,
) -> Result<()> {
    let (session, inst) = session(world, origin, handle)?;
    let entity = operation(world, session, bits)?;
    // A destination that is live but another session's is refused here; a
    // dead one fails the restore when its copy would be submitted
    // (`stale_generation`), as it may die between now and then anyway.
    for t in &targets {
        if let Err(CommandError::NotOwner) = live_device_page(world, session, t.device_page) {
            return Err(CommandError::NotOwner);
        }
    }
    let op = world.get::<Operation>(entity).expect("checked");
    if op.state != OpState::Ready {
        return Err(wrong_state(entity, op.state, "ready"));
    }
    let rec = world
        .get::<Recovery>(entity)
        .ok_or_else(|| invalid("operation is not a recovery"))?;
    let instance = world
        .get::<Instance>(inst)
        .expect("sessions point at live instances");
    let page = instance.page_tokens;
    let mut seen = HashSet::new();
    for t in &targets {
        if !seen.insert(t.device_page) {
            return Err(invalid(format!(
                "device page {:#x} is targeted twice",
                t.device_page
            )));
        }
    }
    // The transferred and retained keys must exactly cover every range.
    for (rank, range) in &rec.ranges {
        let state = &instance.ranks[*rank as usize];
        let key_at = |p: &PagePos| -> Result<StateKey> {
            let hash = rec
                .hash_at(p.group, p.page_end, page)
                .ok_or_else(|| invalid(format!("no hash for page ending at {}", p.page_end)))?;
            Ok(StateKey {
                namespace: state.namespace,
                group: p.group,
                native: hash,
            })
        };
        let in_range = |p: &PagePos| p.rank == *rank && p.group == range.group;
        let range_keys = (range.start / page..range.end / page)
            .map(|i| {
                key_at(&PagePos {
                    rank: *rank,
                    group: range.group,
                    page_end: (i + 1) * page,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let transferred = targets
            .iter()
            .map(|t| &t.pos)
            .filter(|p| in_range(p))
            .map(key_at)
            .collect::<Result<Vec<_>>>()?;
        let kept = retained
            .iter()
            .filter(|p| in_range(p))
            .map(key_at)
            .collect::<Result<Vec<_>>>()?;
        state
            .contract
            .validate_load(range, &range_keys, &transferred, &kept)
            .map_err(|e| CommandError::LoadInvalid(e.to_string()))?;
    }
    // Positions outside every range were not counted above.
    let covered = |p: &PagePos| {
        rec.ranges.iter().any(|(r, g)| {
            *r == p.rank && g.group == p.group && p.page_end > g.start && p.page_end <= g.end
        })
    };
    if let Some(p) = targets
        .iter()
        .map(|t| &t.pos)
        .chain(&retained)
        .find(|p| !covered(p))
    {
        return Err(CommandError::LoadInvalid(format!(
            "page {p:?} is outside the required ranges"
        )));
    }
    let mut rec = world.get_mut::<Recovery>(entity).expect("checked");
    rec.restore = targets;
    rec.retained = retained;
    let deadline = world
        .resource::<Clock>()
        .now_us
        .saturating_add(world.resource::<Limits>().restore_deadline_us);
    let mut op = world.get_mut::<Operation>(entity).expect("checked");
    op.state = OpState::RestorePending;
    op.deadline_us = deadline;
    Ok(())
}

fn publish(
    world: &mut World,
    id: CommandId,
    origin: Origin,
    handle: SessionHandle,
    request: u64,
    pages: Vec<PublishPage>,
) -> Result<()> {
    let (session, inst) = session(world, origin, handle)?;
    let limits = world.resource::<Limits>().clone();
    if pages.is_empty() {
        return Err(invalid("publish has no pages"));
    }
    if pages.len() > limits.max_publish_pages {
        return Err(limit("max_publish_pages", limits.max_publish_pages));
    }
    if world.resource::<Registry>().operations >= limits.max_operations {
        return Err(limit("max_operations", limits.max_operations));
    }
    let ranks = world
        .get::<Instance>(inst)
        .expect("sessions point at live instances")
        .ranks
        .clone();
    let mut items = Vec::with_capacity(pages.len());
    let mut keys = HashSet::new();
    let mut sources = HashSet::new();
    for p in &pages {
        let rank = p.rank;
        let state = ranks
            .get(rank as usize)
            .ok_or_else(|| invalid(format!("unknown rank index {rank}")))?;
        let bytes = state
            .page_bytes(p.group)
            .ok_or_else(|| invalid(format!("unknown group {}", p.group)))?;
        let (device_page, region) = live_device_page(world, session, p.device_page)?;
        if region.rank != rank || region.group != p.group {
            return Err(invalid(format!(
                "device page {:#x} is in (rank {}, group {}), not (rank {rank}, group {})",
                p.device_page, region.rank, region.group, p.group
            )));
        }
        let key = StateKey {
            namespace: state.namespace,
            group: p.group,
            native: p.hash,
        };
        if !keys.insert(key) || !sources.insert(device_page) {
            return Err(invalid("a key or device page appears twice in one publish"));
        }
        items.push(PublishItem {
            key,
            format: state.format_digest,
            device_page,
            bytes,
            dram_slot: None,
            dram_offset: 0,
            state: ItemState::Waiting,
        });
    }
    // Sources stay pinned until the copy completes; a free meanwhile waits.
    for item in &items {
        world
            .get_mut::<DevicePage>(item.device_page)
            .expect("checked")
            .pins += 1;
    }
    let now = world.resource::<Clock>().now_us;
    world.resource_mut::<Registry>().operations += 1;
    world.resource_mut::<Metrics>().publishes += 1;
    world.spawn((
        Operation {
            command: id,
            session,
            origin,
            instance: inst,
            request,
            state: OpState::PublishPending,
            deadline_us: now.saturating_add(limits.publish_deadline_us),
            bytes_reserved: 0,
            speculative: false,
            in_flight: 0,
            outcome: None,
            loading_sent: false,
            reported: false,
        },
        PublishJob { items },
    ));
    Ok(())
}

fn release(world: &mut World, origin: Origin, handle: SessionHandle, bits: u64) -> Result<()> {
    let (session, _) = session(world, origin, handle)?;
    let entity = operation(world, session, bits)?;
    let mut op = world.get_mut::<Operation>(entity).expect("checked");
    match op.state {
        OpState::Selected | OpState::Admit | OpState::Reading | OpState::Ready => {
            finish(&mut op, Outcome::Released);
            Ok(())
        }
        state => Err(wrong_state(
            entity,
            state,
            "selected, admit, reading or ready",
        )),
    }
}

fn cancel(world: &mut World, origin: Origin, handle: SessionHandle, bits: u64) -> Result<()> {
    let (session, _) = session(world, origin, handle)?;
    let entity = operation(world, session, bits)?;
    cancel_op(&mut world.get_mut::<Operation>(entity).expect("checked"));
    Ok(())
}
