//! Helpers shared by the SSD store tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use orbitkv_components::{Namespace, StateKey};
use orbitkv_io::dram::{HostPool, HostPoolConfig};
use orbitkv_io::ssd::{
    BackendKind, IoBackend, RecordInfo, SsdConfig, SsdStore, WriteDone, WriteRefused,
};
use orbitkv_io::tier::{BackingTier, ReadDone, TierError};

/// Both engines; every parity test runs over this list.
pub const BACKENDS: [IoBackend; 2] = [IoBackend::Blocking, IoBackend::IoUring];

pub const DIGEST: [u8; 32] = [0xd1; 32];

pub fn key(i: u64) -> StateKey {
    StateKey::new(Namespace([7; 32]), 3, &i.to_le_bytes()).unwrap()
}

/// The `i` of a key made by [`key`].
pub fn key_index(k: &StateKey) -> u64 {
    u64::from_le_bytes(k.native.as_bytes().try_into().unwrap())
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Deterministic bytes of page `i` (the crash helper uses the same).
pub fn payload(i: u64, len: usize) -> Vec<u8> {
    let mut s = mix(i.wrapping_add(0x9e37_79b9_7f4a_7c15));
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Page length of the crash helper's page `i`.
pub fn crash_len(i: u64) -> usize {
    1 + (mix(i) % 24_576) as usize
}

/// Small segments so that tests cross segment boundaries.
pub fn config(dir: &Path, backend: IoBackend) -> SsdConfig {
    SsdConfig {
        backend,
        segment_bytes: 2 << 20,
        capacity_bytes: 128 << 20,
        ..SsdConfig::new(dir)
    }
}

pub fn open(dir: &Path, backend: IoBackend) -> SsdStore {
    // A reopen right after a drop can find the directory's `flock` still
    // held for a moment: another test of this binary forking `mount`
    // copies every descriptor, the lock's included, until its exec closes
    // them (O_CLOEXEC). That child is not a store; wait it out, bounded.
    let mut tries = 0;
    let s = loop {
        match SsdStore::open(config(dir, backend)) {
            Err(orbitkv_io::ssd::SsdError::Locked { .. }) if tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => break other.expect("open"),
        }
    };
    let want = match backend {
        IoBackend::Blocking => BackendKind::Blocking,
        _ => BackendKind::IoUring,
    };
    assert_eq!(s.backend(), want);
    s
}

/// Writes every page (retrying on a full queue) and waits until all are
/// reported; asserts each succeeded.
pub fn write_all(store: &mut SsdStore, pages: &[(StateKey, Vec<u8>)]) {
    let mut done: Vec<WriteDone> = Vec::new();
    for (k, bytes) in pages {
        let mut spins = 0;
        loop {
            match store.submit_write(k, DIGEST, bytes, 0) {
                Ok(_) => break,
                Err(WriteRefused::QueueFull) => {
                    store.poll_writes(0, &mut done);
                    spins += 1;
                    assert!(spins < 1_000_000, "write queue never drained");
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(e) => panic!("write refused: {e}"),
            }
        }
    }
    done.extend(store.wait_writes(0));
    assert_eq!(done.len(), pages.len());
    for d in &done {
        assert_eq!(d.result, Ok(()), "{:?}", d.key);
    }
}

/// Writes each page alone, waiting for it before the next: every record
/// gets a header block of its own (pages submitted together are written as
/// groups).
pub fn write_each(store: &mut SsdStore, pages: &[(StateKey, Vec<u8>)]) {
    for p in pages {
        write_all(store, std::slice::from_ref(p));
        let info = store.record_info(&p.0).expect("written");
        assert!(!info.grouped, "a record written alone is not grouped");
    }
}

/// Asserts records are packed at the store's block `blk`: a header block
/// (a record's own, or one shared by a group written together), then each
/// payload rounded up to the block. `infos`: each record and its length.
pub fn assert_packed(mut infos: Vec<(RecordInfo, u64)>, blk: u64) {
    infos.sort_by_key(|(r, _)| (r.segment_id, r.payload_offset));
    for w in infos.windows(2) {
        let ((a, alen), (c, _)) = (&w[0], &w[1]);
        assert_eq!((a.block, a.offset % blk), (blk, 0));
        let a_end = a.payload_offset + alen.div_ceil(blk) * blk;
        if a.segment_id != c.segment_id {
            continue;
        }
        if c.grouped && c.offset == a.offset {
            // The next record of the same group.
            assert!(a.grouped);
            assert_eq!(c.payload_offset, a_end);
        } else {
            // A new record or group starts with its header block.
            assert_eq!((c.offset, c.payload_offset), (a_end, a_end + blk));
        }
    }
}

/// A host pool registered with a store.
pub struct Pool {
    pub pool: HostPool,
    /// Reads reaped while waiting for another one.
    done: Vec<ReadDone>,
}

impl Pool {
    pub fn new(store: &mut SsdStore, bytes: u64) -> Pool {
        let mut pool = HostPool::new(HostPoolConfig {
            // Slab extents are never returned to other classes: leave room
            // for one 2 MiB extent per page size a test uses.
            capacity_bytes: bytes.max(64 << 20),
            extent_bytes: 2 << 20,
            slot_align: 4096,
            shared: false,
        })
        .unwrap();
        // SAFETY: the pool outlives every read in these tests (reads are
        // polled to completion before the pool is dropped), and the store
        // is dropped before the pool in every test.
        unsafe { store.register_host_pool(pool.base_ptr(), pool.capacity()) }.unwrap();
        Pool {
            pool,
            done: Vec::new(),
        }
    }

    /// Polls until the read `token` finishes (hang guard, not a timing
    /// assertion).
    pub fn wait(&mut self, store: &mut SsdStore, token: orbitkv_io::tier::ReadToken) -> ReadDone {
        for _ in 0..2_000_000 {
            store.poll(0, &mut self.done);
            if let Some(i) = self.done.iter().position(|d| d.token == token) {
                return self.done.swap_remove(i);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        panic!("read never completed");
    }

    /// Reads `key` (of `len` bytes) into a fresh slot; returns its bytes.
    pub fn read(
        &mut self,
        store: &mut SsdStore,
        key: &StateKey,
        len: u64,
    ) -> Result<Vec<u8>, TierError> {
        let slot = self.pool.alloc(len).unwrap();
        let off = self.pool.offset(slot).unwrap();
        let token = match store.submit_read(key, off, len, 0) {
            Ok(t) => t,
            Err(e) => {
                self.pool.free(slot).unwrap();
                return Err(e);
            }
        };
        let done = self.wait(store, token);
        let r = done
            .result
            .map(|()| self.pool.bytes(slot, len).unwrap().to_vec());
        self.pool.free(slot).unwrap();
        r
    }
}

/// Flips one byte of a file in place.
pub fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

/// A tmpfs mounted for one test, unmounted on drop. `None` where mounting
/// is not permitted (not root, no CAP_SYS_ADMIN).
pub struct Mount(pub std::path::PathBuf);

impl Mount {
    pub fn tmpfs(at: &Path, opts: &str) -> Option<Mount> {
        std::fs::create_dir_all(at).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(at)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then(|| Mount(at.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
