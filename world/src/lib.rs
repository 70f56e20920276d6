//! The OrbitKV runtime: builds the ECS `World` and tick schedule from a
//! [`Config`], and exposes the [`Runtime`] facade: `submit` commands, `tick`
//! for events. There is no other way to change the runtime's state.
//!
//! # Codemap
//!
//! - `schedule.rs`: `Stage` (ingest, discover, validate, read, restore,
//!   fence, evict) and `build()`: the order, declared once, single-threaded;
//!   each system's commands apply before the next runs, and a system whose
//!   work is marked runs only when something carries its marker (an idle
//!   tick polls the backends and little else).
//! - `runtime.rs`: `RuntimeWorld` (the `World` built from a config: every
//!   resource, the LRU hooks, backends registered with the pool; its
//!   `Drop` drains backends before the pool; the stage tests run systems on
//!   it one at a time), `Runtime::new(Config)`, `with_backends(Config, Backends)`,
//!   `submit(Origin, Command)`, `answer_now(Origin, Command, now) -> Answer`
//!   (a `Lookup` with nothing queued ahead of it and no trace recording:
//!   the ingest stage alone runs on it and its events come back at once;
//!   anything else comes back `Queue`d for `submit`), `tick() -> Vec<Addressed>`, `tick_at(us)`
//!   (simulated clocks: the simulator sets time), `close_origin(Origin)` (a
//!   client went away: its sessions close as on a crash),
//!   `finish_demotions()` (before a restart or shutdown: the tiers' accepted
//!   writes finish and are counted); read-only `stats()`, `metrics()`,
//!   `operations()` (each live operation and what holds it),
//!   `tier_occupancy()`, `inbox_room()`, `check_invariants()`; `record(out)`.
//!   `tick` clears the world's change and removal trackers (no system reads
//!   them; kept, every despawn would be remembered forever), and the evict
//!   stage's per-tick record before the stages run. `Drop` drains
//!   backends before the pool is unmapped.
//! - `driver.rs`: the engine side, once: `Port` (submit; step, advancing
//!   time or not), `Driver` (register, open, region, alloc, alloc_many,
//!   publish, query, ready, restore; bounded waits, typed `DriverError`),
//!   `Embedded` (the runtime as a port for one origin; on a wall clock a
//!   step with only the runtime's own copies in flight sleeps in
//!   `Runtime::wait_io` instead of spinning ticks), `register_command`
//!   (a test engine's layout: `StorageLayout::uniform`), `dense`/`hybrid`
//!   shapes, `target`. World tests, benchmarks, the replay driver and the
//!   demo build on it; so do the tests and examples that drive a real
//!   `orbitkv serve`, through `tests/support/port.rs` (`ClientPort`, a
//!   manager connection as a `Port`). `tests/support/manager.rs` is that
//!   manager as a test's subprocess (config, metrics endpoint, `stop`,
//!   metric waits, RSS and CPU time), shared by `tests/{serve,hotpath,
//!   manager,remote}.rs`.
//! - `locate.rs`: `Runtime::locate`, where each page of a `LookupRequest` is
//!   (DRAM index, then each tier's `lookup`), and `Restorable`: the boundary
//!   a load would select (discover's `rank_candidates`, each rank's
//!   contract, the intersection, the prompt's cap, `min_load_tokens`) with
//!   its tokens per tier; reads metadata only. `Runtime::take_tier_changes`
//!   drains the tiers' journals (`record_page_changes` starts them too).
//! - `record.rs`: `Recorder`: every command (handles written as `$c<N>`)
//!   and every tick, as a trace with explicit ticks that replays to the same
//!   events on the same simulated backends. Traces carry no origins (a
//!   replay runs raw `cmd` lines from one origin); `close_origin` is written
//!   as `close_session` lines. Nor agents: an agent region is recorded as a manager-owned one
//!   and `CopyDone` is not recorded, so a replay does the agent's copies on
//!   its own copy engine (same outcomes, not the same copy timing).
//! - `config.rs`: `Config` (serde, `deny_unknown_fields`): `DramConfig`,
//!   `ssd: Option<SsdConfig>` and `remote: Option<RemoteConfig>` (opened by
//!   `Runtime::new`, in that lookup order; `Runtime::remote_stats`),
//!   `BudgetConfig` (query budget default 75% of DRAM, instance budget,
//!   speculative 25%), `CopyConfig`, `Limits`, `incarnation`.
//! - `invariants.rs`: checked after every tick when `check_invariants` is set
//!   (on in debug builds and tests, off by default in release; replays and
//!   the fuzzer check every tick in any build): leases hold live pages of
//!   their operation's namespaces; exactly the unleased pages are in the LRU;
//!   no page sits in a free slot; reserved bytes equal the operations' sum;
//!   device-page pins equal the copies using them; region slot indexes match
//!   their pages; each operation carries exactly its state's marker; registry
//!   counts match; a tick evicted for a slot class at most what its failed
//!   allocations lacked (after evicting, free plus held slots never exceed
//!   the pressure).

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
