//! Retiring, in two steps. An operation's final reply goes out once its
//! outcome is decided and nothing it has in flight can still change it:
//! its transfers drained, or every one left is overdue (a deadline is a
//! deadline: the engine hears the outcome then, not whenever a hung copy
//! reports). What it holds (leases, reserved bytes, device pins, staging
//! slots) is returned only once its transfers are gone (drained, or failed
//! by the origin's end), and then it is despawned (its leases with it, and
//! the pages they held become evictable). A closing session with no
//! operation left goes, with its regions and device pages.

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::api::{Event, Origin};
use orbitkv_components::ecs::{
    DeviceRegion, Executor, Instance, ItemState, NeedState, OpState, Operation, Operations,
    Outcome, PublishJob, Recovery, Regions, Session, SessionOf, Sessions, Transfer, Transfers, at,
    session_handle,
};

use crate::copies::Devices;
use crate::lifecycle::finish;
use crate::resources::{Agents, Budget, Copier, Dram, Metrics, Outbox, Registry, decrement};

/// What retiring returns things to.
#[derive(SystemParam)]
pub struct Returns<'w, 's> {
    instances: Query<'w, 's, &'static mut Instance>,
    dram: ResMut<'w, Dram>,
    budget: ResMut<'w, Budget>,
    registry: ResMut<'w, Registry>,
    metrics: ResMut<'w, Metrics>,
}

type Retiring<'a> = (
    Entity,
    &'a mut Operation,
    Option<&'a Recovery>,
    Option<&'a mut PublishJob>,
    Option<&'a Transfers>,
);

/// Finished, restoring or publishing.
type Settling = Or<(
    With<at::Finishing>,
    With<at::Restoring>,
    With<at::Publishing>,
)>;

pub fn retire(
    mut commands: Commands,
    mut ops: Query<Retiring, Settling>,
    transfers: Query<&Transfer>,
    mut devices: Devices,
    mut returns: Returns,
) {
    for (entity, mut op, rec, mut job, in_flight) in &mut ops {
        let drained = in_flight.is_none();
        let hung =
            in_flight.is_some_and(|t| t.iter().all(|t| transfers.get(t).is_ok_and(|t| t.overdue)));
        if !(drained || hung) {
            continue; // what is in flight may still change the outcome
        }
        if op.state() != OpState::Finishing {
            // A failure recorded earlier (an overdue copy, a cancel) is the
            // outcome; else the operation must have nothing left to send.
            let Some(outcome) = op.outcome.or_else(|| settled(rec, job.as_deref())) else {
                continue; // the copy stages send it, or abandon it
            };
            finish(&mut commands, entity, &mut op, outcome);
        }
        if !op.reported {
            op.reported = true;
            let reply = match (rec, job.as_deref_mut()) {
                (Some(rec), _) => returns.recovery_reply(entity, &op, rec),
                (None, Some(job)) => returns.publish_reply(&op, job),
                (None, None) => unreachable!("an operation is a recovery or a publish"),
            };
            devices.outbox().push(op.origin, reply);
        }
        if !drained {
            continue; // held until its transfers are gone
        }
        let pages: Vec<Entity> = match (rec, job.as_deref_mut()) {
            (Some(rec), _) => {
                return_leases(&mut commands, rec);
                rec.copies.iter().map(|c| c.device_page).collect()
            }
            (None, Some(job)) => {
                returns.free_slots(job);
                job.items.iter().map(|i| i.device_page).collect()
            }
            (None, None) => unreachable!("an operation is a recovery or a publish"),
        };
        // Restore destinations and publish sources stay pinned until now:
        // a deferred free is reported after the reply.
        for page in pages {
            devices.unpin(&mut commands, page);
        }
        returns.bytes(&op);
        decrement(&mut returns.registry.operations, 1, "registry.operations");
        // Its leases go with it (`HeldLeases` despawns them).
        commands.entity(entity).despawn();
    }
}

/// How a restore or publish with nothing in flight ends, once nothing is
/// left to send either.
fn settled(rec: Option<&Recovery>, job: Option<&PublishJob>) -> Option<Outcome> {
    match (rec, job) {
        (Some(rec), _) => (rec.copies_sent == rec.copies.len()).then_some(Outcome::Restored),
        (None, Some(job)) => {
            let waiting = job.items.iter().any(|i| i.state == ItemState::Waiting);
            (!waiting).then_some(Outcome::Published)
        }
        (None, None) => unreachable!("an operation is a recovery or a publish"),
    }
}

/// Returns the leases in page order, so the pages enter the LRU in a
/// known order. (Despawning the operation would return any left.)
fn return_leases(commands: &mut Commands, rec: &Recovery) {
    for need in &rec.needs {
        if let NeedState::Leased(lease) = need.state {
            commands.entity(lease).despawn();
        }
    }
}

impl Returns<'_, '_> {
    /// The recovery's final reply, counted in the metrics.
    fn recovery_reply(&mut self, entity: Entity, op: &Operation, rec: &Recovery) -> Event {
        let operation = entity.to_bits();
        match op.outcome.expect("finishing operations have an outcome") {
            Outcome::Miss(reason) => {
                self.metrics.miss(reason);
                Event::Miss { operation, reason }
            }
            Outcome::Released => Event::Released { operation },
            Outcome::Restored => {
                let bytes: u64 = rec
                    .needs_at(rec.restore.iter().map(|t| &t.pos))
                    .flatten()
                    .map(|n| n.bytes)
                    .sum();
                let m = &mut *self.metrics;
                m.restores += 1;
                m.hits += 1;
                m.hit_tokens += rec.selected.unwrap_or(0) - rec.origin;
                m.bytes_restored += bytes;
                Event::RestoreDone {
                    operation,
                    pages: rec.restore.len() as u64,
                    bytes,
                }
            }
            Outcome::Published => unreachable!("recoveries do not publish"),
        }
    }

    /// Frees slots never copied into, and counts the publish's pages;
    /// pages still copying (an overdue batch: it failed, whatever it
    /// reports later) count as dropped.
    fn publish_reply(&mut self, op: &Operation, job: &mut PublishJob) -> Event {
        self.free_slots(job);
        let inserted = job.count(ItemState::Inserted);
        let duplicates = job.count(ItemState::Duplicate);
        let dropped = job.count(ItemState::Dropped) + job.count(ItemState::Copying);
        let m = &mut *self.metrics;
        m.pages_published += inserted;
        m.publish_duplicates += duplicates;
        m.publish_dropped += dropped;
        Event::PublishDone {
            command: op.command,
            request: op.request,
            inserted,
            duplicates,
            dropped,
        }
    }

    /// Frees the slots of pages that will never be copied (allocated, not
    /// sent) and drops what still waits; a copying page keeps its slot
    /// until its batch lands.
    fn free_slots(&mut self, job: &mut PublishJob) {
        for item in job.items.iter_mut() {
            if matches!(item.state, ItemState::Copying | ItemState::Inserted) {
                continue;
            }
            if let Some(slot) = item.dram_slot.take() {
                self.dram.free(slot); // allocated, never copied
                item.state = ItemState::Dropped;
            }
            if item.state == ItemState::Waiting {
                item.state = ItemState::Dropped;
            }
        }
    }

    /// Returns the operation's reserved bytes.
    fn bytes(&mut self, op: &Operation) {
        if op.bytes_reserved == 0 {
            return;
        }
        self.budget.release(op.bytes_reserved, op.speculative);
        if let Ok(mut instance) = self.instances.get_mut(op.instance) {
            decrement(
                &mut instance.bytes_reserved,
                op.bytes_reserved,
                "instance.bytes_reserved",
            );
        }
    }
}

type Closing<'a> = (Entity, &'a Session, &'a SessionOf, Option<&'a Regions>);

/// What a closed session gives back to: the copy engine (manager-owned
/// regions), the agents (its origin's staging area) and the registry.
#[derive(SystemParam)]
pub struct Executors<'w> {
    copier: ResMut<'w, Copier>,
    agents: ResMut<'w, Agents>,
    registry: ResMut<'w, Registry>,
}

/// Despawns closing sessions once they own no operation, with their
/// regions and device pages (no page is pinned then: pins belong to
/// operations). A retired instance goes with its last session.
pub fn close_sessions(
    mut commands: Commands,
    sessions: Query<Closing, Without<Operations>>,
    all: Query<(Entity, &Session)>,
    instances: Query<(&Instance, &Sessions)>,
    regions: Query<&DeviceRegion>,
    mut executors: Executors,
    mut outbox: ResMut<Outbox>,
) {
    let gone: Vec<Entity> = sessions
        .iter()
        .filter(|(_, s, ..)| s.closing)
        .map(|(e, ..)| e)
        .collect();
    for &entity in &gone {
        let (_, session, of, owned) = sessions.get(entity).expect("collected above");
        if let Ok((instance, members)) = instances.get(of.0)
            && instance.retired
            && members.iter().all(|s| gone.contains(&s))
        {
            commands.entity(of.0).despawn(); // and its groups
        }
        // Nothing targets its regions any more: no operation of it is left.
        // An agent's regions are its own memory: nothing to unregister here.
        for region in owned.iter().flat_map(|r| r.iter()) {
            if let Ok(r) = regions.get(region)
                && r.executor == Executor::Local
            {
                let engine = executors.copier.0.get_mut();
                let _ = engine.unregister_device_region(r.engine_region);
            }
        }
        let registry = &mut executors.registry;
        decrement(&mut registry.sessions, 1, "registry.sessions");
        let handle = session_handle(entity, session.epoch, registry.incarnation);
        outbox.push(
            session.origin,
            Event::SessionClosed {
                command: session.closed_by,
                session: handle,
            },
        );
        // Its regions and their pages go with it.
        commands.entity(entity).despawn();
    }
    drop_idle_staging(&all, &gone, &mut executors.agents);
}

/// An origin's staging area goes with its last session: no copy can hold
/// a slot of it then (staging slots belong to publishes, which their
/// session outlives).
fn drop_idle_staging(all: &Query<(Entity, &Session)>, gone: &[Entity], agents: &mut Agents) {
    if gone.is_empty() || agents.staging.is_empty() {
        return;
    }
    let origins: Vec<Origin> = agents.staging.keys().copied().collect();
    for origin in origins {
        let open = all
            .iter()
            .any(|(e, s)| s.origin == origin && !gone.contains(&e));
        if open {
            continue;
        }
        let staging = agents.staging.remove(&origin).expect("listed above");
        assert_eq!(
            staging.stats().bytes_used,
            0,
            "{origin}'s staging area is idle once its sessions are gone"
        );
    }
}
