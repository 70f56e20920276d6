//! Query: discovery + validation for 2048 pages × 3 groups, against bare
//! hash-map lookups of the same keys.
//!
//! A hybrid instance (prefix attention, 100-token sliding window, recurrent
//! checkpoint) holds 3 × 2048 pages in DRAM. One iteration submits a
//! 2049-page query (`prepare: false`) and runs the tick that discovers and
//! validates it; the `Release` of the selected operation runs in a second,
//! untimed tick. The baseline looks the same 3 × 2048 `StateKey`s up in an
//! FxHash map (`rustc_hash::FxHashMap<StateKey, u64>`), the fastest general
//! map available, so the ratio does not flatter the runtime. A second line
//! compares with the index's own map type (`KeyHasher`, keyed per process),
//! which separates the runtime's work from the cost of a seeded hash.
//!
//! Page hashes are 32-byte digests, as vLLM's default `sha256_cbor` block
//! hashes are. Sequential integers flatter FxHash's multiplicative mix and
//! are not what engines send.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::*;
use criterion::Criterion;
use orbitkv_components::api::{
    Addressed, Command, Event, GroupHashes, Origin, PublishPage, SessionHandle,
};
use orbitkv_components::{KeyMap, StateKey};
use rustc_hash::FxHashMap;

const PAGES: u64 = 2048;
const GROUPS: [u32; 3] = [0, 1, 2];
const PAGE_TOKENS: u64 = 16;
const PAGE_BYTES: u64 = 512;
const SEED: u64 = 7;
const CHUNK: u64 = 1024;

struct Setup {
    d: Driver,
    session: SessionHandle,
    query: Command,
    keys: Vec<StateKey>,
}

fn setup() -> Setup {
    let mut c = config(16 << 20, 512, 64 << 10);
    c.limits.max_publish_pages = CHUNK as usize;
    let mut d = Driver::sim(c, 1);
    let ns = d.register(register_cmd("hybrid", hybrid(), 1, PAGE_TOKENS, PAGE_BYTES))[0];
    let session = d.open("hybrid");
    for g in GROUPS {
        let (region, engine_region, page_bytes) = d.region(session, 0, g, CHUNK as u32);
        assert_eq!(page_bytes, PAGE_BYTES);
        let device_pages = d.alloc_many(session, region, 0..CHUNK as u32);
        for slot in 0..CHUNK {
            d.arena
                .write(
                    engine_region,
                    slot * PAGE_BYTES,
                    &payload(g as u64, slot, PAGE_BYTES),
                )
                .unwrap();
        }
        for chunk in 0..PAGES / CHUNK {
            let pages = (0..CHUNK)
                .map(|i| PublishPage {
                    rank: 0,
                    group: g,
                    hash: digest(SEED, g, chunk * CHUNK + i),
                    device_page: device_pages[i as usize],
                })
                .collect();
            let inserted = d.publish(session, chunk, pages);
            assert_eq!(inserted, CHUNK);
        }
    }
    d.clear();
    let st = d.rt().stats();
    assert_eq!(st.pages as u64, GROUPS.len() as u64 * PAGES, "{st:#?}");
    assert_eq!(st.operations, 0);
    let query = Command::Query {
        session,
        request: 1,
        groups: GROUPS
            .iter()
            .map(|&g| GroupHashes {
                group: g,
                hashes: (0..=PAGES).map(|i| digest(SEED, g, i)).collect(),
            })
            .collect(),
        origin: 0,
        prompt_len: (PAGES + 1) * PAGE_TOKENS,
        expect_namespaces: Vec::new(),
        prepare: false,
        speculative: false,
    };
    let keys = GROUPS
        .iter()
        .flat_map(|&g| {
            (0..PAGES).map(move |i| StateKey {
                namespace: ns,
                group: g,
                native: digest(SEED, g, i),
            })
        })
        .collect();
    Setup {
        d,
        session,
        query,
        keys,
    }
}

/// One query: the timed submit + tick, then the untimed release tick.
#[inline(never)]
fn query_once(s: &mut Setup, check: bool) -> Duration {
    let cmd = s.query.clone();
    let start = Instant::now();
    s.d.rt()
        .submit(Origin::EMBEDDED, cmd)
        .expect("inbox has room");
    let ev = s.d.rt().tick();
    let t = start.elapsed();
    let op = match ev.as_slice() {
        [
            Addressed {
                to: Origin::EMBEDDED,
                event:
                    Event::QueryResult {
                        operation,
                        selected: Some(sel),
                        miss: None,
                        candidates,
                        ..
                    },
                terminal: false,
            },
        ] => {
            if check {
                assert_eq!(*sel, PAGES * PAGE_TOKENS, "boundary");
                assert_eq!(candidates.len(), 3);
                for c in candidates {
                    assert_eq!(c.page_ends.len() as u64, PAGES, "{:?}", c.group);
                }
            }
            *operation
        }
        other => panic!("query tick: {other:?}"),
    };
    s.d.rt()
        .submit(
            Origin::EMBEDDED,
            Command::Release {
                session: s.session,
                operation: op,
            },
        )
        .expect("inbox has room");
    let ev = s.d.rt().tick();
    assert!(
        matches!(ev.as_slice(), [Addressed { event: Event::Released { operation }, .. }] if *operation == op),
        "release tick: {ev:?}"
    );
    black_box(t)
}

/// Sums the values of `keys` through `get` (one map lookup each).
fn lookups<'m>(get: impl Fn(&StateKey) -> Option<&'m u64>, keys: &[StateKey]) -> u64 {
    let mut sum = 0u64;
    for k in keys {
        sum = sum.wrapping_add(*get(black_box(k)).expect("present"));
    }
    sum
}

fn main() {
    let t0 = Instant::now();
    let mut s = setup();
    eprintln!(
        "query: setup ({} pages) took {:.2} s",
        s.d.rt().stats().pages,
        secs(t0)
    );
    query_once(&mut s, true);
    // `-- --profile N`: only N queries, for a profiler (valgrind
    // --tool=callgrind --toggle-collect='*query_once*').
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let n: u64 = args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(100);
        let t: Duration = (0..n).map(|_| query_once(&mut s, false)).sum();
        println!(
            "{n} queries, {:.1} us/query",
            t.as_secs_f64() * 1e6 / n as f64
        );
        return;
    }
    let map: FxHashMap<StateKey, u64> = s
        .keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, i as u64))
        .collect();
    let keys = s.keys.clone();

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    {
        let mut group = c.benchmark_group("query_2048x3");
        group.bench_function("query_tick", |b| {
            b.iter_custom(|iters| (0..iters).map(|_| query_once(&mut s, false)).sum())
        });
        group.bench_function("fxhash_lookups", |b| {
            b.iter(|| black_box(lookups(|k| map.get(k), &keys)))
        });
        group.finish();
    }
    c.final_summary();

    let (q_ns, l_ns, nq, nl) = interleaved(
        5,
        Duration::from_millis(600),
        |n| (0..n).map(|_| query_once(&mut s, false)).sum(),
        |n| {
            let start = Instant::now();
            for _ in 0..n {
                black_box(lookups(|k| map.get(k), &keys));
            }
            start.elapsed()
        },
    );
    let st = s.d.rt().stats();
    assert_eq!((st.operations, st.leases), (0, 0), "{st:#?}");
    println!(
        "query tick (2049 pages x 3 groups, submit+tick, release tick excluded): {:.1} us/query ({nq} per round)",
        q_ns / 1e3
    );
    println!(
        "FxHash map lookups (2048 x 3 keys): {:.1} us/pass ({nl} per round), {:.1} ns/key",
        l_ns / 1e3,
        l_ns / (3 * PAGES) as f64
    );
    println!("query tick / FxHash lookups = {:.2}x", q_ns / l_ns);
    // The index's own map type (`KeyHasher`, keyed per process: clients
    // choose their native hashes), on the same keys: what the lookups
    // alone cost the runtime, apart from FxHash's cheaper, unseeded mix.
    let own: KeyMap<u64> = s
        .keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, i as u64))
        .collect();
    let (o_ns, _, _, _) = interleaved(
        5,
        Duration::from_millis(600),
        |n| {
            let start = Instant::now();
            for _ in 0..n {
                black_box(lookups(|k| own.get(k), &keys));
            }
            start.elapsed()
        },
        |n| (0..n).map(|_| query_once(&mut s, false)).sum(),
    );
    println!(
        "KeyMap (KeyHasher) lookups of the same keys: {:.1} us/pass; query tick / KeyMap lookups = {:.2}x",
        o_ns / 1e3,
        q_ns / o_ns
    );
    eprintln!("query: total {:.1} s", secs(t0));
}
