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
//!
//! # Codemap
//!
//! The manager protocol (`docs/serve.md`). Depends on components only.
//!
//! - `frame.rs`: 16-byte versioned header, JSON payloads; `FrameReader`
//!   (consumes a stream's input with a cursor: a burst of n frames costs
//!   O(n)); `send_some` (non-blocking `sendmsg`, descriptors on the first
//!   byte); `recv_some`; `SO_PEERCRED`. Invariant: nothing here panics on
//!   bytes from a peer.
//! - `lib.rs`: `Hello`, `Welcome`, `Submit`, `Accepted`, `Delivered` (an
//!   event with the runtime's `terminal` flag: what an `Events` frame carries,
//!   protocol 4), `ProtocolError`, `Descriptor` (a memfd and the handle it belongs to: never paired by
//!   position); `snapshot.rs`: `Snapshot`, `Window`, `ConnectionSummary`
//!   (`orbitkv inspect`).
//! - `client.rs`: `Client`: checks the manager's peer uid before sending
//!   anything (`ClientOptions::trusted_uids`, `ORBITKV_TRUSTED_UIDS`),
//!   blocking `call`, queued events with their flags (`wait_delivered`,
//!   `poll_delivered`; a hot request's last response is its terminal event;
//!   `requeue` puts back what a borrower did not consume), spin-then-block waits, zero-copy `page`
//!   reads from the read-only pool, writable device `region_mut` (mapped
//!   from `Descriptor` frames), `inspect`; hot commands go over iceoryx2
//!   when the manager offers it. `Agent` (trait) / `set_agent`: a copy agent
//!   riding on the client takes the `AgentCopy` events (the user never sees
//!   them) and sends its `CopyDone` reports inside every wait, gets the pool
//!   (read-only) and the staging area (`Descriptor` kind `staging`) for its
//!   window, keeps waits short while its copies run, and drains when the
//!   connection is lost.
//! - `presence.rs`: the presence filter, a bitmap of the keys the
//!   manager's tiers hold, in a sealed memfd every hot client maps
//!   read-only. Invariants: a bit is set after the tick that indexed its
//!   page and before that tick's events leave (so a page an engine was told
//!   of is never "absent"); bits are cleared only by a rebuild, under an odd
//!   epoch (a seqlock: readers that overlap ask the manager); a reader
//!   trusts it only while `open` (every tier listable and reachable) and
//!   while the manager's beat is under `STALE_MS` old. The filter only
//!   answers misses (`not_found`), never a hit. The manager side
//!   (`manager/src/presence.rs`) feeds it from the page journals it drains
//!   once a tick for it and the KV event stream; the engine side
//!   (`Session::answer_from_filter`) checks group 0's first page asked for.
//! - `hot.rs`, `hot_server.rs`: the hot path: 128-byte `#[repr(C)]`
//!   requests as iceoryx2 publish-subscribe samples and responses in a
//!   mailbox of the connection's descriptor area (256 slots, each side
//!   keeping its own count; every request the manager takes ends with a
//!   last response there, and it refuses a connection's 33rd open request)
//!   for query, lookup, load, prepare,
//!   restore, publish, release and cancel (a request closes with its
//!   event's `terminal` flag; the server derives nothing), whose variable-size parts live in a
//!   per-connection memfd descriptor area (request and reply rings of
//!   generation-stamped records, sealed against resizing); the server side
//!   validates every descriptor (bounds, alignment, generation, length,
//!   kind) before it parses a copy. Each hot connection has its own request
//!   service (`connection_service_name`; its requests must carry its token;
//!   the subscriber's buffer never overwrites, a request it cannot take is
//!   not delivered and goes on the socket); after a disconnect the server
//!   releases what dead nodes hold (`remove_dead_nodes`, from `receive`, at
//!   most every 100 ms: a crashed client's node and its share of its
//!   service). Wake-ups go through eventfds (`WakeFd`: the manager's, and
//!   one per connection, passed with `Welcome`), never a socket or pipe
//!   write: those are "sync" wake-ups that put the woken side on the
//!   waker's CPU, and the waker here spins on. Service names and the iceoryx2 file
//!   prefix are unique per manager incarnation; stale files are removed at
//!   start and shutdown; `restrict_files_with_prefix` makes an
//!   incarnation's files owner-only.
//!   Cost before responses moved to the mailbox (protocol 5; callgrind, manager, one hot query hit plus its release: 2
//!   requests, 2 ticks, 3 responses; `query_roundtrip --only-hot` with
//!   `ORBITKV_BIN` a callgrind wrapper): ~144k instructions, of which
//!   iceoryx2 `send_copy` ~22k per response (loan: `Sender::allocate`'s
//!   reclaim scan ~10k; `ResponseMut::send` ~11k), the two ticks ~45k (bevy's
//!   executor ~27k of it, ingest ~8k, validate ~4k, discover ~2.4k),
//!   `Server::receive` ~2.3k per call (measured with one shared service;
//!   `update_connections` is cheap per
//!   call: its big share in a profile is one client's disconnect,
//!   `UsedChunkList::remove_all`, ~117M instructions at 256 clients), decode
//!   ~1.5k per request. The encoders allocate each part once (sized up front,
//!   no part list); `end_tick` walks only the requests received since the
//!   last tick. With protocol 6, an 8-page lookup hit answered between ticks
//!   (callgrind): the manager ~2.3k instructions to decode and ~9.5k to
//!   answer, the response one 128-byte copy; the Python client ~16k, of which
//!   iceoryx2's request `send_copy` ~3.5k and dropping the request's
//!   response stream ~2.4k. Protocol 7 (requests as publish-subscribe
//!   samples, and a lookup's hashes read from Python by borrowed item): the
//!   client ~10.7k, `send_copy` ~2.6k. The client counts its requests in
//!   the area (`requests_sent`), so the manager asks a service only when its
//!   count moved (and every service once in 64 looks).
//!
//! Never knows about: ECS, the runtime's state, how the manager schedules.

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
