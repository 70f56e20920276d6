//! IPC between engine processes and `orbitkv serve`: a Unix-socket
//! protocol of versioned frames, with shared-memory descriptors passed as
//! `SCM_RIGHTS` so KV bytes never travel in a message.
//!
//! Frame layout (little-endian, 16-byte header, then the payload):
//!
//! ```text
//! magic "OKVP" | version:u16 (=1) | kind:u16 | payload_len:u32 | reserved:u32 (=0)
//! payload: UTF-8 JSON of the kind's message
//! ```
//!
//! | kind | direction | message |
//! | --- | --- | --- |
//! | 1 `Hello` | client → manager | [`Hello`] |
//! | 2 `Welcome` | manager → client | [`Welcome`], with the pool's memfd when the pool is shared |
//! | 3 `Submit` | client → manager | [`Submit`]: a tagged `Command` |
//! | 4 `Accepted` | manager → client | [`Accepted`]: tag → command id, or why not |
//! | 5 `Events` | manager → client | `Vec<Event>` routed to this connection; a `RegionRegistered` event carries its region's memfd |
//! | 6 `Error` | manager → client | [`ProtocolError`]; the manager closes the connection after it |
//! | 7 `Ping` / 8 `Pong` | both | empty: liveness and round-trip measurement |
//!
//! A frame with a bad magic, version, kind or length, or a payload that is
//! not the kind's JSON, gets an `Error` frame and the connection is closed;
//! other connections are unaffected.

pub mod client;
pub mod frame;

pub use client::{Client, ClientError};
pub use frame::{FrameError, Kind, MAX_FRAME_BYTES, PROTOCOL_VERSION};

use orbitkv_components::api::{Command, CommandError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    pub protocol: u16,
    /// Free text for logs (engine, pid).
    #[serde(default)]
    pub client: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Welcome {
    pub protocol: u16,
    /// Changes at every manager start: session handles from another
    /// incarnation are stale.
    pub incarnation: u64,
    /// Bytes of the shared pool whose descriptor came with this frame; 0
    /// when the pool is private.
    pub pool_bytes: u64,
    pub max_frame_bytes: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// Chosen by the client; echoed in `Accepted`.
    pub tag: u64,
    pub command: Command,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Accepted {
    pub tag: u64,
    /// The command's id, which its reply events carry; or why it was not
    /// queued (the manager's inbox is bounded).
    pub result: Result<u64, CommandError>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtocolError {
    pub error: String,
}
