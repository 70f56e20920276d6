//! Two `orbitkv serve` managers (different sockets and DRAM pools) sharing
//! one Redis deployment stand for two hosts: pages published through A are
//! restored byte for byte through B; another identity never hits; a
//! corrupted record is a miss with its reason through the manager; a
//! remote that is down leaves DRAM serving. Skipped, loudly, without
//! `ORBITKV_TEST_REDIS` (`scripts/redis.sh start`; `scripts/test.sh` sets it).

mod support;
use support::*;

use std::path::Path;
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, Event, GroupHashes, MissReason, SessionHandle};
use orbitkv_io::remote::record::{RecordHeader, RecordMac, directory_key, encode_record, shard_of};
use orbitkv_ipc::Client;
use orbitkv_world::driver::{DriverError, target};

/// A manager whose remote tier is `remote` (seed URLs, comma-separated),
/// with short refresh and breaker timings; `prefix` keeps tests apart.
/// The managers of one `dir` share its MAC secret, as a deployment does.
fn start(dir: &Path, name: &str, remote: &str, prefix: &str) -> Manager {
    let config = remote_config(
        dir,
        &format!(
            "key_prefix = \"{prefix}\"\nrefresh_interval_ms = 20\nvalidate_every_rounds = 5\n\
             read_timeout_ms = 1000\nbreaker_failures = 2\nbreaker_cooldown_ms = 200\n"
        ),
    );
    Manager::start(dir, name, "16MiB", &config, &["--remote", remote])
}

fn remote_urls(test: &str, cluster: bool) -> Option<String> {
    let var = if cluster {
        "ORBITKV_TEST_REDIS_CLUSTER"
    } else {
        "ORBITKV_TEST_REDIS"
    };
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var_os("ORBITKV_REQUIRE_REDIS").is_none(),
                "{test}: Redis is required here (ORBITKV_REQUIRE_REDIS is set) but its address is unset"
            );
            eprintln!(
                "\n!!!! SKIPPED {test}: {var} is unset. Run `eval \"$(scripts/redis.sh start)\"` first; \
                 CI always sets it. !!!!\n"
            );
            None
        }
    }
}

/// A prefix no other test run uses.
fn unique_prefix(tag: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("okvt{}{tag}{t}:", std::process::id())
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(13).wrapping_add(i as u8 * 11 + 3))
        .collect()
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0x5e0 + i)).collect()
}

fn query(s: SessionHandle, request: u64, pages: u64) -> Command {
    Command::Query {
        session: s,
        request,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes(pages),
        }],
        origin: 0,
        prompt_len: pages * PAGE + 1,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    }
}

/// How one query ended.
#[derive(Debug)]
enum Outcome {
    /// Ready: (operation, boundary, pages from DRAM, pages from tiers).
    Ready(u64, u64, u64, u64),
    Miss(Option<MissReason>),
}

fn ask(c: &mut Client, s: SessionHandle, request: u64, pages: u64) -> Outcome {
    with_driver(c, T, |d| {
        let qr = d.query(query(s, request, pages))?;
        if qr.selected.is_none() {
            return Ok(Outcome::Miss(qr.miss));
        }
        Ok::<_, DriverError<_>>(match d.ready(qr.operation)? {
            Event::Ready {
                boundary,
                pages_from_dram,
                pages_from_tiers,
                ..
            } => Outcome::Ready(qr.operation, boundary, pages_from_dram, pages_from_tiers),
            Event::Miss { reason, .. } => Outcome::Miss(Some(reason)),
            e => panic!("{e:?}"),
        })
    })
    .unwrap()
}

/// Restores the ready operation's `n` pages into device slots 20.. and
/// checks every byte.
fn restore_and_check(c: &mut Client, s: SessionHandle, region: u64, operation: u64, n: u64) {
    let done = with_driver(c, T, |d| {
        let dps = d.alloc_many(s, region, (0..n as u32).map(|i| 20 + i))?;
        let targets = (0..n)
            .zip(dps)
            .map(|(i, dp)| target(0, 0, (i + 1) * PAGE, dp))
            .collect();
        d.restore(s, operation, targets, vec![])
    })
    .unwrap();
    assert!(
        matches!(done, Event::RestoreDone { pages, .. } if pages == n),
        "{done:?}"
    );
    for i in 0..n {
        let at = ((20 + i) * BYTES) as usize;
        assert_eq!(
            &c.region_mut(region).unwrap()[at..at + BYTES as usize],
            &payload(i)[..],
            "page {i}: exact bytes"
        );
    }
}

/// Publishes pages 0..4 of `hashes(4)` through `c` (identity `[9; 32]`).
fn publish(c: &mut Client) {
    let h = hashes(4);
    publish_four(c, &h, payload);
}

/// Asks until the answer is no longer "not found yet" (B follows the
/// namespace's directory after its first lookup).
fn ask_until_found(c: &mut Client, s: SessionHandle, pages: u64) -> Outcome {
    let deadline = Instant::now() + T;
    let mut request = 100;
    loop {
        request += 1;
        match ask(c, s, request, pages) {
            Outcome::Miss(Some(MissReason::NotFound)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(30));
            }
            other => return other,
        }
    }
}

fn shares_pages(remote: &str, tag: &str) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique_prefix(tag);
    let a = start(dir.path(), "a", remote, &prefix);
    let b = start(dir.path(), "b", remote, &prefix);

    let mut ca = Client::connect(&a.socket, "engine-a").unwrap();
    publish(&mut ca);
    // Written through: four records stored by A, each offered once with
    // the checksum its copy computed.
    a.wait_metric("remote_writes_total", 4);
    a.wait_metric("write_through_total{outcome=\"submitted\"}", 4);

    let mut cb = Client::connect(&b.socket, "engine-b").unwrap();
    // The remote tier cannot list the pages other hosts store (B follows a
    // namespace only once asked about it): the presence filter stays
    // closed, and B's engine asks B even for pages B has never seen.
    assert!(cb.presence().is_some());
    assert_eq!(
        (a.metric("presence_open"), b.metric("presence_open")),
        (Some(0), Some(0))
    );
    let mut engine = orbitkv_engine::Session::open(
        &mut cb,
        register_command(),
        orbitkv_engine::SessionOptions::default(),
    )
    .unwrap();
    let asked = orbitkv_engine::Query {
        groups: vec![0],
        hashes: hashes(4),
        origin: 0,
        prompt_len: 4 * PAGE + 1,
    };
    assert!(!engine.lookup(&mut cb, &asked).unwrap().local);
    register_as(&mut cb, "llama", [9; 32]);
    let (sb, rb) = open_as(&mut cb, "llama");
    let Outcome::Ready(op, boundary, from_dram, from_tiers) = ask_until_found(&mut cb, sb, 4)
    else {
        panic!("B never found A's pages")
    };
    assert_eq!(boundary, 4 * PAGE);
    assert_eq!(
        (from_dram, from_tiers),
        (0, 4),
        "all four came from the remote tier"
    );
    restore_and_check(&mut cb, sb, rb, op, 4);

    // Another identity on B, same native hashes: never a hit.
    register_as(&mut cb, "other", [8; 32]);
    let (so, _) = open_as(&mut cb, "other");
    for r in 0..5 {
        match ask(&mut cb, so, 200 + r, 4) {
            Outcome::Miss(Some(MissReason::NotFound)) => {}
            o => panic!("another identity got {o:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    b.wait_metric("leases", 0);
    b.wait_metric("bytes_reserved", 0);
    a.wait_metric("leases", 0);
    assert!(b.metric("remote_read_bytes_total").unwrap() >= 4 * BYTES);
    assert_eq!(b.metric("remote_up"), Some(1));
}

#[test]
fn two_managers_share_pages_through_a_single_node() {
    let Some(url) = remote_urls("two_managers_share_pages_through_a_single_node", false) else {
        return;
    };
    shares_pages(&url, "s");
}

#[test]
fn two_managers_share_pages_through_a_cluster() {
    let Some(urls) = remote_urls("two_managers_share_pages_through_a_cluster", true) else {
        return;
    };
    shares_pages(&urls, "c");
}

/// A record overwritten with other bytes: B misses with `remote_corrupt`
/// (never the bytes), returns everything, and then restores the intact
/// prefix before the bad page.
#[test]
fn a_corrupted_record_is_a_miss_through_the_manager() {
    let Some(url) = remote_urls("a_corrupted_record_is_a_miss_through_the_manager", false) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique_prefix("x");
    let a = start(dir.path(), "a", &url, &prefix);
    let b = start(dir.path(), "b", &url, &prefix);
    let mut ca = Client::connect(&a.socket, "engine-a").unwrap();
    publish(&mut ca);
    a.wait_metric("remote_writes_total", 4);

    // Overwrite page 2's record (key: prefix + "d:" + hex of its StateKey).
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}d:*"))
        .query(&mut raw)
        .unwrap();
    assert_eq!(keys.len(), 4);
    let native = NativeHash::from_u64(0x5e0 + 2);
    let victim = keys
        .iter()
        .find(|k| {
            let bytes = hex::decode(&k[prefix.len() + 2..]).unwrap();
            orbitkv_components::StateKey::decode(&bytes).unwrap().native == native
        })
        .unwrap();
    // Issue 23: a forged record as a writer of the store makes it, every
    // unkeyed check recomputed (header checksum, payload XXH3) and a fresh
    // directory entry promising it, MACs under public keys (it lacks the
    // deployment's secret). Before records were keyed, B served it.
    let bytes = hex::decode(&victim[prefix.len() + 2..]).unwrap();
    let key = orbitkv_components::StateKey::decode(&bytes).unwrap();
    let evil = vec![0x42u8; BYTES as usize];
    let forger = RecordMac::unauthenticated();
    let h = RecordHeader {
        key,
        format_digest: [0; 32],
        payload_len: BYTES,
        payload_checksum: orbitkv_io::checksum::page_checksum(&evil),
        payload_mac: forger.payload_mac(&evil),
        writer: 666,
        written_unix_ms: 4_000_000_000_000,
        ttl_ms: 3_600_000,
    };
    let () = redis::cmd("SET")
        .arg(victim)
        .arg(encode_record(&h, &forger, &evil))
        .query(&mut raw)
        .unwrap();
    let dir_key = directory_key(&prefix, &key.namespace, shard_of(&key, 16));
    let _: String = redis::cmd("XADD")
        .arg(dir_key)
        .arg("*")
        .arg("h")
        .arg(h.encode(&forger))
        .query(&mut raw)
        .unwrap();

    let mut cb = Client::connect(&b.socket, "engine-b").unwrap();
    register_as(&mut cb, "llama", [9; 32]);
    let (sb, rb) = open_as(&mut cb, "llama");
    match ask_until_found(&mut cb, sb, 4) {
        Outcome::Miss(Some(MissReason::RemoteCorrupt)) => {}
        o => panic!("{o:?}"),
    }
    b.wait_metric("misses_total{reason=\"remote_corrupt\"}", 1);
    b.wait_metric("leases", 0);
    b.wait_metric("bytes_reserved", 0);
    // The bad record left B's metadata: the prefix before it restores.
    let Outcome::Ready(op, boundary, _, _) = ask(&mut cb, sb, 300, 4) else {
        panic!("the intact prefix should restore")
    };
    assert_eq!(boundary, 2 * PAGE);
    restore_and_check(&mut cb, sb, rb, op, 2);
    b.wait_metric("leases", 0);
    b.wait_metric("bytes_reserved", 0);
}

/// A remote that is down: the manager starts, publishes and restores from
/// DRAM as usual, and reports the tier down.
#[test]
fn a_remote_that_is_down_leaves_dram_serving() {
    let Some(_) = remote_urls("a_remote_that_is_down_leaves_dram_serving", false) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let m = start(dir.path(), "m", &dead, &unique_prefix("d"));
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    publish(&mut c);
    // Write-through fails (two failures open the breaker).
    m.wait_metric("remote_up", 0);
    let (s, r) = open_as(&mut c, "llama");
    let Outcome::Ready(op, boundary, from_dram, from_tiers) = ask(&mut c, s, 7, 4) else {
        panic!("DRAM should serve")
    };
    assert_eq!((boundary, from_dram, from_tiers), (4 * PAGE, 4, 0));
    restore_and_check(&mut c, s, r, op, 4);
    m.wait_metric("leases", 0);
    // Every write-through was refused (breaker open) or failed
    // (unavailable), counted by reason; none was stored.
    let deadline = Instant::now() + T;
    loop {
        let refused = m.metric("remote_write_refusals_total{reason=\"unavailable\"}");
        let failed = m.metric("remote_errors_total{op=\"write\",kind=\"unavailable\"}");
        if refused.unwrap_or(0) + failed.unwrap_or(0) == 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{refused:?} refused, {failed:?} failed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(m.metric("remote_writes_total"), Some(0));
}

/// Issue 23: a manager with a remote tier and no MAC secret refuses to
/// start (records from the store could not be authenticated), unless the
/// operator says it trusts whoever can write the store. No Redis needed:
/// the tier does not connect at start.
#[test]
fn a_manager_without_a_remote_secret_does_not_start_unless_told_to_trust() {
    let dir = tempfile::tempdir().unwrap();
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let config = dir.path().join("plain.toml");
    std::fs::write(&config, format!("{BASE_CONFIG}[remote]\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv"))
        .args(["serve", "--socket"])
        .arg(dir.path().join("plain.sock"))
        .args(["--config", config.to_str().unwrap(), "--remote", &dead])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mac_key_file"), "{err}");
    let trusting = format!("{BASE_CONFIG}[remote]\nunauthenticated = true\n");
    let m = Manager::start(
        dir.path(),
        "trusting",
        "16MiB",
        &trusting,
        &["--remote", &dead],
    );
    m.stop();
}
