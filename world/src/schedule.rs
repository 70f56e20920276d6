//! The stage order, declared once.

use bevy_ecs::prelude::*;
use bevy_ecs::query::QueryFilter;
use bevy_ecs::schedule::SingleThreadedExecutor;
use orbitkv_components::ecs::{Handoff, Operation, Session, at};
use orbitkv_systems::resources::{Agents, Dram, Inbox};
use orbitkv_systems::{
    copies, discover, evict, fence, handoff, ingest, publish, read, restore, validate,
};

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
    //
    // A system whose work is marked runs only when something carries its
    // marker: an idle tick costs the polling of backends (`land`) and little
    // else, however much is stored.
    schedule.add_systems((
        ingest::ingest.run_if(commands_queued).in_set(Stage::Ingest),
        discover::discover
            .run_if(any_with_component::<at::Discover>)
            .in_set(Stage::Discover),
        validate::validate
            .run_if(any_with_component::<at::Validate>)
            .in_set(Stage::Validate),
        read::read
            .run_if(any::<Or<(With<at::Admit>, With<at::Reading>)>>)
            .in_set(Stage::Read),
        (
            restore::restore.run_if(any::<Or<(With<at::RestorePending>, With<at::Restoring>)>>),
            publish::publish.run_if(any::<Or<(With<at::PublishPending>, With<at::Publishing>)>>),
            copies::flush_agent_events.run_if(agent_events),
        )
            .chain()
            .in_set(Stage::Restore),
        (
            fence::land,
            fence::expire.run_if(any_with_component::<Operation>),
            fence::retire.run_if(
                any::<
                    Or<(
                        With<at::Finishing>,
                        With<at::Restoring>,
                        With<at::Publishing>,
                    )>,
                >,
            ),
            fence::close_sessions.run_if(any_with_component::<Session>),
            handoff::pin.run_if(watching_landings),
            handoff::sweep.run_if(any_with_component::<Handoff>),
        )
            .chain()
            .in_set(Stage::Fence),
        evict::evict.run_if(pressure).in_set(Stage::Evict),
    ));
    schedule
}

/// Run condition: some entity matches `F`.
fn any<F: QueryFilter>(q: Query<(), F>) -> bool {
    !q.is_empty()
}

fn commands_queued(inbox: Res<Inbox>) -> bool {
    !inbox.0.is_empty()
}

/// The copy stages sent work to copy agents this tick.
fn agent_events(agents: Res<Agents>) -> bool {
    !agents.events.is_empty()
}

/// A handoff waits for pages that may have landed.
fn watching_landings(dram: Res<Dram>) -> bool {
    dram.watch_landings
}

/// An allocation failed this tick: the evict stage has work.
fn pressure(dram: Res<Dram>) -> bool {
    !dram.pressure.is_empty()
}
