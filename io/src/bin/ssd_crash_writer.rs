//! Crash-test helper for `tests/ssd_crash.rs`: opens an SSD store and
//! publishes deterministic pages in a loop, printing `ok <i>` for each page
//! whose write was reported complete (durable and visible) — until it is
//! killed, or after `limit` pages.
//!
//! Usage: `ssd_crash_writer <dir> <blocking|io_uring> <first index> <limit>`
//!
//! Page `i`: key `StateKey(namespace [7; 32], group 3, native i as 8 LE
//! bytes)`, length `1 + mix(i) % 24576`, bytes from an xorshift stream
//! seeded by `i` (the test regenerates both). Even pages are demoted in
//! place from a registered host pool (the runtime's path: carried
//! checksum, the slot freed when its token is released), odd pages go
//! through `submit_write` (copy and hash).

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use orbitkv_components::{Namespace, StateKey};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::dram::{HostPool, HostPoolConfig};
use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdStore, WriteRefused};
use orbitkv_io::tier::{BackingTier, DemoteRefused, Demoted};

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn payload(i: u64, len: usize) -> Vec<u8> {
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: ssd_crash_writer <dir> <blocking|io_uring> <first> <limit>");
        std::process::exit(2);
    }
    let backend = match args[2].as_str() {
        "blocking" => IoBackend::Blocking,
        "io_uring" => IoBackend::IoUring,
        other => {
            eprintln!("unknown backend {other}");
            std::process::exit(2);
        }
    };
    let (Ok(first), Ok(limit)) = (args[3].parse::<u64>(), args[4].parse::<u64>()) else {
        eprintln!("bad numbers");
        std::process::exit(2);
    };
    let cfg = SsdConfig {
        backend,
        segment_bytes: 1 << 20,
        capacity_bytes: 128 << 20,
        max_inflight_io: 32,
        write_queue_depth: 32,
        ..SsdConfig::new(&args[1])
    };
    let mut store = match SsdStore::open(cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("open: {e}");
            std::process::exit(1);
        }
    };
    let mut pool = match HostPool::new(HostPoolConfig::new(64 << 20)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("pool: {e}");
            std::process::exit(1);
        }
    };
    // SAFETY: the pool outlives the store (the store is dropped first, at
    // the end of main, and Drop waits for writes in flight); a slot is
    // written only before its demotion and freed only once released.
    if let Err(e) = unsafe { store.register_host_pool(pool.base_ptr(), pool.capacity()) } {
        eprintln!("register pool: {e}");
        std::process::exit(1);
    }
    let mut held = HashMap::new();
    let mut released = Vec::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = writeln!(out, "ready {}", store.stats().records);
    let _ = out.flush();
    let ns = Namespace([7; 32]);
    let start = Instant::now();
    let mut next = first;
    let mut done = Vec::new();
    let mut t = 0u64;
    while next < first + limit && start.elapsed() < Duration::from_secs(30) {
        t += 1;
        let key = StateKey::new(ns, 3, &next.to_le_bytes()).expect("valid key");
        let len = 1 + (mix(next) % 24_576) as usize;
        let bytes = payload(next, len);
        let outcome = if next % 2 == 0 {
            let Ok(slot) = pool.alloc(len as u64) else {
                eprintln!("pool exhausted");
                std::process::exit(1);
            };
            let Some(dst) = pool.bytes_mut(slot, len as u64) else {
                eprintln!("pool slot");
                std::process::exit(1);
            };
            dst.copy_from_slice(&bytes);
            let src = pool.bytes(slot, len as u64).unwrap_or_default();
            match store.demote(&key, [0xd1; 32], src, page_checksum(&bytes), t) {
                Ok(Demoted::InPlace(token)) => {
                    held.insert(token, slot);
                    Ok(())
                }
                Ok(Demoted::Copied) => {
                    let _ = pool.free(slot);
                    Ok(())
                }
                Err(e) => {
                    let _ = pool.free(slot);
                    Err(e == DemoteRefused::QueueFull)
                }
            }
        } else {
            match store.submit_write(&key, [0xd1; 32], &bytes, t) {
                Ok(_) => Ok(()),
                Err(e) => Err(e == WriteRefused::QueueFull),
            }
        };
        match outcome {
            Ok(()) => next += 1,
            Err(true) => std::thread::sleep(Duration::from_micros(100)),
            Err(false) => {
                eprintln!("refused {next}");
                next += 1;
            }
        }
        store.poll_writes(t, &mut done);
        store.poll_released(&mut released);
        for token in released.drain(..) {
            if let Some(slot) = held.remove(&token) {
                let _ = pool.free(slot);
            }
        }
        for d in done.drain(..) {
            let i = u64::from_le_bytes(d.key.native.as_bytes().try_into().expect("8 bytes"));
            let _ = match d.result {
                Ok(()) => writeln!(out, "ok {i}"),
                Err(e) => writeln!(out, "err {i} {e}"),
            };
        }
        let _ = out.flush();
    }
    for d in store.wait_writes(t) {
        let i = u64::from_le_bytes(d.key.native.as_bytes().try_into().expect("8 bytes"));
        if d.result.is_ok() {
            let _ = writeln!(out, "ok {i}");
        }
    }
    let _ = out.flush();
    drop(store);
    drop(pool);
}
