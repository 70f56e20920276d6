//! Resource errors: missing, non-directory and read-only directories, and a
//! filesystem that runs out of space. Typed errors, never a panic, never a
//! wrong byte.
//!
//! The read-only and ENOSPC cases mount small tmpfs filesystems, which
//! needs root (CAP_SYS_ADMIN), as on the project's machines and CI. Where
//! mounting is refused the test says so on stderr and checks what it can
//! (`chmod 0555` for a non-root user). tmpfs accepts O_DIRECT since Linux
//! 6.6; on older kernels the store falls back to buffered I/O there
//! (`direct_io: false` in stats), which these tests print.

mod ssd_common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use orbitkv_io::checksum::page_checksum;
use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdError, SsdStore, WriteError, WriteRefused};
use orbitkv_io::tier::{BackingTier, DemoteFailed};
use ssd_common::*;

fn is_root() -> bool {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn missing_directory_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a/b/c");
    let store = SsdStore::open(config(&dir, IoBackend::Auto)).unwrap();
    assert!(dir.is_dir());
    drop(store);
}

#[test]
fn directory_under_a_file_is_a_typed_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    for dir in [file.join("sub"), file.join("sub/deeper"), file.clone()] {
        let r = SsdStore::open(config(&dir, IoBackend::Blocking));
        assert!(
            matches!(r, Err(SsdError::NotADirectory { .. })),
            "{dir:?}: {r:?}"
        );
    }
}

#[test]
fn read_only_directory_is_a_typed_error() {
    let tmp = tempfile::tempdir().unwrap();
    if !is_root() {
        let dir = tmp.path().join("ro");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let r = SsdStore::open(config(&dir, IoBackend::Blocking));
        assert!(matches!(r, Err(SsdError::PermissionDenied { .. })), "{r:?}");
        return;
    }
    // Root ignores mode bits: a read-only filesystem is the honest test.
    let empty = tmp.path().join("empty-ro");
    let Some(_m) = Mount::tmpfs(&empty, "ro,size=1m") else {
        eprintln!("SKIPPED read-only checks: running as root but mount(2) is not permitted");
        return;
    };
    let r = SsdStore::open(config(&empty, IoBackend::Blocking));
    assert!(matches!(r, Err(SsdError::ReadOnly { .. })), "{r:?}");
    // A missing directory below a read-only mount cannot be created.
    let r = SsdStore::open(config(&empty.join("sub"), IoBackend::Blocking));
    assert!(matches!(r, Err(SsdError::ReadOnly { .. })), "{r:?}");

    // A store with data whose filesystem has become read-only.
    let full = tmp.path().join("was-rw");
    let m = Mount::tmpfs(&full, "size=8m").expect("second mount");
    {
        let mut store = SsdStore::open(SsdConfig {
            segment_bytes: 1 << 20,
            capacity_bytes: 4 << 20,
            ..config(&full, IoBackend::Blocking)
        })
        .unwrap();
        write_all(&mut store, &[(key(1), payload(1, 5000))]);
    }
    let ok = std::process::Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&m.0)
        .status()
        .unwrap()
        .success();
    assert!(ok, "remount read-only");
    let r = SsdStore::open(config(&full, IoBackend::Blocking));
    assert!(matches!(r, Err(SsdError::ReadOnly { .. })), "{r:?}");
}

/// A 1 MiB tmpfs holds four 256 KiB segments (preallocated). Writing 3 MiB
/// makes segment creation fail with ENOSPC: the store drops its oldest
/// segment (eviction reason `no_space`) and goes on; nothing panics, every
/// write is reported, and every indexed page reads back exactly.
fn enospc(backend: IoBackend) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("small");
    let Some(_m) = Mount::tmpfs(&dir, "size=1m") else {
        eprintln!("SKIPPED ENOSPC test: mount(2) is not permitted here");
        return;
    };
    let cfg = SsdConfig {
        segment_bytes: 256 << 10,
        capacity_bytes: 64 << 20, // far beyond the filesystem
        ..config(&dir, backend)
    };
    let mut store = SsdStore::open(cfg.clone()).unwrap();
    eprintln!("tmpfs: direct_io = {}", store.direct_io());
    let mut done = Vec::new();
    let mut accepted = 0;
    let mut now = 0u64;
    for i in 0..200u64 {
        loop {
            now += 1;
            match store.submit_write(&key(i), DIGEST, &payload(i, 16_000), now) {
                Ok(_) => {
                    accepted += 1;
                    break;
                }
                Err(WriteRefused::QueueFull) => {
                    store.poll_writes(now, &mut done);
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(WriteRefused::NoSpace) => break,
                Err(e) => panic!("unexpected refusal {e}"),
            }
        }
        store.poll_writes(now, &mut done);
    }
    done.extend(store.wait_writes(now));
    assert_eq!(done.len(), accepted, "every accepted write is reported");
    for d in &done {
        match &d.result {
            Ok(()) | Err(WriteError::NoSpace) => {}
            Err(e) => panic!("{:?}: {e}", d.key),
        }
    }
    let s = store.stats();
    eprintln!(
        "ENOSPC: {} ok, {} failed no_space, {} refused no_space, {} records evicted for no_space, {} segments",
        s.writes_completed,
        s.write_failures.no_space,
        s.refusals.no_space,
        s.evictions.no_space,
        s.segments
    );
    assert!(
        s.evictions.no_space + s.write_failures.no_space + s.refusals.no_space > 0,
        "3 MiB into a 1 MiB filesystem must hit ENOSPC: {s:?}"
    );
    assert!(s.writes_completed > 0);
    let mut pool = Pool::new(&mut store, 64 << 20);
    let keys = store.keys();
    assert_eq!(keys.len() as u64, s.records);
    for k in &keys {
        let i = key_index(k);
        // Under ENOSPC the store keeps trying to preallocate its next
        // segment in the background and may evict the oldest one meanwhile
        // (reason `no_space`): a key can vanish between `keys()` and the
        // read. That is a miss, never wrong bytes.
        match pool.read(&mut store, k, 16_000) {
            Ok(bytes) => assert!(bytes == payload(i, 16_000), "wrong bytes for {k:?}"),
            Err(orbitkv_io::tier::TierError::NotFound) => assert!(store.record_info(k).is_none()),
            Err(e) => panic!("{k:?}: {e}"),
        }
    }
    drop(store);
    // Reopening a full filesystem works; stored pages stay readable.
    let mut store = SsdStore::open(cfg).expect("open on a full filesystem");
    let mut pool = Pool::new(&mut store, 64 << 20);
    // Keys still indexed after the first pass were all found again by the
    // scan, unless the reopened store's own segment preallocation hit
    // ENOSPC and evicted the oldest segment: never a key that was not there.
    let reopened: std::collections::HashSet<_> = store.keys().into_iter().collect();
    let before: std::collections::HashSet<_> = keys.iter().copied().collect();
    assert!(
        reopened.is_subset(&before),
        "the scan found keys that were never written"
    );
    for k in &keys {
        let i = key_index(k);
        // Under ENOSPC the store keeps trying to preallocate its next
        // segment in the background and may evict the oldest one meanwhile
        // (reason `no_space`): a key can vanish between `keys()` and the
        // read. That is a miss, never wrong bytes.
        match pool.read(&mut store, k, 16_000) {
            Ok(bytes) => assert!(bytes == payload(i, 16_000), "wrong bytes for {k:?}"),
            Err(orbitkv_io::tier::TierError::NotFound) => assert!(store.record_info(k).is_none()),
            Err(e) => panic!("{k:?}: {e}"),
        }
    }
    drop(store);
}

#[test]
fn enospc_blocking() {
    enospc(IoBackend::Blocking);
}

#[test]
fn enospc_io_uring() {
    enospc(IoBackend::IoUring);
}

/// A filesystem too small for even one segment: `open` still succeeds
/// (existing pages would stay readable), writes are refused with
/// `NoSpace` for a second of the caller's clock, and a write accepted after
/// that fails with `WriteError::NoSpace` once creation fails again.
#[test]
fn enospc_with_nothing_to_evict() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let Some(_m) = Mount::tmpfs(&dir, "size=128k") else {
        eprintln!("SKIPPED ENOSPC test: mount(2) is not permitted here");
        return;
    };
    for backend in BACKENDS {
        let cfg = SsdConfig {
            segment_bytes: 256 << 10,
            ..config(&dir, backend)
        };
        let mut store = SsdStore::open(cfg).expect("open on a full filesystem");
        assert_eq!(
            store.submit_write(&key(1), DIGEST, &[1; 100], 10),
            Err(WriteRefused::NoSpace)
        );
        let t = 10 + 2_000_000;
        store.submit_write(&key(1), DIGEST, &[1; 100], t).unwrap();
        let done = store.wait_writes(t);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].result, Err(WriteError::NoSpace));
        assert!(store.lookup(&key(1)).is_none());
        let s = store.stats();
        assert_eq!(s.refusals.no_space, 1);
        assert_eq!(s.write_failures.no_space, 1);
        assert_eq!(s.records, 0);
        // The same through the tier interface: the demotion is accepted,
        // then reported as a typed failure.
        let t = t + 2_000_000;
        let page = [2u8; 100];
        BackingTier::demote(&mut store, &key(2), DIGEST, &page, page_checksum(&page), t).unwrap();
        let mut failed = Vec::new();
        for _ in 0..1000 {
            store.poll_demotions(t, &mut failed);
            if !failed.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(failed, vec![Err(DemoteFailed::NoSpace)]);
        drop(store);
    }
}
