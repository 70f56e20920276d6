//! Stage 1, ingest: engine commands become entities, in arrival order.
//!
//! This is the one exclusive system: commands of every kind must apply in
//! the order they were submitted (an alloc before the restore that targets
//! it), and a refused command must have no effect at all. So each handler
//! is a `plan` that only reads the World and either refuses with a typed
//! error or returns everything it will change, and an `apply` that changes
//! exactly that and cannot fail. One module per command family.

mod agents;
mod clear;
mod devices;
mod handoff;
mod instances;
mod publish;
mod recovery;
mod resolve;
mod sessions;

use bevy_ecs::prelude::*;
use orbitkv_components::api::{Command, CommandError, CommandId, Event, Origin};
use orbitkv_components::ecs::LoadPlan;

use crate::resources::{Clock, Inbound, Inbox, Limits, Metrics, Outbox, SimulatedClock};

type Result<T> = std::result::Result<T, CommandError>;

/// Who asked: the command's id (echoed in its reply) and origin (its
/// addressee, and the owner its handles are checked against).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx {
    pub id: CommandId,
    pub origin: Origin,
}

pub fn ingest(world: &mut World) {
    let max = world.resource::<Limits>().max_commands_per_tick;
    for _ in 0..max {
        let Some(inbound) = world.resource_mut::<Inbox>().0.pop_front() else {
            break;
        };
        match inbound {
            Inbound::CloseOrigin(origin) => sessions::close_origin(world, origin),
            Inbound::Command {
                id,
                origin,
                command,
            } => {
                let kind = command.kind();
                if let Err(error) = handle(world, Ctx { id, origin }, command) {
                    world.resource_mut::<Metrics>().refused(kind, &error);
                    emit(world, origin, Event::Rejected { command: id, error });
                }
            }
        }
    }
}

fn emit(world: &mut World, to: Origin, event: Event) {
    world.resource_mut::<Outbox>().push(to, event);
}

fn handle(world: &mut World, ctx: Ctx, command: Command) -> Result<()> {
    match command {
        Command::RegisterInstance {
            instance,
            identity,
            layout,
            page_tokens,
            groups,
            ranks,
        } => {
            let args = instances::Args {
                name: instance,
                identity,
                layout,
                page_tokens,
                groups,
                ranks,
            };
            instances::register(world, ctx, args)
        }
        Command::OpenSession { instance } => sessions::open(world, ctx, &instance),
        Command::CloseSession { session } => sessions::close(world, ctx, session),
        Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
            agent,
        } => devices::register_region(world, ctx, session, (rank, group), slots, agent),
        Command::DevicePageAlloc {
            session,
            region,
            slot,
        } => devices::alloc(world, ctx, session, region, slot),
        Command::DevicePageFree {
            session,
            device_page,
        } => devices::free(world, ctx, session, device_page),
        Command::Query {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
            prepare,
            speculative,
        } => {
            let q = recovery::QueryArgs {
                request,
                groups,
                origin,
                prompt_len,
                expect_namespaces,
                prepare,
                speculative,
                peek: false,
                load: None,
                handoff: None,
            };
            recovery::query(world, ctx, session, q)
        }
        Command::Lookup {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
        } => {
            let q = recovery::QueryArgs {
                request,
                groups,
                origin,
                prompt_len,
                expect_namespaces,
                prepare: false,
                speculative: false,
                peek: true,
                load: None,
                handoff: None,
            };
            recovery::query(world, ctx, session, q)
        }
        Command::Load {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
            ranks,
            targets,
            retained,
            handoff,
        } => {
            let q = recovery::QueryArgs {
                request,
                groups,
                origin,
                prompt_len,
                expect_namespaces,
                prepare: true,
                speculative: false,
                peek: false,
                load: Some(LoadPlan {
                    ranks,
                    targets,
                    retained,
                }),
                handoff,
            };
            recovery::query(world, ctx, session, q)
        }
        Command::Hold {
            session,
            handoff,
            groups,
            deadline_ms,
        } => handoff::hold(
            world,
            ctx,
            session,
            handoff::Args {
                handoff,
                groups,
                deadline_ms,
            },
        ),
        Command::Prepare { session, operation } => {
            recovery::prepare(world, ctx, session, operation)
        }
        Command::Restore {
            session,
            operation,
            targets,
            retained,
        } => recovery::restore(world, ctx, session, operation, targets, retained),
        Command::Publish {
            session,
            request,
            pages,
        } => publish::publish(world, ctx, session, request, pages),
        Command::Release { session, operation } => {
            recovery::release(world, ctx, session, operation)
        }
        Command::Cancel { session, operation } => recovery::cancel(world, ctx, session, operation),
        Command::CopyDone {
            copy,
            failure,
            checksums,
        } => agents::copy_done(world, ctx, copy, failure, checksums),
        Command::AdvanceClock { us } => advance_clock(world, us),
        Command::Clear { namespaces } => clear::clear(world, ctx, namespaces),
    }
}

fn advance_clock(world: &mut World, us: u64) -> Result<()> {
    if !world.resource::<SimulatedClock>().0 {
        return Err(CommandError::WallClock);
    }
    let mut clock = world.resource_mut::<Clock>();
    clock.now_us = clock.now_us.saturating_add(us);
    Ok(())
}
