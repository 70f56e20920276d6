//! Query round trip through `orbitkv serve`: the socket path against the
//! iceoryx2 hot path, with both raw transports measured in the same run.
//! Not a test: it asserts nothing about time.
//!
//! ```sh
//! cargo build --release --bin orbitkv
//! cargo run --release --example query_roundtrip -- [--iterations 10000] [--sweep] [--only-hot]
//! ```
//!
//! Starts the release manager (`target/release/orbitkv`; `ORBITKV_BIN`
//! overrides), publishes 8 pages from one client, then measures from
//! another:
//!
//! - (a) `Client::call(query)` (prepare: false, a hit; its operation is
//!   released outside the timed region) over the socket path;
//! - (b) the same over the hot path;
//! - (a') (b') query with prepare until `ready` (8 leases in the reply);
//! - (c) a raw iceoryx2 request/response between two processes with the
//!   hot path's message size (128 bytes each way), both sides busy-polling;
//! - (d) a raw Unix-socket ping-pong of 128 bytes between two processes,
//!   blocking reads;
//!
//! and prints p50/p99/p99.9 in microseconds and the ratios. `--sweep` also
//! measures (b) for several client spin budgets, alone and with a third
//! process burning a core (the machine has 2), which is how
//! `DEFAULT_SPIN` was chosen.

use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::time::{Duration, Instant};

use iceoryx2::prelude::{NodeBuilder, SignalHandlingMode};
use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, Event, GroupHashes, PublishPage, SessionHandle};
use orbitkv_ipc::hot::{self, HotRequest, HotResponse, Ipc};
use orbitkv_ipc::{Client, ClientOptions};
use orbitkv_world::driver;

#[path = "../tests/support/port.rs"]
mod port;
use port::with_driver;

const PAGE: u64 = 16;
const BYTES: u64 = 4096;
const PAGES: u64 = 8;
const T: Duration = Duration::from_secs(10);

struct Stats {
    p50: f64,
    p99: f64,
    p999: f64,
}

fn stats(mut xs: Vec<f64>) -> Stats {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |p: f64| xs[((xs.len() as f64 * p) as usize).min(xs.len() - 1)];
    Stats {
        p50: q(0.5),
        p99: q(0.99),
        p999: q(0.999),
    }
}

fn row(name: &str, s: &Stats) {
    println!(
        "{name:<58} p50 {:>8.2} us  p99 {:>9.2} us  p99.9 {:>9.2} us",
        s.p50, s.p99, s.p999
    );
}

fn us(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("iox-echo") => return iox_echo(&args[2], &args[3]),
        Some("uds-echo") => return uds_echo(Path::new(&args[2])),
        Some("burn") => loop {
            std::hint::spin_loop();
        },
        // Only the raw iceoryx2 baseline, one JSON line: the Python
        // benchmark measures it in its own run this way.
        Some("--raw-iceoryx2") => {
            let n: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(10_000);
            let me = std::env::current_exe().unwrap();
            let s = stats(raw_iceoryx2(&me, n / 10 + 100, n));
            println!(
                "{{\"p50_us\": {:.3}, \"p99_us\": {:.3}, \"p999_us\": {:.3}}}",
                s.p50, s.p99, s.p999
            );
            return;
        }
        _ => {}
    }
    let iterations: usize = args
        .iter()
        .position(|a| a == "--iterations")
        .and_then(|i| args.get(i + 1))
        .map_or(10_000, |v| v.parse().expect("--iterations N"));
    let sweep = args.iter().any(|a| a == "--sweep");
    // Only (b), nothing printed but its row: a fixed number of hot queries
    // for profiling the manager (`ORBITKV_BIN` a wrapper that runs it under
    // callgrind; two runs with different counts give the cost per query).
    let only_hot = args.iter().any(|a| a == "--only-hot");
    let me = std::env::current_exe().unwrap();
    let bin = std::env::var_os("ORBITKV_BIN").map_or_else(
        || me.parent().unwrap().parent().unwrap().join("orbitkv"),
        PathBuf::from,
    );
    assert!(
        bin.exists(),
        "{} is missing: cargo build --release --bin orbitkv",
        bin.display()
    );
    if cfg!(debug_assertions) {
        println!("NOTE: a debug build; numbers are several times slower than --release");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut manager = start(&bin, dir.path());
    let socket = dir.path().join("orbitkv.sock");

    let mut a = Client::connect(&socket, "publisher").unwrap();
    publish(&mut a);
    let hot_opts = ClientOptions {
        hot_path: true,
        ..ClientOptions::default()
    };
    let sock_opts = ClientOptions {
        hot_path: false,
        ..ClientOptions::default()
    };
    let mut hotc = Client::connect_with(&socket, "bench-hot", hot_opts.clone()).unwrap();
    assert!(hotc.hot_service().is_some(), "{:?}", hotc.hot_path_error());
    let mut sockc = Client::connect_with(&socket, "bench-socket", sock_opts).unwrap();
    assert!(sockc.hot_service().is_none());
    let sh = setup(&mut hotc);
    let ss = setup(&mut sockc);
    let warm = iterations / 10 + 100;

    println!(
        "query round trip, {iterations} iterations, {} CPUs, spin budget {:?}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        orbitkv_ipc::client::DEFAULT_SPIN
    );
    if only_hot {
        let b_ = stats(query_loop(&mut hotc, sh, false, 0, iterations));
        row("(b)  hot path:    call(query), hit", &b_);
        drop((a, hotc, sockc));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(manager.id() as i32, libc::SIGTERM) };
        let _ = manager.wait();
        return;
    }
    let a_ = stats(query_loop(&mut sockc, ss, false, warm, iterations));
    let b_ = stats(query_loop(&mut hotc, sh, false, warm, iterations));
    let a2 = stats(query_loop(&mut sockc, ss, true, warm, iterations / 2));
    let b2 = stats(query_loop(&mut hotc, sh, true, warm, iterations / 2));
    let c_ = stats(raw_iceoryx2(&me, warm, iterations));
    let d_ = stats(raw_uds(&me, warm, iterations));
    println!();
    row("(a)  socket path: call(query), hit", &a_);
    row("(b)  hot path:    call(query), hit", &b_);
    row(
        "(a') socket path: query(prepare) until ready, 8 leases",
        &a2,
    );
    row(
        "(b') hot path:    query(prepare) until ready, 8 leases",
        &b2,
    );
    row("(c)  raw iceoryx2 request/response, 128 B, busy-poll", &c_);
    row("(d)  raw Unix-socket ping-pong, 128 B, blocking", &d_);
    println!();
    let r = |n: &str, x: &Stats, y: &Stats| {
        println!(
            "{n:<46} p50 {:>6.2}x  p99 {:>6.2}x",
            x.p50 / y.p50,
            x.p99 / y.p99
        )
    };
    r("(b)/(a)  hot vs socket", &b_, &a_);
    r("(b')/(a') hot vs socket", &b2, &a2);
    r("(b)/(c)  hot vs raw iceoryx2 (goal p50 <= 2x)", &b_, &c_);
    r("(b')/(c) hot until ready vs raw iceoryx2", &b2, &c_);
    r("(a)/(d)  socket vs raw socket", &a_, &d_);
    r("(b)/(d)  hot vs raw socket", &b_, &d_);
    r("(c)/(d)  raw iceoryx2 vs socket", &c_, &d_);

    if sweep {
        println!("\nspin budget sweep, (b) hot path query (hit):");
        for burn in [false, true] {
            let mut burner = burn.then(|| {
                Proc::new(&me)
                    .arg("burn")
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            });
            let third = if burn {
                ", a third process burns a core"
            } else {
                ""
            };
            for spin_us in [0u64, 5, 10, 20, 50, 100, 200] {
                hotc.set_spin_fixed(Duration::from_micros(spin_us));
                let s = stats(query_loop(&mut hotc, sh, false, warm, iterations / 2));
                row(&format!("fixed spin {spin_us:>3} us{third}"), &s);
            }
            hotc.set_spin(orbitkv_ipc::client::DEFAULT_SPIN);
            let s = stats(query_loop(&mut hotc, sh, false, warm, iterations / 2));
            row(
                &format!(
                    "adaptive, at most {:?}{third}",
                    orbitkv_ipc::client::DEFAULT_SPIN
                ),
                &s,
            );
            sockc.set_spin(orbitkv_ipc::client::DEFAULT_SPIN);
            let s = stats(query_loop(&mut sockc, ss, false, warm, iterations / 2));
            row(&format!("(a) socket path, adaptive{third}"), &s);
            if let Some(b) = burner.as_mut() {
                let _ = b.kill();
                let _ = b.wait();
            }
        }
        hotc.set_spin(orbitkv_ipc::client::DEFAULT_SPIN);
    }
    drop((a, hotc, sockc));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(manager.id() as i32, libc::SIGTERM) };
    let _ = manager.wait();
}

fn start(bin: &Path, dir: &Path) -> Child {
    let socket = dir.join("orbitkv.sock");
    let config = dir.join("orbitkv.toml");
    // `ORBITKV_BENCH_SERVE="socket_poll_interval_us = 1"`: extra `[serve]`
    // lines, to compare the loop's settings in otherwise equal runs.
    let serve = std::env::var("ORBITKV_BENCH_SERVE").unwrap_or_default();
    std::fs::write(
        &config,
        format!("[serve]\n{serve}\n[dram]\nfirst_touch = false\nextent_bytes = 65536\n"),
    )
    .unwrap();
    let child = Proc::new(bin)
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram",
            "64MiB",
            "--config",
            config.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .env_remove("ORBITKV_HOT_PATH")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Generous: a manager under valgrind takes seconds to come up.
    let deadline = Instant::now() + 6 * T;
    while Client::connect(&socket, "probe").is_err() {
        assert!(Instant::now() < deadline, "manager did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Registers "bench" (the test engines' layout) and opens a session.
fn setup(c: &mut Client) -> SessionHandle {
    let register = driver::register_command("bench", [3; 32], driver::dense(), 1, PAGE, BYTES);
    with_driver(c, T, |d| {
        d.register(register)?;
        d.open("bench")
    })
    .unwrap()
}

fn hashes() -> Vec<NativeHash> {
    (0..PAGES + 1)
        .map(|i| NativeHash::from_u64(0xbe_0000 + i))
        .collect()
}

fn publish(a: &mut Client) {
    let s = setup(a);
    let done = with_driver(a, T, |d| {
        let region = d.region(s, (0, 0), PAGES as u32)?.region;
        let dps = d.alloc_many(s, region, 0..PAGES as u32)?;
        let pages = dps
            .into_iter()
            .zip(hashes())
            .map(|(device_page, hash)| PublishPage {
                rank: 0,
                group: 0,
                hash,
                device_page,
            })
            .collect();
        d.publish(s, 1, pages)
    })
    .unwrap();
    assert_eq!(done.inserted, PAGES, "{done:?}");
}

/// Timed: `call(query)` (or query with prepare until `ready`); untimed:
/// releasing the operation.
fn query_loop(c: &mut Client, s: SessionHandle, prepare: bool, warm: usize, n: usize) -> Vec<f64> {
    let q = Command::Query {
        session: s,
        request: 1,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes(),
        }],
        origin: 0,
        prompt_len: (PAGES + 1) * PAGE,
        expect_namespaces: vec![],
        prepare,
        speculative: false,
    };
    let mut xs = Vec::with_capacity(n);
    for i in 0..warm + n {
        let t = Instant::now();
        let e = c.call(q.clone(), T).unwrap();
        let Event::QueryResult {
            operation,
            selected: Some(_),
            ..
        } = e
        else {
            panic!("{e:?}")
        };
        if prepare {
            let r = c
                .wait_event(T, |e| {
                    matches!(e, Event::Ready { operation: o, .. } | Event::Miss { operation: o, .. } if *o == operation)
                })
                .unwrap()
                .unwrap();
            assert!(
                matches!(&r, Event::Ready { leases, .. } if leases.len() == PAGES as usize),
                "{r:?}"
            );
        }
        let dt = t.elapsed();
        if i >= warm {
            xs.push(us(dt));
        }
        c.submit(Command::Release {
            session: s,
            operation,
        })
        .unwrap();
        c.wait_event(
            T,
            |e| matches!(e, Event::Released { operation: o } if *o == operation),
        )
        .unwrap()
        .unwrap();
    }
    xs
}

fn bench_prefix() -> String {
    format!("iox2_okvbench{:08x}_", std::process::id())
}

fn iox_echo(prefix: &str, service: &str) {
    let config = hot::iox_config(prefix).unwrap();
    let node = NodeBuilder::new()
        .config(&config)
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<Ipc>()
        .unwrap();
    let svc = node
        .service_builder(&service.try_into().unwrap())
        .request_response::<HotRequest, HotResponse>()
        .create()
        .unwrap();
    let server = svc.server_builder().create().unwrap();
    let mut idle = Instant::now();
    // Busy-poll; exit when nobody asked for 2 s.
    while idle.elapsed() < Duration::from_secs(2) {
        while let Some(r) = server.receive().unwrap() {
            let q = *r.payload();
            r.send_copy(HotResponse {
                tag: q.tag,
                ..HotResponse::default()
            })
            .unwrap();
            idle = Instant::now();
        }
        std::hint::spin_loop();
    }
}

fn raw_iceoryx2(me: &Path, warm: usize, n: usize) -> Vec<f64> {
    hot::quiet_iceoryx2_logs();
    let prefix = bench_prefix();
    let service = "orbitkv/bench/raw";
    let mut child = Proc::new(me)
        .args(["iox-echo", &prefix, service])
        .spawn()
        .unwrap();
    let config = hot::iox_config(&prefix).unwrap();
    let node = NodeBuilder::new()
        .config(&config)
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<Ipc>()
        .unwrap();
    let deadline = Instant::now() + T;
    let svc = loop {
        match node
            .service_builder(&service.try_into().unwrap())
            .request_response::<HotRequest, HotResponse>()
            .open()
        {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{e:?}"),
        }
    };
    let client = svc.client_builder().create().unwrap();
    // Wait for the server port.
    std::thread::sleep(Duration::from_millis(100));
    let mut xs = Vec::with_capacity(n);
    for i in 0..warm + n {
        let t = Instant::now();
        let p = client
            .send_copy(HotRequest {
                tag: i as u64,
                ..HotRequest::default()
            })
            .unwrap();
        loop {
            if let Some(r) = p.receive().unwrap() {
                assert_eq!(r.payload().tag, i as u64);
                break;
            }
            std::hint::spin_loop();
        }
        let dt = t.elapsed();
        drop(p);
        if i >= warm {
            xs.push(us(dt));
        }
    }
    drop((client, svc, node));
    let _ = child.wait();
    hot::remove_files_with_prefix(&prefix);
    xs
}

fn uds_echo(path: &Path) {
    let l = UnixListener::bind(path).unwrap();
    let (mut s, _) = l.accept().unwrap();
    let mut b = [0u8; 128];
    while s.read_exact(&mut b).is_ok() {
        if s.write_all(&b).is_err() {
            break;
        }
    }
}

fn raw_uds(me: &Path, warm: usize, n: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("echo.sock");
    let mut child = Proc::new(me)
        .args(["uds-echo", path.to_str().unwrap()])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + T;
    let mut s = loop {
        match UnixStream::connect(&path) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{e}"),
        }
    };
    let mut b = [7u8; 128];
    let mut xs = Vec::with_capacity(n);
    for i in 0..warm + n {
        let t = Instant::now();
        s.write_all(&b).unwrap();
        s.read_exact(&mut b).unwrap();
        let dt = t.elapsed();
        if i >= warm {
            xs.push(us(dt));
        }
    }
    drop(s);
    let _ = child.wait();
    xs
}
