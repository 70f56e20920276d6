//! [`SsdStore`]: index, segments, the write queue and completion handling.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use orbitkv_components::StateKey;

use super::blocking::BlockingEngine;
use super::buf::{AlignedBuf, BufPool};
use super::engine::{Completion, Engine, Request};
use super::format::{
    FORMAT_GROUP, FORMAT_V1, GroupPos, MAX_BLOCK, MIN_BLOCK, RecordHeader, group_capacity,
    record_bytes, round_up, valid_block,
};
use super::meta::{
    self, MAX_SEGMENT_ID, Meta, MetaDone, MetaReq, parse_segment_name, segment_name,
};
use super::scan::{ScanRefused, open_regular, scan_segment};
use super::types::*;
use super::uring::UringEngine;
use crate::checksum::page_checksum;
use crate::tier::{
    BackingTier, DemoteFailed, DemoteRefused, DemoteToken, Demoted, ReadDone, ReadToken, TierEntry,
    TierError,
};

/// Fdatasync operations in flight at once (one per segment at most).
const MAX_SYNCS: usize = 4;
/// After a segment could not be created, new writes are refused for this
/// long (by the caller's clock) before creation is tried again.
const CREATE_BACKOFF_US: u64 = 1_000_000;
/// `submit_*` hand queued io_uring operations to the kernel once this many
/// have gathered; `poll` hands over the rest (one io_uring_enter per poll).
const FLUSH_BATCH: usize = 16;
/// Idle aligned buffers kept for reuse.
const BUF_POOL_BYTES: usize = 64 << 20;
/// Queued records whose padded payload is at most this many bytes are
/// written in groups (one header block for several records, at most
/// `SsdConfig::group_bytes`); for larger ones a header block of their own
/// costs at most 6%. (The default group size, 256 KiB, was measured
/// against 1 MiB on the development VM: smaller groups keep more writes in
/// flight and wrote 64 KiB pages faster.)
const GROUP_MAX_PAYLOAD: u64 = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IndexEntry {
    segment: u64,
    offset: u64,
    payload_len: u64,
    checksum: u64,
    sequence: u64,
    digest: [u8; 32],
    written_us: u64,
    /// The record's block (header block size, payload padding unit).
    block: u64,
    /// Where the payload starts in the segment.
    payload_offset: u64,
    /// A record of a group: its header is one entry of the group's header
    /// block, and a read fetches the payload alone.
    grouped: bool,
}

impl IndexEntry {
    fn from_header(h: &RecordHeader) -> IndexEntry {
        IndexEntry {
            segment: h.segment_id,
            offset: h.record_offset,
            payload_offset: h.payload_offset(),
            grouped: h.group.is_some(),
            payload_len: h.payload_len,
            checksum: h.payload_checksum,
            sequence: h.sequence,
            digest: h.format_digest,
            written_us: h.written_us,
            block: h.block,
        }
    }

    /// Bytes a read of this record fetches from `read_offset`: header
    /// block and padded payload, or (grouped) the padded payload.
    fn record_bytes(&self) -> u64 {
        if self.grouped {
            round_up(self.payload_len, self.block)
        } else {
            record_bytes(self.payload_len, self.block)
        }
    }

    /// Where a read of this record starts.
    fn read_offset(&self) -> u64 {
        if self.grouped {
            self.payload_offset
        } else {
            self.offset
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegState {
    /// Created ahead of need, not written yet.
    Spare,
    /// Receiving writes.
    Active,
    /// Never written again.
    Sealed,
}

struct Segment {
    file: File,
    size: u64,
    write_pos: u64,
    state: SegState,
    /// Keys indexed into this segment (entries may since point elsewhere).
    keys: Vec<StateKey>,
    /// Reads, writes and syncs in flight against this file: it is neither
    /// closed nor evicted while non-zero (reads pin segments).
    ops: u32,
    /// Writes completed and waiting for the next fdatasync.
    unsynced: Vec<Written>,
    syncing: bool,
}

/// A write that reached the device and waits to be published.
struct Written {
    token: WriteToken,
    key: StateKey,
    entry: IndexEntry,
}

struct QueuedWrite {
    token: WriteToken,
    key: StateKey,
    digest: [u8; 32],
    payload_len: u64,
    checksum: u64,
    written_us: u64,
    src: WriteSrc,
}

impl QueuedWrite {
    /// The record's header once placed: at `offset` of segment `segment`,
    /// alone or (`group`) as an entry of a group's header block there.
    fn header(
        &self,
        segment: u64,
        offset: u64,
        sequence: u64,
        block: u64,
        group: Option<GroupPos>,
    ) -> RecordHeader {
        RecordHeader {
            segment_id: segment,
            record_offset: offset,
            sequence,
            key: self.key,
            format_digest: self.digest,
            payload_len: self.payload_len,
            payload_checksum: self.checksum,
            written_us: self.written_us,
            block,
            version: if group.is_some() {
                FORMAT_GROUP
            } else {
                super::format::FORMAT_VERSION
            },
            group,
        }
    }
}

/// Where a queued record's bytes come from.
enum WriteSrc {
    /// A store-owned copy: the header block (filled at dispatch), then the
    /// payload zero-padded to whole blocks.
    Copy(AlignedBuf),
    /// An in-place demotion: written from the host pool.
    InPlace(InPlaceWrite),
}

/// One record written as `[header block, pool range, tail block]` by one
/// `pwritev`: the pool range is the payload's whole blocks (possibly
/// none), the tail block a zero-padded copy of the last `len % block`
/// bytes (absent when the length is a multiple of the block).
struct InPlaceWrite {
    token: DemoteToken,
    header: AlignedBuf,
    body: PoolRange,
    tail: Option<AlignedBuf>,
    iov: Iovecs<3>,
}

/// A range of the registered host pool.
struct PoolRange(*const u8, usize);
// SAFETY: an address in the registered pool, read only by the engine,
// under `register_host_pool`'s contract (unchanged until released).
unsafe impl Send for PoolRange {}

enum ReadDest {
    /// Header into `header`, payload straight into the pool slot.
    Direct { header: AlignedBuf },
    /// A record of a group: its payload alone, straight into the pool slot.
    Payload,
    /// The whole record into a store buffer, payload copied on success
    /// (pool range not 4 KiB aligned, or too short for the padded tail).
    Bounce { buf: AlignedBuf },
}

struct ReadOp {
    token: ReadToken,
    key: StateKey,
    entry: IndexEntry,
    host_offset: u64,
    dest: ReadDest,
    iov: Iovecs<2>,
    iovcnt: u32,
    expect: usize,
}

/// The iovecs of one read or in-place write; boxed so their address is
/// stable while the kernel or a worker uses them.
struct Iovecs<const N: usize>(Box<[libc::iovec; N]>);
// SAFETY: plain addresses of buffers owned by the same op (or of the
// registered pool); only the engine dereferences them, under its contract.
unsafe impl<const N: usize> Send for Iovecs<N> {}

const NO_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

/// The iovecs of a group write (header block, then each record's parts).
struct IovecList(Box<[libc::iovec]>);
// SAFETY: as `Iovecs`.
unsafe impl Send for IovecList {}

/// Records written as one group by one `pwritev`.
struct GroupWrite {
    writes: Vec<(QueuedWrite, IndexEntry)>,
    segment: u64,
    header: AlignedBuf,
    /// Kept alive (and unmoved) while the kernel reads it.
    _iov: IovecList,
    bytes: u64,
}

enum Op {
    Read(ReadOp),
    Write {
        w: QueuedWrite,
        segment: u64,
        entry: IndexEntry,
    },
    Group(GroupWrite),
    Sync {
        segment: u64,
        batch: Vec<Written>,
    },
}

struct PoolPtr(*mut u8, u64);
// SAFETY: only dereferenced under `register_host_pool`'s contract, by the
// owner of the store.
unsafe impl Send for PoolPtr {}

/// Bounded "seen once" set of [`WriteAdmission::OnReuse`].
struct SeenOnce {
    map: orbitkv_components::KeyMap<u64>,
    order: VecDeque<(StateKey, u64)>,
    next: u64,
    cap: usize,
}

impl SeenOnce {
    fn new(cap: usize) -> SeenOnce {
        SeenOnce {
            map: Default::default(),
            order: VecDeque::new(),
            next: 0,
            cap,
        }
    }

    /// `true` if `key` was offered before (and forgets it); otherwise
    /// remembers it, forgetting the oldest beyond `cap`.
    fn offer(&mut self, key: &StateKey) -> bool {
        if self.map.remove(key).is_some() {
            return true;
        }
        let g = self.next;
        self.next += 1;
        self.map.insert(*key, g);
        self.order.push_back((*key, g));
        while self.order.len() > self.cap {
            if let Some((k, g)) = self.order.pop_front()
                && self.map.get(&k) == Some(&g)
            {
                self.map.remove(&k);
            }
        }
        false
    }
}

fn strerror(errno: i32) -> String {
    std::io::Error::from_raw_os_error(errno).to_string()
}

/// What `list_segments` found.
struct Listing {
    /// Segment files to scan, ascending.
    ids: Vec<u64>,
    /// Entries named like segments that were skipped (with a warning):
    /// anything but a regular file, and ids past [`MAX_SEGMENT_ID`].
    skipped: u64,
    /// The first id no entry uses (skipped ones included, so a new segment
    /// never collides with a name that is taken).
    next_id: u64,
}

fn list_segments(dir: &Path) -> Result<Listing, SsdError> {
    let mut ids = Vec::new();
    let mut skipped = 0;
    let mut next_id = 0;
    let entries = std::fs::read_dir(dir).map_err(|e| SsdError::from_io("list", dir, e))?;
    for ent in entries {
        let ent = ent.map_err(|e| SsdError::from_io("list", dir, e))?;
        let Some(id) = ent.file_name().to_str().and_then(parse_segment_name) else {
            continue;
        };
        if id <= MAX_SEGMENT_ID {
            next_id = next_id.max(id + 1);
        }
        // `file_type` does not follow symlinks.
        let regular = ent.file_type().is_ok_and(|t| t.is_file());
        if !regular || id > MAX_SEGMENT_ID {
            let why = if regular {
                "its id is past the largest this store uses"
            } else {
                "it is not a regular file"
            };
            tracing::warn!(path = %ent.path().display(), "skipping an entry named like an SSD segment: {why}");
            skipped += 1;
            continue;
        }
        ids.push(id);
    }
    ids.sort_unstable();
    Ok(Listing {
        ids,
        skipped,
        next_id,
    })
}

/// The SSD tier. See the [module docs](super) for layout and policies.
pub struct SsdStore {
    cfg: SsdConfig,
    _lock: File,
    engine: Box<dyn Engine>,
    meta: Meta,
    direct: bool,
    /// Block of new records: the directory's direct-I/O offset alignment
    /// (512..=4096).
    block: u64,
    /// Direct-I/O memory alignment: in-place sources must start on it (and
    /// on `block`).
    mem_align: u64,
    /// Open flags of new segment files (O_DIRECT, O_DSYNC).
    create_flags: i32,
    index: orbitkv_components::KeyMap<IndexEntry>,
    /// Changes of `index` for the manager's KV events (off unless asked);
    /// `index_insert` and `index_remove` are the only ways it changes.
    journal: crate::tier::TierJournal,
    indexed_bytes: u64,
    segments: BTreeMap<u64, Segment>,
    active: Option<u64>,
    spare: Option<u64>,
    creating: bool,
    next_segment: u64,
    next_seq: u64,
    next_user: u64,
    next_read: u64,
    next_write: u64,
    ops: HashMap<u64, Op>,
    read_queue: VecDeque<u64>,
    reads_in_flight: usize,
    write_queue: VecDeque<QueuedWrite>,
    write_io_limit: usize,
    writes_in_io: usize,
    syncs_in_io: usize,
    dirty: BTreeSet<u64>,
    accepted_writes: usize,
    pending_keys: HashSet<StateKey, orbitkv_components::KeyHasher>,
    seen: SeenOnce,
    pool: Option<PoolPtr>,
    next_demote: u64,
    /// In-place demotions released (write finished or never to be issued)
    /// and not yet handed out by `poll_released`.
    released: Vec<DemoteToken>,
    /// In-place demotions accepted and not yet handed out by
    /// `poll_released`.
    holding: usize,
    /// Fault injection: the next this many writes are issued against an
    /// invalid fd (they fail with EBADF).
    fail_writes: u32,
    bufs: BufPool,
    done_reads: Vec<ReadDone>,
    done_writes: Vec<WriteDone>,
    scratch: Vec<Completion>,
    /// New writes are refused with this reason until this time.
    backoff: Option<(u64, WriteRefused)>,
    now_us: u64,
    stats: SsdStats,
    /// Being dropped: queued writes go only where the active segment has
    /// room (no segment is sealed, requested or evicted for them).
    dropping: bool,
}

impl std::fmt::Debug for SsdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdStore")
            .field("dir", &self.cfg.dir)
            .field("backend", &self.engine.kind())
            .field("direct_io", &self.direct)
            .field("records", &self.index.len())
            .field("segments", &self.segments.len())
            .finish_non_exhaustive()
    }
}

impl SsdStore {
    /// Opens (creating if needed) the store in `cfg.dir`: takes the
    /// directory lock, creates the first new segment (which proves the
    /// directory writable and probes O_DIRECT), scans every existing
    /// segment into the index and evicts beyond capacity. Blocks (it is not
    /// called inside a tick).
    pub fn open(cfg: SsdConfig) -> Result<SsdStore, SsdError> {
        cfg.validate()?;
        let dir = cfg.dir.clone();
        match std::fs::metadata(&dir) {
            Ok(m) if !m.is_dir() => return Err(SsdError::NotADirectory { path: dir }),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(&dir).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        SsdError::NotADirectory { path: dir.clone() }
                    } else {
                        SsdError::from_io("create directory", &dir, e)
                    }
                })?;
                // The new entry (and its parents') must survive a crash too.
                if let Some(parent) = dir.parent() {
                    let _ = meta::sync_dir(parent);
                }
            }
            Err(e) => return Err(SsdError::from_io("stat", &dir, e)),
        }
        let lock = lock_dir(&dir)?;
        // The LOCK file is a regular file of the directory's filesystem.
        let (block, mem_align) = dio_alignment(&lock);
        assert!(valid_block(block), "ssd: record block {block} out of range");

        let Listing {
            ids,
            skipped: skipped_files,
            next_id: first,
        } = list_segments(&dir)?;

        let engine_cap = cfg.max_inflight_io + MAX_SYNCS;
        let engine: Box<dyn Engine> = match cfg.backend {
            IoBackend::Blocking => Box::new(blocking(&cfg, engine_cap)?),
            IoBackend::IoUring => Box::new(
                UringEngine::new(engine_cap).map_err(|e| SsdError::RingSetup(e.to_string()))?,
            ),
            IoBackend::Auto => match UringEngine::new(engine_cap) {
                Ok(u) => Box::new(u),
                Err(_) => Box::new(blocking(&cfg, engine_cap)?),
            },
        };

        let dsync = if cfg.sync == SyncPolicy::Dsync {
            libc::O_DSYNC
        } else {
            0
        };
        let mut direct = cfg.direct_io != DirectIo::Off;
        let mut first_seg = None;
        let mut backoff = None;
        let first_file = loop {
            let flags = dsync | if direct { libc::O_DIRECT } else { 0 };
            match meta::create_segment(&dir, first, cfg.segment_bytes, flags) {
                Ok(f) => break Some(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && direct => {
                    if cfg.direct_io == DirectIo::Require {
                        return Err(SsdError::DirectIoUnsupported { path: dir });
                    }
                    direct = false;
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                    // Existing pages stay readable; writes are refused until
                    // a segment can be created.
                    backoff = Some((CREATE_BACKOFF_US, WriteRefused::NoSpace));
                    break None;
                }
                Err(e) => return Err(SsdError::from_io("create segment", &dir, e)),
            }
        };
        let create_flags = dsync | if direct { libc::O_DIRECT } else { 0 };
        if let Some(file) = first_file {
            first_seg = Some((
                first,
                Segment {
                    file,
                    size: cfg.segment_bytes,
                    write_pos: 0,
                    state: SegState::Active,
                    keys: Vec::new(),
                    ops: 0,
                    unsynced: Vec::new(),
                    syncing: false,
                },
            ));
        }

        let meta = Meta::spawn(dir.clone()).map_err(|e| SsdError::from_io("spawn", &dir, e))?;
        let write_io_limit = cfg
            .max_inflight_io
            .saturating_sub(cfg.max_inflight_reads.min(cfg.max_inflight_io / 2))
            .max(1);
        let stats = SsdStats {
            backend: engine.kind(),
            direct_io: direct,
            block_bytes: block,
            writes_in_place: 0,
            grouped_writes: 0,
            demotions_holding: 0,
            sync: cfg.sync,
            records: 0,
            bytes: 0,
            segments: 0,
            disk_bytes: 0,
            capacity_bytes: cfg.capacity_bytes,
            reads_submitted: 0,
            reads_completed: 0,
            reads_failed: 0,
            reads_corrupt: 0,
            reads_in_flight: 0,
            writes_accepted: 0,
            writes_completed: 0,
            write_failures: WriteFailures::default(),
            writes_pending: 0,
            syncs: 0,
            refusals: Refusals::default(),
            open_scan: OpenScan::default(),
            evictions: Evictions::default(),
            segments_evicted: 0,
            segment_delete_failures: 0,
            seen_once: 0,
            last_corruption: None,
        };
        let mut store = SsdStore {
            seen: SeenOnce::new(cfg.seen_once_capacity),
            cfg,
            _lock: lock,
            engine,
            meta,
            direct,
            block,
            mem_align,
            create_flags,
            index: Default::default(),
            journal: Default::default(),
            indexed_bytes: 0,
            segments: BTreeMap::new(),
            active: None,
            spare: None,
            creating: false,
            dropping: false,
            next_segment: first + 1,
            next_seq: 0,
            next_user: 0,
            next_read: 0,
            next_write: 0,
            ops: HashMap::new(),
            read_queue: VecDeque::new(),
            reads_in_flight: 0,
            write_queue: VecDeque::new(),
            write_io_limit,
            writes_in_io: 0,
            syncs_in_io: 0,
            dirty: BTreeSet::new(),
            accepted_writes: 0,
            pending_keys: Default::default(),
            pool: None,
            next_demote: 0,
            released: Vec::new(),
            holding: 0,
            fail_writes: 0,
            bufs: BufPool::new(BUF_POOL_BYTES),
            done_reads: Vec::new(),
            done_writes: Vec::new(),
            scratch: Vec::new(),
            backoff,
            now_us: 0,
            stats,
        };
        for id in ids {
            store.load_segment(id);
        }
        if let Some((id, seg)) = first_seg {
            store.segments.insert(id, seg);
            store.active = Some(id);
        }
        store.stats.open_scan.skipped_files = skipped_files;
        // Over capacity (a smaller capacity or larger segments than last
        // time): oldest first.
        while store.disk_bytes() > store.cfg.capacity_bytes {
            if !store.evict_oldest(EvictReason::Capacity) {
                break;
            }
            store.stats.open_scan.evicted_segments += 1;
        }
        Ok(store)
    }

    /// Bytes of every segment file held (their preallocated sizes).
    fn disk_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.size).sum()
    }

    /// Whether one more segment of the configured size fits the capacity,
    /// counted in bytes: segments written under another `segment_bytes`
    /// count at their own size.
    fn room_for_segment(&self) -> bool {
        self.disk_bytes() + self.cfg.segment_bytes <= self.cfg.capacity_bytes
    }

    /// Scans segment `id` and indexes its valid records.
    fn load_segment(&mut self, id: u64) {
        let path = self.segment_path(id);
        // No segment this tier wrote is larger than the tier itself.
        let scan = match scan_segment(&path, id, self.cfg.capacity_bytes) {
            Ok(s) => s,
            Err(ScanRefused::Oversized { len, allocated }) => {
                tracing::warn!(
                    path = %path.display(),
                    len,
                    allocated,
                    capacity_bytes = self.cfg.capacity_bytes,
                    "skipping a segment file larger than the SSD tier's capacity: not one this \
                     tier wrote (left on disk, not read)"
                );
                self.stats.open_scan.oversized_segments += 1;
                return;
            }
            Err(ScanRefused::Io(e)) => {
                tracing::warn!(path = %path.display(), error = %e, "an SSD segment file could not be read (left on disk)");
                self.stats.open_scan.unreadable_segments += 1;
                return;
            }
        };
        let os = &mut self.stats.open_scan;
        os.segments += 1;
        os.corrupt_skipped += scan.corrupt;
        os.bytes_read += scan.bytes_read;
        if scan.records.is_empty() {
            if std::fs::remove_file(&path).is_ok() {
                os.empty_segments_removed += 1;
            } else {
                os.unreadable_segments += 1;
            }
            return;
        }
        // Records of a smaller block than this device's direct-I/O
        // alignment (written on another device) cannot be read O_DIRECT:
        // such a segment is read through the page cache.
        let direct = self.direct && scan.records.iter().all(|h| h.block >= self.block);
        if self.direct && !direct {
            tracing::warn!(path = %path.display(), block = self.block, "segment holds records of a smaller block than the direct-I/O alignment: reading it buffered");
            self.stats.open_scan.buffered_segments += 1;
        }
        let flags = if direct { libc::O_DIRECT } else { 0 };
        let file = match open_regular(&path, flags) {
            Ok(f) => f,
            Err(_) => {
                self.stats.open_scan.unreadable_segments += 1;
                return;
            }
        };
        let mut keys = Vec::with_capacity(scan.records.len());
        for h in &scan.records {
            self.next_seq = self.next_seq.max(h.sequence + 1);
            let entry = IndexEntry::from_header(h);
            match self.index.get(&h.key) {
                Some(old) if old.sequence >= entry.sequence => {
                    self.stats.open_scan.duplicates += 1;
                    continue;
                }
                Some(_) => {
                    self.stats.open_scan.duplicates += 1;
                    self.index_remove(&h.key);
                }
                None => {}
            }
            self.index_insert(h.key, entry);
            self.stats.open_scan.records += 1;
            if h.version == FORMAT_V1 {
                self.stats.open_scan.v1_records += 1;
            }
            keys.push(h.key);
        }
        self.segments.insert(
            id,
            Segment {
                file,
                size: scan.file_len,
                write_pos: scan.file_len,
                state: SegState::Sealed,
                keys,
                ops: 0,
                unsynced: Vec::new(),
                syncing: false,
            },
        );
    }

    /// Path of segment file `id`.
    pub fn segment_path(&self, id: u64) -> PathBuf {
        self.cfg.dir.join(segment_name(id))
    }

    pub fn config(&self) -> &SsdConfig {
        &self.cfg
    }

    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    pub fn backend(&self) -> BackendKind {
        self.engine.kind()
    }

    /// Whether segment files are open `O_DIRECT`.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Every visible key (unordered).
    pub fn keys(&self) -> Vec<StateKey> {
        self.index.keys().copied().collect()
    }

    /// Where a visible record is, and its header fields.
    pub fn record_info(&self, key: &StateKey) -> Option<RecordInfo> {
        self.index.get(key).map(|e| RecordInfo {
            segment_id: e.segment,
            offset: e.offset,
            payload_len: e.payload_len,
            checksum: e.checksum,
            sequence: e.sequence,
            format_digest: e.digest,
            written_us: e.written_us,
            block: e.block,
            payload_offset: e.payload_offset,
            grouped: e.grouped,
        })
    }

    /// Block of new records (header block size, record alignment and
    /// payload padding unit): the directory's direct-I/O alignment.
    pub fn block_bytes(&self) -> u64 {
        self.block
    }

    /// Fault injection for tests and tools: the next `n` writes
    /// dispatched (a record, or a group of records written together) are
    /// issued against an invalid file descriptor, so the engine completes
    /// them with `EBADF` (every record of it fails, reported as
    /// [`WriteError::Io`]; an in-place demotion's token is released).
    #[doc(hidden)]
    pub fn fail_next_writes(&mut self, n: u32) {
        self.fail_writes = n;
    }

    /// Accepted writes not yet reported.
    pub fn writes_pending(&self) -> usize {
        self.accepted_writes
    }

    pub fn stats(&self) -> SsdStats {
        let mut s = self.stats.clone();
        s.records = self.index.len() as u64;
        s.bytes = self.indexed_bytes;
        s.segments = self.segments.len() as u64;
        s.disk_bytes = self.disk_bytes();
        s.reads_in_flight = self.reads_in_flight as u64;
        s.writes_pending = self.accepted_writes as u64;
        s.demotions_holding = self.holding as u64;
        s.seen_once = self.seen.map.len() as u64;
        s
    }

    fn index_insert(&mut self, key: StateKey, e: IndexEntry) {
        self.indexed_bytes += e.payload_len;
        match self.index.insert(key, e) {
            Some(old) => self.indexed_bytes -= old.payload_len,
            None => self.journal.push(crate::tier::TierChange::Stored(key)),
        }
    }

    fn index_remove(&mut self, key: &StateKey) -> Option<IndexEntry> {
        let old = self.index.remove(key)?;
        self.indexed_bytes -= old.payload_len;
        self.journal.push(crate::tier::TierChange::Removed(*key));
        Some(old)
    }

    /// Copies `payload` into a store-owned aligned buffer and queues it;
    /// the caller may reuse its memory at once. The record's checksum is
    /// computed over the copy. Never blocks. The page becomes visible to
    /// `lookup` when its [`WriteDone`] is reported by
    /// [`poll_writes`](Self::poll_writes).
    pub fn submit_write(
        &mut self,
        key: &StateKey,
        format_digest: [u8; 32],
        payload: &[u8],
        now_us: u64,
    ) -> Result<WriteToken, WriteRefused> {
        self.submit_copy(key, format_digest, payload, None, now_us)
    }

    /// [`submit_write`](Self::submit_write) of bytes whose checksum is
    /// already known (computed once, when they landed in DRAM): the header
    /// records `checksum` and nothing is hashed. Bytes that changed since
    /// are stored as they are now and refused when read
    /// ([`TierError::Corrupt`]), never served under a fresh checksum.
    pub fn submit_write_with_checksum(
        &mut self,
        key: &StateKey,
        format_digest: [u8; 32],
        payload: &[u8],
        checksum: u64,
        now_us: u64,
    ) -> Result<WriteToken, WriteRefused> {
        self.submit_copy(key, format_digest, payload, Some(checksum), now_us)
    }

    fn submit_copy(
        &mut self,
        key: &StateKey,
        format_digest: [u8; 32],
        payload: &[u8],
        known: Option<u64>,
        now_us: u64,
    ) -> Result<WriteToken, WriteRefused> {
        self.admit(key, payload, now_us)?;
        let len = payload.len();
        let rec = record_bytes(len as u64, self.block) as usize;
        let Some(mut buf) = self.bufs.get(rec) else {
            // The allocator refused: treat as a full queue (back-pressure).
            self.stats.refusals.bump(WriteRefused::QueueFull);
            return Err(WriteRefused::QueueFull);
        };
        let h = self.block as usize;
        let body = &mut buf.as_mut_slice()[..rec];
        body[..h].fill(0);
        body[h..h + len].copy_from_slice(payload);
        body[h + len..].fill(0);
        let checksum = known.unwrap_or_else(|| page_checksum(&body[h..h + len]));
        Ok(self.enqueue(
            key,
            format_digest,
            len as u64,
            checksum,
            WriteSrc::Copy(buf),
        ))
    }

    /// Whether `payload` can be written in place: it lies entirely inside
    /// the registered host pool and (under O_DIRECT) starts on the block
    /// and the direct-I/O memory alignment. Its length may be anything: a
    /// partial last block goes through a small tail buffer.
    fn in_place_ok(&self, payload: &[u8]) -> bool {
        let Some(pool) = &self.pool else {
            return false;
        };
        let (p, base) = (payload.as_ptr() as usize, pool.0 as usize);
        let inside = p >= base
            && ((p - base) as u64)
                .checked_add(payload.len() as u64)
                .is_some_and(|end| end <= pool.1);
        let align = self.block.max(self.mem_align) as usize;
        inside && (!self.direct || p.is_multiple_of(align))
    }

    /// Queues an in-place demotion of `payload` (which `in_place_ok`
    /// accepted): nothing is hashed or copied but the partial last block.
    fn submit_in_place(
        &mut self,
        key: &StateKey,
        format_digest: [u8; 32],
        payload: &[u8],
        checksum: u64,
        now_us: u64,
    ) -> Result<DemoteToken, WriteRefused> {
        self.admit(key, payload, now_us)?;
        let b = self.block as usize;
        let whole = payload.len() / b * b;
        let header = self.bufs.get(b);
        let tail = if whole < payload.len() {
            self.bufs.get(b).map(|mut t| {
                let rest = &payload[whole..];
                let s = t.as_mut_slice();
                s[..rest.len()].copy_from_slice(rest);
                s[rest.len()..b].fill(0);
                Some(t)
            })
        } else {
            Some(None)
        };
        let (Some(header), Some(tail)) = (header, tail) else {
            self.stats.refusals.bump(WriteRefused::QueueFull);
            return Err(WriteRefused::QueueFull);
        };
        let token = DemoteToken(self.next_demote);
        self.next_demote += 1;
        let src = WriteSrc::InPlace(InPlaceWrite {
            token,
            header,
            body: PoolRange(payload.as_ptr(), whole),
            tail,
            iov: Iovecs(Box::new([NO_IOV; 3])),
        });
        self.holding += 1;
        self.stats.writes_in_place += 1;
        self.enqueue(key, format_digest, payload.len() as u64, checksum, src);
        Ok(token)
    }

    fn enqueue(
        &mut self,
        key: &StateKey,
        digest: [u8; 32],
        payload_len: u64,
        checksum: u64,
        src: WriteSrc,
    ) -> WriteToken {
        let token = WriteToken(self.next_write);
        self.next_write += 1;
        self.write_queue.push_back(QueuedWrite {
            token,
            key: *key,
            digest,
            payload_len,
            checksum,
            written_us: self.now_us,
            src,
        });
        self.pending_keys.insert(*key);
        self.accepted_writes += 1;
        self.stats.writes_accepted += 1;
        // A small record waits for the next poll, or until the records
        // queued fill a group, so that records submitted together share a
        // header block.
        if self.group_filled() {
            self.dispatch_writes();
            self.flush_if_batched();
        }
        token
    }

    /// Returns a finished (or abandoned) write's buffers and releases its
    /// in-place token.
    fn retire_src(&mut self, src: WriteSrc) {
        match src {
            WriteSrc::Copy(buf) => self.bufs.put(buf),
            WriteSrc::InPlace(ip) => {
                self.bufs.put(ip.header);
                if let Some(t) = ip.tail {
                    self.bufs.put(t);
                }
                assert!(
                    self.released.len() < self.holding,
                    "ssd: releasing in-place demotion {:?} with {} released of {} held",
                    ip.token,
                    self.released.len(),
                    self.holding
                );
                self.released.push(ip.token);
            }
        }
    }

    /// Advances the store's clock to `now_us` and admits a write, counting
    /// a refusal by its reason.
    fn admit(&mut self, key: &StateKey, payload: &[u8], now_us: u64) -> Result<(), WriteRefused> {
        self.now_us = self.now_us.max(now_us);
        let r = self.check_admission(key, payload);
        if let Err(reason) = r {
            self.stats.refusals.bump(reason);
        }
        r
    }

    fn check_admission(&mut self, key: &StateKey, payload: &[u8]) -> Result<(), WriteRefused> {
        if payload.is_empty() {
            return Err(WriteRefused::Empty);
        }
        if record_bytes(payload.len() as u64, self.block) > self.cfg.segment_bytes {
            return Err(WriteRefused::TooLarge);
        }
        if self.index.contains_key(key) || self.pending_keys.contains(key) {
            return Err(WriteRefused::Duplicate);
        }
        if self.accepted_writes >= self.cfg.write_queue_depth {
            return Err(WriteRefused::QueueFull);
        }
        if let Some((until, reason)) = self.backoff {
            if self.now_us < until {
                return Err(reason);
            }
            self.backoff = None;
        }
        if self.cfg.admission == WriteAdmission::OnReuse && !self.seen.offer(key) {
            return Err(WriteRefused::AdmissionPolicy);
        }
        Ok(())
    }

    /// Reaps completions (reads and writes), publishes durable writes and
    /// submits queued work; then appends finished writes. Never blocks.
    pub fn poll_writes(&mut self, now_us: u64, out: &mut Vec<WriteDone>) {
        self.pump(now_us);
        out.append(&mut self.done_writes);
    }

    /// Blocks until every accepted write has been reported (for shutdown,
    /// tools and tests; never inside a tick). Returns the reports.
    pub fn wait_writes(&mut self, now_us: u64) -> Vec<WriteDone> {
        loop {
            self.pump(now_us);
            if self.accepted_writes == 0 {
                break;
            }
            if self.engine.in_flight() > 0 {
                self.engine.wait();
                continue;
            }
            if self.meta.pending() > 0 {
                if let Some(d) = self.meta.recv_timeout(Duration::from_millis(20)) {
                    self.handle_meta(d);
                }
                continue;
            }
            // Nothing in flight can make progress (creation backing off):
            // fail what is left rather than wait for the clock.
            let err = match self.backoff {
                Some((_, WriteRefused::NoSpace)) => WriteError::NoSpace,
                _ => WriteError::Unavailable("no segment available".into()),
            };
            self.fail_queued(err);
        }
        std::mem::take(&mut self.done_writes)
    }

    fn flush_if_batched(&mut self) {
        if self.engine.unflushed() >= FLUSH_BATCH {
            self.engine.flush();
        }
    }

    /// One non-blocking round: reap, handle, dispatch, flush.
    fn pump(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
        let mut done = std::mem::take(&mut self.scratch);
        self.engine.reap(&mut done);
        for c in done.drain(..) {
            self.complete(c);
        }
        self.scratch = done;
        while let Some(d) = self.meta.try_recv() {
            self.handle_meta(d);
        }
        self.dispatch_reads();
        self.dispatch_syncs();
        self.dispatch_writes();
        self.engine.flush();
    }

    fn complete(&mut self, c: Completion) {
        let Some(op) = self.ops.remove(&c.user) else {
            return;
        };
        match op {
            Op::Read(r) => self.complete_read(r, c.result),
            Op::Write { w, segment, entry } => self.complete_write(w, segment, entry, c.result),
            Op::Group(g) => self.complete_group(g, c.result),
            Op::Sync { segment, batch } => {
                self.syncs_in_io -= 1;
                self.stats.syncs += 1;
                if let Some(seg) = self.segments.get_mut(&segment) {
                    seg.ops -= 1;
                    seg.syncing = false;
                }
                for w in batch {
                    match c.result {
                        Ok(_) => self.publish(w),
                        Err(e) => self.fail_write(w.token, w.key, WriteError::Sync(strerror(e))),
                    }
                }
            }
        }
    }

    fn complete_write(
        &mut self,
        w: QueuedWrite,
        segment: u64,
        entry: IndexEntry,
        result: Result<usize, i32>,
    ) {
        self.writes_in_io -= 1;
        if let Some(seg) = self.segments.get_mut(&segment) {
            seg.ops -= 1;
        }
        let expected = entry.record_bytes();
        let (token, key) = (w.token, w.key);
        // The write I/O is over: an in-place source is released whatever
        // the outcome.
        self.retire_src(w.src);
        if self.record_written(Written { token, key, entry }, result, expected) {
            self.evict_oldest(EvictReason::NoSpace);
        }
    }

    /// A group's write is over: every record of it succeeds or fails
    /// with it.
    fn complete_group(&mut self, g: GroupWrite, result: Result<usize, i32>) {
        self.writes_in_io -= 1;
        if let Some(seg) = self.segments.get_mut(&g.segment) {
            seg.ops -= 1;
        }
        self.bufs.put(g.header);
        let mut no_space = false;
        for (w, entry) in g.writes {
            let (token, key) = (w.token, w.key);
            self.retire_src(w.src);
            no_space |= self.record_written(Written { token, key, entry }, result, g.bytes);
        }
        if no_space {
            self.evict_oldest(EvictReason::NoSpace);
        }
    }

    /// A record's write I/O is over, `result` being the bytes written of
    /// the `expected` (its own record's, or its group's) or an errno: the
    /// record waits for its segment's fdatasync, becomes visible, or fails.
    /// `true` when it failed for lack of space.
    fn record_written(&mut self, done: Written, result: Result<usize, i32>, expected: u64) -> bool {
        let (token, key, segment) = (done.token, done.key, done.entry.segment);
        match result {
            Ok(n) if n as u64 == expected => {
                if self.cfg.sync == SyncPolicy::BatchFdatasync {
                    if let Some(seg) = self.segments.get_mut(&segment) {
                        seg.unsynced.push(done);
                        self.dirty.insert(segment);
                    }
                } else {
                    self.publish(done);
                }
                false
            }
            Ok(n) => {
                let written = n as u64;
                self.fail_write(token, key, WriteError::Short { written, expected });
                false
            }
            Err(e) if e == libc::ENOSPC || e == libc::EDQUOT => {
                self.fail_write(token, key, WriteError::NoSpace);
                true
            }
            Err(e) => {
                self.fail_write(token, key, WriteError::Io(strerror(e)));
                false
            }
        }
    }

    fn publish(&mut self, w: Written) {
        self.pending_keys.remove(&w.key);
        self.accepted_writes -= 1;
        match self.segments.get_mut(&w.entry.segment) {
            Some(seg) => {
                seg.keys.push(w.key);
                self.index_insert(w.key, w.entry);
                self.stats.writes_completed += 1;
                self.done_writes.push(WriteDone {
                    token: w.token,
                    key: w.key,
                    result: Ok(()),
                });
            }
            None => {
                // Unreachable: segments with unpublished writes are never
                // evicted. Fail closed rather than index a missing file.
                let e = WriteError::Io("segment vanished before publish".into());
                self.stats.write_failures.bump(&e);
                self.done_writes.push(WriteDone {
                    token: w.token,
                    key: w.key,
                    result: Err(e),
                });
            }
        }
    }

    fn fail_write(&mut self, token: WriteToken, key: StateKey, e: WriteError) {
        self.pending_keys.remove(&key);
        self.accepted_writes -= 1;
        self.stats.write_failures.bump(&e);
        self.done_writes.push(WriteDone {
            token,
            key,
            result: Err(e),
        });
    }

    fn fail_queued(&mut self, e: WriteError) {
        while let Some(w) = self.write_queue.pop_front() {
            let (token, key) = (w.token, w.key);
            self.retire_src(w.src);
            self.fail_write(token, key, e.clone());
        }
    }

    fn handle_meta(&mut self, d: MetaDone) {
        match d {
            MetaDone::Deleted { result } => {
                if result.is_err() {
                    self.stats.segment_delete_failures += 1;
                }
            }
            MetaDone::Created { id, result } => {
                self.creating = false;
                match result {
                    Ok(file) => {
                        let state = if self.active.is_none() {
                            self.active = Some(id);
                            SegState::Active
                        } else {
                            self.spare = Some(id);
                            SegState::Spare
                        };
                        self.segments.insert(
                            id,
                            Segment {
                                file,
                                size: self.cfg.segment_bytes,
                                write_pos: 0,
                                state,
                                keys: Vec::new(),
                                ops: 0,
                                unsynced: Vec::new(),
                                syncing: false,
                            },
                        );
                    }
                    Err(e) => {
                        let nospace = matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
                        if nospace && self.evict_oldest(EvictReason::NoSpace) {
                            // Space was freed: the next dispatch retries.
                            return;
                        }
                        let (reason, err) = if nospace {
                            (WriteRefused::NoSpace, WriteError::NoSpace)
                        } else {
                            (
                                WriteRefused::Unavailable,
                                WriteError::Unavailable(e.to_string()),
                            )
                        };
                        self.backoff = Some((self.now_us + CREATE_BACKOFF_US, reason));
                        self.fail_queued(err);
                    }
                }
            }
        }
    }

    /// A segment with room for `rec` bytes, rolling to the spare or
    /// requesting a new one; `None` while none is ready.
    fn writable_segment(&mut self, rec: u64) -> Option<u64> {
        if self.dropping {
            let id = self.active?;
            let seg = self.segments.get(&id)?;
            return (seg.write_pos + rec <= seg.size).then_some(id);
        }
        if let Some(id) = self.active {
            let seg = self.segments.get_mut(&id)?;
            if seg.write_pos + rec <= seg.size {
                let half = seg.write_pos > seg.size / 2;
                if half && self.spare.is_none() && self.room_for_segment() {
                    self.request_segment();
                }
                return Some(id);
            }
            seg.state = SegState::Sealed;
            self.active = None;
        }
        if let Some(id) = self.spare.take()
            && let Some(seg) = self.segments.get_mut(&id)
        {
            seg.state = SegState::Active;
            self.active = Some(id);
            return (rec <= seg.size).then_some(id);
        }
        self.request_segment();
        None
    }

    /// Asks the helper thread for a new segment, first evicting the oldest
    /// segments beyond capacity (waiting while the oldest is pinned).
    fn request_segment(&mut self) {
        if self.creating {
            return;
        }
        if let Some((until, _)) = self.backoff {
            if self.now_us < until {
                return;
            }
            self.backoff = None;
        }
        while !self.room_for_segment() {
            if !self.evict_oldest(EvictReason::Capacity) {
                return;
            }
        }
        let id = self.next_segment;
        if id > MAX_SEGMENT_ID {
            // Unreachable by counting; never wrap onto an existing file.
            self.backoff = Some((u64::MAX, WriteRefused::Unavailable));
            return;
        }
        self.next_segment += 1;
        if self.meta.send(MetaReq::Create {
            id,
            size: self.cfg.segment_bytes,
            flags: self.create_flags,
        }) {
            self.creating = true;
        } else {
            self.backoff = Some((self.now_us + CREATE_BACKOFF_US, WriteRefused::Unavailable));
        }
    }

    /// Drops the oldest sealed segment and every record in it, unless
    /// something is in flight against it. `true` if one was dropped.
    fn evict_oldest(&mut self, reason: EvictReason) -> bool {
        let Some((&id, seg)) = self
            .segments
            .iter()
            .find(|(_, s)| s.state == SegState::Sealed)
        else {
            return false;
        };
        if seg.ops > 0 || seg.syncing || !seg.unsynced.is_empty() {
            return false;
        }
        let Some(seg) = self.segments.remove(&id) else {
            return false;
        };
        let mut n = 0;
        for key in &seg.keys {
            if self.index.get(key).is_some_and(|e| e.segment == id) {
                self.index_remove(key);
                n += 1;
            }
        }
        self.stats.evictions.add(reason, n);
        self.stats.segments_evicted += 1;
        let path = self.segment_path(id);
        if !self.meta.send(MetaReq::Delete {
            path,
            file: seg.file,
        }) {
            // Helper gone: the file stays until the next open removes or
            // rescans it; nothing references it any more.
        }
        true
    }

    fn dispatch_writes(&mut self) {
        while !self.write_queue.is_empty()
            && self.writes_in_io < self.write_io_limit
            && self.engine.in_flight() < self.cfg.max_inflight_io + self.syncs_in_io
        {
            let block = self.block;
            let (n, bytes) = self.group_len();
            if n >= 2 {
                if self.dispatch_group(n, bytes) {
                    continue;
                }
                return;
            }
            let rec = self
                .write_queue
                .front()
                .map_or(0, |w| record_bytes(w.payload_len, block));
            let Some(seg_id) = self.writable_segment(rec) else {
                return;
            };
            let Some(mut w) = self.write_queue.pop_front() else {
                return;
            };
            let Some(seg) = self.segments.get_mut(&seg_id) else {
                self.write_queue.push_front(w);
                return;
            };
            let offset = seg.write_pos;
            seg.write_pos += rec;
            let mut fd = seg.file.as_raw_fd();
            let fault = self.fail_writes > 0;
            if fault {
                self.fail_writes -= 1;
                fd = -1;
            }
            let header = w.header(seg_id, offset, self.next_seq, block, None);
            self.next_seq += 1;
            let entry = IndexEntry::from_header(&header);
            let built = match &mut w.src {
                WriteSrc::Copy(buf) => header
                    .encode_into(buf.as_mut_slice())
                    .map_err(|e| e.to_string())
                    .and_then(|()| {
                        check_aligned(
                            self.direct,
                            buf.as_ptr(),
                            rec as usize,
                            offset,
                            block,
                            self.mem_align,
                        )
                        .map_err(|e| e.to_string())
                    })
                    .map(|()| Request::Write {
                        fd,
                        offset,
                        ptr: buf.as_ptr(),
                        len: rec as usize,
                    }),
                WriteSrc::InPlace(ip) => header
                    .encode_into(ip.header.as_mut_slice())
                    .map_err(|e| e.to_string())
                    .and_then(|()| {
                        let mut parts = vec![(ip.header.as_ptr(), block as usize)];
                        if ip.body.1 > 0 {
                            parts.push((ip.body.0, ip.body.1));
                        }
                        if let Some(t) = &ip.tail {
                            parts.push((t.as_ptr(), block as usize));
                        }
                        for (i, &(ptr, len)) in parts.iter().enumerate() {
                            check_aligned(self.direct, ptr, len, offset, block, self.mem_align)
                                .map_err(|e| e.to_string())?;
                            ip.iov.0[i] = libc::iovec {
                                iov_base: ptr as *mut libc::c_void,
                                iov_len: len,
                            };
                        }
                        Ok(Request::Writev {
                            fd,
                            offset,
                            iov: ip.iov.0.as_ptr(),
                            iovcnt: parts.len() as u32,
                        })
                    }),
            };
            let req = match built {
                Ok(r) => r,
                Err(why) => {
                    let (token, key) = (w.token, w.key);
                    self.retire_src(w.src);
                    self.fail_write(token, key, WriteError::Misaligned(why));
                    continue;
                }
            };
            let user = self.next_user;
            self.next_user += 1;
            // SAFETY: the buffers and iovecs move into `ops` (their heap
            // addresses are stable) and stay there until this completion
            // is reaped; an in-place pool range stays unchanged until its
            // token is released (register_host_pool contract), which is
            // after that; the segment (and its fd) is not evicted while
            // `ops > 0`.
            if unsafe { self.engine.submit(user, req) }.is_err() {
                // Cannot happen (we stay below capacity); retry later.
                if let Some(seg) = self.segments.get_mut(&seg_id) {
                    seg.write_pos -= rec;
                }
                self.next_seq -= 1;
                self.fail_writes += u32::from(fault);
                self.write_queue.push_front(w);
                return;
            }
            if let Some(seg) = self.segments.get_mut(&seg_id) {
                seg.ops += 1;
            }
            self.writes_in_io += 1;
            self.ops.insert(
                user,
                Op::Write {
                    w,
                    segment: seg_id,
                    entry,
                },
            );
        }
    }

    /// Whether the writes queued at the head leave nothing to wait for: they
    /// fill a group (by count or by bytes), or one of them is too large to
    /// be grouped.
    fn group_filled(&self) -> bool {
        let cap = group_capacity(self.block);
        let max = self.cfg.group_bytes;
        let mut bytes = self.block;
        for (i, w) in self.write_queue.iter().enumerate() {
            let padded = round_up(w.payload_len, self.block);
            bytes += padded;
            // Full when another record of this size would not fit.
            if i + 1 >= cap || padded > GROUP_MAX_PAYLOAD || bytes + padded > max {
                return true;
            }
        }
        false
    }

    /// How many writes at the head of the queue form a group in the
    /// active segment, and the group's bytes: `(0, 0)` when fewer than two
    /// do (or no segment is active yet).
    fn group_len(&self) -> (usize, u64) {
        if self.write_queue.len() < 2 {
            return (0, 0);
        }
        let Some(seg) = self.active.and_then(|id| self.segments.get(&id)) else {
            return (0, 0);
        };
        let room = seg
            .size
            .saturating_sub(seg.write_pos)
            .min(self.cfg.group_bytes);
        let (mut n, mut bytes) = (0, self.block);
        for w in self.write_queue.iter().take(group_capacity(self.block)) {
            let padded = round_up(w.payload_len, self.block);
            if padded > GROUP_MAX_PAYLOAD || bytes + padded > room {
                break;
            }
            bytes += padded;
            n += 1;
        }
        if n >= 2 { (n, bytes) } else { (0, 0) }
    }

    /// Writes the first `n` queued records as one group of `bytes` (one
    /// header block holding their headers, then their payloads) with one
    /// `pwritev`. `false` when nothing more can be dispatched now.
    fn dispatch_group(&mut self, n: usize, bytes: u64) -> bool {
        let block = self.block;
        let Some(seg_id) = self.writable_segment(bytes) else {
            return false;
        };
        let Some(mut header) = self.bufs.get(block as usize) else {
            return false;
        };
        let Some(seg) = self.segments.get_mut(&seg_id) else {
            self.bufs.put(header);
            return false;
        };
        let offset = seg.write_pos;
        let mut fd = seg.file.as_raw_fd();
        let fault = self.fail_writes > 0;
        if fault {
            self.fail_writes -= 1;
            fd = -1;
        }
        let writes: Vec<QueuedWrite> = self.write_queue.drain(..n).collect();
        let mut entries = Vec::with_capacity(n);
        let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(1 + 2 * n);
        parts.push((header.as_ptr(), block as usize));
        let mut at = offset + block;
        for (i, w) in writes.iter().enumerate() {
            let padded = round_up(w.payload_len, block);
            let pos = GroupPos {
                index: i as u16,
                count: n as u16,
                bytes,
                payload_offset: at,
            };
            let sequence = self.next_seq + i as u64;
            entries.push(w.header(seg_id, offset, sequence, block, Some(pos)));
            match &w.src {
                // SAFETY: the copy buffer holds the header block and the
                // padded payload (`record_bytes`).
                WriteSrc::Copy(buf) => {
                    parts.push((unsafe { buf.as_ptr().add(block as usize) }, padded as usize))
                }
                WriteSrc::InPlace(ip) => {
                    if ip.body.1 > 0 {
                        parts.push((ip.body.0, ip.body.1));
                    }
                    if let Some(t) = &ip.tail {
                        parts.push((t.as_ptr(), block as usize));
                    }
                }
            }
            at += padded;
        }
        let built = RecordHeader::encode_group(&entries, header.as_mut_slice())
            .map_err(|e| e.to_string())
            .and_then(|()| {
                parts.iter().try_for_each(|&(ptr, len)| {
                    check_aligned(self.direct, ptr, len, offset, block, self.mem_align)
                        .map_err(|e| e.to_string())
                })
            });
        if let Err(why) = built {
            self.bufs.put(header);
            for w in writes {
                let (token, key) = (w.token, w.key);
                self.retire_src(w.src);
                self.fail_write(token, key, WriteError::Misaligned(why.clone()));
            }
            return true;
        }
        let iov = IovecList(
            parts
                .iter()
                .map(|&(ptr, len)| libc::iovec {
                    iov_base: ptr as *mut libc::c_void,
                    iov_len: len,
                })
                .collect(),
        );
        let user = self.next_user;
        self.next_user += 1;
        let req = Request::Writev {
            fd,
            offset,
            iov: iov.0.as_ptr(),
            iovcnt: iov.0.len() as u32,
        };
        // SAFETY: as for a single write: the header buffer, the copy
        // buffers and the iovecs move into `ops` (stable heap addresses)
        // until this completion is reaped; in-place pool ranges stay
        // unchanged until their tokens are released, after that; the
        // segment is not evicted while `ops > 0`.
        if unsafe { self.engine.submit(user, req) }.is_err() {
            // Cannot happen (we stay below capacity); retry later.
            self.bufs.put(header);
            self.fail_writes += u32::from(fault);
            for w in writes.into_iter().rev() {
                self.write_queue.push_front(w);
            }
            return false;
        }
        self.next_seq += n as u64;
        if let Some(seg) = self.segments.get_mut(&seg_id) {
            seg.write_pos += bytes;
            seg.ops += 1;
        }
        self.writes_in_io += 1;
        self.stats.grouped_writes += n as u64;
        let writes = writes
            .into_iter()
            .zip(&entries)
            .map(|(w, h)| (w, IndexEntry::from_header(h)))
            .collect();
        self.ops.insert(
            user,
            Op::Group(GroupWrite {
                writes,
                segment: seg_id,
                header,
                _iov: iov,
                bytes,
            }),
        );
        true
    }

    fn dispatch_syncs(&mut self) {
        while self.syncs_in_io < MAX_SYNCS {
            let Some(id) = self.dirty.iter().copied().find(|id| {
                self.segments
                    .get(id)
                    .is_some_and(|s| !s.syncing && !s.unsynced.is_empty())
            }) else {
                return;
            };
            let Some(seg) = self.segments.get_mut(&id) else {
                return;
            };
            let fd = seg.file.as_raw_fd();
            let user = self.next_user;
            self.next_user += 1;
            // SAFETY: no buffers; the fd stays open while `ops > 0`.
            if unsafe { self.engine.submit(user, Request::Fdatasync { fd }) }.is_err() {
                return;
            }
            seg.syncing = true;
            seg.ops += 1;
            let batch = std::mem::take(&mut seg.unsynced);
            self.dirty.remove(&id);
            self.syncs_in_io += 1;
            self.ops.insert(user, Op::Sync { segment: id, batch });
        }
    }

    fn dispatch_reads(&mut self) {
        while let Some(&user) = self.read_queue.front() {
            if self.engine.in_flight() >= self.cfg.max_inflight_io + self.syncs_in_io {
                return;
            }
            let Some(Op::Read(r)) = self.ops.get(&user) else {
                self.read_queue.pop_front();
                continue;
            };
            let Some(seg) = self.segments.get(&r.entry.segment) else {
                self.read_queue.pop_front();
                continue;
            };
            let req = Request::Readv {
                fd: seg.file.as_raw_fd(),
                offset: r.entry.read_offset(),
                iov: r.iov.0.as_ptr(),
                iovcnt: r.iovcnt,
            };
            // SAFETY: the iovecs (boxed) and the buffers they name live in
            // `ops` until this completion is reaped; pool ranges are valid
            // per `register_host_pool`; the segment is pinned (`ops`).
            if unsafe { self.engine.submit(user, req) }.is_err() {
                return;
            }
            self.read_queue.pop_front();
        }
    }

    fn complete_read(&mut self, mut r: ReadOp, result: Result<usize, i32>) {
        self.reads_in_flight -= 1;
        if let Some(seg) = self.segments.get_mut(&r.entry.segment) {
            seg.ops -= 1;
        }
        let outcome = match result {
            Err(e) => Err(TierError::Io(strerror(e))),
            Ok(n) if n != r.expect => Err(self.corrupt(
                &r,
                format!("short read: {n} of {} bytes (truncated record)", r.expect),
            )),
            Ok(_) => match self.verify(&mut r) {
                Ok(()) => Ok(()),
                Err(why) => Err(self.corrupt(&r, why)),
            },
        };
        match &outcome {
            Ok(()) => self.stats.reads_completed += 1,
            Err(TierError::Corrupt) => {}
            Err(_) => self.stats.reads_failed += 1,
        }
        match r.dest {
            ReadDest::Direct { header } => self.bufs.put(header),
            ReadDest::Bounce { buf } => self.bufs.put(buf),
            ReadDest::Payload => {}
        }
        self.done_reads.push(ReadDone {
            token: r.token,
            result: outcome,
        });
    }

    /// Checks the header against the index entry and the payload against
    /// its checksum; on success the payload is in the pool.
    fn verify(&mut self, r: &mut ReadOp) -> Result<(), String> {
        let Some(pool) = &self.pool else {
            return Err("host pool vanished".into());
        };
        let e = &r.entry;
        if e.grouped {
            return self.verify_payload(r);
        }
        let hb = e.block as usize;
        let header_block = match &r.dest {
            ReadDest::Direct { header } => &header.as_slice()[..hb],
            ReadDest::Bounce { buf } => &buf.as_slice()[..hb],
            ReadDest::Payload => return Err("a single record read without its header".into()),
        };
        let h = RecordHeader::decode(header_block).map_err(|e| format!("header: {e}"))?;
        if h.key != r.key {
            return Err(format!("header key {:?} is not {:?}", h.key, r.key));
        }
        if (h.segment_id, h.record_offset) != (e.segment, e.offset) {
            return Err(format!(
                "header names segment {} offset {}, read {} at {}",
                h.segment_id, h.record_offset, e.segment, e.offset
            ));
        }
        if h.payload_len != e.payload_len {
            return Err(format!(
                "header payload_len {} != indexed {}",
                h.payload_len, e.payload_len
            ));
        }
        if h.sequence != e.sequence
            || h.format_digest != e.digest
            || h.payload_checksum != e.checksum
            || h.block != e.block
        {
            return Err("header disagrees with the index".into());
        }
        let len = e.payload_len as usize;
        let sum = match &r.dest {
            ReadDest::Direct { .. } => {
                // SAFETY: bounds checked at submit; the runtime does not
                // touch the destination while the read is in flight.
                let dst =
                    unsafe { std::slice::from_raw_parts(pool.0.add(r.host_offset as usize), len) };
                page_checksum(dst)
            }
            ReadDest::Bounce { buf } => page_checksum(&buf.as_slice()[hb..hb + len]),
            ReadDest::Payload => return Err("a single record read without its header".into()),
        };
        if sum != h.payload_checksum {
            return Err(format!(
                "payload checksum {sum:#018x} != header {:#018x}",
                h.payload_checksum
            ));
        }
        if let ReadDest::Bounce { buf } = &r.dest {
            // SAFETY: as above; ranges do not overlap (store buffer vs pool).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    buf.as_ptr().add(hb),
                    pool.0.add(r.host_offset as usize),
                    len,
                );
            }
        }
        Ok(())
    }

    /// A record of a group: its payload (read alone) against the checksum
    /// of the header entry that indexed it, verified when it was written
    /// or at the open-time scan.
    fn verify_payload(&mut self, r: &mut ReadOp) -> Result<(), String> {
        let Some(pool) = &self.pool else {
            return Err("host pool vanished".into());
        };
        let len = r.entry.payload_len as usize;
        let sum = match &r.dest {
            ReadDest::Payload => {
                // SAFETY: bounds checked at submit; the runtime does not
                // touch the destination while the read is in flight.
                let dst =
                    unsafe { std::slice::from_raw_parts(pool.0.add(r.host_offset as usize), len) };
                page_checksum(dst)
            }
            ReadDest::Bounce { buf } => page_checksum(&buf.as_slice()[..len]),
            ReadDest::Direct { .. } => return Err("a grouped record read with a header".into()),
        };
        if sum != r.entry.checksum {
            return Err(format!(
                "payload checksum {sum:#018x} != header entry {:#018x}",
                r.entry.checksum
            ));
        }
        if let ReadDest::Bounce { buf } = &r.dest {
            // SAFETY: as in `verify`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    buf.as_ptr(),
                    pool.0.add(r.host_offset as usize),
                    len,
                );
            }
        }
        Ok(())
    }

    /// Records a verification failure and drops the record from the index.
    fn corrupt(&mut self, r: &ReadOp, why: String) -> TierError {
        self.stats.reads_corrupt += 1;
        self.stats.last_corruption = Some(format!(
            "{:?} (segment {} offset {}): {why}",
            r.key, r.entry.segment, r.entry.offset
        ));
        if self.index.get(&r.key).is_some_and(|e| {
            (e.segment, e.payload_offset) == (r.entry.segment, r.entry.payload_offset)
        }) {
            self.index_remove(&r.key);
            self.stats.evictions.add(EvictReason::Corrupt, 1);
        }
        TierError::Corrupt
    }

    /// Blocks until nothing is in flight (Drop).
    fn drain(&mut self) {
        // Bounded: every submitted op completes (or its engine is gone).
        while self.engine.in_flight() > 0 {
            self.engine.wait();
            let mut done = std::mem::take(&mut self.scratch);
            self.engine.reap(&mut done);
            for c in done.drain(..) {
                self.complete(c);
            }
            self.scratch = done;
        }
    }
}

fn blocking(cfg: &SsdConfig, cap: usize) -> Result<BlockingEngine, SsdError> {
    BlockingEngine::new(cfg.blocking_workers, cap)
        .map_err(|e| SsdError::from_io("spawn workers", &cfg.dir, e))
}

/// How long `open` waits for `dir/LOCK` before reporting it held. A store
/// dropped a moment ago can look alive: a `flock` lasts while any
/// descriptor of its open file exists, and a child this process forks in
/// another thread holds copies of every descriptor until its `exec`
/// closes them (the lock file is close-on-exec).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Takes an exclusive `flock` on `dir/LOCK`, waiting at most `LOCK_WAIT`.
fn lock_dir(dir: &Path) -> Result<File, SsdError> {
    let path = dir.join("LOCK");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| SsdError::from_io("open lock file", &path, e))?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: plain syscall on an fd we own.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(SsdError::from_io("lock", &path, e));
        }
        if std::time::Instant::now() >= deadline {
            return Err(SsdError::Locked { path: dir.into() });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The record block and the direct-I/O memory alignment of `file`'s
/// filesystem: `statx(STATX_DIOALIGN)`'s offset alignment (raised to the
/// filesystem block) and memory alignment where the kernel reports them
/// (Linux 6.1+, filesystems with direct I/O);
/// otherwise the logical block size of the backing device from sysfs, and
/// 4096 where that is unknown too (tmpfs, network filesystems). The block is
/// rounded up to a power of two and clamped to `MIN_BLOCK..=MAX_BLOCK`.
fn dio_alignment(file: &File) -> (u64, u64) {
    let clamp = |v: u64| v.max(1).next_power_of_two().clamp(MIN_BLOCK, MAX_BLOCK);
    // SAFETY: a zeroed statx is a valid out-buffer; plain syscall on an fd
    // we own with an empty, NUL-terminated path (AT_EMPTY_PATH).
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_BASIC_STATS | libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align > 0 {
        // Not below the filesystem block: ext4 serialises direct writes
        // that are not fs-block aligned (measured: 512-byte records on a
        // 4 KiB-block ext4 wrote at 0.12-0.25x raw, all I/O one at a time).
        let fs_block = u64::from(stx.stx_blksize);
        let block = clamp(u64::from(stx.stx_dio_offset_align).max(fs_block));
        return (block, u64::from(stx.stx_dio_mem_align).max(1));
    }
    let logical = (r == 0)
        .then(|| {
            let dev = format!("/sys/dev/block/{}:{}", stx.stx_dev_major, stx.stx_dev_minor);
            // A partition's queue is its disk's.
            [
                format!("{dev}/queue/logical_block_size"),
                format!("{dev}/../queue/logical_block_size"),
            ]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        })
        .flatten()
        .unwrap_or(MAX_BLOCK);
    let block = clamp(logical);
    (block, block)
}

/// The O_DIRECT guard: length and file offset on `block`, the address on
/// `block` and on the memory alignment `mem`.
fn check_aligned(
    direct: bool,
    ptr: *const u8,
    len: usize,
    offset: u64,
    block: u64,
    mem: u64,
) -> Result<(), SsdError> {
    if !direct {
        return Ok(());
    }
    let b = block as usize;
    let a = block.max(mem) as usize;
    if !(ptr as usize).is_multiple_of(a) || !len.is_multiple_of(b) || !offset.is_multiple_of(block)
    {
        return Err(SsdError::Misaligned(format!(
            "address {ptr:p}, length {len}, offset {offset}"
        )));
    }
    Ok(())
}

impl BackingTier for SsdStore {
    fn name(&self) -> &'static str {
        "ssd"
    }

    /// Drops the namespace's records from the index (reads and lookups
    /// never find them again in this process); their bytes stay in their
    /// segments until collection reclaims them, and a restart's scan
    /// indexes them again (nothing on disk marks them cleared yet).
    fn clear_namespace(
        &mut self,
        namespace: &orbitkv_components::Namespace,
    ) -> Result<u64, String> {
        let keys: Vec<StateKey> = self
            .index
            .keys()
            .filter(|k| k.namespace == *namespace)
            .copied()
            .collect();
        for k in &keys {
            self.index_remove(k);
        }
        Ok(keys.len() as u64)
    }

    fn occupancy(&self) -> Option<(u64, u64)> {
        let s = self.stats();
        Some((s.bytes, s.capacity_bytes))
    }

    fn list_keys(&self, f: &mut dyn FnMut(&StateKey)) -> bool {
        self.index.keys().for_each(f);
        true
    }

    fn record_changes(&mut self, cap: usize) {
        self.journal.start(cap, self.index.keys().copied());
    }

    fn relist_changes(&mut self) {
        self.journal.relist(self.index.keys().copied());
    }

    fn take_changes(&mut self, out: &mut Vec<crate::tier::TierChange>) -> bool {
        let index = &self.index;
        self.journal.take(
            out,
            |k| index.contains_key(k),
            || Box::new(index.keys().copied()),
        )
    }

    fn lookup(&self, key: &StateKey) -> Option<TierEntry> {
        self.index.get(key).map(|e| TierEntry {
            bytes: e.payload_len,
            checksum: e.checksum,
        })
    }

    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), TierError> {
        if base.is_null() {
            return Err(TierError::NoHostPool);
        }
        self.pool = Some(PoolPtr(base, len));
        Ok(())
    }

    fn submit_read(
        &mut self,
        key: &StateKey,
        host_offset: u64,
        len: u64,
        now_us: u64,
    ) -> Result<ReadToken, TierError> {
        self.now_us = self.now_us.max(now_us);
        let Some(pool) = &self.pool else {
            return Err(TierError::NoHostPool);
        };
        let (base, pool_len) = (pool.0, pool.1);
        if host_offset
            .checked_add(len)
            .is_none_or(|end| end > pool_len)
        {
            return Err(TierError::OutOfBounds {
                offset: host_offset,
                len,
                size: pool_len,
            });
        }
        let entry = *self.index.get(key).ok_or(TierError::NotFound)?;
        if entry.payload_len != len {
            return Err(TierError::SizeMismatch {
                expected: len,
                actual: entry.payload_len,
            });
        }
        if self.reads_in_flight >= self.cfg.max_inflight_reads {
            return Err(TierError::QueueFull(
                self.reads_in_flight,
                self.cfg.max_inflight_reads,
            ));
        }
        if !self.segments.contains_key(&entry.segment) {
            return Err(TierError::NotFound);
        }
        let block = entry.block;
        let padded = round_up(len, block);
        let dst = base as usize + host_offset as usize;
        let direct_ok = dst.is_multiple_of(block.max(self.mem_align) as usize)
            && host_offset
                .checked_add(padded)
                .is_some_and(|end| end <= pool_len);
        let no_buf = || TierError::Io("out of memory for a read buffer".into());
        let (dest, iov, iovcnt) = if direct_ok && entry.grouped {
            let iov = Iovecs(Box::new([
                libc::iovec {
                    iov_base: dst as *mut libc::c_void,
                    iov_len: padded as usize,
                },
                NO_IOV,
            ]));
            (ReadDest::Payload, iov, 1)
        } else if direct_ok {
            let mut header = self.bufs.get(block as usize).ok_or_else(no_buf)?;
            let iov = Iovecs(Box::new([
                libc::iovec {
                    iov_base: header.as_mut_ptr().cast(),
                    iov_len: block as usize,
                },
                libc::iovec {
                    iov_base: dst as *mut libc::c_void,
                    iov_len: padded as usize,
                },
            ]));
            (ReadDest::Direct { header }, iov, 2)
        } else {
            let mut buf = self
                .bufs
                .get(entry.record_bytes() as usize)
                .ok_or_else(no_buf)?;
            let iov = Iovecs(Box::new([
                libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: entry.record_bytes() as usize,
                },
                NO_IOV,
            ]));
            (ReadDest::Bounce { buf }, iov, 1)
        };
        let token = ReadToken(self.next_read);
        self.next_read += 1;
        let user = self.next_user;
        self.next_user += 1;
        if let Some(seg) = self.segments.get_mut(&entry.segment) {
            seg.ops += 1; // pinned until reaped
        }
        self.ops.insert(
            user,
            Op::Read(ReadOp {
                token,
                key: *key,
                entry,
                host_offset,
                dest,
                iov,
                iovcnt,
                expect: entry.record_bytes() as usize,
            }),
        );
        self.reads_in_flight += 1;
        self.stats.reads_submitted += 1;
        self.read_queue.push_back(user);
        self.dispatch_reads();
        self.flush_if_batched();
        Ok(token)
    }

    fn poll(&mut self, now_us: u64, out: &mut Vec<ReadDone>) {
        self.pump(now_us);
        out.append(&mut self.done_reads);
    }

    fn in_flight(&self) -> usize {
        self.reads_in_flight
    }

    fn demote(
        &mut self,
        key: &StateKey,
        format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        now_us: u64,
    ) -> Result<Demoted, DemoteRefused> {
        // No hashing here: the header records the checksum the page
        // carries; a read verifies the stored bytes against it.
        if self.in_place_ok(payload) {
            self.submit_in_place(key, format, payload, checksum, now_us)
                .map(Demoted::InPlace)
                .map_err(DemoteRefused::from)
        } else {
            self.submit_write_with_checksum(key, format, payload, checksum, now_us)
                .map(|_| Demoted::Copied)
                .map_err(DemoteRefused::from)
        }
    }

    fn poll_released(&mut self, out: &mut Vec<DemoteToken>) {
        if self.released.is_empty() && self.holding > 0 {
            self.pump(self.now_us);
        }
        let n = self.released.len();
        assert!(
            n <= self.holding,
            "ssd: handing out {n} released demotions with {} held",
            self.holding
        );
        self.holding -= n;
        out.append(&mut self.released);
    }

    fn demotions_holding(&self) -> usize {
        self.holding
    }

    /// Waits for every accepted write (in place or copied); their reports
    /// wait for the next `poll_demotions`.
    fn finish_demotions(&mut self) {
        let done = self.wait_writes(self.now_us);
        self.done_writes = done;
    }

    fn poll_demotions(&mut self, now_us: u64, out: &mut Vec<Result<(), DemoteFailed>>) {
        let mut done = Vec::new();
        self.poll_writes(now_us, &mut done);
        out.extend(
            done.into_iter()
                .map(|d| d.result.map_err(DemoteFailed::from)),
        );
    }
}

impl Drop for SsdStore {
    fn drop(&mut self) {
        // The kernel or a worker may still read from or write into our
        // buffers or the host pool (reads, in-place demotions): wait for
        // every submitted operation first. Small records still waiting to
        // be grouped are issued first, as a submission would have issued
        // them before grouping existed; writes that cannot be issued now
        // (no room in the active segment: nothing is evicted or created
        // for them now) are discarded (never reported, never visible,
        // never issued).
        self.dropping = true;
        self.dispatch_writes();
        self.engine.flush();
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_components::Namespace;

    fn key(i: u64) -> StateKey {
        StateKey::new(Namespace([1; 32]), 0, &i.to_le_bytes()).unwrap()
    }

    #[test]
    fn seen_once_is_bounded_and_consumed() {
        let mut s = SeenOnce::new(2);
        assert!(!s.offer(&key(1)));
        assert!(s.offer(&key(1)));
        assert!(!s.offer(&key(1)));
        assert!(!s.offer(&key(2)));
        assert!(!s.offer(&key(3))); // forgets 1
        assert!(!s.offer(&key(1)));
        assert!(s.map.len() <= 2 && s.order.len() <= 2);
    }

    #[test]
    fn alignment_guard() {
        assert!(check_aligned(true, 4096 as *const u8, 8192, 4096, 4096, 4).is_ok());
        assert!(check_aligned(true, 4097 as *const u8, 8192, 4096, 4096, 4).is_err());
        assert!(check_aligned(true, 4096 as *const u8, 100, 4096, 4096, 4).is_err());
        assert!(check_aligned(true, 4096 as *const u8, 4096, 10, 4096, 4).is_err());
        assert!(check_aligned(true, 512 as *const u8, 1536, 2560, 512, 512).is_ok());
        assert!(check_aligned(true, 512 as *const u8, 1536, 2560, 1024, 4).is_err());
        // The memory alignment binds the address only.
        assert!(check_aligned(true, 512 as *const u8, 512, 512, 512, 1024).is_err());
        assert!(check_aligned(true, 1024 as *const u8, 512, 512, 512, 1024).is_ok());
        assert!(check_aligned(false, std::ptr::dangling::<u8>(), 1, 1, 4096, 4096).is_ok());
    }

    #[test]
    fn pinned_oldest_segment_is_not_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = SsdConfig::new(dir.path());
        cfg.segment_bytes = 64 << 10;
        cfg.capacity_bytes = 128 << 10;
        cfg.backend = IoBackend::Blocking;
        let mut s = SsdStore::open(cfg).unwrap();
        // Several segments of 8 KiB records; capacity keeps two.
        for i in 0..40u64 {
            if s.submit_write(&key(i), [0; 32], &[i as u8; 4096], i)
                .is_ok()
            {
                let _ = s.wait_writes(i);
            }
        }
        let oldest = s
            .segments
            .iter()
            .find(|(_, g)| g.state == SegState::Sealed)
            .map(|(id, _)| *id)
            .unwrap();
        s.segments.get_mut(&oldest).unwrap().ops += 1;
        assert!(!s.evict_oldest(EvictReason::Capacity));
        s.segments.get_mut(&oldest).unwrap().ops -= 1;
        assert!(s.evict_oldest(EvictReason::Capacity));
        assert!(s.stats().evictions.capacity > 0);
    }
}
