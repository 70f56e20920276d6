//! [`RemoteTier`]: the tick-side state (pending reads, queued writes) and
//! the threads behind it (readers, writers, the refresher).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded, unbounded};
use orbitkv_components::api::MissReason;
use orbitkv_components::{Namespace, StateKey};

use super::config::{RemoteConfig, RemoteError};
use super::conn::{Bounded, Conn, Connector, DirPut, Put, Scratch, classify};
use super::meta::{MetaCache, MetaEntry};
use super::record::{
    Expect, MAC_LEN, RecordHeader, RecordMac, data_key, directory_key, max_record_len, shard_of,
    verify,
};
use super::stats::{ErrorKind, Live, RemoteStats, RemoteStatsSnapshot};
use crate::checksum::copy_with_checksum;
use crate::tier::{
    BackingTier, DemoteFailed, DemoteRefused, Demoted, ReadDone, ReadToken, TierChange, TierEntry,
    TierError, remote_miss_reason,
};

/// A read's destination, claimed by exactly one side: the worker (to copy
/// verified bytes) or the tick (to report a timeout).
const PENDING: u8 = 0;
const COPYING: u8 = 1;
const DONE: u8 = 2;
const ABANDONED: u8 = 3;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Opens after `threshold` consecutive connection/timeout failures; only a
/// successful health check (the refresher's PING) closes it.
struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
    /// When a health check may next run, ms since `Shared::epoch`.
    retry_at_ms: AtomicU64,
    threshold: u32,
    cooldown_ms: u64,
}

impl Breaker {
    fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Counts a failure; `true` if this one opened the breaker.
    fn failure(&self, now_ms: u64) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.threshold && !self.open.swap(true, Ordering::AcqRel) {
            self.retry_at_ms
                .store(now_ms + self.cooldown_ms, Ordering::Relaxed);
            return true;
        }
        false
    }

    fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Release);
    }

    fn may_probe(&self, now_ms: u64) -> bool {
        now_ms >= self.retry_at_ms.load(Ordering::Relaxed)
    }

    fn postpone(&self, now_ms: u64) {
        self.retry_at_ms
            .store(now_ms + self.cooldown_ms, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Interest {
    queue: VecDeque<Namespace>,
    queued: HashSet<Namespace>,
}

/// State shared by the tick side and every thread.
struct Shared {
    cfg: RemoteConfig,
    connector: Connector,
    /// The deployment's record keys: every record written is authenticated
    /// with them, every record and directory entry read is verified.
    mac: RecordMac,
    meta: RwLock<MetaCache>,
    interest: Mutex<Interest>,
    wake: Condvar,
    breaker: Breaker,
    stats: RemoteStats,
    stop: AtomicBool,
    writer_id: u64,
    epoch: Instant,
    // Gauges the tick side owns, published for `stats()` from any thread.
    reads_in_flight: AtomicU64,
    reads_abandoned: AtomicU64,
    writes_queued: AtomicU64,
    write_bytes_queued: AtomicU64,
    /// Write buffers the writers are done with, reused for the next writes
    /// of the same size (a fresh buffer costs page faults and zeroing on
    /// the caller's thread, the manager's tick); at most
    /// `max_queued_write_bytes` kept, what the queue may hold anyway.
    spare: Mutex<Spare>,
}

#[derive(Default)]
struct Spare {
    buffers: Vec<Vec<u8>>,
    bytes: u64,
}

impl Shared {
    /// A buffer of exactly `len` bytes (contents unspecified).
    fn write_buffer(&self, len: usize) -> Vec<u8> {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = spare.buffers.iter().rposition(|b| b.len() == len) {
            let b = spare.buffers.swap_remove(i);
            spare.bytes -= len as u64;
            return b;
        }
        drop(spare);
        vec![0; len]
    }

    /// Keeps `buffer` for reuse while the bound allows.
    fn recycle(&self, buffer: Vec<u8>) {
        let cap = self.cfg.max_queued_write_bytes;
        let len = buffer.len() as u64;
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.bytes + len <= cap {
            spare.bytes += len;
            spare.buffers.push(buffer);
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn meta_read(&self) -> std::sync::RwLockReadGuard<'_, MetaCache> {
        // A panic while holding the lock cannot leave the map inconsistent
        // (every mutation is one std call); keep using it.
        self.meta.read().unwrap_or_else(|e| e.into_inner())
    }

    fn meta_write(&self) -> std::sync::RwLockWriteGuard<'_, MetaCache> {
        self.meta.write().unwrap_or_else(|e| e.into_inner())
    }

    fn publish_meta_stats(&self, m: &mut MetaCache) {
        self.stats
            .metadata_entries
            .store(m.len() as u64, Ordering::Relaxed);
        self.stats
            .metadata_dropped
            .fetch_add(m.take_dropped(), Ordering::Relaxed);
    }

    /// A failed operation of `kind`: counts towards the breaker when the
    /// deployment did not answer.
    fn failed(&self, kind: ErrorKind) {
        if matches!(kind, ErrorKind::Unavailable | ErrorKind::Timeout)
            && self.breaker.failure(self.now_ms())
        {
            self.stats.breaker_opens.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                failures = self.cfg.breaker_failures,
                "remote tier unreachable: lookups answer absent until a health check passes"
            );
        }
    }

    /// The thread's connection, made if missing.
    fn conn<'a>(
        &self,
        slot: &'a mut Option<Conn>,
        io_timeout: Duration,
    ) -> Result<&'a mut Conn, (ErrorKind, String)> {
        if slot.is_none() {
            match self.connector.connect(io_timeout) {
                Ok(c) => {
                    self.stats.connects.fetch_add(1, Ordering::Relaxed);
                    *slot = Some(c);
                }
                Err(e) => {
                    self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                    let kind = match classify(&e) {
                        ErrorKind::Timeout => ErrorKind::Timeout,
                        _ => ErrorKind::Unavailable,
                    };
                    return Err((kind, format!("connect: {e}")));
                }
            }
        }
        slot.as_mut()
            .ok_or_else(|| (ErrorKind::Unavailable, "no connection".into()))
    }
}

struct SendPtr(*mut u8);
// SAFETY: the pointer names a pool range owned by one read; it is only
// written through after that read's state moved PENDING -> COPYING, which
// the tick side never does (see `RemoteTier::poll` and `Drop`).
unsafe impl Send for SendPtr {}

struct ReadJob {
    token: u64,
    data_key: String,
    expect: Expect,
    dest: SendPtr,
    deadline: Instant,
    submitted: Instant,
    state: Arc<AtomicU8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Demote,
    Publish,
}

struct WriteJob {
    key: StateKey,
    format: [u8; 32],
    payload: Vec<u8>,
    /// The checksum the page carries since its bytes landed, verified
    /// against `payload` when the job was made; the record carries it.
    checksum: u64,
    origin: Origin,
}

enum Reply {
    Read {
        token: u64,
        result: Result<(), (ErrorKind, String)>,
    },
    Write {
        key: StateKey,
        origin: Origin,
        bytes: u64,
        result: Result<(), (ErrorKind, String)>,
    },
}

struct Pending {
    deadline_us: u64,
    state: Arc<AtomicU8>,
}

/// The remote tier. See the [module docs](super).
pub struct RemoteTier {
    shared: Arc<Shared>,
    read_tx: Sender<ReadJob>,
    write_tx: Sender<WriteJob>,
    replies: Receiver<Reply>,
    pool: Option<(usize, u64)>,
    next_token: u64,
    pending: HashMap<u64, Pending>,
    abandoned: HashMap<u64, Arc<AtomicU8>>,
    writes: orbitkv_components::KeyMap<u64>,
    write_bytes: u64,
    demoted: Vec<Result<(), DemoteFailed>>,
    /// Reads finished but not yet reported (drained outside `poll`).
    ready: Vec<ReadDone>,
    last_error: Option<String>,
    /// Whether the KV events advertise the metadata now: not while the
    /// breaker is open (a lookup answers "absent" then).
    advertising: bool,
    _threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("connector", &self.shared.connector)
            .field("pending", &self.pending.len())
            .field("writes", &self.writes.len())
            .finish_non_exhaustive()
    }
}

/// Read-only access to a tier's counters from another owner (the runtime
/// keeps one for `/metrics` after the tier itself moved into the world).
#[derive(Clone)]
pub struct RemoteStatsHandle(Arc<Shared>);

impl RemoteStatsHandle {
    pub fn snapshot(&self) -> RemoteStatsSnapshot {
        snapshot(&self.0)
    }
}

impl std::fmt::Debug for RemoteStatsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemoteStatsHandle")
    }
}

fn snapshot(s: &Shared) -> RemoteStatsSnapshot {
    s.stats.snapshot(Live {
        mode: s.connector.mode_name(),
        breaker_open: s.breaker.is_open(),
        reads_in_flight: s.reads_in_flight.load(Ordering::Relaxed),
        reads_abandoned: s.reads_abandoned.load(Ordering::Relaxed),
        writes_queued: s.writes_queued.load(Ordering::Relaxed),
        write_bytes_queued: s.write_bytes_queued.load(Ordering::Relaxed),
    })
}

impl RemoteTier {
    /// Validates `cfg`, resolves the password and starts the threads. It
    /// does not wait for the deployment: a remote that is down at start is
    /// a tier that misses until it comes up. `writer_id` (the manager's
    /// incarnation) is stamped on every record written.
    pub fn open(cfg: RemoteConfig, writer_id: u64) -> Result<RemoteTier, RemoteError> {
        cfg.validate()?;
        let password = cfg.password()?;
        let mac = cfg.record_mac(password.as_deref())?;
        if !mac.is_keyed() {
            tracing::warn!(
                "remote tier without a MAC secret (unauthenticated = true): whoever can write \
                 the store can inject pages"
            );
        }
        let connector = Connector::new(&cfg, password).map_err(RemoteError::InvalidConfig)?;
        let shared = Arc::new(Shared {
            meta: RwLock::new(MetaCache::new(cfg.metadata_max_entries)),
            interest: Mutex::new(Interest::default()),
            wake: Condvar::new(),
            breaker: Breaker {
                failures: AtomicU32::new(0),
                open: AtomicBool::new(false),
                retry_at_ms: AtomicU64::new(0),
                threshold: cfg.breaker_failures,
                cooldown_ms: cfg.breaker_cooldown_ms,
            },
            stats: RemoteStats::default(),
            stop: AtomicBool::new(false),
            writer_id,
            epoch: Instant::now(),
            reads_in_flight: AtomicU64::new(0),
            reads_abandoned: AtomicU64::new(0),
            writes_queued: AtomicU64::new(0),
            write_bytes_queued: AtomicU64::new(0),
            spare: Mutex::new(Spare::default()),
            connector,
            mac,
            cfg,
        });
        let cfg = &shared.cfg;
        let (read_tx, read_rx) = bounded::<ReadJob>(cfg.max_inflight_reads);
        let (write_tx, write_rx) = bounded::<WriteJob>(cfg.max_queued_writes);
        // Unbounded in type, bounded in fact: at most one reply per accepted
        // read (max_inflight_reads) and write (max_queued_writes).
        let (reply_tx, replies) = unbounded::<Reply>();
        let mut threads = Vec::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(RemoteError::Spawn)
        };
        for i in 0..cfg.read_workers {
            let (s, rx, tx) = (shared.clone(), read_rx.clone(), reply_tx.clone());
            threads.push(spawn(
                format!("okv-remote-r{i}"),
                Box::new(move || read_worker(&s, &rx, &tx)),
            )?);
        }
        for i in 0..cfg.write_workers {
            let (s, rx, tx) = (shared.clone(), write_rx.clone(), reply_tx.clone());
            threads.push(spawn(
                format!("okv-remote-w{i}"),
                Box::new(move || write_worker(&s, &rx, &tx)),
            )?);
        }
        let s = shared.clone();
        threads.push(spawn(
            "okv-remote-refresh".into(),
            Box::new(move || refresher(&s)),
        )?);
        tracing::info!(
            seeds = ?shared.cfg.urls,
            mode = ?shared.cfg.mode,
            write_policy = ?shared.cfg.write_policy,
            "remote tier started"
        );
        Ok(RemoteTier {
            shared,
            read_tx,
            write_tx,
            replies,
            pool: None,
            next_token: 0,
            pending: HashMap::new(),
            abandoned: HashMap::new(),
            writes: Default::default(),
            write_bytes: 0,
            demoted: Vec::new(),
            ready: Vec::new(),
            last_error: None,
            advertising: false,
            _threads: threads,
        })
    }

    pub fn config(&self) -> &RemoteConfig {
        &self.shared.cfg
    }

    pub fn stats(&self) -> RemoteStatsSnapshot {
        snapshot(&self.shared)
    }

    pub fn stats_handle(&self) -> RemoteStatsHandle {
        RemoteStatsHandle(self.shared.clone())
    }

    /// The last read or write failure, for operators and tests.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// Whether the breaker is open (the deployment is treated as down).
    pub fn is_down(&self) -> bool {
        self.shared.breaker.is_open()
    }

    /// Entries in the metadata cache.
    pub fn metadata_entries(&self) -> usize {
        self.shared.meta_read().len()
    }

    /// Writes accepted and not finished.
    pub fn writes_pending(&self) -> usize {
        self.writes.len()
    }

    /// Accepts `payload` for a write-through (a page just published, whose
    /// bytes hash to `checksum`). Refusals as for [`BackingTier::demote`].
    pub fn offer(
        &mut self,
        key: &StateKey,
        format: [u8; 32],
        payload: &[u8],
        checksum: u64,
    ) -> Result<(), DemoteRefused> {
        self.offer_write(key, format, payload, checksum, Origin::Publish)
    }

    /// Blocks until a reply from a worker arrives (or `timeout` passes);
    /// `true` if one did. For callers without a tick loop of their own
    /// (benchmarks, tools): a read it finished is reported by the next
    /// `poll`.
    pub fn wait(&mut self, timeout: Duration) -> bool {
        match self.replies.recv_timeout(timeout) {
            Ok(r) => {
                if let Some(done) = self.apply(r) {
                    self.ready.push(done);
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Waits (polling) until every accepted write finished or `timeout`
    /// passed; `true` when none is left. For shutdown and tests.
    pub fn flush_writes(&mut self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while !self.writes.is_empty() && Instant::now() < until {
            if let Ok(r) = self.replies.recv_timeout(Duration::from_millis(5))
                && let Some(done) = self.apply(r)
            {
                self.ready.push(done);
            }
        }
        self.writes.is_empty()
    }

    /// Queues a write of `payload`, copied here and verified against the
    /// checksum the page carries (bytes altered since they landed are
    /// refused, never written under a fresh checksum).
    fn offer_write(
        &mut self,
        key: &StateKey,
        format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        origin: Origin,
    ) -> Result<(), DemoteRefused> {
        let refuse = |s: &Shared, why: DemoteRefused| {
            s.stats.refuse(why);
            Err(why)
        };
        let s = &self.shared;
        let len = payload.len() as u64;
        if payload.is_empty() {
            return refuse(s, DemoteRefused::Empty);
        }
        if len > s.cfg.max_page_bytes {
            return refuse(s, DemoteRefused::TooLarge);
        }
        if s.breaker.is_open() {
            return refuse(s, DemoteRefused::Unavailable);
        }
        if self.writes.contains_key(key) || s.meta_read().get(key).is_some() {
            return refuse(s, DemoteRefused::Duplicate);
        }
        if self.writes.len() >= s.cfg.max_queued_writes
            || self.write_bytes + len > s.cfg.max_queued_write_bytes
        {
            return refuse(s, DemoteRefused::QueueFull);
        }
        // Copied and hashed in one pass: the record holds exactly the
        // bytes that matched.
        let mut kept = s.write_buffer(payload.len());
        if copy_with_checksum(&mut kept, payload) != checksum {
            s.recycle(kept);
            return refuse(s, DemoteRefused::Checksum);
        }
        let job = WriteJob {
            key: *key,
            format,
            payload: kept,
            checksum,
            origin,
        };
        match self.write_tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return refuse(s, DemoteRefused::QueueFull),
            Err(TrySendError::Disconnected(_)) => return refuse(s, DemoteRefused::Unavailable),
        }
        self.writes.insert(*key, len);
        self.write_bytes += len;
        s.stats.writes_submitted.fetch_add(1, Ordering::Relaxed);
        self.publish_gauges();
        Ok(())
    }

    fn publish_gauges(&self) {
        let s = &self.shared;
        s.reads_in_flight
            .store(self.pending.len() as u64, Ordering::Relaxed);
        s.reads_abandoned
            .store(self.abandoned.len() as u64, Ordering::Relaxed);
        s.writes_queued
            .store(self.writes.len() as u64, Ordering::Relaxed);
        s.write_bytes_queued
            .store(self.write_bytes, Ordering::Relaxed);
    }

    fn apply_read(
        &mut self,
        token: u64,
        result: Result<(), (ErrorKind, String)>,
    ) -> Option<ReadDone> {
        if self.pending.remove(&token).is_none() {
            // Reported as timed out already; the worker is back now.
            if self.abandoned.remove(&token).is_some() {
                self.shared.stats.reads_late.fetch_add(1, Ordering::Relaxed);
            }
            return None;
        }
        let result = result.map_err(|(kind, why)| {
            self.last_error = Some(format!("read: {why}"));
            match kind {
                ErrorKind::Missing => TierError::NotFound,
                ErrorKind::Corrupt => TierError::Corrupt,
                ErrorKind::Timeout => TierError::Timeout,
                ErrorKind::Unavailable => TierError::Unavailable(why),
                ErrorKind::Server => TierError::Io(why),
            }
        });
        Some(ReadDone {
            token: ReadToken(token),
            result,
        })
    }

    fn apply(&mut self, r: Reply) -> Option<ReadDone> {
        match r {
            Reply::Read { token, result } => self.apply_read(token, result),
            Reply::Write {
                key,
                origin,
                bytes,
                result,
            } => {
                let held = self.writes.remove(&key);
                debug_assert_eq!(held, Some(bytes), "one reply per accepted write");
                assert!(self.write_bytes >= bytes, "queued write bytes underflow");
                self.write_bytes -= bytes;
                if let Err((_, why)) = &result {
                    self.last_error = Some(format!("write: {why}"));
                }
                if origin == Origin::Demote {
                    self.demoted
                        .push(result.map_err(|(kind, why)| demote_failed(kind, why)));
                }
                self.publish_gauges();
                None
            }
        }
    }

    /// Applies every reply that arrived; finished reads wait in `ready`
    /// for the next `poll`.
    fn drain(&mut self) {
        while let Ok(r) = self.replies.try_recv() {
            if let Some(done) = self.apply(r) {
                self.ready.push(done);
            }
        }
    }
}

impl BackingTier for RemoteTier {
    fn name(&self) -> &'static str {
        "remote"
    }

    /// While the breaker is open, lookups answer "absent" without asking.
    fn unavailable(&self) -> bool {
        self.shared.breaker.is_open()
    }

    /// The metadata cache's changes: this manager's writes, other hosts'
    /// writes the refresher reads from the directories it follows, expiry,
    /// failed reads and the cache's own bound. While the breaker is open
    /// every page is withdrawn (lookups answer "absent"), and listed again
    /// when it closes.
    fn record_changes(&mut self, cap: usize) {
        let mut m = self.shared.meta_write();
        let present: Vec<StateKey> = m.keys().collect();
        m.journal.start(cap, present.into_iter());
        self.advertising = true;
    }

    fn relist_changes(&mut self) {
        let mut m = self.shared.meta_write();
        let present: Vec<StateKey> = m.keys().collect();
        m.journal.relist(present.into_iter());
    }

    fn take_changes(&mut self, out: &mut Vec<TierChange>) -> bool {
        let open = self.shared.breaker.is_open();
        let mut m = self.shared.meta_write();
        if !m.journal.is_on() {
            return false;
        }
        if open {
            // Nothing is advertised meanwhile: the changes (and a loss of
            // them) are moot; the cache is listed again when it closes.
            m.take_changes(&mut Vec::new());
            if std::mem::replace(&mut self.advertising, false) {
                out.extend(m.keys().map(TierChange::Removed));
            }
            return false;
        }
        if !std::mem::replace(&mut self.advertising, true) {
            let present: Vec<StateKey> = m.keys().collect();
            m.journal.relist(present.into_iter());
        }
        m.take_changes(out)
    }

    fn lookup(&self, key: &StateKey) -> Option<TierEntry> {
        let s = &self.shared;
        s.stats.lookups.fetch_add(1, Ordering::Relaxed);
        if s.breaker.is_open() {
            s.stats.lookups_suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let (entry, followed) = {
            let m = s.meta_read();
            (m.get(key).copied(), m.followed.contains(&key.namespace))
        };
        if !followed {
            let mut i = s.interest.lock().unwrap_or_else(|e| e.into_inner());
            if i.queued.len() < s.cfg.max_namespaces && i.queued.insert(key.namespace) {
                i.queue.push_back(key.namespace);
                s.wake.notify_one();
            }
        }
        let e = entry?;
        s.stats.lookup_hits.fetch_add(1, Ordering::Relaxed);
        Some(TierEntry {
            bytes: e.bytes,
            checksum: e.checksum,
        })
    }

    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), TierError> {
        if base.is_null() {
            return Err(TierError::NoHostPool);
        }
        self.pool = Some((base as usize, len));
        Ok(())
    }

    fn submit_read(
        &mut self,
        key: &StateKey,
        host_offset: u64,
        len: u64,
        now_us: u64,
    ) -> Result<ReadToken, TierError> {
        let s = self.shared.clone();
        let refused = |e: TierError| {
            s.stats.reads_refused.fetch_add(1, Ordering::Relaxed);
            Err(e)
        };
        let Some((base, size)) = self.pool else {
            return refused(TierError::NoHostPool);
        };
        if host_offset.checked_add(len).is_none_or(|end| end > size) {
            return refused(TierError::OutOfBounds {
                offset: host_offset,
                len,
                size,
            });
        }
        if s.breaker.is_open() {
            return refused(TierError::Unavailable("breaker open".into()));
        }
        let Some(entry) = s.meta_read().get(key).copied() else {
            return refused(TierError::NotFound);
        };
        if entry.bytes != len {
            return refused(TierError::SizeMismatch {
                expected: len,
                actual: entry.bytes,
            });
        }
        let outstanding = self.pending.len() + self.abandoned.len();
        if outstanding >= s.cfg.max_inflight_reads {
            return refused(TierError::QueueFull(outstanding, s.cfg.max_inflight_reads));
        }
        let token = self.next_token;
        let state = Arc::new(AtomicU8::new(PENDING));
        let now = Instant::now();
        let job = ReadJob {
            token,
            data_key: data_key(&s.cfg.key_prefix, key),
            expect: Expect {
                key: *key,
                len,
                checksum: entry.checksum,
            },
            dest: SendPtr((base + host_offset as usize) as *mut u8),
            deadline: now + s.cfg.read_timeout(),
            submitted: now,
            state: state.clone(),
        };
        match self.read_tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return refused(TierError::QueueFull(outstanding, s.cfg.max_inflight_reads));
            }
            Err(TrySendError::Disconnected(_)) => {
                return refused(TierError::Unavailable("reader threads gone".into()));
            }
        }
        self.next_token += 1;
        self.pending.insert(
            token,
            Pending {
                deadline_us: now_us.saturating_add(s.cfg.read_timeout_ms * 1000),
                state,
            },
        );
        s.stats.reads_submitted.fetch_add(1, Ordering::Relaxed);
        self.publish_gauges();
        Ok(ReadToken(token))
    }

    fn poll(&mut self, now_us: u64, out: &mut Vec<ReadDone>) {
        self.drain();
        out.append(&mut self.ready);
        // Deadlines: a read still PENDING is taken back from its worker and
        // reported; one being copied finishes first (a memcpy) and is
        // reported by its reply.
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline_us <= now_us)
            .map(|(t, _)| *t)
            .collect();
        for token in expired {
            let Some(p) = self.pending.get(&token) else {
                continue;
            };
            if p.state
                .compare_exchange(PENDING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let p = self.pending.remove(&token).expect("present above");
                self.abandoned.insert(token, p.state);
                self.shared.stats.read_errors.bump(ErrorKind::Timeout);
                self.shared.failed(ErrorKind::Timeout);
                self.last_error = Some("read: past its deadline".into());
                out.push(ReadDone {
                    token: ReadToken(token),
                    result: Err(TierError::Timeout),
                });
            }
        }
        self.publish_gauges();
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn demote(
        &mut self,
        key: &StateKey,
        format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        _now_us: u64,
    ) -> Result<Demoted, DemoteRefused> {
        if !self.shared.cfg.write_policy.on_evict() {
            return Err(DemoteRefused::NotWritable);
        }
        self.offer_write(key, format, payload, checksum, Origin::Demote)
            .map(|()| Demoted::Copied)
    }

    fn poll_demotions(&mut self, _now_us: u64, out: &mut Vec<Result<(), DemoteFailed>>) {
        self.drain();
        out.append(&mut self.demoted);
    }

    fn write_through(
        &mut self,
        key: &StateKey,
        format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        _now_us: u64,
    ) -> Result<(), DemoteRefused> {
        if !self.shared.cfg.write_policy.on_publish() {
            return Err(DemoteRefused::NotWritable);
        }
        self.offer_write(key, format, payload, checksum, Origin::Publish)
    }

    fn miss_reason(&self, e: &TierError) -> MissReason {
        remote_miss_reason(e)
    }
}

/// A failed remote write of a demotion, typed by the kind of failure.
fn demote_failed(kind: ErrorKind, why: String) -> DemoteFailed {
    match kind {
        ErrorKind::Unavailable => DemoteFailed::Unavailable(why),
        ErrorKind::Timeout => DemoteFailed::Timeout,
        ErrorKind::Corrupt | ErrorKind::Missing | ErrorKind::Server => DemoteFailed::Refused(why),
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        let s = &self.shared;
        s.stop.store(true, Ordering::Release);
        s.wake.notify_all();
        // Take every destination back from the workers, so none writes into
        // the pool after the tier is gone; wait out copies under way (each
        // a memcpy of one verified page).
        for p in self.pending.values() {
            while p
                .state
                .compare_exchange(PENDING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_err_and(|st| st == COPYING)
            {
                std::thread::yield_now();
            }
        }
        // Threads are not joined: one may sit in a socket call until its
        // timeout. They own nothing of the pool now and exit on their own.
    }
}

fn read_worker(s: &Shared, rx: &Receiver<ReadJob>, tx: &Sender<Reply>) {
    let mut conn: Option<Conn> = None;
    for job in rx.iter() {
        let result = read_one(s, &mut conn, &job);
        let us = job.submitted.elapsed().as_micros() as u64;
        match &result {
            Ok(bytes) => {
                s.stats.reads_ok.fetch_add(1, Ordering::Relaxed);
                s.stats.bytes_read.fetch_add(*bytes, Ordering::Relaxed);
                s.stats.read_latency.record(us);
            }
            Err((kind, _)) => {
                // Claim the failure; if the tick already reported this read
                // as timed out, it counted it too.
                let ours = job
                    .state
                    .compare_exchange(PENDING, DONE, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
                if ours {
                    s.stats.read_errors.bump(*kind);
                    s.failed(*kind);
                }
                if matches!(kind, ErrorKind::Missing | ErrorKind::Corrupt) {
                    // The metadata promised this record: forget the promise.
                    let mut m = s.meta_write();
                    m.remove_if(&job.expect.key, job.expect.checksum);
                    s.publish_meta_stats(&mut m);
                }
            }
        }
        let reply = Reply::Read {
            token: job.token,
            result: result.map(|_| ()),
        };
        if tx.send(reply).is_err() {
            return; // the tier is gone
        }
    }
}

fn read_one(
    s: &Shared,
    conn: &mut Option<Conn>,
    job: &ReadJob,
) -> Result<u64, (ErrorKind, String)> {
    if job.state.load(Ordering::Acquire) != PENDING {
        return Err((ErrorKind::Timeout, "abandoned before it started".into()));
    }
    let now = Instant::now();
    if now >= job.deadline {
        return Err((ErrorKind::Timeout, "deadline passed in the queue".into()));
    }
    if s.breaker.is_open() {
        return Err((ErrorKind::Unavailable, "breaker open".into()));
    }
    let c = s.conn(conn, s.cfg.read_timeout())?;
    // Never more than a record of the promised length can take: a value
    // planted under the key is not read whole.
    let limit = max_record_len(job.expect.len);
    let value = c
        .set_read_timeout(job.deadline.saturating_duration_since(now))
        .and_then(|()| c.get_bounded(&job.data_key, limit));
    let value = match value {
        Ok(v) => v,
        Err(e) => {
            *conn = None; // a timed-out reply may still arrive on it
            return Err((classify(&e), e.to_string()));
        }
    };
    s.breaker.success();
    let value = match value {
        Bounded::Missing => return Err((ErrorKind::Missing, "record is gone".into())),
        Bounded::TooLong(actual) => {
            let e = super::record::RecordError::TooLong { limit, actual };
            return Err((ErrorKind::Corrupt, e.to_string()));
        }
        Bounded::Value(v) => v,
    };
    let start =
        verify(&value, &job.expect, &s.mac).map_err(|e| (ErrorKind::Corrupt, e.to_string()))?;
    let payload = &value[start..];
    if job
        .state
        .compare_exchange(PENDING, COPYING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err((
            ErrorKind::Timeout,
            "reported timed out before it landed".into(),
        ));
    }
    // SAFETY: the destination range was bounds-checked against the pool at
    // submit; the read owns it until reported, and the tick side cannot
    // report it (or drop the tier) while the state is COPYING.
    unsafe {
        std::ptr::copy_nonoverlapping(payload.as_ptr(), job.dest.0, payload.len());
    }
    job.state.store(DONE, Ordering::Release);
    Ok(payload.len() as u64)
}

/// Directory streams whose expiry a writer renewed lately, and when. A
/// directory's expiry only has to outlive its newest record, so it is
/// renewed at most every tenth of the TTL per writer, not on every write.
struct Renewals(HashMap<String, Instant>);

/// Directory keys a writer remembers renewing (it forgets all beyond).
const MAX_RENEWALS: usize = 4096;

impl Renewals {
    fn due(&mut self, dir: &str, ttl_ms: u64) -> bool {
        let every = Duration::from_millis((ttl_ms / 10).max(1));
        if self.0.get(dir).is_some_and(|t| t.elapsed() < every) {
            return false;
        }
        if self.0.len() >= MAX_RENEWALS {
            self.0.clear();
        }
        self.0.insert(dir.to_owned(), Instant::now());
        true
    }
}

/// Takes a write and whatever else is queued behind it, up to
/// `write_batch_pages` and `write_batch_bytes`, and sends them as one
/// pipeline: several writes queued on one connection cost one round trip.
fn write_worker(s: &Shared, rx: &Receiver<WriteJob>, tx: &Sender<Reply>) {
    let mut conn: Option<Conn> = None;
    let mut renewals = Renewals(HashMap::new());
    // A batch's packed commands: its records plus their keys, headers and
    // directory commands (a few hundred bytes each).
    let keep = s.cfg.write_batch_bytes as usize + s.cfg.write_batch_pages * 1024;
    let mut scratch = Scratch::new(keep);
    let mut batch: Vec<WriteJob> = Vec::new();
    let mut carry: Option<WriteJob> = None;
    loop {
        let first = match carry.take() {
            Some(job) => job,
            None => match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
        };
        let mut bytes = first.payload.len() as u64;
        batch.push(first);
        while batch.len() < s.cfg.write_batch_pages {
            let Ok(job) = rx.try_recv() else { break };
            let len = job.payload.len() as u64;
            if bytes + len > s.cfg.write_batch_bytes {
                carry = Some(job);
                break;
            }
            bytes += len;
            batch.push(job);
        }
        let started = Instant::now();
        let result = write_batch(s, &mut conn, &mut renewals, &mut scratch, &batch);
        let us = started.elapsed().as_micros() as u64;
        match &result {
            Ok(()) => {
                let n = batch.len() as u64;
                s.stats.writes_ok.fetch_add(n, Ordering::Relaxed);
                s.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                s.stats.write_batches.fetch_add(1, Ordering::Relaxed);
                s.stats.write_latency.record(us);
            }
            Err((kind, _)) => {
                for _ in &batch {
                    s.stats.write_errors.bump(*kind);
                }
                s.failed(*kind);
            }
        }
        for job in batch.drain(..) {
            let reply = Reply::Write {
                key: job.key,
                origin: job.origin,
                bytes: job.payload.len() as u64,
                result: result.clone(),
            };
            s.recycle(job.payload);
            if tx.send(reply).is_err() {
                return;
            }
        }
    }
}

fn write_batch(
    s: &Shared,
    conn: &mut Option<Conn>,
    renewals: &mut Renewals,
    scratch: &mut Scratch,
    jobs: &[WriteJob],
) -> Result<(), (ErrorKind, String)> {
    if s.stop.load(Ordering::Acquire) {
        return Err((ErrorKind::Unavailable, "tier shutting down".into()));
    }
    if s.breaker.is_open() {
        return Err((ErrorKind::Unavailable, "breaker open".into()));
    }
    let cfg = &s.cfg;
    let shards = cfg.directory_shards;
    let per_shard = cfg.directory_max_entries.div_ceil(u64::from(shards)).max(1);
    let mut puts = Vec::with_capacity(jobs.len());
    for job in jobs {
        // The payload MAC is computed as `put_many` packs the payload.
        let header = RecordHeader {
            key: job.key,
            format_digest: job.format,
            payload_len: job.payload.len() as u64,
            payload_checksum: job.checksum,
            payload_mac: [0; MAC_LEN],
            writer: s.writer_id,
            written_unix_ms: unix_ms(),
            ttl_ms: cfg.ttl_ms,
        };
        let dir = directory_key(
            &cfg.key_prefix,
            &job.key.namespace,
            shard_of(&job.key, shards),
        );
        let renew = renewals.due(&dir, cfg.ttl_ms);
        puts.push(Put {
            data_key: data_key(&cfg.key_prefix, &job.key),
            header,
            payload: &job.payload,
            dir: DirPut {
                key: dir,
                max_entries: per_shard,
                renew,
            },
        });
    }
    let c = s.conn(conn, cfg.write_timeout())?;
    if let Err(e) = c.put_many(&mut puts, &s.mac, cfg.ttl_ms, scratch) {
        *conn = None;
        for p in &puts {
            renewals.0.remove(&p.dir.key);
        }
        return Err((classify(&e), e.to_string()));
    }
    s.breaker.success();
    let mut m = s.meta_write();
    for p in &puts {
        m.insert(p.header.key, MetaEntry::from_header(&p.header));
    }
    s.publish_meta_stats(&mut m);
    Ok(())
}

/// A namespace whose directory streams are followed.
struct Follow {
    ns: Namespace,
    /// Last entry id read, per shard.
    last: Vec<Option<String>>,
}

fn refresher(s: &Shared) {
    let mut conn: Option<Conn> = None;
    let mut follows: VecDeque<Follow> = VecDeque::new();
    let mut round: u64 = 0;
    let interval = Duration::from_millis(s.cfg.refresh_interval_ms);
    loop {
        let fresh: Vec<Namespace> = {
            let mut i = s.interest.lock().unwrap_or_else(|e| e.into_inner());
            if i.queue.is_empty() && !s.stop.load(Ordering::Acquire) {
                i = s
                    .wake
                    .wait_timeout(i, interval)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            let fresh: Vec<Namespace> = i.queue.drain(..).collect();
            for ns in &fresh {
                i.queued.remove(ns);
            }
            fresh
        };
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        round += 1;
        s.stats.refresh_rounds.fetch_add(1, Ordering::Relaxed);
        adopt(s, &mut follows, fresh);
        if s.breaker.is_open() {
            health_check(s, &mut conn);
            continue;
        }
        let c = match s.conn(&mut conn, s.cfg.read_timeout()) {
            Ok(c) => c,
            Err((kind, _)) => {
                s.stats.refresh_errors.bump(kind);
                s.failed(kind);
                continue;
            }
        };
        let mut result = refresh(s, c, &mut follows);
        if result.is_ok() && round.is_multiple_of(s.cfg.validate_every_rounds) {
            result = validate(s, c, &mut follows);
        }
        if let Err(e) = result {
            conn = None;
            let kind = classify(&e);
            s.stats.refresh_errors.bump(kind);
            s.failed(kind);
        } else if !follows.is_empty() {
            // Only an answer counts: with nothing followed, nothing was sent.
            s.breaker.success();
        }
    }
}

fn adopt(s: &Shared, follows: &mut VecDeque<Follow>, fresh: Vec<Namespace>) {
    if fresh.is_empty() {
        return;
    }
    let mut m = s.meta_write();
    for ns in fresh {
        if m.followed.contains(&ns) {
            continue;
        }
        if follows.len() >= s.cfg.max_namespaces
            && let Some(old) = follows.pop_front()
        {
            m.followed.remove(&old.ns);
        }
        m.followed.insert(ns);
        follows.push_back(Follow {
            ns,
            last: vec![None; s.cfg.directory_shards as usize],
        });
    }
    s.stats
        .namespaces_followed
        .store(follows.len() as u64, Ordering::Relaxed);
}

fn health_check(s: &Shared, conn: &mut Option<Conn>) {
    let now = s.now_ms();
    if !s.breaker.may_probe(now) {
        return;
    }
    *conn = None; // a fresh connection proves the deployment is back
    let ok = s
        .conn(conn, s.cfg.read_timeout())
        .and_then(|c| c.ping().map_err(|e| (classify(&e), e.to_string())));
    match ok {
        Ok(()) => {
            s.breaker.close();
            tracing::info!("remote tier reachable again");
        }
        Err(_) => {
            *conn = None;
            s.breaker.postpone(now);
        }
    }
}

/// Reads new directory entries of every followed namespace, up to
/// `max_refresh_entries` this round.
fn refresh(s: &Shared, c: &mut Conn, follows: &mut VecDeque<Follow>) -> redis::RedisResult<()> {
    let cfg = &s.cfg;
    let mut taken = 0usize;
    loop {
        let mut more = false;
        for f in follows.iter_mut() {
            if taken >= cfg.max_refresh_entries {
                return Ok(());
            }
            let keys: Vec<String> = (0..cfg.directory_shards)
                .map(|shard| directory_key(&cfg.key_prefix, &f.ns, shard))
                .collect();
            let count = cfg.refresh_batch;
            let batches = c.read_directories(&keys, &f.last, count)?;
            let now = unix_ms();
            let mut fresh = Vec::new();
            for (shard, entries) in batches.into_iter().enumerate() {
                if entries.len() >= count {
                    more = true;
                }
                taken += entries.len();
                if let Some((id, _)) = entries.last() {
                    f.last[shard] = Some(id.clone());
                }
                for (_, header) in entries {
                    s.stats
                        .directory_entries_read
                        .fetch_add(1, Ordering::Relaxed);
                    // A forged entry (no secret) is dropped here, before
                    // it can promise anything.
                    match RecordHeader::decode(&header, &s.mac) {
                        Ok((h, _)) if h.key.namespace == f.ns => {
                            let e = MetaEntry::from_header(&h);
                            if e.expires_unix_ms > now {
                                fresh.push((h.key, e));
                            }
                        }
                        _ => {
                            s.stats
                                .directory_entries_bad
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            if !fresh.is_empty() {
                let mut m = s.meta_write();
                for (k, e) in fresh {
                    m.insert(k, e);
                }
                s.publish_meta_stats(&mut m);
            }
        }
        if !more {
            return Ok(());
        }
    }
}

/// Drops the metadata of directory streams that vanished (a flushed or
/// expired directory) and of entries past their expiry.
fn validate(s: &Shared, c: &mut Conn, follows: &mut VecDeque<Follow>) -> redis::RedisResult<()> {
    let cfg = &s.cfg;
    let mut gone: Vec<(Namespace, u32)> = Vec::new();
    for f in follows.iter_mut() {
        let shards: Vec<u32> = (0..cfg.directory_shards)
            .filter(|i| f.last[*i as usize].is_some())
            .collect();
        let keys: Vec<String> = shards
            .iter()
            .map(|i| directory_key(&cfg.key_prefix, &f.ns, *i))
            .collect();
        for (shard, exists) in shards.iter().zip(c.exists(&keys)?) {
            if !exists {
                f.last[*shard as usize] = None;
                gone.push((f.ns, *shard));
            }
        }
    }
    let now = unix_ms();
    let mut m = s.meta_write();
    if !gone.is_empty() {
        s.stats
            .directory_resets
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        let gone: HashSet<(Namespace, u32)> = gone.into_iter().collect();
        m.drop_where(|k, _| gone.contains(&(k.namespace, shard_of(k, cfg.directory_shards))));
    }
    m.drop_where(|_, e| e.expires_unix_ms <= now);
    s.publish_meta_stats(&mut m);
    Ok(())
}
