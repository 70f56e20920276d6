//! Scenarios: the trace format, deterministic replay with simulated
//! backends, and (in `fuzz`) simulation fuzzing with a false-hit oracle.
//! The simulator owns time and I/O: the same trace always gives the same
//! report.
//!
//! # Codemap
//!
//! - `trace.rs`: trace format v1 (`docs/trace-format.md`): `Header`,
//!   `Latency`, `Line`/`Body` (raw `cmd` lines with `$name` handles, engine
//!   steps `register`/`open`/`publish`/`request`, `tick`, `fault`,
//!   `tier_put`), `parse` (every bad line reported with its number),
//!   `chained_hashes` (prompt segments → engine-style chained hashes).
//! - `replay.rs`: `Replay`, the driver. It owns time (simulated clock,
//!   `Ticks::Interval` or `Ticks::Explicit`) and I/O (`SimCopyEngine`,
//!   `MemoryTier`s with the header's latency models), plays the engine side
//!   (device pages, payload bytes, restores, frees), injects faults, checks
//!   invariants after every tick, verifies every restored byte, checks after
//!   each restart (and at the end) that every demotion submitted was written
//!   or failed once the runtime's writes finished (`finish_demotions`), and
//!   feeds an `Observer` (the fuzzer's oracle: lines, misses, the live
//!   operations each tick, the quiet end). Each `open` line's session is an
//!   engine process with its own origin (raw `cmd` lines share one);
//!   `session_crash` closes that origin (`close_origin`) as a dropped
//!   connection would. Sessions opened with `agent` have agent-owned regions
//!   whose memory the driver keeps (`SimAgents`): it plays their copy agent
//!   (`agent_copy`: reads the exported pool, writes the origin's exported
//!   staging area, checks checksums, reports `copy_done`), which by its
//!   `AgentModel` is late, fails or vanishes (its engine then crashes).
//! - `payload.rs`: `payload(key, len)`: the bytes a key legitimately holds.
//! - `report.rs`: `Report` (`docs/report-format.md`), `render_text`,
//!   `Percentiles`, `Sample` (the plot's time series).
//! - `plot.rs`: `--plot` SVG (plotters).
//! - `fuzz.rs`: `generate` (random scenarios with every fault kind, random
//!   copy limits and engine queues, identities reused across shapes and
//!   windows, sessions with misbehaving copy agents), `Oracle` (boundaries
//!   and leased pages recomputed from the rule definitions, keys the scenario
//!   produced, a namespace never shared by two stored representations; every
//!   miss reason explained by a fault seen earlier, or by DRAM churn for
//!   `evicted_during_read`; liveness: no operation past its deadline plus the
//!   longest transfer limit without its reply, and once quiet nothing left
//!   that has not replied or is held by anything but overdue transfers),
//!   `check`/`check_with` (panics of the runtime or the driver are failures),
//!   `run_case` (check, then minimize a failure), `minimize` (bounded delta
//!   debugging that keeps the same failure).
//! - `corpus/`: the scenario corpus and each one's `*.expected.json`.
//!
//! Invariant: a replay never reads the OS clock; the same trace and flags give
//! a byte-identical report.

pub mod fuzz;
pub mod payload;
pub mod plot;
pub mod replay;
pub mod report;
pub mod trace;
