//! Publish + restore on the host backend at 16 KiB, 64 KiB and 2 MiB
//! pages, against a single-thread streamed memcpy measured in the same run.
//!
//! The real threaded `HostCopyEngine` (default config: 2 workers) and the
//! wall clock. A dense instance; one iteration publishes 16 MiB of pages
//! (N = 1024, 256 or 8 pages) from device slots, queries and prepares them,
//! and restores them into other device slots. Device pages are allocated
//! once, for every slot, as the engine side's slot table does: no alloc or
//! free rounds around loads and saves.
//! Every iteration publishes distinct keys, so every iteration really
//! copies; the 256 MiB pool fills after 16 iterations and eviction runs
//! from then on. Publishes are checksummed in the copy pass, restores
//! verified: checksums are on. Bytes moved per iteration: 2 × 16 MiB.
//!
//! Baseline: one thread's `copy_from_slice` of the same 32 MiB per
//! iteration, in page-sized chunks, streaming through two buffers each
//! twice the last-level cache (read from sysfs; at least 64 MiB), so the
//! copy runs from memory, not from cache. `cargo bench --bench throughput
//! -- 64` runs one size.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::*;
use orbitkv_components::api::{
    Command, Event, GroupHashes, PagePos, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
use orbitkv_world::{Backends, Runtime};

const PAGE_TOKENS: u64 = 16;
/// Bytes published (and restored) per iteration.
const BYTES_PER_SIDE: u64 = 16 << 20;
const BYTES_PER_ITER: u64 = 2 * BYTES_PER_SIDE;
const SIZES: [u64; 3] = [16 << 10, 64 << 10, 2 << 20];

struct Setup {
    d: Driver,
    /// Pages per iteration, and their size.
    n: u64,
    page_bytes: u64,
    session: SessionHandle,
    engine_region: u32,
    /// Publish sources: device slots 0..N.
    sources: Vec<u64>,
    /// Restore targets: device slots N..2N.
    targets: Vec<u64>,
    /// Keys are distinct per iteration.
    iteration: u64,
}

fn setup(page_bytes: u64) -> Setup {
    let n = BYTES_PER_SIDE / page_bytes;
    let mut c = config(256 << 20, 4096, page_bytes.max(2 << 20));
    c.limits.max_publish_pages = c.limits.max_publish_pages.max(n as usize);
    c.limits.max_query_pages = c.limits.max_query_pages.max(n as usize + 1);
    // Touch the pool up front so early iterations do not pay page faults.
    c.dram.first_touch = true;
    let engine = HostCopyEngine::new(HostCopyConfig::default());
    let arena = engine.arena();
    let rt = Runtime::with_backends(
        c,
        Backends {
            copy: Box::new(engine),
            tiers: Vec::new(),
            simulated_clock: false,
        },
    )
    .expect("runtime");
    let mut d = Driver::new(rt, arena, false);
    d.register(register_cmd("dense", dense(), 1, PAGE_TOKENS, page_bytes));
    let session = d.open("dense");
    // Slots 0..n are publish sources, n..2n restore targets.
    let (region, engine_region, got) = d.region(session, 0, 0, 2 * n as u32);
    assert_eq!(got, page_bytes);
    let sources = d.alloc_many(session, region, 0..n as u32);
    let targets = d.alloc_many(session, region, n as u32..2 * n as u32);
    for slot in 0..2 * n {
        d.arena
            .write(
                engine_region,
                slot * page_bytes,
                &payload(0, slot, page_bytes),
            )
            .unwrap();
    }
    Setup {
        d,
        n,
        page_bytes,
        session,
        engine_region,
        sources,
        targets,
        iteration: 0,
    }
}

/// Per-phase tick counts and wall times of one iteration.
#[derive(Debug, Default, Clone, Copy)]
struct Ticks {
    publish: u64,
    query: u64,
    restore: u64,
    publish_us: f64,
    query_us: f64,
    restore_us: f64,
}

/// One iteration; `verify` checks the restored bytes (and rewrites the
/// sources and zeroes the targets first, so stale bytes cannot pass).
#[inline(never)]
fn iteration(s: &mut Setup, verify: bool) -> Ticks {
    s.iteration += 1;
    let (n, page_bytes) = (s.n, s.page_bytes);
    let seed = s.iteration;
    let session = s.session;
    if verify {
        for slot in 0..n {
            s.d.arena
                .write(
                    s.engine_region,
                    slot * page_bytes,
                    &payload(seed, slot, page_bytes),
                )
                .unwrap();
        }
        for slot in n..2 * n {
            s.d.arena
                .write(
                    s.engine_region,
                    slot * page_bytes,
                    &vec![0u8; page_bytes as usize],
                )
                .unwrap();
        }
    }
    let mut ticks = Ticks::default();

    // Publish n pages from the source slots.
    let t = s.d.ticks();
    let phase = Instant::now();
    let pages = (0..n)
        .map(|i| PublishPage {
            rank: 0,
            group: 0,
            hash: hash(seed, 0, i),
            device_page: s.sources[i as usize],
        })
        .collect();
    let inserted = s.d.publish(session, seed, pages);
    assert_eq!(inserted, n);
    ticks.publish = s.d.ticks() - t;
    ticks.publish_us = phase.elapsed().as_secs_f64() * 1e6;

    // Query + prepare.
    let t = s.d.ticks();
    let phase = Instant::now();
    let q = s.d.submit(Command::Query {
        session,
        request: seed,
        groups: vec![GroupHashes {
            group: 0,
            hashes: (0..=n).map(|i| hash(seed, 0, i)).collect(),
        }],
        origin: 0,
        prompt_len: (n + 1) * PAGE_TOKENS,
        expect_namespaces: Vec::new(),
        prepare: true,
        speculative: false,
    });
    let op = match s.d.wait(
        "query result",
        |e| matches!(e, Event::QueryResult { command, .. } if *command == q),
    ) {
        Event::QueryResult {
            operation,
            selected: Some(sel),
            miss: None,
            ..
        } if sel == n * PAGE_TOKENS => operation,
        e => panic!("query: {e:?}"),
    };
    match s.d.wait("ready", |e| {
        matches!(e, Event::Ready { operation, .. } | Event::Miss { operation, .. } if *operation == op)
    }) {
        Event::Ready {
            boundary, leases, ..
        } if boundary == n * PAGE_TOKENS && leases.len() as u64 == n => {}
        e => panic!("prepare: {e:?}"),
    }
    ticks.query = s.d.ticks() - t;
    ticks.query_us = phase.elapsed().as_secs_f64() * 1e6;

    // Restore into the target slots.
    let t = s.d.ticks();
    let phase = Instant::now();
    s.d.submit(Command::Restore {
        session,
        operation: op,
        targets: s
            .targets
            .iter()
            .enumerate()
            .map(|(i, &device_page)| RestoreTarget {
                pos: PagePos {
                    rank: 0,
                    group: 0,
                    page_end: (i as u64 + 1) * PAGE_TOKENS,
                },
                device_page,
            })
            .collect(),
        retained: Vec::new(),
    });
    s.d.tick();
    match s.d.wait("restore", |e| {
        matches!(e, Event::RestoreDone { operation, .. } | Event::Miss { operation, .. } if *operation == op)
    }) {
        Event::RestoreDone { pages, bytes, .. } if pages == n && bytes == n * page_bytes => {}
        e => panic!("restore: {e:?}"),
    }
    ticks.restore = s.d.ticks() - t;
    ticks.restore_us = phase.elapsed().as_secs_f64() * 1e6;

    if verify {
        for i in 0..n {
            let got =
                s.d.arena
                    .read(s.engine_region, (n + i) * page_bytes, page_bytes)
                    .unwrap();
            if got != payload(seed, i, page_bytes) {
                panic!("restored page {i} of iteration {seed} differs from the published bytes");
            }
        }
    }

    s.d.clear();
    ticks
}

/// The last-level cache's size from sysfs (the highest cache index), if
/// the system says.
fn llc_bytes() -> Option<u64> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        // Entries other than `indexN` have neither file.
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(k) => (k, 1u64 << 10),
            None => match size.strip_suffix('M') {
                Some(m) => (m, 1 << 20),
                None => (size, 1),
            },
        };
        let Ok(num) = num.parse::<u64>() else {
            continue;
        };
        let bytes = num * mult;
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, bytes));
        }
    }
    best.map(|(_, b)| b)
}

/// Single-thread streamed memcpy: each run copies `BYTES_PER_ITER` in
/// `page`-sized chunks from `a` to `b` at a cursor that walks through both
/// buffers, so no byte is still cached when it is copied again.
struct Memcpy {
    a: Vec<u8>,
    b: Vec<u8>,
    page: usize,
    at: usize,
}

impl Memcpy {
    fn new(len: usize, page: usize) -> Self {
        let len = len / BYTES_PER_ITER as usize * BYTES_PER_ITER as usize;
        // Filled, so both buffers are faulted in before timing.
        Memcpy {
            a: vec![7u8; len],
            b: vec![1u8; len],
            page,
            at: 0,
        }
    }

    fn run(&mut self) {
        let end = self.at + BYTES_PER_ITER as usize;
        let (src, dst) = (&self.a[self.at..end], &mut self.b[self.at..end]);
        for (d, s) in dst
            .chunks_exact_mut(self.page)
            .zip(src.chunks_exact(self.page))
        {
            d.copy_from_slice(black_box(s));
        }
        black_box(&mut self.b);
        self.at = if end >= self.a.len() { 0 } else { end };
    }
}

fn gbps(ns_per_iter: f64) -> f64 {
    BYTES_PER_ITER as f64 / ns_per_iter
}

fn main() {
    let t0 = Instant::now();
    let llc = llc_bytes();
    let buffer = (2 * llc.unwrap_or(0)).max(64 << 20) as usize;
    let args: Vec<String> = std::env::args().collect();
    let profile: Option<u64> = args
        .iter()
        .position(|a| a == "--profile")
        .and_then(|i| args.get(i + 1)?.parse().ok());
    // `cargo bench --bench throughput -- 16 64 2048` (KiB) picks sizes.
    let picked: Vec<u64> = args
        .iter()
        .skip(1)
        .filter(|a| profile.is_none_or(|n| **a != n.to_string()))
        .filter_map(|a| a.parse::<u64>().ok())
        .map(|kib| kib << 10)
        .filter(|b| SIZES.contains(b))
        .collect();
    let sizes = if picked.is_empty() {
        SIZES.to_vec()
    } else {
        picked
    };
    println!(
        "publish+restore vs single-thread memcpy; last-level cache {}, memcpy buffers 2 x {} MiB",
        llc.map_or("unknown".to_owned(), |b| format!("{} MiB", b >> 20)),
        buffer >> 20
    );
    let mut summary = Vec::new();
    for page_bytes in sizes {
        let label = if page_bytes >= 1 << 20 {
            format!("{} MiB", page_bytes >> 20)
        } else {
            format!("{} KiB", page_bytes >> 10)
        };
        let mut s = setup(page_bytes);
        // Correctness, outside any timing.
        let ticks = iteration(&mut s, true);
        eprintln!("throughput {label}: verified restored bytes; ticks {ticks:?}");
        // `-- --profile N 16`: N steady-state iterations only, for a
        // profiler (valgrind --tool=callgrind --toggle-collect='*iteration*').
        if let Some(n) = profile {
            for _ in 0..16 + n {
                iteration(&mut s, false);
            }
            continue;
        }
        // Fill the pool (16 iterations) so the timing is in steady state,
        // with eviction running.
        for _ in 0..16 {
            iteration(&mut s, false);
        }
        let mut m = Memcpy::new(buffer, page_bytes as usize);
        let evictions_before = s.d.rt().stats().metrics.evictions.values().sum::<u64>();
        let mut last = Ticks::default();
        let (rt_ns, mc_ns, nr, nm) = interleaved(
            5,
            Duration::from_millis(1000),
            |k| {
                let start = Instant::now();
                for _ in 0..k {
                    last = iteration(&mut s, false);
                }
                start.elapsed()
            },
            |k| {
                let start = Instant::now();
                for _ in 0..k {
                    m.run();
                }
                start.elapsed()
            },
        );
        drop(m);
        // And once more at the end, in steady state.
        iteration(&mut s, true);
        let st = s.d.rt().stats();
        assert_eq!(
            (st.operations, st.leases, st.transfers, st.bytes_reserved),
            (0, 0, 0, 0),
            "{st:#?}"
        );
        let evictions = st.metrics.evictions.values().sum::<u64>();
        eprintln!(
            "throughput {label}: {} iterations, {} evictions during the timing; phases of the last: {last:?}",
            s.iteration,
            evictions - evictions_before
        );
        println!(
            "{label:>7} pages x {:>4}: runtime {:6.2} ms/iter = {:5.2} GB/s ({nr}/round); memcpy {:6.2} ms/iter = {:5.2} GB/s ({nm}/round); runtime/memcpy = {:.2}x",
            s.n,
            rt_ns / 1e6,
            gbps(rt_ns),
            mc_ns / 1e6,
            gbps(mc_ns),
            gbps(rt_ns) / gbps(mc_ns)
        );
        summary.push((label, gbps(rt_ns) / gbps(mc_ns)));
    }
    for (label, r) in summary {
        // The data-path goals: 0.8x at 16 KiB, at least memcpy above.
        let goal = if label == "16 KiB" { 0.8 } else { 1.0 };
        println!("ratio {label}: {r:.2}x (goal >= {goal:.1}x)");
    }
    eprintln!("throughput: total {:.1} s", secs(t0));
}
