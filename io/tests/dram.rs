//! Host pool (`orbitkv_io::dram`) and LRU order (`orbitkv_io::lru`) tests.

use std::collections::HashSet;

use orbitkv_io::dram::{
    DEFAULT_EXTENT_BYTES, DEFAULT_SLOT_ALIGN, HostPool, HostPoolConfig, PoolError, SlotKey,
};
use orbitkv_io::lru::LruOrder;
use proptest::prelude::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn pool(capacity_bytes: u64, extent_bytes: u64, slot_align: u64) -> HostPool {
    HostPool::new(HostPoolConfig {
        capacity_bytes,
        extent_bytes,
        slot_align,
        shared: false,
    })
    .expect("valid config")
}

/// Deterministic, slot-specific byte pattern.
fn pattern(tag: u64, len: usize) -> Vec<u8> {
    let mut x = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn fill(pool: &mut HostPool, key: SlotKey, tag: u64) {
    let len = pool.slot_len(key).unwrap();
    let bytes = pool.bytes_mut(key, len).unwrap();
    bytes.copy_from_slice(&pattern(tag, len as usize));
}

fn assert_filled(pool: &HostPool, key: SlotKey, tag: u64) {
    let len = pool.slot_len(key).unwrap();
    let bytes = pool.bytes(key, len).unwrap();
    assert!(
        bytes == pattern(tag, len as usize).as_slice(),
        "slot {key:?} (tag {tag}) was disturbed"
    );
}

#[test]
fn defaults() {
    let c = HostPoolConfig::new(64 * MIB);
    assert_eq!(c.extent_bytes, 2 * MIB);
    assert_eq!(c.slot_align, 4096);
    assert_eq!(DEFAULT_EXTENT_BYTES, 2 * MIB);
    assert_eq!(DEFAULT_SLOT_ALIGN, 4096);
    let p = HostPool::new(c).unwrap();
    assert_eq!(p.capacity(), 64 * MIB);
    assert_eq!(p.extent_bytes(), 2 * MIB);
    assert_eq!(p.slot_align(), 4096);
    p.check_invariants().unwrap();
}

#[test]
fn written_bytes_read_back_undisturbed_by_neighbours() {
    let mut p = pool(16 * MIB, 2 * MIB, 4096);
    // Neighbours in the same class (adjacent offsets) and in other classes.
    let sizes = [
        4096,
        4096,
        4096,
        100,
        8192,
        8000,
        16 * KIB,
        3 * 4096,
        2 * MIB,
    ];
    let keys: Vec<SlotKey> = sizes.iter().map(|&s| p.alloc(s).unwrap()).collect();
    for (tag, &k) in keys.iter().enumerate() {
        fill(&mut p, k, tag as u64);
    }
    for (tag, &k) in keys.iter().enumerate() {
        assert_filled(&p, k, tag as u64);
    }
    // Exact bytes of a short write stay put while every neighbour is
    // rewritten, then the neighbours are checked too.
    let target = keys[1];
    let msg = b"orbitkv page bytes";
    p.bytes_mut(target, msg.len() as u64)
        .unwrap()
        .copy_from_slice(msg);
    for (tag, &k) in keys.iter().enumerate() {
        if k != target {
            fill(&mut p, k, 1000 + tag as u64);
        }
    }
    assert_eq!(p.bytes(target, msg.len() as u64).unwrap(), msg);
    let rest = pattern(1, 4096);
    assert_eq!(
        &p.bytes(target, 4096).unwrap()[msg.len()..],
        &rest[msg.len()..]
    );
    for (tag, &k) in keys.iter().enumerate() {
        if k != target {
            assert_filled(&p, k, 1000 + tag as u64);
        }
    }
    p.check_invariants().unwrap();
}

#[test]
fn bytes_len_bounds_and_class_rounding() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let k = p.alloc(100).unwrap();
    assert_eq!(p.slot_len(k), Some(4096));
    assert_eq!(p.bytes(k, 100).unwrap().len(), 100);
    assert_eq!(p.bytes(k, 0).unwrap().len(), 0);
    assert_eq!(p.bytes(k, 4096).unwrap().len(), 4096);
    assert!(p.bytes(k, 4097).is_none());
    assert!(p.bytes_mut(k, 4097).is_none());
    assert!(p.bytes(k, u64::MAX).is_none());
    let k2 = p.alloc(4097).unwrap();
    assert_eq!(p.slot_len(k2), Some(8192));
}

#[test]
fn base_ptr_plus_offset_is_the_slot() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let _a = p.alloc(4096).unwrap();
    let b = p.alloc(8192).unwrap();
    let off = p.offset(b).unwrap() as usize;
    let base = p.base_ptr();
    let via_bytes = p.bytes_mut(b, 1).unwrap().as_mut_ptr();
    assert_eq!(base.wrapping_add(off), via_bytes);
}

#[test]
fn offsets_distinct_aligned_within_capacity() {
    let mut p = pool(16 * MIB, 2 * MIB, 4096);
    let sizes = [4096, 8192, 12 * KIB, 64 * KIB, MIB + 1, 2 * MIB, 5000];
    let mut live = Vec::new();
    let mut i = 0usize;
    loop {
        let size = sizes[i % sizes.len()];
        i += 1;
        match p.alloc(size) {
            Ok(k) => live.push(k),
            Err(PoolError::Exhausted { .. }) => {
                if sizes.iter().all(|&s| !p.can_alloc(s)) {
                    break;
                }
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(live.len() > 100);
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .map(|&k| (p.offset(k).unwrap(), p.slot_len(k).unwrap()))
        .collect();
    let distinct: HashSet<u64> = spans.iter().map(|s| s.0).collect();
    assert_eq!(distinct.len(), live.len());
    for &(off, len) in &spans {
        assert_eq!(off % 4096, 0, "offset {off} unaligned");
        assert_eq!(len % 4096, 0);
        assert!(off + len <= p.capacity());
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
    }
    p.check_invariants().unwrap();
    // The stats show a full pool.
    let s = p.stats();
    assert_eq!(s.extents_free, 0);
    assert_eq!(s.slots_used, live.len() as u64);
}

#[test]
fn exhausted_then_free_allows_alloc() {
    let mut p = pool(2 * MIB, 2 * MIB, 4096);
    let a = p.alloc(MIB).unwrap();
    let _b = p.alloc(MIB).unwrap();
    assert!(!p.can_alloc(MIB));
    assert_eq!(p.alloc(MIB), Err(PoolError::Exhausted { class_bytes: MIB }));
    // The only extent belongs to the 1 MiB class: other classes are out too.
    assert!(!p.can_alloc(4096));
    assert_eq!(
        p.alloc(4096),
        Err(PoolError::Exhausted { class_bytes: 4096 })
    );
    // A failed request leaves no empty class behind.
    assert_eq!(p.stats().classes.len(), 1);
    p.free(a).unwrap();
    assert!(p.can_alloc(MIB));
    assert!(p.can_alloc(MIB - 4096 + 1));
    assert!(!p.can_alloc(4096), "extents are not returned to the pool");
    let c = p.alloc(MIB).unwrap();
    assert_eq!(p.slot_len(c), Some(MIB));
    p.check_invariants().unwrap();
}

#[test]
fn stale_key_after_free() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let k = p.alloc(4096).unwrap();
    p.free(k).unwrap();
    assert_eq!(p.free(k), Err(PoolError::StaleSlot));
    assert_eq!(p.offset(k), None);
    assert_eq!(p.slot_len(k), None);
    assert!(p.bytes(k, 1).is_none());
    assert!(p.bytes(k, 0).is_none());
    assert!(p.bytes_mut(k, 1).is_none());
    p.check_invariants().unwrap();
    // Keys that never came from the pool are stale too.
    for bits in [
        0,
        1,
        u64::MAX,
        0xdead_beef_0000_0007,
        SlotKey::default().to_bits(),
    ] {
        let k = SlotKey::from_bits(bits);
        assert_eq!(p.free(k), Err(PoolError::StaleSlot));
        assert_eq!(p.offset(k), None);
    }
}

#[test]
fn reuse_gives_new_key_same_offset() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let _keep = p.alloc(4096).unwrap();
    let old = p.alloc(4096).unwrap();
    let off = p.offset(old).unwrap();
    p.free(old).unwrap();
    let new = p.alloc(4096).unwrap();
    assert_ne!(new, old);
    assert_ne!(new.to_bits(), old.to_bits());
    // LIFO free list: the freed offset is handed out again.
    assert_eq!(p.offset(new), Some(off));
    assert_eq!(p.offset(old), None);
    assert_eq!(p.free(old), Err(PoolError::StaleSlot));
    assert_eq!(
        p.offset(new),
        Some(off),
        "stale free left the new slot alone"
    );
    p.check_invariants().unwrap();
}

#[test]
fn key_bits_round_trip() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let keys: Vec<SlotKey> = (0..10).map(|_| p.alloc(4096).unwrap()).collect();
    for &k in &keys {
        let back = SlotKey::from_bits(k.to_bits());
        assert_eq!(back, k);
        assert_eq!(p.offset(back), p.offset(k));
    }
}

#[test]
fn too_large_and_zero_size() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    assert_eq!(p.alloc(0), Err(PoolError::ZeroSize));
    assert!(!p.can_alloc(0));
    for bytes in [2 * MIB + 1, 3 * MIB, u64::MAX] {
        assert_eq!(
            p.alloc(bytes),
            Err(PoolError::TooLarge {
                bytes,
                extent_bytes: 2 * MIB
            })
        );
        assert!(!p.can_alloc(bytes));
    }
    let k = p.alloc(2 * MIB).unwrap();
    assert_eq!(p.slot_len(k), Some(2 * MIB));
    // Class rounding never pushes a legal request past the extent.
    let mut q = pool(3 * 8192, 8192, 8192);
    let qk = q.alloc(8191).unwrap();
    assert_eq!(q.slot_len(qk), Some(8192));
    assert!(matches!(q.alloc(8193), Err(PoolError::TooLarge { .. })));
    p.check_invariants().unwrap();
    q.check_invariants().unwrap();
}

#[test]
fn config_errors() {
    let cfg = |capacity_bytes, extent_bytes, slot_align| HostPoolConfig {
        capacity_bytes,
        extent_bytes,
        slot_align,
        shared: false,
    };
    for slot_align in [0, 3, 4095, 6000] {
        assert_eq!(
            HostPool::new(cfg(4 * MIB, 2 * MIB, slot_align)).unwrap_err(),
            PoolError::BadSlotAlign { slot_align }
        );
    }
    for extent_bytes in [0, 6000, 4096 + 512] {
        assert_eq!(
            HostPool::new(cfg(4 * MIB, extent_bytes, 4096)).unwrap_err(),
            PoolError::BadExtent {
                extent_bytes,
                slot_align: 4096
            }
        );
    }
    for capacity_bytes in [0, 1, 2 * MIB - 1] {
        assert_eq!(
            HostPool::new(cfg(capacity_bytes, 2 * MIB, 4096)).unwrap_err(),
            PoolError::CapacityTooSmall {
                capacity_bytes,
                extent_bytes: 2 * MIB
            }
        );
    }
    // Capacity is rounded down to whole extents.
    let p = HostPool::new(cfg(5 * MIB + 1, 2 * MIB, 4096)).unwrap();
    assert_eq!(p.capacity(), 4 * MIB);
    assert_eq!(p.stats().extents_total, 2);
    // Errors print.
    assert!(
        PoolError::Exhausted { class_bytes: 4096 }
            .to_string()
            .contains("4096")
    );
}

#[test]
fn stats_are_exact() {
    let mut p = pool(8 * MIB, 2 * MIB, 4096);
    let s = p.stats();
    assert_eq!(s.capacity_bytes, 8 * MIB);
    assert_eq!(s.extents_total, 4);
    assert_eq!(s.extents_free, 4);
    assert_eq!(s.slots_used, 0);
    assert_eq!(s.bytes_used, 0);
    assert!(s.classes.is_empty());

    let a = p.alloc(8192).unwrap();
    let _b = p.alloc(5000).unwrap();
    let _c = p.alloc(4096).unwrap();
    let d = p.alloc(MIB).unwrap();
    p.free(a).unwrap();
    p.free(d).unwrap();
    let s = p.stats();
    assert_eq!(s.extents_free, 1);
    assert_eq!(s.slots_used, 2);
    assert_eq!(s.bytes_used, 4096 + 8192);
    let got: Vec<(u64, u64, u64, u64)> = s
        .classes
        .iter()
        .map(|c| (c.class_bytes, c.extents, c.slots_used, c.slots_free))
        .collect();
    assert_eq!(
        got,
        vec![(4096, 1, 1, 511), (8192, 1, 1, 255), (MIB, 1, 0, 2)]
    );
    p.check_invariants().unwrap();
}

#[test]
fn first_touch_64_mib() {
    let mut p = pool(64 * MIB, 2 * MIB, 4096);
    let r = p.first_touch();
    assert_eq!(r.bytes, p.capacity());
    assert_eq!(r.bytes, 64 * MIB);
    assert!(r.seconds_per_gib > 0.0, "{r:?}");
    assert!(r.seconds >= 0.0);
    assert!(r.threads >= 1);
    p.check_invariants().unwrap();
}

#[test]
fn first_touch_preserves_live_slots() {
    let mut p = pool(4 * MIB, 2 * MIB, 4096);
    let keys: Vec<SlotKey> = (0..8).map(|_| p.alloc(4096).unwrap()).collect();
    for (tag, &k) in keys.iter().enumerate() {
        fill(&mut p, k, tag as u64);
    }
    let r = p.first_touch();
    assert_eq!(r.bytes, 4 * MIB);
    for (tag, &k) in keys.iter().enumerate() {
        assert_filled(&p, k, tag as u64);
    }
}

/// Release-mode startup figure for a 1 GiB pool. Run with
/// `cargo test --release -p orbitkv-io --test dram -- --ignored --nocapture`.
#[test]
#[ignore = "maps and touches 1 GiB; run by hand in release"]
fn first_touch_1_gib_report() {
    let mut p = HostPool::new(HostPoolConfig::new(1 << 30)).unwrap();
    let r = p.first_touch();
    println!(
        "first_touch: {} bytes in {:.4} s = {:.4} s/GiB on {} rayon threads",
        r.bytes, r.seconds, r.seconds_per_gib, r.threads
    );
    assert_eq!(r.bytes, 1 << 30);
}

#[derive(Debug, Clone)]
enum PoolOp {
    Alloc(u64),
    /// Frees the live key at this index modulo the live count.
    Free(usize),
    /// Frees a key that was already freed, if any.
    FreeStale(usize),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    // Sizes cluster on a few page classes (as the runtime's do) plus
    // arbitrary ones up to the 64 KiB extent, and some illegal sizes.
    let size = prop_oneof![
        4 => prop::sample::select(vec![4096u64, 8192, 16384, 65536]),
        3 => 1u64..=65536,
        1 => prop::sample::select(vec![0u64, 65537, u64::MAX]),
    ];
    prop_oneof![
        5 => size.prop_map(PoolOp::Alloc),
        4 => any::<usize>().prop_map(PoolOp::Free),
        1 => any::<usize>().prop_map(PoolOp::FreeStale),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_alloc_free_keeps_invariants(ops in prop::collection::vec(pool_op(), 1..200)) {
        const EXTENT: u64 = 64 * 1024;
        let mut p = pool(8 * EXTENT, EXTENT, 4096);
        // Model: live keys with their tag and class size.
        let mut live: Vec<(SlotKey, u64, u64)> = Vec::new();
        let mut dead: Vec<SlotKey> = Vec::new();
        let mut next_tag = 0u64;
        for op in ops {
            match op {
                PoolOp::Alloc(bytes) => {
                    let could = p.can_alloc(bytes);
                    match p.alloc(bytes) {
                        Ok(k) => {
                            prop_assert!(could);
                            let class = bytes.div_ceil(4096) * 4096;
                            prop_assert_eq!(p.slot_len(k), Some(class));
                            let off = p.offset(k).unwrap();
                            prop_assert_eq!(off % 4096, 0);
                            prop_assert!(off + class <= p.capacity());
                            fill(&mut p, k, next_tag);
                            live.push((k, next_tag, class));
                            next_tag += 1;
                        }
                        Err(PoolError::ZeroSize) => prop_assert_eq!(bytes, 0),
                        Err(PoolError::TooLarge { bytes: b, extent_bytes }) => {
                            prop_assert_eq!(b, bytes);
                            prop_assert_eq!(extent_bytes, EXTENT);
                            prop_assert!(bytes > EXTENT);
                        }
                        Err(PoolError::Exhausted { class_bytes }) => {
                            prop_assert!(!could);
                            prop_assert_eq!(class_bytes, bytes.div_ceil(4096) * 4096);
                            prop_assert_eq!(p.stats().extents_free, 0);
                        }
                        Err(e) => prop_assert!(false, "unexpected error {}", e),
                    }
                }
                PoolOp::Free(i) => {
                    if !live.is_empty() {
                        let (k, tag, _) = live.swap_remove(i % live.len());
                        assert_filled(&p, k, tag);
                        prop_assert_eq!(p.free(k), Ok(()));
                        prop_assert_eq!(p.offset(k), None);
                        dead.push(k);
                    }
                }
                PoolOp::FreeStale(i) => {
                    if !dead.is_empty() {
                        let k = dead[i % dead.len()];
                        prop_assert_eq!(p.free(k), Err(PoolError::StaleSlot));
                    }
                }
            }
            let s = p.stats();
            prop_assert_eq!(s.slots_used, live.len() as u64);
            prop_assert_eq!(s.bytes_used, live.iter().map(|l| l.2).sum::<u64>());
            prop_assert_eq!(
                s.classes.iter().map(|c| c.slots_used).sum::<u64>(),
                live.len() as u64
            );
            prop_assert!(s.classes.windows(2).all(|w| w[0].class_bytes < w[1].class_bytes));
            prop_assert_eq!(
                s.extents_free + s.classes.iter().map(|c| c.extents).sum::<u64>(),
                s.extents_total
            );
            if let Err(msg) = p.check_invariants() {
                prop_assert!(false, "invariant broken: {}", msg);
            }
        }
        for &(k, tag, _) in &live {
            assert_filled(&p, k, tag);
        }
    }

    #[test]
    fn arbitrary_key_bits_never_panic(bits in any::<u64>()) {
        let mut p = pool(2 * MIB, 2 * MIB, 4096);
        let live = p.alloc(4096).unwrap();
        let k = SlotKey::from_bits(bits);
        if k != live {
            prop_assert_eq!(p.offset(k), None);
            prop_assert!(p.bytes(k, 1).is_none());
            prop_assert_eq!(p.free(k), Err(PoolError::StaleSlot));
        }
        prop_assert!(p.check_invariants().is_ok());
    }
}

// ---------------------------------------------------------------- LRU

#[test]
fn lru_order_and_peek() {
    let mut lru = LruOrder::new();
    assert!(lru.is_empty());
    assert_eq!(lru.peek_oldest(), None);
    assert!(lru.touch(1u32));
    assert!(lru.touch(2));
    assert!(lru.touch(3));
    assert_eq!(lru.len(), 3);
    assert_eq!(lru.peek_oldest(), Some(1));
    assert_eq!(lru.iter_oldest_first().collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(lru.contains(&2));
    assert!(!lru.contains(&4));
}

#[test]
fn lru_touch_moves_to_back() {
    let mut lru = LruOrder::new();
    for k in [1u32, 2, 3] {
        lru.touch(k);
    }
    assert!(!lru.touch(1), "existing key is moved, not inserted");
    assert_eq!(lru.len(), 3);
    assert_eq!(lru.peek_oldest(), Some(2));
    assert_eq!(lru.iter_oldest_first().collect::<Vec<_>>(), vec![2, 3, 1]);
    lru.touch(3);
    assert_eq!(lru.iter_oldest_first().collect::<Vec<_>>(), vec![2, 1, 3]);
}

#[test]
fn lru_remove() {
    let mut lru = LruOrder::new();
    for k in [1u32, 2, 3] {
        lru.touch(k);
    }
    assert!(lru.remove(1));
    assert!(!lru.remove(1));
    assert!(!lru.remove(9));
    assert!(!lru.contains(&1));
    assert_eq!(lru.len(), 2);
    assert_eq!(lru.peek_oldest(), Some(2));
    lru.touch(1);
    assert_eq!(lru.iter_oldest_first().collect::<Vec<_>>(), vec![2, 3, 1]);
    lru.clear();
    assert!(lru.is_empty());
    assert_eq!(lru.pop_oldest(), None);
}

#[test]
fn lru_pop_order() {
    let mut lru = LruOrder::default();
    for k in [5u64, 3, 9, 1] {
        lru.touch(k);
    }
    lru.touch(3);
    let mut popped = Vec::new();
    while let Some(k) = lru.pop_oldest() {
        assert!(!lru.contains(&k));
        popped.push(k);
    }
    assert_eq!(popped, vec![5, 9, 1, 3]);
    assert!(lru.is_empty());
    assert_eq!(lru.len(), 0);
}

#[derive(Debug, Clone)]
enum LruOp {
    Touch(u8),
    Remove(u8),
    Pop,
    Peek,
}

fn lru_op() -> impl Strategy<Value = LruOp> {
    prop_oneof![
        5 => (0u8..16).prop_map(LruOp::Touch),
        2 => (0u8..16).prop_map(LruOp::Remove),
        2 => Just(LruOp::Pop),
        1 => Just(LruOp::Peek),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn lru_matches_vec_model(ops in prop::collection::vec(lru_op(), 0..300)) {
        let mut lru = LruOrder::new();
        // Model: oldest first.
        let mut model: Vec<u8> = Vec::new();
        for op in ops {
            match op {
                LruOp::Touch(k) => {
                    let was_absent = !model.contains(&k);
                    model.retain(|&x| x != k);
                    model.push(k);
                    prop_assert_eq!(lru.touch(k), was_absent);
                }
                LruOp::Remove(k) => {
                    let present = model.contains(&k);
                    model.retain(|&x| x != k);
                    prop_assert_eq!(lru.remove(k), present);
                }
                LruOp::Pop => {
                    let want = if model.is_empty() { None } else { Some(model.remove(0)) };
                    prop_assert_eq!(lru.pop_oldest(), want);
                }
                LruOp::Peek => {
                    prop_assert_eq!(lru.peek_oldest(), model.first().copied());
                }
            }
            prop_assert_eq!(lru.len(), model.len());
            prop_assert_eq!(lru.is_empty(), model.is_empty());
            prop_assert_eq!(lru.iter_oldest_first().collect::<Vec<_>>(), model.clone());
            for k in 0u8..16 {
                prop_assert_eq!(lru.contains(&k), model.contains(&k));
            }
        }
    }
}
