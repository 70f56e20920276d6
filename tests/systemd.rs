//! `orbitkv serve` under systemd socket activation, through Debian's
//! `systemd-socket-activate` (the sd_listen_fds protocol, as a `.socket`
//! unit with `Accept=no` uses it): the socket exists before the manager
//! does, the first client's connection starts it, it serves that client on
//! the passed socket (a publish and a restore, exact bytes), reports
//! `READY=1` on `NOTIFY_SOCKET`, and leaves systemd's socket in place when
//! it stops. Misconfigured sockets (others may connect, two sockets) stop
//! it with a message naming the `.socket` setting.
//!
//! Without `systemd-socket-activate` (Debian: `apt-get install systemd`)
//! the tests are skipped loudly, unless `ORBITKV_REQUIRE_SYSTEMD` is set
//! (`scripts/test.sh` sets it), when they fail.

mod support;
use support::*;

use std::io::Read as _;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, Event, GroupHashes};
use orbitkv_ipc::Client;

/// `systemd-socket-activate` on PATH, or `None` after a loud skip message.
fn activator(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("systemd-socket-activate"))
            .find(|f| f.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("ORBITKV_REQUIRE_SYSTEMD").is_none(),
            "{test}: systemd-socket-activate is required here (ORBITKV_REQUIRE_SYSTEMD is set) \
             but not on PATH: apt-get install systemd"
        );
        eprintln!(
            "\n!!!! SKIPPED {test}: systemd-socket-activate is not on PATH \
             (apt-get install systemd; scripts/test.sh installs it)\n"
        );
    }
    found
}

/// `systemd-socket-activate -l SOCKET` (one `-l` per socket), starting
/// `orbitkv serve` with `args` at the first connection. The activator
/// execs the manager, so the child is the manager once started. Its
/// environment is only what `-E` passes; its sockets have mode 0644 (only
/// the owner may connect: connecting takes write permission).
fn activate(activator: &Path, sockets: &[&Path], env: &[String], args: &[&str]) -> Child {
    let mut cmd = Proc::new(activator);
    for s in sockets {
        cmd.arg("-l").arg(s);
    }
    for e in env {
        cmd.arg("-E").arg(e);
    }
    cmd.arg(env!("CARGO_BIN_EXE_orbitkv"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + T;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {T:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What the process runs now (`/proc/PID/comm`, at most 15 bytes).
fn comm(child: &Child) -> String {
    std::fs::read_to_string(format!("/proc/{}/comm", child.id()))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(13).wrapping_add(i as u8 * 5 + 3))
        .collect()
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0x5d00 + i)).collect()
}

#[test]
fn the_first_connection_starts_the_manager_on_the_socket_systemd_passed() {
    let Some(activator) = activator("systemd socket activation") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("orbitkv.sock");
    let config = dir.path().join("orbitkv.toml");
    std::fs::write(&config, BASE_CONFIG).unwrap();
    // systemd's side of sd_notify: a datagram socket the manager reports to.
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(T)).unwrap();
    let mut child = activate(
        &activator,
        &[&socket],
        &[
            "RUST_LOG=error".into(),
            format!("NOTIFY_SOCKET={}", notify_path.display()),
        ],
        &["--dram", "16MiB", "--config", config.to_str().unwrap()],
    );
    wait_for("the activator's socket", || socket.exists());
    // Listening, and no manager yet: it starts at the first connection.
    assert_eq!(comm(&child), "systemd-socket-");

    // The first client's connection starts the manager, which greets it on
    // the passed socket.
    let mut a = Client::connect(&socket, "first").unwrap();
    assert_eq!(comm(&child), "orbitkv");
    let mut ready = [0u8; 64];
    let n = notify.recv(&mut ready).expect("READY=1 on NOTIFY_SOCKET");
    assert_eq!(std::str::from_utf8(&ready[..n]).unwrap(), "READY=1\n");

    // It serves: a publish on the first connection, a restore of the same
    // bytes on a second.
    publish_four(&mut a, &hashes(4), payload);
    let mut b = Client::connect(&socket, "second").unwrap();
    register(&mut b);
    let (sb, rb) = open(&mut b);
    let qr = b
        .call(
            Command::Query {
                session: sb,
                request: 2,
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
    let Event::QueryResult {
        operation,
        selected: Some(selected),
        ..
    } = qr
    else {
        panic!("{qr:?}")
    };
    assert_eq!(selected, 4 * PAGE);
    b.wait_event(
        T,
        |e| matches!(e, Event::Ready { operation: o, .. } if *o == operation),
    )
    .unwrap()
    .expect("ready");
    let done = restore_four(&mut b, sb, rb, operation, 0, payload);
    assert!(
        matches!(done, Event::RestoreDone { pages: 4, .. }),
        "{done:?}"
    );
    drop((a, b));

    // SIGTERM: a clean exit, STOPPING=1, and systemd's socket left where
    // it is (its unit keeps listening and starts the next manager).
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let n = notify.recv(&mut ready).expect("STOPPING=1");
    assert_eq!(std::str::from_utf8(&ready[..n]).unwrap(), "STOPPING=1\n");
    assert!(socket.exists(), "the passed socket is systemd's to remove");
}

/// Starts the activator on `sockets`, gives the first `mode`, connects
/// once (which starts the manager), and returns the manager's exit code
/// and stderr.
fn refused_start(activator: &Path, mode: u32, sockets: &[&Path], args: &[&str]) -> (i32, String) {
    use std::os::unix::fs::PermissionsExt as _;
    let mut child = activate(activator, sockets, &["RUST_LOG=error".into()], args);
    wait_for("the activator's sockets", || {
        sockets.iter().all(|s| s.exists())
    });
    std::fs::set_permissions(sockets[0], std::fs::Permissions::from_mode(mode)).unwrap();
    // The connection is queued on the passed socket; the manager refuses
    // to serve it and exits, which closes it.
    let connected = Client::connect(sockets[0], "refused");
    assert!(connected.is_err(), "a misconfigured manager served");
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code().unwrap_or(-1), err)
}

#[test]
fn a_misconfigured_socket_unit_stops_the_manager_with_the_setting_to_change() {
    let Some(activator) = activator("systemd socket misconfiguration") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = ["--dram", "16MiB"];

    // Others may connect (systemd's default SocketMode=0666).
    let open_socket = dir.path().join("open.sock");
    let (code, err) = refused_start(&activator, 0o666, &[&open_socket], &args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("SocketMode=0600"), "{err}");

    // Two sockets: one ListenStream=.
    let (one, two) = (dir.path().join("one.sock"), dir.path().join("two.sock"));
    let (code, err) = refused_start(&activator, 0o600, &[&one, &two], &args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("exactly one"), "{err}");

    // --socket naming another path than the one systemd passed.
    let other = dir.path().join("other.sock");
    let passed = dir.path().join("passed.sock");
    let (code, err) = refused_start(
        &activator,
        0o600,
        &[&passed],
        &["--dram", "16MiB", "--socket", other.to_str().unwrap()],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--socket"), "{err}");
    assert!(!other.exists(), "nothing bound at the other path");
}
