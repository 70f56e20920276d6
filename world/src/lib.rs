//! The OrbitKV runtime: builds the ECS `World` and tick schedule from a
//! [`Config`], and exposes the [`Runtime`] facade: `submit` commands, `tick`
//! for events. There is no other way to change the runtime's state.

pub mod config;
pub mod driver;
pub mod invariants;
mod locate;
pub mod record;
pub mod runtime;
pub mod schedule;

pub use config::{Config, ConfigError};
pub use orbitkv_components::api::{Command, CommandError, CommandId, Event, MissReason};
pub use orbitkv_io::tier::TierChange;
pub use orbitkv_systems::resources::{PageChange, Removal};
pub use runtime::{
    Answer, Backends, HandoffStats, NamespaceInfo, OperationInfo, Runtime, RuntimeError,
    RuntimeWorld, Stats, SubmitError,
};
