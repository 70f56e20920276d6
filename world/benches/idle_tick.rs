//! Idle tick: cost with 1M stored pages and no work. It must be O(active
//! work), not O(stored pages).
//!
//! Two runtimes, one holding 1024 pages and one holding 1_048_576 pages
//! (512-byte pages in a ~600 MiB pool), both with nothing queued, leased or
//! in flight; `tick()` is timed on each.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::*;
use criterion::Criterion;
use orbitkv_components::api::{Command, Event, PublishPage};

const PAGE_TOKENS: u64 = 16;
const PAGE_BYTES: u64 = 512;
const CHUNK: u64 = 1024;
/// Publishes submitted together per tick while filling.
const IN_FLIGHT: u64 = 16;

/// A simulated runtime holding `pages` published pages (a multiple of CHUNK).
fn filled(pages: u64, capacity_bytes: u64) -> Driver {
    let t0 = Instant::now();
    let mut c = config(capacity_bytes, 512, 64 << 10);
    c.limits.max_publish_pages = CHUNK as usize;
    // Copies complete in the tick that submits them.
    let mut d = Driver::sim(c, 0);
    d.register(register_cmd("dense", dense(), 1, PAGE_TOKENS, PAGE_BYTES));
    let session = d.open("dense");
    let (region, _, page_bytes) = d.region(session, 0, 0, CHUNK as u32);
    assert_eq!(page_bytes, PAGE_BYTES);
    // The same device pages are the sources of every publish; keys differ.
    let sources = d.alloc_many(session, region, 0..CHUNK as u32);
    let chunks = pages / CHUNK;
    let mut next = 0u64;
    while next < chunks {
        let batch = IN_FLIGHT.min(chunks - next);
        let ids: Vec<u64> = (next..next + batch)
            .map(|chunk| {
                d.submit(Command::Publish {
                    session,
                    request: chunk,
                    pages: (0..CHUNK)
                        .map(|i| PublishPage {
                            rank: 0,
                            group: 0,
                            hash: hash(1, 0, chunk * CHUNK + i),
                            device_page: sources[i as usize],
                        })
                        .collect(),
                })
            })
            .collect();
        d.tick();
        for id in ids {
            match d.wait(
                "publish",
                |e| matches!(e, Event::PublishDone { command, .. } if *command == id),
            ) {
                Event::PublishDone {
                    inserted,
                    duplicates: 0,
                    dropped: 0,
                    ..
                } if inserted == CHUNK => {}
                e => panic!("publish chunk: {e:?}"),
            }
        }
        d.clear();
        next += batch;
        if next.is_multiple_of(128) || next == chunks {
            eprintln!(
                "idle_tick: {} / {} pages published ({:.1} s)",
                next * CHUNK,
                pages,
                secs(t0)
            );
        }
    }
    // Let anything left (deferred work, retirements) settle.
    for _ in 0..4 {
        d.submit(Command::AdvanceClock { us: 1 });
        d.tick();
    }
    d.clear();
    let st = d.rt().stats();
    assert_eq!(st.pages as u64, pages, "{st:#?}");
    assert_eq!(
        (st.operations, st.leases, st.transfers, st.bytes_reserved),
        (0, 0, 0, 0),
        "{st:#?}"
    );
    assert!(d.rt().is_idle());
    d
}

fn idle_ticks(d: &mut Driver, n: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        let ev = d.rt().tick();
        debug_assert!(ev.is_empty());
        black_box(ev);
    }
    start.elapsed()
}

fn main() {
    let t0 = Instant::now();
    let mut small = filled(CHUNK, 16 << 20);
    let mut large = filled(1 << 20, 600 << 20);
    eprintln!("idle_tick: setup took {:.1} s", secs(t0));
    // Idle ticks produce no events.
    assert!(small.rt().tick().is_empty());
    assert!(large.rt().tick().is_empty());

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    {
        let mut group = c.benchmark_group("idle_tick");
        group.bench_function("1K_pages", |b| b.iter(|| black_box(small.rt().tick())));
        group.bench_function("1M_pages", |b| b.iter(|| black_box(large.rt().tick())));
        group.finish();
    }
    c.final_summary();

    let (large_ns, small_ns, nl, ns) = interleaved(
        7,
        Duration::from_millis(500),
        |n| idle_ticks(&mut large, n),
        |n| idle_ticks(&mut small, n),
    );
    println!(
        "idle tick with 1K pages ({} stored): {:.0} ns/tick ({ns} ticks per round)",
        small.rt().stats().pages,
        small_ns
    );
    println!(
        "idle tick with 1M pages ({} stored): {:.0} ns/tick ({nl} ticks per round)",
        large.rt().stats().pages,
        large_ns
    );
    println!(
        "idle tick with 1M pages / with 1K pages = {:.2}x",
        large_ns / small_ns
    );
    eprintln!("idle_tick: total {:.1} s", secs(t0));
}
