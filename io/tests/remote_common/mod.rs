//! Helpers of the remote-tier tests: where Redis is, private nodes for
//! destructive faults, a host pool, and polling with deadlines.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use orbitkv_components::{Namespace, StateKey};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::remote::record::RecordMac;
use orbitkv_io::remote::{RemoteConfig, RemoteTier};
use orbitkv_io::tier::{BackingTier, ReadDone, ReadToken, TierEntry, TierError};

/// The shared single node (`scripts/redis.sh start` sets it; `scripts/test.sh` runs
/// that). `None` prints a loud skip message.
pub fn single_url(test: &str) -> Option<String> {
    match std::env::var("ORBITKV_TEST_REDIS") {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            assert!(
                std::env::var_os("ORBITKV_REQUIRE_REDIS").is_none(),
                "{test}: Redis is required here (ORBITKV_REQUIRE_REDIS is set) but its address is unset"
            );
            eprintln!(
                "\n!!!! SKIPPED {test}: ORBITKV_TEST_REDIS is unset. Run `eval \"$(scripts/redis.sh start)\"` \
                 first; CI always sets it. !!!!\n"
            );
            None
        }
    }
}

/// The shared 3-master cluster's seeds.
pub fn cluster_urls(test: &str) -> Option<Vec<String>> {
    match std::env::var("ORBITKV_TEST_REDIS_CLUSTER") {
        Ok(u) if !u.is_empty() => Some(RemoteConfig::parse_urls(&u)),
        _ => {
            assert!(
                std::env::var_os("ORBITKV_REQUIRE_REDIS").is_none(),
                "{test}: Redis is required here (ORBITKV_REQUIRE_REDIS is set) but its address is unset"
            );
            eprintln!(
                "\n!!!! SKIPPED {test}: ORBITKV_TEST_REDIS_CLUSTER is unset. Run `eval \"$(scripts/redis.sh start)\"` \
                 first; CI always sets it. !!!!\n"
            );
            None
        }
    }
}

/// A namespace no other test uses (tests share the Redis deployment).
pub fn fresh_namespace() -> Namespace {
    let mut ns = [0u8; 32];
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    ns[..16].copy_from_slice(&t.to_le_bytes());
    ns[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    ns[20..24].copy_from_slice(
        &N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_le_bytes(),
    );
    ns[31] = 1;
    Namespace(ns)
}

pub fn key(ns: Namespace, i: u64) -> StateKey {
    StateKey::new(ns, 0, &i.to_le_bytes()).unwrap()
}

/// Deterministic, key-specific bytes.
pub fn payload(i: u64, len: usize) -> Vec<u8> {
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

/// The tests' deployment secret (every tier of a test shares it, as the
/// managers of a deployment do).
pub const TEST_SECRET: &[u8; 32] = b"orbitkv-tests-remote-mac-secret!";

/// A file holding [`TEST_SECRET`], written once per test process.
pub fn test_mac_key() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("orbitkv-test-mac-{}", std::process::id()));
        std::fs::write(&path, TEST_SECRET).unwrap();
        path
    })
    .clone()
}

/// The record keys of [`TEST_SECRET`].
pub fn test_mac() -> RecordMac {
    RecordMac::from_secret(TEST_SECRET).unwrap()
}

/// Config for tests: short timeouts and refresh so faults show quickly.
pub fn config(urls: Vec<String>) -> RemoteConfig {
    let mut c = RemoteConfig::new(urls);
    c.mac_key_file = Some(test_mac_key());
    c.read_timeout_ms = 300;
    c.write_timeout_ms = 1_000;
    c.connect_timeout_ms = 300;
    c.refresh_interval_ms = 20;
    c.validate_every_rounds = 5;
    c.breaker_failures = 3;
    c.breaker_cooldown_ms = 200;
    c.directory_shards = 4;
    c
}

/// A host pool the tier reads into.
pub struct Pool(pub Vec<u8>);

impl Pool {
    pub fn new(len: usize) -> Pool {
        Pool(vec![0xAB; len])
    }

    pub fn register(&mut self, tier: &mut dyn BackingTier) {
        // SAFETY: the pool outlives the tier in every test (declared first,
        // dropped last) and is only read after reads are reported.
        unsafe { tier.register_host_pool(self.0.as_mut_ptr(), self.0.len() as u64) }.unwrap();
    }
}

/// Microseconds since the first call: the tests' clock.
pub fn now_us() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Polls until `token` is reported (or `timeout` of wall time passes).
pub fn wait_read(
    tier: &mut dyn BackingTier,
    token: ReadToken,
    timeout: Duration,
) -> Option<Result<(), TierError>> {
    let until = Instant::now() + timeout;
    let mut done: Vec<ReadDone> = Vec::new();
    while Instant::now() < until {
        tier.poll(now_us(), &mut done);
        if let Some(d) = done.iter().find(|d| d.token == token) {
            return Some(d.result.clone());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// Polls until every token is reported; results in token order.
pub fn wait_all(
    tier: &mut dyn BackingTier,
    tokens: &[ReadToken],
    timeout: Duration,
) -> Vec<Result<(), TierError>> {
    let until = Instant::now() + timeout;
    let mut got = std::collections::HashMap::new();
    let mut done: Vec<ReadDone> = Vec::new();
    while got.len() < tokens.len() {
        assert!(
            Instant::now() < until,
            "{} of {} reads reported",
            got.len(),
            tokens.len()
        );
        tier.poll(now_us(), &mut done);
        for d in done.drain(..) {
            assert!(got.insert(d.token, d.result).is_none(), "reported twice");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    tokens
        .iter()
        .map(|t| got.remove(t).expect("every token"))
        .collect()
}

/// Polls `lookup` until it answers (the refresher read the directory).
pub fn wait_lookup(tier: &dyn BackingTier, key: &StateKey, timeout: Duration) -> Option<TierEntry> {
    let until = Instant::now() + timeout;
    loop {
        if let Some(e) = tier.lookup(key) {
            return Some(e);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads `key` into `[offset, offset + len)` and waits for the result.
pub fn read(tier: &mut RemoteTier, key: &StateKey, offset: u64, len: u64) -> Result<(), TierError> {
    let token = tier.submit_read(key, offset, len, now_us())?;
    wait_read(tier, token, Duration::from_secs(10)).expect("every read is reported")
}

/// Writes pages through `tier` and waits until they are stored.
pub fn write_all(tier: &mut RemoteTier, pages: &[(StateKey, Vec<u8>)]) {
    for (k, p) in pages {
        tier.offer(k, [4; 32], p, page_checksum(p)).unwrap();
    }
    assert!(
        tier.flush_writes(Duration::from_secs(20)),
        "writes finished"
    );
    assert_eq!(
        tier.stats().write_errors.total(),
        0,
        "{:?}",
        tier.last_error()
    );
}

/// A direct client for faults (overwrites, flushes, pauses).
pub fn raw_single(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

pub fn raw_cluster(urls: &[String]) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::new(urls.to_vec())
        .unwrap()
        .get_connection()
        .unwrap()
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/redis.sh")
}

/// Nodes this test owns (it may kill or flush them), stopped on drop.
pub struct PrivateRedis {
    dir: tempfile::TempDir,
    pub ports: Vec<u16>,
}

fn port_free(p: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// `n` ports that are free, as are their cluster bus ports (+10000).
fn free_ports(n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    let seed = (std::process::id() as u64 * 7919 + now_us()) % 20_000;
    let mut p = 20_000 + seed as u16;
    while out.len() < n {
        p = if p >= 40_000 { 20_000 } else { p + 1 };
        if port_free(p) && port_free(p + 10_000) {
            out.push(p);
        }
    }
    out
}

impl PrivateRedis {
    fn run(&self, args: &[&str]) {
        let st = Command::new("bash")
            .arg(script())
            .args(args)
            .env("ORBITKV_REDIS_DIR", self.dir.path())
            .status()
            .expect("scripts/redis.sh runs");
        assert!(st.success(), "scripts/redis.sh {args:?} failed");
    }

    pub fn node() -> PrivateRedis {
        let r = PrivateRedis {
            dir: tempfile::tempdir().unwrap(),
            ports: free_ports(1),
        };
        r.run(&["node", &r.ports[0].to_string()]);
        r
    }

    pub fn cluster() -> PrivateRedis {
        let r = PrivateRedis {
            dir: tempfile::tempdir().unwrap(),
            ports: free_ports(3),
        };
        let p: Vec<String> = r.ports.iter().map(u16::to_string).collect();
        r.run(&["cluster", &p[0], &p[1], &p[2]]);
        r
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// SIGKILL the node on `port`.
    pub fn kill(&self, port: u16) {
        self.run(&["kill", &port.to_string()]);
    }

    /// Starts a (standalone) node on `port` again, empty.
    pub fn restart_single(&self, port: u16) {
        self.run(&["node", &port.to_string()]);
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .env("ORBITKV_REDIS_DIR", self.dir.path())
            .status();
    }
}
