//! What the copy stages share: submitting a batch within the bounds to
//! whoever runs it (`Copies`: the copy engine for manager-owned regions,
//! the owning origin's copy agent for agent-owned ones), and pinning and
//! unpinning device pages (`Devices`).

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::api::{AgentDirection, AgentPageCopy, Event};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Executor, PageOf, RegionOf, Transfer, TransferKind, TransferOf,
};
use orbitkv_gpu::{CopyError, Direction, PageCopy};

use crate::lifecycle::unpin_device_page;
use crate::resources::{
    AgentCopyEntry, Agents, Clock, Copier, Limits, LoadRates, Metrics, Outbox, TransferIndex,
};

/// The copy engine and the agents with their bounds: what submitting a
/// batch needs.
#[derive(SystemParam)]
pub struct Copies<'w> {
    copier: ResMut<'w, Copier>,
    agents: ResMut<'w, Agents>,
    index: ResMut<'w, TransferIndex>,
    metrics: ResMut<'w, Metrics>,
    limits: Res<'w, Limits>,
    clock: Res<'w, Clock>,
    rates: ResMut<'w, LoadRates>,
}

/// Why a batch was not submitted.
pub enum Refused {
    /// No room now (our bound or the engine's queue): try next tick.
    Full,
    /// The engine refused the batch itself.
    Failed,
}

impl Copies<'_> {
    pub fn now_us(&self) -> u64 {
        self.clock.now_us
    }

    pub fn batch_pages(&self) -> usize {
        self.limits.max_copy_batch_pages.max(1)
    }

    /// The staging area of `origin`'s agent, where publishes from its
    /// regions land before the manager moves them into the pool.
    pub fn staging(
        &mut self,
        origin: orbitkv_components::api::Origin,
    ) -> Option<&mut orbitkv_io::dram::HostPool> {
        self.agents.staging.get_mut(&origin)
    }

    /// Submits one batch for `operation` to `executor` and spawns its
    /// Transfer, or says why not. For an agent, `host_offset`s are pool
    /// offsets toward the device and staging offsets from it.
    pub fn submit(
        &mut self,
        commands: &mut Commands,
        operation: Entity,
        direction: Direction,
        copies: &[PageCopy],
        kind: TransferKind,
        executor: Executor,
    ) -> Result<(), Refused> {
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        // A restore's copies are what the load rates measure; each is
        // counted again when it lands, whatever it ends with.
        let restore = direction == Direction::HostToDevice;
        if let Executor::Agent(origin) = executor {
            if !self.has_room(executor) {
                return Err(Refused::Full);
            }
            self.send_to_agent(commands, operation, direction, copies, kind, origin);
            if restore {
                self.rates.started(LoadRates::DEVICE, self.clock.now_us);
            }
            return Ok(());
        }
        let engine = self.copier.0.get_mut();
        if engine.in_flight() >= self.limits.max_inflight_copies {
            return Err(Refused::Full);
        }
        let now_us = self.clock.now_us;
        let token = match engine.submit(direction, copies, now_us) {
            Ok(token) => token,
            Err(CopyError::QueueFull(..)) => return Err(Refused::Full),
            Err(_) => return Err(Refused::Failed),
        };
        let transfer = Transfer {
            token: token.0,
            executor: Executor::Local,
            submitted_us: now_us,
            bytes,
            overdue: false,
            kind,
        };
        let transfer = commands.spawn((transfer, TransferOf(operation))).id();
        self.index.copies.insert(token.0, transfer);
        if restore {
            self.rates.started(LoadRates::DEVICE, now_us);
        }
        Ok(())
    }

    /// Whether `executor` can take one more batch now.
    pub fn has_room(&self, executor: Executor) -> bool {
        match executor {
            Executor::Local => true, // the engine's own queue decides
            Executor::Agent(origin) => {
                self.agents.in_flight(origin) < self.limits.max_agent_copies_per_origin
            }
        }
    }

    /// Sends a batch to `origin`'s agent as an addressed `AgentCopy`. The
    /// caller checked `has_room`; the agent validates the offsets against
    /// its own memory and reports a failure rather than trusting them.
    fn send_to_agent(
        &mut self,
        commands: &mut Commands,
        operation: Entity,
        direction: Direction,
        copies: &[PageCopy],
        kind: TransferKind,
        origin: orbitkv_components::api::Origin,
    ) {
        let bytes = copies.iter().map(|c| c.len).sum();
        let copy = self.agents.next_id();
        let transfer = Transfer {
            token: copy,
            executor: Executor::Agent(origin),
            submitted_us: self.clock.now_us,
            bytes,
            overdue: false,
            kind,
        };
        let transfer = commands.spawn((transfer, TransferOf(operation))).id();
        let entry = AgentCopyEntry { origin, transfer };
        self.agents.sent.insert(copy, entry);
        let direction = match direction {
            Direction::HostToDevice => AgentDirection::PoolToRegion,
            Direction::DeviceToHost => AgentDirection::RegionToStaging,
        };
        let pages = copies
            .iter()
            .map(|c| AgentPageCopy {
                host_offset: c.host_offset,
                region: c.region,
                region_offset: c.device_offset,
                len: c.len,
                checksum: c.expect_checksum,
            })
            .collect();
        let event = Event::AgentCopy {
            copy,
            direction,
            pages,
        };
        self.agents.events.push(orbitkv_components::api::Addressed {
            to: origin,
            event,
            terminal: false,
        });
        self.metrics.agent_copies += 1;
    }
}

/// Moves this tick's agent copy events to the outbox, after the copy
/// stages (which cannot hold the outbox: `Devices` does).
pub fn flush_agent_events(mut agents: ResMut<Agents>, mut outbox: ResMut<Outbox>) {
    outbox.0.append(&mut agents.events);
}

/// Device pages and their regions, for resolving, pinning and unpinning.
#[derive(SystemParam)]
pub struct Devices<'w, 's> {
    pages: Query<'w, 's, (&'static mut DevicePage, &'static PageOf)>,
    regions: Query<'w, 's, &'static mut DeviceRegion>,
    owners: Query<'w, 's, &'static RegionOf>,
    outbox: ResMut<'w, Outbox>,
}

impl Devices<'_, '_> {
    pub fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    pub fn pin(&mut self, page: Entity) {
        self.pages.get_mut(page).expect("resolved live").0.pins += 1;
    }

    pub fn unpin(&mut self, commands: &mut Commands, page: Entity) {
        let Ok((mut dp, of)) = self.pages.get_mut(page) else {
            unreachable!("a pinned device page is live");
        };
        let of = *of;
        unpin_device_page(
            commands,
            &mut self.regions,
            &mut self.outbox,
            page,
            &mut dp,
            of,
        );
    }

    /// A live device page the engine has not freed, in a region of
    /// `session` for (rank, group).
    pub fn destination(
        &self,
        bits: u64,
        session: Entity,
        (rank, group): (u32, u32),
    ) -> Option<(Entity, &DevicePage, &DeviceRegion)> {
        let entity = Entity::try_from_bits(bits)?;
        let (page, of) = self.pages.get(entity).ok()?;
        let region = self.regions.get(of.0).ok()?;
        let owner = self.owners.get(of.0).ok()?;
        let fits = page.free_deferred.is_none()
            && owner.0 == session
            && (region.rank, region.group) == (rank, group);
        fits.then_some((entity, page, region))
    }

    /// Where a pinned source page's bytes are.
    pub fn source(&self, page: Entity) -> (&DevicePage, &DeviceRegion) {
        let (dp, of) = self.pages.get(page).expect("sources are pinned");
        let region = self
            .regions
            .get(of.0)
            .expect("pinned pages keep their region");
        (dp, region)
    }
}
