//! SSD store throughput against raw io_uring O_DIRECT I/O on the same
//! filesystem, same block size and queue depth, measured in the same run.
//!
//! - read: the store reads 1024 pages of 64 KiB, written in groups (each
//!   read fetches the payload straight into a pool slot and verifies its
//!   XXH3; a record with a header block of its own is one readv of header
//!   block + payload, with the header verified too) vs raw 64 KiB O_DIRECT
//!   reads of the same payload offsets of the same segment files, into the
//!   same pool, and raw readvs of the 4 KiB before each payload + the
//!   payload (the shape of a single record's read); QD 32 all.
//! - write: the runtime's path. Pages sit in a registered `HostPool`; the
//!   store takes each with `demote` and the checksum it carries, in place
//!   (no copy, no hashing: pages submitted together go out as groups, one
//!   pwritev of a shared header block + each pool range), 16 MiB of 16 KiB
//!   or 64 KiB pages per batch, under each sync policy; vs raw O_DIRECT
//!   writes of the same payload bytes from the same slots into a freshly
//!   fallocate'd file, one page per write and, the I/O shape of a group,
//!   as many pages per `writev` as a group holds: no sync / fdatasync after
//!   every 32 pages / O_DSYNC; QD 32 single-page writes, and batched writes
//!   holding as many pages in flight as the store accepts (128).
//!
//! Criterion reports each; a final pass prints the store/raw ratios
//! (median of 5). The directory is $ORBITKV_BENCH_DIR or the system temp
//! dir; its `df -T` line is printed because O_DIRECT behaviour depends on
//! the filesystem.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use io_uring::{IoUring, opcode, types};
use orbitkv_components::{Namespace, StateKey};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::dram::{HostPool, HostPoolConfig};
use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdStore, SyncPolicy, WriteRefused};
use orbitkv_io::tier::{BackingTier, DemoteRefused, Demoted};

const PAGE: usize = 64 << 10;
const READ_PAGES: usize = 1024;
/// Payload bytes per write batch.
const WRITE_BYTES: usize = 16 << 20;
/// Write page sizes.
const WRITE_PAGES: [usize; 2] = [16 << 10, 64 << 10];
/// Distinct source slots per page size.
const SLOTS: usize = 64;
const QD: usize = 32;

fn key(i: u64) -> StateKey {
    StateKey::new(Namespace([9; 32]), 0, &i.to_le_bytes()).unwrap()
}

fn bench_root() -> PathBuf {
    std::env::var_os("ORBITKV_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

fn cfg(dir: &Path, backend: IoBackend, sync: SyncPolicy) -> SsdConfig {
    SsdConfig {
        backend,
        sync,
        capacity_bytes: 512 << 20,
        segment_bytes: 64 << 20,
        max_inflight_reads: QD,
        max_inflight_io: 2 * QD,
        write_queue_depth: 4 * QD,
        ..SsdConfig::new(dir)
    }
}

/// A store holding READ_PAGES pages, a pool with one slot per page, and
/// what the raw baseline needs: (segment path, payload offset) per page.
struct ReadSetup {
    store: SsdStore,
    pool: HostPool,
    slots: Vec<u64>,
    keys: Vec<StateKey>,
    /// Segment file and payload offset of each page, and its header block.
    raw: Vec<(PathBuf, u64, u64)>,
}

fn read_setup(dir: &Path, backend: IoBackend) -> ReadSetup {
    let mut store = SsdStore::open(cfg(dir, backend, SyncPolicy::BatchFdatasync)).unwrap();
    let keys: Vec<_> = (0..READ_PAGES as u64).map(key).collect();
    let page = vec![0x5au8; PAGE];
    let mut now = 0;
    for k in &keys {
        loop {
            now += 1;
            match store.submit_write(k, [0; 32], &page, now) {
                Ok(_) => break,
                Err(WriteRefused::QueueFull) => {
                    store.poll_writes(now, &mut Vec::new());
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(store.wait_writes(now).iter().all(|d| d.result.is_ok()));
    let mut pool = HostPool::new(HostPoolConfig::new(80 << 20)).unwrap();
    pool.first_touch();
    let slots: Vec<u64> = keys
        .iter()
        .map(|_| {
            let slot = pool.alloc(PAGE as u64).unwrap();
            pool.offset(slot).unwrap()
        })
        .collect();
    // SAFETY: the pool outlives the store (dropped after it in ReadSetup's
    // field order) and no slot is touched while a read into it is pending.
    unsafe { store.register_host_pool(pool.base_ptr(), pool.capacity()) }.unwrap();
    let raw = keys
        .iter()
        .map(|k| {
            let info = store.record_info(k).unwrap();
            (
                store.segment_path(info.segment_id),
                info.payload_offset,
                info.block,
            )
        })
        .collect();
    ReadSetup {
        store,
        pool,
        slots,
        keys,
        raw,
    }
}

fn store_read_all(s: &mut ReadSetup) -> Duration {
    let start = Instant::now();
    let (mut next, mut inflight, mut done) = (0, 0, Vec::new());
    while next < s.keys.len() || inflight > 0 {
        while inflight < QD && next < s.keys.len() {
            s.store
                .submit_read(&s.keys[next], s.slots[next], PAGE as u64, 0)
                .unwrap();
            next += 1;
            inflight += 1;
        }
        s.store.poll(0, &mut done);
        if done.is_empty() {
            // The store never blocks; give the CPU away like the raw
            // baseline's submit_and_wait does (2-core machine).
            std::thread::yield_now();
        }
        for d in done.drain(..) {
            d.result.unwrap();
            inflight -= 1;
        }
    }
    start.elapsed()
}

/// Raw O_DIRECT reads of the payloads; with `headers`, each is one readv of
/// the record's header block (into `hdr`) plus the payload, i.e. the
/// store's exact I/O pattern without its bookkeeping and verification.
fn raw_read_all(s: &mut ReadSetup, ring: &mut IoUring, hdr: Option<&mut HostPool>) -> Duration {
    let mut files = std::collections::HashMap::new();
    for (p, _, _) in &s.raw {
        files.entry(p.clone()).or_insert_with(|| {
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(p)
                .unwrap()
        });
    }
    let base = s.pool.base_ptr();
    let hdr_base = hdr.map(|h| h.base_ptr());
    let iovs: Vec<[libc::iovec; 2]> = (0..s.raw.len())
        .map(|i| {
            [
                libc::iovec {
                    // SAFETY: QD header blocks of at most 4 KiB inside `hdr`.
                    iov_base: hdr_base
                        .map_or(std::ptr::null_mut(), |b| unsafe { b.add((i % QD) * 4096) })
                        .cast(),
                    iov_len: s.raw[i].2 as usize,
                },
                libc::iovec {
                    // SAFETY: slot offsets are inside the pool.
                    iov_base: unsafe { base.add(s.slots[i] as usize) }.cast(),
                    iov_len: PAGE,
                },
            ]
        })
        .collect();
    let start = Instant::now();
    let (mut next, mut inflight) = (0, 0);
    while next < s.raw.len() || inflight > 0 {
        while inflight < QD && next < s.raw.len() {
            let (path, off, hb) = &s.raw[next];
            let fd = types::Fd(files[path].as_raw_fd());
            let e = if hdr_base.is_some() {
                opcode::Readv::new(fd, iovs[next].as_ptr(), 2)
                    .offset(*off - *hb)
                    .build()
            } else {
                opcode::Read::new(fd, iovs[next][1].iov_base.cast(), PAGE as u32)
                    .offset(*off)
                    .build()
            }
            .user_data(next as u64);
            // SAFETY: buffer and fd outlive the operation (we reap all).
            unsafe { ring.submission().push(&e).unwrap() };
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1).unwrap();
        for cqe in ring.completion() {
            assert!(cqe.result() >= PAGE as i32, "raw read: {}", cqe.result());
            inflight -= 1;
        }
    }
    start.elapsed()
}

/// Source pages of the write benches: `SLOTS` slots of each page size in
/// one host pool (registered with every write store), each filled with its
/// own bytes, with the checksum a page carries since it landed.
struct Sources {
    pool: HostPool,
    /// Per page size: (pool offset, checksum) of each slot.
    slots: Vec<(usize, Vec<(u64, u64)>)>,
}

impl Sources {
    fn new() -> Sources {
        let bytes: usize = WRITE_PAGES.iter().map(|p| p * SLOTS).sum();
        let mut pool = HostPool::new(HostPoolConfig::new((bytes + (8 << 20)) as u64)).unwrap();
        pool.first_touch();
        let slots = WRITE_PAGES
            .iter()
            .map(|&page| {
                let v = (0..SLOTS)
                    .map(|i| {
                        let slot = pool.alloc(page as u64).unwrap();
                        let b = pool.bytes_mut(slot, page as u64).unwrap();
                        for (j, x) in b.iter_mut().enumerate() {
                            *x = (j as u64 * 31 + i as u64 * 7 + page as u64) as u8;
                        }
                        let sum = page_checksum(b);
                        (pool.offset(slot).unwrap(), sum)
                    })
                    .collect();
                (page, v)
            })
            .collect();
        Sources { pool, slots }
    }

    fn page(&mut self, page: usize, i: usize) -> (&[u8], u64) {
        let (_, v) = self.slots.iter().find(|(p, _)| *p == page).unwrap();
        let (off, sum) = v[i % SLOTS];
        let base = self.pool.base_ptr();
        // SAFETY: a slot of `page` bytes inside the pool, never written
        // after `new` (so unchanged while any in-place write reads it).
        (
            unsafe { std::slice::from_raw_parts(base.add(off as usize), page) },
            sum,
        )
    }

    fn ptrs(&mut self, page: usize) -> Vec<*const u8> {
        (0..SLOTS).map(|i| self.page(page, i).0.as_ptr()).collect()
    }
}

/// One batch of WRITE_BYTES through `demote`, as the runtime evicts: in
/// place, carried checksum; waits until every write is reported and every
/// token released.
fn store_demote_batch(
    store: &mut SsdStore,
    src: &mut Sources,
    page: usize,
    next_key: &mut u64,
) -> Duration {
    let n = WRITE_BYTES / page;
    let start = Instant::now();
    let mut now = 0;
    let (mut done, mut released) = (Vec::new(), Vec::new());
    for i in 0..n {
        let k = key(*next_key);
        *next_key += 1;
        let (bytes, sum) = src.page(page, i);
        loop {
            now += 1;
            match store.demote(&k, [0; 32], bytes, sum, now) {
                Ok(Demoted::InPlace(_)) => break,
                Ok(Demoted::Copied) => panic!("a pool page was copied"),
                Err(DemoteRefused::QueueFull) => {
                    let before = done.len() + released.len();
                    store.poll_demotions(now, &mut done);
                    store.poll_released(&mut released);
                    if done.len() + released.len() == before {
                        // Nothing landed: give the CPU away, as the read
                        // loop does and as the raw baseline blocks in
                        // `submit_and_wait` and `fdatasync` (2 cores: the
                        // kernel's io_uring workers run the syncs).
                        std::thread::yield_now();
                    }
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
    let rest = store.wait_writes(now);
    store.poll_released(&mut released);
    let elapsed = start.elapsed();
    assert!(done.iter().all(|d| d.is_ok()) && rest.iter().all(|d| d.result.is_ok()));
    assert_eq!(done.len() + rest.len(), n);
    assert_eq!(released.len(), n);
    assert_eq!(store.demotions_holding(), 0);
    elapsed
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawSync {
    None,
    Every32,
    Dsync,
}

/// Pages the store writes as one group at most (one header block of 16
/// entries, 256 KiB in all): the raw batched baseline writes as many per
/// I/O.
fn group_pages(page: usize) -> usize {
    (((256 << 10) - 4096) / page.max(1)).clamp(1, 16)
}

/// Raw O_DIRECT writes of WRITE_BYTES from the source slots into a fresh,
/// fallocate'd file (created outside the timed part), `per_io` pages per
/// write (one `writev` of that many slots; 1: one page each). One page per
/// write runs at QD writes in flight; batched writes keep as many pages in
/// flight as the store accepts (`write_queue_depth`, 4 x QD), so that both
/// sides have the same bytes in flight.
fn raw_write_batch(
    dir: &Path,
    ring: &mut IoUring,
    bufs: &[*const u8],
    page: usize,
    sync: RawSync,
    per_io: usize,
) -> Duration {
    let n = WRITE_BYTES / page;
    let depth = if per_io == 1 {
        QD
    } else {
        (4 * QD).div_ceil(per_io)
    };
    let iovs: Vec<Vec<libc::iovec>> = (0..n)
        .step_by(per_io)
        .map(|first| {
            (first..(first + per_io).min(n))
                .map(|i| libc::iovec {
                    iov_base: bufs[i % bufs.len()] as *mut libc::c_void,
                    iov_len: page,
                })
                .collect()
        })
        .collect();
    let path = dir.join("raw-write.bin");
    let _ = std::fs::remove_file(&path);
    let flags = libc::O_DIRECT
        | if sync == RawSync::Dsync {
            libc::O_DSYNC
        } else {
            0
        };
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(flags)
        .open(&path)
        .unwrap();
    // SAFETY: plain syscall.
    unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, WRITE_BYTES as i64) };
    let fd = types::Fd(f.as_raw_fd());
    let start = Instant::now();
    let (mut next, mut inflight, mut since_sync) = (0usize, 0, 0);
    while next < iovs.len() || inflight > 0 {
        while inflight < depth && next < iovs.len() {
            let v = &iovs[next];
            let at = (next * per_io * page) as u64;
            let e = if v.len() == 1 {
                opcode::Write::new(fd, v[0].iov_base as *const u8, page as u32)
                    .offset(at)
                    .build()
            } else {
                opcode::Writev::new(fd, v.as_ptr(), v.len() as u32)
                    .offset(at)
                    .build()
            };
            let e = e.user_data(v.len() as u64);
            // SAFETY: the slots and the iovecs outlive the batch.
            unsafe { ring.submission().push(&e).unwrap() };
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1).unwrap();
        for cqe in ring.completion() {
            assert!(cqe.result() >= 0, "raw write: {}", cqe.result());
            inflight -= 1;
            since_sync += cqe.user_data() as usize;
        }
        if sync == RawSync::Every32 && (since_sync >= 32 || (next == iovs.len() && inflight == 0)) {
            since_sync = 0;
            f.sync_data().unwrap();
        }
    }
    start.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn df(dir: &Path) -> String {
    std::process::Command::new("df")
        .arg("-T")
        .arg(dir)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|e| format!("df failed: {e}"))
}

fn ssd(c: &mut Criterion) {
    let root = tempfile::tempdir_in(bench_root()).unwrap();
    println!(
        "bench directory: {}\n{}",
        root.path().display(),
        df(root.path())
    );
    let mut ring = IoUring::new(QD as u32 * 2).unwrap();

    // Reads.
    let read_dir = root.path().join("read");
    let mut setups: Vec<(IoBackend, ReadSetup)> = [IoBackend::IoUring, IoBackend::Blocking]
        .into_iter()
        .map(|b| (b, read_setup(&read_dir.join(format!("{b:?}")), b)))
        .collect();
    let direct = setups[0].1.store.direct_io();
    println!("O_DIRECT in use: {direct}");
    let mut g = c.benchmark_group("ssd_read_64k_qd32");
    g.throughput(Throughput::Bytes((READ_PAGES * PAGE) as u64));
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut hdr = HostPool::new(HostPoolConfig::new(2 << 20)).unwrap();
    hdr.first_touch();
    g.bench_function("raw_io_uring_odirect", |b| {
        let s = &mut setups[0].1;
        b.iter_custom(|n| (0..n).map(|_| raw_read_all(s, &mut ring, None)).sum())
    });
    g.bench_function("raw_io_uring_odirect_readv_header", |b| {
        let s = &mut setups[0].1;
        b.iter_custom(|n| {
            (0..n)
                .map(|_| raw_read_all(s, &mut ring, Some(&mut hdr)))
                .sum()
        })
    });
    for (backend, s) in &mut setups {
        g.bench_function(format!("store_{backend:?}"), |b| {
            b.iter_custom(|n| (0..n).map(|_| store_read_all(s)).sum())
        });
    }
    g.finish();

    // Writes.
    let mut src = Sources::new();
    let write_dir = root.path().join("write");
    std::fs::create_dir_all(&write_dir).unwrap();
    let policies = [
        (SyncPolicy::BatchFdatasync, RawSync::Every32),
        (SyncPolicy::Dsync, RawSync::Dsync),
        (SyncPolicy::None, RawSync::None),
    ];
    let base = src.pool.base_ptr();
    let cap = src.pool.capacity();
    let mut stores: Vec<(SyncPolicy, RawSync, SsdStore)> = policies
        .iter()
        .map(|&(p, r)| {
            let d = write_dir.join(format!("{p:?}"));
            let mut store = SsdStore::open(cfg(&d, IoBackend::IoUring, p)).unwrap();
            // SAFETY: `src` outlives the stores (dropped at the end, after
            // them) and its slots are never written after setup.
            unsafe { store.register_host_pool(base, cap) }.unwrap();
            (p, r, store)
        })
        .collect();
    println!(
        "record block {} bytes: a 64 KiB page takes {} KiB on disk, a 16 KiB page {} KiB",
        stores[0].2.block_bytes(),
        (stores[0].2.block_bytes() as f64 + 65536.0) / 1024.0,
        (stores[0].2.block_bytes() as f64 + 16384.0) / 1024.0
    );
    let mut next_key = 0u64;
    for page in WRITE_PAGES {
        let bufs = src.ptrs(page);
        let mut g = c.benchmark_group(format!("ssd_write_{}k_qd32", page >> 10));
        g.throughput(Throughput::Bytes(WRITE_BYTES as u64));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for (policy, raw, store) in &mut stores {
            g.bench_function(format!("raw_odirect_{raw:?}"), |b| {
                b.iter_custom(|n| {
                    (0..n)
                        .map(|_| raw_write_batch(&write_dir, &mut ring, &bufs, page, *raw, 1))
                        .sum()
                })
            });
            g.bench_function(format!("store_demote_{policy:?}"), |b| {
                b.iter_custom(|n| {
                    (0..n)
                        .map(|_| store_demote_batch(store, &mut src, page, &mut next_key))
                        .sum()
                })
            });
        }
        g.finish();
    }

    // Ratios, same run: median of 5 each, interleaved.
    println!(
        "\n== ratios (store / raw, median of 5, {} KiB pages, QD {QD}) ==",
        PAGE >> 10
    );
    let mut raw_t = Vec::new();
    let mut rawv_t = Vec::new();
    let mut st: Vec<Vec<Duration>> = vec![Vec::new(); setups.len()];
    for _ in 0..5 {
        raw_t.push(raw_read_all(&mut setups[0].1, &mut ring, None));
        rawv_t.push(raw_read_all(&mut setups[0].1, &mut ring, Some(&mut hdr)));
        for (i, (_, s)) in setups.iter_mut().enumerate() {
            st[i].push(store_read_all(s));
        }
    }
    let raw = median(raw_t);
    let rawv = median(rawv_t);
    let bytes = READ_PAGES * PAGE;
    println!(
        "read  raw 64K read                  {:6.2} GB/s",
        gbps(bytes, raw)
    );
    println!(
        "read  raw readv 4K header + 64K     {:6.2} GB/s",
        gbps(bytes, rawv)
    );
    for (i, (b, _)) in setups.iter().enumerate() {
        let t = median(std::mem::take(&mut st[i]));
        println!(
            "read  store {:<23} {:6.2} GB/s  ratio {:.2} (vs raw readv {:.2})",
            format!("{b:?}"),
            gbps(bytes, t),
            raw.as_secs_f64() / t.as_secs_f64(),
            rawv.as_secs_f64() / t.as_secs_f64()
        );
    }
    let bytes = WRITE_BYTES;
    for page in WRITE_PAGES {
        let bufs = src.ptrs(page);
        for (policy, rawp, store) in &mut stores {
            let k = group_pages(page);
            let (mut r, mut rk, mut s) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..5 {
                r.push(raw_write_batch(
                    &write_dir, &mut ring, &bufs, page, *rawp, 1,
                ));
                rk.push(raw_write_batch(
                    &write_dir, &mut ring, &bufs, page, *rawp, k,
                ));
                s.push(store_demote_batch(store, &mut src, page, &mut next_key));
            }
            let (r, rk, s) = (median(r), median(rk), median(s));
            println!(
                "write {:>2}K raw {:<8} {:6.2} GB/s, x{k} per write {:6.2} GB/s | store demote {:<15} {:6.2} GB/s  ratio {:.2} (vs x{k} {:.2})",
                page >> 10,
                format!("{rawp:?}"),
                gbps(bytes, r),
                gbps(bytes, rk),
                format!("{policy:?}"),
                gbps(bytes, s),
                r.as_secs_f64() / s.as_secs_f64(),
                rk.as_secs_f64() / s.as_secs_f64()
            );
        }
    }
    for (p, _, s) in &stores {
        let st = s.stats();
        println!(
            "store {p:?}: {} writes, {} fdatasyncs ({:.1} writes per sync), {} evicted",
            st.writes_completed,
            st.syncs,
            st.writes_completed as f64 / st.syncs.max(1) as f64,
            st.evictions.capacity
        );
    }
    drop(stores);
    drop(src);
    drop(setups);
}

criterion_group!(benches, ssd);
criterion_main!(benches);
