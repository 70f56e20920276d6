//! Least-recently-used order of evictable items.
//!
//! The runtime keeps only **unleased** pages in an [`LruOrder`]: a page
//! leaves the order when it is leased and comes back (as most recent) when
//! its last lease ends. Eviction therefore takes [`LruOrder::pop_oldest`]
//! as is and never has to skip over pages that are in use.
//!
//! Each item carries a sequence number from a monotonically increasing
//! `u64` counter; a hash map finds an item's number and an ordered map
//! walks the numbers oldest first. Every operation is O(log n) and the
//! order depends only on the sequence of calls, never on hashing.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Least-recently-used order over keys `K`.
#[derive(Debug, Clone)]
pub struct LruOrder<K: Copy + Eq + Hash> {
    /// Key -> its sequence number.
    seq_of: HashMap<K, u64>,
    /// Sequence number -> key; the first entry is the oldest.
    by_seq: BTreeMap<u64, K>,
    /// Number the next touch gets.
    next_seq: u64,
}

impl<K: Copy + Eq + Hash> Default for LruOrder<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Eq + Hash> LruOrder<K> {
    /// An empty order.
    pub fn new() -> Self {
        LruOrder {
            seq_of: HashMap::new(),
            by_seq: BTreeMap::new(),
            next_seq: 0,
        }
    }

    /// Makes `k` the most recent item, inserting it if absent. Returns
    /// `true` if `k` was not in the order before.
    pub fn touch(&mut self, k: K) -> bool {
        if self.next_seq == u64::MAX {
            self.renumber();
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let old = self.seq_of.insert(k, seq);
        if let Some(old) = old {
            self.by_seq.remove(&old);
        }
        self.by_seq.insert(seq, k);
        old.is_none()
    }

    /// Removes `k`; `false` if it was not in the order.
    pub fn remove(&mut self, k: K) -> bool {
        match self.seq_of.remove(&k) {
            Some(seq) => {
                self.by_seq.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the least recently touched item.
    pub fn pop_oldest(&mut self) -> Option<K> {
        let (_, k) = self.by_seq.pop_first()?;
        self.seq_of.remove(&k);
        Some(k)
    }

    /// The least recently touched item, left in place.
    pub fn peek_oldest(&self) -> Option<K> {
        self.by_seq.first_key_value().map(|(_, &k)| k)
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.seq_of.len()
    }

    /// Whether the order holds no item.
    pub fn is_empty(&self) -> bool {
        self.seq_of.is_empty()
    }

    /// Whether `k` is in the order.
    pub fn contains(&self, k: &K) -> bool {
        self.seq_of.contains_key(k)
    }

    /// Items from oldest to most recent.
    pub fn iter_oldest_first(&self) -> impl Iterator<Item = K> + '_ {
        self.by_seq.values().copied()
    }

    /// Removes every item.
    pub fn clear(&mut self) {
        self.seq_of.clear();
        self.by_seq.clear();
    }

    /// Reassigns sequence numbers `0..len` in the current order. Only runs
    /// when the counter would overflow (after 2^64 touches), so touch never
    /// panics and the order is preserved.
    fn renumber(&mut self) {
        let old = std::mem::take(&mut self.by_seq);
        for (seq, (_, k)) in (0u64..).zip(old) {
            self.by_seq.insert(seq, k);
            self.seq_of.insert(k, seq);
        }
        self.next_seq = self.by_seq.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::LruOrder;

    #[test]
    fn renumbers_instead_of_overflowing() {
        let mut lru = LruOrder::new();
        lru.next_seq = u64::MAX - 3;
        for k in [1u32, 2, 3, 4, 2, 5] {
            lru.touch(k);
        }
        let order: Vec<u32> = lru.iter_oldest_first().collect();
        assert_eq!(order, vec![1, 3, 4, 2, 5]);
        assert!(lru.next_seq < 10);
        assert_eq!(lru.pop_oldest(), Some(1));
        assert_eq!(lru.len(), 4);
    }
}
