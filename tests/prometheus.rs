//! The Grafana dashboard and the alerting rules against a real Prometheus
//! (Debian's `prometheus` package): a Prometheus on loopback scrapes a real
//! `orbitkv serve` (DRAM, an SSD tier, and a remote tier whose Redis is
//! down, so its breaker series exist) while clients publish, restore, miss
//! and get refused; every metric the dashboard's queries name must then be
//! a series in Prometheus, and every rule in `deploy/prometheus/rules.yml`
//! must load and evaluate. `promtool check rules` and `promtool test rules`
//! (the alerts' unit tests, `rules_test.yml`) pass.
//!
//! Without `prometheus` or `promtool` the test is skipped loudly, unless
//! `ORBITKV_REQUIRE_PROMETHEUS` is set (`scripts/test.sh` sets it).

mod support;
use support::*;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, Event, GroupHashes, SessionHandle};
use orbitkv_ipc::Client;

/// Dashboard metrics that another branch adds to the manager and this
/// build may not export yet (`orbitkv_refusals_total{command,reason}`).
/// Excused only while the manager does not declare them at all; once it
/// does, they are checked like every other name.
const PENDING: &[&str] = &["orbitkv_refusals_total"];

/// Scrapes (every second) are quick, but the machine may be loaded.
const WAIT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `name` on PATH, or `None` after a loud skip message.
fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("ORBITKV_REQUIRE_PROMETHEUS").is_none(),
            "{name} is required here (ORBITKV_REQUIRE_PROMETHEUS is set) but not on PATH: \
             apt-get install prometheus"
        );
        eprintln!(
            "\n!!!! SKIPPED the Prometheus test: {name} is not on PATH \
             (apt-get install prometheus; scripts/test.sh installs it)\n"
        );
    }
    found
}

/// A plain HTTP/1.0 GET on loopback: (status, body).
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(T)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Prometheus's API: the `data` of a successful answer.
fn api(addr: &str, path: &str) -> Option<serde_json::Value> {
    let (status, body) = get(addr, path)?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    (status == 200 && v["status"] == "success").then(|| v["data"].clone())
}

fn wait_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every `orbitkv_*` name in the dashboard's queries.
fn dashboard_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("deploy/grafana/orbitkv.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(s)) => {
                            out.push(s.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dash, &mut exprs);
    assert!(exprs.len() > 20, "the dashboard's queries: {exprs:?}");
    let mut names = BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(at) = rest.find("orbitkv_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_owned());
            rest = &tail[end..];
        }
    }
    names
}

/// The metric families the manager declares (`# TYPE` lines), whether or
/// not they have samples yet.
fn declared(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

/// The family a series name belongs to.
fn family<'a>(series: &'a str, families: &BTreeSet<String>) -> Option<&'a str> {
    if families.contains(series) {
        return Some(series);
    }
    ["_total", "_bucket", "_count", "_sum", "_created"]
        .iter()
        .filter_map(|suffix| series.strip_suffix(suffix))
        .find(|f| families.contains(*f))
}

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_prometheus(bin: &Path, dir: &Path, target: &str, web: &str) -> Prometheus {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: orbitkv\n    static_configs:\n      - targets: [\"{target}\"]\n",
            rules = root().join("deploy/prometheus/rules.yml").display()
        ),
    )
    .unwrap();
    let child = Proc::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Prometheus(child)
}

fn hashes(seed: u64, n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(seed + i)).collect()
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(7).wrapping_add(i as u8 * 11 + 5))
        .collect()
}

fn query(s: SessionHandle, hashes: Vec<NativeHash>) -> Command {
    let pages = hashes.len() as u64;
    Command::Query {
        session: s,
        request: 9,
        groups: vec![GroupHashes { group: 0, hashes }],
        origin: 0,
        prompt_len: pages * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    }
}

/// Publishes, restores (a hit), misses and gets refused, so the counters,
/// histograms and labelled families all have samples.
fn traffic(socket: &Path) {
    let mut a = Client::connect(socket, "publisher").unwrap();
    publish_four(&mut a, &hashes(0x9900, 4), payload);
    let mut b = Client::connect(socket, "restorer").unwrap();
    register(&mut b);
    let (s, region) = open(&mut b);
    let Event::QueryResult {
        operation,
        selected: Some(_),
        ..
    } = b.call(query(s, hashes(0x9900, 5)), T).unwrap()
    else {
        panic!("no hit")
    };
    b.wait_event(
        T,
        |e| matches!(e, Event::Ready { operation: o, .. } if *o == operation),
    )
    .unwrap()
    .expect("ready");
    restore_four(&mut b, s, region, operation, 0, payload);
    // A miss (nothing stored under these hashes) and a refusal (no such
    // instance).
    let miss = b.call(query(s, hashes(0x7700, 3)), T).unwrap();
    assert!(
        matches!(miss, Event::QueryResult { selected: None, .. }),
        "{miss:?}"
    );
    let refused = b
        .call(
            Command::OpenSession {
                instance: "no-such-instance".into(),
            },
            T,
        )
        .unwrap();
    assert!(matches!(refused, Event::Rejected { .. }), "{refused:?}");
}

#[test]
fn prometheus_scrapes_every_series_the_dashboard_uses_and_loads_the_rules() {
    let (Some(prometheus), Some(promtool)) = (tool("prometheus"), tool("promtool")) else {
        return;
    };
    let rules_dir = root().join("deploy/prometheus");
    for args in [
        &["check", "rules", "rules.yml"][..],
        &["test", "rules", "rules_test.yml"],
    ] {
        let out = Proc::new(&promtool)
            .args(args)
            .current_dir(&rules_dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let dead_redis = format!("redis://127.0.0.1:{}", free_port());
    let m = Manager::start(
        dir.path(),
        "orbitkv",
        "16MiB",
        &remote_config(dir.path(), ""),
        &[
            "--ssd",
            &format!("{}:256MiB", ssd.display()),
            "--remote",
            &dead_redis,
        ],
    );
    traffic(&m.socket);

    let web = format!("127.0.0.1:{}", free_port());
    let _p = start_prometheus(&prometheus, dir.path(), &m.metrics, &web);
    wait_until("Prometheus ready", || {
        get(&web, "/-/ready").filter(|(s, _)| *s == 200)
    });

    let wanted = dashboard_metrics();
    let families = declared(&m.scrape());
    let mut checked = Vec::new();
    for name in &wanted {
        if family(name, &families).is_none() {
            assert!(
                PENDING.contains(&name.as_str()),
                "the dashboard uses {name}, which the manager does not export"
            );
            eprintln!("not checked: {name} (PENDING: this build does not export it yet)");
            continue;
        }
        checked.push(name.clone());
    }
    // The manager exports them; Prometheus must have scraped a series of
    // each (the names API lists names with samples only).
    let deadline = Instant::now() + WAIT;
    loop {
        let names = api(&web, "/api/v1/label/__name__/values").unwrap_or_default();
        let have: BTreeSet<&str> = names
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        let missing: Vec<&String> = checked
            .iter()
            .filter(|n| !have.contains(n.as_str()))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not in Prometheus within {WAIT:?}: {missing:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(checked.len() >= 30, "{checked:?}");

    // The scrape itself is healthy, and every rule loaded and evaluated
    // against the real series without an error.
    wait_until("the target up", || {
        let t = api(&web, "/api/v1/targets")?;
        let active = t["activeTargets"].as_array()?;
        (active.len() == 1 && active[0]["health"] == "up").then_some(())
    });
    let rules = wait_until("every rule evaluated", || {
        let r = api(&web, "/api/v1/rules")?;
        let rules: Vec<serde_json::Value> = r["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = rules.iter().all(|r| {
            r["health"] == "ok"
                && r["lastEvaluation"]
                    .as_str()
                    .is_some_and(|t| !t.starts_with("0001"))
        });
        (evaluated && !rules.is_empty()).then_some(rules)
    });
    let names: BTreeSet<&str> = rules.iter().filter_map(|r| r["name"].as_str()).collect();
    for alert in [
        "OrbitKVChecksumFailures",
        "OrbitKVRemoteDown",
        "OrbitKVHighMissRate",
        "OrbitKVPoolFull",
        "OrbitKVStalledOperations",
    ] {
        assert!(names.contains(alert), "{alert} not loaded: {names:?}");
    }
    // The remote tier's Redis is down: its breaker says so (the alert
    // fires after 2 minutes; its expression already holds).
    wait_until("orbitkv_remote_up == 0 in Prometheus", || {
        let v = api(&web, "/api/v1/query?query=orbitkv_remote_up")?;
        let r = v["result"].as_array()?;
        (r.len() == 1 && r[0]["value"][1] == "0").then_some(())
    });
}
