//! The copy agent's restore on the host engine (2 copy workers): pool
//! pages into engine memory laid out as 8 runs per page (the shape of a
//! vLLM block: per-layer K and V runs), every page's XXH3-64 verified.
//!
//! Columns per page size, in one run, each over the same 256 MiB:
//! - `memcpy`: one thread's `copy_from_slice` of each page, run by run (the
//!   floor; no verification);
//! - `two-pass`: the agent verifies every pool page on its own thread,
//!   then the executor copies (the agent before issue 25);
//! - `one-pass`: the executor verifies each page while it copies it, its
//!   runs hashed as one chain (`CopyEngine::verifies_source_chains`);
//! - `first`: the one-pass restore's first pass over a freshly mapped pool
//!   window, which pays a minor page fault per 4 KiB of the window (as an
//!   engine process does once per pool page after it connects). The other
//!   agent columns are the second pass over the same window: an engine's
//!   steady state.
//!
//! `cargo bench -p orbitkv-gpu --bench agent_restore [-- ROUNDS]`. Not a
//! test: compare the ratios, on an idle machine.

use std::time::{Duration, Instant};

use orbitkv_components::api::{AgentDirection, AgentPageCopy, Command, Event};
use orbitkv_gpu::agent::{Chunk, CopyAgent, HostWindow, MemoryKind};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine, shared_memory};
use orbitkv_gpu::{
    Completion, CompletionToken, CopyEngine, CopyError, Direction, ExternalMemory, HostSpan,
    PageCopy, RegionId,
};

const TOTAL: u64 = 256 << 20;
const RUNS: u64 = 8;
/// Pages per `AgentCopy` (the runtime's batches are of this order).
const BATCH: usize = 64;

/// The host engine, but the agent verifies before copying.
struct TwoPass(HostCopyEngine);

impl CopyEngine for TwoPass {
    fn name(&self) -> &'static str {
        "two-pass"
    }
    fn register_device_region(&mut self, bytes: u64) -> Result<RegionId, CopyError> {
        self.0.register_device_region(bytes)
    }
    unsafe fn attach_region(&mut self, memory: ExternalMemory) -> Result<RegionId, CopyError> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.0.attach_region(memory) }
    }
    fn unregister_device_region(&mut self, region: RegionId) -> Result<(), CopyError> {
        self.0.unregister_device_region(region)
    }
    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), CopyError> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.0.register_host_pool(base, len) }
    }
    unsafe fn register_host_window(
        &mut self,
        base: *mut u8,
        len: u64,
        spans: &[HostSpan],
    ) -> Result<(), CopyError> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.0.register_host_window(base, len, spans) }
    }
    fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
        now_us: u64,
    ) -> Result<CompletionToken, CopyError> {
        self.0.submit(direction, copies, now_us)
    }
    fn poll(&mut self, now_us: u64, out: &mut Vec<Completion>) {
        self.0.poll(now_us, out)
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight()
    }
}

struct Bench {
    page: u64,
    pool: memmap2::MmapMut,
    sums: Vec<u64>,
    mem: Vec<u8>,
}

impl Bench {
    fn new(page: u64) -> Self {
        let (_, mut pool) = shared_memory("bench-pool", TOTAL).expect("pool");
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for b in pool.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
        }
        let sums = pool
            .chunks(page as usize)
            .map(xxhash_rust::xxh3::xxh3_64)
            .collect();
        Bench {
            page,
            pool,
            sums,
            mem: vec![1; TOTAL as usize],
        }
    }

    fn pages(&self) -> u64 {
        TOTAL / self.page
    }

    /// Run `r` of slot `s` lies at `r * run * pages + s * run` of `mem`:
    /// each run is its own strided array, as a layer's blocks are.
    fn run_at(&self, r: u64, slot: u64) -> usize {
        let run = self.page / RUNS;
        (r * run * self.pages() + slot * run) as usize
    }

    fn memcpy(&mut self) -> Duration {
        let run = (self.page / RUNS) as usize;
        let start = Instant::now();
        for slot in 0..self.pages() {
            for r in 0..RUNS {
                let from = (slot * self.page) as usize + r as usize * run;
                let at = self.run_at(r, slot);
                self.mem[at..at + run].copy_from_slice(&self.pool[from..from + run]);
            }
        }
        start.elapsed()
    }

    /// One agent over a fresh window: the first restore's time, then the
    /// second's (the same pages again).
    fn agent(&mut self, executor: Box<dyn CopyEngine>) -> (Duration, Duration) {
        let mut agent = CopyAgent::new(executor);
        let (pool_file, mut pool) = shared_memory("bench-pool-2", TOTAL).expect("pool");
        pool.copy_from_slice(&self.pool);
        let (staging_file, _staging) = shared_memory("bench-staging", 1 << 20).expect("staging");
        let window = HostWindow::map(&pool_file, TOTAL, &staging_file, 1 << 20).expect("window");
        agent.set_window(window).expect("window");
        let run = self.page / RUNS;
        let chunks: Vec<Chunk> = (0..RUNS)
            .map(|r| Chunk {
                kind: MemoryKind::Host,
                ptr: self.mem.as_mut_ptr() as u64 + (r * run * self.pages()),
                stride: run,
                len: run,
            })
            .collect();
        // SAFETY: `mem` outlives the agent and nothing else touches it.
        let (region, _) = unsafe { agent.attach(self.pages() as u32, &chunks) }.expect("attach");
        let pages: Vec<AgentPageCopy> = (0..self.pages())
            .map(|n| AgentPageCopy {
                host_offset: n * self.page,
                region,
                region_offset: n * self.page,
                len: self.page,
                checksum: Some(self.sums[n as usize]),
            })
            .collect();
        let mut restore = |pass: u64| {
            let mut out = Vec::new();
            let start = Instant::now();
            for (i, batch) in pages.chunks(BATCH).enumerate() {
                let event = Event::AgentCopy {
                    copy: pass * 1_000_000 + i as u64,
                    direction: AgentDirection::PoolToRegion,
                    pages: batch.to_vec(),
                };
                assert!(agent.handle(&event));
            }
            assert!(agent.drain(Duration::from_secs(60), &mut out));
            let took = start.elapsed();
            for c in &out {
                assert!(
                    matches!(c, Command::CopyDone { failure: None, .. }),
                    "{c:?}"
                );
            }
            took
        };
        let first = restore(0);
        (first, restore(1))
    }

    fn check(&self) {
        let run = (self.page / RUNS) as usize;
        for slot in 0..self.pages() {
            for r in 0..RUNS {
                let from = (slot * self.page) as usize + r as usize * run;
                let at = self.run_at(r, slot);
                assert!(self.mem[at..at + run] == self.pool[from..from + run]);
            }
        }
    }
}

fn gbs(d: Duration) -> f64 {
    TOTAL as f64 / d.as_secs_f64() / 1e9
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    println!(
        "agent restore of {} MiB, {RUNS} runs per page, best of {rounds}",
        TOTAL >> 20
    );
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "page", "memcpy", "two-pass", "one-pass", "first", "two/mem", "one/mem", "first/mem"
    );
    for page in [256u64 << 10, 2 << 20] {
        let mut b = Bench::new(page);
        let best = |f: &mut dyn FnMut() -> Duration| (0..rounds).map(|_| f()).min().unwrap();
        let mem = best(&mut || b.memcpy());
        b.mem.fill(0);
        let two = best(&mut || {
            b.agent(Box::new(TwoPass(HostCopyEngine::new(
                HostCopyConfig::default(),
            ))))
            .1
        });
        b.check();
        b.mem.fill(0);
        let mut first = Duration::MAX;
        let one = best(&mut || {
            let (cold, warm) = b.agent(Box::new(HostCopyEngine::new(HostCopyConfig::default())));
            first = first.min(cold);
            warm
        });
        b.check();
        let ratio = |d: Duration| mem.as_secs_f64() / d.as_secs_f64();
        println!(
            "{:>5} KiB {:>5.2} GB/s {:>5.2} GB/s {:>5.2} GB/s {:>5.2} GB/s {:>8.2}x {:>8.2}x {:>8.2}x",
            page >> 10,
            gbs(mem),
            gbs(two),
            gbs(one),
            gbs(first),
            ratio(two),
            ratio(one),
            ratio(first),
        );
    }
}
