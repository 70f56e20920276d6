//! IPC between engine processes and `orbitkv serve`: a Unix-socket
//! protocol of versioned frames, with shared-memory descriptors passed as
//! `SCM_RIGHTS` so KV bytes never travel in a message.
//!
//! Frame layout (little-endian, 16-byte header, then the payload):
//!
//! ```text
//! magic "OKVP" | version:u16 (=`PROTOCOL_VERSION`) | kind:u16 | payload_len:u32 | reserved:u32 (=0)
//! payload: UTF-8 JSON of the kind's message
//! ```
//!
//! | kind | direction | message |
//! | --- | --- | --- |
//! | 1 `Hello` | client → manager | [`Hello`] |
//! | 2 `Welcome` | manager → client | [`Welcome`], with the pool's memfd when the pool is shared, then the hot path's descriptors ([`HotPathInfo`]), then the presence filter's ([`presence`]) |
//! | 3 `Submit` | client → manager | [`Submit`]: a tagged `Command` |
//! | 4 `Accepted` | manager → client | [`Accepted`]: tag → command id, or why not |
//! | 5 `Events` | manager → client | `Vec<Delivered>`: events addressed to this connection, each with the runtime's `terminal` flag |
//! | 6 `Error` | manager → client | [`ProtocolError`]; the manager closes the connection after it |
//! | 7 `Ping` / 8 `Pong` | both | empty: liveness and round-trip measurement |
//! | 10 `Descriptor` | manager → client | [`Descriptor`]: one memfd attached, and the handle it belongs to |
//! | 11 `Inspect` | client → manager | empty: asks for a [`Snapshot`] |
//! | 12 `Snapshot` | manager → client | [`Snapshot`]: the manager's live state (`orbitkv inspect`) |
//! | 13 `Lookup` | client → manager | `LookupRequest` (`components::admin`): where a prompt's pages are |
//! | 14 `LookupReply` | manager → client | `LookupReply`: per namespace, the tier of each page (`orbitkv lookup`) |
//!
//! The hot path ([`hot`]): a client that asks for it in `Hello` gets an
//! iceoryx2 request/response service name, a descriptor area and two wake
//! eventfds (after the pool's memfd) in `Welcome`; query, prepare, restore, publish,
//! release and cancel then travel as fixed-size messages, their large parts
//! in the area. Everything else stays on the socket, which also tells the
//! manager when the client is gone.
//!
//! A frame with a bad magic, version, kind or length, or a payload that is
//! not the kind's JSON, gets an `Error` frame and the connection is closed;
//! other connections are unaffected.

pub mod client;
pub mod frame;
pub mod hot;
pub mod hot_server;
pub mod presence;
pub mod snapshot;

pub use client::{Agent, Client, ClientError, ClientOptions, Sent};
pub use frame::{FrameError, Kind, MAX_FRAME_BYTES, PROTOCOL_VERSION};
pub use snapshot::{ConnectionSummary, Health, Snapshot, Window};

use orbitkv_components::api::{Command, CommandError, Event};
use serde::{Deserialize, Serialize};

/// Where `orbitkv serve` listens unless told otherwise:
/// `$XDG_RUNTIME_DIR/orbitkv.sock`, else `/tmp/orbitkv-<uid>/orbitkv.sock`
/// (in a directory of mode 0700 the manager makes: a socket straight in
/// `/tmp` could be taken by any user first). The manager and every client
/// read this one rule.
pub fn default_socket() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => std::path::PathBuf::from(dir).join("orbitkv.sock"),
        _ => fallback_socket_dir().join("orbitkv.sock"),
    }
}

/// `/tmp/orbitkv-<uid>`: the socket's directory when `XDG_RUNTIME_DIR`
/// is unset.
pub fn fallback_socket_dir() -> std::path::PathBuf {
    // SAFETY: getuid has no preconditions.
    std::path::PathBuf::from(format!("/tmp/orbitkv-{}", unsafe { libc::getuid() }))
}

/// The socket a client uses when its configuration names none:
/// `ORBITKV_SOCKET` (as `orbitkv serve --socket` reads it) if set and not
/// empty, else [`default_socket`].
pub fn client_socket() -> std::path::PathBuf {
    match std::env::var_os("ORBITKV_SOCKET") {
        Some(s) if !s.is_empty() => std::path::PathBuf::from(s),
        _ => default_socket(),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    pub protocol: u16,
    /// Free text for logs (engine, pid).
    #[serde(default)]
    pub client: String,
    /// Asks for the hot path (`Welcome::hot`). Left out when false, so a
    /// socket-only client still greets older managers.
    #[serde(default, skip_serializing_if = "is_false")]
    pub hot: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Where the hot path is: the connection's iceoryx2 service. Three
/// descriptors ride on the `Welcome` frame after the pool's: the
/// connection's descriptor area (a memfd), the manager's wake eventfd (the
/// client signals it after a request while the manager sleeps) and the
/// client's (the manager signals it after a response while the client
/// sleeps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotPathInfo {
    /// The connection's request/response service,
    /// `orbitkv/<incarnation>/rpc/<connection>`.
    pub service: String,
    /// The iceoryx2 file prefix of this incarnation (its config).
    pub prefix: String,
    /// Ties hot requests to this connection.
    pub token: u64,
    /// Bytes of the descriptor area.
    pub area_bytes: u64,
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
    /// The hot path, when the client asked for it and the manager has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot: Option<HotPathInfo>,
    /// Bytes of the presence filter ([`presence`]) whose descriptor comes
    /// last, after the hot path's: offered with the hot path only (the
    /// client counts the lookups it answered in its descriptor area).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// Chosen by the client; echoed in `Accepted`.
    pub tag: u64,
    pub command: Command,
}

/// An event as a connection receives it: with the runtime's word on whether
/// it ends its command and operation (`Addressed::terminal`), so no client
/// derives that again from the event's kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delivered {
    pub event: Event,
    pub terminal: bool,
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

/// What a `Descriptor` frame's memfd is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DescriptorKind {
    /// A device region's shared memory (`region_registered`), mapped
    /// read-write by the engine that registered it.
    Region,
    /// The connection's staging area (sent before the `region_registered`
    /// of an agent-owned region): the one memory the client's copy agent
    /// writes for the manager, mapped read-write beside the read-only pool.
    Staging,
}

/// The payload of a `Descriptor` frame: which handle the attached memfd
/// belongs to. Sent before the `Events` frame that names the handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Descriptor {
    pub kind: DescriptorKind,
    /// The handle (a device region's `region` bits).
    pub handle: u64,
    /// Bytes of the shared memory.
    pub bytes: u64,
}
