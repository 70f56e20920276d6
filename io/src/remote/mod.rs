//! The remote tier: pages in Redis or Redis Cluster (or Valkey), shared by
//! every manager that points at the same deployment, and never trusted.
//!
//! [`RemoteTier`] implements [`BackingTier`](crate::tier::BackingTier)
//! (name `remote`). Nothing blocks inside a tick: `lookup` answers from an
//! in-memory metadata cache, `submit_read` and the write calls only queue
//! work for bounded worker threads, `poll` collects their replies and
//! enforces deadlines. Deployment and operation: `docs/remote.md`.
//!
//! # Keys
//!
//! ```text
//! <prefix>d:<hex StateKey::encode>      the page's record (SET ... PX ttl_ms)
//! <prefix>i:<hex namespace>:<shard>     directory stream of one namespace,
//!                                       shard = xxh3(key) % directory_shards
//! ```
//!
//! `prefix` is `key_prefix` (default `okv1:`). Directory shards spread one
//! model's directory over cluster slots.
//!
//! # Record layout
//!
//! A value is `header ‖ payload`; the header is also the whole directory
//! entry (stream field `h`). Integers little-endian:
//!
//! ```text
//! offset size  field
//!      0    8  magic             "OKVREM\0\x01"
//!      8    2  version           2
//!     10    2  header_len        152 + key_len
//!     12    2  key_len           length of StateKey::encode (41..=104)
//!     14    2  flags             0
//!     16    8  payload_len       > 0
//!     24    8  payload_checksum  XXH3-64 of the payload (checksum::page_checksum)
//!     32    8  writer            the writing manager's incarnation
//!     40    8  written_unix_ms   writer's wall clock
//!     48    8  ttl_ms            expiry the writer set
//!     56   32  format_digest     StateFormat::digest of the bytes' format
//!     88   32  payload_mac       keyed BLAKE3 of the payload (payload key)
//!    120    k  key               StateKey::encode (the full key: namespace,
//!                                group, native hash)
//!  120+k   32  header_mac        keyed BLAKE3 of bytes [0, 120+k) (header key)
//! 152+k    …  payload
//! ```
//!
//! The two keys are derived (`blake3::derive_key`, one context each) from
//! the deployment's secret in `mac_key_file` ([`record::RecordMac`]); with
//! `unauthenticated = true` they are derived from nothing, so anyone can
//! compute them. Version-1 records (no MACs) are never read.
//!
//! # Metadata is a hint
//!
//! `lookup` answers from a bounded cache (`metadata_max_entries`, oldest
//! forgotten first) filled three ways: this manager's own completed writes;
//! the refresher thread, which follows the directory streams of every
//! namespace `lookup` was asked about (`XRANGE` from the last id read, every
//! `refresh_interval_ms`, at most `max_refresh_entries` a round); and
//! nothing else: a namespace seen for the first time misses until its
//! directory has been read. Entries past their writer's expiry are pruned,
//! and a directory stream that vanished (a flushed or expired directory)
//! drops its entries, every `validate_every_rounds` rounds.
//!
//! # Never trusted
//!
//! A read fetches the record's length and at most the bytes a record of
//! the promised length can take (`STRLEN` and `GETRANGE` in one pipeline:
//! a larger value planted under the key is refused by its length, never
//! read whole) and verifies it on the worker before any byte reaches the
//! pool: header (magic, version, lengths, flags, header MAC, key
//! encoding), the full key equal to the one asked for, the payload length
//! equal to the reserved length, the value exactly `header_len +
//! payload_len` long (a truncated or padded value fails), the payload
//! checksum equal to the one the metadata promised (a record rewritten
//! since the lookup, for instance by an owner that restarted, fails), the
//! payload MAC, and the payload's XXH3-64 equal to the header's. Only then
//! are the bytes copied into the destination slot. Directory entries are
//! verified by their header MAC before they promise anything: a forged
//! entry is dropped (`directory_entries_bad`). Failures are
//! reported as typed [`TierError`](crate::tier::TierError)s that the runtime
//! turns into misses with a reason (`remote_missing`, `remote_corrupt`,
//! `remote_timeout`, `remote_unavailable`); a missing or corrupt record
//! also leaves the metadata cache. The runtime checksums the slot again
//! against the looked-up checksum before indexing the page.
//!
//! # Deadlines
//!
//! A read not reported `read_timeout_ms` after `submit_read` (by the
//! caller's clock) is reported as `Timeout`. Ownership of the destination
//! is one atomic per read (`PENDING`, `COPYING`, `DONE`, `ABANDONED`): the
//! worker copies only after moving `PENDING -> COPYING`, the tick reports a
//! timeout only after moving `PENDING -> ABANDONED`, so a slot the runtime
//! got back is never written. Sockets carry the same timeout, so a worker
//! never waits longer than its read's deadline. Abandoned reads count
//! against `max_inflight_reads` until their worker returns.
//!
//! # Down, slow, partitioned
//!
//! `breaker_failures` consecutive connection failures or timeouts open a
//! breaker: lookups answer "absent" (so queries select shorter boundaries
//! from DRAM and SSD instead of failing on remote reads), reads and writes
//! are refused at once. The refresher PINGs on a fresh connection every
//! `breaker_cooldown_ms` and closes the breaker when it answers. A remote
//! that is down at start is the same case: `open` does not connect.
//!
//! # Writes
//!
//! `write_policy`: `write_through` (pages published into DRAM are offered
//! through [`BackingTier::write_through`](crate::tier::BackingTier::write_through)),
//! `write_back` (pages DRAM evicts, through `demote`), `both`, or
//! `read_only`. A write copies the page (the caller frees its slot at
//! once) and verifies the copy against the checksum the page carries; it
//! is refused by a typed reason ([`DemoteRefused`](crate::tier::DemoteRefused):
//! `unavailable`, `too_large`, `duplicate`, `queue_full` beyond
//! `max_queued_writes` / `max_queued_write_bytes`, `empty`, `checksum`),
//! and is done by a writer thread: `SET` of the
//! record with `PX ttl_ms`, then `XADD` of the directory entry (trimmed to
//! about `directory_max_entries`) and `PEXPIRE` of the directory. The value
//! goes first, so a directory entry never precedes its record. A writer
//! sends the writes queued behind the one it took (at most
//! `write_batch_pages` records, `write_batch_bytes` bytes) as one
//! pipeline, each record still ahead of its entry.
//!
//! # Threads and bounds
//!
//! `read_workers` readers and `write_workers` writers, one connection
//! each, fed by bounded channels (`max_inflight_reads`,
//! `max_queued_writes`); one refresher (also the health check). Dropping
//! the tier takes every pending destination back (waiting only for copies
//! under way) and does not join threads that may sit in a socket call.

mod config;
mod conn;
mod meta;
pub mod record;
mod stats;
mod tier;

pub use config::{PASSWORD_ENV, RemoteConfig, RemoteError, RemoteMode, WritePolicy};
pub use stats::{
    ErrorCounts, ErrorKind, LATENCY_BOUNDS_US, LatencyHistogram, RemoteStatsSnapshot, WriteRefusals,
};
pub use tier::{RemoteStatsHandle, RemoteTier};
