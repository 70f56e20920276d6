//! Stage 6, fence: poll completions (tier reads, device copies), verify and
//! index what landed, unpin device pages, expire deadlines, settle
//! operations whose I/O drained, and retire finished ones. This is the only
//! stage that returns leases and byte reservations, and only once an
//! operation has no `Transfers` left.
//!
//! Systems, in this order: `land_reads`, `land_copies`, `expire`,
//! `settle`, `retire`, `close_sessions`.

mod copies;
mod expire;
mod reads;
mod retire;

pub use copies::land_copies;
pub use expire::{expire, settle};
pub use reads::land_reads;
pub use retire::{close_sessions, retire};
