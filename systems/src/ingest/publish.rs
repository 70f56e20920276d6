//! `Publish`: save device pages of one or more ranks. The sources are
//! pinned from here until the operation retires, after every copy of the
//! publish completed; the reply waits for that too.

use bevy_ecs::entity::EntityHashSet;
use bevy_ecs::prelude::*;
use orbitkv_components::api::{InvalidCommand, LimitName, PublishPage, SessionHandle};
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Instance, ItemState, OpState, Operation, OperationOf, PublishItem,
    PublishJob, at,
};
use orbitkv_components::{KeyHasher, KeySet, StateKey};

use super::resolve::{self, Owned, invalid, limit};
use super::{Ctx, Result};
use crate::resources::{Clock, Limits, Metrics, Registry};

pub(super) fn publish(
    world: &mut World,
    ctx: Ctx,
    handle: SessionHandle,
    request: u64,
    pages: Vec<PublishPage>,
) -> Result<()> {
    let owned = resolve::session(world, ctx.origin, handle)?;
    let items = plan(world, owned, &pages)?;
    // Apply.
    for item in &items {
        world
            .get_mut::<DevicePage>(item.device_page)
            .expect("resolved")
            .pins += 1;
    }
    let now = world.resource::<Clock>().now_us;
    let deadline = now.saturating_add(world.resource::<Limits>().publish_deadline_us);
    world.resource_mut::<Registry>().operations += 1;
    world.resource_mut::<Metrics>().publishes += 1;
    let op = Operation::new(
        ctx.id,
        ctx.origin,
        owned.instance,
        request,
        OpState::PublishPending,
        deadline,
        false,
    );
    world.spawn((
        op,
        at::PublishPending,
        OperationOf(owned.session),
        PublishJob { items },
    ));
    Ok(())
}

/// One item per page: a live source of this session in the page's (rank,
/// group) region, no key or source twice, within the bounds.
fn plan(world: &World, owned: Owned, pages: &[PublishPage]) -> Result<Vec<PublishItem>> {
    let limits = world.resource::<Limits>();
    if pages.is_empty() {
        return Err(invalid(InvalidCommand::EmptyPublish));
    }
    if pages.len() > limits.max_publish_pages {
        return Err(limit(LimitName::MaxPublishPages, limits.max_publish_pages));
    }
    if world.resource::<Registry>().operations >= limits.max_operations {
        return Err(limit(LimitName::MaxOperations, limits.max_operations));
    }
    let ranks = &world
        .get::<Instance>(owned.instance)
        .expect("sessions point at live instances")
        .ranks;
    let mut items = Vec::with_capacity(pages.len());
    let mut keys = KeySet::with_capacity_and_hasher(pages.len(), KeyHasher::default());
    let mut sources = EntityHashSet::with_capacity(pages.len());
    for p in pages {
        let state = ranks
            .get(p.rank as usize)
            .ok_or_else(|| invalid(InvalidCommand::UnknownRank { rank: p.rank }))?;
        let bytes = state
            .page_bytes(p.group)
            .ok_or_else(|| invalid(InvalidCommand::UnknownGroup { group: p.group }))?;
        let (device_page, region) = resolve::device_page(world, owned.session, p.device_page)?;
        let region = world.get::<DeviceRegion>(region).expect("resolved");
        if (region.rank, region.group) != (p.rank, p.group) {
            return Err(invalid(InvalidCommand::WrongRegion {
                device_page: p.device_page,
                region_rank: region.rank,
                region_group: region.group,
                rank: p.rank,
                group: p.group,
            }));
        }
        let key = StateKey {
            namespace: state.namespace,
            group: p.group,
            native: p.hash,
        };
        if !keys.insert(key) || !sources.insert(device_page) {
            return Err(invalid(InvalidCommand::DuplicatePublishPage));
        }
        items.push(PublishItem {
            key,
            format: state.format_digest,
            device_page,
            bytes,
            dram_slot: None,
            dram_offset: 0,
            staging: None,
            state: ItemState::Waiting,
        });
    }
    Ok(items)
}
