//! Backing tiers below DRAM (SSD, remote, simulated): the interface the
//! runtime's discover, read and fence stages drive.
//!
//! Discovery calls [`BackingTier::lookup`] only: metadata, no payload bytes.
//! The read stage submits reads into DRAM slots (by host-pool offset); the
//! fence stage polls completions. A tier never blocks inside a tick.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use orbitkv_components::StateKey;

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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    pub token: ReadToken,
    pub result: Result<(), TierError>,
}

pub trait BackingTier: Send {
    /// Tier name for reports and metrics (`ssd`, `remote`, `sim`).
    fn name(&self) -> &'static str;

    /// Metadata-only lookup.
    fn lookup(&self, key: &StateKey) -> Option<TierEntry>;

    /// Payload bytes held and the capacity, where the tier knows them
    /// (`orbitkv inspect`).
    fn occupancy(&self) -> Option<(u64, u64)> {
        None
    }

    /// Registers the host pool that read destinations are offsets into.
    ///
    /// # Safety
    /// As for `CopyEngine::register_host_pool`: the range stays valid until
    /// the tier is dropped, and nobody touches a destination range while a
    /// read into it is in flight.
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

    /// Demotion: keep a page DRAM is evicting. The payload is copied before
    /// this returns, so the caller frees its DRAM slot at once. A refusal
    /// is typed, and the runtime counts it by reason: nothing is dropped
    /// silently. `checksum` is the one the page carries since its bytes
    /// landed: the tier verifies the bytes it keeps against it (refusing
    /// with [`DemoteRefused::Checksum`] when they differ) and never computes
    /// a fresh one over whatever the bytes are now.
    fn demote(
        &mut self,
        _key: &StateKey,
        _format: [u8; 32],
        _payload: &[u8],
        _checksum: u64,
        _now_us: u64,
    ) -> Result<(), DemoteRefused> {
        Err(DemoteRefused::NotWritable)
    }

    /// Demotions that finished since the last call: `Ok` once visible to
    /// `lookup` (and durable per the tier's policy), or why they failed.
    fn poll_demotions(&mut self, _now_us: u64, _out: &mut Vec<Result<(), String>>) {}
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
    #[error("the bytes do not match the page's checksum")]
    Checksum,
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
}

#[derive(Default)]
struct MemoryPages {
    pages: HashMap<StateKey, (Vec<u8>, u64)>,
    fail_next: usize,
    lose_next: usize,
    extra_latency_us: u64,
}

/// An in-memory tier with a deterministic latency model: the simulated
/// remote/SSD tier of replays and runtime tests. Bytes land in the pool only
/// when the read completes. Its contents are shared with
/// [`MemoryTierHandle`]s, through which tests and the fuzzer insert, lose,
/// corrupt or fail pages while the runtime owns the tier.
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

    /// Stores a page with the checksum of its bytes.
    pub fn insert(&self, key: StateKey, bytes: Vec<u8>) {
        let sum = page_checksum(&bytes);
        self.pages().pages.insert(key, (bytes, sum));
    }

    pub fn remove(&self, key: &StateKey) -> bool {
        self.pages().pages.remove(key).is_some()
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
        MemoryTier {
            shared: handle.0.clone(),
            ..MemoryTier::new(name, latency_us, max_in_flight)
        }
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
}

impl BackingTier for MemoryTier {
    fn name(&self) -> &'static str {
        self.name
    }

    fn lookup(&self, key: &StateKey) -> Option<TierEntry> {
        self.pages().pages.get(key).map(|(b, sum)| TierEntry {
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
        let token = ReadToken(self.next_token);
        self.next_token += 1;
        let extra = {
            let mut f = self.pages();
            if f.lose_next > 0 {
                f.lose_next -= 1;
                drop(f);
                self.lost += 1;
                return Ok(token);
            }
            f.extra_latency_us
        };
        self.pending.insert(
            (now_us + self.latency_us + extra, token),
            PendingRead {
                key: *key,
                offset: host_offset,
                len,
            },
        );
        Ok(token)
    }

    fn poll(&mut self, now_us: u64, out: &mut Vec<ReadDone>) {
        let shared = self.shared.clone();
        let mut pages = shared.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now_us {
                break;
            }
            let ((_, token), read) = entry.remove_entry();
            let result = if pages.fail_next > 0 {
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
        _now_us: u64,
    ) -> Result<(), DemoteRefused> {
        if !self.writable {
            return Err(DemoteRefused::NotWritable);
        }
        let kept = payload.to_vec();
        let sum = page_checksum(&kept);
        if sum != checksum {
            return Err(DemoteRefused::Checksum);
        }
        self.pages().pages.insert(*key, (kept, sum));
        self.demoted += 1;
        Ok(())
    }

    fn poll_demotions(&mut self, _now_us: u64, out: &mut Vec<Result<(), String>>) {
        out.extend((0..std::mem::take(&mut self.demoted)).map(|_| Ok(())));
    }
}
