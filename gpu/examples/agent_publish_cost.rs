//! What the end-to-end publish checksum costs a copy agent (issue 23).
//!
//! A copy agent's publish copies each page out of engine memory into the
//! staging area, chunk by chunk (here two chunks per page, as a layer's K
//! and V runs). Before issue 23 the host executor hashed each destination
//! chunk as it landed and the agent threw the sums away; now it hashes each
//! source chunk right after reading it, chaining a page's chunks into one
//! XXH3 that `copy_done` carries. Both run here on the same memory in the
//! same process, alternating, with a plain multi-threaded memcpy of the
//! same bytes as the floor, and the manager's copy-in (copy + checksum into
//! the pool, then the comparison) after each.
//!
//! `cargo run --release -p orbitkv-gpu --example agent_publish_cost -- [PAGE_KIB] [PAGES] [ROUNDS]`

use std::time::{Duration, Instant};

use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};
use orbitkv_gpu::{CopyEngine, Direction, ExternalMemory, PageCopy, SumOf};

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<u64>().expect("a number"));
    let page_kib = args.next().unwrap_or(64);
    let pages = args.next().unwrap_or(512);
    let rounds = args.next().unwrap_or(9);
    let page = page_kib << 10;
    let half = page / 2;
    let bytes = page * pages;
    // Engine memory: two runs per page, in two buffers (K and V).
    let mut k: Vec<u8> = (0..bytes / 2).map(|i| (i * 7 + i / 4093) as u8).collect();
    let mut v: Vec<u8> = (0..bytes / 2).map(|i| (i * 13 + i / 3001) as u8).collect();
    let mut staging = vec![0u8; bytes as usize];
    let mut pool = vec![0u8; bytes as usize];
    let mut engine = HostCopyEngine::new(HostCopyConfig::default());
    // SAFETY: every buffer outlives the engine (dropped at the end of main)
    // and nothing else touches them while a batch runs (we wait for each).
    let (rk, rv) = unsafe {
        engine
            .register_host_pool(staging.as_mut_ptr(), bytes)
            .unwrap();
        (
            engine
                .attach_region(ExternalMemory::Host {
                    base: k.as_mut_ptr(),
                    len: bytes / 2,
                })
                .unwrap(),
            engine
                .attach_region(ExternalMemory::Host {
                    base: v.as_mut_ptr(),
                    len: bytes / 2,
                })
                .unwrap(),
        )
    };
    let batch = |source: bool| -> Vec<PageCopy> {
        (0..pages)
            .flat_map(|p| {
                [(rk, 0u64), (rv, half)].map(|(region, at)| PageCopy {
                    host_offset: p * page + at,
                    region,
                    device_offset: p * half,
                    len: half,
                    expect_checksum: None,
                    sum: match (source, at) {
                        (false, _) => SumOf::Destination,
                        (true, 0) => SumOf::SourceStart,
                        (true, _) => SumOf::SourceContinue,
                    },
                })
            })
            .collect()
    };
    let run = |engine: &mut HostCopyEngine, copies: &[PageCopy]| -> (Duration, Vec<u64>) {
        let t = Instant::now();
        let token = engine.submit(Direction::DeviceToHost, copies, 0).unwrap();
        let mut done = Vec::new();
        while done.is_empty() {
            engine.poll(0, &mut done);
            std::hint::spin_loop();
        }
        let c = done.pop().unwrap();
        assert_eq!(c.token, token);
        c.result.unwrap();
        (t.elapsed(), c.checksums)
    };
    let (before, after) = (batch(false), batch(true));
    let mut t_before = Vec::new();
    let mut t_after = Vec::new();
    let mut t_memcpy = Vec::new();
    let mut t_copy_in = Vec::new();
    for _ in 0..rounds {
        t_before.push(run(&mut engine, &before).0.as_secs_f64());
        let (t, sums) = run(&mut engine, &after);
        t_after.push(t.as_secs_f64());
        // The page checksums, one per page (the last chunk's chain).
        let expected: Vec<u64> = sums.chunks(2).map(|c| c[1]).collect();
        // The floor: the same bytes moved by the same number of threads.
        let t = Instant::now();
        std::thread::scope(|s| {
            let workers = HostCopyConfig::default().workers.max(1);
            let per = (pages as usize).div_ceil(workers) * page as usize;
            for (n, dst) in staging.chunks_mut(per).enumerate() {
                let (k, v) = (&k, &v);
                s.spawn(move || {
                    for (i, p) in dst.chunks_mut(page as usize).enumerate() {
                        let at = (n * per / page as usize + i) * half as usize;
                        p[..half as usize].copy_from_slice(&k[at..at + half as usize]);
                        p[half as usize..].copy_from_slice(&v[at..at + half as usize]);
                    }
                });
            }
        });
        t_memcpy.push(t.elapsed().as_secs_f64());
        // The manager's copy-in: copy + checksum into the pool, compare.
        let t = Instant::now();
        let ok = std::thread::scope(|s| {
            let workers = HostCopyConfig::default().workers.max(1);
            let per = (pages as usize).div_ceil(workers) * page as usize;
            let handles: Vec<_> = pool
                .chunks_mut(per)
                .zip(staging.chunks(per))
                .enumerate()
                .map(|(n, (dst, src))| {
                    let expected = &expected;
                    s.spawn(move || {
                        dst.chunks_mut(page as usize)
                            .zip(src.chunks(page as usize))
                            .enumerate()
                            .all(|(i, (d, s))| {
                                // SAFETY: equal lengths, distinct buffers.
                                let sum = unsafe {
                                    orbitkv_gpu::copy_and_checksum(
                                        s.as_ptr(),
                                        d.as_mut_ptr(),
                                        s.len(),
                                    )
                                };
                                expected.get(n * per / page as usize + i) == Some(&sum)
                            })
                    })
                })
                .collect();
            handles.into_iter().all(|h| h.join().unwrap())
        });
        t_copy_in.push(t.elapsed().as_secs_f64());
        assert!(ok, "every staged page matches the agent's checksum");
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let gbps = |s: f64| bytes as f64 / s / 1e9;
    let (b, a, m, c) = (
        median(&mut t_before),
        median(&mut t_after),
        median(&mut t_memcpy),
        median(&mut t_copy_in),
    );
    println!(
        "agent publish copy, {pages} pages of {page_kib} KiB in two chunks, {rounds} rounds, medians:"
    );
    println!("  memcpy floor                        {:7.2} GB/s", gbps(m));
    println!(
        "  before: dest hashed, sums dropped   {:7.2} GB/s  ({:.2}x the floor)",
        gbps(b),
        m / b
    );
    println!(
        "  after: source hashed, page chained  {:7.2} GB/s  ({:.2}x the floor)",
        gbps(a),
        m / a
    );
    println!("  after / before time                 {:7.3}", a / b);
    println!("  manager copy-in + compare           {:7.2} GB/s", gbps(c));
    drop(engine);
}
