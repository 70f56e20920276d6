//! Byte movers for OrbitKV: the DRAM host pool, the SSD store and the
//! remote tier (see ARCHITECTURE.md; the wire is `orbitkv-ipc`).
//!
//! # Codemap
//!
//! - `dram.rs`: `HostPool`, one anonymous mapping addressed by offsets (so it
//!   can move to shared memory later without changing callers); slab classes
//!   carved from fixed extents; slots are slotmap `SlotKey`s
//!   (generation-checked; stored as `u64` bits elsewhere); `first_touch`
//!   touches every OS page in parallel (rayon) and reports s/GiB.
//!   `check_invariants` proves no two live slots overlap. Extents are never
//!   returned to the shared list (a known slab limitation).
//! - `lru.rs`: `LruOrder<K>` (a linked list through a slab, O(1) touch,
//!   remove and pop); the runtime keeps only unleased pages in it.
//! - `tier.rs`: `BackingTier`, the interface of every tier below DRAM:
//!   `lookup` (metadata only), `submit_read` into a pool offset, `poll`,
//!   `demote(key, format, bytes, checksum, now) -> Demoted` (eviction:
//!   `Copied`, the caller frees the slot at once, or `InPlace(DemoteToken)`,
//!   the tier writes straight from the registered host pool and the caller
//!   keeps the slot unchanged until `poll_released` returns the token, exactly
//!   once, also for failed writes; `demotions_holding` counts the
//!   unreleased; accepted demotions that fail later come back from
//!   `poll_demotions` as a typed `DemoteFailed`) and `write_through`
//!   (publish). Copying tiers (remote, write-through) verify their copy
//!   against the checksum the page carries (refusals are typed
//!   `DemoteRefused`, `DemoteRefused::Checksum` for altered bytes); the SSD
//!   tier records that checksum without hashing and refuses altered bytes at
//!   read. `miss_reason` (how a failed read is reported: `local_miss_reason`,
//!   `remote_miss_reason`); `unavailable` (the tier cannot be reached now:
//!   its "absent" is not evidence a page is gone, so a read that finds its
//!   page nowhere misses with that tier's reason, `remote_unavailable`);
//!   `finish_demotions` (shutdown and restarts only: blocks until every
//!   accepted demotion finished, so the next polls count and release them);
//!   `occupancy`; `record_changes`/`take_changes`/`relist_changes` (KV
//!   events: a `TierJournal` of `TierChange`s, bounded, the index at start
//!   listed first and checked as listed; the SSD's `index_insert`/
//!   `index_remove` and the memory tier's `store`/`unstore` are the only
//!   index mutators); `clear_namespace` (`orbitkv clear`: the memory tier and the
//!   SSD index forget a namespace; the remote tier refuses, by default).
//!   `MemoryTier` is the deterministic in-memory tier of tests and replays;
//!   `MemoryTierHandle` injects faults (corrupt, remove, fail, and in remote
//!   mode `SimRemote`: stale metadata, verified reads with a deadline, down,
//!   flush, rewrite, truncate) and opts into in-place demotions
//!   (`set_in_place(Some(us))`: bytes copied out of the pool only at release,
//!   so a slot reused too early stores wrong bytes that fail their checksum).
//! - `checksum.rs`: `page_checksum` (XXH3-64, defined once in
//!   `orbitkv_components::checksum`, twox-hash's kernel picked at run time:
//!   AVX2 where the CPU has it, from a portable build): computed once when bytes
//!   land (by the copy, `orbitkv_gpu::copy_and_checksum`), carried with the
//!   page, verified after every lower-tier read, and on copying demotions and
//!   write-through (remote); SSD demotions store it unhashed (the read
//!   verifies).
//! - `dram.rs` also: `sealed_pool_memory`, the shared pool's memfd, sealed
//!   against writes (`F_SEAL_FUTURE_WRITE`) and resizing right after the
//!   manager's own mapping; `HostPool::export_fd` hands out a read-only
//!   descriptor.
//! - `ssd/`: `SsdStore`, the SSD tier: log-structured segment files
//!   (`seg-<id>.okv`) of records aligned to the directory's direct-I/O
//!   alignment `B` (statx `STATX_DIOALIGN`, not below the filesystem block:
//!   ext4 serialises sub-block direct writes; 512..=4096; a `B`-byte header
//!   block, payload padded to `B`: format version 2, `format::RecordHeader`:
//!   magic, version, block, full `StateKey`, format digest, lengths, payload
//!   and header xxh3, the record's own segment and offset; version-1 segments,
//!   4 KiB blocks, are still read; small records submitted together are
//!   written as a group, format version 3: one header block of up to 16
//!   256-byte entries, each naming its payload, then the payloads, one
//!   `pwritev`, succeeding or failing as a whole; a grouped record is read
//!   as its payload alone, verified against its indexed entry's checksum). `engine.rs` is the I/O trait (readv,
//!   write, writev, fdatasync) with two backends, `uring.rs` (io_uring,
//!   O_DIRECT) and `blocking.rs` (pread/pwrite worker pool, chosen when the
//!   ring cannot be set up). Demotions from the host pool are written in
//!   place (one `pwritev` of header block + pool range + tail block, no copy,
//!   no hashing; token released when the write completes); `submit_write`
//!   copies and hashes. `scan.rs` rebuilds the index from headers on open
//!   (stepping 512 bytes, jumping over holes with `SEEK_DATA`; a file longer,
//!   or with more allocated bytes, than `capacity_bytes` is refused unread:
//!   `OpenScan::oversized_segments`), skipping torn or corrupt records. A record becomes visible only after its write and a
//!   batched `fdatasync` completed (`SyncPolicy`). Capacity (in bytes) is
//!   kept by FIFO segment collection; reads pin segments. Only regular files
//!   are opened at start-up (a FIFO named like a segment is skipped). Implements `BackingTier`
//!   (`lookup`, `submit_read` with header and checksum verification, `demote`).
//!   Invariants: a record that disagrees with its header, index or checksum is
//!   `TierError::Corrupt` and leaves the index; nothing blocks inside a tick.
//!
//! - `remote/`: `RemoteTier`, the remote tier over Redis / Redis Cluster
//!   (`docs/remote.md`; layout in `mod.rs`). `record.rs`: the record header
//!   (full `StateKey`, format digest, length, XXH3, payload MAC, writer,
//!   time, TTL, header MAC), `RecordMac` (keyed BLAKE3 keys derived from the
//!   deployment's secret, `mac_key_file`; public keys only with
//!   `unauthenticated = true`), `verify`; `conn.rs`: single-node / cluster
//!   connections (redis crate, sync) and the commands sent (`get_bounded`:
//!   a read never fetches more than a record of the promised length); `meta.rs`: `MetaCache`, the bounded
//!   metadata `lookup` answers from, with tombstones of failed reads;
//!   `tier.rs`: reader and writer threads behind bounded channels (a writer
//!   sends what is queued as one pipeline, `write_batch_pages` /
//!   `write_batch_bytes`, from buffers it reuses), the
//!   refresher (directory streams, health check), the breaker; `stats.rs`:
//!   counters and latency histograms (the manager's `/metrics` collector
//!   reads them); `config.rs`: `RemoteConfig` (every bound; the password
//!   only from env or a file).
//!   A write (demotion or write-through) is verified against the page's
//!   checksum before it is queued; the record carries that checksum.
//!   Invariants: no byte reaches the pool before the record verified; a
//!   destination slot is written only after its read moved `PENDING ->
//!   COPYING`, and reported as timed out only after `PENDING -> ABANDONED`;
//!   nothing blocks inside a tick.
//!
//! Never knows about: ECS, operations, engines, the wire.

pub mod checksum;
pub mod dram;
pub mod lru;
pub mod remote;
pub mod ssd;
pub mod tier;
