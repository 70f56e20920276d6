//! SSD store: round trips, restart, corruption, refusals and capacity, each
//! on both engines (blocking pool and io_uring). Exact bytes, no timing.

mod ssd_common;

use orbitkv_io::checksum::page_checksum;
use orbitkv_io::ssd::format::RecordHeader;
use orbitkv_io::ssd::{
    IoBackend, SsdConfig, SsdError, SsdStore, SyncPolicy, WriteAdmission, WriteRefused,
};
use orbitkv_io::tier::{BackingTier, TierChange, TierError};
use ssd_common::*;

/// Sizes that cover one block, several blocks, a large page, non-multiples
/// of 4 KiB on both sides of a block boundary, and a 1-byte page.
const SIZES: [usize; 9] = [4096, 12288, 65536, 5000, 1, 4095, 4097, 300_000, 1 << 20];

fn pages(n: u64, base: u64) -> Vec<(orbitkv_components::StateKey, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let id = base + i;
            (key(id), payload(id, SIZES[(i as usize) % SIZES.len()]))
        })
        .collect()
}

fn round_trip(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let pages = pages(40, 0);
    write_all(&mut store, &pages);
    let mut pool = Pool::new(&mut store, 32 << 20);
    for (k, bytes) in &pages {
        let e = store.lookup(k).expect("visible after completion");
        assert_eq!(e.bytes, bytes.len() as u64);
        assert_eq!(e.checksum, page_checksum(bytes));
        assert_eq!(store.record_info(k).unwrap().format_digest, DIGEST);
        let got = pool.read(&mut store, k, bytes.len() as u64).unwrap();
        assert!(got == *bytes, "{k:?}: bytes differ");
    }
    let s = store.stats();
    assert_eq!(s.records, 40);
    assert_eq!(
        s.bytes,
        pages.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
    );
    assert_eq!(s.writes_completed, 40);
    assert_eq!(s.reads_completed, 40);
    assert_eq!(s.reads_corrupt + s.reads_failed, 0);
    assert!(s.segments >= 2, "40 pages of up to 1 MiB span segments");
    assert!(s.syncs >= 1);
    assert_eq!(s.refusals.total(), 0);
    drop(store);
}

#[test]
fn round_trip_blocking() {
    round_trip(IoBackend::Blocking);
}

#[test]
fn round_trip_io_uring() {
    round_trip(IoBackend::IoUring);
}

/// Reads into pool ranges that are not aligned to the record block (100
/// bytes off: no block divides it), or too short for the padded tail, go
/// through a bounce buffer: exactly `len` bytes land, the bytes around them
/// are untouched.
fn unaligned_destination(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let pages = pages(6, 100);
    write_all(&mut store, &pages);
    let mut pool = Pool::new(&mut store, 8 << 20);
    for (k, bytes) in &pages {
        let len = bytes.len() as u64;
        let slot = pool.pool.alloc(len + 8192).unwrap();
        let off = pool.pool.offset(slot).unwrap();
        pool.pool.bytes_mut(slot, len + 8192).unwrap().fill(0xee);
        let token = store.submit_read(k, off + 100, len, 0).unwrap();
        let done = pool.wait(&mut store, token);
        assert_eq!(done.result, Ok(()));
        let all = pool.pool.bytes(slot, len + 8192).unwrap();
        assert!(all[..100].iter().all(|&b| b == 0xee));
        assert!(all[100..100 + len as usize] == bytes[..]);
        assert!(all[100 + len as usize..].iter().all(|&b| b == 0xee));
        pool.pool.free(slot).unwrap();
    }
    // The tail of the pool: room for `len` but not for the padded length.
    let (k, bytes) = &pages[3]; // 5000 bytes
    let size = pool.pool.capacity();
    let off = size - bytes.len() as u64;
    let token = store.submit_read(k, off, bytes.len() as u64, 0).unwrap();
    assert_eq!(pool.wait(&mut store, token).result, Ok(()));
    drop(store);
}

#[test]
fn unaligned_destination_blocking() {
    unaligned_destination(IoBackend::Blocking);
}

#[test]
fn unaligned_destination_io_uring() {
    unaligned_destination(IoBackend::IoUring);
}

fn restart(backend: IoBackend, reopen_with: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let pages = pages(30, 1000);
    {
        let mut store = open(dir.path(), backend);
        write_all(&mut store, &pages);
    }
    let mut store = open(dir.path(), reopen_with);
    let s = store.stats();
    assert_eq!(s.open_scan.records, 30);
    assert_eq!(s.open_scan.corrupt_skipped, 0);
    assert_eq!(s.records, 30);
    assert_eq!(s.open_scan.v1_records, 0);
    // Records at the store's block, packed: a header block (a record's
    // own, or one shared by a group of records written together), then
    // each payload rounded up to the block.
    let blk = store.block_bytes();
    let infos: Vec<_> = pages
        .iter()
        .map(|(k, b)| (store.record_info(k).unwrap(), b.len() as u64))
        .collect();
    assert!(
        infos.iter().any(|(r, _)| r.grouped),
        "30 writes submitted together form groups"
    );
    assert_packed(infos, blk);
    let mut pool = Pool::new(&mut store, 32 << 20);
    for (k, bytes) in &pages {
        assert_eq!(store.lookup(k).unwrap().bytes, bytes.len() as u64);
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    // New writes after a restart go to a new segment and survive too.
    let more = pages_after(2000);
    write_all(&mut store, &more);
    drop(store);
    let mut store = open(dir.path(), backend);
    assert_eq!(store.stats().records, 33);
    let mut pool = Pool::new(&mut store, 32 << 20);
    for (k, bytes) in pages.iter().chain(&more) {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    drop(store);
}

fn pages_after(base: u64) -> Vec<(orbitkv_components::StateKey, Vec<u8>)> {
    (0..3)
        .map(|i| (key(base + i), payload(base + i, 7000)))
        .collect()
}

#[test]
fn restart_blocking() {
    restart(IoBackend::Blocking, IoBackend::Blocking);
}

#[test]
fn restart_io_uring() {
    restart(IoBackend::IoUring, IoBackend::IoUring);
}

#[test]
fn restart_across_backends() {
    restart(IoBackend::IoUring, IoBackend::Blocking);
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// A payload byte flipped.
    Payload,
    /// A header byte (inside the key) flipped: header checksum fails.
    Header,
    /// A well-formed header naming another key, with a valid checksum.
    ForeignKey,
    /// A header copied from another record (wrong segment offset).
    MovedHeader,
}

fn corruption(backend: IoBackend, damage: Damage) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    let pages = pages(4, 3000);
    write_each(&mut store, &pages);
    let (victim, vbytes) = &pages[1];
    let info = store.record_info(victim).unwrap();
    let path = store.segment_path(info.segment_id);
    match damage {
        Damage::Payload => flip_byte(&path, info.offset + info.block + 100),
        Damage::Header => flip_byte(&path, info.offset + 100),
        Damage::ForeignKey | Damage::MovedHeader => {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut block = vec![0u8; info.block as usize];
            let block = if let Damage::ForeignKey = damage {
                f.read_exact_at(&mut block, info.offset).unwrap();
                let mut h = RecordHeader::decode(&block).unwrap();
                h.key = key(999_999);
                h.encode().unwrap()
            } else {
                let other = store.record_info(&pages[0].0).unwrap();
                assert_eq!(other.segment_id, info.segment_id);
                f.read_exact_at(&mut block, other.offset).unwrap();
                block
            };
            f.write_all_at(&block, info.offset).unwrap();
            f.sync_all().unwrap();
        }
    }
    let mut pool = Pool::new(&mut store, 8 << 20);
    assert!(store.lookup(victim).is_some(), "metadata-only lookup");
    let r = pool.read(&mut store, victim, vbytes.len() as u64);
    assert_eq!(r, Err(TierError::Corrupt), "{damage:?}");
    assert!(store.lookup(victim).is_none(), "corrupt record reclaimed");
    assert_eq!(
        store.submit_read(victim, 0, vbytes.len() as u64, 0),
        Err(TierError::NotFound)
    );
    let s = store.stats();
    assert_eq!(s.reads_corrupt, 1);
    assert_eq!(s.evictions.corrupt, 1);
    assert!(s.last_corruption.is_some());
    for (k, bytes) in pages.iter().filter(|(k, _)| k != victim) {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    drop(store);

    let mut store = open(dir.path(), backend);
    assert!(
        store.lookup(victim).is_none(),
        "{damage:?}: skipped at open"
    );
    let s = store.stats();
    match damage {
        // The forged header is a self-consistent record of another key.
        Damage::ForeignKey => assert!(store.lookup(&key(999_999)).is_some()),
        _ => assert_eq!(s.open_scan.corrupt_skipped, 1, "{damage:?}"),
    }
    let mut pool = Pool::new(&mut store, 8 << 20);
    for (k, bytes) in pages.iter().filter(|(k, _)| k != victim) {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    drop(store);
}

#[test]
fn corrupt_payload_blocking() {
    corruption(IoBackend::Blocking, Damage::Payload);
}

#[test]
fn corrupt_payload_io_uring() {
    corruption(IoBackend::IoUring, Damage::Payload);
}

#[test]
fn corrupt_header_blocking() {
    corruption(IoBackend::Blocking, Damage::Header);
}

#[test]
fn corrupt_header_io_uring() {
    corruption(IoBackend::IoUring, Damage::Header);
}

#[test]
fn foreign_key_header_blocking() {
    corruption(IoBackend::Blocking, Damage::ForeignKey);
}

#[test]
fn foreign_key_header_io_uring() {
    corruption(IoBackend::IoUring, Damage::ForeignKey);
}

#[test]
fn moved_header_blocking() {
    corruption(IoBackend::Blocking, Damage::MovedHeader);
}

#[test]
fn moved_header_io_uring() {
    corruption(IoBackend::IoUring, Damage::MovedHeader);
}

/// Torn and partial records (as a crash mid-write leaves them) are skipped
/// at open and counted; the scan resynchronises after a garbage header.
fn torn_records(backend: IoBackend) {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let pages: Vec<_> = (0..5).map(|i| (key(i), payload(i, 20_000))).collect();
    let (seg_path, offs, hb) = {
        let mut store = open(dir.path(), backend);
        write_each(&mut store, &pages);
        let infos: Vec<_> = pages
            .iter()
            .map(|(k, _)| store.record_info(k).unwrap())
            .collect();
        assert!(infos.iter().all(|i| i.segment_id == infos[0].segment_id));
        assert!(infos.iter().all(|i| i.block == store.block_bytes()));
        (
            store.segment_path(infos[0].segment_id),
            infos.iter().map(|i| i.offset).collect::<Vec<_>>(),
            infos[0].block,
        )
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg_path)
        .unwrap();
    // Record 0: garbage header (a torn first block).
    f.write_all_at(&[0xab; 4096], offs[0]).unwrap();
    // Record 2: the payload's second half never reached the disk.
    f.write_all_at(&vec![0u8; 8192], offs[2] + hb + 12288)
        .unwrap();
    // Record 4: the file ends inside its payload.
    f.set_len(offs[4] + hb + 4096).unwrap();
    f.sync_all().unwrap();
    drop(f);

    let mut store = open(dir.path(), backend);
    let s = store.stats();
    assert_eq!(s.open_scan.corrupt_skipped, 3, "{:?}", s.open_scan);
    assert_eq!(s.records, 2);
    let mut pool = Pool::new(&mut store, 8 << 20);
    for i in [0usize, 2, 4] {
        assert!(store.lookup(&pages[i].0).is_none());
    }
    for i in [1usize, 3] {
        let got = pool.read(&mut store, &pages[i].0, 20_000).unwrap();
        assert!(got == pages[i].1);
    }
    drop(store);
}

/// Records written together share one header block (a group). Damage to
/// one entry costs that record only; a torn first entry costs the group;
/// a damaged payload costs its record, at read and at open. A grouped
/// record's read verifies its payload against the checksum its entry had
/// when indexed, so a damaged entry whose payload is intact still reads
/// correct bytes until the next open drops it.
fn damaged_groups(backend: IoBackend) {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let group = |g: u64| -> Vec<_> {
        (0..5)
            .map(|i| (key(10 * g + i), payload(10 * g + i, 20_000)))
            .collect()
    };
    let (a, b, c) = (group(1), group(2), group(3));
    let mut store = open(dir.path(), backend);
    for g in [&a, &b, &c] {
        write_all(&mut store, g);
    }
    let info = |store: &SsdStore, k| store.record_info(k).unwrap();
    let hb = store.block_bytes();
    for g in [&a, &b, &c] {
        let first = info(&store, &g[0].0);
        assert!(first.grouped);
        assert_eq!(first.payload_offset, first.offset + hb);
        for (k, _) in g {
            assert_eq!(
                info(&store, k).offset,
                first.offset,
                "one group per write_all"
            );
        }
    }
    assert_eq!(store.stats().grouped_writes, 15);
    let path = store.segment_path(info(&store, &a[0].0).segment_id);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let a0 = info(&store, &a[0].0).offset;
    // A: entry 2's key flipped (its header checksum fails); A3's payload
    // damaged.
    f.write_all_at(&[0x5a], a0 + 2 * 256 + 100).unwrap();
    let a3 = info(&store, &a[3].0).payload_offset;
    f.write_all_at(&[0x5a; 8], a3 + 300).unwrap();
    // B: its header block torn (the first entry is garbage).
    f.write_all_at(&[0xab; 512], info(&store, &b[0].0).offset)
        .unwrap();
    // C: the second half of entry 1's payload never reached the disk.
    let c1 = info(&store, &c[1].0).payload_offset;
    f.write_all_at(&[0u8; 8192], c1 + 12288).unwrap();
    f.sync_all().unwrap();
    drop(f);

    let mut pool = Pool::new(&mut store, 8 << 20);
    assert!(pool.read(&mut store, &a[2].0, 20_000).unwrap() == a[2].1);
    assert_eq!(
        pool.read(&mut store, &a[3].0, 20_000),
        Err(TierError::Corrupt)
    );
    assert!(store.lookup(&a[3].0).is_none(), "reclaimed at read");
    assert_eq!(
        pool.read(&mut store, &c[1].0, 20_000),
        Err(TierError::Corrupt)
    );
    assert!(pool.read(&mut store, &c[2].0, 20_000).unwrap() == c[2].1);
    drop(pool);
    drop(store);

    let mut store = open(dir.path(), backend);
    let s = store.stats();
    // A2's entry, A3's payload, B's torn block (one run), C1's payload.
    assert_eq!(s.open_scan.corrupt_skipped, 4, "{:?}", s.open_scan);
    assert_eq!(s.records, 7);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let lost = [&a[2], &a[3], &c[1]].into_iter().chain(&b);
    for (k, _) in lost {
        assert!(store.lookup(k).is_none(), "{k:?}");
    }
    let kept = [0, 1, 4]
        .map(|i| &a[i])
        .into_iter()
        .chain([0, 2, 3, 4].map(|i| &c[i]));
    for (k, bytes) in kept {
        assert!(pool.read(&mut store, k, 20_000).unwrap() == *bytes, "{k:?}");
    }
    drop(store);
}

#[test]
fn damaged_groups_blocking() {
    damaged_groups(IoBackend::Blocking);
}

#[test]
fn damaged_groups_io_uring() {
    damaged_groups(IoBackend::IoUring);
}

#[test]
fn torn_records_blocking() {
    torn_records(IoBackend::Blocking);
}

#[test]
fn torn_records_io_uring() {
    torn_records(IoBackend::IoUring);
}

fn refusals(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        write_queue_depth: 2,
        ..config(dir.path(), backend)
    };
    let mut store = SsdStore::open(cfg).unwrap();
    let big = vec![1u8; 2 << 20]; // + header exceeds the 2 MiB segment
    assert_eq!(
        store.submit_write(&key(1), DIGEST, &big, 0),
        Err(WriteRefused::TooLarge)
    );
    assert_eq!(
        store.submit_write(&key(1), DIGEST, &[], 0),
        Err(WriteRefused::Empty)
    );
    store.submit_write(&key(1), DIGEST, &[1; 100], 0).unwrap();
    assert_eq!(
        store.submit_write(&key(1), DIGEST, &[1; 100], 0),
        Err(WriteRefused::Duplicate),
        "pending"
    );
    store.submit_write(&key(2), DIGEST, &[2; 100], 0).unwrap();
    assert_eq!(
        store.submit_write(&key(3), DIGEST, &[3; 100], 0),
        Err(WriteRefused::QueueFull)
    );
    let done = store.wait_writes(0);
    assert_eq!(done.len(), 2);
    assert_eq!(
        store.submit_write(&key(1), DIGEST, &[1; 100], 0),
        Err(WriteRefused::Duplicate),
        "stored"
    );
    let s = store.stats();
    assert_eq!(s.refusals.too_large, 1);
    assert_eq!(s.refusals.empty, 1);
    assert_eq!(s.refusals.duplicate, 2);
    assert_eq!(s.refusals.queue_full, 1);
    assert_eq!(s.refusals.get(WriteRefused::Duplicate), 2);
    assert_eq!(s.refusals.total(), 5);
    assert_eq!(s.writes_accepted, 2);
    drop(store);
}

#[test]
fn refusals_blocking() {
    refusals(IoBackend::Blocking);
}

#[test]
fn refusals_io_uring() {
    refusals(IoBackend::IoUring);
}

#[test]
fn admission_on_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        admission: WriteAdmission::OnReuse,
        seen_once_capacity: 2,
        ..config(dir.path(), IoBackend::Auto)
    };
    let mut store = SsdStore::open(cfg).unwrap();
    let w = |s: &mut SsdStore, i: u64| s.submit_write(&key(i), DIGEST, &payload(i, 5000), 0);
    assert_eq!(w(&mut store, 1), Err(WriteRefused::AdmissionPolicy));
    assert!(w(&mut store, 1).is_ok(), "second offer is written");
    assert_eq!(w(&mut store, 2), Err(WriteRefused::AdmissionPolicy));
    assert_eq!(w(&mut store, 3), Err(WriteRefused::AdmissionPolicy));
    assert_eq!(w(&mut store, 4), Err(WriteRefused::AdmissionPolicy));
    // The set holds two keys: 2 was forgotten, 4 is remembered.
    assert_eq!(w(&mut store, 2), Err(WriteRefused::AdmissionPolicy));
    assert!(w(&mut store, 4).is_ok());
    let done = store.wait_writes(0);
    assert_eq!(done.len(), 2);
    assert!(store.lookup(&key(1)).is_some() && store.lookup(&key(4)).is_some());
    let s = store.stats();
    assert_eq!(s.refusals.admission_policy, 5);
    assert!(s.seen_once <= 2);
    drop(store);
}

/// Writes far beyond capacity: whole segments leave oldest-first, counted
/// as `capacity` evictions; what is still indexed reads back exactly.
fn capacity_fifo(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        segment_bytes: 256 << 10,
        capacity_bytes: 768 << 10,
        ..config(dir.path(), backend)
    };
    let mut store = SsdStore::open(cfg).unwrap();
    let pages: Vec<_> = (0..120).map(|i| (key(i), payload(i, 16_000))).collect();
    for chunk in pages.chunks(10) {
        write_all(&mut store, chunk);
    }
    let s = store.stats();
    assert!(s.segments <= 3, "{s:?}");
    assert!(s.evictions.capacity > 0);
    assert!(s.segments_evicted > 0);
    assert_eq!(s.records + s.evictions.capacity, 120);
    assert!(store.lookup(&pages[0].0).is_none(), "oldest evicted first");
    assert!(store.lookup(&pages[119].0).is_some(), "newest kept");
    // FIFO: the surviving keys are a suffix of the write order.
    let first_kept = pages
        .iter()
        .position(|(k, _)| store.lookup(k).is_some())
        .unwrap();
    assert!(
        pages[first_kept..]
            .iter()
            .all(|(k, _)| store.lookup(k).is_some())
    );
    let mut pool = Pool::new(&mut store, 8 << 20);
    for (k, bytes) in &pages[first_kept..] {
        assert!(pool.read(&mut store, k, 16_000).unwrap() == *bytes);
    }
    drop(store);
    let files = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("seg-")
        })
        .count();
    assert!(files <= 3, "{files} segment files left");
}

#[test]
fn capacity_fifo_blocking() {
    capacity_fifo(IoBackend::Blocking);
}

#[test]
fn capacity_fifo_io_uring() {
    capacity_fifo(IoBackend::IoUring);
}

/// Every sync policy publishes only completed writes and survives restart.
#[test]
fn sync_policies() {
    for sync in [
        SyncPolicy::BatchFdatasync,
        SyncPolicy::Dsync,
        SyncPolicy::None,
    ] {
        for backend in BACKENDS {
            let dir = tempfile::tempdir().unwrap();
            let cfg = SsdConfig {
                sync,
                ..config(dir.path(), backend)
            };
            let pages = pages(9, 5000);
            {
                let mut store = SsdStore::open(cfg.clone()).unwrap();
                assert_eq!(store.stats().sync, sync);
                write_all(&mut store, &pages);
                if sync != SyncPolicy::BatchFdatasync {
                    assert_eq!(store.stats().syncs, 0);
                }
            }
            let mut store = SsdStore::open(cfg).unwrap();
            let mut pool = Pool::new(&mut store, 8 << 20);
            for (k, bytes) in &pages {
                assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
            }
            drop(store);
        }
    }
}

fn read_errors(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), backend);
    assert_eq!(
        store.submit_read(&key(1), 0, 10, 0),
        Err(TierError::NoHostPool)
    );
    write_all(&mut store, &[(key(1), payload(1, 5000))]);
    let mut pool = Pool::new(&mut store, 4 << 20);
    let cap = pool.pool.capacity();
    assert!(matches!(
        store.submit_read(&key(1), cap - 100, 5000, 0),
        Err(TierError::OutOfBounds { .. })
    ));
    assert_eq!(
        store.submit_read(&key(1), 0, 4999, 0),
        Err(TierError::SizeMismatch {
            expected: 4999,
            actual: 5000
        })
    );
    assert_eq!(
        store.submit_read(&key(2), 0, 5000, 0),
        Err(TierError::NotFound)
    );
    assert_eq!(store.in_flight(), 0);
    assert!(pool.read(&mut store, &key(1), 5000).unwrap() == payload(1, 5000));
    drop(store);
}

#[test]
fn read_errors_blocking() {
    read_errors(IoBackend::Blocking);
}

#[test]
fn read_errors_io_uring() {
    read_errors(IoBackend::IoUring);
}

/// Many reads submitted at once, more than `max_inflight_reads`: the excess
/// is refused with `QueueFull`, the rest complete with exact bytes.
fn read_queue_bound(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        max_inflight_reads: 4,
        max_inflight_io: 2,
        ..config(dir.path(), backend)
    };
    let mut store = SsdStore::open(cfg).unwrap();
    let pages: Vec<_> = (0..6).map(|i| (key(i), payload(i, 9000))).collect();
    write_all(&mut store, &pages);
    let mut pool = Pool::new(&mut store, 8 << 20);
    let mut slots = Vec::new();
    for (k, _) in &pages[..4] {
        let slot = pool.pool.alloc(9000).unwrap();
        let t = store
            .submit_read(k, pool.pool.offset(slot).unwrap(), 9000, 0)
            .unwrap();
        slots.push((t, slot));
    }
    assert_eq!(
        store.submit_read(&pages[4].0, 0, 9000, 0),
        Err(TierError::QueueFull(4, 4))
    );
    for (i, (t, slot)) in slots.into_iter().enumerate() {
        assert_eq!(pool.wait(&mut store, t).result, Ok(()));
        assert!(pool.pool.bytes(slot, 9000).unwrap() == pages[i].1);
    }
    assert_eq!(store.in_flight(), 0);
    drop(store);
}

#[test]
fn read_queue_bound_blocking() {
    read_queue_bound(IoBackend::Blocking);
}

#[test]
fn read_queue_bound_io_uring() {
    read_queue_bound(IoBackend::IoUring);
}

/// A store dropped while another descriptor of its lock file still exists
/// (a child forked in another thread holds copies until its `exec`) is
/// reopened once that descriptor closes, within `open`'s wait.
#[test]
fn open_waits_out_a_lock_a_forked_child_still_holds() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let dir = tempfile::tempdir().unwrap();
    let lock = std::fs::canonicalize(dir.path()).unwrap().join("LOCK");
    let a = open(dir.path(), IoBackend::Blocking);
    // The store's own descriptor of LOCK, duplicated as fork would.
    let held = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == lock))
        .and_then(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .expect("the store holds LOCK open");
    // SAFETY: dup of a descriptor this process has open; the copy is owned.
    let copy = unsafe { OwnedFd::from_raw_fd(libc::dup(held)) };
    assert!(copy.as_raw_fd() >= 0);
    drop(a);
    let closer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(copy);
    });
    let b = SsdStore::open(config(dir.path(), IoBackend::Blocking));
    closer.join().unwrap();
    assert!(b.is_ok(), "{:?}", b.err());
}

#[test]
fn second_open_of_a_directory_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), IoBackend::Blocking);
    let b = SsdStore::open(config(dir.path(), IoBackend::Blocking));
    assert!(matches!(b, Err(SsdError::Locked { .. })), "{b:?}");
    drop(a);
    assert!(SsdStore::open(config(dir.path(), IoBackend::Blocking)).is_ok());
}

#[test]
fn config_is_strict_and_defaulted() {
    let c: SsdConfig = serde_json::from_str(r#"{"dir": "/x"}"#).unwrap();
    assert_eq!(c.segment_bytes, 64 << 20);
    assert_eq!(c.max_inflight_reads, 64);
    assert_eq!(c.backend, IoBackend::Auto);
    assert_eq!(c.admission, WriteAdmission::All);
    assert_eq!(c.group_bytes, 256 << 10);
    let c: SsdConfig = serde_json::from_str(
        r#"{"dir": "/x", "backend": "io_uring", "admission": "on_reuse", "sync": "dsync",
            "group_bytes": 0}"#,
    )
    .unwrap();
    assert_eq!(c.group_bytes, 0);
    assert_eq!(c.backend, IoBackend::IoUring);
    assert_eq!(c.admission, WriteAdmission::OnReuse);
    assert_eq!(c.sync, SyncPolicy::Dsync);
    assert!(serde_json::from_str::<SsdConfig>(r#"{"dir": "/x", "segmnt_bytes": 1}"#).is_err());
    assert_eq!(SsdConfig::default().validate().ok(), Some(()));
    for bad in [
        SsdConfig {
            segment_bytes: 5000,
            ..SsdConfig::default()
        },
        SsdConfig {
            capacity_bytes: 64 << 20,
            ..SsdConfig::default()
        },
        SsdConfig {
            max_inflight_reads: 0,
            ..SsdConfig::default()
        },
        SsdConfig {
            dir: "".into(),
            ..SsdConfig::default()
        },
        SsdConfig {
            group_bytes: 8 << 10,
            ..SsdConfig::default()
        },
        SsdConfig {
            group_bytes: (4 << 20) + 4096,
            ..SsdConfig::default()
        },
    ] {
        assert!(matches!(
            SsdStore::open(bad),
            Err(SsdError::InvalidConfig(_))
        ));
    }
}

/// `group_bytes = 0`: pages submitted together are written each with a
/// header block of its own (format 2), packed as before groups, and read
/// back through a restart.
#[test]
fn group_bytes_zero_writes_no_groups() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        group_bytes: 0,
        ..config(dir.path(), IoBackend::IoUring)
    };
    let pages = pages(30, 4000);
    let mut store = SsdStore::open(cfg.clone()).unwrap();
    write_all(&mut store, &pages);
    assert_eq!(store.stats().grouped_writes, 0);
    drop(store);
    let mut store = SsdStore::open(cfg).unwrap();
    assert_eq!(store.stats().open_scan.records, 30);
    let blk = store.block_bytes();
    let infos: Vec<_> = pages
        .iter()
        .map(|(k, b)| (store.record_info(k).unwrap(), b.len() as u64))
        .collect();
    assert!(infos.iter().all(|(r, _)| !r.grouped));
    assert_packed(infos, blk);
    let mut pool = Pool::new(&mut store, 32 << 20);
    for (k, bytes) in &pages {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
}

/// A store dropped with a small write still queued (waiting to be
/// grouped) and no room left in its active segment discards that write;
/// it never evicts an older segment to make room for it.
#[test]
fn a_drop_never_evicts_for_a_queued_write() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        segment_bytes: 64 << 10,
        capacity_bytes: 128 << 10,
        ..config(dir.path(), IoBackend::IoUring)
    };
    // Three records of 20,000 bytes: one group of exactly 64 KiB.
    let a: Vec<_> = (0..3).map(|i| (key(i), payload(i, 20_000))).collect();
    let b: Vec<_> = (3..6).map(|i| (key(i), payload(i, 20_000))).collect();
    let mut store = SsdStore::open(cfg.clone()).unwrap();
    write_all(&mut store, &a);
    write_all(&mut store, &b);
    assert_eq!(store.stats().segments, 2, "both segments full, at capacity");
    let files: Vec<_> = [&a[0].0, &b[0].0]
        .map(|k| store.segment_path(store.record_info(k).unwrap().segment_id))
        .into();
    assert_ne!(files[0], files[1]);
    let late = payload(9, 20_000);
    store.submit_write(&key(9), DIGEST, &late, 0).unwrap();
    drop(store);
    for f in &files {
        assert!(f.exists(), "{} was evicted by the drop", f.display());
    }
    // (A reopen starts a segment of its own, which at this capacity
    // evicts the oldest: that is the open's doing, not the drop's.)
    let store = SsdStore::open(cfg).unwrap();
    assert_eq!(store.stats().open_scan.records, 6);
    assert!(store.lookup(&key(9)).is_none());
}

#[test]
fn auto_prefers_io_uring() {
    let dir = tempfile::tempdir().unwrap();
    let store = SsdStore::open(config(dir.path(), IoBackend::Auto)).unwrap();
    // io_uring is available on the project's machines (kernel 6.x); where
    // it is not, Auto must still open with the blocking pool.
    eprintln!("auto chose {:?}", store.backend());
    assert_eq!(store.name(), "ssd");
}

/// Total bytes of the segment files in `dir`.
fn segment_bytes_on_disk(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// Issue 10: capacity is counted in bytes. Segments written under one
/// `segment_bytes` count at their own size after a restart with another, in
/// both directions, so the directory never holds more than the cap.
fn capacity_in_bytes_across_segment_sizes(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let cap = 1 << 20;
    let fill = |segment_bytes: u64, base: u64| {
        let cfg = SsdConfig {
            segment_bytes,
            capacity_bytes: cap,
            ..config(dir.path(), backend)
        };
        let mut store = SsdStore::open(cfg).unwrap();
        assert!(store.stats().disk_bytes <= cap, "{:?}", store.stats());
        let pages: Vec<_> = (base..base + 150)
            .map(|i| (key(i), payload(i, 16_000)))
            .collect();
        for chunk in pages.chunks(10) {
            write_all(&mut store, chunk);
            let s = store.stats();
            assert!(s.disk_bytes <= cap, "{s:?}");
        }
        // The newest pages read back exactly.
        let mut pool = Pool::new(&mut store, 1 << 20);
        for (k, bytes) in &pages[140..] {
            assert!(pool.read(&mut store, k, 16_000).unwrap() == *bytes);
        }
        drop(store);
        let on_disk = segment_bytes_on_disk(dir.path());
        assert!(on_disk <= cap, "{on_disk} bytes of segments, cap {cap}");
    };
    // Small segments fill the cap; larger ones must then evict by bytes,
    // not by count (8 small segments are not "2 of 8 allowed" large ones);
    // and back again.
    fill(128 << 10, 0);
    fill(512 << 10, 1000);
    fill(64 << 10, 2000);
}

#[test]
fn capacity_in_bytes_across_segment_sizes_blocking() {
    capacity_in_bytes_across_segment_sizes(IoBackend::Blocking);
}

#[test]
fn capacity_in_bytes_across_segment_sizes_io_uring() {
    capacity_in_bytes_across_segment_sizes(IoBackend::IoUring);
}

/// Issue 10: a FIFO (or a directory, or a symlink) named like a segment is
/// skipped with a warning, never opened: open returns and the store works.
#[test]
fn entries_that_are_not_regular_files_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), IoBackend::Blocking);
    let pages = pages(4, 0);
    write_all(&mut store, &pages);
    drop(store);
    let fifo = dir.path().join("seg-00000000000000f0.okv");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::create_dir(dir.path().join("seg-00000000000000f1.okv")).unwrap();
    let real = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("0000.okv"))
        .unwrap();
    std::os::unix::fs::symlink(&real, dir.path().join("seg-00000000000000f2.okv")).unwrap();

    let mut store = open(dir.path(), IoBackend::Blocking);
    assert_eq!(store.stats().open_scan.skipped_files, 3);
    let mut pool = Pool::new(&mut store, 4 << 20);
    for (k, bytes) in &pages {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    write_all(&mut store, &pages_after(100));
    drop(store);
    // Left where they were.
    assert!(fifo.exists());
}

/// Issue 10: a segment named with the largest id does not make the next id
/// wrap onto an existing file: it is skipped, and the store opens and
/// writes.
#[test]
fn a_segment_id_at_the_top_of_the_range_does_not_wrap() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), IoBackend::Blocking);
    write_all(&mut store, &pages(4, 0));
    drop(store);
    let top = dir.path().join("seg-ffffffffffffffff.okv");
    std::fs::write(&top, vec![0u8; 4096]).unwrap();
    let mut store = open(dir.path(), IoBackend::Blocking);
    assert_eq!(store.stats().open_scan.skipped_files, 1);
    let more = pages_after(50);
    write_all(&mut store, &more);
    let mut pool = Pool::new(&mut store, 4 << 20);
    for (k, bytes) in &more {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    drop(store);
    // Reopens again (no "File exists").
    drop(open(dir.path(), IoBackend::Blocking));
    assert!(top.exists());
}

/// Issue 23: an 8 GiB sparse file named like a segment held up the start
/// for half a minute (the scan walked every 512-byte block). A file larger
/// than the tier's capacity is refused unread, with a warning; a sparse one
/// within it is walked over its data only (holes hold no record). Checked
/// by the bytes the scan read, not by time.
#[test]
fn an_oversized_or_sparse_segment_file_is_not_walked() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), IoBackend::Blocking);
    let pages = pages(8, 0);
    write_all(&mut store, &pages);
    drop(store);
    let baseline = open(dir.path(), IoBackend::Blocking).stats().open_scan;
    // 8 GiB, sparse: past the 128 MiB tier.
    let huge = std::fs::File::create(dir.path().join("seg-00000000000000f0.okv")).unwrap();
    huge.set_len(8 << 30).unwrap();
    drop(huge);
    // 100 MiB, sparse but for 4 KiB of junk near its end: within the tier.
    let sparse = std::fs::File::create(dir.path().join("seg-00000000000000f1.okv")).unwrap();
    sparse.set_len(100 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&sparse, &[0x5a; 4096], 96 << 20).unwrap();
    drop(sparse);
    let mut store = open(dir.path(), IoBackend::Blocking);
    let scan = store.stats().open_scan;
    assert_eq!(scan.oversized_segments, 1);
    // Each open also leaves a fresh segment behind: compare loosely.
    assert!(
        scan.segments > baseline.segments,
        "the sparse one was scanned"
    );
    assert!(scan.corrupt_skipped > baseline.corrupt_skipped, "its junk");
    let extra = scan.bytes_read - baseline.bytes_read;
    assert!(
        extra <= 16 << 20,
        "read {extra} bytes more for a 100 MiB file"
    );
    let mut pool = Pool::new(&mut store, 4 << 20);
    for (k, bytes) in &pages {
        assert!(pool.read(&mut store, k, bytes.len() as u64).unwrap() == *bytes);
    }
    drop(store);
    assert!(
        dir.path().join("seg-00000000000000f0.okv").exists(),
        "left alone"
    );
}

/// Replays tier changes onto a set, asserting each is a change of it.
fn replay(held: &mut std::collections::BTreeSet<u64>, changes: &[TierChange]) {
    for c in changes {
        match c {
            TierChange::Stored(k) => assert!(held.insert(key_index(k)), "stored twice: {k:?}"),
            TierChange::Removed(k) => assert!(held.remove(&key_index(k)), "removed absent {k:?}"),
        }
    }
}

fn indexed(store: &SsdStore, upto: u64) -> std::collections::BTreeSet<u64> {
    (0..upto)
        .filter(|&i| store.lookup(&key(i)).is_some())
        .collect()
}

/// The SSD index's change journal (the manager's KV events): what a
/// restart's scan found is listed first, then every landed write,
/// capacity eviction and clear, so the changes replayed onto a set end
/// where the index ends; past the cap the loss is said once and the whole
/// index is listed again.
#[test]
fn index_changes_follow_the_index_through_restart_eviction_and_clear() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || SsdConfig {
        segment_bytes: 256 << 10,
        capacity_bytes: 768 << 10,
        ..config(dir.path(), IoBackend::Blocking)
    };
    {
        let mut store = SsdStore::open(cfg()).unwrap();
        let first: Vec<_> = (0..10).map(|i| (key(i), payload(i, 16_000))).collect();
        write_all(&mut store, &first);
    }
    let mut store = SsdStore::open(cfg()).unwrap();
    let mut out = Vec::new();
    assert!(
        !store.take_changes(&mut out) && out.is_empty(),
        "off until asked"
    );
    store.record_changes(1000);
    let mut held = std::collections::BTreeSet::new();
    assert!(!store.take_changes(&mut out));
    assert_eq!(out.len(), 10, "the scan's records listed: {out:?}");
    replay(&mut held, &out);
    // Writes past the capacity evict the oldest segments.
    let more: Vec<_> = (10..120).map(|i| (key(i), payload(i, 16_000))).collect();
    for chunk in more.chunks(10) {
        write_all(&mut store, chunk);
        out.clear();
        assert!(!store.take_changes(&mut out));
        replay(&mut held, &out);
        assert_eq!(held, indexed(&store, 120));
    }
    assert!(store.stats().evictions.capacity > 0);
    // A clear removes the rest.
    let n = store.clear_namespace(&key(0).namespace).unwrap();
    assert!(n > 0);
    out.clear();
    assert!(!store.take_changes(&mut out));
    assert_eq!(out.len() as u64, n);
    replay(&mut held, &out);
    assert!(held.is_empty());
    // Past the cap: said once, and what is indexed is listed again.
    store.record_changes(3);
    write_all(&mut store, &more[..8]);
    out.clear();
    assert!(store.take_changes(&mut out), "a loss went unsaid");
    let mut relisted = std::collections::BTreeSet::new();
    loop {
        replay(&mut relisted, &out);
        out.clear();
        assert!(!store.take_changes(&mut out), "a loss is said once");
        if out.is_empty() {
            break;
        }
        assert!(out.len() <= 3, "a drain lists at most the cap");
    }
    assert_eq!(relisted, indexed(&store, 120));
    assert_eq!(relisted.len(), 8);
}
