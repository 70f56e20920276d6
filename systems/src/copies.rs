//! What the copy stages share: submitting a batch to the copy engine within
//! the bounds (`Copies`), and pinning and unpinning device pages
//! (`Devices`).

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, PageOf, RegionOf, Transfer, TransferKind, TransferOf,
};
use orbitkv_gpu::{CopyError, Direction, PageCopy};

use crate::lifecycle::unpin_device_page;
use crate::resources::{Clock, Copier, Limits, Outbox, TransferIndex};

/// The copy engine with its bounds: what submitting a batch needs.
#[derive(SystemParam)]
pub struct Copies<'w> {
    copier: ResMut<'w, Copier>,
    index: ResMut<'w, TransferIndex>,
    limits: Res<'w, Limits>,
    clock: Res<'w, Clock>,
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

    /// Submits one batch for `operation` and spawns its Transfer, or says
    /// why not.
    pub fn submit(
        &mut self,
        commands: &mut Commands,
        operation: Entity,
        direction: Direction,
        copies: &[PageCopy],
        kind: TransferKind,
    ) -> Result<(), Refused> {
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
            submitted_us: now_us,
            overdue: false,
            kind,
        };
        let transfer = commands.spawn((transfer, TransferOf(operation))).id();
        self.index.copies.insert(token.0, transfer);
        Ok(())
    }
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
        let fits = !page.free_deferred
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
