//! `orbitkv serve` as a real subprocess, driven through the Rust client:
//! exact bytes across two connections through shared memory, a client that
//! vanishes mid-restore, malformed frames, and a manager restart.

mod support;
use support::*;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{
    Command, CommandError, Event, GroupHashes, PagePos, RestoreTarget, SessionHandle,
};
use orbitkv_ipc::Client;

struct Manager {
    child: Child,
    socket: PathBuf,
    metrics: String,
}

fn start(dir: &Path) -> Manager {
    let socket = dir.join("orbitkv.sock");
    let config = dir.join("orbitkv.toml");
    std::fs::write(
        &config,
        "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nextent_bytes = 65536\n",
    )
    .unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let child = Proc::new(env!("CARGO_BIN_EXE_orbitkv"))
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram",
            "16MiB",
            "--config",
            config.to_str().unwrap(),
        ])
        .args(["--metrics-addr", &metrics])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + T;
    while Client::connect(&socket, "probe").is_err() {
        assert!(Instant::now() < deadline, "manager did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Manager {
        child,
        socket,
        metrics,
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        // A failed test must not leave a manager running.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Manager {
    fn stop(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        assert!(!self.socket.exists(), "socket file removed on shutdown");
    }

    /// A gauge from `/metrics`; `None` until the first snapshot.
    fn metric(&self, name: &str) -> Option<u64> {
        let mut s = std::net::TcpStream::connect(&self.metrics).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        let line = body
            .lines()
            .find(|l| l.starts_with(&format!("orbitkv_{name} ")))?;
        line.rsplit(' ').next()?.parse().ok()
    }

    /// Waits until the metrics (refreshed every 100 ms) show `value`.
    fn wait_metric(&self, name: &str, value: u64) {
        let deadline = Instant::now() + T;
        while self.metric(name) != Some(value) {
            assert!(
                Instant::now() < deadline,
                "{name} never reached {value} (now {:?})",
                self.metric(name)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(31).wrapping_add(i as u8 * 7 + 1))
        .collect()
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0xabc0 + i)).collect()
}

fn query(s: SessionHandle, pages: u64) -> Command {
    Command::Query {
        session: s,
        request: 1,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes(pages),
        }],
        origin: 0,
        prompt_len: pages * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    }
}

#[test]
fn serve_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    // The socket is private to its user.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&m.socket).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Client A publishes 4 pages from its device region.
    let mut a = Client::connect(&m.socket, "engine-a").unwrap();
    publish_four(&mut a, &hashes(4), payload);

    // Client B, another connection, restores them.
    let mut b = Client::connect(&m.socket, "engine-b").unwrap();
    register(&mut b);
    let (sb, rb) = open(&mut b);
    let qr = b.call(query(sb, 5), T).unwrap();
    let Event::QueryResult {
        operation,
        selected: Some(sel),
        ..
    } = qr
    else {
        panic!("{qr:?}")
    };
    assert_eq!(sel, 4 * PAGE);
    let ready = b
        .wait_event(
            T,
            |e| matches!(e, Event::Ready { operation: o, .. } if *o == operation),
        )
        .unwrap()
        .unwrap();
    let Event::Ready { leases, .. } = ready else {
        unreachable!()
    };
    // Zero copy: the leased pages are readable straight from the shared pool.
    for l in &leases {
        assert_eq!(b.page(l).unwrap(), &payload(l.pos.page_end / PAGE - 1)[..]);
    }
    let mut targets = Vec::new();
    for i in 0..4u64 {
        let dp = alloc(&mut b, sb, rb, 10 + i as u32);
        targets.push(RestoreTarget {
            pos: PagePos {
                rank: 0,
                group: 0,
                page_end: (i + 1) * PAGE,
            },
            device_page: dp,
        });
    }
    b.submit(Command::Restore {
        session: sb,
        operation,
        targets,
        retained: vec![],
    })
    .unwrap();
    let done = b
        .wait_event(T, |e| {
            matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
        })
        .unwrap()
        .unwrap();
    assert!(
        matches!(done, Event::RestoreDone { pages: 4, .. }),
        "{done:?}"
    );
    for i in 0..4u64 {
        let at = ((10 + i) * BYTES) as usize;
        assert_eq!(
            &b.region_mut(rb).unwrap()[at..at + BYTES as usize],
            &payload(i)[..],
            "page {i}"
        );
    }
    m.wait_metric("leases", 0);

    // A client that vanishes holding leases: its session closes, its leases
    // and reserved bytes return.
    {
        let mut c = Client::connect(&m.socket, "doomed").unwrap();
        let (sc, _) = open(&mut c);
        let _ = c.call(query(sc, 5), T).unwrap();
        c.wait_event(T, |e| matches!(e, Event::Ready { .. }))
            .unwrap()
            .unwrap();
        m.wait_metric("leases", 4);
        m.wait_metric("bytes_reserved", 4 * BYTES);
    } // dropped: the connection closes
    m.wait_metric("leases", 0);
    m.wait_metric("bytes_reserved", 0);

    // Malformed input closes only the offending connection.
    let mut bad = Client::connect(&m.socket, "fuzzer").unwrap();
    bad.send_raw(b"GARBAGE-NOT-A-FRAME!").unwrap();
    let err = bad.wait_event(T, |_| true).unwrap_err();
    assert!(err.to_string().contains("magic"), "{err}");
    let mut big = Client::connect(&m.socket, "big").unwrap();
    let mut frame = orbitkv_ipc::frame::header(orbitkv_ipc::Kind::Submit, 8);
    frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    big.send_raw(&frame).unwrap();
    assert!(
        big.wait_event(T, |_| true)
            .unwrap_err()
            .to_string()
            .contains("exceeds")
    );
    let mut junk = Client::connect(&m.socket, "junk").unwrap();
    junk.send_raw(&orbitkv_ipc::frame::encode(
        orbitkv_ipc::Kind::Submit,
        &serde_json::json!({"tag": 1, "command": {"command": "teleport"}}),
    ))
    .unwrap();
    assert!(
        junk.wait_event(T, |_| true)
            .unwrap_err()
            .to_string()
            .contains("Submit")
    );
    // A well-formed command with a bad handle is a typed refusal, not a close.
    let r = b
        .call(
            query(
                SessionHandle {
                    id: 1,
                    epoch: 1,
                    incarnation: 1,
                },
                2,
            ),
            T,
        )
        .unwrap();
    assert!(
        matches!(
            r,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(a.ping().unwrap() < T);
    assert!(b.ping().unwrap() < T);

    // Restart: old handles are stale; reconnecting works.
    let old_incarnation = b.incarnation();
    drop((a, b, bad, big, junk));
    m.stop();
    let m = start(dir.path());
    let mut b = Client::connect(&m.socket, "engine-b").unwrap();
    assert_ne!(b.incarnation(), old_incarnation);
    let r = b.call(query(sb, 2), T).unwrap();
    assert!(
        matches!(
            r,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{r:?}"
    );
    register(&mut b);
    let (sb2, _) = open(&mut b);
    let r = b.call(query(sb2, 5), T).unwrap();
    // DRAM did not survive the restart (no SSD tier configured).
    assert!(
        matches!(r, Event::QueryResult { miss: Some(_), .. }),
        "{r:?}"
    );
    m.stop();
}
