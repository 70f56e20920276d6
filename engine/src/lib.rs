//! The engine side of OrbitKV: what every engine adapter (vLLM, SGLang,
//! transformers) uses to talk to a manager, written once.
//!
//! - [`Session`]: one session over one connection. It registers the
//!   instance and opens the session, keeps a slot table per device region
//!   (a device page is allocated once per slot and kept with the session),
//!   and offers the verbs with typed results: [`Session::lookup`] (a peek
//!   that holds nothing), [`Session::lookup_many`] (many in one round
//!   trip), [`Session::load`] (query, lease, read and copy in one command),
//!   [`Session::save`].
//! - [`EngineError`]: refused (the manager answered no, with its reason) is
//!   never confused with unavailable (it did not answer, or the connection
//!   can no longer be trusted).
//! - [`Backoff`]: when a session may be tried again after a failure.
//! - [`agent`]: the copy agent a connection carries (engine memory copied
//!   in this process on the manager's instruction).
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
