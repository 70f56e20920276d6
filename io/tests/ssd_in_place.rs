//! In-place demotions (issue 14): pages are written straight from the
//! registered host pool with the checksum they carry, tokens come back
//! exactly once when the write I/O is over (also when it failed), Drop
//! waits for writes in flight, altered bytes are refused at read, and the
//! record format (version 2, blocks of the device's direct-I/O alignment)
//! reads version-1 segments as written. Each on both engines.

mod ssd_common;

use std::collections::HashMap;
use std::time::Duration;

use orbitkv_io::checksum::page_checksum;
use orbitkv_io::ssd::format::{OFF_HEADER_SUM, RecordHeader, V1_BLOCK, header_sum};
use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdStore, WriteError};
use orbitkv_io::tier::{BackingTier, DemoteFailed, DemoteToken, Demoted, TierError};
use ssd_common::*;

/// Page lengths: 16 KiB and 64 KiB (whole blocks), and lengths that are not
/// a multiple of any block (a tail block), one shorter than a block.
const LENS: [usize; 5] = [16 << 10, 64 << 10, 16_000, 300, 70_001];

fn round_up(n: u64, b: u64) -> u64 {
    n.div_ceil(b) * b
}

/// Polls until every accepted demotion is reported and every in-place
/// token handed back (hang guard, not a timing assertion); returns the
/// tokens and the reports.
fn settle(store: &mut SsdStore) -> (Vec<DemoteToken>, Vec<Result<(), DemoteFailed>>) {
    let (mut released, mut done) = (Vec::new(), Vec::new());
    for _ in 0..200_000 {
        store.poll_released(&mut released);
        store.poll_demotions(0, &mut done);
        if store.writes_pending() == 0 && store.demotions_holding() == 0 {
            return (released, done);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    panic!("demotions never settled");
}

/// Allocates a slot of `len`, fills it with page `i`'s bytes; returns the
/// slot.
fn land(pool: &mut Pool, i: u64, len: usize) -> orbitkv_io::dram::SlotKey {
    let slot = pool.pool.alloc(len as u64).unwrap();
    pool.pool
        .bytes_mut(slot, len as u64)
        .unwrap()
        .copy_from_slice(&payload(i, len));
    slot
}

fn demote_slot(
    store: &mut SsdStore,
    pool: &Pool,
    slot: orbitkv_io::dram::SlotKey,
    i: u64,
    len: usize,
    checksum: u64,
) -> Demoted {
    let bytes = pool.pool.bytes(slot, len as u64).unwrap();
    store.demote(&key(i), DIGEST, bytes, checksum, 0).unwrap()
}

fn round_trip(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let b = store.block_bytes();
    assert!(
        b.is_power_of_two() && (512..=4096).contains(&b),
        "block {b}"
    );
    let mut pool = Pool::new(&mut store, 32 << 20);
    let mut tokens = Vec::new();
    let mut slots = Vec::new();
    for (i, &len) in LENS.iter().enumerate() {
        let i = i as u64;
        let slot = land(&mut pool, i, len);
        let sum = page_checksum(&payload(i, len));
        match demote_slot(&mut store, &pool, slot, i, len, sum) {
            Demoted::InPlace(t) => tokens.push(t),
            Demoted::Copied => panic!("page {i} ({len} bytes) in the pool was copied"),
        }
        slots.push(slot);
    }
    assert_eq!(store.demotions_holding(), LENS.len());
    let (mut released, done) = settle(&mut store);
    assert_eq!(done.len(), LENS.len());
    released.sort();
    tokens.sort();
    assert_eq!(released, tokens, "every token exactly once");
    assert!(done.iter().all(|d| d.is_ok()), "{done:?}");
    assert_eq!(store.demotions_holding(), 0);
    let mut again = Vec::new();
    store.poll_released(&mut again);
    assert!(again.is_empty(), "released twice: {again:?}");
    // The slots are the caller's again: scribbling on them changes nothing.
    for (slot, &len) in slots.iter().zip(&LENS) {
        pool.pool.bytes_mut(*slot, len as u64).unwrap().fill(0xee);
    }
    for (i, &len) in LENS.iter().enumerate() {
        let i = i as u64;
        let got = pool.read(&mut store, &key(i), len as u64).unwrap();
        assert!(got == payload(i, len), "page {i}: bytes differ");
        let info = store.record_info(&key(i)).unwrap();
        assert_eq!(info.block, b);
        assert_eq!(info.offset % b, 0);
        assert_eq!(info.checksum, page_checksum(&payload(i, len)));
    }
    // Records are packed: a block of header for each record, or for each
    // group of records submitted together, plus each payload rounded up to
    // the block.
    let infos: Vec<_> = LENS
        .iter()
        .enumerate()
        .map(|(i, &len)| (store.record_info(&key(i as u64)).unwrap(), len as u64))
        .collect();
    assert_packed(infos, b);
    let s = store.stats();
    assert_eq!(s.writes_in_place, LENS.len() as u64);
    assert_eq!(s.writes_completed, LENS.len() as u64);
    assert_eq!(s.demotions_holding, 0);
    assert_eq!(s.refusals.total(), 0);
    assert_eq!(s.block_bytes, b);

    // Outside the pool, or (under O_DIRECT) off the alignment: copied.
    let outside = payload(100, 5000);
    assert_eq!(
        store
            .demote(&key(100), DIGEST, &outside, page_checksum(&outside), 0)
            .unwrap(),
        Demoted::Copied
    );
    let slot = land(&mut pool, 101, 8193);
    let sum = page_checksum(&payload(101, 8193)[1..]);
    let shifted = &pool.pool.bytes(slot, 8193).unwrap()[1..];
    let how = store.demote(&key(101), DIGEST, shifted, sum, 0).unwrap();
    if store.direct_io() {
        assert_eq!(how, Demoted::Copied);
    }
    let (released, done) = settle(&mut store);
    assert_eq!(released.len(), usize::from(how != Demoted::Copied));
    assert_eq!(done, vec![Ok(()), Ok(())]);
    assert!(pool.read(&mut store, &key(100), 5000).unwrap() == outside);
    assert!(pool.read(&mut store, &key(101), 8192).unwrap() == payload(101, 8193)[1..]);
    drop(store);

    // Restart: the scan finds the version-2 records.
    let mut store = open(dir.path(), backend);
    let s = store.stats();
    assert_eq!(s.open_scan.records, LENS.len() as u64 + 2);
    assert_eq!(s.open_scan.v1_records, 0);
    assert_eq!(s.open_scan.corrupt_skipped, 0);
    let mut pool = Pool::new(&mut store, 32 << 20);
    for (i, &len) in LENS.iter().enumerate() {
        let i = i as u64;
        assert!(pool.read(&mut store, &key(i), len as u64).unwrap() == payload(i, len));
    }
    drop(store);
}

#[test]
fn in_place_round_trip_blocking() {
    round_trip(IoBackend::Blocking);
}

#[test]
fn in_place_round_trip_io_uring() {
    round_trip(IoBackend::IoUring);
}

/// A write that fails at the device releases its token exactly once and
/// reports the demotion failed; the key can be demoted again.
fn failed_write_releases(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let len = 64 << 10;
    let slot = land(&mut pool, 1, len);
    let sum = page_checksum(&payload(1, len));
    store.fail_next_writes(1);
    let Demoted::InPlace(t) = demote_slot(&mut store, &pool, slot, 1, len, sum) else {
        panic!("copied")
    };
    let (released, done) = settle(&mut store);
    assert_eq!(released, vec![t]);
    assert!(
        matches!(&done[..], [Err(DemoteFailed::Io(why))] if why.contains("Bad file descriptor")),
        "{done:?}"
    );
    assert_eq!(store.demotions_holding(), 0);
    assert!(store.lookup(&key(1)).is_none());
    let s = store.stats();
    assert_eq!(s.write_failures.io, 1);
    assert_eq!(s.write_failures.total(), 1);
    assert_eq!(s.writes_completed, 0);
    // Again, now healthy.
    let Demoted::InPlace(t2) = demote_slot(&mut store, &pool, slot, 1, len, sum) else {
        panic!("copied")
    };
    assert_ne!(t, t2);
    let (released, done) = settle(&mut store);
    assert_eq!(released, vec![t2]);
    assert_eq!(done, vec![Ok(())]);
    assert!(pool.read(&mut store, &key(1), len as u64).unwrap() == payload(1, len));
    drop(store);
}

#[test]
fn failed_write_releases_blocking() {
    failed_write_releases(IoBackend::Blocking);
}

#[test]
fn failed_write_releases_io_uring() {
    failed_write_releases(IoBackend::IoUring);
}

/// In-place demotions submitted together are written as one group: one
/// header block, then each payload straight from the pool (a partial last
/// block through a tail buffer). A failed group fails and releases every
/// record of it, exactly once; a healthy one is read back, before and
/// after a reopen.
fn grouped_demotions(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let lens = [16 << 10, 5000, 20_000, 4096, 1];
    let slots: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| land(&mut pool, i as u64, len))
        .collect();
    let demote_all = |store: &mut SsdStore, pool: &Pool| -> Vec<DemoteToken> {
        lens.iter()
            .zip(&slots)
            .enumerate()
            .map(|(i, (&len, &slot))| {
                let sum = page_checksum(&payload(i as u64, len));
                match demote_slot(store, pool, slot, i as u64, len, sum) {
                    Demoted::InPlace(t) => t,
                    Demoted::Copied => panic!("copied"),
                }
            })
            .collect()
    };
    store.fail_next_writes(1);
    let mut tokens = demote_all(&mut store, &pool);
    let (mut released, done) = settle(&mut store);
    released.sort();
    tokens.sort();
    assert_eq!(
        released, tokens,
        "every record of the failed group is released once"
    );
    assert_eq!(done.len(), lens.len());
    assert!(
        done.iter().all(|d| matches!(d, Err(DemoteFailed::Io(_)))),
        "{done:?}"
    );
    let s = store.stats();
    assert_eq!((s.write_failures.io, s.writes_completed), (5, 0));
    assert_eq!(s.grouped_writes, 5, "one group of five");
    assert_eq!(store.demotions_holding(), 0);
    for i in 0..lens.len() as u64 {
        assert!(store.lookup(&key(i)).is_none());
    }

    let mut tokens = demote_all(&mut store, &pool);
    let (mut released, done) = settle(&mut store);
    released.sort();
    tokens.sort();
    assert_eq!(released, tokens);
    assert_eq!(done, vec![Ok(()); lens.len()]);
    assert_eq!(store.stats().grouped_writes, 10);
    let first = store.record_info(&key(0)).unwrap();
    for i in 0..lens.len() as u64 {
        let info = store.record_info(&key(i)).unwrap();
        assert!(info.grouped && info.offset == first.offset, "{info:?}");
    }
    for (i, &len) in lens.iter().enumerate() {
        let got = pool.read(&mut store, &key(i as u64), len as u64).unwrap();
        assert!(got == payload(i as u64, len), "page {i}");
    }
    drop(pool);
    drop(store);
    let mut store = open(dir.path(), backend);
    assert_eq!(store.stats().open_scan.records, 5);
    assert_eq!(store.stats().open_scan.corrupt_skipped, 0);
    let mut pool = Pool::new(&mut store, 8 << 20);
    for (i, &len) in lens.iter().enumerate() {
        let got = pool.read(&mut store, &key(i as u64), len as u64).unwrap();
        assert!(got == payload(i as u64, len), "page {i} after reopen");
    }
    drop(store);
}

#[test]
fn grouped_demotions_blocking() {
    grouped_demotions(IoBackend::Blocking);
}

#[test]
fn grouped_demotions_io_uring() {
    grouped_demotions(IoBackend::IoUring);
}

/// Out of space with nothing to evict: the queued in-place write is never
/// issued, fails `NoSpace`, and its token is released.
#[test]
fn no_space_releases() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let Some(_m) = Mount::tmpfs(&dir, "size=128k") else {
        eprintln!("SKIPPED no-space test: mount(2) is not permitted here");
        return;
    };
    for backend in BACKENDS {
        let cfg = SsdConfig {
            segment_bytes: 256 << 10,
            ..config(&dir, backend)
        };
        let mut store = SsdStore::open(cfg).expect("open on a full filesystem");
        let mut pool = Pool::new(&mut store, 8 << 20);
        let slot = land(&mut pool, 2, 4096);
        let sum = page_checksum(&payload(2, 4096));
        let t = 2_000_000; // past the creation backoff
        let bytes = pool.pool.bytes(slot, 4096).unwrap();
        let Demoted::InPlace(token) = store.demote(&key(2), DIGEST, bytes, sum, t).unwrap() else {
            panic!("copied")
        };
        let (released, done) = settle(&mut store);
        assert_eq!(released, vec![token]);
        assert_eq!(done, vec![Err(DemoteFailed::NoSpace)]);
        assert_eq!(store.demotions_holding(), 0);
        assert_eq!(store.stats().write_failures.no_space, 1);
        drop(store);
    }
}

/// Drop waits for in-place writes in flight: once it returns the pool is
/// the caller's, and what was written is what the pool held at demote.
fn drop_drains(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let mut pool = Pool::new(&mut store, 16 << 20);
    let len = 64 << 10;
    let mut slots = Vec::new();
    for i in 0..8u64 {
        let slot = land(&mut pool, i, len);
        let sum = page_checksum(&payload(i, len));
        assert!(matches!(
            demote_slot(&mut store, &pool, slot, i, len, sum),
            Demoted::InPlace(_)
        ));
        slots.push(slot);
    }
    assert_eq!(store.demotions_holding(), 8);
    drop(store); // not polled once
    for s in &slots {
        pool.pool.bytes_mut(*s, len as u64).unwrap().fill(0x11);
    }
    let mut store = open(dir.path(), backend);
    assert_eq!(store.stats().open_scan.records, 8);
    assert_eq!(store.stats().open_scan.corrupt_skipped, 0);
    let mut pool = Pool::new(&mut store, 8 << 20);
    for i in 0..8u64 {
        assert!(pool.read(&mut store, &key(i), len as u64).unwrap() == payload(i, len));
    }
    drop(store);
}

#[test]
fn drop_drains_in_place_writes_blocking() {
    drop_drains(IoBackend::Blocking);
}

#[test]
fn drop_drains_in_place_writes_io_uring() {
    drop_drains(IoBackend::IoUring);
}

/// Bytes altered in DRAM after they landed (so no longer matching the
/// checksum the page carries) are stored without hashing, in place or
/// copied, and refused when read: `Corrupt`, the key leaves the index,
/// counted as such; the next open skips them.
fn altered_after_land(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let len = 16 << 10;
    // Page 1 in place, page 2 copied (outside the pool), page 3 intact.
    let slot = land(&mut pool, 1, len);
    let sum1 = page_checksum(&payload(1, len));
    pool.pool.bytes_mut(slot, len as u64).unwrap()[77] ^= 0x40;
    assert!(matches!(
        demote_slot(&mut store, &pool, slot, 1, len, sum1),
        Demoted::InPlace(_)
    ));
    let mut copy = payload(2, len);
    let sum2 = page_checksum(&copy);
    copy[len - 1] ^= 1;
    assert_eq!(
        store.demote(&key(2), DIGEST, &copy, sum2, 0).unwrap(),
        Demoted::Copied
    );
    let slot3 = land(&mut pool, 3, len);
    let sum3 = page_checksum(&payload(3, len));
    assert!(matches!(
        demote_slot(&mut store, &pool, slot3, 3, len, sum3),
        Demoted::InPlace(_)
    ));
    let (released, done) = settle(&mut store);
    assert_eq!(released.len(), 2);
    assert_eq!(done, vec![Ok(()); 3], "stored, unverified");
    assert_eq!(store.stats().writes_completed, 3);
    assert_eq!(store.stats().refusals.total(), 0);
    assert_eq!(store.lookup(&key(1)).unwrap().checksum, sum1);
    for (k, sum) in [(key(1), sum1), (key(2), sum2)] {
        assert_eq!(store.lookup(&k).unwrap().checksum, sum);
        assert_eq!(
            pool.read(&mut store, &k, len as u64),
            Err(TierError::Corrupt)
        );
        assert!(store.lookup(&k).is_none(), "refused record left the index");
    }
    assert!(pool.read(&mut store, &key(3), len as u64).unwrap() == payload(3, len));
    let s = store.stats();
    assert_eq!(s.reads_corrupt, 2);
    assert_eq!(s.evictions.corrupt, 2);
    assert_eq!(s.reads_completed, 1);
    assert_eq!(s.records, 1);
    assert!(s.last_corruption.unwrap().contains("payload checksum"));
    drop(store);
    let store = open(dir.path(), backend);
    let s = store.stats();
    assert_eq!(s.open_scan.corrupt_skipped, 2);
    assert_eq!(s.open_scan.records, 1);
    assert!(store.lookup(&key(1)).is_none() && store.lookup(&key(2)).is_none());
    drop(store);
}

#[test]
fn altered_after_land_is_refused_at_read_blocking() {
    altered_after_land(IoBackend::Blocking);
}

#[test]
fn altered_after_land_is_refused_at_read_io_uring() {
    altered_after_land(IoBackend::IoUring);
}

/// Writes a version-1 segment (4 KiB header blocks, payloads padded to
/// 4 KiB, no block field) as the previous code did. Returns each record's
/// offset.
fn write_v1_segment(path: &std::path::Path, id: u64, pages: &[(u64, usize)], bad: u64) -> Vec<u64> {
    let mut file = vec![0u8; 1 << 20];
    let mut off = 0u64;
    let mut offs = Vec::new();
    for (seq, &(i, len)) in pages.iter().enumerate() {
        let bytes = payload(i, len);
        let h = RecordHeader {
            segment_id: id,
            record_offset: off,
            sequence: seq as u64,
            key: key(i),
            format_digest: DIGEST,
            payload_len: len as u64,
            payload_checksum: page_checksum(&bytes),
            written_us: 5,
            block: V1_BLOCK,
            version: 2,
            group: None,
        };
        let mut hb = h.encode().unwrap();
        // The version-1 layout: version 1, bytes 200..248 reserved (zero).
        hb[8..10].copy_from_slice(&1u16.to_le_bytes());
        hb[200..204].fill(0);
        let sum = header_sum(&hb);
        hb[OFF_HEADER_SUM..OFF_HEADER_SUM + 8].copy_from_slice(&sum.to_le_bytes());
        let at = off as usize;
        file[at..at + 4096].copy_from_slice(&hb);
        file[at + 4096..at + 4096 + len].copy_from_slice(&bytes);
        if i == bad {
            file[at + 4096 + len / 2] ^= 0x08;
        }
        offs.push(off);
        off += 4096 + round_up(len as u64, 4096);
    }
    std::fs::write(path, &file).unwrap();
    offs
}

/// Version-1 segments found at open are read as written (4 KiB blocks):
/// valid records are indexed and served with exact bytes, a corrupt one is
/// skipped and counted; new records beside them are version 2.
fn v1_segments_are_read(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let pages = [
        (0u64, 5000usize),
        (1, 4096),
        (2, 1),
        (3, 70_000),
        (4, 12_288),
    ];
    let offs = write_v1_segment(&dir.path().join("seg-0000000000000000.okv"), 0, &pages, 2);
    let mut store = open(dir.path(), backend);
    let s = store.stats();
    assert_eq!(s.open_scan.v1_records, 4, "{:?}", s.open_scan);
    assert_eq!(s.open_scan.records, 4);
    assert_eq!(s.open_scan.corrupt_skipped, 1);
    assert_eq!(s.open_scan.buffered_segments, 0);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let at: HashMap<u64, u64> = pages.iter().map(|p| p.0).zip(offs).collect();
    for &(i, len) in &pages {
        if i == 2 {
            assert!(store.lookup(&key(i)).is_none());
            continue;
        }
        let info = store.record_info(&key(i)).unwrap();
        assert_eq!(
            (info.block, info.offset, info.sequence),
            (V1_BLOCK, at[&i], i)
        );
        assert!(pool.read(&mut store, &key(i), len as u64).unwrap() == payload(i, len));
    }
    // New pages beside them use the current layout.
    write_all(&mut store, &[(key(10), payload(10, 9000))]);
    let info = store.record_info(&key(10)).unwrap();
    assert_eq!(info.block, store.block_bytes());
    assert!(info.sequence > 4, "sequences continue past the v1 records");
    drop(store);
    let mut store = open(dir.path(), backend);
    let s = store.stats();
    assert_eq!((s.open_scan.records, s.open_scan.v1_records), (5, 4));
    let mut pool = Pool::new(&mut store, 8 << 20);
    assert!(pool.read(&mut store, &key(3), 70_000).unwrap() == payload(3, 70_000));
    assert!(pool.read(&mut store, &key(10), 9000).unwrap() == payload(10, 9000));
    drop(store);
}

#[test]
fn v1_segments_are_read_blocking() {
    v1_segments_are_read(IoBackend::Blocking);
}

#[test]
fn v1_segments_are_read_io_uring() {
    v1_segments_are_read(IoBackend::IoUring);
}

/// `submit_write` (bytes with no known checksum) still copies and hashes;
/// a failed copy-path write reports `WriteError::Io`.
#[test]
fn submit_write_copies_and_hashes() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = open(dir.path(), backend);
        store.fail_next_writes(1);
        let bytes = payload(5, 3000);
        store.submit_write(&key(5), DIGEST, &bytes, 0).unwrap();
        let done = store.wait_writes(0);
        assert!(
            matches!(&done[..], [d] if matches!(d.result, Err(WriteError::Io(_)))),
            "{done:?}"
        );
        store.submit_write(&key(5), DIGEST, &bytes, 0).unwrap();
        assert_eq!(store.wait_writes(0)[0].result, Ok(()));
        assert_eq!(
            store.lookup(&key(5)).unwrap().checksum,
            page_checksum(&bytes)
        );
        assert_eq!(store.stats().writes_in_place, 0);
        drop(store);
    }
}
