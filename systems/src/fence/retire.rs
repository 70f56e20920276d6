//! Retiring: a restore or publish with nothing left to send or drain is
//! finished (settled); a finished operation whose I/O drained sends its
//! final reply, returns its bytes, unpins its device pages, and is
//! despawned (its leases with it, and the pages they held become
//! evictable). A closing
//! session with no operation left goes, with its regions and device pages.

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::api::{Event, Origin};
use orbitkv_components::ecs::{
    DeviceRegion, Executor, Instance, ItemState, NeedState, OpState, Operation, Operations,
    Outcome, PublishJob, Recovery, Regions, Session, SessionOf, Sessions, Transfers, at,
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
);

/// Finished, restoring or publishing, with nothing in flight.
type Drained = (
    Or<(
        With<at::Finishing>,
        With<at::Restoring>,
        With<at::Publishing>,
    )>,
    Without<Transfers>,
);

pub fn retire(
    mut commands: Commands,
    mut ops: Query<Retiring, Drained>,
    mut devices: Devices,
    mut returns: Returns,
) {
    for (entity, mut op, rec, job) in &mut ops {
        if op.state() != OpState::Finishing {
            let Some(outcome) = settled(rec, job.as_deref()) else {
                continue; // the copy stages send it, or abandon it
            };
            // A restore keeps an earlier failure as its outcome.
            finish(&mut commands, entity, &mut op, outcome);
        }
        let op = &*op;
        let event = match (rec, job) {
            (Some(rec), _) => {
                return_leases(&mut commands, rec);
                let reply = returns.recovery_reply(entity, op, rec);
                let pages = rec.copies.iter().map(|c| c.device_page);
                devices.reply_then_unpin(&mut commands, op.origin, reply, pages);
                None
            }
            (None, Some(mut job)) => {
                let reply = Some(returns.publish_reply(op, &mut job));
                let sources = job.items.iter().map(|i| i.device_page);
                devices.reply_then_unpin(&mut commands, op.origin, reply, sources);
                None
            }
            (None, None) => unreachable!("an operation is a recovery or a publish"),
        };
        if let Some(event) = event {
            devices.outbox().push(op.origin, event);
        }
        returns.bytes(op);
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
    /// The recovery's final reply (none if its query already reported a
    /// miss), counted in the metrics.
    fn recovery_reply(&mut self, entity: Entity, op: &Operation, rec: &Recovery) -> Option<Event> {
        let operation = entity.to_bits();
        let event = match op.outcome.expect("finishing operations have an outcome") {
            Outcome::Miss(reason) => {
                if op.reported {
                    return None;
                }
                self.metrics.miss(reason);
                Event::Miss { operation, reason }
            }
            // A lookup ended with its (terminal) result.
            Outcome::Released if op.reported => return None,
            Outcome::Released => Event::Released { operation },
            Outcome::Restored => {
                let bytes: u64 = rec
                    .restore
                    .iter()
                    .filter_map(|t| rec.needs.iter().find(|n| n.pos == t.pos))
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
        };
        Some(event)
    }

    /// Frees slots never copied into, and counts the publish's pages.
    fn publish_reply(&mut self, op: &Operation, job: &mut PublishJob) -> Event {
        for item in job.items.iter_mut() {
            if let Some(slot) = item.dram_slot.take() {
                self.dram.free(slot); // allocated, never copied
                item.state = ItemState::Dropped;
            }
            if item.state == ItemState::Waiting {
                item.state = ItemState::Dropped;
            }
        }
        let inserted = job.count(ItemState::Inserted);
        let duplicates = job.count(ItemState::Duplicate);
        let dropped = job.count(ItemState::Dropped);
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

impl Devices<'_, '_> {
    /// Restore destinations and publish sources stay pinned until the
    /// reply: a deferred free is reported after it.
    fn reply_then_unpin(
        &mut self,
        commands: &mut Commands,
        to: orbitkv_components::api::Origin,
        reply: Option<Event>,
        pages: impl Iterator<Item = Entity>,
    ) {
        if let Some(reply) = reply {
            self.outbox().push(to, reply);
        }
        for page in pages {
            self.unpin(commands, page);
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
        outbox.push(session.origin, Event::SessionClosed { session: handle });
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
