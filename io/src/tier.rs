//! Backing tiers below DRAM (SSD, remote, simulated): the interface the
//! runtime's discover, read and fence stages drive.
//!
//! Discovery calls [`BackingTier::lookup`] only: metadata, no payload bytes.
//! The read stage submits reads into DRAM slots (by host-pool offset); the
//! fence stage polls completions. A tier never blocks inside a tick.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use orbitkv_components::api::MissReason;
use orbitkv_components::{Namespace, StateKey};

use crate::checksum::page_checksum;

/// What a tier knows about a page without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierEntry {
    pub bytes: u64,
    /// [`page_checksum`] of the payload, verified after every read.
    pub checksum: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReadToken(pub u64);

/// Names one in-place demotion until [`BackingTier::poll_released`]
/// returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DemoteToken(pub u64);

/// How a tier took a page DRAM is evicting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demoted {
    /// The tier holds its own copy: the caller frees the DRAM slot at once.
    Copied,
    /// The tier writes straight from the registered host pool: the caller
    /// keeps that range's bytes unchanged (and the slot allocated) until
    /// `poll_released` returns this token.
    InPlace(DemoteToken),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    #[error("no host pool is registered")]
    NoHostPool,
    #[error("page is not in this tier")]
    NotFound,
    #[error("read of {len} bytes at host offset {offset} is outside the pool ({size} bytes)")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("page holds {actual} bytes, {expected} were requested")]
    SizeMismatch { expected: u64, actual: u64 },
    #[error("{0} reads in flight; the limit is {1}")]
    QueueFull(usize, usize),
    #[error("I/O error: {0}")]
    Io(String),
    /// The stored record failed verification (header, key, length or
    /// payload checksum); the tier has dropped it. The runtime reports the
    /// miss as `checksum`.
    #[error("stored page failed verification")]
    Corrupt,
    /// The store cannot be reached (connection refused or lost, cluster
    /// down for the slot, breaker open).
    #[error("tier unavailable: {0}")]
    Unavailable(String),
    /// The read did not complete by its deadline.
    #[error("read past its deadline")]
    Timeout,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    pub token: ReadToken,
    pub result: Result<(), TierError>,
}

/// One change of what a tier's index holds: a page became readable from
/// it (its record landed) or stopped being so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierChange {
    Stored(StateKey),
    Removed(StateKey),
}

/// A tier's index changes for the manager's event stream, between two
/// drains: at most `cap` (past it they are dropped, the drain says so,
/// and the whole index is listed again); and the pages already indexed
/// when recording starts (a restart's rescan), listed as stored, `cap` a
/// drain. A listed page is checked against the index as it is listed, so
/// a page removed before its turn is never advertised.
#[derive(Debug, Default)]
pub struct TierJournal {
    cap: usize,
    changes: Vec<TierChange>,
    lost: bool,
    /// Pages indexed before recording began (or at a loss), not listed yet.
    relist: Vec<StateKey>,
}

impl TierJournal {
    /// Starts recording; `present` (the index now) is listed first.
    pub fn start(&mut self, cap: usize, present: impl Iterator<Item = StateKey>) {
        self.cap = cap;
        self.relist = present.collect();
    }

    pub fn is_on(&self) -> bool {
        self.cap > 0
    }

    /// Lists `present` (the index now) again over the next drains: the
    /// subscriber forgot what it was told (another medium's loss).
    pub fn relist(&mut self, present: impl Iterator<Item = StateKey>) {
        if self.is_on() {
            self.relist = present.collect();
        }
    }

    /// Records a change (nothing while off).
    pub fn push(&mut self, change: TierChange) {
        if self.cap == 0 {
            return;
        }
        if self.changes.len() >= self.cap {
            self.changes.clear();
            self.lost = true;
            return;
        }
        self.changes.push(change);
    }

    /// Moves what is due to `out`: up to `cap` listed pages still indexed
    /// (`indexed`), then the recorded changes. True when changes were lost
    /// since the last drain: the subscriber forgets, and `all` (the index
    /// now) is listed again over the next drains.
    pub fn take<'a>(
        &mut self,
        out: &mut Vec<TierChange>,
        indexed: impl Fn(&StateKey) -> bool,
        all: impl FnOnce() -> Box<dyn Iterator<Item = StateKey> + 'a>,
    ) -> bool {
        let lost = std::mem::take(&mut self.lost);
        if lost {
            self.changes.clear();
            self.relist = all().collect();
        }
        let n = self.relist.len().min(self.cap.max(1));
        let start = self.relist.len() - n;
        out.extend(
            self.relist
                .drain(start..)
                .filter(|k| indexed(k))
                .map(TierChange::Stored),
        );
        out.append(&mut self.changes);
        lost
    }
}

pub trait BackingTier: Send {
    /// Tier name for reports and metrics (`ssd`, `remote`, `sim`).
    fn name(&self) -> &'static str;

    /// Metadata-only lookup.
    fn lookup(&self, key: &StateKey) -> Option<TierEntry>;

    /// Whether the tier cannot be reached now (a remote store down, its
    /// breaker open). Its lookups answer "absent" meanwhile, so "absent"
    /// alone does not say the page is gone: a read that finds its page in
    /// no tier while one is unavailable misses with that tier's reason for
    /// [`TierError::Unavailable`], not as churn.
    fn unavailable(&self) -> bool {
        false
    }

    /// Payload bytes held and the capacity, where the tier knows them
    /// (`orbitkv inspect`).
    fn occupancy(&self) -> Option<(u64, u64)> {
        None
    }

    /// Registers the host pool that read destinations are offsets into, and
    /// that in-place demotions write from.
    ///
    /// # Safety
    /// As for `CopyEngine::register_host_pool`: the range stays valid until
    /// the tier is dropped, nobody touches a destination range while a
    /// read into it is in flight, and nobody writes a range while an
    /// in-place demotion from it is unreleased ([`Demoted::InPlace`] until
    /// [`poll_released`](Self::poll_released) returns its token).
    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), TierError>;

    /// Starts reading `key` into `[host_offset, host_offset + len)`.
    fn submit_read(
        &mut self,
        key: &StateKey,
        host_offset: u64,
        len: u64,
        now_us: u64,
    ) -> Result<ReadToken, TierError>;

    /// Appends finished reads; never blocks.
    fn poll(&mut self, now_us: u64, out: &mut Vec<ReadDone>);

    fn in_flight(&self) -> usize;

    /// Demotion: keep a page DRAM is evicting. Either the payload is
    /// copied before this returns ([`Demoted::Copied`]: the caller frees its
    /// DRAM slot at once), or, where `payload` lies in the registered host
    /// pool and the tier can write from it directly, the tier writes
    /// straight from there ([`Demoted::InPlace`]: the caller keeps the
    /// slot, bytes unchanged, until [`poll_released`](Self::poll_released)
    /// returns the token). A refusal is typed, and the runtime counts it by
    /// reason: nothing is dropped silently.
    ///
    /// `checksum` is the one the page carries since its bytes landed; the
    /// tier never computes a fresh one over whatever the bytes are now.
    /// Tiers that copy may verify the copy against it (refusing with
    /// [`DemoteRefused::Checksum`]); the SSD tier records it as the
    /// record's checksum without hashing, so bytes altered in DRAM after
    /// they landed are stored but refused when read
    /// ([`TierError::Corrupt`], and the record leaves the tier).
    fn demote(
        &mut self,
        _key: &StateKey,
        _format: [u8; 32],
        _payload: &[u8],
        _checksum: u64,
        _now_us: u64,
    ) -> Result<Demoted, DemoteRefused> {
        Err(DemoteRefused::NotWritable)
    }

    /// Tokens of in-place demotions whose source bytes the tier no longer
    /// needs (the write I/O finished, successfully or not; durability is
    /// reported separately by [`poll_demotions`](Self::poll_demotions)).
    /// Every token is returned exactly once. Never blocks.
    fn poll_released(&mut self, _out: &mut Vec<DemoteToken>) {}

    /// In-place demotions not yet released (tokens `poll_released` has not
    /// returned yet).
    fn demotions_holding(&self) -> usize {
        0
    }

    /// Demotions that finished since the last call: `Ok` once visible to
    /// `lookup` (and durable per the tier's policy), or why they failed.
    fn poll_demotions(&mut self, _now_us: u64, _out: &mut Vec<Result<(), DemoteFailed>>) {}

    /// Shutdown (or a restart), never inside a tick: blocks until every
    /// demotion the tier accepted has finished, so the next
    /// [`poll_demotions`](Self::poll_demotions) reports each of them and
    /// [`poll_released`](Self::poll_released) returns every token. A tier
    /// whose writes finish on their own when it is dropped would otherwise
    /// take them out of the counts. The default, for tiers that report
    /// every accepted write without waiting (or never take writes), does
    /// nothing.
    fn finish_demotions(&mut self) {}

    /// Write-through: a page was just published into DRAM and stays there;
    /// a tier that shares pages with other hosts copies it now (always a
    /// copy, verified against `checksum`, the one the copy computed as the
    /// bytes landed: [`DemoteRefused::Checksum`] when they differ).
    /// Refusals as for [`demote`](Self::demote); completions are the tier's
    /// own business (they are not demotions).
    fn write_through(
        &mut self,
        _key: &StateKey,
        _format: [u8; 32],
        _payload: &[u8],
        _checksum: u64,
        _now_us: u64,
    ) -> Result<(), DemoteRefused> {
        Err(DemoteRefused::NotWritable)
    }

    /// The miss reason a failed read of this tier becomes.
    fn miss_reason(&self, e: &TierError) -> MissReason {
        local_miss_reason(e)
    }

    /// Forgets every page of `namespace` (`orbitkv clear`): `lookup` finds
    /// none of them afterwards. Returns how many it dropped, or why it
    /// cannot (the caller reports it; nothing is dropped silently).
    fn clear_namespace(&mut self, _namespace: &Namespace) -> Result<u64, String> {
        Err(format!("the {} tier cannot clear a namespace", self.name()))
    }

    /// Starts recording what the tier's index gains and loses (the
    /// manager's KV events), at most `cap` changes between drains; the
    /// pages it holds now are reported as stored first. A tier whose index
    /// others change out of sight (the remote store) records nothing.
    fn record_changes(&mut self, _cap: usize) {}

    /// Appends the index changes due since the last call (see
    /// [`TierJournal::take`]); true when some were lost.
    fn take_changes(&mut self, _out: &mut Vec<TierChange>) -> bool {
        false
    }

    /// Lists every indexed page as stored again over the next drains
    /// (while recording): the subscriber was told to forget.
    fn relist_changes(&mut self) {}

    /// Calls `f` with every page the index holds now (the manager's
    /// presence filter is rebuilt from them) and returns true; false,
    /// calling nothing, where the tier cannot list them all (the remote
    /// store: other hosts add pages it learns of only when asked).
    fn list_keys(&self, _f: &mut dyn FnMut(&StateKey)) -> bool {
        false
    }
}

/// Miss reasons of a tier on this host (SSD).
pub fn local_miss_reason(e: &TierError) -> MissReason {
    match e {
        TierError::NotFound => MissReason::EvictedDuringRead,
        TierError::Corrupt => MissReason::Checksum,
        _ => MissReason::IoError,
    }
}

/// Miss reasons of a remote store: what operators of the cluster need to
/// tell apart.
pub fn remote_miss_reason(e: &TierError) -> MissReason {
    match e {
        TierError::NotFound => MissReason::RemoteMissing,
        TierError::Corrupt | TierError::SizeMismatch { .. } => MissReason::RemoteCorrupt,
        TierError::Timeout => MissReason::RemoteTimeout,
        _ => MissReason::RemoteUnavailable,
    }
}

/// Why a tier did not take a page DRAM is evicting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, thiserror::Error)]
pub enum DemoteRefused {
    /// The tier takes no writes (a remote store filled out of band): the
    /// next tier is asked.
    #[error("the tier takes no writes")]
    NotWritable,
    #[error("the write queue is full")]
    QueueFull,
    #[error("the admission policy declined the page")]
    AdmissionPolicy,
    #[error("the page is larger than the tier stores")]
    TooLarge,
    #[error("the page is empty")]
    Empty,
    #[error("the key is already stored or being written")]
    Duplicate,
    #[error("the tier is out of space")]
    NoSpace,
    #[error("the tier is unavailable")]
    Unavailable,
    /// The bytes no longer match the checksum the page carries since they
    /// landed (altered in memory): never stored under a fresh checksum.
    /// Only tiers that copy and verify the copy refuse this way (the remote
    /// tier, its write-through, the simulator's copying tier); the SSD tier
    /// stores the carried checksum unverified and refuses such bytes when
    /// they are read ([`TierError::Corrupt`]).
    #[error("the bytes do not match the page's checksum")]
    Checksum,
}

/// Why a demotion the tier accepted did not become visible. The strings
/// are the operating system's or the store's own words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DemoteFailed {
    #[error("the tier ran out of space")]
    NoSpace,
    /// The write or its sync failed (or wrote short).
    #[error("write failed: {0}")]
    Io(String),
    /// The store could not be reached (files cannot be created, the remote
    /// is down or refused the connection).
    #[error("the tier is unavailable: {0}")]
    Unavailable(String),
    #[error("the write passed its deadline")]
    Timeout,
    /// The store answered with an error.
    #[error("the store refused the write: {0}")]
    Refused(String),
}

impl DemoteFailed {
    /// The failure's name in metrics and reports.
    pub fn as_str(&self) -> &'static str {
        match self {
            DemoteFailed::NoSpace => "no_space",
            DemoteFailed::Io(_) => "io",
            DemoteFailed::Unavailable(_) => "unavailable",
            DemoteFailed::Timeout => "timeout",
            DemoteFailed::Refused(_) => "refused",
        }
    }
}

impl DemoteRefused {
    /// The reason's name in metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            DemoteRefused::NotWritable => "not_writable",
            DemoteRefused::QueueFull => "queue_full",
            DemoteRefused::AdmissionPolicy => "admission_policy",
            DemoteRefused::TooLarge => "too_large",
            DemoteRefused::Empty => "empty",
            DemoteRefused::Duplicate => "duplicate",
            DemoteRefused::NoSpace => "no_space",
            DemoteRefused::Unavailable => "unavailable",
            DemoteRefused::Checksum => "checksum",
        }
    }
}

struct PoolPtr(*mut u8, u64);
// SAFETY: the pointer is only dereferenced under the contract of
// `register_host_pool`, by the owner of the tier.
unsafe impl Send for PoolPtr {}

struct PendingRead {
    key: StateKey,
    offset: u64,
    len: u64,
    /// Remote mode: the checksum the metadata promised at submit.
    expect_sum: u64,
    /// Remote mode: completes as `Timeout` (it would have finished past
    /// its deadline).
    timed_out: bool,
}

/// Remote-store semantics for a simulated tier (the simulator's model of
/// `remote::RemoteTier`): lookups answer from metadata that can go stale,
/// reads verify the record against it and have a deadline, the store can
/// be down for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimRemote {
    /// A read whose latency exceeds this completes as `Timeout` at the
    /// deadline.
    pub read_timeout_us: u64,
    /// Published pages are written through.
    pub write_through: bool,
}

#[derive(Default)]
struct MemoryPages {
    pages: orbitkv_components::KeyMap<(Vec<u8>, u64)>,
    fail_next: usize,
    lose_next: usize,
    extra_latency_us: u64,
    remote: Option<SimRemote>,
    /// Remote mode: what lookups believe (length, checksum); a hint.
    meta: orbitkv_components::KeyMap<(u64, u64)>,
    /// Remote mode: down (lookups absent, reads fail) before this time.
    down_until_us: u64,
    /// In-place demotions (opt-in, see [`MemoryTierHandle::set_in_place`]):
    /// released this long after `demote`.
    in_place_us: Option<u64>,
    /// The latest time the tier was polled or submitted to.
    now_us: u64,
    /// Changes of `pages` (local mode) for KV events, off unless asked.
    journal: TierJournal,
}

impl MemoryPages {
    /// Takes a page out (the one way one leaves, but `flush`).
    fn unstore(&mut self, key: &StateKey) -> bool {
        let gone = self.pages.remove(key).is_some();
        if gone && self.remote.is_none() {
            self.journal.push(TierChange::Removed(*key));
        }
        gone
    }

    fn down(&self) -> bool {
        self.remote.is_some() && self.now_us < self.down_until_us
    }

    /// Remote mode: checks a finished read of `read` against the record,
    /// as `RemoteTier` does; a failed record leaves the metadata.
    fn verify_remote(&mut self, read: &PendingRead) -> Result<(), TierError> {
        if read.timed_out {
            return Err(TierError::Timeout);
        }
        if self.down() {
            return Err(TierError::Unavailable("simulated remote down".into()));
        }
        let verdict = match self.pages.get(&read.key) {
            None => Err(TierError::NotFound),
            Some((bytes, sum)) => {
                if bytes.len() as u64 != read.len
                    || *sum != read.expect_sum
                    || page_checksum(bytes) != *sum
                {
                    Err(TierError::Corrupt)
                } else {
                    Ok(())
                }
            }
        };
        if verdict.is_err()
            && self
                .meta
                .get(&read.key)
                .is_some_and(|(_, s)| *s == read.expect_sum)
        {
            self.meta.remove(&read.key);
        }
        verdict
    }

    /// In remote mode a write is refused while the store is down or when
    /// the key is stored already.
    fn admit(&self, key: &StateKey) -> Result<(), DemoteRefused> {
        if self.remote.is_some() {
            if self.down() {
                return Err(DemoteRefused::Unavailable);
            }
            if self.meta.contains_key(key) {
                return Err(DemoteRefused::Duplicate);
            }
        }
        Ok(())
    }

    /// Keeps a copy of `payload` (a demotion or a write-through), refused
    /// as [`admit`](Self::admit) says; the copy is verified against the
    /// checksum the page carries, as the copying tiers do.
    fn keep(&mut self, key: &StateKey, payload: &[u8], checksum: u64) -> Result<(), DemoteRefused> {
        self.admit(key)?;
        let kept = payload.to_vec();
        if page_checksum(&kept) != checksum {
            return Err(DemoteRefused::Checksum);
        }
        self.store(*key, kept, checksum);
        Ok(())
    }

    fn store(&mut self, key: StateKey, bytes: Vec<u8>, sum: u64) {
        if self.remote.is_some() {
            self.meta.insert(key, (bytes.len() as u64, sum));
        }
        if self.pages.insert(key, (bytes, sum)).is_none() && self.remote.is_none() {
            self.journal.push(TierChange::Stored(key));
        }
    }
}

/// An in-place demotion of the simulated tier, copied out of the pool only
/// at its release.
struct HeldDemotion {
    key: StateKey,
    offset: u64,
    len: u64,
    checksum: u64,
}

/// An in-memory tier with a deterministic latency model: the simulated
/// remote/SSD tier of replays and runtime tests. Bytes land in the pool only
/// when the read completes. Its contents are shared with
/// [`MemoryTierHandle`]s, through which tests and the fuzzer insert, lose,
/// corrupt or fail pages while the runtime owns the tier.
///
/// Demotions are copied at once by default. With
/// [`MemoryTierHandle::set_in_place`] a demotion whose payload lies in the
/// registered pool is taken [`Demoted::InPlace`], like the SSD tier does:
/// the bytes are copied out of the pool only at the release (the first
/// poll at or after `demote`'s clock plus the delay), stored under the
/// checksum the page carried, so a runtime that reuses the slot before the
/// token comes back stores wrong bytes and a later read fails its checksum.
/// Drop releases (copies) whatever is still held.
pub struct MemoryTier {
    name: &'static str,
    /// Accepts demotions from DRAM (a simulated SSD), or only reads (a
    /// remote store that pages are put into out of band).
    writable: bool,
    demoted: usize,
    /// Reads whose completion was lost: never reported, still in flight.
    lost: usize,
    shared: Arc<Mutex<MemoryPages>>,
    pool: Option<PoolPtr>,
    latency_us: u64,
    max_in_flight: usize,
    next_token: u64,
    pending: BTreeMap<(u64, ReadToken), PendingRead>,
    next_demote: u64,
    /// In-place demotions by release time.
    held: BTreeMap<(u64, DemoteToken), HeldDemotion>,
    /// Released, not yet returned by `poll_released`.
    released: Vec<DemoteToken>,
    /// The latest clock the tier was given.
    now_us: u64,
}

/// Outside access to a [`MemoryTier`]'s pages.
#[derive(Clone)]
pub struct MemoryTierHandle(Arc<Mutex<MemoryPages>>);

impl MemoryTierHandle {
    fn pages(&self) -> std::sync::MutexGuard<'_, MemoryPages> {
        // A panic while holding this lock can only come from a test; the
        // map itself is always consistent, so keep using it.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores a page with the checksum of its bytes (and, in remote mode,
    /// its metadata).
    pub fn insert(&self, key: StateKey, bytes: Vec<u8>) {
        let sum = page_checksum(&bytes);
        self.pages().store(key, bytes, sum);
    }

    /// In-place demotions: `Some(us)` makes `demote` of a payload inside
    /// the registered pool return [`Demoted::InPlace`] and copy the bytes
    /// out `us` later (at the first poll past it); `None` (the default)
    /// copies at once.
    pub fn set_in_place(&self, release_after_us: Option<u64>) {
        self.pages().in_place_us = release_after_us;
    }

    /// Gives the tier remote-store semantics ([`SimRemote`]).
    pub fn set_remote(&self, remote: SimRemote) {
        self.pages().remote = Some(remote);
    }

    pub fn is_remote(&self) -> bool {
        self.pages().remote.is_some()
    }

    /// Remote mode: the store is down until `until_us`.
    pub fn down_until(&self, until_us: u64) {
        self.pages().down_until_us = until_us;
    }

    /// Remote mode: every record is gone, the metadata still promises them
    /// (a flushed cluster). Returns how many records went.
    pub fn flush(&self) -> usize {
        let mut p = self.pages();
        let n = p.pages.len();
        p.pages.clear();
        n
    }

    /// Replaces a page with other bytes under a valid checksum of those
    /// bytes (an owner that restarted and wrote again); lookups still
    /// promise the old ones.
    pub fn rewrite(&self, key: &StateKey) -> bool {
        match self.pages().pages.get_mut(key) {
            Some((bytes, sum)) if !bytes.is_empty() => {
                bytes.iter_mut().for_each(|b| *b ^= 0x5a);
                *sum = page_checksum(bytes);
                true
            }
            _ => false,
        }
    }

    /// Drops the last byte of a page, keeping its checksum (a truncated
    /// value).
    pub fn truncate(&self, key: &StateKey) -> bool {
        match self.pages().pages.get_mut(key) {
            Some((bytes, _)) if !bytes.is_empty() => {
                bytes.pop();
                true
            }
            _ => false,
        }
    }

    /// The page is gone. In remote mode its metadata stays (stale, until a
    /// read finds the record missing).
    pub fn remove(&self, key: &StateKey) -> bool {
        self.pages().unstore(key)
    }

    /// Flips one payload byte without updating the checksum.
    pub fn corrupt(&self, key: &StateKey) -> bool {
        match self.pages().pages.get_mut(key) {
            Some((bytes, _)) if !bytes.is_empty() => {
                bytes[0] ^= 0xff;
                true
            }
            _ => false,
        }
    }

    /// The next `n` reads to complete fail with an I/O error.
    pub fn fail_next(&self, n: usize) {
        self.pages().fail_next = n;
    }

    /// Whether the tier holds `key`.
    pub fn contains(&self, key: &StateKey) -> bool {
        self.pages().pages.contains_key(key)
    }

    /// The next `n` reads submitted never complete (a lost completion).
    pub fn lose_next(&self, n: usize) {
        self.pages().lose_next = n;
    }

    /// Reads submitted from now on take `extra_us` longer.
    pub fn delay(&self, extra_us: u64) {
        self.pages().extra_latency_us = extra_us;
    }

    pub fn len(&self) -> usize {
        self.pages().pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl MemoryTier {
    pub fn new(name: &'static str, latency_us: u64, max_in_flight: usize) -> Self {
        MemoryTier {
            name,
            writable: false,
            demoted: 0,
            lost: 0,
            shared: Arc::default(),
            pool: None,
            latency_us,
            max_in_flight,
            next_token: 0,
            pending: BTreeMap::new(),
            next_demote: 0,
            held: BTreeMap::new(),
            released: Vec::new(),
            now_us: 0,
        }
    }

    /// A tier over existing pages (a restarted manager finds its lower
    /// tiers as they were).
    pub fn from_handle(
        name: &'static str,
        handle: &MemoryTierHandle,
        latency_us: u64,
        max_in_flight: usize,
    ) -> Self {
        let mut tier = MemoryTier::new(name, latency_us, max_in_flight);
        tier.shared = handle.0.clone();
        tier
    }

    /// Makes the tier accept demotions from DRAM.
    pub fn writable(mut self) -> Self {
        self.writable = true;
        self
    }

    pub fn handle(&self) -> MemoryTierHandle {
        MemoryTierHandle(self.shared.clone())
    }

    fn pages(&self) -> std::sync::MutexGuard<'_, MemoryPages> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pool offset of `payload` when it lies entirely inside the
    /// registered pool.
    fn pool_offset(&self, payload: &[u8]) -> Option<u64> {
        let pool = self.pool.as_ref()?;
        let start = (payload.as_ptr() as usize).checked_sub(pool.0 as usize)? as u64;
        let end = start.checked_add(payload.len() as u64)?;
        (end <= pool.1).then_some(start)
    }

    /// Copies out every in-place demotion due by `now_us` (all with
    /// `u64::MAX`) and releases its token.
    fn release_due(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
        while let Some(entry) = self.held.first_entry() {
            if entry.key().0 > now_us {
                break;
            }
            let ((_, token), d) = entry.remove_entry();
            let Some(pool) = &self.pool else {
                // Unreachable: in-place demotions need a registered pool.
                self.released.push(token);
                continue;
            };
            // SAFETY: the range was inside the registered pool at demote,
            // and the pool stays valid until the tier is dropped
            // (register_host_pool contract).
            let bytes = unsafe {
                std::slice::from_raw_parts(pool.0.add(d.offset as usize), d.len as usize)
            }
            .to_vec();
            // Whatever the slot holds now, under the checksum the page
            // carried: no verification, as on the SSD's write path.
            self.pages().store(d.key, bytes, d.checksum);
            self.demoted += 1;
            self.released.push(token);
        }
    }
}

impl Drop for MemoryTier {
    fn drop(&mut self) {
        // The "writes" in flight finish before the tier is gone.
        self.release_due(u64::MAX);
    }
}

impl BackingTier for MemoryTier {
    fn name(&self) -> &'static str {
        self.name
    }

    fn clear_namespace(&mut self, namespace: &Namespace) -> Result<u64, String> {
        let mut p = self.pages();
        let gone: Vec<StateKey> = p
            .pages
            .keys()
            .filter(|k| k.namespace == *namespace)
            .copied()
            .collect();
        for k in &gone {
            p.unstore(k);
        }
        p.meta.retain(|k, _| k.namespace != *namespace);
        Ok(gone.len() as u64)
    }

    fn record_changes(&mut self, cap: usize) {
        let mut p = self.pages();
        let present: Vec<StateKey> = p.pages.keys().copied().collect();
        p.journal.start(cap, present.into_iter());
    }

    fn relist_changes(&mut self) {
        let mut p = self.pages();
        let present: Vec<StateKey> = p.pages.keys().copied().collect();
        p.journal.relist(present.into_iter());
    }

    fn take_changes(&mut self, out: &mut Vec<TierChange>) -> bool {
        let mut guard = self.pages();
        let p = &mut *guard;
        let pages = &p.pages;
        p.journal.take(
            out,
            |k| pages.contains_key(k),
            || Box::new(pages.keys().copied()),
        )
    }

    fn unavailable(&self) -> bool {
        self.pages().down()
    }

    fn list_keys(&self, f: &mut dyn FnMut(&StateKey)) -> bool {
        let p = self.pages();
        if p.remote.is_some() {
            return false;
        }
        p.pages.keys().for_each(f);
        true
    }

    fn lookup(&self, key: &StateKey) -> Option<TierEntry> {
        let p = self.pages();
        if p.remote.is_some() {
            if p.down() {
                return None;
            }
            return p.meta.get(key).map(|(bytes, sum)| TierEntry {
                bytes: *bytes,
                checksum: *sum,
            });
        }
        p.pages.get(key).map(|(b, sum)| TierEntry {
            bytes: b.len() as u64,
            checksum: *sum,
        })
    }

    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), TierError> {
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
        let Some(pool) = &self.pool else {
            return Err(TierError::NoHostPool);
        };
        if host_offset.checked_add(len).is_none_or(|end| end > pool.1) {
            return Err(TierError::OutOfBounds {
                offset: host_offset,
                len,
                size: pool.1,
            });
        }
        if self.in_flight() >= self.max_in_flight {
            return Err(TierError::QueueFull(self.in_flight(), self.max_in_flight));
        }
        let (extra, remote, expect_sum) = {
            let mut f = self.pages();
            f.now_us = f.now_us.max(now_us);
            let mut expect_sum = 0;
            if f.remote.is_some() {
                if f.down() {
                    return Err(TierError::Unavailable("simulated remote down".into()));
                }
                match f.meta.get(key) {
                    None => return Err(TierError::NotFound),
                    Some((bytes, _)) if *bytes != len => {
                        return Err(TierError::SizeMismatch {
                            expected: len,
                            actual: *bytes,
                        });
                    }
                    Some((_, sum)) => expect_sum = *sum,
                }
            }
            let token = ReadToken(self.next_token);
            if f.lose_next > 0 {
                f.lose_next -= 1;
                drop(f);
                self.next_token += 1;
                self.lost += 1;
                return Ok(token);
            }
            (f.extra_latency_us, f.remote, expect_sum)
        };
        let token = ReadToken(self.next_token);
        self.next_token += 1;
        let mut done_at = now_us + self.latency_us + extra;
        let mut timed_out = false;
        if let Some(r) = remote
            && self.latency_us + extra > r.read_timeout_us
        {
            done_at = now_us + r.read_timeout_us;
            timed_out = true;
        }
        self.pending.insert(
            (done_at, token),
            PendingRead {
                key: *key,
                offset: host_offset,
                len,
                expect_sum,
                timed_out,
            },
        );
        Ok(token)
    }

    fn poll(&mut self, now_us: u64, out: &mut Vec<ReadDone>) {
        self.release_due(now_us);
        let shared = self.shared.clone();
        let mut pages = shared.lock().unwrap_or_else(|e| e.into_inner());
        pages.now_us = pages.now_us.max(now_us);
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now_us {
                break;
            }
            let ((_, token), read) = entry.remove_entry();
            let checked = if pages.remote.is_some() {
                pages.verify_remote(&read)
            } else {
                Ok(())
            };
            let result = if let Err(e) = checked {
                Err(e)
            } else if pages.fail_next > 0 {
                pages.fail_next -= 1;
                Err(TierError::Io("injected read error".into()))
            } else {
                match pages.pages.get(&read.key) {
                    None => Err(TierError::NotFound),
                    Some((bytes, _)) if bytes.len() as u64 != read.len => {
                        Err(TierError::SizeMismatch {
                            expected: read.len,
                            actual: bytes.len() as u64,
                        })
                    }
                    Some((bytes, _)) => {
                        let pool = self.pool.as_ref().expect("checked at submit");
                        // SAFETY: bounds checked at submit; the runtime owns
                        // the destination slot exclusively until this read
                        // is reported (register_host_pool contract).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                pool.0.add(read.offset as usize),
                                bytes.len(),
                            );
                        }
                        Ok(())
                    }
                }
            };
            out.push(ReadDone { token, result });
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.lost
    }

    fn demote(
        &mut self,
        key: &StateKey,
        _format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        now_us: u64,
    ) -> Result<Demoted, DemoteRefused> {
        if !self.writable {
            return Err(DemoteRefused::NotWritable);
        }
        self.now_us = self.now_us.max(now_us);
        let in_place = self.pages().in_place_us;
        if let Some(after) = in_place
            && let Some(offset) = self.pool_offset(payload)
        {
            self.pages().admit(key)?;
            let token = DemoteToken(self.next_demote);
            self.next_demote += 1;
            self.held.insert(
                (now_us.saturating_add(after), token),
                HeldDemotion {
                    key: *key,
                    offset,
                    len: payload.len() as u64,
                    checksum,
                },
            );
            return Ok(Demoted::InPlace(token));
        }
        self.pages().keep(key, payload, checksum)?;
        self.demoted += 1;
        Ok(Demoted::Copied)
    }

    fn poll_released(&mut self, out: &mut Vec<DemoteToken>) {
        self.release_due(self.now_us);
        out.append(&mut self.released);
    }

    fn demotions_holding(&self) -> usize {
        self.held.len() + self.released.len()
    }

    fn poll_demotions(&mut self, now_us: u64, out: &mut Vec<Result<(), DemoteFailed>>) {
        self.release_due(now_us);
        out.extend((0..std::mem::take(&mut self.demoted)).map(|_| Ok(())));
    }

    /// The held writes "finish" now, as they would at drop.
    fn finish_demotions(&mut self) {
        self.release_due(u64::MAX);
    }

    fn write_through(
        &mut self,
        key: &StateKey,
        _format: [u8; 32],
        payload: &[u8],
        checksum: u64,
        _now_us: u64,
    ) -> Result<(), DemoteRefused> {
        let mut p = self.pages();
        if !p.remote.is_some_and(|r| r.write_through) {
            return Err(DemoteRefused::NotWritable);
        }
        p.keep(key, payload, checksum)
    }

    fn miss_reason(&self, e: &TierError) -> MissReason {
        if self.pages().remote.is_some() {
            remote_miss_reason(e)
        } else {
            local_miss_reason(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_components::Namespace;

    fn key(i: u64) -> StateKey {
        StateKey::new(Namespace([2; 32]), 0, &i.to_le_bytes()).unwrap()
    }

    const SLOT: usize = 4096;

    /// Views of a test pool, all through one raw pointer (the tier holds
    /// the same pointer).
    struct Mem {
        _buf: Vec<u8>,
        base: *mut u8,
    }

    impl Mem {
        fn new(slots: usize) -> Mem {
            let mut buf = vec![0u8; slots * SLOT];
            let base = buf.as_mut_ptr();
            Mem { _buf: buf, base }
        }

        fn slot(&self, i: usize) -> &[u8] {
            // SAFETY: inside `_buf`; `fill` is never called while a view
            // is held.
            unsafe { std::slice::from_raw_parts(self.base.add(i * SLOT), SLOT) }
        }

        fn fill(&self, i: usize, v: u8) {
            // SAFETY: inside `_buf`, through the pointer the tier holds.
            unsafe { std::ptr::write_bytes(self.base.add(i * SLOT), v, SLOT) }
        }
    }

    #[test]
    fn in_place_demotions_copy_out_at_release() {
        let mem = Mem::new(4);
        let mut tier = MemoryTier::new("sim", 10, 8).writable();
        let handle = tier.handle();
        handle.set_in_place(Some(100));
        // SAFETY: `mem` outlives the tier (dropped after it, below).
        unsafe { tier.register_host_pool(mem.base, 4 * SLOT as u64) }.unwrap();
        mem.fill(0, 1);
        mem.fill(1, 2);
        let (sum1, sum2) = (page_checksum(mem.slot(0)), page_checksum(mem.slot(1)));
        let Ok(Demoted::InPlace(t1)) = tier.demote(&key(1), [0; 32], mem.slot(0), sum1, 1000)
        else {
            panic!("not in place")
        };
        let Ok(Demoted::InPlace(t2)) = tier.demote(&key(2), [0; 32], mem.slot(1), sum2, 1000)
        else {
            panic!("not in place")
        };
        let outside = vec![3u8; 100];
        assert_eq!(
            tier.demote(&key(3), [0; 32], &outside, page_checksum(&outside), 1000),
            Ok(Demoted::Copied)
        );
        assert_eq!(tier.demotions_holding(), 2);
        let mut released = Vec::new();
        tier.poll_released(&mut released);
        assert!(released.is_empty(), "released before its time");
        assert!(tier.lookup(&key(1)).is_none(), "not written yet");
        // The runtime reuses slot 1 too early.
        mem.fill(1, 9);
        tier.poll(1099, &mut Vec::new());
        tier.poll_released(&mut released);
        assert!(released.is_empty());
        tier.poll(1100, &mut Vec::new());
        tier.poll_released(&mut released);
        assert_eq!(released, vec![t1, t2]);
        assert_eq!(tier.demotions_holding(), 0);
        let mut done = Vec::new();
        tier.poll_demotions(1100, &mut done);
        assert_eq!(done, vec![Ok(()); 3]);
        // Page 2 was stored as the slot held at release, under the checksum
        // it carried: a read lands bytes that fail it.
        assert_eq!(tier.lookup(&key(2)).unwrap().checksum, sum2);
        let t = tier
            .submit_read(&key(2), 2 * SLOT as u64, SLOT as u64, 2000)
            .unwrap();
        let mut reads = Vec::new();
        tier.poll(2010, &mut reads);
        assert_eq!(
            reads,
            vec![ReadDone {
                token: t,
                result: Ok(())
            }]
        );
        assert!(mem.slot(2).iter().all(|&b| b == 9));
        assert_ne!(page_checksum(mem.slot(2)), sum2);
        // Page 1 is intact.
        assert_eq!(tier.lookup(&key(1)).unwrap().checksum, sum1);
        let t = tier
            .submit_read(&key(1), 3 * SLOT as u64, SLOT as u64, 3000)
            .unwrap();
        tier.poll(3010, &mut reads);
        assert_eq!(
            reads.last(),
            Some(&ReadDone {
                token: t,
                result: Ok(())
            })
        );
        assert_eq!(page_checksum(mem.slot(3)), sum1);
        // Drop releases what is still held (the write finishes).
        mem.fill(0, 4);
        let sum4 = page_checksum(mem.slot(0));
        assert!(matches!(
            tier.demote(&key(4), [0; 32], mem.slot(0), sum4, 4000),
            Ok(Demoted::InPlace(_))
        ));
        drop(tier);
        assert!(handle.contains(&key(4)));
        drop(mem);
    }

    #[test]
    fn in_place_is_opt_in() {
        let mem = Mem::new(1);
        let mut tier = MemoryTier::new("sim", 10, 8).writable();
        // SAFETY: `mem` outlives the tier.
        unsafe { tier.register_host_pool(mem.base, SLOT as u64) }.unwrap();
        mem.fill(0, 5);
        let sum = page_checksum(mem.slot(0));
        assert_eq!(
            tier.demote(&key(1), [0; 32], mem.slot(0), sum, 0),
            Ok(Demoted::Copied)
        );
        // The copying tier still verifies against the carried checksum.
        assert_eq!(
            tier.demote(&key(2), [0; 32], mem.slot(0), sum ^ 1, 0),
            Err(DemoteRefused::Checksum)
        );
        assert!(tier.handle().contains(&key(1)));
        drop(tier);
        drop(mem);
    }
}
