//! The SSD tier: KV-cache pages in log-structured segment files, read and
//! written with `O_DIRECT` through io_uring (or a blocking pread/pwrite
//! worker pool behind the same internal engine trait).
//!
//! [`SsdStore`] implements [`BackingTier`](crate::tier::BackingTier) (name
//! `ssd`): `lookup` answers from the in-memory index only; `submit_read`
//! reads one record and delivers exactly its payload into the registered
//! host pool after verifying it; `poll` reaps completions. Writes go through
//! [`SsdStore::submit_write`] / [`SsdStore::poll_writes`], demotions through
//! `demote` (in place from the host pool where it can, see Writes) /
//! `poll_demotions` / `poll_released`. Nothing blocks
//! inside a tick: submissions only queue, `poll` only reaps, and segment
//! file creation/deletion runs on a helper thread.
//!
//! # Directory
//!
//! ```text
//! <dir>/LOCK                      flock(LOCK_EX) while a store has it open
//! <dir>/seg-<id:016x>.okv         segment files, id increasing with age
//! ```
//!
//! `open` waits up to 200 ms for `LOCK` before refusing with
//! `SsdError::Locked`: a store just dropped keeps its lock while a child
//! forked meanwhile still holds a copy of the descriptor (until its
//! `exec`).
//!
//! A segment is created at `segment_bytes` (fallocate'd where supported,
//! then the directory is fsync'd), written append-only by exactly one
//! store session, and never written again once sealed. Every `open` starts
//! a new segment; segments of earlier sessions are read-only.
//!
//! # Record layout
//!
//! Every record uses blocks of `B` bytes: the directory's direct-I/O
//! alignment, read at `open` with `statx(STATX_DIOALIGN)` (its
//! `dio_offset_align`, but not below the filesystem block `st_blksize`;
//! where the kernel or filesystem reports no alignment, the backing
//! device's logical block size from sysfs, else 4096), rounded up to a
//! power of two and clamped to 512..=4096 ([`SsdStats::block_bytes`]). The
//! filesystem-block floor is measured, not cautious: on the development
//! VM (ext4, 4 KiB blocks, on a 512-byte-sector virtio disk) 512-byte
//! records wrote at 0.12-0.25x raw O_DIRECT throughput, because ext4
//! serialises direct writes that are not fs-block aligned; so `B` is 4096
//! there, and 512 only where the filesystem's block is (e.g. ext4 or XFS
//! made with 512-byte blocks). A record starts at a multiple of `B`, is one
//! `B`-byte header block followed by the payload zero-padded to a multiple
//! of `B`, so it occupies `B + round_up(payload_len, B)` bytes (with `B` =
//! 512: a 64 KiB page 64.5 KiB, a 16 KiB page 16.5 KiB; with 4096, 68 and
//! 20) and its payload is `B`-aligned on disk (read with O_DIRECT straight
//! into a pool
//! slot). Header fields (format version 2, integers little-endian):
//!
//! ```text
//! offset size  field
//!      0    8  magic             "OKVSSDR\x01"
//!      8    2  format_version    2
//!     10    2  header_len        256 (bytes of the block that carry data)
//!     12    2  key_len           length of the encoded StateKey (41..=104)
//!     14    2  flags             0
//!     16    8  segment_id        id of the segment written into
//!     24    8  record_offset     offset of this header in that segment (a multiple of B)
//!     32    8  sequence          store-wide write sequence; newest wins
//!     40    8  payload_len       bytes of payload (without padding), > 0
//!     48    8  payload_checksum  XXH3-64 of the payload (checksum::page_checksum)
//!     56    8  written_us        caller's clock at the write (informational)
//!     64   32  format_digest     StateFormat::digest of the bytes' format
//!     96  104  key               StateKey::encode, zero-padded
//!    200    4  block             B: 512, 1024, 2048 or 4096
//!    204   44  reserved          zero
//!    248    8  header_checksum   XXH3-64 of bytes [0, 248)
//!    256  B-256  zero
//!      B    …  payload, then zero padding to the next multiple of B
//! ```
//!
//! `segment_id` and `record_offset` bind a header to its place, so a stale
//! or misplaced copy of a header (or one embedded in a payload) never
//! validates elsewhere; `block` is covered by the header checksum, so a
//! header tells where its payload starts and how long its record is.
//!
//! Version 1 (earlier releases) is the same header with `format_version`
//! 1, bytes 200..248 reserved (zero) and `B` fixed at 4096. Segments in
//! that layout found at `open` are read as written (their records are
//! indexed with `B` = 4096 and counted in [`OpenScan::v1_records`]); new
//! records are always version 2. A segment holding records of a smaller
//! block than the current device's alignment (moved from another device)
//! is read through the page cache instead of O_DIRECT
//! ([`OpenScan::buffered_segments`]).
//!
//! ## Groups (format version 3)
//!
//! Records submitted together are written as a group, so that small pages
//! do not each pay a whole header block (a 16 KiB page with `B` = 4096 took
//! 20 KiB on disk; in a group of 16 it takes 16.25 KiB). A group is one
//! `B`-byte header block holding up to `min(16, B / 256)` headers, one
//! 256-byte entry each at `i * 256` (the rest of the block zero), followed
//! by the records' payloads in entry order, each zero-padded to whole
//! blocks. Each entry is the header above with `format_version` 3,
//! `record_offset` the group's header block (so every entry of a group
//! names the same offset, and entry 0 sits where a record's header would),
//! and four fields in bytes 204..224, all covered by the entry's own
//! header checksum:
//!
//! ```text
//!    204    8  payload_offset    this record's payload in the segment (a multiple of B)
//!    212    8  group_bytes       the whole group: header block + padded payloads
//!    220    2  index             this entry's place in the header block
//!    222    2  count             entries in the group, 2..=min(16, B / 256)
//!    224   24  reserved          zero
//! ```
//!
//! Decoding checks that the payload lies after the header block and inside
//! the group, block-aligned, and that the index is below the count. Only
//! records whose padded payload is at most 64 KiB are grouped, at most
//! [`SsdConfig::group_bytes`] per group (256 KiB by default, so several
//! groups are in flight at once, and a 64 KiB page's header share falls
//! from 6% to 2%; 0 turns groups off) and never across a segment's end; a
//! single record (a
//! larger one, or one written alone) keeps version 2.
//!
//! # Writes
//!
//! [`SsdStore::submit_write`] (tools, tests: bytes with no known checksum)
//! copies the payload into a store-owned aligned buffer behind its header
//! block, hashes the copy, and writes the record with one `pwrite`.
//! Demotions ([`BackingTier::demote`](crate::tier::BackingTier::demote))
//! never hash: the header records the checksum the page carries (computed
//! once, when its bytes landed in DRAM). When the payload lies inside the
//! registered host pool and (under O_DIRECT) starts on `B` and the
//! direct-I/O memory alignment, the record is written in place: one
//! `pwritev` of `[header block, the payload's whole blocks straight from
//! the pool, a zero-padded copy of the last partial block]` (the tail is
//! copied at `demote`, at most `B - 1` bytes), and `demote` returns
//! [`Demoted::InPlace`](crate::tier::Demoted::InPlace). Its token comes
//! back from `poll_released` exactly once, when that write completed
//! (successfully or not), or when the queued write is failed without being
//! issued (no space, no segment); until then the caller keeps the slot and
//! its bytes. Anything else (a payload outside the pool, misaligned) takes
//! the copy path without hashing and returns `Copied`.
//!
//! A small record (padded payload at most 64 KiB) is not issued at its
//! submission: it waits for the next `poll` (or until the records queued
//! fill a group: 16 of them, or another of the same size would pass
//! 256 KiB), and the queued small records at the head of the queue then go
//! out as one group with one `pwritev` of `[the group's header block, each
//! record's payload blocks (from the pool or from its copy), each partial
//! last block's tail buffer]`. The group succeeds or fails as a whole:
//! every record of it is reported, and every in-place token released,
//! exactly once, with the group's outcome. Bytes altered in
//! DRAM after they landed are therefore stored as they are and refused at
//! read (below). `Drop` waits for every submitted operation, so no write
//! reads the pool after the store is gone; queued, unissued writes are
//! dropped.
//!
//! # Verification
//!
//! A read succeeds only if the header decodes (magic, version, header
//! checksum, flags, reserved bytes, key encoding), names the requested key,
//! the indexed segment/offset/sequence/digest/checksum and length, and the
//! payload's XXH3-64 equals the header's. Anything else completes as
//! [`TierError::Corrupt`](crate::tier::TierError::Corrupt) and drops the
//! record from the index (counted as eviction reason `corrupt`).
//!
//! A record of a group is read without its header (the entry is not next
//! to the payload, and a second read per page would double the reads'
//! I/Os): the read fetches the payload alone, and it succeeds only if the
//! payload's XXH3-64 equals the checksum of the entry that indexed it. That
//! entry was verified, like a header above, when the group was written (by
//! this store) or by the open-time scan. So a grouped record's bytes are
//! verified exactly as strictly at every read; damage to its entry alone
//! (payload intact) is found by the next open, which drops that record. On any
//! failed read the destination range's contents are unspecified.
//!
//! # Durability
//!
//! [`SyncPolicy::BatchFdatasync`] (default): a record is written with one
//! O_DIRECT `pwrite` (copy) or `pwritev` (in place) of header + payload, or
//! with its group's `pwritev`. When writes complete, the next
//! `poll` submits one `fdatasync` per segment (asynchronously, through the
//! same engine) covering every write of that segment completed so far;
//! only when it succeeds are those records inserted into the index and
//! reported as [`WriteDone`] `Ok`. So a page is never visible before it is
//! durable (data and the metadata needed to read it: fallocate'd extents
//! converted, file size), and a crash can lose only unreported writes.
//! Group commit amortises the flush across every write that completed
//! while the previous sync ran. `SyncPolicy::Dsync` (O_DSYNC, every write
//! durable on completion) and `SyncPolicy::None` (visible on completion,
//! survives a process crash but not power loss) are available; the
//! benchmark `benches/ssd.rs` measures all three against raw O_DIRECT
//! io_uring writes of the same payload bytes, in the same run. Batching
//! (tens of writes per fdatasync) costs little against no sync at all,
//! while O_DSYNC pays a flush per write; hence the default. (Run-to-run
//! noise on the shared 2-core VM is large; compare within one run.)
//!
//! # Submission
//!
//! `submit_read` / `submit_write` only queue: io_uring SQEs are handed to
//! the kernel by the next `poll` (one `io_uring_enter` per poll, without
//! waiting) or as soon as 16 have gathered; the blocking backend hands each
//! job to its workers at once. `poll` reaps without waiting.
//!
//! # Recovery
//!
//! `open` scans every segment front to back (buffered reads): a block that
//! parses as a header of this segment at this offset, whose record fits in
//! the file and whose payload checksum matches, is indexed and its whole
//! record skipped; other non-zero blocks are skipped 512 bytes (the
//! smallest block) at a time, each stretch up to the next valid record
//! counted once
//! ([`OpenScan::corrupt_skipped`]); zero blocks (preallocated, never
//! written) are skipped silently. Stepping 512 bytes finds records of
//! every block size, version 1 included. If a key occurs twice the highest
//! sequence wins. Segments without a valid record are removed. The scan
//! reads all data (O(stored bytes)); a checkpointed index is future work.
//!
//! A group is found by its entry 0 (valid, of this segment, naming this
//! offset, index 0). Every other entry is then decoded from the header
//! block and indexed only if it verifies, names the same group (offset,
//! count, size, block) and a payload after the previous valid entry's,
//! and its payload matches its checksum; each entry that does not counts
//! once in `corrupt_skipped`, and the scan goes on after the group. A
//! group whose entry 0 is damaged is one bad stretch (its records are
//! lost, as an unreported write at a crash is); a group cut off by the end
//! of the file ends the scan, as a cut-off record does.
//!
//! Entries named like segments that are not regular files (a FIFO, a
//! device, a directory, a symlink) are never opened: they are skipped with
//! a warning (`OpenScan::skipped_files`), as are ids past
//! `MAX_SEGMENT_ID` (2^63 - 1), so the next id never wraps onto a file that
//! exists.
//!
//! # Capacity
//!
//! Segment files hold at most `capacity_bytes`, counted in bytes (each file
//! at its own size, so segments written under another `segment_bytes`
//! count as what they are). When a new one would pass that, the oldest
//! sealed segment is dropped whole
//! (FIFO) with all its records (eviction reason `capacity`), but only once
//! nothing is in flight against it: reads pin their segment until reaped.
//! If creating a segment fails with ENOSPC the oldest segment is dropped
//! (reason `no_space`) and creation retried; with nothing left to drop,
//! queued writes fail with [`WriteError::NoSpace`] and new ones are
//! refused with [`WriteRefused::NoSpace`] for one second (caller's clock).
//! A write completion with ENOSPC fails that write the same way.
//!
//! # Bounds
//!
//! Every queue is bounded by [`SsdConfig`]: reads accepted
//! (`max_inflight_reads`), engine operations (`max_inflight_io`, of which
//! writes get at most the part not reserved for reads, plus up to 4
//! fdatasyncs), accepted writes (`write_queue_depth`, each owning an aligned
//! copy of its payload, or for an in-place demotion a header block, at most
//! one tail block and its pool range, held until released) and the
//! seen-once set (`seen_once_capacity`).

mod blocking;
mod buf;
mod engine;
pub mod format;
mod meta;
mod scan;
mod store;
mod types;
mod uring;

pub use store::SsdStore;
pub use types::{
    BackendKind, DirectIo, EvictReason, Evictions, IoBackend, OpenScan, RecordInfo, Refusals,
    SsdConfig, SsdError, SsdStats, SyncPolicy, WriteAdmission, WriteDone, WriteError,
    WriteFailures, WriteRefused, WriteToken,
};
