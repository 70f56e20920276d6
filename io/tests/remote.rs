//! The remote tier against real Redis: a single node and a 3-master
//! cluster (shared, from `scripts/redis.sh start`) and private nodes for
//! destructive faults. Every test is skipped, loudly, when
//! `ORBITKV_TEST_REDIS` is unset; `scripts/test.sh` always sets it.

mod remote_common;

use std::time::Duration;

use orbitkv_components::StateKey;
use orbitkv_components::api::MissReason;
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::remote::record::{
    RecordHeader, RecordMac, data_key, directory_key, encode_record, shard_of,
};
use orbitkv_io::remote::{RemoteConfig, RemoteTier, WritePolicy};
use orbitkv_io::tier::{BackingTier, DemoteRefused, TierError};
use redis::Commands;
use remote_common::*;

const PAGE: usize = 64 << 10;

/// Two tiers standing for two hosts: what A writes, B finds through its
/// directory and reads back byte for byte; B never hits for another
/// namespace with the same native hashes.
fn shares_pages_between_hosts(urls: Vec<String>) {
    let ns = fresh_namespace();
    let other = fresh_namespace();
    let mut pool_b = Pool::new(8 * PAGE);
    let mut a = RemoteTier::open(config(urls.clone()), 1).unwrap();
    let mut b = RemoteTier::open(config(urls), 2).unwrap();
    pool_b.register(&mut b);
    let pages: Vec<_> = (0..8u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    // B asks first: the namespace is new to it, so it misses and starts
    // following that namespace's directory.
    assert!(b.lookup(&pages[0].0).is_none());
    write_all(&mut a, &pages);
    for (i, (k, p)) in pages.iter().enumerate() {
        let e = wait_lookup(&b, k, Duration::from_secs(10)).expect("B learns A's page");
        assert_eq!(e.bytes, PAGE as u64);
        assert_eq!(e.checksum, page_checksum(p));
        let off = (i * PAGE) as u64;
        read(&mut b, k, off, PAGE as u64).unwrap();
        assert_eq!(&pool_b.0[i * PAGE..(i + 1) * PAGE], &p[..], "exact bytes");
    }
    // Another identity: same native hashes, another namespace.
    for i in 0..8u64 {
        let k = key(other, i);
        assert!(b.lookup(&k).is_none());
    }
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..8u64 {
        let k = key(other, i);
        assert!(b.lookup(&k).is_none(), "never a hit for another namespace");
        assert_eq!(
            b.submit_read(&k, 0, PAGE as u64, now_us()),
            Err(TierError::NotFound)
        );
    }
    let s = b.stats();
    assert_eq!(s.reads_ok, 8);
    assert_eq!(s.bytes_read, 8 * PAGE as u64);
    assert_eq!(s.read_errors.total(), 0);
    assert_eq!(b.in_flight(), 0);
    assert!(s.read_latency.count == 8);
    let sa = a.stats();
    assert_eq!(sa.writes_ok, 8);
    assert_eq!(sa.bytes_written, 8 * PAGE as u64);
    assert_eq!(a.writes_pending(), 0);
}

#[test]
fn single_node_shares_pages_between_hosts() {
    let Some(url) = single_url("single_node_shares_pages_between_hosts") else {
        return;
    };
    shares_pages_between_hosts(vec![url]);
}

#[test]
fn cluster_shares_pages_between_hosts() {
    let Some(urls) = cluster_urls("cluster_shares_pages_between_hosts") else {
        return;
    };
    let t = RemoteTier::open(config(urls.clone()), 9).unwrap();
    shares_pages_between_hosts(urls);
    // Auto mode found the cluster from its seeds.
    assert_eq!(t.stats().mode, "cluster");
}

/// Writes queued behind a busy writer go out as pipelines of at most
/// `write_batch_pages` records and `write_batch_bytes` bytes; every record
/// lands whole and is found and read back, byte for byte, by another host.
#[test]
fn queued_writes_go_out_in_bounded_pipelines() {
    let Some(_) = single_url("queued_writes_go_out_in_bounded_pipelines") else {
        return;
    };
    let r = PrivateRedis::node();
    let urls = r.urls();
    let ns = fresh_namespace();
    let mut cfg = config(urls.clone());
    cfg.write_workers = 1;
    cfg.write_batch_pages = 8;
    // Three pages fit; a fourth would pass the byte bound.
    cfg.write_batch_bytes = 3 * PAGE as u64 + 100;
    let mut a = RemoteTier::open(cfg, 1).unwrap();
    // Connected before the pause.
    write_all(&mut a, &[(key(ns, 1000), payload(1000, PAGE))]);
    let mut raw = raw_single(&urls[0]);
    // The writer's next pipeline waits in the server while the rest queue.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("ALL")
        .query(&mut raw)
        .unwrap();
    let pages: Vec<_> = (0..48u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    write_all(&mut a, &pages);
    let s = a.stats();
    assert_eq!(s.writes_ok, 49);
    assert_eq!(s.bytes_written, 49 * PAGE as u64);
    // 1 before the pause; then at most 3 per pipeline, and the writer took
    // at most one pipeline before the rest were queued.
    let batches = s.write_batches - 1;
    assert!(
        (16..=17).contains(&batches),
        "{batches} pipelines for 48 records"
    );
    let mut b = RemoteTier::open(config(urls), 2).unwrap();
    let mut pool = Pool::new(PAGE);
    pool.register(&mut b);
    assert!(b.lookup(&pages[0].0).is_none());
    for (k, p) in &pages {
        let e = wait_lookup(&b, k, Duration::from_secs(10)).expect("B learns every record");
        assert_eq!(e.checksum, page_checksum(p));
        read(&mut b, k, 0, PAGE as u64).unwrap();
        assert_eq!(&pool.0[..], &p[..], "exact bytes");
    }
}

#[test]
fn a_single_seed_of_a_cluster_is_detected() {
    let Some(urls) = cluster_urls("a_single_seed_of_a_cluster_is_detected") else {
        return;
    };
    // One seed: auto mode asks the node (INFO cluster).
    let ns = fresh_namespace();
    let mut t = RemoteTier::open(config(vec![urls[0].clone()]), 1).unwrap();
    let pages: Vec<_> = (0..6u64).map(|i| (key(ns, i), payload(i, 4096))).collect();
    write_all(&mut t, &pages);
    assert_eq!(t.stats().mode, "cluster");
    let mut pool = Pool::new(4096);
    pool.register(&mut t);
    for (k, p) in &pages {
        read(&mut t, k, 0, 4096).unwrap();
        assert_eq!(&pool.0[..], &p[..]);
    }
}

/// Faults on stored values: overwritten with other bytes, truncated,
/// rewritten with a valid record of other bytes (an owner that restarted),
/// deleted. Each read fails typed, leaves the destination untouched, and
/// drops the metadata entry.
fn value_faults(urls: Vec<String>, raw: &mut dyn redis::ConnectionLike) {
    let ns = fresh_namespace();
    let mut pool = Pool::new(PAGE);
    let mut t = RemoteTier::open(config(urls), 1).unwrap();
    pool.register(&mut t);
    let pages: Vec<_> = (0..4u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    write_all(&mut t, &pages);
    let prefix = t.config().key_prefix.clone();
    let dk = |i: usize| data_key(&prefix, &pages[i].0);

    // 0: other bytes.
    let _: () = redis::cmd("SET")
        .arg(dk(0))
        .arg(vec![7u8; PAGE + 120])
        .query(raw)
        .unwrap();
    // 1: truncated by one byte.
    let v: Vec<u8> = redis::cmd("GET").arg(dk(1)).query(raw).unwrap();
    let _: () = redis::cmd("SET")
        .arg(dk(1))
        .arg(&v[..v.len() - 1])
        .query(raw)
        .unwrap();
    // 2: a valid record of the same key with other bytes (a restarted
    // owner wrote again).
    let other = payload(99, PAGE);
    let h = RecordHeader {
        key: pages[2].0,
        format_digest: [4; 32],
        payload_len: PAGE as u64,
        payload_checksum: page_checksum(&other),
        payload_mac: test_mac().payload_mac(&other),
        writer: 77,
        written_unix_ms: 1,
        ttl_ms: 60_000,
    };
    let _: () = redis::cmd("SET")
        .arg(dk(2))
        .arg(encode_record(&h, &test_mac(), &other))
        .query(raw)
        .unwrap();
    // 3: gone.
    let _: () = redis::cmd("DEL").arg(dk(3)).query(raw).unwrap();

    let expect = [
        TierError::Corrupt,
        TierError::Corrupt,
        TierError::Corrupt,
        TierError::NotFound,
    ];
    for (i, want) in expect.iter().enumerate() {
        pool.0.fill(0xAB);
        assert_eq!(
            read(&mut t, &pages[i].0, 0, PAGE as u64),
            Err(want.clone()),
            "page {i}"
        );
        assert!(pool.0.iter().all(|b| *b == 0xAB), "no byte landed");
        assert!(t.lookup(&pages[i].0).is_none(), "metadata dropped");
    }
    assert_eq!(
        t.miss_reason(&TierError::Corrupt),
        MissReason::RemoteCorrupt
    );
    assert_eq!(
        t.miss_reason(&TierError::NotFound),
        MissReason::RemoteMissing
    );
    let s = t.stats();
    assert_eq!(s.read_errors.corrupt, 3);
    assert_eq!(s.read_errors.missing, 1);
    assert_eq!(s.reads_ok, 0);
    assert_eq!(t.in_flight(), 0);
}

#[test]
fn single_node_value_faults_are_typed_misses() {
    let Some(url) = single_url("single_node_value_faults_are_typed_misses") else {
        return;
    };
    let mut raw = raw_single(&url);
    value_faults(vec![url], &mut raw);
}

#[test]
fn cluster_value_faults_are_typed_misses() {
    let Some(urls) = cluster_urls("cluster_value_faults_are_typed_misses") else {
        return;
    };
    let mut raw = raw_cluster(&urls);
    value_faults(urls, &mut raw);
}

/// A node paused past the read deadline: the read is reported as a
/// timeout at its deadline; the late reply is dropped; nothing lands.
#[test]
fn slow_node_past_the_deadline_times_out() {
    let Some(_) = single_url("slow_node_past_the_deadline_times_out") else {
        return;
    };
    let r = PrivateRedis::node();
    let urls = r.urls();
    let ns = fresh_namespace();
    let mut pool = Pool::new(PAGE);
    let mut cfg = config(urls.clone());
    cfg.breaker_failures = 100; // keep the breaker out of this test
    let mut t = RemoteTier::open(cfg, 1).unwrap();
    pool.register(&mut t);
    let pages = vec![(key(ns, 1), payload(1, PAGE))];
    write_all(&mut t, &pages);
    let mut raw = raw_single(&urls[0]);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("ALL")
        .query(&mut raw)
        .unwrap();
    pool.0.fill(0xAB);
    let started = std::time::Instant::now();
    assert_eq!(
        read(&mut t, &pages[0].0, 0, PAGE as u64),
        Err(TierError::Timeout)
    );
    assert!(
        started.elapsed() < Duration::from_millis(1400),
        "reported at its deadline"
    );
    assert_eq!(t.in_flight(), 0);
    assert_eq!(
        t.miss_reason(&TierError::Timeout),
        MissReason::RemoteTimeout
    );
    // The worker returns after the pause; its reply is dropped.
    std::thread::sleep(Duration::from_millis(1600));
    let mut out = Vec::new();
    t.poll(now_us(), &mut out);
    assert!(out.is_empty(), "a late reply is never reported");
    assert!(pool.0.iter().all(|b| *b == 0xAB), "no byte landed");
    let s = t.stats();
    assert_eq!(s.read_errors.timeout, 1);
    assert_eq!(s.reads_abandoned, 0);
    // After the pause the same page reads fine.
    read(&mut t, &pages[0].0, 0, PAGE as u64).unwrap();
    assert_eq!(&pool.0[..], &pages[0].1[..]);
}

/// A node killed mid-read: the read fails (unavailable), the breaker opens,
/// lookups then answer absent and writes are refused; when a node is back
/// the health check closes the breaker.
#[test]
fn node_killed_mid_read_degrades_to_misses() {
    let Some(_) = single_url("node_killed_mid_read_degrades_to_misses") else {
        return;
    };
    let r = PrivateRedis::node();
    let urls = r.urls();
    let ns = fresh_namespace();
    let mut pool = Pool::new(PAGE);
    let mut t = RemoteTier::open(config(urls.clone()), 1).unwrap();
    pool.register(&mut t);
    let pages: Vec<_> = (0..4u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    write_all(&mut t, &pages);
    // Hold the read in the server, then kill it.
    let mut raw = raw_single(&urls[0]);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5000)
        .arg("ALL")
        .query(&mut raw)
        .unwrap();
    pool.0.fill(0xAB);
    let token = t
        .submit_read(&pages[0].0, 0, PAGE as u64, now_us())
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    r.kill(r.ports[0]);
    let res = wait_read(&mut t, token, Duration::from_secs(5)).unwrap();
    assert!(
        matches!(res, Err(TierError::Unavailable(_) | TierError::Timeout)),
        "{res:?}"
    );
    assert!(pool.0.iter().all(|b| *b == 0xAB));
    // More failures open the breaker.
    for (k, _) in &pages[1..] {
        if let Ok(tok) = t.submit_read(k, 0, PAGE as u64, now_us()) {
            let res = wait_read(&mut t, tok, Duration::from_secs(5)).unwrap();
            assert!(res.is_err());
        }
    }
    assert!(t.is_down(), "breaker open: {:?}", t.stats());
    assert!(t.lookup(&pages[1].0).is_none(), "lookups answer absent");
    assert_eq!(
        t.submit_read(&pages[1].0, 0, PAGE as u64, now_us()),
        Err(TierError::Unavailable("breaker open".into()))
    );
    assert_eq!(
        t.offer(&key(ns, 50), [0; 32], &[1; 10], page_checksum(&[1; 10])),
        Err(DemoteRefused::Unavailable)
    );
    assert_eq!(t.in_flight(), 0);
    assert!(pool.0.iter().all(|b| *b == 0xAB));
    // Back (empty): the health check closes the breaker; the old pages
    // are gone, which reads report as missing, never as bytes.
    r.restart_single(r.ports[0]);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while t.is_down() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!t.is_down(), "health check closed the breaker");
    assert_eq!(
        read(&mut t, &pages[1].0, 0, PAGE as u64),
        Err(TierError::NotFound)
    );
    assert!(t.stats().breaker_opens >= 1);
}

/// A remote that is down from the start is a tier that misses: open does
/// not fail, nothing panics, and it recovers when Redis comes up.
#[test]
fn down_at_start_then_up() {
    let Some(_) = single_url("down_at_start_then_up") else {
        return;
    };
    let r = PrivateRedis::node();
    let port = r.ports[0];
    r.kill(port);
    let ns = fresh_namespace();
    let mut t = RemoteTier::open(config(r.urls()), 1).unwrap();
    let k = key(ns, 1);
    let p = payload(1, 8192);
    // Writes fail until the breaker opens, then are refused.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !t.is_down() && std::time::Instant::now() < until {
        let _ = t.offer(&key(ns, now_us()), [0; 32], &p, page_checksum(&p));
        t.flush_writes(Duration::from_secs(2));
        assert!(t.lookup(&k).is_none());
    }
    assert!(t.is_down());
    assert!(t.stats().write_errors.unavailable > 0);
    r.restart_single(port);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while t.is_down() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!t.is_down());
    let failed = t.stats().write_errors.total();
    t.offer(&k, [4; 32], &p, page_checksum(&p)).unwrap();
    assert!(t.flush_writes(Duration::from_secs(10)));
    assert_eq!(
        t.stats().write_errors.total(),
        failed,
        "{:?}",
        t.last_error()
    );
    let mut pool = Pool::new(8192);
    pool.register(&mut t);
    read(&mut t, &k, 0, 8192).unwrap();
    assert_eq!(pool.0, p);
}

/// A flushed cluster: reads of what the metadata still promises are
/// missing (never bytes), and the directory check then drops the rest.
#[test]
fn flushed_cluster_misses_and_forgets() {
    let Some(_) = single_url("flushed_cluster_misses_and_forgets") else {
        return;
    };
    let r = PrivateRedis::cluster();
    let urls = r.urls();
    let ns = fresh_namespace();
    let mut pool = Pool::new(PAGE);
    let mut a = RemoteTier::open(config(urls.clone()), 1).unwrap();
    let mut b = RemoteTier::open(config(urls.clone()), 2).unwrap();
    pool.register(&mut b);
    let pages: Vec<_> = (0..16u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    assert!(b.lookup(&pages[0].0).is_none());
    write_all(&mut a, &pages);
    for (k, _) in &pages {
        wait_lookup(&b, k, Duration::from_secs(10)).unwrap();
    }
    for port in &r.ports {
        let mut c = raw_single(&format!("redis://127.0.0.1:{port}"));
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    }
    pool.0.fill(0xAB);
    assert_eq!(
        read(&mut b, &pages[0].0, 0, PAGE as u64),
        Err(TierError::NotFound)
    );
    assert!(pool.0.iter().all(|x| *x == 0xAB));
    // The directory streams are gone: their entries leave the cache.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while pages.iter().any(|(k, _)| b.lookup(k).is_some()) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pages.iter().all(|(k, _)| b.lookup(k).is_none()));
    assert!(b.stats().directory_resets > 0);
}

/// A node of the cluster killed while reads are in flight: reads of its
/// slots fail, reads of the others succeed with exact bytes, nothing wrong
/// ever lands.
#[test]
fn cluster_node_killed_mid_read() {
    let Some(_) = single_url("cluster_node_killed_mid_read") else {
        return;
    };
    let r = PrivateRedis::cluster();
    let urls = r.urls();
    let ns = fresh_namespace();
    let n = 24usize;
    let mut pool = Pool::new(n * PAGE);
    let mut cfg = config(urls.clone());
    cfg.breaker_failures = 1000;
    cfg.read_workers = 8;
    let mut t = RemoteTier::open(cfg, 1).unwrap();
    pool.register(&mut t);
    let pages: Vec<_> = (0..n as u64)
        .map(|i| (key(ns, i), payload(i, PAGE)))
        .collect();
    write_all(&mut t, &pages);
    let victim = r.ports[1];
    let mut raw = raw_single(&format!("redis://127.0.0.1:{victim}"));
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5000)
        .arg("ALL")
        .query(&mut raw)
        .unwrap();
    pool.0.fill(0xAB);
    let tokens: Vec<_> = pages
        .iter()
        .enumerate()
        .map(|(i, (k, _))| {
            t.submit_read(k, (i * PAGE) as u64, PAGE as u64, now_us())
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    r.kill(victim);
    let mut ok = 0;
    let results = wait_all(&mut t, &tokens, Duration::from_secs(10));
    for (i, res) in results.into_iter().enumerate() {
        let slot = &pool.0[i * PAGE..(i + 1) * PAGE];
        match res {
            Ok(()) => {
                ok += 1;
                assert_eq!(slot, &pages[i].1[..], "exact bytes");
            }
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        TierError::Unavailable(_) | TierError::Timeout | TierError::Io(_)
                    ),
                    "{e:?}"
                );
                assert!(slot.iter().all(|b| *b == 0xAB), "nothing landed");
            }
        }
    }
    assert!(
        ok > 0 && ok < n,
        "{ok} of {n} read: some slots lived on the victim"
    );
    assert_eq!(t.in_flight(), 0);
}

/// Bounds: queued writes and page size are refused by name.
#[test]
fn write_refusals_by_reason() {
    let Some(url) = single_url("write_refusals_by_reason") else {
        return;
    };
    let ns = fresh_namespace();
    let mut cfg = config(vec![url]);
    cfg.max_queued_writes = 2;
    cfg.max_page_bytes = 1 << 20;
    cfg.write_workers = 1;
    let mut t = RemoteTier::open(cfg, 1).unwrap();
    assert_eq!(
        t.offer(&key(ns, 0), [0; 32], &[], page_checksum(&[])),
        Err(DemoteRefused::Empty)
    );
    assert_eq!(
        t.offer(&key(ns, 0), [0; 32], &vec![0; (1 << 20) + 1], 0),
        Err(DemoteRefused::TooLarge)
    );
    let p = payload(1, 4096);
    let sum = page_checksum(&p);
    // Bytes that do not match the checksum the page carries are refused,
    // never written under a fresh one.
    assert_eq!(
        t.offer(&key(ns, 0), [0; 32], &p, sum ^ 1),
        Err(DemoteRefused::Checksum)
    );
    let mut accepted = 0;
    let mut full = 0;
    for i in 0..50 {
        match t.offer(&key(ns, i), [0; 32], &p, sum) {
            Ok(()) => accepted += 1,
            Err(DemoteRefused::QueueFull) => full += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        full > 0 && accepted >= 2,
        "{accepted} accepted, {full} full"
    );
    assert!(t.writes_pending() <= 2);
    assert!(t.flush_writes(Duration::from_secs(10)));
    // Stored keys are duplicates now; so is one in flight.
    assert_eq!(
        t.offer(&key(ns, 0), [0; 32], &p, sum),
        Err(DemoteRefused::Duplicate)
    );
    let s = t.stats();
    assert_eq!(s.write_refusals.queue_full, full);
    assert_eq!(s.write_refusals.empty, 1);
    assert_eq!(s.write_refusals.too_large, 1);
    assert_eq!(s.write_refusals.duplicate, 1);
    assert_eq!(s.write_refusals.checksum, 1);
    assert_eq!(s.writes_queued, 0);
    assert_eq!(s.write_bytes_queued, 0);
    // Write-back only on eviction: write-through is refused as
    // not_writable, demote accepted.
    let mut cfg = config(vec![t.config().urls[0].clone()]);
    cfg.write_policy = WritePolicy::WriteBack;
    let mut wb = RemoteTier::open(cfg, 1).unwrap();
    assert_eq!(
        wb.write_through(&key(ns, 100), [0; 32], &p, sum, 0),
        Err(DemoteRefused::NotWritable)
    );
    assert_eq!(
        wb.demote(&key(ns, 101), [0; 32], &p, sum ^ 1, 0),
        Err(DemoteRefused::Checksum)
    );
    wb.demote(&key(ns, 100), [0; 32], &p, sum, 0).unwrap();
    assert!(wb.flush_writes(Duration::from_secs(10)));
    let mut done = Vec::new();
    wb.poll_demotions(0, &mut done);
    assert_eq!(done, vec![Ok(())]);
}

/// Passwords come from a file (or env), never from URLs or logs; a wrong
/// one is a tier that is unavailable, not an error that stops the manager.
#[test]
fn password_from_file_and_never_shown() {
    let Some(_) = single_url("password_from_file_and_never_shown") else {
        return;
    };
    let r = PrivateRedis::node();
    let url = r.urls()[0].clone();
    let mut raw = raw_single(&url);
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("orbit-s3cret")
        .query(&mut raw)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "orbit-s3cret\n").unwrap();
    let ns = fresh_namespace();

    let mut cfg = config(vec![url.clone()]);
    cfg.password_file = Some(pw.clone());
    let mut t = RemoteTier::open(cfg, 1).unwrap();
    let p = payload(3, 4096);
    write_all(&mut t, &[(key(ns, 3), p.clone())]);
    let mut pool = Pool::new(4096);
    pool.register(&mut t);
    read(&mut t, &key(ns, 3), 0, 4096).unwrap();
    assert_eq!(pool.0, p);
    assert!(!format!("{t:?}").contains("orbit-s3cret"));

    // Without the password: writes fail as unavailable.
    let mut t = RemoteTier::open(config(vec![url.clone()]), 1).unwrap();
    t.offer(&key(ns, 4), [0; 32], &p, page_checksum(&p))
        .unwrap();
    t.flush_writes(Duration::from_secs(5));
    assert_eq!(
        t.stats().write_errors.unavailable,
        1,
        "{:?}",
        t.last_error()
    );
    assert!(!t.last_error().unwrap_or_default().contains("orbit-s3cret"));

    // A password inside the URL is refused without echoing it.
    let e = RemoteTier::open(
        RemoteConfig::new([format!("redis://:orbit-s3cret@127.0.0.1:{}", r.ports[0])]),
        1,
    )
    .unwrap_err();
    assert!(!e.to_string().contains("orbit-s3cret"), "{e}");
}

/// Records expire with the configured TTL; metadata of expired records is
/// pruned.
#[test]
fn records_expire_with_their_ttl() {
    let Some(url) = single_url("records_expire_with_their_ttl") else {
        return;
    };
    let ns = fresh_namespace();
    let mut cfg = config(vec![url.clone()]);
    cfg.ttl_ms = 300;
    let mut t = RemoteTier::open(cfg, 1).unwrap();
    let k = key(ns, 1);
    write_all(&mut t, &[(k, payload(1, 1024))]);
    let mut raw = raw_single(&url);
    let ttl: i64 = raw.pttl(data_key(&t.config().key_prefix, &k)).unwrap();
    assert!(ttl > 0 && ttl <= 300, "{ttl}");
    assert!(t.lookup(&k).is_some());
    std::thread::sleep(Duration::from_millis(400));
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while t.lookup(&k).is_some() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(t.lookup(&k).is_none(), "expired metadata pruned");
}

/// Issue 23: whoever can write the Redis could recompute every unkeyed
/// check (header checksum, payload XXH3, the directory's promise) and
/// inject pages into every host. Records are keyed now: a forged record
/// with its own directory entry is never looked up (the entry fails its
/// MAC and is dropped), a forged record over an honest one is corrupt
/// (`remote_corrupt`), and a value planted over its promised length is
/// refused by its length without being read whole.
fn forged_records(urls: Vec<String>, raw: &mut dyn redis::ConnectionLike) {
    let ns = fresh_namespace();
    let mut pool = Pool::new(PAGE);
    let mut a = RemoteTier::open(config(urls.clone()), 1).unwrap();
    let mut b = RemoteTier::open(config(urls), 2).unwrap();
    pool.register(&mut b);
    let pages: Vec<_> = (0..3u64).map(|i| (key(ns, i), payload(i, PAGE))).collect();
    assert!(b.lookup(&pages[0].0).is_none()); // B follows the namespace
    write_all(&mut a, &pages);
    for (k, _) in &pages {
        wait_lookup(&b, k, Duration::from_secs(10)).expect("B learns A's pages");
    }
    let cfg = a.config().clone();
    let evil = vec![0xEE; PAGE];
    // Records and entries as a writer of the store makes them: every
    // field right, every unkeyed checksum recomputed, MACs under the keys
    // it has (the public ones, or a secret of its own).
    let forge = |k, forger: &RecordMac| {
        let h = RecordHeader {
            key: k,
            format_digest: [0; 32],
            payload_len: PAGE as u64,
            payload_checksum: page_checksum(&evil),
            payload_mac: forger.payload_mac(&evil),
            writer: 666,
            written_unix_ms: 4_000_000_000_000,
            ttl_ms: 60_000,
        };
        (encode_record(&h, forger, &evil), h.encode(forger))
    };
    let plant = |raw: &mut dyn redis::ConnectionLike, k, forger: &RecordMac| {
        let (record, entry) = forge(k, forger);
        let _: () = redis::cmd("SET")
            .arg(data_key(&cfg.key_prefix, &k))
            .arg(record)
            .query(raw)
            .unwrap();
        let dir = directory_key(&cfg.key_prefix, &ns, shard_of(&k, cfg.directory_shards));
        let _: String = redis::cmd("XADD")
            .arg(dir)
            .arg("*")
            .arg("h")
            .arg(entry)
            .query(raw)
            .unwrap();
    };
    let fresh = key(ns, 100);
    let other_secret = RecordMac::from_secret(&[0x77; 32]).unwrap();
    plant(raw, fresh, &RecordMac::unauthenticated());
    plant(raw, pages[1].0, &other_secret);
    // B reads both forged entries and believes neither.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while b.stats().directory_entries_bad < 2 {
        assert!(
            std::time::Instant::now() < until,
            "forged entries never read"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        b.lookup(&fresh).is_none(),
        "a forged entry promises nothing"
    );
    assert_eq!(
        b.submit_read(&fresh, 0, PAGE as u64, now_us()),
        Err(TierError::NotFound)
    );
    // The honest entry of page 1 still promises it: its forged record is
    // corrupt, and nothing lands.
    pool.0.fill(0xAB);
    assert_eq!(
        read(&mut b, &pages[1].0, 0, PAGE as u64),
        Err(TierError::Corrupt)
    );
    assert!(pool.0.iter().all(|x| *x == 0xAB), "no byte landed");
    assert!(
        b.last_error().unwrap_or_default().contains("MAC"),
        "{:?}",
        b.last_error()
    );
    // 64 MiB planted under page 2's key: refused by its length.
    let _: () = redis::cmd("SET")
        .arg(data_key(&cfg.key_prefix, &pages[2].0))
        .arg(vec![0x11u8; 64 << 20])
        .query(raw)
        .unwrap();
    assert_eq!(
        read(&mut b, &pages[2].0, 0, PAGE as u64),
        Err(TierError::Corrupt)
    );
    let why = b.last_error().unwrap_or_default().to_owned();
    assert!(why.contains(&format!("{}", 64 << 20)), "{why}");
    assert_eq!(b.stats().bytes_read, 0);
    // Page 0 is untouched and exact.
    read(&mut b, &pages[0].0, 0, PAGE as u64).unwrap();
    assert_eq!(&pool.0[..], &pages[0].1[..]);
    let _: () = redis::cmd("DEL")
        .arg(data_key(&cfg.key_prefix, &pages[2].0))
        .query(raw)
        .unwrap();
}

#[test]
fn single_node_forged_records_are_never_served() {
    let Some(url) = single_url("single_node_forged_records_are_never_served") else {
        return;
    };
    let mut raw = raw_single(&url);
    forged_records(vec![url], &mut raw);
}

#[test]
fn cluster_forged_records_are_never_served() {
    let Some(urls) = cluster_urls("cluster_forged_records_are_never_served") else {
        return;
    };
    let mut raw = raw_cluster(&urls);
    forged_records(urls, &mut raw);
}

/// A store nobody configured a secret for is refused at open, unless the
/// operator said it trusts the store fully.
#[test]
fn a_tier_without_a_secret_is_refused_unless_trusted() {
    let mut cfg = RemoteConfig::new(["redis://127.0.0.1:1"]);
    let e = RemoteTier::open(cfg.clone(), 1).unwrap_err();
    assert!(e.to_string().contains("mac_key_file"), "{e}");
    cfg.unauthenticated = true;
    RemoteTier::open(cfg, 1).unwrap();
}

/// The metadata cache's change journal (the manager's KV events, medium
/// `STORAGE`, locality `REMOTE`): what another host writes reaches the
/// events once the namespace is followed, this host's own writes as they
/// land, a failed read withdraws its page; while the breaker is open every
/// page is withdrawn, and listed again once it closes.
#[test]
fn metadata_changes_follow_what_lookups_would_find() {
    use orbitkv_io::tier::TierChange;
    use std::collections::BTreeSet;
    let Some(_) = single_url("metadata_changes_follow_what_lookups_would_find") else {
        return;
    };
    let r = PrivateRedis::node();
    let port = r.ports[0];
    let ns = fresh_namespace();
    let mut a = RemoteTier::open(config(r.urls()), 1).unwrap();
    let mut b = RemoteTier::open(config(r.urls()), 2).unwrap();
    let mut out = Vec::new();
    assert!(
        !b.take_changes(&mut out) && out.is_empty(),
        "off until asked"
    );
    b.record_changes(1000);
    let mut held = BTreeSet::new();
    let drain = |b: &mut RemoteTier, held: &mut BTreeSet<StateKey>| {
        let mut out = Vec::new();
        assert!(!b.take_changes(&mut out));
        for c in out {
            match c {
                TierChange::Stored(k) => assert!(held.insert(k), "stored twice {k:?}"),
                TierChange::Removed(k) => assert!(held.remove(&k), "removed absent {k:?}"),
            }
        }
    };
    let looked_up = |b: &RemoteTier, keys: &[StateKey]| -> BTreeSet<StateKey> {
        keys.iter()
            .copied()
            .filter(|k| b.lookup(k).is_some())
            .collect()
    };
    // Another host's writes, once B follows the namespace.
    let pages: Vec<_> = (0..4u64).map(|i| (key(ns, i), payload(i, 8192))).collect();
    assert!(b.lookup(&pages[0].0).is_none());
    write_all(&mut a, &pages);
    for (k, _) in &pages {
        wait_lookup(&b, k, Duration::from_secs(10)).expect("B learns A's page");
    }
    let mut keys: Vec<StateKey> = pages.iter().map(|(k, _)| *k).collect();
    drain(&mut b, &mut held);
    assert_eq!(held, looked_up(&b, &keys));
    assert_eq!(held.len(), 4);
    // B's own write.
    let own = (key(ns, 10), payload(10, 8192));
    write_all(&mut b, std::slice::from_ref(&own));
    keys.push(own.0);
    drain(&mut b, &mut held);
    assert!(held.contains(&own.0));
    assert_eq!(held, looked_up(&b, &keys));
    // A record gone out of band: the failed read withdraws it.
    let prefix = b.config().key_prefix.clone();
    let mut raw = raw_single(&r.urls()[0]);
    let _: () = redis::cmd("DEL")
        .arg(data_key(&prefix, &pages[0].0))
        .query(&mut raw)
        .unwrap();
    let mut pool = Pool::new(8192);
    pool.register(&mut b);
    assert!(read(&mut b, &pages[0].0, 0, 8192).is_err());
    drain(&mut b, &mut held);
    assert!(!held.contains(&pages[0].0));
    assert_eq!(held, looked_up(&b, &keys));
    // Down: everything withdrawn (lookups answer "absent"); up: listed again.
    r.kill(port);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !b.is_down() && std::time::Instant::now() < until {
        let _ = b.offer(&key(ns, now_us()), [0; 32], &own.1, page_checksum(&own.1));
        b.flush_writes(Duration::from_secs(2));
    }
    assert!(b.is_down());
    drain(&mut b, &mut held);
    assert!(held.is_empty(), "{held:?}");
    r.restart_single(port);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while b.is_down() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!b.is_down());
    drain(&mut b, &mut held);
    assert_eq!(held, looked_up(&b, &keys));
    assert_eq!(
        held.len(),
        4,
        "the three of A's still promised, and B's own"
    );
}
