//! Both copy engines through the `CopyEngine` trait: exact bytes, typed
//! validation errors, back-pressure, and each backend's own guarantees
//! (sim: timing and fault hooks; host: many concurrent batches, drop).

use std::thread;
use std::time::Duration;

use orbitkv_gpu::host::{DeviceArena, HostCopyConfig, HostCopyEngine};
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_gpu::{Completion, CompletionToken, CopyEngine, CopyError, Direction, PageCopy};

use Direction::{DeviceToHost, HostToDevice};

/// A host pool accessed only through its raw pointer, so the test never
/// holds a reference that aliases what the engine's workers write.
struct TestPool {
    ptr: *mut u8,
    len: usize,
}

impl TestPool {
    fn new(len: usize) -> Self {
        let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
        Self { ptr, len }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; called only while no copy is in flight.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) }
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        let mut out = vec![0; len];
        // SAFETY: in bounds; called only while no copy is in flight.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), len) }
        out
    }

    /// # Safety
    /// The pool must outlive the engine (declare it before the engine).
    unsafe fn register(&self, engine: &mut dyn CopyEngine) {
        unsafe { engine.register_host_pool(self.ptr, self.len as u64) }.unwrap();
    }
}

impl Drop for TestPool {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` of a slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

type Backend = (Box<dyn CopyEngine>, DeviceArena);

fn host_backend(max_in_flight_batches: usize) -> Backend {
    let engine = HostCopyEngine::new(HostCopyConfig {
        max_in_flight_batches,
        ..Default::default()
    });
    let arena = engine.arena();
    (Box::new(engine), arena)
}

fn sim_backend(max_in_flight_batches: usize) -> Backend {
    let engine = SimCopyEngine::new(SimCopyConfig {
        max_in_flight_batches,
        ..Default::default()
    });
    let arena = engine.arena();
    (Box::new(engine), arena)
}

const BACKENDS: [fn(usize) -> Backend; 2] = [host_backend, sim_backend];

/// Late enough that every sim batch is due.
const FAR_FUTURE: u64 = u64::MAX;

/// Polls until nothing is in flight. Bounded, and no timing assertions:
/// the host engine's workers finish whenever the scheduler lets them.
fn drain(engine: &mut dyn CopyEngine) -> Vec<Completion> {
    let mut out = Vec::new();
    for _ in 0..60_000 {
        engine.poll(FAR_FUTURE, &mut out);
        if engine.in_flight() == 0 {
            return out;
        }
        thread::sleep(Duration::from_millis(1));
    }
    panic!(
        "{}: {} batches never completed",
        engine.name(),
        engine.in_flight()
    );
}

fn assert_all_ok(completions: &[Completion], tokens: &[CompletionToken]) {
    let mut got: Vec<_> = completions.iter().map(|c| c.token).collect();
    got.sort();
    let mut want = tokens.to_vec();
    want.sort();
    assert_eq!(got, want);
    for c in completions {
        assert_eq!(c.result, Ok(()), "{c:?}");
    }
}

/// Distinct, position-dependent bytes so misplaced copies show up.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i ^ seed << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect()
}

fn copy(host_offset: u64, region: u32, device_offset: u64, len: u64) -> PageCopy {
    PageCopy {
        host_offset,
        region,
        device_offset,
        len,
        expect_checksum: None,
        sum: orbitkv_gpu::SumOf::Destination,
    }
}

#[test]
fn copies_checksum_what_landed_and_refuse_altered_sources() {
    let pool = TestPool::new(8192);
    let (mut sim, arena, r) = sim_with_pool(&pool, SimCopyConfig::default());
    pool.write(0, &[7; 4096]);
    let good = xxhash_rust::xxh3::xxh3_64(&[7; 4096]);
    // Device -> host reports the checksum of the bytes that landed.
    arena.write(r, 0, &[3; 4096]).unwrap();
    sim.submit(DeviceToHost, &[copy(4096, r, 0, 4096)], 0)
        .unwrap();
    // Host -> device verifies against the checksum the page carries.
    let mut ok = copy(0, r, 4096, 4096);
    ok.expect_checksum = Some(good);
    sim.submit(HostToDevice, &[ok], 0).unwrap();
    let mut bad = copy(0, r, 8192, 4096);
    bad.expect_checksum = Some(good ^ 1);
    sim.submit(HostToDevice, &[bad], 0).unwrap();
    let mut out = Vec::new();
    sim.poll(FAR_FUTURE, &mut out);
    assert_eq!(out.len(), 3);
    assert_eq!(
        out[0].checksums,
        vec![xxhash_rust::xxh3::xxh3_64(&[3; 4096])]
    );
    assert_eq!(out[1].result, Ok(()));
    assert_eq!(out[1].checksums, vec![good]);
    assert!(
        matches!(out[2].result, Err(CopyError::Checksum { host_offset: 0 })),
        "{:?}",
        out[2]
    );
}

#[test]
fn names() {
    assert_eq!(host_backend(1).0.name(), "host");
    assert_eq!(sim_backend(1).0.name(), "sim");
}

#[test]
fn round_trip_exact_bytes_across_regions() {
    for backend in BACKENDS {
        let pool = TestPool::new(64 * 1024);
        let (mut engine, arena) = backend(64);
        let engine = engine.as_mut();
        // SAFETY: `pool` is declared before `engine`, so it outlives it.
        unsafe { pool.register(engine) };
        let r0 = engine.register_device_region(32 * 1024).unwrap();
        let r1 = engine.register_device_region(16 * 1024).unwrap();
        assert_ne!(r0, r1);
        assert_eq!(arena.region_len(r1), Some(16 * 1024));

        let src = pattern(1, 32 * 1024);
        pool.write(0, &src);
        let restore = [
            copy(0, r0, 4096, 4096),
            copy(4096, r1, 0, 8192),
            copy(12288, r0, 0, 100),
            copy(20000, r1, 16 * 1024 - 3, 3),
        ];
        let t1 = engine.submit(HostToDevice, &restore, 0).unwrap();
        assert_all_ok(&drain(engine), &[t1]);
        assert_eq!(arena.read(r0, 4096, 4096).unwrap(), src[..4096]);
        assert_eq!(arena.read(r1, 0, 8192).unwrap(), src[4096..12288]);
        assert_eq!(arena.read(r0, 0, 100).unwrap(), src[12288..12388]);
        assert_eq!(arena.read(r1, 16 * 1024 - 3, 3).unwrap(), src[20000..20003]);
        // Untouched device bytes stay zero.
        assert_eq!(arena.read(r0, 100, 3996).unwrap(), vec![0; 3996]);

        let dev = pattern(2, 1000);
        arena.write(r1, 9000, &dev).unwrap();
        let publish = [
            copy(40_000, r0, 4096, 4096),
            copy(50_000, r1, 9000, 1000),
            copy(60_000, r1, 0, 10),
        ];
        let t2 = engine.submit(DeviceToHost, &publish, 0).unwrap();
        assert!(t2 > t1);
        assert_all_ok(&drain(engine), &[t2]);
        assert_eq!(pool.read(40_000, 4096), src[..4096]);
        assert_eq!(pool.read(50_000, 1000), dev);
        assert_eq!(pool.read(60_000, 10), src[4096..4106]);
        assert_eq!(
            pool.read(44_096, 5904),
            vec![0; 5904],
            "no bytes beyond the copies"
        );
    }
}

#[test]
fn bounds_errors_reject_whole_batch() {
    for backend in BACKENDS {
        let pool = TestPool::new(8192);
        let (mut engine, arena) = backend(64);
        let engine = engine.as_mut();
        // SAFETY: `pool` outlives `engine`.
        unsafe { pool.register(engine) };
        let r = engine.register_device_region(4096).unwrap();
        pool.write(0, &[7; 8192]);
        let good = copy(0, r, 0, 4096);
        let oob = |what, offset, len, size| CopyError::OutOfBounds {
            what,
            offset,
            len,
            size,
        };
        let cases = [
            (copy(8000, r, 0, 193), oob("host pool", 8000, 193, 8192)),
            (copy(0, r, 4000, 97), oob("device region", 4000, 97, 4096)),
            (
                copy(u64::MAX - 1, r, 0, 4),
                oob("host pool", u64::MAX - 1, 4, 8192),
            ),
            (
                copy(0, r, u64::MAX - 1, 4),
                oob("device region", u64::MAX - 1, 4, 4096),
            ),
            (copy(0, r, 1, u64::MAX), oob("host pool", 0, u64::MAX, 8192)),
        ];
        for (bad, err) in cases {
            for dir in [HostToDevice, DeviceToHost] {
                assert_eq!(engine.submit(dir, &[good, bad], 0), Err(err.clone()));
            }
        }
        assert_eq!(engine.in_flight(), 0);
        assert!(drain(engine).is_empty());
        assert_eq!(
            arena.read(r, 0, 4096).unwrap(),
            vec![0; 4096],
            "nothing started"
        );
    }
}

#[test]
fn unknown_region_empty_batch_and_no_pool() {
    for backend in BACKENDS {
        let pool = TestPool::new(4096);
        let (mut engine, _arena) = backend(64);
        let engine = engine.as_mut();
        let r = engine.register_device_region(4096).unwrap();
        let c = copy(0, r, 0, 16);
        assert_eq!(
            engine.submit(HostToDevice, &[c], 0),
            Err(CopyError::NoHostPool)
        );
        assert_eq!(
            engine.submit(HostToDevice, &[], 0),
            Err(CopyError::EmptyBatch)
        );
        // SAFETY: `pool` outlives `engine`.
        unsafe { pool.register(engine) };
        assert_eq!(
            engine.submit(DeviceToHost, &[], 0),
            Err(CopyError::EmptyBatch)
        );
        assert_eq!(
            engine.submit(DeviceToHost, &[c, copy(0, r + 1, 0, 16)], 0),
            Err(CopyError::UnknownRegion(r + 1))
        );
        assert_eq!(engine.in_flight(), 0);
        assert!(matches!(
            engine.register_device_region(0),
            Err(CopyError::RegionRejected(0, _))
        ));
    }
}

#[test]
fn arena_access_is_bounds_checked() {
    for backend in BACKENDS {
        let (mut engine, arena) = backend(64);
        let r = engine.register_device_region(100).unwrap();
        arena.write(r, 90, &[1; 10]).unwrap();
        assert_eq!(arena.read(r, 95, 5).unwrap(), vec![1; 5]);
        assert!(matches!(
            arena.write(r, 91, &[1; 10]),
            Err(CopyError::OutOfBounds { size: 100, .. })
        ));
        assert!(matches!(
            arena.read(r, u64::MAX, 2),
            Err(CopyError::OutOfBounds { .. })
        ));
        assert!(matches!(
            arena.read(r, 0, u64::MAX),
            Err(CopyError::OutOfBounds { .. })
        ));
        assert_eq!(
            arena.read(r + 1, 0, 1),
            Err(CopyError::UnknownRegion(r + 1))
        );
        assert_eq!(arena.region_len(r + 1), None);
    }
}

#[test]
fn queue_full_at_the_bound_until_polled() {
    for backend in BACKENDS {
        let pool = TestPool::new(4096);
        let (mut engine, _arena) = backend(1);
        let engine = engine.as_mut();
        // SAFETY: `pool` outlives `engine`.
        unsafe { pool.register(engine) };
        let r = engine.register_device_region(4096).unwrap();
        let batch = [copy(0, r, 0, 4096)];
        let t = engine.submit(HostToDevice, &batch, 0).unwrap();
        // The first batch may already have landed, but it counts until polled.
        assert_eq!(
            engine.submit(HostToDevice, &batch, 0),
            Err(CopyError::QueueFull(1, 1))
        );
        assert_eq!(engine.in_flight(), 1);
        assert_all_ok(&drain(engine), &[t]);
        let t2 = engine.submit(HostToDevice, &batch, 0).unwrap();
        assert_all_ok(&drain(engine), &[t2]);
    }
}

fn sim_with_pool(pool: &TestPool, config: SimCopyConfig) -> (SimCopyEngine, DeviceArena, u32) {
    let mut engine = SimCopyEngine::new(config);
    // SAFETY: each caller declares `pool` before the engine.
    unsafe { pool.register(&mut engine) };
    let r = engine.register_device_region(1 << 20).unwrap();
    let arena = engine.arena();
    (engine, arena, r)
}

#[test]
fn sim_bytes_land_exactly_at_due_time() {
    let pool = TestPool::new(1 << 20);
    let (mut sim, arena, r) = sim_with_pool(&pool, SimCopyConfig::default());
    let src = pattern(3, 40_000);
    pool.write(0, &src);
    // due = 100 + 10 latency + 40_000 bytes / 10_000 per us = 114.
    let t = sim
        .submit(
            HostToDevice,
            &[copy(0, r, 0, 30_000), copy(30_000, r, 500_000, 10_000)],
            100,
        )
        .unwrap();
    let mut out = Vec::new();
    sim.poll(113, &mut out);
    assert!(out.is_empty());
    assert_eq!(sim.in_flight(), 1);
    assert_eq!(
        arena.read(r, 0, 30_000).unwrap(),
        vec![0; 30_000],
        "not visible early"
    );
    sim.poll(114, &mut out);
    assert_eq!(
        plain(&out),
        [Completion {
            token: t,
            result: Ok(()),
            checksums: vec![],
        }]
    );
    assert_eq!(sim.in_flight(), 0);
    assert_eq!(arena.read(r, 0, 30_000).unwrap(), src[..30_000]);
    assert_eq!(arena.read(r, 500_000, 10_000).unwrap(), src[30_000..]);

    // Device -> host is likewise invisible until due.
    let t = sim
        .submit(DeviceToHost, &[copy(600_000, r, 0, 100)], 200)
        .unwrap();
    sim.poll(209, &mut out);
    assert_eq!(pool.read(600_000, 100), vec![0; 100]);
    sim.poll(210, &mut out);
    assert_eq!(
        plain(&out).last(),
        Some(&Completion {
            token: t,
            result: Ok(()),
            checksums: vec![],
        })
    );
    assert_eq!(pool.read(600_000, 100), src[..100]);
}

#[test]
fn sim_completion_order_is_by_due_time_then_token() {
    let run = || {
        let pool = TestPool::new(1 << 20);
        let (mut sim, _arena, r) = sim_with_pool(&pool, SimCopyConfig::default());
        let submit = |sim: &mut SimCopyEngine, len, now| {
            sim.submit(HostToDevice, &[copy(0, r, 0, len)], now)
                .unwrap()
        };
        let big = submit(&mut sim, 500_000, 0); // due 60
        let small = submit(&mut sim, 10, 5); // due 15
        let tie_a = submit(&mut sim, 10_000, 20); // due 31
        let tie_b = submit(&mut sim, 20_000, 20); // due 32
        let tie_c = submit(&mut sim, 0, 21); // due 31, after tie_a by token
        let mut out = Vec::new();
        sim.poll(31, &mut out);
        let early: Vec<_> = out.iter().map(|c| c.token).collect();
        assert_eq!(early, [small, tie_a, tie_c]);
        sim.poll(1_000, &mut out);
        let all: Vec<_> = out.iter().map(|c| c.token).collect();
        assert_eq!(all, [small, tie_a, tie_c, tie_b, big]);
        out
    };
    assert_eq!(run(), run());
}

#[test]
fn sim_zero_rate_means_latency_only() {
    let pool = TestPool::new(1 << 20);
    let config = SimCopyConfig {
        latency_us: 7,
        bytes_per_us: 0,
        ..Default::default()
    };
    let (mut sim, _arena, r) = sim_with_pool(&pool, config);
    sim.submit(HostToDevice, &[copy(0, r, 0, 1 << 20)], 0)
        .unwrap();
    let mut out = Vec::new();
    sim.poll(6, &mut out);
    assert!(out.is_empty());
    sim.poll(7, &mut out);
    assert_eq!(out.len(), 1);
}

#[test]
fn sim_fail_next_copies_nothing() {
    let pool = TestPool::new(4096);
    let (mut sim, arena, r) = sim_with_pool(&pool, SimCopyConfig::default());
    pool.write(0, &[9; 4096]);
    sim.fail_next(1);
    let failed = sim.submit(HostToDevice, &[copy(0, r, 0, 100)], 0).unwrap();
    let ok = sim
        .submit(HostToDevice, &[copy(100, r, 100, 100)], 1)
        .unwrap();
    let mut out = Vec::new();
    sim.poll(FAR_FUTURE, &mut out);
    assert_eq!(
        plain(&out),
        [
            Completion {
                token: failed,
                result: Err(CopyError::Failed("injected".into())),
                checksums: vec![],
            },
            Completion {
                token: ok,
                result: Ok(()),
                checksums: vec![],
            },
        ]
    );
    assert_eq!(arena.read(r, 0, 100).unwrap(), vec![0; 100]);
    assert_eq!(arena.read(r, 100, 100).unwrap(), vec![9; 100]);
}

#[test]
fn sim_hold_and_delay() {
    let pool = TestPool::new(4096);
    let (mut sim, arena, r) = sim_with_pool(&pool, SimCopyConfig::default());
    pool.write(0, &[5; 4096]);
    sim.hold(true);
    let held = sim.submit(HostToDevice, &[copy(0, r, 0, 10)], 0).unwrap();
    let mut out = Vec::new();
    sim.poll(FAR_FUTURE, &mut out);
    assert!(out.is_empty());
    assert_eq!(sim.in_flight(), 1);
    assert_eq!(arena.read(r, 0, 10).unwrap(), vec![0; 10]);
    sim.hold(false);

    sim.delay_all(1_000);
    let slow = sim.submit(HostToDevice, &[copy(0, r, 10, 10)], 0).unwrap(); // due 1010
    sim.poll(1_009, &mut out);
    assert_eq!(
        plain(&out),
        [Completion {
            token: held,
            result: Ok(()),
            checksums: vec![],
        }]
    );
    sim.poll(1_010, &mut out);
    assert_eq!(
        plain(&out)[1],
        Completion {
            token: slow,
            result: Ok(()),
            checksums: vec![],
        }
    );
    assert_eq!(arena.read(r, 0, 20).unwrap(), vec![5; 20]);
}

#[test]
fn host_many_batches_land_exactly() {
    const PAGE: usize = 4096;
    const PAGES_PER_BATCH: usize = 64;
    const BATCHES: usize = 200;
    const TOTAL: usize = PAGE * PAGES_PER_BATCH * BATCHES;
    let pages = (PAGES_PER_BATCH * BATCHES) as u64;
    // 7919 is coprime with the page count, so this scatters pages as a
    // permutation of the device region.
    let device_page = |i: u64| (i * 7919) % pages;

    let pool = TestPool::new(2 * TOTAL);
    let mut engine = HostCopyEngine::new(HostCopyConfig {
        max_in_flight_batches: BATCHES,
        ..Default::default()
    });
    // SAFETY: `pool` outlives `engine`.
    unsafe { pool.register(&mut engine) };
    let r = engine.register_device_region(TOTAL as u64).unwrap();
    let arena = engine.arena();
    let src = pattern(4, TOTAL);
    pool.write(0, &src);

    let run = |engine: &mut HostCopyEngine, dir, host_base: u64| {
        let tokens: Vec<_> = (0..BATCHES as u64)
            .map(|b| {
                let batch: Vec<_> = (0..PAGES_PER_BATCH as u64)
                    .map(|p| {
                        let i = b * PAGES_PER_BATCH as u64 + p;
                        let page = PAGE as u64;
                        copy(host_base + i * page, r, device_page(i) * page, page)
                    })
                    .collect();
                engine.submit(dir, &batch, 0).unwrap()
            })
            .collect();
        assert_all_ok(&drain(engine), &tokens);
    };

    run(&mut engine, HostToDevice, 0);
    let device = arena.read(r, 0, TOTAL as u64).unwrap();
    for i in 0..pages as usize {
        let d = device_page(i as u64) as usize * PAGE;
        assert_eq!(
            device[d..d + PAGE],
            src[i * PAGE..(i + 1) * PAGE],
            "page {i}"
        );
    }

    run(&mut engine, DeviceToHost, TOTAL as u64);
    assert!(pool.read(TOTAL, TOTAL) == src, "published pages differ");
}

#[test]
fn host_drop_finishes_submitted_batches() {
    let pool = TestPool::new(1 << 20);
    let src = pattern(5, 1 << 19);
    pool.write(0, &src);
    {
        let mut engine = HostCopyEngine::new(HostCopyConfig::default());
        // SAFETY: `pool` outlives `engine`.
        unsafe { pool.register(&mut engine) };
        let r = engine.register_device_region(1 << 19).unwrap();
        engine.arena().write(r, 0, &src).unwrap();
        let half = 1 << 18;
        engine
            .submit(DeviceToHost, &[copy(1 << 19, r, 0, half)], 0)
            .unwrap();
        engine
            .submit(DeviceToHost, &[copy(3 << 18, r, half, half)], 0)
            .unwrap();
        // Dropped with both batches possibly still in flight.
    }
    assert!(pool.read(1 << 19, 1 << 19) == src);
}

#[test]
fn host_zero_workers_still_copies() {
    let pool = TestPool::new(64);
    let mut engine = HostCopyEngine::new(HostCopyConfig {
        workers: 0,
        ..Default::default()
    });
    // SAFETY: `pool` outlives `engine`.
    unsafe { pool.register(&mut engine) };
    let r = engine.register_device_region(64).unwrap();
    pool.write(0, &[3; 64]);
    let t = engine
        .submit(HostToDevice, &[copy(0, r, 0, 64)], 0)
        .unwrap();
    assert_all_ok(&drain(&mut engine), &[t]);
    assert_eq!(engine.arena().read(r, 0, 64).unwrap(), vec![3; 64]);
}

/// Memory the engine owns is copied into and out of exactly, is never freed
/// by the engine, and bad external memory is refused with a typed error.
#[test]
fn attached_host_memory_round_trips_and_bad_memory_is_refused() {
    use orbitkv_gpu::ExternalMemory;
    let mut engine = HostCopyEngine::new(HostCopyConfig::default());
    let mut pool = vec![0u8; 8192];
    for (i, b) in pool.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    // SAFETY: `pool` outlives the engine (dropped after it below).
    unsafe { engine.register_host_pool(pool.as_mut_ptr(), pool.len() as u64) }.unwrap();
    let mut owned = vec![0u8; 4096];
    let region = unsafe {
        engine.attach_region(ExternalMemory::Host {
            base: owned.as_mut_ptr(),
            len: owned.len() as u64,
        })
    }
    .unwrap();
    let copy = |host_offset, device_offset| PageCopy {
        host_offset,
        region,
        device_offset,
        len: 1024,
        expect_checksum: None,
        sum: orbitkv_gpu::SumOf::Destination,
    };
    let t = engine
        .submit(Direction::HostToDevice, &[copy(1024, 2048)], 0)
        .unwrap();
    let mut done = Vec::new();
    while done.is_empty() {
        engine.poll(0, &mut done);
        std::thread::yield_now();
    }
    assert_eq!(
        done,
        vec![Completion {
            token: t,
            result: Ok(()),
            checksums: vec![xxhash_rust::xxh3::xxh3_64(&pool[1024..2048])],
        }]
    );
    assert_eq!(
        engine.arena().read(region, 2048, 1024).unwrap(),
        pool[1024..2048]
    );
    // Out of the attached bounds: typed, and nothing starts.
    assert!(matches!(
        engine.submit(Direction::HostToDevice, &[copy(0, 3584)], 0),
        Err(CopyError::OutOfBounds {
            what: "device region",
            ..
        })
    ));
    for bad in [
        ExternalMemory::Host {
            base: std::ptr::null_mut(),
            len: 64,
        },
        ExternalMemory::Host {
            base: owned.as_mut_ptr(),
            len: 0,
        },
        ExternalMemory::Cuda {
            device: 0,
            ptr: 0x1000,
            len: 64,
        },
    ] {
        assert!(matches!(
            unsafe { engine.attach_region(bad) },
            Err(CopyError::RegionRejected(..))
        ));
    }
    engine.unregister_device_region(region).unwrap();
    drop(engine);
    // The engine never freed the caller's memory; it holds what was copied.
    assert_eq!(owned[2048..3072], pool[1024..2048]);
}

/// Completions without their checksums (the tests below compare tokens and
/// results; `copies_checksum_what_landed` covers the checksums).
fn plain(out: &[Completion]) -> Vec<Completion> {
    out.iter()
        .map(|c| Completion {
            checksums: vec![],
            ..c.clone()
        })
        .collect()
}

/// `wait` sleeps until a batch lands and leaves it for `poll`, exactly
/// once; with nothing in flight it answers at once. The sim engine never
/// blocks: its batches land when its clock says.
#[test]
fn wait_blocks_until_a_batch_lands_and_poll_reports_it() {
    let pool = TestPool::new(1 << 20);
    let (mut engine, arena) = host_backend(8);
    let engine = engine.as_mut();
    // SAFETY: `pool` is declared before `engine`, so it outlives it.
    unsafe { pool.register(engine) };
    let r = engine.register_device_region(1 << 20).unwrap();
    assert!(!engine.wait(Duration::from_secs(5)), "nothing in flight");
    let src = pattern(9, 512 * 1024);
    pool.write(0, &src);
    let t = engine
        .submit(HostToDevice, &[copy(0, r, 0, 512 * 1024)], 0)
        .unwrap();
    // Bounded: a lost completion fails the test instead of hanging it.
    let mut woke = false;
    for _ in 0..50 {
        if engine.wait(Duration::from_millis(100)) {
            woke = true;
            break;
        }
    }
    assert!(woke, "the batch landed within 5 s");
    // Still in flight until polled; a second wait returns at once.
    assert_eq!(engine.in_flight(), 1);
    assert!(engine.wait(Duration::from_secs(5)));
    let mut out = Vec::new();
    engine.poll(0, &mut out);
    assert_all_ok(&out, &[t]);
    assert_eq!(engine.in_flight(), 0);
    assert_eq!(arena.read(r, 0, src.len() as u64).unwrap(), src);
    out.clear();
    engine.poll(0, &mut out);
    assert!(out.is_empty(), "reported once");

    let (mut sim, _) = sim_backend(8);
    let sim = sim.as_mut();
    // SAFETY: as above.
    unsafe { pool.register(sim) };
    let r = sim.register_device_region(4096).unwrap();
    sim.submit(HostToDevice, &[copy(0, r, 0, 4096)], 0).unwrap();
    assert!(
        !sim.wait(Duration::from_secs(5)),
        "the sim engine never blocks"
    );
    assert_eq!(drain(sim).len(), 1);
}
