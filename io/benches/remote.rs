//! The remote tier against raw GET/SET of the same values with the same
//! client crate (redis-rs, sync), on the same server, in the same run; and,
//! when a Python with LMCache is given, against LMCache's Redis backend
//! (`RedisConnector`, lmcache 0.5.6) on the same server too.
//!
//! For 64 KiB and 2 MiB pages:
//! - write: tier = `write_through` of every page (record = header + page,
//!   `SET ... PX` then `XADD` + `PEXPIRE` of the directory entry) until
//!   stored; raw = `SET ... PX` of the page bytes.
//! - read: tier = `submit_read` into a pool slot until reported (GET,
//!   header + key + length + XXH3 verification, copy into the slot); raw =
//!   `GET` into a fresh `Vec`.
//! - latency: one operation at a time (p50/p99 over every operation);
//!   throughput: `CONCURRENCY` operations in flight (tier: that many
//!   worker threads; raw: that many threads, one connection each).
//!
//! Run: `eval "$(scripts/redis.sh start)"` then
//! `cargo bench -p orbitkv-io --bench remote` (add `-- --cluster` for the
//! 3-master cluster, `-- --lmcache $(scripts/venv.sh lmcache)/bin/python`
//! for the peer; `-- --only 2MiB` for one page size). Results go to
//! stdout and `target/remote-bench.json`.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use orbitkv_components::{Namespace, StateKey};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::remote::{RemoteConfig, RemoteTier, WritePolicy};
use orbitkv_io::tier::{BackingTier, DemoteRefused, ReadDone, ReadToken};
use serde_json::{Value, json};

const CONCURRENCY: usize = 4;
/// Expiry of every key written (the tier's default TTL), so a benchmark
/// leaves nothing behind for long, and raw SETs pay what the tier's pay.
const TTL_MS: u64 = 600_000;

struct Case {
    name: &'static str,
    page: usize,
    /// Pages in the throughput runs.
    pages: usize,
    /// Operations in the latency runs.
    latency_ops: usize,
}

const CASES: [Case; 2] = [
    Case {
        name: "64KiB",
        page: 64 << 10,
        pages: 2048,
        latency_ops: 400,
    },
    Case {
        name: "2MiB",
        page: 2 << 20,
        pages: 96,
        latency_ops: 48,
    },
];

#[derive(Debug, Clone)]
struct Row {
    case: &'static str,
    op: &'static str,
    system: String,
    ops_per_s: f64,
    mib_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn lat(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

fn bytes_for(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn now_us(start: Instant) -> u64 {
    start.elapsed().as_micros() as u64
}

fn namespace(tag: u8) -> Namespace {
    let mut ns = [tag; 32];
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    ns[..16].copy_from_slice(&t.to_le_bytes());
    Namespace(ns)
}

fn tier_config(urls: &[String], page: usize) -> RemoteConfig {
    let mut c = RemoteConfig::new(urls.to_vec());
    c.write_policy = WritePolicy::WriteThrough;
    c.read_workers = CONCURRENCY;
    c.write_workers = CONCURRENCY;
    c.max_inflight_reads = 64;
    c.max_queued_writes = 4096;
    c.max_queued_write_bytes = 1 << 30;
    c.max_page_bytes = page as u64;
    c.read_timeout_ms = 10_000;
    c.write_timeout_ms = 10_000;
    c.key_prefix = "okvbench:".into();
    c.ttl_ms = TTL_MS;
    // Keyed records, as a deployment runs them: the MACs are part of the
    // measured cost.
    let secret = std::env::temp_dir().join(format!("okvbench-mac-{}", std::process::id()));
    std::fs::write(&secret, [0x5a; 32]).unwrap();
    c.mac_key_file = Some(secret);
    c
}

/// Tier: write throughput (all pages queued, CONCURRENCY writers) and
/// latency (one at a time), then read latency and throughput.
fn bench_tier(urls: &[String], case: &Case, values: &[Vec<u8>]) -> Vec<Row> {
    // The checksums pages carry since they landed (the manager has them
    // from the copy; not part of the timed work).
    let sums: Vec<u64> = values.iter().map(|v| page_checksum(v)).collect();
    let page = case.page;
    let mut pool = vec![0u8; CONCURRENCY * 16 * page];
    let mut t = RemoteTier::open(tier_config(urls, page), 7).unwrap();
    // SAFETY: `pool` outlives `t` (dropped at the end of this function,
    // after `t`) and is only read after reads are reported.
    unsafe { t.register_host_pool(pool.as_mut_ptr(), pool.len() as u64) }.unwrap();
    let ns = namespace(1);
    let keys: Vec<StateKey> = (0..case.pages as u64)
        .map(|i| StateKey::new(ns, 0, &i.to_le_bytes()).unwrap())
        .collect();
    let mut rows = Vec::new();

    // Write throughput.
    let start = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        loop {
            let v = i % values.len();
            match t.offer(k, [1; 32], &values[v], sums[v]) {
                Ok(()) => break,
                Err(DemoteRefused::QueueFull) => {
                    t.wait(Duration::from_millis(100));
                }
                Err(e) => panic!("write refused: {e}"),
            }
        }
    }
    assert!(t.flush_writes(Duration::from_secs(600)));
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(t.stats().write_errors.total(), 0, "{:?}", t.last_error());
    let w_tput = case.pages as f64 / secs;

    // Write latency, one at a time.
    let ns_lat = namespace(2);
    let mut w_lat = Vec::new();
    for i in 0..case.latency_ops as u64 {
        let k = StateKey::new(ns_lat, 0, &i.to_le_bytes()).unwrap();
        let s = Instant::now();
        let v = i as usize % values.len();
        t.offer(&k, [1; 32], &values[v], sums[v]).unwrap();
        assert!(t.flush_writes(Duration::from_secs(60)));
        w_lat.push(s.elapsed().as_secs_f64() * 1e6);
    }
    let (p50, p99) = lat(w_lat);
    rows.push(Row {
        case: case.name,
        op: "write",
        system: "orbitkv tier".into(),
        ops_per_s: w_tput,
        mib_per_s: w_tput * page as f64 / (1 << 20) as f64,
        p50_us: p50,
        p99_us: p99,
    });

    // Read latency, one at a time.
    let clock = Instant::now();
    let mut done: Vec<ReadDone> = Vec::new();
    let mut r_lat = Vec::new();
    for i in 0..case.latency_ops {
        let k = &keys[i % keys.len()];
        let s = Instant::now();
        let tok = t.submit_read(k, 0, page as u64, now_us(clock)).unwrap();
        loop {
            t.poll(now_us(clock), &mut done);
            if let Some(d) = done.iter().find(|d| d.token == tok) {
                d.result.clone().unwrap();
                break;
            }
            t.wait(Duration::from_millis(100));
        }
        done.clear();
        r_lat.push(s.elapsed().as_secs_f64() * 1e6);
        assert_eq!(&pool[..page], &values[i % keys.len() % values.len()][..]);
    }

    // Read throughput: CONCURRENCY * 4 reads in flight into distinct slots.
    let slots = CONCURRENCY * 4;
    let start = Instant::now();
    let mut next = 0usize;
    let mut finished = 0usize;
    let mut inflight: HashMap<ReadToken, usize> = HashMap::new();
    let mut free: Vec<usize> = (0..slots).collect();
    while finished < case.pages {
        while next < case.pages
            && let Some(slot) = free.pop()
        {
            let tok = t
                .submit_read(
                    &keys[next],
                    (slot * page) as u64,
                    page as u64,
                    now_us(clock),
                )
                .unwrap();
            inflight.insert(tok, slot);
            next += 1;
        }
        t.poll(now_us(clock), &mut done);
        if done.is_empty() {
            t.wait(Duration::from_millis(100));
        }
        for d in done.drain(..) {
            d.result.unwrap();
            free.push(inflight.remove(&d.token).unwrap());
            finished += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let r_tput = case.pages as f64 / secs;
    let (p50, p99) = lat(r_lat);
    rows.push(Row {
        case: case.name,
        op: "read",
        system: "orbitkv tier".into(),
        ops_per_s: r_tput,
        mib_per_s: r_tput * page as f64 / (1 << 20) as f64,
        p50_us: p50,
        p99_us: p99,
    });
    drop(t);
    drop(pool);
    rows
}

fn raw_conn(urls: &[String]) -> Box<dyn redis::ConnectionLike + Send> {
    if urls.len() > 1 {
        Box::new(
            redis::cluster::ClusterClient::new(urls.to_vec())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
    } else {
        Box::new(
            redis::Client::open(urls[0].as_str())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
    }
}

/// Raw SET/GET with the same crate: throughput with CONCURRENCY threads,
/// latency on one connection.
fn bench_raw(urls: &[String], case: &Case, values: &[Vec<u8>]) -> Vec<Row> {
    let page = case.page;
    let key = |i: usize| format!("okvbench:raw:{}:{i}", case.name);
    let per = case.pages.div_ceil(CONCURRENCY);
    let run = |write: bool| -> f64 {
        let start = Instant::now();
        std::thread::scope(|s| {
            for w in 0..CONCURRENCY {
                s.spawn(move || {
                    let mut c = raw_conn(urls);
                    for i in w * per..((w + 1) * per).min(case.pages) {
                        if write {
                            let () = redis::cmd("SET")
                                .arg(key(i))
                                .arg(&values[i % values.len()][..])
                                .arg("PX")
                                .arg(TTL_MS)
                                .query(c.as_mut())
                                .unwrap();
                        } else {
                            let v: Vec<u8> =
                                redis::cmd("GET").arg(key(i)).query(c.as_mut()).unwrap();
                            assert_eq!(v.len(), page);
                        }
                    }
                });
            }
        });
        case.pages as f64 / start.elapsed().as_secs_f64()
    };
    run(true); // warm-up: the server allocates, and the keys exist
    let w_tput = run(true);
    let r_tput = run(false);
    let mut c = raw_conn(urls);
    let mut w_lat = Vec::new();
    let mut r_lat = Vec::new();
    for i in 0..case.latency_ops {
        let s = Instant::now();
        let () = redis::cmd("SET")
            .arg(format!("okvbench:rawlat:{}:{i}", case.name))
            .arg(&values[i % values.len()][..])
            .arg("PX")
            .arg(TTL_MS)
            .query(c.as_mut())
            .unwrap();
        w_lat.push(s.elapsed().as_secs_f64() * 1e6);
    }
    for i in 0..case.latency_ops {
        let s = Instant::now();
        let v: Vec<u8> = redis::cmd("GET")
            .arg(key(i % case.pages))
            .query(c.as_mut())
            .unwrap();
        r_lat.push(s.elapsed().as_secs_f64() * 1e6);
        assert_eq!(v.len(), page);
    }
    let mib = |ops: f64| ops * page as f64 / (1 << 20) as f64;
    let (wp50, wp99) = lat(w_lat);
    let (rp50, rp99) = lat(r_lat);
    vec![
        Row {
            case: case.name,
            op: "write",
            system: "raw SET (redis-rs)".into(),
            ops_per_s: w_tput,
            mib_per_s: mib(w_tput),
            p50_us: wp50,
            p99_us: wp99,
        },
        Row {
            case: case.name,
            op: "read",
            system: "raw GET (redis-rs)".into(),
            ops_per_s: r_tput,
            mib_per_s: mib(r_tput),
            p50_us: rp50,
            p99_us: rp99,
        },
    ]
}

/// LMCache's RedisConnector through `benches/remote_lmcache.py` (one JSON
/// document on stdout), or why it could not run.
fn bench_lmcache(python: &str, url: &str, case: &Case) -> Result<Vec<Row>, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/remote_lmcache.py");
    let out = Command::new(python)
        .arg(script)
        .args(["--url", url])
        .args(["--page-bytes", &case.page.to_string()])
        .args(["--pages", &case.pages.to_string()])
        .args(["--latency-ops", &case.latency_ops.to_string()])
        .args(["--concurrency", &CONCURRENCY.to_string()])
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(format!("exit {}: {}", out.status, tail.join(" | ")));
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for op in ["write", "read"] {
        let r = &v[op];
        let ops = r["ops_per_s"].as_f64().ok_or("no ops_per_s")?;
        rows.push(Row {
            case: case.name,
            op: if op == "write" { "write" } else { "read" },
            system: "LMCache RedisConnector".into(),
            ops_per_s: ops,
            mib_per_s: ops * case.page as f64 / (1 << 20) as f64,
            p50_us: r["p50_us"].as_f64().unwrap_or(f64::NAN),
            p99_us: r["p99_us"].as_f64().unwrap_or(f64::NAN),
        });
    }
    Ok(rows)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cluster = args.iter().any(|a| a == "--cluster");
    let lmcache = args
        .iter()
        .position(|a| a == "--lmcache")
        .and_then(|i| args.get(i + 1).cloned());
    let var = if cluster {
        "ORBITKV_TEST_REDIS_CLUSTER"
    } else {
        "ORBITKV_TEST_REDIS"
    };
    let Ok(spec) = std::env::var(var) else {
        eprintln!("remote bench: {var} is unset; run `eval \"$(scripts/redis.sh start)\"` first");
        return;
    };
    let urls = RemoteConfig::parse_urls(&spec);
    println!(
        "remote tier benchmark: {} ({}), concurrency {CONCURRENCY}",
        spec,
        if cluster { "cluster" } else { "single node" }
    );
    if !cluster {
        clean(&urls);
    }
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    // `--only 2MiB`: one page size (a profile of one size's traffic).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    for case in CASES
        .iter()
        .filter(|c| only.as_deref().is_none_or(|o| o == c.name))
    {
        let values: Vec<Vec<u8>> = (0..8u64).map(|i| bytes_for(i, case.page)).collect();
        rows.extend(bench_raw(&urls, case, &values));
        rows.extend(bench_tier(&urls, case, &values));
        if let Some(py) = &lmcache {
            if cluster {
                notes.push("LMCache: run against the single node only".to_string());
            } else {
                match bench_lmcache(py, &urls[0], case) {
                    Ok(r) => rows.extend(r),
                    Err(e) => notes.push(format!("LMCache {}: {e}", case.name)),
                }
            }
        }
    }
    println!(
        "\n{:<6} {:<6} {:<24} {:>10} {:>10} {:>10} {:>10}",
        "page", "op", "system", "ops/s", "MiB/s", "p50 µs", "p99 µs"
    );
    for r in &rows {
        println!(
            "{:<6} {:<6} {:<24} {:>10.0} {:>10.1} {:>10.0} {:>10.0}",
            r.case, r.op, r.system, r.ops_per_s, r.mib_per_s, r.p50_us, r.p99_us
        );
    }
    println!("\nratios (orbitkv tier / baseline): throughput, p50 latency");
    let mut ratios = Vec::new();
    for r in rows.iter().filter(|r| r.system == "orbitkv tier") {
        for b in rows
            .iter()
            .filter(|b| b.case == r.case && b.op == r.op && b.system != r.system)
        {
            let t = r.ops_per_s / b.ops_per_s;
            let l = r.p50_us / b.p50_us;
            println!(
                "{:<6} {:<6} vs {:<24} throughput x{t:.2}  p50 x{l:.2}",
                r.case, r.op, b.system
            );
            ratios.push(json!({"page": r.case, "op": r.op, "baseline": b.system,
                "throughput_ratio": t, "p50_ratio": l}));
        }
    }
    for n in &notes {
        println!("note: {n}");
    }
    let doc = json!({
        "target": spec,
        "cluster": cluster,
        "concurrency": CONCURRENCY,
        "rows": rows.iter().map(|r| json!({
            "page": r.case, "op": r.op, "system": r.system, "ops_per_s": r.ops_per_s,
            "mib_per_s": r.mib_per_s, "p50_us": r.p50_us, "p99_us": r.p99_us,
        })).collect::<Vec<_>>(),
        "ratios": ratios,
        "notes": notes,
    });
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/remote-bench.json");
    let _ = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap() + "\n");
    // Leave the server as found (in a cluster, keys expire after TTL_MS).
    if !cluster {
        clean(&urls);
    }
}

/// Deletes the benchmark's keys from a single node: a run writes ~1 GiB,
/// and leftovers of an earlier run would make Redis evict this run's.
fn clean(urls: &[String]) {
    let mut c = raw_conn(urls);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("okvbench:*")
        .query(c.as_mut())
        .unwrap_or_default();
    for chunk in keys.chunks(512) {
        let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query(c.as_mut());
    }
}
