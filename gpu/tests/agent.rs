//! The copy agent on the host executor: exact bytes through chunked
//! regions, and every bad copy a typed failure reported through `poll`.

use std::time::Duration;

use orbitkv_components::api::{AgentDirection, AgentPageCopy, Command, CopyFailure, Event};
use orbitkv_gpu::agent::{AgentError, Chunk, CopyAgent, HostWindow, MemoryKind};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine, shared_memory};

const PAGE: u64 = 4096;
const SLOTS: u32 = 4;

fn agent() -> CopyAgent {
    CopyAgent::new(Box::new(HostCopyEngine::new(HostCopyConfig::default())))
}

/// A pool (filled with a pattern) and a staging area, as memfds, mapped
/// into the agent's window; returns the maps the "runtime" keeps.
fn window(agent: &mut CopyAgent) -> (memmap2::MmapMut, memmap2::MmapMut) {
    let (pool_file, mut pool) = shared_memory("test-pool", 16 * PAGE).unwrap();
    for (i, b) in pool.iter_mut().enumerate() {
        *b = (i * 7 + i / 4096) as u8;
    }
    let (staging_file, staging) = shared_memory("test-staging", 8 * PAGE).unwrap();
    let w = HostWindow::map(&pool_file, 16 * PAGE, &staging_file, 8 * PAGE).unwrap();
    assert_eq!((w.pool_len(), w.staging_len()), (16 * PAGE, 8 * PAGE));
    agent.set_window(w).unwrap();
    (pool, staging)
}

/// Pages split in two runs: 1 KiB every 3 KiB in `a`, 3 KiB back to back in `b`.
struct Memory {
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Memory {
    fn new() -> Self {
        Memory {
            a: vec![0; (3072 * (SLOTS as u64 - 1) + 1024) as usize],
            b: vec![0; (3072 * SLOTS as u64) as usize],
        }
    }
    fn chunks(&mut self) -> Vec<Chunk> {
        vec![
            Chunk {
                kind: MemoryKind::Host,
                ptr: self.a.as_mut_ptr() as u64,
                stride: 3072,
                len: 1024,
            },
            Chunk {
                kind: MemoryKind::Host,
                ptr: self.b.as_mut_ptr() as u64,
                stride: 3072,
                len: 3072,
            },
        ]
    }
    fn page(&self, slot: u64) -> Vec<u8> {
        let (a, b) = ((slot * 3072) as usize, (slot * 3072) as usize);
        [&self.a[a..a + 1024], &self.b[b..b + 3072]].concat()
    }
}

fn run(
    agent: &mut CopyAgent,
    copy: u64,
    direction: AgentDirection,
    pages: Vec<AgentPageCopy>,
) -> Option<CopyFailure> {
    assert!(agent.handle(&Event::AgentCopy {
        copy,
        direction,
        pages
    }));
    let mut out = Vec::new();
    assert!(agent.drain(Duration::from_secs(10), &mut out));
    assert_eq!(out.len(), 1, "{out:?}");
    match out.pop().unwrap() {
        Command::CopyDone {
            copy: c, failure, ..
        } => {
            assert_eq!(c, copy);
            failure
        }
        other => panic!("{other:?}"),
    }
}

fn page(host_offset: u64, region: u32, slot: u64) -> AgentPageCopy {
    AgentPageCopy {
        host_offset,
        region,
        region_offset: slot * PAGE,
        len: PAGE,
        checksum: None,
    }
}

#[test]
fn restored_pool_pages_are_verified_against_their_checksums() {
    let mut a = agent();
    let (pool, _staging) = window(&mut a);
    let mut mem = Memory::new();
    let (region, _) = unsafe { a.attach(SLOTS, &mem.chunks()) }.unwrap();
    let sum =
        |n: u64| xxhash_rust::xxh3::xxh3_64(&pool[(n * PAGE) as usize..((n + 1) * PAGE) as usize]);
    let good = AgentPageCopy {
        checksum: Some(sum(2)),
        ..page(2 * PAGE, region, 0)
    };
    assert_eq!(
        run(&mut a, 1, AgentDirection::PoolToRegion, vec![good]),
        None
    );
    assert_eq!(mem.page(0), pool[2 * PAGE as usize..3 * PAGE as usize]);
    // The bytes in the pool are not what the page's checksum says.
    let bad = AgentPageCopy {
        checksum: Some(sum(2) ^ 1),
        ..page(2 * PAGE, region, 1)
    };
    let f = run(&mut a, 2, AgentDirection::PoolToRegion, vec![good, bad]);
    assert_eq!(f, Some(CopyFailure::Checksum(2 * PAGE)));
}

#[test]
fn a_page_verified_in_the_copy_pass_is_named_by_its_pool_offset() {
    // The host engine verifies each restored page while it copies it, its
    // two runs hashed as one chain: a byte altered in either run of the
    // middle page fails the copy, named by that page's pool offset.
    for (which, at) in [("first", 10), ("second", 1024 + 2000)] {
        let mut a = agent();
        let (mut pool, _staging) = window(&mut a);
        let mut mem = Memory::new();
        let (region, _) = unsafe { a.attach(SLOTS, &mem.chunks()) }.unwrap();
        let sum = |pool: &[u8], n: u64| {
            xxhash_rust::xxh3::xxh3_64(&pool[(n * PAGE) as usize..((n + 1) * PAGE) as usize])
        };
        let pages: Vec<AgentPageCopy> = [3, 5, 7]
            .iter()
            .enumerate()
            .map(|(slot, &n)| AgentPageCopy {
                checksum: Some(sum(&pool, n)),
                ..page(n * PAGE, region, slot as u64)
            })
            .collect();
        assert_eq!(
            run(&mut a, 1, AgentDirection::PoolToRegion, pages.clone()),
            None,
            "{which}"
        );
        for (slot, n) in [3u64, 5, 7].iter().enumerate() {
            let want = &pool[(n * PAGE) as usize..((n + 1) * PAGE) as usize];
            assert_eq!(mem.page(slot as u64), want, "{which}: page {n}");
        }
        pool[(5 * PAGE) as usize + at] ^= 0x40;
        let f = run(&mut a, 2, AgentDirection::PoolToRegion, pages);
        assert_eq!(f, Some(CopyFailure::Checksum(5 * PAGE)), "{which} run");
    }
}

#[test]
fn pages_move_exactly_through_chunked_regions() {
    let mut a = agent();
    let (pool, staging) = window(&mut a);
    let mut mem = Memory::new();
    let (region, page_bytes) = unsafe { a.attach(SLOTS, &mem.chunks()) }.unwrap();
    assert_eq!(page_bytes, PAGE);
    // Restore pool pages 3 and 5 into slots 1 and 2.
    let f = run(
        &mut a,
        1,
        AgentDirection::PoolToRegion,
        vec![page(3 * PAGE, region, 1), page(5 * PAGE, region, 2)],
    );
    assert_eq!(f, None);
    assert_eq!(mem.page(1), pool[3 * PAGE as usize..4 * PAGE as usize]);
    assert_eq!(mem.page(2), pool[5 * PAGE as usize..6 * PAGE as usize]);
    assert_eq!(
        mem.page(0),
        vec![0; PAGE as usize],
        "untargeted slots untouched"
    );
    // Publish slot 2 into staging offset PAGE: the staging area has it, the pool is unchanged.
    let before = pool.to_vec();
    let f = run(
        &mut a,
        2,
        AgentDirection::RegionToStaging,
        vec![page(PAGE, region, 2)],
    );
    assert_eq!(f, None);
    assert_eq!(staging[PAGE as usize..2 * PAGE as usize], mem.page(2)[..]);
    assert_eq!(pool[..], before[..]);
    // Detached: later copies fail.
    assert!(a.detach(region));
    let f = run(
        &mut a,
        3,
        AgentDirection::PoolToRegion,
        vec![page(0, region, 0)],
    );
    assert_eq!(f, Some(CopyFailure::UnknownRegion(region)));
}

#[test]
fn bad_copies_are_typed_failures_and_touch_nothing() {
    let mut a = agent();
    let mut mem = Memory::new();
    let (region, _) = unsafe { a.attach(SLOTS, &mem.chunks()) }.unwrap();
    // No window yet: the agent cannot run anything.
    let f = run(
        &mut a,
        1,
        AgentDirection::PoolToRegion,
        vec![page(0, region, 0)],
    );
    assert_eq!(f, Some(CopyFailure::Shutdown));
    let (_pool, staging) = window(&mut a);
    let cases = [
        (
            AgentDirection::PoolToRegion,
            page(0, region + 1, 0),
            "unknown_region",
        ),
        (
            AgentDirection::PoolToRegion,
            page(0, region, SLOTS as u64),
            "out_of_bounds",
        ),
        (
            AgentDirection::PoolToRegion,
            page(16 * PAGE - 1, region, 0),
            "out_of_bounds",
        ),
        (
            AgentDirection::PoolToRegion,
            page(u64::MAX - 10, region, 0),
            "out_of_bounds",
        ),
        // Staging offsets are bounded by the staging area, never the pool's.
        (
            AgentDirection::RegionToStaging,
            page(8 * PAGE, region, 0),
            "out_of_bounds",
        ),
        (
            AgentDirection::PoolToRegion,
            AgentPageCopy {
                host_offset: 0,
                region,
                region_offset: 100,
                len: PAGE,
                checksum: None,
            },
            "out_of_bounds",
        ),
        (
            AgentDirection::PoolToRegion,
            AgentPageCopy {
                host_offset: 0,
                region,
                region_offset: 0,
                len: PAGE / 2,
                checksum: None,
            },
            "out_of_bounds",
        ),
    ];
    for (n, (dir, p, kind)) in cases.into_iter().enumerate() {
        // A good page first: the whole batch is refused, nothing of it runs.
        let f = run(&mut a, 10 + n as u64, dir, vec![page(0, region, 3), p]);
        assert_eq!(f.as_ref().map(|f| f.kind()), Some(kind), "case {n}: {f:?}");
    }
    assert!((0..SLOTS as u64).all(|s| mem.page(s) == vec![0; PAGE as usize]));
    assert!(staging.iter().all(|&b| b == 0));
    let f = run(&mut a, 99, AgentDirection::PoolToRegion, vec![]);
    assert_eq!(f.map(|f| f.kind()), Some("out_of_bounds"));
}

#[test]
fn bad_layouts_are_refused_at_attach() {
    let mut a = agent();
    let mut buf = vec![0u8; 64 << 10];
    let ptr = buf.as_mut_ptr() as u64;
    let chunk = |ptr, stride, len| Chunk {
        kind: MemoryKind::Host,
        ptr,
        stride,
        len,
    };
    for (slots, chunks) in [
        (0, vec![chunk(ptr, 4096, 4096)]),
        (4, vec![]),
        (4, vec![chunk(ptr, 1024, 4096)]),
        (4, vec![chunk(0, 4096, 4096)]),
        (4, vec![chunk(ptr, 4096, 0)]),
        (4, vec![chunk(u64::MAX - 100, 4096, 4096)]),
    ] {
        let r = unsafe { a.attach(slots, &chunks) };
        assert!(
            matches!(r, Err(AgentError::Layout(_))),
            "{slots} {chunks:?}: {r:?}"
        );
    }
    // CUDA memory on the host executor: refused by the executor.
    let cuda = Chunk {
        kind: MemoryKind::Cuda { device: 0 },
        ptr,
        stride: 4096,
        len: 4096,
    };
    let r = unsafe { a.attach(4, &[chunk(ptr, 4096, 4096), cuda]) };
    assert!(matches!(r, Err(AgentError::Executor(_))), "{r:?}");
    // The good chunk attached before the refusal was let go: ids start over cleanly.
    let (id, bytes) = unsafe { a.attach(4, &[chunk(ptr, 4096, 4096)]) }.unwrap();
    assert_eq!((id, bytes), (0, 4096));
    drop(buf);
}

#[test]
fn a_read_only_pool_descriptor_is_enough_for_the_window() {
    let mut a = agent();
    let (pool_file, _pool) = shared_memory("ro-pool", 4 * PAGE).unwrap();
    let (staging_file, _staging) = shared_memory("ro-staging", 4 * PAGE).unwrap();
    // A pool descriptor that only allows reading still maps: the agent never asks for more.
    let path = format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&pool_file)
    );
    let ro = std::fs::File::open(path).unwrap();
    let w = HostWindow::map(&ro, 4 * PAGE, &staging_file, 4 * PAGE).unwrap();
    a.set_window(w).unwrap();
    assert!(a.has_window());
}

/// Issue 23: a publish's `CopyDone` carries each page's checksum, taken
/// from the engine's memory chunk after chunk while the host executor
/// copied it, equal to the page checksum of the staged page. A batch over
/// a megabyte is split across the executor's workers, never inside a
/// page.
#[test]
fn a_publish_reports_each_pages_checksum_from_its_source() {
    const SLOTS: u32 = 600; // 600 pages of 4 KiB in two chunks: 2.4 MiB
    let mut a = CopyAgent::new(Box::new(HostCopyEngine::new(HostCopyConfig {
        workers: 4,
        ..HostCopyConfig::default()
    })));
    let (pool_file, _pool) = shared_memory("test-pool", 16 * PAGE).unwrap();
    let staging_bytes = u64::from(SLOTS) * PAGE;
    let (staging_file, staging) = shared_memory("test-staging", staging_bytes).unwrap();
    let w = HostWindow::map(&pool_file, 16 * PAGE, &staging_file, staging_bytes).unwrap();
    a.set_window(w).unwrap();
    // 1 KiB every 3 KiB, then 3 KiB back to back, as `Memory` lays them.
    let mut first: Vec<u8> = (0..3072 * SLOTS as usize)
        .map(|i| (i * 13 + 5) as u8)
        .collect();
    let mut second: Vec<u8> = (0..3072 * SLOTS as usize)
        .map(|i| (i * 31 + i / 977) as u8)
        .collect();
    let chunks = [
        Chunk {
            kind: MemoryKind::Host,
            ptr: first.as_mut_ptr() as u64,
            stride: 3072,
            len: 1024,
        },
        Chunk {
            kind: MemoryKind::Host,
            ptr: second.as_mut_ptr() as u64,
            stride: 3072,
            len: 3072,
        },
    ];
    let (region, _) = unsafe { a.attach(SLOTS, &chunks) }.unwrap();
    // Staged in reverse slot order, so page n of the copy is slot 599 - n.
    let pages: Vec<AgentPageCopy> = (0..u64::from(SLOTS))
        .map(|n| page(n * PAGE, region, u64::from(SLOTS) - 1 - n))
        .collect();
    assert!(a.handle(&Event::AgentCopy {
        copy: 7,
        direction: AgentDirection::RegionToStaging,
        pages,
    }));
    let mut out = Vec::new();
    assert!(a.drain(Duration::from_secs(10), &mut out));
    let Some(Command::CopyDone {
        copy: 7,
        failure: None,
        checksums,
    }) = out.pop()
    else {
        panic!("{out:?}");
    };
    assert_eq!(checksums.len(), SLOTS as usize);
    for (n, sum) in checksums.iter().enumerate() {
        let slot = SLOTS as usize - 1 - n;
        let source = [
            &first[slot * 3072..slot * 3072 + 1024],
            &second[slot * 3072..slot * 3072 + 3072],
        ]
        .concat();
        let staged = &staging[n * PAGE as usize..(n + 1) * PAGE as usize];
        assert_eq!(staged, &source[..], "page {n}");
        assert_eq!(*sum, xxhash_rust::xxh3::xxh3_64(&source), "page {n}");
    }
    drop(a);
}
