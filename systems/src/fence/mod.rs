//! Stage 6, fence: poll completions (tier reads, device copies), verify and
//! index what landed, unpin device pages, expire deadlines, settle
//! operations whose I/O drained, and retire finished ones. This is the only
//! stage that returns leases and byte reservations, and only once an
//! operation has no `Transfers` left.
//!
//! Systems, in this order: `land` (tier reads, then device copies),
//! `expire`, `retire` (settling drained restores and publishes first),
//! `close_sessions`.

mod copies;
mod expire;
mod reads;
mod retire;

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::ecs::{Operation, PublishJob, Recovery, Transfer, TransferOf};

pub use expire::expire;
pub use reads::settle_demotions;
pub use retire::{close_sessions, retire};

use crate::resources::{Agents, Clock, Copier, Dram, LoadRates, Metrics, Tiers, TransferIndex};

type Ops<'a> = (
    &'a mut Operation,
    Option<&'a mut Recovery>,
    Option<&'a mut PublishJob>,
);
type Transfers<'a> = (&'a Transfer, &'a TransferOf);

/// The backends and what their completions update.
#[derive(SystemParam)]
pub struct Landing<'w> {
    tiers: ResMut<'w, Tiers>,
    copier: ResMut<'w, Copier>,
    agents: ResMut<'w, Agents>,
    dram: ResMut<'w, Dram>,
    index: ResMut<'w, TransferIndex>,
    metrics: ResMut<'w, Metrics>,
    clock: Res<'w, Clock>,
    rates: ResMut<'w, LoadRates>,
}

/// Applies every completion the backends report: tier reads, then device
/// copies.
pub fn land(
    mut commands: Commands,
    mut ops: Query<Ops>,
    transfers: Query<Transfers>,
    mut landing: Landing,
) {
    reads::land_reads(&mut commands, &mut ops, &transfers, &mut landing);
    copies::land_copies(&mut commands, &mut ops, &transfers, &mut landing);
}
