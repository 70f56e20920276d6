//! Scenarios: the trace format, deterministic replay with simulated
//! backends, and (in `fuzz`) simulation fuzzing with a false-hit oracle.
//! The simulator owns time and I/O: the same trace always gives the same
//! report.

pub mod fuzz;
pub mod payload;
pub mod plot;
pub mod replay;
pub mod report;
pub mod trace;
