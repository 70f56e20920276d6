//! H2D and D2H bandwidth through the CUDA copy engine against one
//! `cuMemcpyAsync` of the same total size from the same pinned pool, in the
//! same run (scripts/gpu-check.sh runs it; needs a GPU).
//!
//! For each page size (64 KiB, 2 MiB), layout (device slots scattered, so
//! nothing coalesces; or contiguous, so batches collapse into one run) and
//! copy call (per-run async copies; `cuMemcpyBatchAsync` where the driver
//! has it): batches of `--batch` pages up to the engine's in-flight bound,
//! timed from the first submit until `poll` reported the last batch. Best
//! of `--repeats`.
//!
//! Usage: cuda_bandwidth [--total-mib N] [--batch PAGES] [--repeats N]

use std::time::{Duration, Instant};

use orbitkv_gpu::cuda::testing::{DeviceMemory, raw_copy_seconds};
use orbitkv_gpu::cuda::{CopyApi, CudaConfig, CudaCopyEngine};
use orbitkv_gpu::{Completion, CopyEngine, CopyError, Direction, ExternalMemory, PageCopy};

struct Args {
    total: u64,
    batch: usize,
    repeats: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        total: 2048 << 20,
        batch: 256,
        repeats: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: u64 = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?;
        match flag.as_str() {
            "--total-mib" => a.total = n << 20,
            "--batch" => a.batch = n.max(1) as usize,
            "--repeats" => a.repeats = n.max(1) as usize,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Seconds to move every copy through the engine, batches of `batch`.
fn timed(
    engine: &mut CudaCopyEngine,
    direction: Direction,
    copies: &[PageCopy],
    batch: usize,
) -> Result<f64, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut done: Vec<Completion> = Vec::new();
    let start = Instant::now();
    let mut chunks = copies.chunks(batch).peekable();
    while chunks.peek().is_some() || engine.in_flight() > 0 {
        if Instant::now() > deadline {
            return Err("copies did not finish within 60 s".into());
        }
        if let Some(chunk) = chunks.peek() {
            match engine.submit(direction, chunk, 0) {
                Ok(_) => {
                    chunks.next();
                    continue;
                }
                Err(CopyError::QueueFull(..)) => {}
                Err(e) => return Err(format!("submit: {e}")),
            }
        }
        engine.poll(0, &mut done);
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(bad) = done.iter().find(|c| c.result.is_err()) {
        return Err(format!("batch failed: {:?}", bad.result));
    }
    Ok(seconds)
}

fn run() -> Result<(), String> {
    let a = args()?;
    let info = orbitkv_gpu::cuda::probe().map_err(|e| format!("no CUDA: {e}"))?;
    println!(
        "cuda_bandwidth: driver {}.{}, total {} MiB per measurement, batch {} pages, best of {}",
        info.version / 1000,
        info.version % 1000 / 10,
        a.total >> 20,
        a.batch,
        a.repeats
    );
    let mut pool = memmap2::MmapOptions::new()
        .len(a.total as usize)
        .map_anon()
        .map_err(|e| e.to_string())?;
    // Touch every page (first touch), so timing never includes faults.
    for (i, b) in pool.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13);
    }
    let device = DeviceMemory::alloc(0, a.total).map_err(|e| e.to_string())?;
    let mut apis = vec![CopyApi::PerRun];
    if info.batch_api {
        apis.push(CopyApi::Batch);
    }
    let dirs = [
        ("H2D", Direction::HostToDevice),
        ("D2H", Direction::DeviceToHost),
    ];
    // Restores as the runtime sends them: each page carries its checksum,
    // which the engine verifies on the CPU before queueing.
    let rows = [
        ("H2D", Direction::HostToDevice, false),
        ("H2D+verify", Direction::HostToDevice, true),
        ("D2H", Direction::DeviceToHost, false),
    ];
    let mut baseline = [0.0f64; 2];
    let mut worst_ratio = f64::INFINITY;
    for api in apis {
        let mut engine = CudaCopyEngine::open(CudaConfig {
            prefer_batch_api: api == CopyApi::Batch,
            ..CudaConfig::default()
        })
        .map_err(|e| e.to_string())?;
        // SAFETY: `pool` and `device` outlive `engine` (dropped at the end
        // of this iteration); nothing touches them while copies run.
        unsafe { engine.register_host_pool(pool.as_mut_ptr(), a.total) }
            .map_err(|e| e.to_string())?;
        let region = unsafe {
            engine.attach_region(ExternalMemory::Cuda {
                device: 0,
                ptr: device.ptr(),
                len: a.total,
            })
        }
        .map_err(|e| e.to_string())?;
        if baseline[0] == 0.0 {
            // The baseline: one copy of the whole pinned pool.
            for (i, (_, dir)) in dirs.iter().enumerate() {
                // SAFETY: the pool is pinned (registered above) and both
                // ranges are `total` bytes.
                let s = unsafe {
                    raw_copy_seconds(0, *dir, pool.as_mut_ptr(), device.ptr(), a.total, a.repeats)
                }
                .map_err(|e| e.to_string())?;
                baseline[i] = a.total as f64 / s / 1e9;
            }
            println!(
                "baseline: one cuMemcpyAsync of {} MiB pinned: H2D {:.1} GB/s, D2H {:.1} GB/s",
                a.total >> 20,
                baseline[0],
                baseline[1]
            );
        }
        for page in [64u64 << 10, 2 << 20] {
            let pages = a.total / page;
            for (layout, slots) in [
                ("scattered", shuffled(pages)),
                ("contiguous", (0..pages).collect()),
            ] {
                let copies: Vec<PageCopy> = (0..pages)
                    .map(|i| PageCopy {
                        host_offset: i * page,
                        region,
                        device_offset: slots[i as usize] * page,
                        len: page,
                        expect_checksum: None,
                        sum: orbitkv_gpu::SumOf::Destination,
                    })
                    .collect();
                let verified: Vec<PageCopy> = copies
                    .iter()
                    .map(|c| PageCopy {
                        expect_checksum: Some(orbitkv_gpu::page_checksum(
                            &pool[c.host_offset as usize..(c.host_offset + c.len) as usize],
                        )),
                        ..*c
                    })
                    .collect();
                for (name, dir, verify) in rows {
                    let i = usize::from(dir == Direction::DeviceToHost);
                    let copies = if verify { &verified } else { &copies };
                    let before = engine.stats();
                    let mut best = f64::INFINITY;
                    for _ in 0..a.repeats {
                        best = best.min(timed(&mut engine, dir, copies, a.batch)?);
                    }
                    let after = engine.stats();
                    let runs_per_batch = (after.runs - before.runs) as f64
                        / (after.batches - before.batches).max(1) as f64;
                    let gbps = a.total as f64 / best / 1e9;
                    let ratio = gbps / baseline[i];
                    worst_ratio = worst_ratio.min(ratio);
                    println!(
                        "{name} page={:>4} KiB batch={} layout={layout:<10} api={api:?}: engine \
                         {gbps:6.1} GB/s, one cuMemcpyAsync {:6.1} GB/s, ratio {ratio:.2} \
                         ({runs_per_batch:.0} runs/batch)",
                        page >> 10,
                        a.batch,
                        baseline[i],
                    );
                }
            }
        }
        drop(engine);
    }
    println!("worst ratio: {worst_ratio:.2} (goal >= 0.90)");
    drop(device);
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bandwidth: {e}");
        std::process::exit(1);
    }
}
