//! The stage order, declared once.

use bevy_ecs::prelude::*;
use bevy_ecs::schedule::SingleThreadedExecutor;
use orbitkv_systems::{discover, evict, fence, ingest, publish, read, restore, validate};

/// The seven stages, run in this order every tick.
#[derive(SystemSet, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    Ingest,
    Discover,
    Validate,
    Read,
    Restore,
    Fence,
    Evict,
}

/// Builds the tick schedule. Single-threaded on purpose: a tick's work is
/// small and sequential, and one fixed order makes every run reproducible.
pub fn build() -> Schedule {
    let mut schedule = Schedule::default();
    schedule.set_executor(SingleThreadedExecutor::new());
    schedule.configure_sets(
        (
            Stage::Ingest,
            Stage::Discover,
            Stage::Validate,
            Stage::Read,
            Stage::Restore,
            Stage::Fence,
            Stage::Evict,
        )
            .chain(),
    );
    // Each system's commands apply before the next one runs (the chain
    // inserts the sync points), so an operation a stage moves on is seen by
    // the next stage in the same tick.
    schedule.add_systems((
        ingest::ingest.in_set(Stage::Ingest),
        discover::discover.in_set(Stage::Discover),
        validate::validate.in_set(Stage::Validate),
        (read::admit, read::read).chain().in_set(Stage::Read),
        (restore::restore, publish::publish)
            .chain()
            .in_set(Stage::Restore),
        (
            fence::land_reads,
            fence::land_copies,
            fence::expire,
            fence::settle,
            fence::retire,
            fence::close_sessions,
        )
            .chain()
            .in_set(Stage::Fence),
        evict::evict.in_set(Stage::Evict),
    ));
    schedule
}
