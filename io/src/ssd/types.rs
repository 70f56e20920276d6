//! Public configuration, error, token and statistics types of the store.

use std::io;
use std::path::{Path, PathBuf};

use orbitkv_components::StateKey;
use serde::{Deserialize, Serialize};

/// Which I/O engine the store drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoBackend {
    /// io_uring when the ring can be set up, the blocking pool otherwise.
    #[default]
    Auto,
    /// io_uring or [`SsdError::RingSetup`].
    IoUring,
    /// `blocking_workers` threads doing pread/pwrite/fdatasync.
    Blocking,
}

/// The engine actually in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    IoUring,
    Blocking,
}

/// Which offered pages are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteAdmission {
    /// Every offer is written.
    #[default]
    All,
    /// Only a key offered for the second time is written; the first offer
    /// is refused with [`WriteRefused::AdmissionPolicy`] and remembered in
    /// a bounded "seen once" set (`seen_once_capacity`, oldest forgotten
    /// first).
    OnReuse,
}

/// When a completed write is made durable and visible. See the module docs
/// ("Durability") for the measurements behind the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncPolicy {
    /// Group commit: `poll` submits one `fdatasync` per segment for all
    /// writes completed since the last one; records are indexed (visible)
    /// and reported only when it succeeds.
    #[default]
    BatchFdatasync,
    /// Segment files opened `O_DSYNC`: every write is durable when it
    /// completes, and is published at once.
    Dsync,
    /// Published when the write completes: survives a process crash (the
    /// data is in the device or the page cache) but not a power loss.
    None,
}

/// Whether segment files are opened `O_DIRECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirectIo {
    /// `O_DIRECT` where the filesystem accepts it; buffered I/O (reported
    /// as `direct_io: false` in stats) where `open` gets `EINVAL`.
    #[default]
    Auto,
    /// `O_DIRECT` or [`SsdError::DirectIoUnsupported`].
    Require,
    /// Buffered I/O through the page cache.
    Off,
}

/// Bounds and policies of an [`SsdStore`](super::SsdStore).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SsdConfig {
    /// Directory of the segment files; created if missing.
    pub dir: PathBuf,
    /// Most bytes of segment files kept; whole segments are evicted
    /// oldest-first beyond it. At least two segments.
    pub capacity_bytes: u64,
    /// Size of one segment file, a multiple of 4096, at least 64 KiB.
    /// Also the largest record (header block + padded payload). Default
    /// 64 MiB.
    pub segment_bytes: u64,
    /// Reads accepted and not yet reported (`QueueFull` beyond). Default 64;
    /// the runtime additionally bounds reads per group.
    pub max_inflight_reads: usize,
    /// Data operations (reads and writes) handed to the engine at once.
    /// Writes use at most `max_inflight_io - min(max_inflight_reads,
    /// max_inflight_io / 2)` of them, so reads always find room. Default 128.
    pub max_inflight_io: usize,
    /// Writes accepted and not yet reported (queued, in flight or waiting
    /// for their sync); `WriteRefused::QueueFull` beyond. Each holds a copy
    /// of its payload, or (an in-place demotion) a header block, a tail
    /// block and its host-pool range. Default 256.
    pub write_queue_depth: usize,
    /// Worker threads of the blocking backend. Default 4.
    pub blocking_workers: usize,
    pub backend: IoBackend,
    pub admission: WriteAdmission,
    /// Keys remembered by [`WriteAdmission::OnReuse`]. Default 65536.
    pub seen_once_capacity: usize,
    pub sync: SyncPolicy,
    pub direct_io: DirectIo,
    /// Largest group of small records (padded payload at most 64 KiB)
    /// written together under one shared header block (format 3), the
    /// header block included. 0: every record gets a header block of its
    /// own (format 2, which releases from before groups read). Default
    /// 256 KiB; 0 or 16 KiB..=4 MiB.
    pub group_bytes: u64,
}

impl Default for SsdConfig {
    fn default() -> Self {
        SsdConfig {
            dir: PathBuf::from("/var/tmp/orbitkv-ssd"),
            capacity_bytes: 16 << 30,
            segment_bytes: 64 << 20,
            max_inflight_reads: 64,
            max_inflight_io: 128,
            write_queue_depth: 256,
            blocking_workers: 4,
            backend: IoBackend::Auto,
            admission: WriteAdmission::All,
            seen_once_capacity: 65536,
            sync: SyncPolicy::BatchFdatasync,
            direct_io: DirectIo::Auto,
            group_bytes: 256 << 10,
        }
    }
}

impl SsdConfig {
    /// The defaults with `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> SsdConfig {
        SsdConfig {
            dir: dir.into(),
            ..SsdConfig::default()
        }
    }

    /// Checks every bound; `open` calls it.
    pub fn validate(&self) -> Result<(), SsdError> {
        let bad = |why: String| Err(SsdError::InvalidConfig(why));
        if self.dir.as_os_str().is_empty() {
            return bad("dir is empty".into());
        }
        if self.segment_bytes < (64 << 10) || !self.segment_bytes.is_multiple_of(4096) {
            return bad(format!(
                "segment_bytes {} is not a multiple of 4096 of at least 64 KiB",
                self.segment_bytes
            ));
        }
        if self.capacity_bytes / self.segment_bytes < 2 {
            return bad(format!(
                "capacity_bytes {} holds fewer than two segments of {}",
                self.capacity_bytes, self.segment_bytes
            ));
        }
        for (name, v) in [
            ("max_inflight_reads", self.max_inflight_reads),
            ("max_inflight_io", self.max_inflight_io),
            ("write_queue_depth", self.write_queue_depth),
            ("blocking_workers", self.blocking_workers),
            ("seen_once_capacity", self.seen_once_capacity),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if self.max_inflight_io > 4096 {
            return bad("max_inflight_io exceeds 4096".into());
        }
        if self.group_bytes != 0 && !((16 << 10)..=(4 << 20)).contains(&self.group_bytes) {
            return bad(format!(
                "group_bytes {} is neither 0 (no groups) nor in 16 KiB..=4 MiB",
                self.group_bytes
            ));
        }
        Ok(())
    }
}

/// Why the store cannot be opened or a resource failed.
#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("invalid SSD store config: {0}")]
    InvalidConfig(String),
    #[error("{path}: not a directory (or a path component is not one)")]
    NotADirectory { path: PathBuf },
    #[error("{path}: read-only filesystem")]
    ReadOnly { path: PathBuf },
    #[error("{path}: permission denied")]
    PermissionDenied { path: PathBuf },
    #[error("{path}: no space left on device")]
    NoSpace { path: PathBuf },
    #[error("{path}: another SSD store holds the directory lock")]
    Locked { path: PathBuf },
    #[error("io_uring setup failed: {0}")]
    RingSetup(String),
    #[error("{path}: the filesystem refuses O_DIRECT")]
    DirectIoUnsupported { path: PathBuf },
    #[error("I/O buffer misaligned for O_DIRECT: {0}")]
    Misaligned(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl SsdError {
    /// Maps an OS error on `path` to the typed variants.
    pub(crate) fn from_io(op: &'static str, path: &Path, e: io::Error) -> SsdError {
        let path = path.to_path_buf();
        match e.raw_os_error() {
            Some(libc::ENOTDIR) => SsdError::NotADirectory { path },
            Some(libc::EROFS) => SsdError::ReadOnly { path },
            Some(libc::EACCES) | Some(libc::EPERM) => SsdError::PermissionDenied { path },
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => SsdError::NoSpace { path },
            _ => SsdError::Io {
                op,
                path,
                source: e,
            },
        }
    }
}

/// Names one accepted write until its [`WriteDone`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriteToken(pub u64);

/// Why `submit_write` did not accept a page. Every refusal is counted in
/// [`SsdStats::refusals`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WriteRefused {
    #[error("write queue is full")]
    QueueFull,
    #[error("first offer of this key (admission policy on_reuse)")]
    AdmissionPolicy,
    #[error("payload does not fit one segment")]
    TooLarge,
    #[error("empty payload")]
    Empty,
    #[error("key is stored or being written already")]
    Duplicate,
    #[error("no space left on the device (retrying shortly)")]
    NoSpace,
    #[error("segment files cannot be created (retrying shortly)")]
    Unavailable,
}

impl WriteRefused {
    /// A stable name for metrics and reports.
    pub fn reason(self) -> &'static str {
        match self {
            WriteRefused::QueueFull => "queue_full",
            WriteRefused::AdmissionPolicy => "admission_policy",
            WriteRefused::TooLarge => "too_large",
            WriteRefused::Empty => "empty",
            WriteRefused::Duplicate => "duplicate",
            WriteRefused::NoSpace => "no_space",
            WriteRefused::Unavailable => "unavailable",
        }
    }
}

impl From<WriteRefused> for crate::tier::DemoteRefused {
    fn from(r: WriteRefused) -> Self {
        use crate::tier::DemoteRefused as D;
        match r {
            WriteRefused::QueueFull => D::QueueFull,
            WriteRefused::AdmissionPolicy => D::AdmissionPolicy,
            WriteRefused::TooLarge => D::TooLarge,
            WriteRefused::Empty => D::Empty,
            WriteRefused::Duplicate => D::Duplicate,
            WriteRefused::NoSpace => D::NoSpace,
            WriteRefused::Unavailable => D::Unavailable,
        }
    }
}

impl From<WriteError> for crate::tier::DemoteFailed {
    fn from(e: WriteError) -> Self {
        use crate::tier::DemoteFailed as D;
        match e {
            WriteError::NoSpace => D::NoSpace,
            WriteError::Unavailable(why) => D::Unavailable(why),
            e @ (WriteError::Io(_)
            | WriteError::Short { .. }
            | WriteError::Sync(_)
            | WriteError::Misaligned(_)) => D::Io(e.to_string()),
        }
    }
}

/// Why an accepted write failed. Counted in [`SsdStats::write_failures`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    #[error("no space left on device")]
    NoSpace,
    #[error("write failed: {0}")]
    Io(String),
    #[error("short write: {written} of {expected} bytes")]
    Short { written: u64, expected: u64 },
    #[error("fdatasync failed: {0}")]
    Sync(String),
    #[error("internal: {0}")]
    Misaligned(String),
    #[error("segment file could not be created: {0}")]
    Unavailable(String),
}

/// A finished write: visible to `lookup` (and durable per the sync
/// policy) when `result` is `Ok`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteDone {
    pub token: WriteToken,
    pub key: StateKey,
    pub result: Result<(), WriteError>,
}

/// Where and what one indexed record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordInfo {
    pub segment_id: u64,
    /// Offset of the record's header block in the segment file.
    pub offset: u64,
    pub payload_len: u64,
    pub checksum: u64,
    pub sequence: u64,
    pub format_digest: [u8; 32],
    pub written_us: u64,
    /// The record's block: its header block's size and the payload's
    /// padding unit.
    pub block: u64,
    /// Where the payload starts: `offset + block` for a record with a
    /// header block of its own; inside its group for a grouped record.
    pub payload_offset: u64,
    /// Whether the record was written in a group, its header one entry of
    /// the header block at `offset` shared with the group's other records.
    pub grouped: bool,
}

/// Refusals by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Refusals {
    pub queue_full: u64,
    pub admission_policy: u64,
    pub too_large: u64,
    pub empty: u64,
    pub duplicate: u64,
    pub no_space: u64,
    pub unavailable: u64,
}

impl Refusals {
    pub fn get(&self, r: WriteRefused) -> u64 {
        match r {
            WriteRefused::QueueFull => self.queue_full,
            WriteRefused::AdmissionPolicy => self.admission_policy,
            WriteRefused::TooLarge => self.too_large,
            WriteRefused::Empty => self.empty,
            WriteRefused::Duplicate => self.duplicate,
            WriteRefused::NoSpace => self.no_space,
            WriteRefused::Unavailable => self.unavailable,
        }
    }

    pub(crate) fn bump(&mut self, r: WriteRefused) {
        let c = match r {
            WriteRefused::QueueFull => &mut self.queue_full,
            WriteRefused::AdmissionPolicy => &mut self.admission_policy,
            WriteRefused::TooLarge => &mut self.too_large,
            WriteRefused::Empty => &mut self.empty,
            WriteRefused::Duplicate => &mut self.duplicate,
            WriteRefused::NoSpace => &mut self.no_space,
            WriteRefused::Unavailable => &mut self.unavailable,
        };
        *c += 1;
    }

    pub fn total(&self) -> u64 {
        self.queue_full
            + self.admission_policy
            + self.too_large
            + self.empty
            + self.duplicate
            + self.no_space
            + self.unavailable
    }
}

/// Failed writes by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WriteFailures {
    pub no_space: u64,
    pub io: u64,
    pub short: u64,
    pub sync: u64,
    pub misaligned: u64,
    pub unavailable: u64,
}

impl WriteFailures {
    pub(crate) fn bump(&mut self, e: &WriteError) {
        let c = match e {
            WriteError::NoSpace => &mut self.no_space,
            WriteError::Io(_) => &mut self.io,
            WriteError::Short { .. } => &mut self.short,
            WriteError::Sync(_) => &mut self.sync,
            WriteError::Misaligned(_) => &mut self.misaligned,
            WriteError::Unavailable(_) => &mut self.unavailable,
        };
        *c += 1;
    }

    pub fn total(&self) -> u64 {
        self.no_space + self.io + self.short + self.sync + self.misaligned + self.unavailable
    }
}

/// Why records left the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictReason {
    /// FIFO segment eviction to stay within `capacity_bytes`.
    Capacity,
    /// The record failed verification on read.
    Corrupt,
    /// The filesystem ran out of space: the oldest segment was dropped.
    NoSpace,
}

/// Records evicted by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Evictions {
    pub capacity: u64,
    pub corrupt: u64,
    pub no_space: u64,
}

impl Evictions {
    pub fn get(&self, r: EvictReason) -> u64 {
        match r {
            EvictReason::Capacity => self.capacity,
            EvictReason::Corrupt => self.corrupt,
            EvictReason::NoSpace => self.no_space,
        }
    }

    pub(crate) fn add(&mut self, r: EvictReason, n: u64) {
        match r {
            EvictReason::Capacity => self.capacity += n,
            EvictReason::Corrupt => self.corrupt += n,
            EvictReason::NoSpace => self.no_space += n,
        }
    }
}

/// What `open` found on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OpenScan {
    /// Segment files read.
    pub segments: u64,
    /// Valid records indexed.
    pub records: u64,
    /// Of those, records in the version-1 layout (4 KiB blocks), read as
    /// written.
    pub v1_records: u64,
    /// Segments opened without O_DIRECT because they hold records whose
    /// block is smaller than this device's direct-I/O alignment (written
    /// on another device).
    pub buffered_segments: u64,
    /// Torn, partial or corrupt records (or unparseable regions) skipped.
    pub corrupt_skipped: u64,
    /// Older copies of a key superseded by a newer record.
    pub duplicates: u64,
    /// Segment files without a valid record, removed.
    pub empty_segments_removed: u64,
    /// Segment files that could not be read (left on disk, not indexed).
    pub unreadable_segments: u64,
    /// Segment files longer, or with more allocated bytes, than
    /// `capacity_bytes`: not written by this tier, refused unread (left
    /// on disk, with a warning).
    pub oversized_segments: u64,
    /// Segments evicted at open because they exceeded `capacity_bytes`.
    pub evicted_segments: u64,
    /// Entries named like segment files that are not ours to read: not a
    /// regular file (a FIFO, device, directory or symlink), or an id past
    /// the largest the store uses. Left alone, with a warning.
    pub skipped_files: u64,
    pub bytes_read: u64,
}

/// Counters and occupancy of the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SsdStats {
    pub backend: BackendKind,
    /// Whether segment files are open `O_DIRECT`.
    pub direct_io: bool,
    /// Record block of new records (the directory's direct-I/O alignment,
    /// 512..=4096): header block size, record alignment, padding unit.
    pub block_bytes: u64,
    pub sync: SyncPolicy,
    /// Indexed (visible) records and their payload bytes.
    pub records: u64,
    pub bytes: u64,
    /// Segment files held and their bytes (preallocated size).
    pub segments: u64,
    pub disk_bytes: u64,
    pub capacity_bytes: u64,
    pub reads_submitted: u64,
    /// Reads that delivered verified bytes.
    pub reads_completed: u64,
    /// Reads that failed with an I/O error.
    pub reads_failed: u64,
    /// Reads that failed verification (reported as `TierError::Corrupt`).
    pub reads_corrupt: u64,
    pub reads_in_flight: u64,
    pub writes_accepted: u64,
    /// Of those, demotions written straight from the host pool.
    pub writes_in_place: u64,
    /// Records written as part of a group (one header block shared by
    /// several small records), as opposed to a record with its own.
    pub grouped_writes: u64,
    /// In-place demotions whose pool range the store still needs (or whose
    /// release `poll_released` has not handed out yet).
    pub demotions_holding: u64,
    /// Writes that became visible.
    pub writes_completed: u64,
    pub write_failures: WriteFailures,
    /// Accepted writes not yet reported.
    pub writes_pending: u64,
    /// `fdatasync` calls completed.
    pub syncs: u64,
    pub refusals: Refusals,
    pub open_scan: OpenScan,
    /// Records evicted, by reason.
    pub evictions: Evictions,
    pub segments_evicted: u64,
    /// Evicted segment files whose unlink failed (left on disk; the next
    /// open rescans them).
    pub segment_delete_failures: u64,
    /// Keys in the `on_reuse` seen-once set.
    pub seen_once: u64,
    /// The last verification failure, for operators.
    pub last_corruption: Option<String>,
}
