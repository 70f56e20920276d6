//! The presence filter: a bitmap the manager keeps in shared memory, read
//! by every hot-path client, that says when a lookup is certain to miss.
//!
//! A bit per slot; a page key `(namespace, group, native hash)` maps to
//! one slot by XXH3-64 with the filter's seed. The manager sets a key's
//! bit before the page can be found (it drains the runtime's page
//! journals right after each tick, before it delivers the tick's events)
//! and never clears one except in a rebuild. So a clear bit means no tier
//! held the key when the client read it, and the lookup would have
//! missed with `not_found`; a set bit only means "ask the manager". The
//! filter never answers a hit: at worst a stale clear bit costs the
//! engine a recompute of a page that had just landed, which a lookup
//! sent a moment earlier would have cost too.
//!
//! ```text
//! 0     magic "OKVPRES1" | version:u32 = 1 | reserved:u32
//! 16    seed:u64       XXH3 seed of this incarnation
//! 24    words:u64      bitmap words (a power of two)
//! 32    epoch:u64      even: stable; odd: being rebuilt (a seqlock)
//! 40    open:u64       1: clear bits may answer lookups; 0: ask the manager
//! 48    beat_ms:u64    CLOCK_MONOTONIC of the manager's last tick, in ms
//! 4096  the bitmap: `words` × u64
//! ```
//!
//! A reader trusts no answer of a filter whose `beat_ms` is more than
//! [`STALE_MS`] old: a manager that died (kill -9) leaves its filter
//! mapped in every client, open, and frozen; its clients then ask the
//! socket, and find the manager gone. A manager that stops gracefully
//! closes it first.
//!
//! `open` is 0 while a lower tier cannot be reached (its pages may be
//! there and the manager's answer would name the outage), and from the
//! start when a tier cannot list its pages (the remote store, whose index
//! other hosts change). A rebuild (when the bitmap is half full of
//! removed pages' bits, or when the journal lost changes) makes the epoch
//! odd, clears and refills the bitmap, and makes it even again; a reader
//! that saw the epoch change during its read asks the manager.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use orbitkv_components::NativeHash;
use orbitkv_components::key::StateKey;
use orbitkv_components::namespace::Namespace;

const MAGIC: [u8; 8] = *b"OKVPRES1";
const VERSION: u32 = 1;
/// Bytes before the bitmap.
pub const HEADER_BYTES: usize = 4096;
const SEED: usize = 16;
const WORDS: usize = 24;
const EPOCH: usize = 32;
const OPEN: usize = 40;
const BEAT: usize = 48;
/// A manager ticks at least every second while a client is connected.
pub const STALE_MS: u64 = 5_000;

/// CLOCK_MONOTONIC in milliseconds (one clock for every process of a host).
fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1000) + ts.tv_nsec as u64 / 1_000_000
}
/// The smallest bitmap: 512 words (4 KiB).
const MIN_WORDS: u64 = 512;

/// Where a key's bit is: (word index, mask).
fn slot(
    seed: u64,
    words: u64,
    namespace: &Namespace,
    group: u32,
    native: &NativeHash,
) -> (usize, u64) {
    let mut buf = [0u8; 32 + 4 + orbitkv_components::key::MAX_NATIVE_HASH_BYTES];
    buf[..32].copy_from_slice(&namespace.0);
    buf[32..36].copy_from_slice(&group.to_le_bytes());
    let n = native.as_bytes();
    let end = 36 + n.len();
    buf[36..end].copy_from_slice(n);
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&buf[..end], seed);
    // Low bits pick the bit in the word; the rest the word.
    (((h >> 6) & (words - 1)) as usize, 1u64 << (h & 63))
}

/// Words of a bitmap of at most `bytes` (a power of two, at least 512).
pub fn words_for(bytes: u64) -> u64 {
    let words = (bytes / 8).max(MIN_WORDS);
    if words.is_power_of_two() {
        words
    } else {
        words.next_power_of_two() / 2
    }
}

/// What a rebuild reads every stored key from: it calls the given
/// function with each.
pub type KeySource<'a> = dyn FnMut(&mut dyn FnMut(&StateKey)) + 'a;

/// The manager's side: the only writer.
pub struct PresenceTable {
    file: File,
    map: memmap2::MmapRaw,
    seed: u64,
    words: u64,
    /// Bits set since the last rebuild.
    set: u64,
}

// SAFETY: shared memory reached through atomics only.
unsafe impl Send for PresenceTable {}

impl PresenceTable {
    /// A sealed memfd of `words_for(bytes)` words, every bit clear, closed
    /// to answers until [`PresenceTable::set_open`].
    pub fn create(bytes: u64, seed: u64) -> io::Result<PresenceTable> {
        let words = words_for(bytes);
        let len = HEADER_BYTES as u64 + words * 8;
        // Clients map it read-only; nobody may resize it under them.
        let file = crate::hot::sealed_memfd("orbitkv-presence", len)?;
        let map = memmap2::MmapRaw::map_raw(&file)?;
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[SEED..SEED + 8].copy_from_slice(&seed.to_le_bytes());
        h[WORDS..WORDS + 8].copy_from_slice(&words.to_le_bytes());
        // SAFETY: the mapping is longer than 32 bytes; nobody else maps it yet.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), map.as_mut_ptr(), h.len()) };
        Ok(PresenceTable {
            file,
            map,
            seed,
            words,
            set: 0,
        })
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.map.len() && offset.is_multiple_of(8));
        // SAFETY: in bounds (callers pass header fields or bitmap words),
        // 8-aligned in a page-aligned mapping, and only touched atomically.
        unsafe { &*(self.map.as_mut_ptr().add(offset) as *const AtomicU64) }
    }

    /// A descriptor for a client (read-only use).
    pub fn share(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    pub fn bytes(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn words(&self) -> u64 {
        self.words
    }

    /// Sets `key`'s bit. Release: a client that learns of the page from a
    /// message sent after this sees the bit.
    pub fn insert(&mut self, key: &StateKey) {
        let (i, mask) = slot(
            self.seed,
            self.words,
            &key.namespace,
            key.group,
            &key.native,
        );
        let before = self
            .word(HEADER_BYTES + 8 * i)
            .fetch_or(mask, Ordering::Release);
        if before & mask == 0 {
            self.set += 1;
        }
    }

    /// The share of bits set.
    pub fn fill(&self) -> f64 {
        self.set as f64 / (self.words * 64) as f64
    }

    /// Bits set since the last rebuild.
    pub fn bits_set(&self) -> u64 {
        self.set
    }

    /// Clears the bitmap and sets the bits of `keys` (every page any tier
    /// holds), odd epoch meanwhile: a reader that overlaps asks the manager.
    pub fn rebuild(&mut self, keys: &mut KeySource<'_>) {
        let epoch = self.word(EPOCH).load(Ordering::Relaxed);
        assert!(
            epoch.is_multiple_of(2),
            "presence epoch {epoch} odd outside a rebuild"
        );
        self.word(EPOCH).store(epoch + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        for i in 0..self.words as usize {
            self.word(HEADER_BYTES + 8 * i).store(0, Ordering::Relaxed);
        }
        self.set = 0;
        keys(&mut |k| self.insert(k));
        self.word(EPOCH).store(epoch + 2, Ordering::Release);
    }

    /// The manager is alive now (every tick).
    pub fn beat(&mut self) {
        self.word(BEAT).store(monotonic_ms(), Ordering::Release);
    }

    /// Whether clear bits may answer lookups.
    pub fn set_open(&mut self, open: bool) {
        self.word(OPEN).store(u64::from(open), Ordering::Release);
    }

    pub fn is_open(&self) -> bool {
        self.word(OPEN).load(Ordering::Relaxed) == 1
    }
}

/// A client's read-only view.
pub struct PresenceView {
    map: memmap2::Mmap,
    seed: u64,
    words: u64,
}

impl std::fmt::Debug for PresenceView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PresenceView")
            .field("words", &self.words)
            .finish()
    }
}

impl PresenceView {
    /// Maps the manager's filter and checks its header against the size.
    pub fn open(file: &File) -> Result<PresenceView, String> {
        // SAFETY: a read-only view of a sealed memfd (it cannot shrink).
        let map = unsafe { memmap2::Mmap::map(file) }.map_err(|e| e.to_string())?;
        if map.len() < HEADER_BYTES {
            return Err("presence filter smaller than its header".into());
        }
        let field = |at: usize| -> u64 {
            let mut b = [0u8; 8];
            b.copy_from_slice(&map[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if map[..8] != MAGIC || map[8..12] != VERSION.to_le_bytes() {
            return Err("presence filter has a bad magic or version".into());
        }
        let (seed, words) = (field(SEED), field(WORDS));
        let fits = words
            .checked_mul(8)
            .and_then(|b| b.checked_add(HEADER_BYTES as u64))
            .is_some_and(|end| end <= map.len() as u64);
        if !words.is_power_of_two() || words < MIN_WORDS || !fits {
            return Err(format!(
                "presence filter of {words} words does not fit its {} bytes",
                map.len()
            ));
        }
        Ok(PresenceView { map, seed, words })
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: in bounds (checked at open: header fields and `words`
        // words after it), 8-aligned, read atomically only.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    /// True only when no tier held the key as of this read: a lookup
    /// needing it first would miss. False means "ask the manager".
    pub fn absent(&self, namespace: &Namespace, group: u32, native: &NativeHash) -> bool {
        let before = self.word(EPOCH).load(Ordering::Acquire);
        if before % 2 == 1 || self.word(OPEN).load(Ordering::Acquire) != 1 {
            return false;
        }
        let beat = self.word(BEAT).load(Ordering::Acquire);
        if monotonic_ms().saturating_sub(beat) > STALE_MS {
            return false;
        }
        let (i, mask) = slot(self.seed, self.words, namespace, group, native);
        let bits = self.word(HEADER_BYTES + 8 * i).load(Ordering::Acquire);
        fence(Ordering::Acquire);
        let after = self.word(EPOCH).load(Ordering::Relaxed);
        before == after && bits & mask == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ns: u8, group: u32, hash: u64) -> StateKey {
        StateKey {
            namespace: Namespace([ns; 32]),
            group,
            native: NativeHash::from_u64(hash),
        }
    }

    fn view(t: &PresenceTable) -> PresenceView {
        PresenceView::open(&t.share().unwrap()).unwrap()
    }

    #[test]
    fn a_set_key_is_never_absent_and_a_closed_filter_answers_nothing() {
        let mut t = PresenceTable::create(64 << 10, 7).unwrap();
        let v = view(&t);
        let k = key(1, 0, 42);
        let is_absent = |k: &StateKey| v.absent(&k.namespace, k.group, &k.native);
        assert!(!is_absent(&k), "closed: ask the manager");
        t.set_open(true);
        assert!(
            !is_absent(&k),
            "no beat yet: a manager gone, ask the socket"
        );
        t.beat();
        assert!(is_absent(&k));
        t.insert(&k);
        assert!(!is_absent(&k));
        // Another namespace, group or hash is another key.
        let absent_others = [key(2, 0, 42), key(1, 1, 42), key(1, 0, 43)]
            .iter()
            .filter(|k| is_absent(k))
            .count();
        assert!(absent_others >= 2, "a 64 KiB filter with one key set");
        t.set_open(false);
        assert!(!is_absent(&key(9, 9, 9)));
    }

    #[test]
    fn a_rebuild_keeps_exactly_the_listed_keys() {
        let mut t = PresenceTable::create(1 << 20, 3).unwrap();
        t.set_open(true);
        t.beat();
        let v = view(&t);
        let keys: Vec<StateKey> = (0..1000).map(|i| key(1, 0, i)).collect();
        for k in &keys {
            t.insert(k);
        }
        assert!(t.bits_set() > 990 && t.bits_set() <= 1000);
        let kept = &keys[..10];
        t.rebuild(&mut |f| kept.iter().for_each(&mut *f));
        assert!(t.bits_set() <= 10);
        for k in kept {
            assert!(!v.absent(&k.namespace, k.group, &k.native));
        }
        let gone = keys[10..]
            .iter()
            .filter(|k| v.absent(&k.namespace, k.group, &k.native))
            .count();
        assert!(gone > 980, "{gone} of 990 removed keys read absent");
    }

    #[test]
    fn a_bad_header_is_refused() {
        let t = PresenceTable::create(4096, 1).unwrap();
        assert_eq!(t.words(), MIN_WORDS);
        // A file too short for the words its header claims.
        let short = memfd::MemfdOptions::default()
            .create("short")
            .unwrap()
            .into_file();
        short.set_len(HEADER_BYTES as u64).unwrap();
        assert!(PresenceView::open(&short).is_err());
        let mut bytes = vec![0u8; HEADER_BYTES + 8 * 512];
        bytes[..8].copy_from_slice(&MAGIC);
        bytes[8..12].copy_from_slice(&VERSION.to_le_bytes());
        bytes[WORDS..WORDS + 8].copy_from_slice(&1000u64.to_le_bytes());
        use std::io::Write as _;
        let mut f = memfd::MemfdOptions::default()
            .create("bad")
            .unwrap()
            .into_file();
        f.write_all(&bytes).unwrap();
        let e = PresenceView::open(&f).unwrap_err();
        assert!(e.contains("1000 words"), "{e}");
        assert_eq!(words_for(100_000), 8192);
        assert_eq!(words_for(1 << 20), 1 << 17);
    }
}
