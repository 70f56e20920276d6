//! The fused page copies of `checksum` (copy + XXH3-64 in one pass), over
//! buffers far beyond the last-level cache, in one run:
//!
//! - `memcpy`: `copy_from_slice`, no hashing (the floor);
//! - `cached`: copy 64 KiB, hash it where it landed, next (every fused copy
//!   before streamed stores; still what copies under `STREAM_MIN` do);
//! - `written`: `copy_checksummed` (`copy_hashing_written`), which streams
//!   its writes past the cache from `STREAM_MIN` on where the CPU has AVX2;
//! - `read`: `copy_hashing_read`, the same with the source hashed (restores).
//!
//! Each on one thread and on two (each thread its own buffers), in 2 MiB
//! page copies as the pool's copy-in makes them; the best of `ROUNDS`.
//!
//! `cargo bench -p orbitkv-components --bench fused_copy [-- MiB_PER_THREAD ROUNDS]`.
//! Not a test: compare the ratios, on an idle machine.

use std::time::Instant;

use orbitkv_components::checksum::{
    PageHasher, copy_checksummed, copy_hashing_read, page_checksum,
};

const PAGE: usize = 2 << 20;
const CHUNK: usize = 64 << 10;

fn cached(dst: &mut [u8], src: &[u8]) -> u64 {
    let mut h = PageHasher::new();
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        d.copy_from_slice(s);
        h.update(d);
    }
    h.digest()
}

fn read(dst: &mut [u8], src: &[u8]) -> u64 {
    let mut h = PageHasher::new();
    // SAFETY: two distinct slices of one length.
    unsafe { copy_hashing_read(src.as_ptr(), dst.as_mut_ptr(), src.len(), &mut h) };
    h.digest()
}

fn memcpy(dst: &mut [u8], src: &[u8]) -> u64 {
    dst.copy_from_slice(src);
    0
}

type Copy = fn(&mut [u8], &[u8]) -> u64;

/// GB/s copied by `threads` threads, each its own pair of buffers, page by
/// page; the best of `rounds`. Checks every page's checksum once.
fn run(f: Copy, hashes: bool, bufs: &mut [(Vec<u8>, Vec<u8>)], rounds: usize) -> f64 {
    let mut best = 0f64;
    for _ in 0..rounds {
        let start = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || {
                    for (d, p) in dst.chunks_mut(PAGE).zip(src.chunks(PAGE)) {
                        let sum = f(d, p);
                        assert!(!hashes || sum == page_checksum(d), "a fused copy's digest");
                    }
                });
            }
        });
        let bytes: usize = bufs.iter().map(|(s, _)| s.len()).sum();
        // The check above re-reads every page: time only the first pass.
        best = best.max(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let mib = args.first().copied().unwrap_or(1024);
    let rounds = args.get(1).copied().unwrap_or(3);
    let len = (mib << 20) / PAGE * PAGE;
    println!(
        "fused copies: {mib} MiB per thread in {} KiB pages, best of {rounds}",
        PAGE >> 10
    );
    let cases: [(&str, Copy, bool); 4] = [
        ("memcpy", memcpy, false),
        ("cached", cached, true),
        ("written", copy_checksummed, true),
        ("read", read, true),
    ];
    for threads in [1, 2] {
        let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
            .map(|t| {
                let src = (0..len).map(|i| (i * 131 + t * 7) as u8).collect();
                (src, vec![1u8; len])
            })
            .collect();
        let mut floor = 0.0;
        for (name, f, hashes) in cases {
            // Hashing runs separately: the timed pass is the copy alone.
            let gbs = run(f, false, &mut bufs, rounds);
            if hashes {
                run(f, true, &mut bufs, 1);
            }
            if name == "memcpy" {
                floor = gbs;
            }
            println!(
                "{threads} thread(s) {name:8} {gbs:6.2} GB/s  x{:.2} memcpy",
                gbs / floor
            );
        }
    }
}
