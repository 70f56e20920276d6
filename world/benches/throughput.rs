//! Publish + restore on the host backend, against memcpy of the same bytes.
//!
//! The real threaded `HostCopyEngine` (default config: 2 workers) and the
//! wall clock. A dense instance with 64 KiB pages; one iteration publishes
//! N = 256 pages (16 MiB) from device slots, queries and prepares them,
//! restores them into other device slots, and frees the restore targets.
//! Every iteration publishes distinct keys, so every iteration really
//! copies; the 256 MiB pool fills after 16 iterations and eviction runs
//! from then on. Bytes moved per iteration: 2 × N × 64 KiB = 32 MiB.
//!
//! Baseline: `copy_from_slice` of the same 32 MiB per iteration, in 64 KiB
//! chunks, between two pre-allocated 16 MiB buffers (one pass each way).

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::*;
use criterion::{Criterion, Throughput};
use orbitkv_components::api::{
    Command, Event, GroupHashes, PagePos, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
use orbitkv_world::{Backends, Runtime};

const N: u64 = 256;
const PAGE_TOKENS: u64 = 16;
const PAGE_BYTES: u64 = 64 << 10;
const BYTES_PER_ITER: u64 = 2 * N * PAGE_BYTES;

struct Setup {
    d: Driver,
    session: SessionHandle,
    region: u64,
    engine_region: u32,
    /// Publish sources: device slots 0..N.
    sources: Vec<u64>,
    /// Keys are distinct per iteration.
    iteration: u64,
}

fn setup() -> Setup {
    let mut c = config(256 << 20, 4096, 2 << 20);
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
    d.register(register_cmd("dense", dense(), 1, PAGE_TOKENS, PAGE_BYTES));
    let session = d.open("dense");
    // Slots 0..N are publish sources, N..2N restore targets.
    let (region, engine_region, page_bytes) = d.region(session, 0, 0, 2 * N as u32);
    assert_eq!(page_bytes, PAGE_BYTES);
    let sources = d.alloc_many(session, region, 0..N as u32);
    for slot in 0..2 * N {
        d.arena
            .write(
                engine_region,
                slot * PAGE_BYTES,
                &payload(0, slot, PAGE_BYTES),
            )
            .unwrap();
    }
    Setup {
        d,
        session,
        region,
        engine_region,
        sources,
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

impl Ticks {
    fn add(&mut self, o: &Ticks) {
        self.publish += o.publish;
        self.query += o.query;
        self.restore += o.restore;
        self.publish_us += o.publish_us;
        self.query_us += o.query_us;
        self.restore_us += o.restore_us;
    }
}

/// One iteration; `verify` checks the restored bytes before the targets are
/// freed (and rewrites the sources first, so stale bytes cannot pass).
fn iteration(s: &mut Setup, verify: bool) -> Ticks {
    s.iteration += 1;
    let seed = s.iteration;
    let session = s.session;
    if verify {
        for slot in 0..N {
            s.d.arena
                .write(
                    s.engine_region,
                    slot * PAGE_BYTES,
                    &payload(seed, slot, PAGE_BYTES),
                )
                .unwrap();
        }
        for slot in N..2 * N {
            s.d.arena
                .write(
                    s.engine_region,
                    slot * PAGE_BYTES,
                    &vec![0u8; PAGE_BYTES as usize],
                )
                .unwrap();
        }
    }
    let mut ticks = Ticks::default();

    // Publish N pages from the source slots.
    let t = s.d.ticks();
    let phase = Instant::now();
    let pages = (0..N)
        .map(|i| PublishPage {
            rank: 0,
            group: 0,
            hash: hash(seed, 0, i),
            device_page: s.sources[i as usize],
        })
        .collect();
    let inserted = s.d.publish(session, seed, pages);
    assert_eq!(inserted, N);
    ticks.publish = s.d.ticks() - t;
    ticks.publish_us = phase.elapsed().as_secs_f64() * 1e6;

    // Query + prepare, with the restore targets allocated in the same tick.
    let t = s.d.ticks();
    let phase = Instant::now();
    let q = s.d.submit(Command::Query {
        session,
        request: seed,
        groups: vec![GroupHashes {
            group: 0,
            hashes: (0..=N).map(|i| hash(seed, 0, i)).collect(),
        }],
        origin: 0,
        prompt_len: (N + 1) * PAGE_TOKENS,
        expect_namespaces: Vec::new(),
        prepare: true,
        speculative: false,
    });
    let targets = s.d.alloc_many(session, s.region, N as u32..2 * N as u32);
    let op = match s.d.wait(
        "query result",
        |e| matches!(e, Event::QueryResult { command, .. } if *command == q),
    ) {
        Event::QueryResult {
            operation,
            selected: Some(sel),
            miss: None,
            ..
        } if sel == N * PAGE_TOKENS => operation,
        e => panic!("query: {e:?}"),
    };
    match s.d.wait("ready", |e| {
        matches!(e, Event::Ready { operation, .. } | Event::Miss { operation, .. } if *operation == op)
    }) {
        Event::Ready {
            boundary, leases, ..
        } if boundary == N * PAGE_TOKENS && leases.len() as u64 == N => {}
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
        targets: targets
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
        Event::RestoreDone { pages, bytes, .. } if pages == N && bytes == N * PAGE_BYTES => {}
        e => panic!("restore: {e:?}"),
    }
    ticks.restore = s.d.ticks() - t;
    ticks.restore_us = phase.elapsed().as_secs_f64() * 1e6;

    if verify {
        for i in 0..N {
            let got =
                s.d.arena
                    .read(s.engine_region, (N + i) * PAGE_BYTES, PAGE_BYTES)
                    .unwrap();
            if got != payload(seed, i, PAGE_BYTES) {
                panic!("restored page {i} of iteration {seed} differs from the published bytes");
            }
        }
    }

    // Free the restore targets.
    for device_page in targets {
        s.d.submit(Command::DevicePageFree {
            session,
            device_page,
        });
    }
    s.d.tick();
    s.d.clear();
    ticks
}

struct Memcpy {
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Memcpy {
    fn new() -> Self {
        let len = (N * PAGE_BYTES) as usize;
        // Filled, so both buffers are faulted in before timing.
        Memcpy {
            a: payload(1, 1, len as u64),
            b: vec![1u8; len],
        }
    }

    /// 2 × N × PAGE_BYTES bytes: a → b, then b → a, page by page.
    fn run(&mut self) {
        let p = PAGE_BYTES as usize;
        for (dst, src) in self.b.chunks_exact_mut(p).zip(self.a.chunks_exact(p)) {
            dst.copy_from_slice(black_box(src));
        }
        for (dst, src) in self.a.chunks_exact_mut(p).zip(self.b.chunks_exact(p)) {
            dst.copy_from_slice(black_box(src));
        }
        black_box(&mut self.a);
        black_box(&mut self.b);
    }
}

fn gbps(ns_per_iter: f64) -> f64 {
    BYTES_PER_ITER as f64 / ns_per_iter
}

fn main() {
    let t0 = Instant::now();
    let mut s = setup();
    eprintln!("throughput: setup took {:.1} s", secs(t0));
    // Correctness, outside any timing.
    let ticks = iteration(&mut s, true);
    eprintln!("throughput: verified restored bytes; ticks {ticks:?}");
    // Phase breakdown, untimed by the ratio: iterations 2..=15 fit in the
    // empty pool; from iteration 17 on every publish needs evictions.
    let phases = |s: &mut Setup, n: u64| {
        let mut sum = Ticks::default();
        for _ in 0..n {
            sum.add(&iteration(s, false));
        }
        let k = n as f64;
        format!(
            "ticks/iter publish {:.0} query {:.0} restore {:.0}; us/iter publish {:.0} query {:.0} restore {:.0}",
            sum.publish as f64 / k,
            sum.query as f64 / k,
            sum.restore as f64 / k,
            sum.publish_us / k,
            sum.query_us / k,
            sum.restore_us / k
        )
    };
    let fill = phases(&mut s, 14);
    iteration(&mut s, false); // the 16th fills the pool
    let steady = phases(&mut s, 14);
    eprintln!("throughput: phases while the pool fills:  {fill}");
    eprintln!("throughput: phases with eviction running: {steady}");
    let mut m = Memcpy::new();

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .configure_from_args();
    {
        let mut group = c.benchmark_group("publish_restore_256x64KiB");
        group.throughput(Throughput::Bytes(BYTES_PER_ITER));
        group.bench_function("runtime_host_engine", |b| {
            b.iter(|| black_box(iteration(&mut s, false)))
        });
        group.bench_function("memcpy", |b| b.iter(|| m.run()));
        group.finish();
    }
    c.final_summary();

    // Past the first 16 iterations the pool is full: steady state evicts.
    let evictions_before = s.d.rt().stats().metrics.evictions.values().sum::<u64>();
    let mut last = Ticks::default();
    let (rt_ns, mc_ns, nr, nm) = interleaved(
        5,
        Duration::from_millis(1500),
        |n| {
            let start = Instant::now();
            for _ in 0..n {
                last = iteration(&mut s, false);
            }
            start.elapsed()
        },
        |n| {
            let start = Instant::now();
            for _ in 0..n {
                m.run();
            }
            start.elapsed()
        },
    );
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
        "throughput: {} iterations in all, {} pages stored, {} evictions ({} during own timing); \
         ticks of the last timed iteration {last:?}",
        s.iteration,
        st.pages,
        evictions,
        evictions - evictions_before
    );
    println!(
        "runtime publish+restore (host engine, 256 x 64 KiB pages, 32 MiB moved): {:.2} ms/iter = {:.2} GB/s ({nr} iters per round)",
        rt_ns / 1e6,
        gbps(rt_ns)
    );
    println!(
        "memcpy (copy_from_slice, 64 KiB chunks, 32 MiB): {:.2} ms/iter = {:.2} GB/s ({nm} iters per round)",
        mc_ns / 1e6,
        gbps(mc_ns)
    );
    println!(
        "runtime / memcpy (throughput) = {:.2}x  (time ratio runtime/memcpy = {:.2}x)",
        gbps(rt_ns) / gbps(mc_ns),
        rt_ns / mc_ns
    );
    eprintln!("throughput: total {:.1} s", secs(t0));
}
