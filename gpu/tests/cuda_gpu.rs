//! The CUDA engine on a real GPU. Ignored by default (CI has no GPU);
//! `scripts/gpu-check.sh` runs them with `--ignored --test-threads=1`.
//!
//! The pool is an anonymous mapping, as the shared DRAM pool is; the
//! "engine tensors" are `cuMemAlloc` allocations made through the same
//! primary context an engine's PyTorch uses.

use std::thread;
use std::time::{Duration, Instant};

use orbitkv_gpu::cuda::testing::DeviceMemory;
use orbitkv_gpu::cuda::{CopyApi, CudaConfig, CudaCopyEngine, TokenState};
use orbitkv_gpu::{
    Completion, CompletionToken, CopyEngine, CopyError, Direction, ExternalMemory, PageCopy,
};

use Direction::{DeviceToHost, HostToDevice};

/// A host pool reached only through its raw pointer.
struct Pool {
    map: memmap2::MmapMut,
    ptr: *mut u8,
    len: usize,
}

impl Pool {
    fn new(len: usize) -> Self {
        let mut map = memmap2::MmapOptions::new().len(len).map_anon().unwrap();
        let ptr = map.as_mut_ptr();
        Self { map, ptr, len }
    }
    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; no copy covers it now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) }
    }
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        let mut out = vec![0; len];
        // SAFETY: in bounds; no copy covers it now.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), len) }
        out
    }
}

fn engine(api: CopyApi) -> CudaCopyEngine {
    CudaCopyEngine::open(CudaConfig {
        prefer_batch_api: api == CopyApi::Batch,
        ..CudaConfig::default()
    })
    .expect("a CUDA device")
}

/// Both copy calls where the driver has the batch one.
fn apis() -> Vec<CopyApi> {
    let e = engine(CopyApi::Batch);
    let mut v = vec![CopyApi::PerRun];
    if e.info().batch_api {
        v.push(CopyApi::Batch);
    }
    v
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A fixed permutation of `0..n` (so device slots are scattered).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Submits `copies` in batches of `batch`, waiting for room when the
/// engine is full, and returns every completion. Bounded by a deadline.
fn run_all(
    engine: &mut dyn CopyEngine,
    direction: Direction,
    copies: &[PageCopy],
    batch: usize,
) -> Vec<Completion> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut done = Vec::new();
    let mut tokens = Vec::new();
    let mut chunks = copies.chunks(batch).peekable();
    while chunks.peek().is_some() || engine.in_flight() > 0 {
        assert!(Instant::now() < deadline, "copies did not finish in 60 s");
        if let Some(chunk) = chunks.peek() {
            match engine.submit(direction, chunk, 0) {
                Ok(t) => {
                    tokens.push(t);
                    chunks.next();
                    continue;
                }
                Err(CopyError::QueueFull(..)) => {}
                Err(e) => panic!("submit: {e}"),
            }
        }
        engine.poll(0, &mut done);
        thread::yield_now();
    }
    engine.poll(0, &mut done);
    let mut got: Vec<_> = done.iter().map(|c| c.token).collect();
    got.sort();
    assert_eq!(got, tokens);
    done
}

fn round_trip(pages: u64) {
    const PAGE: u64 = 64 * 1024;
    for api in apis() {
        let bytes = pages * PAGE;
        let pool = Pool::new(2 * bytes as usize);
        // One page more than the region: the region is a sub-range of its
        // allocation, as a layer's KV tensor is of a larger pool.
        let device = DeviceMemory::alloc(0, bytes + PAGE).unwrap();
        device.fill(0xee).unwrap();
        let mut engine = engine(api);
        assert_eq!(engine.copy_api(), api);
        // SAFETY: `pool` and `device` outlive `engine` (dropped first
        // below), and the test touches no range while a copy covers it.
        unsafe { engine.register_host_pool(pool.ptr, pool.len as u64) }.unwrap();
        let region = unsafe {
            engine.attach_region(ExternalMemory::Cuda {
                device: 0,
                ptr: device.ptr() + PAGE,
                len: bytes,
            })
        }
        .unwrap();
        let src = pattern(pages, bytes as usize);
        pool.write(0, &src);
        let slots = shuffled(pages, pages + 1);
        // Restores carry their pages' checksums, as the runtime's do.
        let restore: Vec<PageCopy> = (0..pages)
            .map(|i| PageCopy {
                host_offset: i * PAGE,
                region,
                device_offset: slots[i as usize] * PAGE,
                len: PAGE,
                expect_checksum: Some(orbitkv_gpu::page_checksum(
                    &src[(i * PAGE) as usize..((i + 1) * PAGE) as usize],
                )),
                sum: orbitkv_gpu::SumOf::Destination,
            })
            .collect();
        for c in run_all(&mut engine, HostToDevice, &restore, 256) {
            assert_eq!(c.result, Ok(()), "{api:?}");
        }
        let on_device = device.read(0, (bytes + PAGE) as usize).unwrap();
        assert!(
            on_device[..PAGE as usize].iter().all(|&b| b == 0xee),
            "byte before the region written"
        );
        for i in 0..pages as usize {
            let slot = slots[i] as usize + 1;
            let p = PAGE as usize;
            assert_eq!(
                on_device[slot * p..(slot + 1) * p],
                src[i * p..(i + 1) * p],
                "page {i}, {api:?}"
            );
        }
        // Back into the pool's second half, page i from slot[i] again.
        let publish: Vec<PageCopy> = restore
            .iter()
            .map(|c| PageCopy {
                host_offset: bytes + c.host_offset,
                expect_checksum: None,
                ..*c
            })
            .collect();
        for c in run_all(&mut engine, DeviceToHost, &publish, 256) {
            assert_eq!(c.result, Ok(()), "{api:?}");
        }
        assert!(
            pool.read(bytes as usize, bytes as usize) == src,
            "pool → device → pool, {api:?}"
        );
        let stats = engine.stats();
        assert_eq!(stats.copies, 2 * pages);
        drop(engine);
        drop(device);
        drop(pool.map);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn exact_bytes_pool_device_pool_1_page() {
    round_trip(1);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn exact_bytes_pool_device_pool_64_pages() {
    round_trip(64);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn exact_bytes_pool_device_pool_4096_pages() {
    round_trip(4096);
}

/// The fencing guarantee with real streams: once `unregister` returns Ok,
/// every batch submitted against the region has finished (poll reports all
/// of them at once, without waiting), later submits are refused, and
/// nothing writes the region's memory or the pool pages those batches
/// named any more, even after the engine frees and reuses the memory.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn unregister_returns_after_in_flight_copies_and_nothing_lands_later() {
    const PAGE: u64 = 1 << 20;
    const PAGES: u64 = 512; // 512 MiB each way: still in flight at unregister
    let bytes = PAGES * PAGE;
    let pool = Pool::new(2 * bytes as usize);
    let device = DeviceMemory::alloc(0, bytes).unwrap();
    let staging = DeviceMemory::alloc(0, bytes).unwrap();
    let src = pattern(11, bytes as usize);
    pool.write(0, &src);
    staging.write(0, &src).unwrap();
    let mut engine = engine(CopyApi::Batch);
    // SAFETY: as in `round_trip`.
    unsafe { engine.register_host_pool(pool.ptr, pool.len as u64) }.unwrap();
    let attach = |engine: &mut CudaCopyEngine, ptr| unsafe {
        engine.attach_region(ExternalMemory::Cuda {
            device: 0,
            ptr,
            len: bytes,
        })
    };
    let target = attach(&mut engine, device.ptr()).unwrap();
    let source = attach(&mut engine, staging.ptr()).unwrap();
    let pages = |region, host_base: u64| -> Vec<PageCopy> {
        (0..PAGES)
            .map(|i| PageCopy {
                host_offset: host_base + i * PAGE,
                region,
                device_offset: (PAGES - 1 - i) * PAGE,
                len: PAGE,
                expect_checksum: None,
                sum: orbitkv_gpu::SumOf::Destination,
            })
            .collect()
    };
    let mut tokens: Vec<CompletionToken> = Vec::new();
    for chunk in pages(target, 0).chunks(64) {
        tokens.push(engine.submit(HostToDevice, chunk, 0).unwrap());
    }
    for chunk in pages(source, bytes).chunks(64) {
        tokens.push(engine.submit(DeviceToHost, chunk, 0).unwrap());
    }
    let pending = tokens
        .iter()
        .filter(|t| engine.query(**t) == TokenState::Pending)
        .count();
    println!(
        "{pending} of {} batches pending at unregister",
        tokens.len()
    );
    engine.unregister_device_region(target).unwrap();
    engine.unregister_device_region(source).unwrap();
    // Nothing was waited for since: every batch is already done.
    let mut done = Vec::new();
    engine.poll(0, &mut done);
    assert_eq!(
        done.len(),
        tokens.len(),
        "unregister returned before its copies finished"
    );
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(
        engine.submit(HostToDevice, &pages(target, 0)[..1], 0),
        Err(CopyError::UnknownRegion(target))
    );
    // The D2H copies had landed in the pool, and stay as they are.
    let p = PAGE as usize;
    let landed = pool.read(bytes as usize, bytes as usize);
    for i in 0..PAGES as usize {
        let slot = PAGES as usize - 1 - i;
        assert!(
            landed[i * p..(i + 1) * p] == src[slot * p..(slot + 1) * p],
            "pool page {i}"
        );
    }
    // The engine frees the tensor and reuses the memory.
    drop(device);
    let reused = DeviceMemory::alloc(0, bytes).unwrap();
    reused.fill(0).unwrap();
    thread::sleep(Duration::from_millis(50));
    assert!(
        reused
            .read(0, bytes as usize)
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "a copy wrote freed memory"
    );
    assert!(
        pool.read(bytes as usize, bytes as usize) == landed,
        "a copy wrote the pool after unregister"
    );
    drop(engine);
    drop((reused, staging));
}

/// Layer-wise loading: one batch per layer; a layer's token reports done
/// only once that layer's bytes are on the device.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn per_layer_tokens_complete_with_their_bytes() {
    const PAGE: u64 = 256 * 1024;
    const LAYERS: u64 = 8;
    const PER_LAYER: u64 = 64;
    let bytes = LAYERS * PER_LAYER * PAGE;
    let pool = Pool::new(bytes as usize);
    let device = DeviceMemory::alloc(0, bytes).unwrap();
    let src = pattern(5, bytes as usize);
    pool.write(0, &src);
    let mut engine = engine(CopyApi::Batch);
    // SAFETY: as in `round_trip`.
    unsafe { engine.register_host_pool(pool.ptr, pool.len as u64) }.unwrap();
    let region = unsafe {
        engine.attach_region(ExternalMemory::Cuda {
            device: 0,
            ptr: device.ptr(),
            len: bytes,
        })
    }
    .unwrap();
    let tokens: Vec<CompletionToken> = (0..LAYERS)
        .map(|layer| {
            let copies: Vec<PageCopy> = (0..PER_LAYER)
                .map(|i| {
                    let off = (layer * PER_LAYER + i) * PAGE;
                    PageCopy {
                        host_offset: off,
                        region,
                        device_offset: off,
                        len: PAGE,
                        expect_checksum: None,
                        sum: orbitkv_gpu::SumOf::Destination,
                    }
                })
                .collect();
            engine.submit(HostToDevice, &copies, 0).unwrap()
        })
        .collect();
    let layer_bytes = (PER_LAYER * PAGE) as usize;
    for (layer, token) in tokens.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match engine.query(*token) {
                TokenState::Pending => {
                    assert!(Instant::now() < deadline, "layer {layer} never finished");
                    thread::yield_now();
                }
                TokenState::Done(result) => {
                    assert_eq!(result, Ok(()));
                    break;
                }
                TokenState::Unknown => panic!("layer {layer}: token unknown before poll"),
            }
        }
        let got = device
            .read((layer * layer_bytes) as u64, layer_bytes)
            .unwrap();
        assert!(
            got == src[layer * layer_bytes..(layer + 1) * layer_bytes],
            "layer {layer}"
        );
    }
    // Contiguous pages coalesce: one run per layer.
    assert_eq!(engine.stats().runs, LAYERS);
    let mut done = Vec::new();
    engine.poll(0, &mut done);
    assert_eq!(done.len(), LAYERS as usize);
    drop(engine);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn regions_outside_their_allocation_are_refused() {
    let device = DeviceMemory::alloc(0, 1 << 20).unwrap();
    let pool = Pool::new(1 << 20);
    let mut engine = engine(CopyApi::PerRun);
    let mut attach = |device, ptr, len| unsafe {
        engine.attach_region(ExternalMemory::Cuda { device, ptr, len })
    };
    let rejected = |r: Result<u32, CopyError>| matches!(r, Err(CopyError::RegionRejected(..)));
    assert!(
        rejected(attach(0, device.ptr() + 4096, 1 << 20)),
        "past the end"
    );
    assert!(rejected(attach(0, pool.ptr as u64, 4096)), "host memory");
    assert!(
        rejected(attach(1 << 20, device.ptr(), 4096)),
        "no such device"
    );
    assert!(attach(0, device.ptr() + 4096, (1 << 20) - 4096).is_ok());
    drop(engine);
    drop(device);
}
