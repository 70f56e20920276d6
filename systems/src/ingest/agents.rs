//! `CopyDone`: a copy agent reports a copy it was sent. Only the origin it
//! was sent to may report it, and only once; anything else is refused with
//! no effect. The fence lands the report.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{CommandError, CopyFailure};

use super::{Ctx, Result};
use crate::resources::Agents;

pub(super) fn copy_done(
    world: &mut World,
    ctx: Ctx,
    copy: u64,
    failure: Option<CopyFailure>,
    checksums: Vec<u64>,
) -> Result<()> {
    // Plan.
    let mut agents = world.resource_mut::<Agents>();
    let entry = match agents.sent.get(&copy) {
        None => return Err(CommandError::UnknownCopy(copy)),
        Some(e) if e.origin != ctx.origin => return Err(CommandError::NotOwner),
        Some(e) => *e,
    };
    // Apply.
    agents.sent.remove(&copy);
    let result = failure.map_or(Ok(checksums), Err);
    agents.reported.push((copy, entry.transfer, result));
    Ok(())
}
