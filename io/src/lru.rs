//! Least-recently-used order of evictable items.
//!
//! The runtime keeps only **unleased** pages in an [`LruOrder`]: a page
//! leaves the order when it is leased and comes back (as most recent) when
//! its last lease ends. Eviction therefore takes [`LruOrder::pop_oldest`]
//! as is and never has to skip over pages that are in use.
//!
//! A doubly linked list threaded through a slab of nodes (oldest at the
//! head), and a hash map from each key to its node: every operation is
//! O(1), one hash probe and a few index writes, because a page enters and
//! leaves the order on every lease and eviction of the tick thread. Freed
//! nodes are reused, so the slab never holds more nodes than the order
//! once held items. The order depends only on the sequence of calls,
//! never on hashing.

use std::collections::HashMap;
use std::hash::Hash;

/// "No node": the list's ends and a free node's links.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node<K> {
    key: K,
    /// Towards the oldest item.
    prev: u32,
    /// Towards the most recent item; for a free node, the next free one.
    next: u32,
}

/// Least-recently-used order over keys `K`.
#[derive(Debug, Clone)]
pub struct LruOrder<K: Copy + Eq + Hash> {
    /// Key -> its node in `nodes`.
    node_of: HashMap<K, u32, orbitkv_components::KeyHasher>,
    nodes: Vec<Node<K>>,
    /// The oldest and the most recent item's nodes.
    head: u32,
    tail: u32,
    /// The first free node (linked through `next`).
    free: u32,
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
            node_of: HashMap::default(),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
            free: NIL,
        }
    }

    /// Makes `k` the most recent item, inserting it if absent. Returns
    /// `true` if `k` was not in the order before.
    pub fn touch(&mut self, k: K) -> bool {
        if let Some(&n) = self.node_of.get(&k) {
            if n != self.tail {
                self.unlink(n);
                self.push_back(n);
            }
            return false;
        }
        let n = self.alloc(k);
        self.node_of.insert(k, n);
        self.push_back(n);
        true
    }

    /// Removes `k`; `false` if it was not in the order.
    pub fn remove(&mut self, k: K) -> bool {
        match self.node_of.remove(&k) {
            Some(n) => {
                self.unlink(n);
                self.release(n);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the least recently touched item.
    pub fn pop_oldest(&mut self) -> Option<K> {
        let n = self.head;
        let k = self.nodes.get(n as usize)?.key;
        let removed = self.node_of.remove(&k);
        assert_eq!(removed, Some(n), "the head node is its key's node");
        self.unlink(n);
        self.release(n);
        Some(k)
    }

    /// The least recently touched item, left in place.
    pub fn peek_oldest(&self) -> Option<K> {
        self.nodes.get(self.head as usize).map(|node| node.key)
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.node_of.len()
    }

    /// Whether the order holds no item.
    pub fn is_empty(&self) -> bool {
        self.node_of.is_empty()
    }

    /// Whether `k` is in the order.
    pub fn contains(&self, k: &K) -> bool {
        self.node_of.contains_key(k)
    }

    /// Items from oldest to most recent.
    pub fn iter_oldest_first(&self) -> impl Iterator<Item = K> + '_ {
        let mut n = self.head;
        std::iter::from_fn(move || {
            let node = self.nodes.get(n as usize)?;
            n = node.next;
            Some(node.key)
        })
    }

    /// Removes every item.
    pub fn clear(&mut self) {
        self.node_of.clear();
        self.nodes.clear();
        (self.head, self.tail, self.free) = (NIL, NIL, NIL);
    }

    /// A node for `k`, unlinked: a free one if any.
    fn alloc(&mut self, key: K) -> u32 {
        let node = Node {
            key,
            prev: NIL,
            next: NIL,
        };
        if self.free != NIL {
            let n = self.free;
            self.free = self.nodes[n as usize].next;
            self.nodes[n as usize] = node;
            return n;
        }
        let n = u32::try_from(self.nodes.len()).expect("fewer than 2^32 - 1 items");
        assert!(n != NIL, "fewer than 2^32 - 1 items");
        self.nodes.push(node);
        n
    }

    /// Puts an unlinked node on the free list.
    fn release(&mut self, n: u32) {
        let node = &mut self.nodes[n as usize];
        node.prev = NIL;
        node.next = self.free;
        self.free = n;
    }

    /// Takes a linked node out of the list.
    fn unlink(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
        match prev {
            NIL => {
                assert_eq!(self.head, n, "only the head has no predecessor");
                self.head = next;
            }
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => {
                assert_eq!(self.tail, n, "only the tail has no successor");
                self.tail = prev;
            }
            s => self.nodes[s as usize].prev = prev,
        }
    }

    /// Links an unlinked node in as the most recent item.
    fn push_back(&mut self, n: u32) {
        let tail = self.tail;
        {
            let node = &mut self.nodes[n as usize];
            node.prev = tail;
            node.next = NIL;
        }
        match tail {
            NIL => self.head = n,
            t => self.nodes[t as usize].next = n,
        }
        self.tail = n;
    }
}

#[cfg(test)]
mod tests {
    use super::LruOrder;

    #[test]
    fn freed_nodes_are_reused() {
        let mut lru = LruOrder::new();
        for round in 0..100u32 {
            for k in 0..8u32 {
                lru.touch(round * 8 + k);
            }
            for _ in 0..8 {
                lru.pop_oldest();
            }
        }
        assert!(lru.is_empty());
        assert_eq!(
            lru.nodes.len(),
            8,
            "the slab holds at most the items once held"
        );
        for k in [1u32, 2, 3, 4, 2, 5] {
            lru.touch(k);
        }
        let order: Vec<u32> = lru.iter_oldest_first().collect();
        assert_eq!(order, vec![1, 3, 4, 2, 5]);
        assert_eq!(lru.pop_oldest(), Some(1));
        assert_eq!(lru.len(), 4);
    }
}
