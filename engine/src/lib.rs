//! The engine side of OrbitKV: what every engine adapter (vLLM, SGLang,
//! transformers) uses to talk to a manager, written once.
//!
//! # Codemap
//!
//! - `session.rs`: `Session`, one session over a `Port` (a manager
//!   `ipc::Client`, or the bridge's embedded `Runtime`, whose waits tick it).
//!   `open` registers the instance and opens the session; `register_region`;
//!   `device_pages`, the slot table (a device page per (region, slot),
//!   allocated once, missing ones in one round, kept with the session);
//!   blocking verbs `lookup`/`lookup_within` (a peek: nothing held; a late
//!   answer is dropped by the next; a miss the port's presence filter
//!   proves, `Port::presence`, is answered here, `Lookup.local`, with no
//!   message: `filter_index` + `answer_from_filter`; `pages_worth_asking`
//!   probes pages `first + 1, + 2, + 4, ...` for one the filter proves
//!   absent, past which no answer can resume, so a long prompt sends only
//!   the pages before it), `lookup_many` (certain
//!   misses here, the rest in one round per `MAX_BATCH`), `locate_many` (the router's answer, `Restorable`, through
//!   `Port::locate`: admin lookups pipelined), `load` (query, lease, read and copy in one command),
//!   `save`, `close`; started verbs `start_load`, `start_lease` + `release`
//!   (engines that read the pool themselves), `start_save`, `cancel`, whose
//!   `Progress` (`Ready`, `Loaded`, `Saved`, `Refused`) `poll` reports by
//!   ticket (the first command's id). `poll` and the waits take only their
//!   own commands' and operations' events, so several sessions can share one
//!   connection or runtime. The event router (`handle_event`) ends a job
//!   when its event is `terminal` (the runtime's word, from `Port::wait_event`)
//!   and takes the outcome from the event's kind; a flag and kind that
//!   disagree (a lookup answer that does not end, a `ready` marked final) is
//!   a protocol fault: `Unavailable`, the connection given up.
//! - `error.rs`: `EngineError`: `Refused` (the manager answered no; its
//!   reason label), `Unavailable` (no answer, or a copy past its deadline:
//!   the connection must go, its agent draining first), `TimedOut` (a
//!   lookup; the connection stays), `Busy` (full inbox), `Invalid` (the
//!   caller's input, refused before anything is sent).
//! - `backoff.rs`: `Backoff`, at most one connection attempt per interval.
//! - `agent.rs`: `SharedAgent`, the copy agent a connection carries (a
//!   `gpu::agent::CopyAgent` whose executor follows the first memory
//!   attached: `memory_kind("cpu" | "cuda:N")`, `new_agent`; `check_kind`
//!   refuses the other kind), shared by its owner and the connection it rides
//!   on (`ipc::Agent`); the embedded `Runtime` holds one in-process and feeds
//!   it from `tick`. `AgentSetup`: why memory was refused.
//!
//! Invariants: a verb returns only after its command's last event
//! (nothing it started is left parked in the manager), or with
//! [`EngineError::Unavailable`], after which the connection must be
//! closed (its agent drains its copies first); a device page handed out
//! by the slot table is this session's and is never freed while the
//! session lives.

pub mod agent;
mod backoff;
mod error;
mod session;

pub use backoff::Backoff;
pub use error::EngineError;
pub use session::{
    Held, LoadPlan, Loaded, Lookup, MAX_BATCH, MAX_PENDING_LOOKUPS, Port, Progress, Query, Region,
    Saved, Sending, Session, SessionOptions, Ticket,
};
