//! The operator verbs against a real `orbitkv serve`: `orbitkv health`
//! (exit codes for container probes) and `orbitkv lookup` (where a
//! prompt's pages are; nothing leased).

mod support;
use support::*;

use std::path::Path;
use std::process::{Command as Proc, Output};
use std::time::Duration;

use orbitkv_components::NativeHash;
use orbitkv_ipc::Client;

fn orbitkv(args: &[&str]) -> Output {
    Proc::new(env!("CARGO_BIN_EXE_orbitkv"))
        .args(args)
        .env_remove("ORBITKV_SOCKET")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0x4200 + i)).collect()
}

fn hex(h: &NativeHash) -> String {
    serde_json::to_value(h)
        .unwrap()
        .as_str()
        .unwrap()
        .to_owned()
}

fn payload(i: u64) -> Vec<u8> {
    vec![i as u8 + 1; BYTES as usize]
}

fn sock(m: &Manager) -> &str {
    m.socket.to_str().unwrap()
}

#[test]
fn health_exit_codes_follow_liveness_and_readiness() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let o = orbitkv(&["health", "--socket", sock(&m)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).starts_with("live and ready"), "{}", text(&o));
    let o = orbitkv(&["health", "--socket", sock(&m), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ready"], true, "{v}");
    assert_eq!(v["health"]["overdue_operations"], 0, "{v}");

    // Nothing at the path: not live.
    let gone = dir.path().join("nobody.sock");
    let o = orbitkv(&["health", "--socket", gone.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).starts_with("not live"), "{}", text(&o));
    let o = orbitkv(&["health", "--live", "--socket", gone.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));

    // A manager whose remote tier is down answers but is not ready; as a
    // liveness probe it passes.
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let config = remote_config(dir.path(), "");
    let r = Manager::start(dir.path(), "remote", "16MiB", &config, &["--remote", &dead]);
    let deadline = std::time::Instant::now() + T;
    let o = loop {
        // The breaker opens after the first failed attempts.
        let o = orbitkv(&["health", "--socket", sock(&r)]);
        if o.status.code() != Some(0) || std::time::Instant::now() > deadline {
            break o;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("tiers down: remote"), "{}", text(&o));
    let o = orbitkv(&["health", "--live", "--socket", sock(&r)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    // Bad flags: 2, as every command.
    let o = orbitkv(&["health", "--timeout-ms", "soon"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn lookup_finds_the_stored_prefix_per_tier_and_leases_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut a = Client::connect(&m.socket, "engine").unwrap();
    publish_four(&mut a, &hashes(4), payload);

    // Five hashes: the first four are stored (in DRAM), the fifth not.
    let mut args = vec![
        "lookup",
        "--socket",
        sock(&m),
        "--instance",
        "llama",
        "--json",
    ];
    let hs: Vec<String> = hashes(5).iter().map(hex).collect();
    args.extend(hs.iter().map(String::as_str));
    let o = orbitkv(&args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ns = &v["namespaces"];
    assert_eq!(ns.as_array().unwrap().len(), 1, "one rank: {v}");
    assert_eq!(ns[0]["prefix_pages"], 4, "{v}");
    assert_eq!(ns[0]["restorable_tokens"], 4 * PAGE, "{v}");
    assert_eq!(ns[0]["prefix_by_tier"]["dram"], 4, "{v}");
    assert_eq!(
        ns[0]["found"],
        serde_json::json!(["dram", "dram", "dram", "dram", null]),
        "{v}"
    );

    // By namespace, as text; a gap at the start means nothing restorable.
    let namespace = ns[0]["namespace"].as_str().unwrap().to_owned();
    let o = orbitkv(&[
        "lookup",
        "--socket",
        sock(&m),
        "--namespace",
        &namespace,
        &hs[4],
        &hs[0],
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "{namespace} (tp 0, pp 0): 0 of 2 pages from the start, 0 tokens"
        )),
        "{}",
        text(&o)
    );

    // Nothing was leased or left open by either lookup.
    let s = a.inspect(T).unwrap();
    assert_eq!((s.leases, s.operations, s.bytes_reserved), (0, 0, 0));

    // Refusals: an unknown instance, a hash that is not hex, no target.
    let o = orbitkv(&["lookup", "--socket", sock(&m), "--instance", "nope", &hs[0]]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("no instance \"nope\""), "{}", text(&o));
    let o = orbitkv(&["lookup", "--socket", sock(&m), "--instance", "llama", "xyz"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = orbitkv(&["lookup", "--socket", sock(&m), &hs[0]]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    // The manager still serves after them.
    assert!(Client::connect(Path::new(sock(&m)), "after").is_ok());
}

#[test]
fn routers_post_lookups_and_get_restorable_tokens_per_tier_within_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let config = BASE_CONFIG.replacen(
        "[serve]\n",
        "[serve]\nlookup_per_second = 5\nlookup_max_body_bytes = 4096\n",
        1,
    );
    let m = Manager::start(dir.path(), "router", "16MiB", &config, &[]);
    let mut a = Client::connect(&m.socket, "engine").unwrap();
    publish_four(&mut a, &hashes(4), payload);
    let hs: Vec<String> = hashes(6).iter().map(hex).collect();
    let ask = |body: serde_json::Value| {
        let (status, text) = m.post("/lookup", body.to_string().as_bytes());
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status} {text:?}: {e}"));
        (status, v)
    };
    // Four of six pages stored; the prompt is longer than the six pages.
    let (status, v) = ask(serde_json::json!({"instance": "llama", "hashes": hs}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["restorable"]["tokens"], 4 * PAGE, "{v}");
    assert_eq!(
        v["restorable"]["by_tier"],
        serde_json::json!({"dram": 4 * PAGE}),
        "{v}"
    );
    assert_eq!(v["restorable"]["miss"], serde_json::Value::Null, "{v}");
    // A prompt of exactly four pages: its last token is the engine's.
    let (_, v) =
        ask(serde_json::json!({"instance": "llama", "hashes": hs[..4], "prompt_len": 4 * PAGE}));
    assert_eq!(v["restorable"]["tokens"], 3 * PAGE, "{v}");
    // An unknown instance is the manager's refusal, in JSON.
    let (status, v) = ask(serde_json::json!({"instance": "nope", "hashes": hs}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("no instance"), "{v}");
    // Past the rate (5 a second, 4 used): refused with 429 and counted.
    let mut limited = 0;
    for _ in 0..10 {
        let (status, _) = ask(serde_json::json!({"instance": "llama", "hashes": hs}));
        limited += usize::from(status == 429);
    }
    assert!(limited >= 4, "{limited} of 10 refused at 5 a second");
    // Malformed and oversized bodies are typed refusals.
    std::thread::sleep(Duration::from_millis(1200));
    let (status, text) = m.post("/lookup", b"{not json");
    assert_eq!(status, 400, "{text}");
    let big = serde_json::json!({"instance": "llama", "hashes": vec![&hs[0]; 400]});
    let (status, text) = m.post("/lookup", big.to_string().as_bytes());
    assert_eq!(status, 413, "{text}");
    let (status, _) = {
        let mut s = std::net::TcpStream::connect(&m.metrics).unwrap();
        use std::io::{Read as _, Write as _};
        s.write_all(b"GET /lookup HTTP/1.0\r\n\r\n").unwrap();
        let mut t = String::new();
        s.read_to_string(&mut t).unwrap();
        (t.split(' ').nth(1).unwrap().to_owned(), t)
    };
    assert_eq!(status, "405");
    assert!(m.metric("lookups_total{outcome=\"rate_limited\"}").unwrap() >= 4);
    assert_eq!(m.metric("lookups_total{outcome=\"too_large\"}"), Some(1));
    assert_eq!(m.metric("lookups_total{outcome=\"bad_request\"}"), Some(1));
    assert_eq!(m.metric("lookups_total{outcome=\"refused\"}"), Some(1));
    // Nothing was leased or left open.
    let s = a.inspect(T).unwrap();
    assert_eq!((s.leases, s.operations, s.bytes_reserved), (0, 0, 0));
}

#[test]
fn clear_drops_an_instance_from_every_tier_and_waits_for_its_leases() {
    use orbitkv_components::api::{Command, Event, GroupHashes};
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let m = Manager::start(
        dir.path(),
        "orbitkv",
        "16MiB",
        BASE_CONFIG,
        &["--ssd", &format!("{}:256MiB", ssd.display())],
    );
    let mut a = Client::connect(&m.socket, "engine").unwrap();
    publish_four(&mut a, &hashes(4), payload);
    let hs: Vec<String> = hashes(4).iter().map(hex).collect();
    let lookup = |extra: &[&str]| {
        let mut args = vec![
            "lookup",
            "--socket",
            sock(&m),
            "--instance",
            "llama",
            "--json",
        ];
        args.extend(extra);
        let o = orbitkv(&args);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["namespaces"][0]["prefix_pages"].as_u64().unwrap()
    };
    let all: Vec<&str> = hs.iter().map(String::as_str).collect();
    assert_eq!(lookup(&all), 4);

    // A recovery holds leases on the pages: the clear is refused whole.
    let (s, _region) = open(&mut a);
    let qr = a
        .call(
            Command::Query {
                session: s,
                request: 3,
                groups: vec![GroupHashes {
                    group: 0,
                    hashes: hashes(5),
                }],
                origin: 0,
                prompt_len: 5 * PAGE,
                expect_namespaces: vec![],
                prepare: true,
                speculative: false,
            },
            T,
        )
        .unwrap();
    let Event::QueryResult { operation, .. } = qr else {
        panic!("{qr:?}")
    };
    a.wait_event(
        T,
        |e| matches!(e, Event::Ready { operation: o, .. } if *o == operation),
    )
    .unwrap()
    .expect("ready");
    let o = orbitkv(&["clear", "--socket", sock(&m), "--instance", "llama"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("4 pages of the namespaces are leased"),
        "{}",
        text(&o)
    );
    assert_eq!(lookup(&all), 4, "a refused clear dropped nothing");

    // Released, the clear drops them from DRAM and asks the SSD tier too.
    a.submit(Command::Release {
        session: s,
        operation,
    })
    .unwrap();
    a.wait_event(
        T,
        |e| matches!(e, Event::Released { operation: o } if *o == operation),
    )
    .unwrap()
    .expect("released");
    let o = orbitkv(&[
        "clear",
        "--socket",
        sock(&m),
        "--instance",
        "llama",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["dram_pages"], 4, "{v}");
    assert_eq!(v["tiers"][0]["tier"], "ssd", "{v}");
    assert_eq!(v["tiers"][0]["pages"], 0, "nothing was demoted: {v}");
    assert_eq!(lookup(&all), 0);
    let s = a.inspect(T).unwrap();
    assert_eq!((s.pages, s.leases, s.bytes_reserved), (0, 0, 0));

    // Bad input: no such instance, a namespace that is not hex.
    let o = orbitkv(&["clear", "--socket", sock(&m), "--instance", "nope"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = orbitkv(&["clear", "--socket", sock(&m), "--namespace", "zz"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
