//! On a machine without a usable CUDA driver (CI): the probe says so with a
//! typed reason instead of panicking, and the engine `best_engine` falls
//! back to moves exact bytes.

use std::thread;
use std::time::Duration;

use orbitkv_gpu::cuda::{self, CudaConfig, CudaCopyEngine, Unavailable};
use orbitkv_gpu::host::HostCopyConfig;
use orbitkv_gpu::{Completion, CopyEngine, Direction, ExternalMemory, PageCopy};

/// Whether this machine has a CUDA driver at all (the test's premise).
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[test]
fn without_cuda_the_probe_reports_why_and_the_host_engine_round_trips() {
    if driver_present() {
        // The typed path must still hold: either CUDA works or a reason.
        let (engine, why) = cuda::best_engine(CudaConfig::default(), HostCopyConfig::default());
        assert_eq!(engine.name() == "cuda", why.is_none(), "{why:?}");
        return;
    }
    assert_eq!(cuda::probe(), Err(Unavailable::NoDriver));
    assert_eq!(
        CudaCopyEngine::open(CudaConfig::default()).err(),
        Some(Unavailable::NoDriver)
    );
    let (mut engine, why) = cuda::best_engine(CudaConfig::default(), HostCopyConfig::default());
    assert_eq!(why, Some(Unavailable::NoDriver));
    assert_eq!(engine.name(), "host");
    assert!(why.unwrap().to_string().contains("libcuda"));

    // Pool and an engine-owned "device" buffer, both reached only through
    // raw pointers while copies may run.
    const PAGE: usize = 4096;
    let pool = Box::into_raw(vec![0u8; 8 * PAGE].into_boxed_slice()).cast::<u8>();
    let device = Box::into_raw(vec![0u8; 8 * PAGE].into_boxed_slice()).cast::<u8>();
    let src: Vec<u8> = (0..4 * PAGE).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: in bounds; no copy is in flight.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), pool, src.len()) };
    // SAFETY: both buffers outlive the engine (dropped below, after it).
    unsafe { engine.register_host_pool(pool, 8 * PAGE as u64) }.unwrap();
    let region = unsafe {
        engine.attach_region(ExternalMemory::Host {
            base: device,
            len: 8 * PAGE as u64,
        })
    }
    .unwrap();
    let copies = |host_base: u64| -> Vec<PageCopy> {
        (0..4u64)
            .map(|i| PageCopy {
                host_offset: (host_base + i) * PAGE as u64,
                region,
                device_offset: (7 - i) * PAGE as u64, // reversed slots
                len: PAGE as u64,
                expect_checksum: None,
                sum: orbitkv_gpu::SumOf::Destination,
            })
            .collect()
    };
    let wait = |engine: &mut Box<dyn CopyEngine>| {
        let mut out: Vec<Completion> = Vec::new();
        for _ in 0..10_000 {
            engine.poll(0, &mut out);
            if engine.in_flight() == 0 {
                break;
            }
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].result, Ok(()));
    };
    engine
        .submit(Direction::HostToDevice, &copies(0), 0)
        .unwrap();
    wait(&mut engine);
    engine
        .submit(Direction::DeviceToHost, &copies(4), 0)
        .unwrap();
    wait(&mut engine);
    drop(engine);
    let mut back = vec![0u8; 4 * PAGE];
    // SAFETY: the engine is gone; in bounds.
    unsafe { std::ptr::copy_nonoverlapping(pool.add(4 * PAGE), back.as_mut_ptr(), back.len()) };
    assert_eq!(back, src);
    // SAFETY: from Box::into_raw of 8 * PAGE bytes each.
    unsafe {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            pool,
            8 * PAGE,
        )));
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            device,
            8 * PAGE,
        )));
    }
}

#[test]
fn disabled_cuda_is_a_reason_too() {
    let cfg = CudaConfig {
        enabled: false,
        ..CudaConfig::default()
    };
    let (engine, why) = cuda::best_engine(cfg, HostCopyConfig::default());
    assert_eq!(engine.name(), "host");
    assert_eq!(why, Some(Unavailable::Disabled));
}

#[test]
fn a_copy_agent_for_cuda_memory_is_refused_with_the_reason_never_given_the_host_engine() {
    use orbitkv_gpu::agent::{AgentError, MemoryKind, executor_for};
    let host = executor_for(
        MemoryKind::Host,
        HostCopyConfig::default(),
        CudaConfig::default(),
    );
    assert_eq!(host.map(|e| e.name()).ok(), Some("host"));
    let cuda = executor_for(
        MemoryKind::Cuda { device: 0 },
        HostCopyConfig::default(),
        CudaConfig::default(),
    );
    if driver_present() {
        // Either the CUDA engine, or a typed reason: never the host engine.
        match cuda {
            Ok(e) => assert_eq!(e.name(), "cuda"),
            Err(e) => assert!(
                matches!(e, AgentError::CudaUnavailable { device: 0, .. }),
                "{e}"
            ),
        }
        return;
    }
    let err = cuda.err().expect("no CUDA engine without a driver");
    assert_eq!(
        err,
        AgentError::CudaUnavailable {
            device: 0,
            reason: Unavailable::NoDriver
        }
    );
    assert!(err.to_string().contains("libcuda"), "{err}");
}
