//! Crash safety: a child process publishes pages and prints each key whose
//! write was reported complete; the parent SIGKILLs it at a random moment,
//! reopens the store and checks that every reported page is served with
//! exact bytes and that every indexed page verifies (no torn or corrupt
//! page is ever served). The store directory is shared by all iterations,
//! so later iterations also recover the segments of earlier crashes.
//!
//! Set ORBITKV_CRASH_SEED to replay a run's kill points.

mod ssd_common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdStore};
use orbitkv_io::tier::BackingTier;
use ssd_common::*;

const ITERATIONS: u64 = 30;
const MIN_ITERATIONS: u64 = 20;
/// Total time the loop may take (checked between iterations).
const BUDGET: Duration = Duration::from_secs(20);
/// At most 4000 records of at most 28 KiB (header block + padded payload):
/// one child's writes fit within the 128 MiB capacity with room for a
/// segment, so FIFO collection only ever drops earlier children's pages,
/// never a page this child reported. The kill comes 2-82 ms in, usually
/// mid-stream.
const WRITES_PER_CHILD: u64 = 4000;

/// Reads every key in `keys`, up to 32 at a time, and checks its bytes
/// against the generator. Returns how many were checked.
fn verify_all(
    store: &mut SsdStore,
    pool: &mut Pool,
    keys: &[orbitkv_components::StateKey],
) -> usize {
    let mut n = 0;
    for batch in keys.chunks(32) {
        let mut inflight = Vec::new();
        for k in batch {
            let i = key_index(k);
            let len = crash_len(i) as u64;
            let entry = store.lookup(k).expect("indexed");
            assert_eq!(entry.bytes, len, "page {i}: length");
            let slot = pool.pool.alloc(len).unwrap();
            let t = store
                .submit_read(k, pool.pool.offset(slot).unwrap(), len, 0)
                .unwrap();
            inflight.push((t, slot, i, len));
        }
        for (t, slot, i, len) in inflight {
            let done = pool.wait(store, t);
            assert_eq!(done.result, Ok(()), "page {i}: read must verify");
            assert!(
                pool.pool.bytes(slot, len).unwrap() == payload(i, len as usize),
                "page {i}: wrong bytes served"
            );
            pool.pool.free(slot).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
fn sigkill_during_publish_loses_nothing_reported() {
    let seed = std::env::var("ORBITKV_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        });
    eprintln!("ORBITKV_CRASH_SEED={seed}");
    let mut rng = seed;
    let mut next_rand = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_ssd_crash_writer");
    let start = Instant::now();
    let (mut iterations, mut reported_total, mut verified_total, mut skipped_total) = (0, 0, 0, 0);
    for it in 0..ITERATIONS {
        if it >= MIN_ITERATIONS && start.elapsed() > BUDGET {
            break;
        }
        let backend = if it % 2 == 0 { "blocking" } else { "io_uring" };
        let mut child = Command::new(bin)
            .arg(dir.path())
            .arg(backend)
            .arg((it * 1_000_000).to_string())
            .arg(WRITES_PER_CHILD.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn crash writer");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let ready = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("child printed nothing");
        assert!(ready.starts_with("ready"), "{ready}");
        let delay = Duration::from_millis(2 + next_rand() % 80);
        std::thread::sleep(delay);
        child.kill().expect("SIGKILL");
        let status = child.wait().unwrap();
        reader.join().unwrap();
        let mut reported = Vec::new();
        for line in rx.try_iter() {
            if let Some(i) = line.strip_prefix("ok ") {
                reported.push(i.parse::<u64>().unwrap());
            } else {
                panic!("child reported: {line}");
            }
        }

        let reopen = if it % 3 == 0 {
            IoBackend::IoUring
        } else {
            IoBackend::Blocking
        };
        let cfg = SsdConfig {
            backend: reopen,
            segment_bytes: 1 << 20,
            capacity_bytes: 128 << 20,
            ..SsdConfig::new(dir.path())
        };
        let mut store = SsdStore::open(cfg).expect("reopen after SIGKILL");
        let scan = store.stats().open_scan;
        let mut pool = Pool::new(&mut store, 64 << 20);
        let indexed: HashSet<_> = store.keys().into_iter().collect();
        for &i in &reported {
            assert!(
                indexed.contains(&key(i)),
                "iteration {it} (seed {seed}): page {i} was reported durable but is gone"
            );
        }
        let keys: Vec<_> = indexed.into_iter().collect();
        let verified = verify_all(&mut store, &mut pool, &keys);
        drop(store);
        eprintln!(
            "iteration {it}: {backend}, killed after {delay:?} ({status}), {} reported, {verified} indexed pages verified, {} skipped at open",
            reported.len(),
            scan.corrupt_skipped
        );
        iterations += 1;
        reported_total += reported.len();
        verified_total += verified;
        skipped_total += scan.corrupt_skipped;
    }
    eprintln!(
        "crash test: {iterations} iterations, {reported_total} pages reported before SIGKILL, all present; {verified_total} page reads verified; {skipped_total} torn/corrupt regions skipped"
    );
    assert!(iterations >= MIN_ITERATIONS);
    assert!(reported_total > 0, "the child never completed a write");
}
