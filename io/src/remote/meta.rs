//! The metadata cache `lookup` answers from: which pages the remote store
//! is believed to hold, with their length and checksum. It is a hint: the
//! refresher fills it from the directory streams, the workers add what this
//! manager wrote and drop what failed to read, and every read is verified
//! against the record itself.

use std::collections::{HashSet, VecDeque};

use orbitkv_components::{Namespace, StateKey};

use super::record::RecordHeader;
use crate::tier::{TierChange, TierJournal};

/// Failed reads remembered at most (oldest forgotten first).
const MAX_TOMBSTONES: usize = 65536;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MetaEntry {
    pub bytes: u64,
    pub checksum: u64,
    pub format: [u8; 32],
    /// Writer's wall clock at write, Unix ms: orders entries of one key.
    pub written_unix_ms: u64,
    /// Writer's wall clock expiry, Unix ms (pruned by the refresher).
    pub expires_unix_ms: u64,
    /// Insertion generation, for the bounded FIFO.
    generation: u64,
}

impl MetaEntry {
    pub(crate) fn from_header(h: &RecordHeader) -> MetaEntry {
        MetaEntry {
            bytes: h.payload_len,
            checksum: h.payload_checksum,
            format: h.format_digest,
            written_unix_ms: h.written_unix_ms,
            expires_unix_ms: h.written_unix_ms.saturating_add(h.ttl_ms),
            generation: 0,
        }
    }
}

/// Bounded map of entries; the oldest inserted are forgotten first.
pub(crate) struct MetaCache {
    map: orbitkv_components::KeyMap<MetaEntry>,
    order: VecDeque<(StateKey, u64)>,
    next_gen: u64,
    cap: usize,
    /// Namespaces whose directories the refresher follows.
    pub followed: HashSet<Namespace>,
    /// Entries dropped since the last `take_dropped`.
    dropped: u64,
    /// Keys whose record failed to read, with the write time of the entry
    /// that promised it: that entry, or an older one, read again from a
    /// directory is not believed again. A newer write is.
    tombstones: orbitkv_components::KeyMap<u64>,
    tomb_order: VecDeque<StateKey>,
    /// Changes of `map` for the manager's KV events (off unless asked):
    /// `insert`, `remove_if` and `drop_where` are the only mutators.
    pub journal: TierJournal,
}

impl MetaCache {
    pub(crate) fn new(cap: usize) -> MetaCache {
        MetaCache {
            map: Default::default(),
            order: VecDeque::new(),
            next_gen: 1,
            cap,
            followed: HashSet::new(),
            dropped: 0,
            tombstones: Default::default(),
            tomb_order: VecDeque::new(),
            journal: TierJournal::default(),
        }
    }

    /// Every key believed held (the journal's relists).
    pub(crate) fn keys(&self) -> impl Iterator<Item = StateKey> + '_ {
        self.map.keys().copied()
    }

    /// The journal's changes due (see `TierJournal::take`).
    pub(crate) fn take_changes(&mut self, out: &mut Vec<TierChange>) -> bool {
        let map = &self.map;
        self.journal.take(
            out,
            |k| map.contains_key(k),
            || Box::new(map.keys().copied()),
        )
    }

    pub(crate) fn get(&self, key: &StateKey) -> Option<&MetaEntry> {
        self.map.get(key)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Inserts or replaces (the newest entry for a key wins), unless a
    /// failed read of this entry or a newer one was recorded.
    pub(crate) fn insert(&mut self, key: StateKey, mut e: MetaEntry) {
        if self
            .tombstones
            .get(&key)
            .is_some_and(|t| *t >= e.written_unix_ms)
        {
            return;
        }
        if let Some(old) = self.map.get(&key)
            && old.written_unix_ms > e.written_unix_ms
        {
            return;
        }
        e.generation = self.next_gen;
        self.next_gen += 1;
        if self.map.insert(key, e).is_none() {
            self.journal.push(TierChange::Stored(key));
        }
        self.order.push_back((key, e.generation));
        while self.map.len() > self.cap {
            let Some((k, g)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|e| e.generation == g) {
                self.map.remove(&k);
                self.journal.push(TierChange::Removed(k));
                self.dropped += 1;
            }
        }
        // Replaced keys leave stale order entries; keep the deque bounded.
        if self.order.len() > 2 * self.cap.max(16) {
            let map = &self.map;
            self.order
                .retain(|(k, g)| map.get(k).is_some_and(|e| e.generation == *g));
        }
        debug_assert!(self.map.len() <= self.cap);
    }

    /// Drops `key` if its entry still promises `checksum` (a newer entry
    /// for the same key stays).
    /// Also remembers the failure (see `tombstones`).
    pub(crate) fn remove_if(&mut self, key: &StateKey, checksum: u64) -> bool {
        let Some(e) = self.map.get(key).copied() else {
            return false;
        };
        if e.checksum != checksum {
            return false;
        }
        self.map.remove(key);
        self.journal.push(TierChange::Removed(*key));
        self.dropped += 1;
        if self.tombstones.insert(*key, e.written_unix_ms).is_none() {
            self.tomb_order.push_back(*key);
        }
        while self.tomb_order.len() > self.cap.min(MAX_TOMBSTONES) {
            if let Some(k) = self.tomb_order.pop_front() {
                self.tombstones.remove(&k);
            }
        }
        true
    }

    /// Drops every entry `pred` selects.
    pub(crate) fn drop_where(&mut self, mut pred: impl FnMut(&StateKey, &MetaEntry) -> bool) {
        let before = self.map.len();
        let journal = &mut self.journal;
        self.map.retain(|k, e| {
            let drop = pred(k, e);
            if drop {
                journal.push(TierChange::Removed(*k));
            }
            !drop
        });
        self.dropped += (before - self.map.len()) as u64;
    }

    pub(crate) fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> StateKey {
        StateKey::new(Namespace([3; 32]), 0, &i.to_le_bytes()).unwrap()
    }

    fn entry(sum: u64) -> MetaEntry {
        MetaEntry {
            bytes: 10,
            checksum: sum,
            format: [0; 32],
            written_unix_ms: sum,
            expires_unix_ms: 0,
            generation: 0,
        }
    }

    #[test]
    fn bounded_fifo_and_conditional_remove() {
        let mut c = MetaCache::new(3);
        for i in 0..5 {
            c.insert(key(i), entry(i));
        }
        assert_eq!(c.len(), 3);
        assert!(c.get(&key(0)).is_none() && c.get(&key(1)).is_none());
        assert_eq!(c.take_dropped(), 2);
        // Re-inserting refreshes the key's age.
        c.insert(key(2), entry(20));
        c.insert(key(5), entry(5));
        assert!(c.get(&key(2)).is_some() && c.get(&key(3)).is_none());
        assert!(!c.remove_if(&key(2), 2), "a newer entry stays");
        assert!(c.remove_if(&key(2), 20));
        for i in 0..1000 {
            c.insert(key(7), entry(i));
        }
        assert!(c.order.len() <= 2 * 16 + 1);
        c.drop_where(|k, _| *k == key(7));
        assert!(c.get(&key(7)).is_none());
    }

    #[test]
    fn a_failed_entry_is_not_believed_again_but_a_newer_write_is() {
        let mut c = MetaCache::new(8);
        c.insert(key(1), entry(10));
        assert!(c.remove_if(&key(1), 10));
        c.insert(key(1), entry(10)); // the directory, read again
        assert!(c.get(&key(1)).is_none());
        c.insert(key(1), entry(5)); // older still
        assert!(c.get(&key(1)).is_none());
        c.insert(key(1), entry(11)); // written again since
        assert_eq!(c.get(&key(1)).unwrap().checksum, 11);
        // An older entry never replaces a newer one.
        c.insert(key(1), entry(9));
        assert_eq!(c.get(&key(1)).unwrap().checksum, 11);
    }
}
