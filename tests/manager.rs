//! The manager hardened (issue 9), against a real `orbitkv serve`
//! subprocess: clients that close at once, never read, pipeline bursts or
//! greet twice; thousands of commands and dozens of regions in one burst;
//! the pool read-only; impostor sockets; iceoryx2 file modes; metrics under
//! idle connections; `orbitkv inspect`; RSS across many Hellos; idle CPU;
//! another connection's handles refused with no effect; a frame fuzzer.

mod support;
use support::*;

use std::collections::{HashMap, VecDeque};
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command as Proc, Stdio};
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{
    Command, CommandError, Event, GroupHashes, LimitName, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_ipc::frame::{self, FrameReader, Kind};
use orbitkv_ipc::{Client, ClientError, ClientOptions, Descriptor, Hello, Submit, Welcome};

/// A manager with `serve` (lines of the `[serve]` table) and extra runtime
/// tables.
fn start_with(dir: &Path, serve: &str, extra: &str) -> Manager {
    start_full(dir, "16MiB", serve, extra, &[])
}

fn start_full(dir: &Path, dram: &str, serve: &str, extra: &str, args: &[&str]) -> Manager {
    // `serve` lines extend the `[serve]` table that BASE_CONFIG opens.
    let (head, rest) = BASE_CONFIG.split_once("[dram]").unwrap();
    let config = format!("{head}{serve}\n[dram]{rest}{extra}");
    Manager::start(dir, "orbitkv", dram, &config, args)
}

fn start(dir: &Path) -> Manager {
    start_with(dir, "", "")
}

/// A connection that speaks raw frames: pipelined bursts, descriptors
/// received as they come.
struct Raw {
    s: UnixStream,
    r: FrameReader,
    fds: VecDeque<OwnedFd>,
    /// The descriptors that came with `Welcome` (the pool's first).
    welcome_fds: Vec<OwnedFd>,
}

impl Raw {
    fn connect(m: &Manager) -> Raw {
        let s = UnixStream::connect(&m.socket).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        Raw {
            s,
            r: FrameReader::default(),
            fds: VecDeque::new(),
            welcome_fds: Vec::new(),
        }
    }

    fn hello(m: &Manager, hot: bool) -> (Raw, Welcome) {
        let mut c = Raw::connect(m);
        c.send(&frame::encode(
            Kind::Hello,
            &Hello {
                protocol: orbitkv_ipc::PROTOCOL_VERSION,
                client: "raw".into(),
                hot,
            },
        ));
        let (k, p) = c.next().unwrap();
        assert_eq!(k, Kind::Welcome, "{}", String::from_utf8_lossy(&p));
        c.welcome_fds = c.fds.drain(..).collect();
        (c, frame::decode(k, &p).unwrap())
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    fn submit(&mut self, tag: u64, command: Command) {
        self.send(&frame::encode(Kind::Submit, &Submit { tag, command }));
    }

    /// The next frame; `None` when the manager closed the connection.
    fn next(&mut self) -> Option<(Kind, Vec<u8>)> {
        loop {
            if let Some(f) = self.r.next_frame().unwrap() {
                return Some(f);
            }
            let mut fresh = Vec::new();
            match self.r.fill(&self.s, 1 << 20, &mut fresh) {
                Ok(0) => return None,
                Ok(_) => self.fds.extend(fresh),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("reading: {e}"),
            }
        }
    }

    /// The next frame within the socket's read timeout; `None` when none
    /// came by then or the manager closed the connection.
    fn next_opt(&mut self) -> Option<(Kind, Vec<u8>)> {
        loop {
            if let Ok(Some(f)) = self.r.next_frame() {
                return Some(f);
            }
            let mut fresh = Vec::new();
            match self.r.fill(&self.s, 1 << 20, &mut fresh) {
                Ok(0) | Err(_) => return None,
                Ok(_) => self.fds.extend(fresh),
            }
        }
    }

    /// Reads until the manager sends an `Error` frame and closes.
    fn refused(&mut self) -> String {
        let mut error = None;
        while let Some((k, p)) = self.next() {
            if k == Kind::Error {
                error = Some(String::from_utf8_lossy(&p).into_owned());
            }
        }
        error.expect("an Error frame before the close")
    }
}

fn events_of(p: &[u8]) -> Vec<Event> {
    delivered_of(p).into_iter().map(|d| d.event).collect()
}

fn delivered_of(p: &[u8]) -> Vec<orbitkv_ipc::Delivered> {
    frame::decode(Kind::Events, p).unwrap()
}

/// Registers "llama" and opens a session over a raw connection.
fn raw_session(c: &mut Raw) -> SessionHandle {
    c.submit(1, register_command());
    c.submit(
        2,
        Command::OpenSession {
            instance: "llama".into(),
        },
    );
    loop {
        let (k, p) = c.next().unwrap();
        if k == Kind::Events {
            for d in delivered_of(&p) {
                if let Event::SessionOpened { session, .. } = d.event {
                    // The runtime's flag travels on the socket: the reply
                    // is its command's last word.
                    assert!(d.terminal, "open_session's reply ends it");
                    return session;
                }
            }
        }
    }
}

fn query(s: SessionHandle, request: u64) -> Command {
    Command::Query {
        session: s,
        request,
        groups: vec![GroupHashes {
            group: 0,
            hashes: (0..4).map(|i| NativeHash::from_u64(0x5000 + i)).collect(),
        }],
        origin: 0,
        prompt_len: 4 * PAGE,
        expect_namespaces: vec![],
        prepare: false,
        speculative: false,
    }
}

#[test]
fn hello_then_close_a_hundred_times_leaves_the_manager_serving() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path());
    let hello = frame::encode(
        Kind::Hello,
        &Hello {
            protocol: orbitkv_ipc::PROTOCOL_VERSION,
            client: "gone".into(),
            hot: true,
        },
    );
    for i in 0..100 {
        let mut s = UnixStream::connect(&m.socket).unwrap();
        s.write_all(&hello).unwrap();
        if i % 2 == 0 {
            // Half of them also leave half a frame behind.
            s.write_all(&frame::header(Kind::Submit, 100)[..9]).unwrap();
        }
        drop(s);
    }
    assert!(m.alive(), "the manager survived");
    let mut c = Client::connect(&m.socket, "after").unwrap();
    assert!(c.ping().unwrap() < T);
    m.wait_sample("orbitkv_connections", |v| v == 1);
    assert!(
        m.sample("orbitkv_disconnects_total{reason=\"peer_closed\"}")
            .unwrap()
            >= 100
    );
}

#[test]
fn frames_out_of_order_are_refused_with_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut good = Client::connect(&m.socket, "good").unwrap();
    // A command before Hello.
    let mut c = Raw::connect(&m);
    c.send(&frame::encode(Kind::Ping, &()));
    let e = c.refused();
    assert!(e.contains("first frame must be Hello"), "{e}");
    // A second Hello.
    let (mut c, _) = Raw::hello(&m, false);
    c.send(&frame::encode(
        Kind::Hello,
        &Hello {
            protocol: orbitkv_ipc::PROTOCOL_VERSION,
            client: "again".into(),
            hot: false,
        },
    ));
    let e = c.refused();
    assert!(e.contains("second Hello"), "{e}");
    // A frame only the manager sends.
    let (mut c, _) = Raw::hello(&m, false);
    c.send(&frame::encode(Kind::Welcome, &()));
    let e = c.refused();
    assert!(e.contains("not a client frame"), "{e}");
    // A huge length: refused from the header, nothing allocated.
    let (mut c, _) = Raw::hello(&m, false);
    let mut h = frame::header(Kind::Submit, 8);
    h[8..12].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
    c.send(&h);
    let e = c.refused();
    assert!(e.contains("exceeds"), "{e}");
    // Issue 23: Ping and Inspect carry `null`; anything else is refused.
    for kind in [Kind::Ping, Kind::Inspect] {
        let (mut c, _) = Raw::hello(&m, false);
        let mut f = frame::header(kind, 9).to_vec();
        f.extend_from_slice(b"\"garbage\"");
        c.send(&f);
        let e = c.refused();
        assert!(e.contains("payload"), "{kind:?}: {e}");
    }
    assert!(good.ping().unwrap() < T);
}

#[test]
fn a_client_that_never_reads_is_cut_off_while_eight_others_keep_going() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with(
        dir.path(),
        "max_outbox_bytes = \"1MiB\"\nstall_timeout_ms = 60000",
        "",
    );
    {
        let mut a = Client::connect(&m.socket, "setup").unwrap();
        register(&mut a);
    }
    // The stuck client pipelines pings and never reads a pong.
    let (stuck, _) = Raw::hello(&m, false);
    let writer = {
        let mut s = stuck.s.try_clone().unwrap();
        std::thread::spawn(move || {
            let ping = frame::encode(Kind::Ping, &());
            let burst: Vec<u8> = ping
                .iter()
                .copied()
                .cycle()
                .take(ping.len() * 4096)
                .collect();
            // Until the manager cuts it off (8 MiB of pongs at most).
            for _ in 0..128 {
                if s.write_all(&burst).is_err() {
                    return true;
                }
            }
            false
        })
    };
    let socket = m.socket.clone();
    let others: Vec<_> = (0..8)
        .map(|i| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket, &format!("steady-{i}")).unwrap();
                let (s, _) = open(&mut c);
                for r in 0..200 {
                    let e = c.call(query(s, r), T).unwrap();
                    assert!(matches!(e, Event::QueryResult { .. }), "{e:?}");
                }
            })
        })
        .collect();
    for o in others {
        o.join().unwrap();
    }
    m.wait_sample("orbitkv_disconnects_total{reason=\"outbox_full\"}", |v| {
        v == 1
    });
    assert!(
        writer.join().unwrap(),
        "the stuck client's socket was closed"
    );
    drop(stuck);
    m.wait_sample("orbitkv_connections", |v| v == 0);
    m.wait_sample("orbitkv_sessions", |v| v == 0);
}

#[test]
fn a_client_that_stops_reading_is_cut_off_after_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with(dir.path(), "stall_timeout_ms = 500", "");
    let (stuck, _) = Raw::hello(&m, false);
    let mut s = stuck.s.try_clone().unwrap();
    // Enough pongs to fill the socket, far below the outbox bound.
    let ping = frame::encode(Kind::Ping, &());
    let burst: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 40_000)
        .collect();
    let writer = std::thread::spawn(move || s.write_all(&burst).is_ok());
    m.wait_sample("orbitkv_disconnects_total{reason=\"stalled\"}", |v| v == 1);
    let _ = writer.join();
}

#[test]
fn an_8_mib_pipelined_burst_leaves_others_p99_under_10_ms() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let (burster, _) = Raw::hello(&m, false);
    let mut w = burster.s.try_clone().unwrap();
    let mut rd = burster;
    let ping = frame::encode(Kind::Ping, &());
    let count = (8 << 20) / ping.len();
    let reader = std::thread::spawn(move || {
        let mut pongs = 0;
        while pongs < count {
            match rd.next() {
                Some((Kind::Pong, _)) => pongs += 1,
                Some(_) => {}
                None => break,
            }
        }
        pongs
    });
    let mut other = Client::connect(&m.socket, "latency").unwrap();
    other.ping().unwrap();
    let writer = std::thread::spawn(move || {
        let burst: Vec<u8> = ping
            .iter()
            .copied()
            .cycle()
            .take(ping.len() * count)
            .collect();
        w.write_all(&burst).unwrap();
    });
    let mut lat = Vec::new();
    while !writer.is_finished() || lat.len() < 100 {
        lat.push(other.ping().unwrap());
    }
    writer.join().unwrap();
    assert_eq!(
        reader.join().unwrap(),
        count,
        "every ping of the burst answered"
    );
    lat.sort();
    let p99 = lat[lat.len() * 99 / 100];
    assert!(
        p99 < Duration::from_millis(10),
        "p99 {p99:?} over {} pings during the burst",
        lat.len()
    );
}

#[test]
fn ten_thousand_commands_in_one_burst_are_all_answered() {
    let dir = tempfile::tempdir().unwrap();
    // A small per-tick intake: most of the burst waits in the inbox.
    let m = start_with(dir.path(), "", "[limits]\nmax_commands_per_tick = 64\n");
    let (mut c, _) = Raw::hello(&m, false);
    let s = raw_session(&mut c);
    let mut burst = Vec::new();
    for tag in 0..10_000u64 {
        burst.extend(frame::encode(
            Kind::Submit,
            &Submit {
                tag: 100 + tag,
                command: query(s, tag),
            },
        ));
    }
    let mut w = c.s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&burst).unwrap());
    let mut accepted = HashMap::new();
    let mut results = HashMap::new();
    while accepted.len() < 10_000 || results.len() < 10_000 {
        let (k, p) = c.next().expect("the manager keeps the connection");
        match k {
            Kind::Accepted => {
                let a: orbitkv_ipc::Accepted = frame::decode(k, &p).unwrap();
                accepted.insert(a.tag, a.result.unwrap());
            }
            Kind::Events => {
                for e in events_of(&p) {
                    if let Event::QueryResult {
                        command, request, ..
                    } = e
                    {
                        results.insert(command, request);
                    }
                }
            }
            _ => {}
        }
    }
    writer.join().unwrap();
    // Every command's reply names the request it was submitted with.
    for (tag, cid) in &accepted {
        assert_eq!(results.get(cid), Some(&(tag - 100)), "tag {tag}");
    }
}

#[test]
fn sixty_four_regions_in_one_burst_are_all_mapped_by_handle() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let (mut c, _) = Raw::hello(&m, false);
    let s = raw_session(&mut c);
    for tag in 0..64u64 {
        c.submit(
            10 + tag,
            Command::RegisterDeviceRegion {
                session: s,
                rank: 0,
                group: 0,
                slots: 4 + tag as u32,
                agent: None,
            },
        );
    }
    let mut mapped: HashMap<u64, memmap2::MmapMut> = HashMap::new();
    let mut registered = Vec::new();
    while registered.len() < 64 {
        let (k, p) = c.next().unwrap();
        match k {
            Kind::Descriptor => {
                let d: Descriptor = frame::decode(k, &p).unwrap();
                let fd = c
                    .fds
                    .pop_front()
                    .expect("the descriptor came with its frame");
                let file = std::fs::File::from(fd);
                assert_eq!(file.metadata().unwrap().len(), d.bytes);
                // SAFETY: the test's own view of a region it registered.
                let map = unsafe { memmap2::MmapMut::map_mut(&file).unwrap() };
                mapped.insert(d.handle, map);
            }
            Kind::Events => {
                for e in events_of(&p) {
                    if let Event::RegionRegistered {
                        region, page_bytes, ..
                    } = e
                    {
                        let map = mapped
                            .get_mut(&region)
                            .expect("descriptor before its event");
                        // Sizes differ per region: each handle got its own.
                        registered.push((region, map.len() as u64 / page_bytes));
                        map[0] = 1;
                    }
                }
            }
            _ => {}
        }
    }
    let mut slots: Vec<u64> = registered.iter().map(|r| r.1).collect();
    slots.sort();
    assert_eq!(slots, (4..68).collect::<Vec<u64>>());
    assert!(c.fds.is_empty());
}

#[test]
fn per_connection_quotas_are_typed_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with(
        dir.path(),
        "max_sessions_per_connection = 2\nmax_regions_per_connection = 1",
        "",
    );
    let mut c = Client::connect(&m.socket, "greedy").unwrap();
    register(&mut c);
    let (s, _) = open(&mut c); // a session and its region
    let open_cmd = || Command::OpenSession {
        instance: "llama".into(),
    };
    assert!(matches!(
        c.call(open_cmd(), T).unwrap(),
        Event::SessionOpened { .. }
    ));
    let e = c.submit(open_cmd()).unwrap_err();
    assert!(
        matches!(
            &e,
            ClientError::Command(CommandError::Limit {
                name: LimitName::MaxSessionsPerConnection,
                limit: 2
            })
        ),
        "{e}"
    );
    let e = c
        .submit(Command::RegisterDeviceRegion {
            session: s,
            rank: 0,
            group: 0,
            slots: 4,
            agent: None,
        })
        .unwrap_err();
    assert!(
        matches!(
            &e,
            ClientError::Command(CommandError::Limit {
                name: LimitName::MaxRegionsPerConnection,
                limit: 1
            })
        ),
        "{e}"
    );
    // Another connection has its own quota.
    let mut d = Client::connect(&m.socket, "other").unwrap();
    open(&mut d);
}

#[test]
fn clients_cannot_make_the_pool_writable() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let (c, w) = Raw::hello(&m, false);
    assert!(w.pool_bytes > 0);
    let pool = c
        .welcome_fds
        .first()
        .expect("the pool's descriptor came with Welcome");
    let len = w.pool_bytes as usize;
    let map = |fd: i32, prot| {
        // SAFETY: a probe mapping, unmapped at once when it succeeds.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if p != libc::MAP_FAILED {
            // SAFETY: the mapping just made.
            unsafe { libc::munmap(p, len) };
            true
        } else {
            false
        }
    };
    assert!(map(pool.as_raw_fd(), libc::PROT_READ), "readable");
    assert!(!map(pool.as_raw_fd(), libc::PROT_READ | libc::PROT_WRITE));
    // Reopened read-write through /proc: the seals still hold.
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", pool.as_raw_fd()));
    if let Ok(rw) = rw {
        assert!(!map(rw.as_raw_fd(), libc::PROT_READ | libc::PROT_WRITE));
        assert!((&rw).write_all(b"x").is_err(), "write(2) is sealed");
        assert!(rw.set_len(4096).is_err(), "shrinking is sealed");
    }
    // A read-only mapping cannot be made writable.
    // SAFETY: a read-only probe mapping of the pool.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            pool.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping just made.
    let r = unsafe { libc::mprotect(p, len, libc::PROT_READ | libc::PROT_WRITE) };
    assert_ne!(r, 0, "mprotect cannot add write access");
    // SAFETY: as above.
    unsafe { libc::munmap(p, len) };
}

#[test]
fn an_impostor_socket_of_another_uid_is_refused_before_anything_is_sent() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run the impostor as nobody");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let socket = dir.path().join("orbitkv.sock");
    let got = dir.path().join("got");
    // The impostor binds first, accepts one connection and records what
    // it received.
    let script = format!(
        "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.bind({sock:?})\ns.listen()\n\
         print('up',flush=True)\nc,_=s.accept()\nc.settimeout(2)\nb=b''\n\
         try:\n  b=c.recv(65536)\nexcept Exception:\n  pass\nopen({got:?},'w').write(str(len(b)))\n",
        sock = socket.to_str().unwrap(),
        got = got.to_str().unwrap()
    );
    use std::os::unix::process::CommandExt as _;
    let mut imp = Proc::new("/usr/bin/python3")
        .args(["-I", "-c", &script])
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = [0u8; 3];
    imp.stdout.as_mut().unwrap().read_exact(&mut line).unwrap();
    let Err(e) = Client::connect_with(&socket, "victim", ClientOptions::default()) else {
        panic!("connected to an impostor");
    };
    assert!(
        matches!(e, ClientError::Untrusted { uid: 65534, .. }),
        "{e}"
    );
    imp.wait().unwrap();
    assert_eq!(
        std::fs::read_to_string(&got).unwrap(),
        "0",
        "nothing was sent"
    );
}

/// A child process killed when the test ends, passed or not (a failed
/// assertion must not leave a manager running).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `open(path, O_RDWR)` gives a process of `uid` (`None`: this
/// process, not root) that holds no capability: "ok" or the errno, per
/// path. As root the probe runs as that uid with every capability dropped
/// (the kernel clears them on the setuid away from 0).
fn open_as(uid: Option<u32>, paths: &[String]) -> Vec<String> {
    let Some(uid) = uid else {
        return paths
            .iter()
            .map(
                |p| match std::fs::OpenOptions::new().read(true).write(true).open(p) {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => e.raw_os_error().unwrap_or(-1).to_string(),
                },
            )
            .collect();
    };
    use std::os::unix::process::CommandExt as _;
    let script = "import os,sys\nfor p in sys.argv[1:]:\n  try:\n    os.close(os.open(p, os.O_RDWR)); print('ok')\n  except OSError as e:\n    print(e.errno)\n";
    let out = Proc::new("/usr/bin/python3")
        .args(["-I", "-c", script])
        .args(paths)
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Issue 23: a process of the manager's uid that never connects used to
/// reopen its memfds through `/proc/<pid>/fd/N` read-write and rewrite
/// what engines publish. The manager is non-dumpable now: its `/proc`
/// entries belong to root, and the same-uid open is `EACCES`.
///
/// As root (CI), the manager and the probe both run as `nobody`, since
/// root's `CAP_SYS_PTRACE` passes the check whatever the manager does; a
/// dumpable process of that uid holding a memfd is the control that shows
/// the probe can open what is open to it. As another user both run as
/// that user.
#[test]
fn a_same_uid_process_that_never_connects_cannot_open_the_managers_memfds() {
    use std::os::unix::fs::MetadataExt as _;
    use std::os::unix::process::CommandExt as _;
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let as_uid = root.then_some(65534u32);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("orbitkv.sock");
    let config = dir.path().join("orbitkv.toml");
    std::fs::write(&config, BASE_CONFIG).unwrap();
    if let Some(uid) = as_uid {
        let path = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
        // SAFETY: a valid path; chown has no other preconditions.
        assert_eq!(unsafe { libc::chown(path.as_ptr(), uid, uid) }, 0);
        let path = std::ffi::CString::new(config.to_str().unwrap()).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { libc::chown(path.as_ptr(), uid, uid) }, 0);
    }
    let mut cmd = Proc::new(env!("CARGO_BIN_EXE_orbitkv"));
    cmd.args(["serve", "--socket", socket.to_str().unwrap()])
        .args(["--dram", "16MiB", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "error")
        .env("ORBITKV_HOT_PATH", "0")
        .stdout(Stdio::null());
    if let Some(uid) = as_uid {
        cmd.uid(uid).gid(uid);
    }
    let mut child = Reaped(cmd.spawn().unwrap());
    let pid = child.0.id();
    let deadline = Instant::now() + T;
    while !socket.exists() {
        assert!(child.0.try_wait().unwrap().is_none(), "manager exited");
        assert!(Instant::now() < deadline, "manager did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The pool's memfd is open from the start. Root can list them; another
    // user cannot even do that, so it tries the low descriptors.
    let fds: Vec<String> = if root {
        let memfds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| {
                let e = e.unwrap();
                let target = std::fs::read_link(e.path()).ok()?;
                target
                    .to_string_lossy()
                    .starts_with("/memfd:")
                    .then(|| e.path().display().to_string())
            })
            .collect();
        assert!(!memfds.is_empty(), "the manager holds its pool's memfd");
        // Non-dumpable: the kernel hands its /proc entries to root.
        let meta = std::fs::metadata(format!("/proc/{pid}/fd")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (0, 0));
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("Uid:") && l.contains("65534")),
            "{status}"
        );
        memfds
    } else {
        (0..32).map(|n| format!("/proc/{pid}/fd/{n}")).collect()
    };
    let got = open_as(as_uid, &fds);
    assert_eq!(got.len(), fds.len());
    for (fd, r) in fds.iter().zip(&got) {
        assert_eq!(r, &libc::EACCES.to_string(), "{fd}");
    }
    // The control: a dumpable process of the same uid holding a memfd is
    // open to the probe, so the refusal above is the manager's doing.
    let mut control = Proc::new("/usr/bin/python3");
    control
        .args([
            "-I",
            "-c",
            "import os,sys,time\nfd=os.memfd_create('control')\nprint(fd,flush=True)\ntime.sleep(30)\n",
        ])
        .stdout(Stdio::piped());
    if let Some(uid) = as_uid {
        control.uid(uid).gid(uid);
    }
    let mut control = Reaped(control.spawn().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(control.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let path = format!("/proc/{}/fd/{}", control.0.id(), line.trim());
    let got = open_as(as_uid, std::slice::from_ref(&path));
    assert_eq!(got, vec!["ok".to_owned()], "{path}");
    drop(child);
}

#[test]
fn iceoryx2_files_are_not_writable_by_others() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let c = Client::connect(&m.socket, "hot").unwrap();
    assert!(c.hot_service().is_some(), "{:?}", c.hot_path_error());
    let prefix = orbitkv_ipc::hot::file_prefix(c.incarnation());
    let files = orbitkv_ipc::hot::files_with_prefix(&prefix);
    assert!(!files.is_empty());
    for f in files {
        let meta = std::fs::symlink_metadata(&f).unwrap();
        if meta.is_dir() {
            continue;
        }
        let mode = meta.permissions().mode();
        assert_eq!(mode & 0o022, 0, "{} is {:o}", f.display(), mode & 0o777);
    }
}

#[test]
fn a_scrape_answers_under_a_second_with_100_idle_metrics_connections() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let idle: Vec<_> = (0..100)
        .map(|_| std::net::TcpStream::connect(&m.metrics).unwrap())
        .collect();
    let t = Instant::now();
    let body = m.scrape();
    let took = t.elapsed();
    assert!(body.contains("orbitkv_queries_total"), "{body}");
    assert!(
        body.contains("orbitkv_misses_total{reason=\"not_found\"}"),
        "{body}"
    );
    assert!(body.contains("orbitkv_latency_seconds_bucket"), "{body}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    drop(idle);
}

#[test]
fn ten_thousand_hellos_leave_rss_flat() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let hello = |m: &Manager| {
        let (c, w) = Raw::hello(m, true);
        assert!(w.hot.is_some());
        drop(c);
    };
    for _ in 0..1000 {
        hello(&m);
    }
    m.wait_sample("orbitkv_connections", |v| v == 0);
    let warm = m.rss_kib();
    for _ in 0..9000 {
        hello(&m);
    }
    m.wait_sample("orbitkv_connections", |v| v == 0);
    let after = m.rss_kib();
    assert!(
        after < warm + 8 * 1024,
        "RSS grew from {warm} KiB to {after} KiB over 9000 Hellos"
    );
}

#[test]
fn a_dangling_symlink_at_the_socket_path_does_not_stop_the_manager() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join("orbitkv.sock")).unwrap();
    let m = start(dir.path());
    let mut c = Client::connect(&m.socket, "c").unwrap();
    assert!(c.ping().unwrap() < T);
}

#[test]
fn inspect_shows_sessions_leases_and_the_last_minute() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut a = Client::connect(&m.socket, "engine-a").unwrap();
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x5000 + i)).collect();
    publish_four(&mut a, &hashes, |i| vec![i as u8; BYTES as usize]);
    let ready = with_driver(&mut a, T, |d| {
        let s = d.open("llama")?;
        let mut q = query(s, 1);
        if let Command::Query { prepare, .. } = &mut q {
            *prepare = true;
        }
        let operation = d.query(q)?.operation;
        d.ready(operation)
    })
    .unwrap();
    assert!(matches!(ready, Event::Ready { .. }), "{ready:?}");
    let out = Proc::new(env!("CARGO_BIN_EXE_orbitkv"))
        .args(["inspect", "--socket", m.socket.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap: orbitkv_ipc::Snapshot = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snap.sessions, 2);
    // A 4-page prompt restores 3 pages: the last token is always computed.
    assert_eq!(snap.leases, 3);
    assert_eq!(snap.bytes_reserved, 3 * BYTES);
    assert_eq!(snap.pages, 4);
    assert_eq!(snap.last_minute.queries, 1);
    assert_eq!(
        snap.last_minute.hits, 0,
        "a prepared query is not yet a hit"
    );
    let engine = snap
        .connections
        .iter()
        .find(|c| c.client == "engine-a")
        .unwrap();
    assert_eq!(engine.sessions, 2);
    // The text view names the same numbers.
    let out = Proc::new(env!("CARGO_BIN_EXE_orbitkv"))
        .args(["inspect", "--socket", m.socket.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("leases 3"), "{text}");
    assert!(text.contains("engine-a"), "{text}");
}

#[test]
fn an_idle_manager_barely_wakes_and_barely_uses_a_core() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    m.wait_sample("orbitkv_connections", |v| v == 0);
    std::thread::sleep(Duration::from_millis(1500));
    let rounds = m.sample("orbitkv_loop_rounds_total").unwrap();
    let before = m.cpu_ns();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    let share = (m.cpu_ns() - before) as f64 / 1e9 / t.elapsed().as_secs_f64();
    // The exact property, whatever else loads the machine: with no client
    // the loop wakes about once a second.
    let woke = m.sample("orbitkv_loop_rounds_total").unwrap() - rounds;
    assert!(woke <= 15, "{woke} loop rounds in 10 idle seconds");
    // On-CPU time (schedstat, exact): ~0.07% of a core on an idle machine
    // in a debug build; bounded loosely here, since a saturated test
    // machine slows every instruction down.
    assert!(
        share < 0.05,
        "idle manager used {:.2}% of a core",
        share * 100.0
    );
}

/// Writes `bytes` into the manager's memory at `offset` of its DRAM pool,
/// through /proc (root: the manager is not dumpable, so only a process
/// with `CAP_SYS_PTRACE` gets in): what no client can do.
fn alter_pool(m: &Manager, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt as _;
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", m.pid())).unwrap();
    let line = maps
        .lines()
        .find(|l| {
            l.contains("memfd:orbitkv-host-pool")
                && l.split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.starts_with("rw"))
        })
        .expect("the manager's writable pool mapping");
    let start = u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap();
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{}/mem", m.pid()))
        .unwrap();
    mem.write_all_at(bytes, start + offset).unwrap();
}

fn prepared(c: &mut Client, s: SessionHandle, hashes: &[NativeHash]) -> Event {
    let q = Command::Query {
        session: s,
        request: 9,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes.to_vec(),
        }],
        origin: 0,
        prompt_len: (hashes.len() as u64 + 1) * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    };
    with_driver(c, T, |d| {
        let id = d.submit(q)?;
        d.tick()?;
        match d.reply("query", id)? {
            Event::QueryResult {
                operation,
                miss: None,
                ..
            } => d.ready(operation),
            e => Ok(e),
        }
    })
    .unwrap()
}

#[test]
fn a_page_altered_in_memory_is_never_a_hit_on_any_tier() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: altering the non-dumpable manager's memory needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let ssd_table = format!(
        "[ssd]\ndir = {:?}\ncapacity_bytes = 67108864\nsegment_bytes = 4194304\n",
        ssd.display().to_string()
    );
    let m = start_full(dir.path(), "1MiB", "", &ssd_table, &[]);
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x7000 + i)).collect();
    let payload = |i: u64| vec![0x40 + i as u8; BYTES as usize];
    let mut a = Client::connect(&m.socket, "engine-a").unwrap();
    publish_four(&mut a, &hashes, payload);
    let (s, region) = open(&mut a);
    // Where the first page lives: from a lease.
    let Event::Ready {
        operation, leases, ..
    } = prepared(&mut a, s, &hashes)
    else {
        panic!("a hit first");
    };
    let first = leases.iter().find(|l| l.pos.page_end == PAGE).unwrap();
    assert_eq!(a.page(first).unwrap(), &payload(0)[..]);
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
    .unwrap();
    // Root changes 16 bytes of the cached page in the manager's memory.
    alter_pool(&m, first.offset + 100, &[0xee; 16]);
    // DRAM: the restore verifies what it copies; a checksum miss.
    let Event::Ready {
        operation, leases, ..
    } = prepared(&mut a, s, &hashes)
    else {
        panic!("the index still lists the page");
    };
    let done = with_driver(&mut a, T, |d| {
        let slots = leases.iter().map(|l| 20 + (l.pos.page_end / PAGE) as u32);
        let dps = d.alloc_many(s, region, slots)?;
        let targets = leases
            .iter()
            .zip(dps)
            .map(|(l, dp)| orbitkv_components::api::RestoreTarget {
                pos: l.pos,
                device_page: dp,
            })
            .collect();
        d.restore(s, operation, targets, vec![])
    })
    .unwrap();
    assert!(
        matches!(
            done,
            Event::Miss {
                reason: orbitkv_components::api::MissReason::Checksum,
                ..
            }
        ),
        "{done:?}"
    );
    m.wait_sample("orbitkv_checksum_failures_total", |v| v == 1);
    // SSD: fill DRAM so every page is evicted. The SSD tier writes each
    // straight from its DRAM slot under the checksum the page carries since
    // it landed (nothing is hashed on the write path), so the altered page
    // is stored under its original checksum and refused when read back.
    for round in 0..12u64 {
        let (fs, fr) = open(&mut a);
        with_driver(&mut a, T, |d| {
            let dps = d.alloc_many(fs, fr, 0..48)?;
            let pages = (0..48u64)
                .zip(dps)
                .map(|(i, dp)| orbitkv_components::api::PublishPage {
                    rank: 0,
                    group: 0,
                    hash: NativeHash::from_u64(0x9_0000 + round * 64 + i),
                    device_page: dp,
                })
                .collect();
            d.publish(fs, 100 + round, pages)
        })
        .unwrap();
    }
    m.wait_sample("orbitkv_demotions_total{outcome=\"in_place\"}", |v| v >= 4);
    m.wait_sample("orbitkv_demotions_total{outcome=\"written\"}", |v| v >= 4);
    // After a restart only the SSD tier holds them. The store's open-time
    // scan verifies every record's payload against its header and skips
    // the altered one, so the prefix's first page is not found: nothing of
    // it is a hit, and never the altered bytes.
    drop(a);
    m.stop();
    let m = start_full(dir.path(), "1MiB", "", &ssd_table, &[]);
    let mut b = Client::connect(&m.socket, "engine-b").unwrap();
    register(&mut b);
    let (s, _) = open(&mut b);
    let r = prepared(&mut b, s, &hashes);
    assert!(
        matches!(
            r,
            Event::QueryResult {
                miss: Some(orbitkv_components::api::MissReason::NotFound),
                ..
            }
        ),
        "{r:?}"
    );
}

/// SplitMix64: the fuzzer's fixed-seed generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Random and mutated frames over the socket and random hot requests with
/// random descriptors, against a live manager (fixed seed, bounded count).
/// Afterwards a well-behaved client's bytes still round-trip exactly, and
/// every lease and reserved byte is back.
#[test]
fn a_frame_fuzzer_leaves_a_well_behaved_client_exact() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut rng = Rng(0x0b17_4b5e_ed00_0009);
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x8100 + i)).collect();
    let payload = |i: u64| {
        (0..BYTES)
            .map(|b| (b as u8).wrapping_mul(13) ^ (i as u8 + 1))
            .collect::<Vec<u8>>()
    };
    let mut good = Client::connect(&m.socket, "good").unwrap();
    publish_four(&mut good, &hashes, payload);
    let (gs, gr) = open(&mut good);
    // Valid frames to mutate.
    let valid: Vec<Vec<u8>> = vec![
        frame::encode(
            Kind::Submit,
            &Submit {
                tag: 1,
                command: query(gs, 1),
            },
        ),
        frame::encode(
            Kind::Submit,
            &Submit {
                tag: 2,
                command: register_command(),
            },
        ),
        frame::encode(
            Kind::Submit,
            &Submit {
                tag: 3,
                command: Command::Restore {
                    session: gs,
                    operation: 77,
                    targets: vec![],
                    retained: vec![],
                },
            },
        ),
        frame::encode(Kind::Ping, &()),
        frame::encode(Kind::Inspect, &()),
    ];
    for case in 0..400u64 {
        let greet = rng.below(8) != 0;
        let mut c = if greet {
            Raw::hello(&m, rng.below(2) == 0).0
        } else {
            Raw::connect(&m)
        };
        let mut sent = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let mut f = valid[rng.below(valid.len() as u64) as usize].clone();
            match rng.below(7) {
                0 => {
                    let n = rng.below(48) as usize;
                    f = rng.bytes(n);
                }
                1 => {
                    // A valid header of any kind and length, random payload.
                    let len = rng.below(64) as u32;
                    f = frame::header(Kind::Ping, len).to_vec();
                    f[6..8].copy_from_slice(&(rng.below(16) as u16).to_le_bytes());
                    f.extend(rng.bytes(len as usize));
                }
                2 => {
                    // Flip bytes of a valid frame (header or JSON).
                    for _ in 0..1 + rng.below(4) {
                        let i = rng.below(f.len() as u64) as usize;
                        f[i] ^= 1 << rng.below(8);
                    }
                }
                3 => {
                    // A huge or lying length.
                    let len = [u32::MAX, 16 << 20, (16 << 20) + 1, 1 << 20][rng.below(4) as usize];
                    f[8..12].copy_from_slice(&len.to_le_bytes());
                }
                4 => f.truncate(rng.below(f.len() as u64) as usize),
                _ => {}
            }
            sent.extend(f);
        }
        if c.s.write_all(&sent).is_err() {
            continue; // refused and closed already
        }
        // Sometimes read what comes back, sometimes vanish at once.
        if rng.below(2) == 0 {
            c.s.set_read_timeout(Some(Duration::from_millis(20)))
                .unwrap();
            let mut buf = [0u8; 4096];
            let _ = c.s.read(&mut buf);
        }
        drop(c);
        if case % 50 == 0 {
            assert!(good.ping().unwrap() < T, "case {case}");
        }
    }
    // The hot path: random requests, random descriptors, live and stale
    // records, this client's token and others'.
    let mut h = Client::connect(&m.socket, "hot-fuzzer").unwrap();
    register(&mut h);
    let (hs, _) = open(&mut h);
    let token = h.hot_token().expect("the hot path is on");
    for _ in 0..300 {
        use orbitkv_ipc::hot::{Desc, HOT_MAGIC, HotRequest};
        let live = if rng.below(2) == 0 {
            let kind = 1 + rng.below(10) as u32;
            let n = rng.below(96) as usize;
            let bytes = rng.bytes(n);
            h.hot_write_part(kind, &bytes)
        } else {
            None
        };
        let mut parts = [Desc::default(); 3];
        for p in parts.iter_mut() {
            *p = match (rng.below(3), live) {
                (0, Some(d)) => d,
                (1, Some(d)) => Desc {
                    offset: d.offset ^ (1 << rng.below(20)),
                    len: d.len.wrapping_add(rng.below(3) as u32),
                    ..d
                },
                _ => Desc {
                    offset: rng.next() as u32,
                    len: rng.next() as u32,
                    generation: rng.below(4) as u32,
                    kind: rng.below(12) as u32,
                },
            };
        }
        let r = HotRequest {
            magic: if rng.below(16) == 0 {
                rng.next() as u32
            } else {
                HOT_MAGIC
            },
            op: rng.below(8) as u32,
            token: if rng.below(16) == 0 {
                rng.next()
            } else {
                token
            },
            tag: 0,
            session: if rng.below(4) == 0 {
                [rng.next(), rng.next(), rng.next()]
            } else {
                [hs.id, hs.epoch, hs.incarnation]
            },
            a: if rng.below(2) == 0 {
                rng.below(8)
            } else {
                rng.next()
            },
            origin: rng.below(4) * PAGE,
            prompt_len: rng.below(8) * PAGE,
            flags: rng.below(4) as u32,
            reserved: 0,
            parts,
        };
        // An error, a refusal or an id: never a hang or a crash.
        let _ = h.hot_submit_raw(r);
    }
    drop(h);
    // A well-behaved client still gets exact bytes.
    let Event::Ready {
        operation, leases, ..
    } = prepared(&mut good, gs, &hashes)
    else {
        panic!("the published pages are still a hit");
    };
    for l in &leases {
        assert_eq!(
            good.page(l).unwrap(),
            &payload(l.pos.page_end / PAGE - 1)[..]
        );
    }
    restore_four(&mut good, gs, gr, operation, 41, payload);
    drop(good);
    m.wait_sample("orbitkv_leases", |v| v == 0);
    m.wait_sample("orbitkv_bytes_reserved", |v| v == 0);
    m.wait_sample("orbitkv_connections", |v| v == 0);
}

/// Refused with `not_owner` (a `rejected` event or the acceptance).
fn not_owner(c: &mut Client, command: Command) {
    match c.submit(command) {
        Err(ClientError::Command(CommandError::NotOwner)) => {}
        Ok(id) => {
            let e = c
                .wait_event(T, |e| e.command() == Some(id))
                .unwrap()
                .expect("a refusal names the command");
            assert!(
                matches!(
                    e,
                    Event::Rejected {
                        error: CommandError::NotOwner,
                        ..
                    }
                ),
                "{e:?}"
            );
        }
        Err(e) => panic!("{e}"),
    }
}

/// One connection naming another's session, operation, device region or
/// pages: each of the seven actions is refused, and the owner's state is
/// untouched.
#[test]
fn cross_connection_actions_are_refused_with_no_effect() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x6100 + i)).collect();
    let payload = |i: u64| vec![0x30 + i as u8; BYTES as usize];
    let mut victim = Client::connect(&m.socket, "victim").unwrap();
    publish_four(&mut victim, &hashes, payload);
    let (vs, vr) = open(&mut victim);
    let vpages: Vec<u64> = (0..4).map(|i| alloc(&mut victim, vs, vr, 10 + i)).collect();
    for (i, dp) in vpages.iter().enumerate() {
        let at = ((10 + i as u64) * BYTES) as usize;
        victim.region_mut(vr).unwrap()[at..at + BYTES as usize].fill(0xaa);
        let _ = dp;
    }
    let Event::Ready {
        operation: vop,
        leases,
        ..
    } = prepared(&mut victim, vs, &hashes)
    else {
        panic!("the victim's query is a hit");
    };
    assert_eq!(leases.len(), 4, "the victim holds one lease per page");
    let leases_before = m.wait_sample("orbitkv_leases", |v| v == 4);

    let mut attacker = Client::connect(&m.socket, "attacker").unwrap();
    register(&mut attacker);
    let (as_, ar) = open(&mut attacker);
    let adp = alloc(&mut attacker, as_, ar, 0);
    // 1. Release and 2. cancel the victim's operation.
    not_owner(
        &mut attacker,
        Command::Release {
            session: vs,
            operation: vop,
        },
    );
    not_owner(
        &mut attacker,
        Command::Release {
            session: as_,
            operation: vop,
        },
    );
    not_owner(
        &mut attacker,
        Command::Cancel {
            session: vs,
            operation: vop,
        },
    );
    not_owner(
        &mut attacker,
        Command::Cancel {
            session: as_,
            operation: vop,
        },
    );
    // 3. Restore into the victim's device pages (through its own query).
    let Event::Ready {
        operation: aop,
        leases: alease,
        ..
    } = prepared(&mut attacker, as_, &hashes)
    else {
        panic!("the attacker's own query is a hit");
    };
    not_owner(
        &mut attacker,
        Command::Restore {
            session: as_,
            operation: aop,
            targets: alease
                .iter()
                .zip(&vpages)
                .map(|(l, dp)| RestoreTarget {
                    pos: l.pos,
                    device_page: *dp,
                })
                .collect(),
            retained: vec![],
        },
    );
    // 4. Free the victim's device pages.
    not_owner(
        &mut attacker,
        Command::DevicePageFree {
            session: vs,
            device_page: vpages[0],
        },
    );
    not_owner(
        &mut attacker,
        Command::DevicePageFree {
            session: as_,
            device_page: vpages[0],
        },
    );
    // 5. Publish from the victim's device pages.
    let steal = |s| Command::Publish {
        session: s,
        request: 66,
        pages: vec![PublishPage {
            rank: 0,
            group: 0,
            hash: NativeHash::from_u64(0xdead),
            device_page: vpages[1],
        }],
    };
    not_owner(&mut attacker, steal(as_));
    not_owner(&mut attacker, steal(vs));
    // 6. Query on the victim's session (and take leases).
    not_owner(&mut attacker, query(vs, 3));
    // 7. Close the victim's session.
    not_owner(&mut attacker, Command::CloseSession { session: vs });
    let _ = (adp, alease);

    // None of it had an effect: the victim's operation is still ready, its
    // pages still allocated and untouched, its session open, and nothing
    // new was published.
    // The attacker's own operation ends; the victim's 4 leases remain.
    attacker
        .submit(Command::Release {
            session: as_,
            operation: aop,
        })
        .unwrap();
    attacker
        .wait_event(
            T,
            |e| matches!(e, Event::Released { operation: o } if *o == aop),
        )
        .unwrap()
        .unwrap();
    m.wait_sample("orbitkv_leases", |v| v == leases_before);
    for (i, _) in vpages.iter().enumerate() {
        let at = ((10 + i as u64) * BYTES) as usize;
        assert!(
            victim.region_mut(vr).unwrap()[at..at + BYTES as usize]
                .iter()
                .all(|b| *b == 0xaa)
        );
    }
    restore_four_into(&mut victim, vs, vr, vop, &vpages, 10, payload);
    let r = attacker.call(query(as_, 4), T).unwrap();
    assert!(matches!(r, Event::QueryResult { .. }), "{r:?}");
    let Event::QueryResult { candidates, .. } = r else {
        unreachable!()
    };
    assert!(
        !candidates.iter().any(|c| c.page_ends.len() > 4),
        "no page was published from the victim's device pages"
    );
}

/// A region's bookkeeping grows with the pages allocated in it, not with
/// its slot count: 40 regions of the largest size cost the manager little.
#[test]
fn forty_regions_of_the_largest_size_keep_rss_small() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let (mut c, _) = Raw::hello(&m, false);
    let s = raw_session(&mut c);
    let before = m.rss_kib();
    for tag in 0..40u64 {
        c.submit(
            10 + tag,
            Command::RegisterDeviceRegion {
                session: s,
                rank: 0,
                group: 0,
                slots: 1 << 22, // the default max_region_slots
                agent: None,
            },
        );
    }
    let mut registered = 0;
    while registered < 40 {
        let (k, p) = c.next().unwrap();
        if k == Kind::Events {
            registered += events_of(&p)
                .iter()
                .filter(|e| matches!(e, Event::RegionRegistered { .. }))
                .count();
        }
        c.fds.clear(); // the test does not map them
    }
    let after = m.rss_kib();
    assert!(
        after < before + 32 * 1024,
        "RSS {before} KiB -> {after} KiB for 40 regions"
    );
}

/// Two tenants (identities that differ only in `ORBITKV_CACHE_SCOPE`, so in
/// their digest) on one manager: one never reads the other's pages.
#[test]
fn another_cache_scope_never_reads_these_pages() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x4400 + i)).collect();
    let mut a = Client::connect(&m.socket, "tenant-a").unwrap();
    publish_four(&mut a, &hashes, |i| vec![i as u8 + 1; BYTES as usize]);
    let mut b = Client::connect(&m.socket, "tenant-b").unwrap();
    // The same model and layout under another scope: another identity.
    register_as(&mut b, "llama-scope-b", [10; 32]);
    let s = with_driver(&mut b, T, |d| d.open("llama-scope-b")).unwrap();
    let r = prepared(&mut b, s, &hashes);
    assert!(
        matches!(
            r,
            Event::QueryResult {
                miss: Some(orbitkv_components::api::MissReason::NotFound),
                ..
            }
        ),
        "{r:?}"
    );
}

fn region_command(session: SessionHandle, slots: u32) -> Command {
    Command::RegisterDeviceRegion {
        session,
        rank: 0,
        group: 0,
        slots,
        agent: None,
    }
}

/// Issue 23: manager-owned regions are mapped in full, so enough sparse
/// 16 GiB regions used to fill the manager's address space and abort it.
/// All of them together are bounded now (`limits.max_region_bytes`), on
/// every connection alike; a region past it is refused with `limit`, the
/// bytes come back when their session closes, and another client keeps
/// publishing and restoring exact bytes throughout.
#[test]
fn regions_past_the_global_byte_budget_are_refused_and_others_keep_serving() {
    const REGION: u64 = (1 << 22) * BYTES; // 16 GiB, the largest region
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_with(
        dir.path(),
        "",
        &format!("[limits]\nmax_region_bytes = {}\n", 4 * REGION),
    );
    let mut good = Client::connect(&m.socket, "good").unwrap();
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(0x9100 + i)).collect();
    let payload = |i: u64| vec![0x21 + i as u8; BYTES as usize];
    publish_four(&mut good, &hashes, payload); // and a 64-slot region
    let budget_refusal = |e: &Event| {
        matches!(
            e,
            Event::Rejected {
                error: CommandError::Limit {
                    name: LimitName::MaxRegionBytes,
                    limit,
                },
                ..
            } if *limit == 4 * REGION
        )
    };
    // Two greedy connections share the one budget: three regions fit
    // beside the good client's small one, the fourth does not, on either.
    let (mut a, _) = Raw::hello(&m, false);
    let (mut b, _) = Raw::hello(&m, false);
    let sa = raw_session(&mut a);
    let sb = raw_session(&mut b);
    let mut outcomes = Vec::new();
    for (n, on_b) in [false, false, true, true, false].into_iter().enumerate() {
        let (c, s) = if on_b { (&mut b, sb) } else { (&mut a, sa) };
        c.submit(100 + n as u64, region_command(s, 1 << 22));
        let e = loop {
            let (k, p) = c.next().unwrap();
            c.fds.clear(); // the test does not map them
            if k != Kind::Events {
                continue;
            }
            if let Some(e) = events_of(&p)
                .into_iter()
                .find(|e| matches!(e, Event::RegionRegistered { .. } | Event::Rejected { .. }))
            {
                break e;
            }
        };
        outcomes.push(if budget_refusal(&e) {
            "limit"
        } else if matches!(e, Event::RegionRegistered { .. }) {
            "ok"
        } else {
            panic!("{e:?}")
        });
    }
    assert_eq!(outcomes, ["ok", "ok", "ok", "limit", "limit"]);
    // The manager is alive and the good client's pages are exact.
    assert!(m.child.try_wait().ok().flatten().is_none());
    let (s, region) = open(&mut good);
    let Event::Ready { operation, .. } = prepared(&mut good, s, &hashes) else {
        panic!("the good client's pages are a hit");
    };
    restore_four(&mut good, s, region, operation, 8, payload);
    // B's session closes: its region's bytes come back to the budget.
    drop(b);
    let deadline = Instant::now() + T;
    loop {
        a.submit(200, region_command(sa, 1 << 22));
        let e = loop {
            let (k, p) = a.next().unwrap();
            a.fds.clear();
            if k == Kind::Events
                && let Some(e) = events_of(&p)
                    .into_iter()
                    .find(|e| matches!(e, Event::RegionRegistered { .. } | Event::Rejected { .. }))
            {
                break e;
            }
        };
        if matches!(e, Event::RegionRegistered { .. }) {
            break;
        }
        assert!(budget_refusal(&e), "{e:?}");
        assert!(
            Instant::now() < deadline,
            "the closed session's bytes never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 23: `max_sessions` is global, so one uid's connections could take
/// every session. A process and a uid each have a share now
/// (`max_sessions_per_process`, `max_sessions_per_uid`), typed `limit`
/// refusals past them; a second process of the same uid gets the uid's
/// share that the first left (the child re-runs this test binary).
#[test]
fn sixteen_connections_of_one_uid_cannot_take_every_session() {
    const CHILD: &str = "ORBITKV_TEST_SESSIONS_CHILD";
    let open_cmd = || Command::OpenSession {
        instance: "llama".into(),
    };
    // Opens sessions on fresh connections, 8 each, until refused; returns
    // the sessions opened and the refusal.
    let grab = |socket: &Path, conns: &mut Vec<Client>| -> (usize, CommandError) {
        let mut opened = 0;
        loop {
            let mut c = Client::connect(socket, "greedy").unwrap();
            if conns.is_empty() {
                register(&mut c);
            }
            for _ in 0..8 {
                match c.call(open_cmd(), T) {
                    Ok(Event::SessionOpened { .. }) => opened += 1,
                    Err(ClientError::Command(e)) => {
                        conns.push(c);
                        return (opened, e);
                    }
                    other => panic!("{other:?}"),
                }
            }
            conns.push(c);
            assert!(conns.len() <= 16, "16 connections took {opened} sessions");
        }
    };
    if let Ok(socket) = std::env::var(CHILD) {
        // The child: the same uid, another process.
        let mut conns = Vec::new();
        let (opened, e) = grab(Path::new(&socket), &mut conns);
        println!(
            "child opened {opened} refused {}",
            serde_json::to_string(&e).unwrap()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = start_full(
        dir.path(),
        "16MiB",
        "max_sessions_per_connection = 8\nmax_sessions_per_uid = 96\nmax_sessions_per_process = 60",
        "[limits]\nmax_sessions = 128\n",
        &[],
    );
    let mut conns = Vec::new();
    let (opened, e) = grab(&m.socket, &mut conns);
    assert_eq!(opened, 60);
    assert_eq!(
        e,
        CommandError::Limit {
            name: LimitName::MaxSessionsPerProcess,
            limit: 60
        }
    );
    let out = Proc::new(std::env::current_exe().unwrap())
        .args([
            "sixteen_connections_of_one_uid_cannot_take_every_session",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &m.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let refusal = serde_json::to_string(&CommandError::Limit {
        name: LimitName::MaxSessionsPerUid,
        limit: 96,
    })
    .unwrap();
    assert!(
        text.contains(&format!("child opened 36 refused {refusal}")),
        "{text}"
    );
    // 96 of 128: the rest is left to other uids, and nothing was broken.
    let mut again = Client::connect(&m.socket, "again").unwrap();
    assert!(matches!(
        again.call(open_cmd(), T).unwrap_err(),
        ClientError::Command(CommandError::Limit {
            name: LimitName::MaxSessionsPerProcess,
            ..
        })
    ));
    drop(conns);
    let deadline = Instant::now() + T;
    while !matches!(again.call(open_cmd(), T), Ok(Event::SessionOpened { .. })) {
        assert!(Instant::now() < deadline, "closed sessions never came back");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 23: outboxes were bounded per connection only, and a frame is
/// held whole until it completes, so 30 connections announcing 16 MiB
/// frames grew the manager by half a gigabyte. Partly received large
/// frames are bounded together (`max_partial_frame_bytes`): the frame
/// that does not fit gets an `Error` naming the limit and its connection
/// closes, before the rest of it is read; outboxes are bounded together
/// (`max_total_outbox_bytes`): past it the largest is cut off.
#[test]
fn half_received_frames_and_outboxes_stay_under_their_global_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with(
        dir.path(),
        "max_partial_frame_bytes = \"40MiB\"\nmax_total_outbox_bytes = \"12MiB\"\nmax_outbox_bytes = \"64MiB\"",
        "",
    );
    let rss_before = m.rss_kib();
    // Each announces a 16 MiB Submit and sends 4 MiB of it.
    let mut senders = Vec::new();
    let mut refused = 0;
    for _ in 0..30 {
        let (mut c, _) = Raw::hello(&m, false);
        let mut bytes = frame::header(Kind::Submit, 16 << 20).to_vec();
        bytes.resize(frame::HEADER_BYTES + (4 << 20), b' ');
        // The manager may close it before all of it is read.
        let _ = c.s.write_all(&bytes);
        senders.push(c);
    }
    for c in &mut senders {
        c.s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        if let Some((k, p)) = c.next_opt() {
            assert_eq!(k, Kind::Error);
            let text = String::from_utf8_lossy(&p);
            assert!(text.contains("max_partial_frame_bytes"), "{text}");
            refused += 1;
        }
    }
    // Two 16 MiB frames fit in 40 MiB; every other one is refused.
    assert_eq!(refused, 28, "refused {refused} of 30");
    assert!(
        m.rss_kib() < rss_before + 96 * 1024,
        "RSS {} KiB -> {} KiB",
        rss_before,
        m.rss_kib()
    );
    m.wait_sample("orbitkv_disconnects_total{reason=\"input_budget\"}", |v| {
        v == 28
    });
    drop(senders);
    // Clients that ask for snapshots and never read: 12 MiB among them.
    let mut readers = Vec::new();
    for _ in 0..8 {
        let (mut c, _) = Raw::hello(&m, false);
        let mut burst = Vec::new();
        for _ in 0..4000 {
            burst.extend_from_slice(&frame::encode(Kind::Inspect, &()));
        }
        c.s.write_all(&burst).unwrap();
        readers.push(c);
    }
    let cut = m.wait_sample("orbitkv_disconnects_total{reason=\"outbox_budget\"}", |v| {
        v > 0
    });
    assert!(cut < 8, "{cut} of 8 cut off");
    // The outbox gauge never stays over the bound (it is sampled every
    // 100 ms: a sample taken before the cut may still show the excess).
    m.wait_sample("orbitkv_outbox_bytes", |v| v <= 12 << 20);
    // The manager serves a good client.
    let mut good = Client::connect(&m.socket, "good").unwrap();
    good.ping().unwrap();
    drop(readers);
}

/// Issue 23: `/metrics` was readable by every local user over TCP. A TCP
/// address must be loopback (unless `metrics_public`), and `unix:PATH`
/// serves it on a socket of mode 0600 whose peers must be this uid: as
/// root the test shows `nobody` cannot connect to it.
#[test]
fn metrics_are_loopback_only_or_owner_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("m.toml");
    std::fs::write(&config, BASE_CONFIG).unwrap();
    let serve = |metrics: &str, name: &str| {
        let mut p = Proc::new(env!("CARGO_BIN_EXE_orbitkv"));
        p.args(["serve", "--socket"])
            .arg(dir.path().join(format!("{name}.sock")))
            .args(["--dram", "16MiB", "--config", config.to_str().unwrap()])
            .args(["--metrics-addr", metrics])
            .env("RUST_LOG", "error")
            .env("ORBITKV_HOT_PATH", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        p
    };
    let out = serve(&format!("0.0.0.0:{}", free_port()), "public")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a loopback address"), "{err}");
    let path = dir.path().join("metrics.sock");
    let mut child = Reaped(
        serve(&format!("unix:{}", path.display()), "unix")
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + T;
    while !path.exists() || !dir.path().join("unix.sock").exists() {
        assert!(Instant::now() < deadline, "manager did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.contains("orbitkv_queries_total"), "{body}");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt as _;
        let script = format!(
            "import socket\ns=socket.socket(socket.AF_UNIX)\ntry:\n  s.connect({:?}); print('connected')\nexcept OSError as e:\n  print(e.errno)\n",
            path.display().to_string()
        );
        // The socket's directory must be reachable for the mode to be
        // what stops `nobody`.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Proc::new("/usr/bin/python3")
            .args(["-I", "-c", &script])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let got = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert_eq!(got, libc::EACCES.to_string());
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    assert!(!path.exists(), "the metrics socket is removed at shutdown");
}

/// The copy agent of an engine, riding on its client as the bridge's does.
struct RacedAgent(std::sync::Arc<std::sync::Mutex<orbitkv_gpu::agent::CopyAgent>>);

impl RacedAgent {
    fn lock(&self) -> std::sync::MutexGuard<'_, orbitkv_gpu::agent::CopyAgent> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl orbitkv_ipc::Agent for RacedAgent {
    fn window(
        &mut self,
        pool: &std::fs::File,
        pool_len: u64,
        staging: std::fs::File,
        staging_len: u64,
    ) -> Result<(), String> {
        use std::os::fd::AsFd as _;
        let mut agent = self.lock();
        if agent.has_window() {
            return Ok(());
        }
        let w = orbitkv_gpu::agent::HostWindow::map(
            pool.as_fd(),
            pool_len,
            staging.as_fd(),
            staging_len,
        )
        .map_err(|e| e.to_string())?;
        agent.set_window(w).map_err(|e| e.to_string())
    }

    fn take(&mut self, event: &Event) -> bool {
        matches!(event, Event::AgentCopy { .. }) && self.lock().handle(event)
    }

    fn reports(&mut self, out: &mut Vec<Command>) {
        self.lock().poll(out);
    }

    fn busy(&self) -> bool {
        self.lock().busy()
    }

    fn lost(&mut self) {
        let mut discard = Vec::new();
        self.lock().drain(Duration::from_secs(10), &mut discard);
    }
}

/// Issue 23: another process of the engine's uid opened its staging area
/// through `/proc/<engine>/fd/N` and rewrote pages between the agent's
/// copy and the manager's copy-in: 780 of 800 published pages were
/// replaced, all under valid checksums. Here a thread of the engine
/// process itself plays that writer, reopening the staging memfd through
/// `/proc/self/fd` and overwriting all of it in a loop while an official
/// client publishes 800 pages through its copy agent. Every page is then
/// looked up: each one the manager serves holds exactly the engine's
/// bytes; the raced ones were refused at publish.
#[test]
fn a_racing_writer_of_the_staging_area_never_gets_a_page_served() {
    use std::os::unix::fs::FileExt as _;
    use std::sync::atomic::{AtomicBool, Ordering};
    const PAGES: u32 = 800;
    const BATCH: u32 = 100;
    let dir = tempfile::tempdir().unwrap();
    // A pool of another size than the staging area, so the writer finds
    // the staging memfd by its size.
    let m = start_full(dir.path(), "32MiB", "", "", &[]);
    let payload = |i: u32| -> Vec<u8> {
        (0..BYTES)
            .map(|b| (u64::from(i) * 31 + b * 7 + b / 251) as u8)
            .collect()
    };
    // The engine's memory: one page per slot, written before the publish.
    let mut memory = vec![0u8; (PAGES as u64 * BYTES) as usize];
    for i in 0..PAGES {
        let at = (u64::from(i) * BYTES) as usize;
        memory[at..at + BYTES as usize].copy_from_slice(&payload(i));
    }
    let executor = Box::new(orbitkv_gpu::host::HostCopyEngine::new(
        orbitkv_gpu::host::HostCopyConfig::default(),
    ));
    let agent = std::sync::Arc::new(std::sync::Mutex::new(orbitkv_gpu::agent::CopyAgent::new(
        executor,
    )));
    let chunk = orbitkv_gpu::agent::Chunk {
        kind: orbitkv_gpu::agent::MemoryKind::Host,
        ptr: memory.as_mut_ptr() as u64,
        stride: BYTES,
        len: BYTES,
    };
    // SAFETY: `memory` outlives the agent (dropped with the client below).
    let (engine_region, page_bytes) =
        unsafe { agent.lock().unwrap().attach(PAGES, &[chunk]) }.unwrap();
    let options = ClientOptions {
        hot_path: false,
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&m.socket, "engine", options).unwrap();
    c.set_agent(Box::new(RacedAgent(agent.clone()))).unwrap();
    register(&mut c);
    let (s, region) = with_driver(&mut c, T, |d| {
        let s = d.open("llama")?;
        let r = d.call(
            "region",
            Command::RegisterDeviceRegion {
                session: s,
                rank: 0,
                group: 0,
                slots: PAGES,
                agent: Some(orbitkv_components::api::AgentRegion {
                    region: engine_region,
                    page_bytes,
                }),
            },
        )?;
        Ok::<_, orbitkv_world::driver::DriverError<_>>((s, r))
    })
    .unwrap();
    let Event::RegionRegistered { region, .. } = region else {
        panic!("{region:?}");
    };
    // The writer: the staging area is the one writable shared-memory
    // mapping of this process of the staging area's size (the agent's
    // window); another process of the uid writes it through
    // /proc/<engine>/mem, as this thread does through /proc/self/mem.
    let staging_len = orbitkv_world::Config::default().limits.max_staging_bytes;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let staging_at = maps
        .lines()
        .filter(|l| {
            l.contains("memfd:")
                && l.split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.starts_with("rw"))
        })
        .find_map(|l| {
            let (range, _) = l.split_once(' ')?;
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            (b - a == staging_len).then_some(a)
        })
        .expect("the agent's writable staging mapping");
    let staging = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let junk = vec![0xEEu8; 1 << 20];
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for at in (0..staging_len).step_by(1 << 20) {
                    staging.write_all_at(&junk, staging_at + at).unwrap();
                }
                rounds += 1;
            }
            rounds
        })
    };
    let mut inserted = 0;
    for first in (0..PAGES).step_by(BATCH as usize) {
        let done = with_driver(&mut c, T, |d| {
            let dps = d.alloc_many(s, region, first..first + BATCH)?;
            let pages = dps
                .iter()
                .enumerate()
                .map(|(n, &device_page)| PublishPage {
                    rank: 0,
                    group: 0,
                    hash: NativeHash::from_u64(0xA000 + u64::from(first) + n as u64),
                    device_page,
                })
                .collect();
            d.publish(s, u64::from(first) + 1, pages)
        })
        .unwrap();
        inserted += done.inserted;
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    assert!(rounds > 0, "the writer raced");
    // Every page: served exactly as the engine wrote it, or a miss.
    let (mut hits, mut wrong) = (0, 0);
    for i in 0..PAGES {
        let q = Command::Query {
            session: s,
            request: 10_000 + u64::from(i),
            groups: vec![GroupHashes {
                group: 0,
                hashes: vec![NativeHash::from_u64(0xA000 + u64::from(i))],
            }],
            origin: 0,
            prompt_len: 2 * PAGE,
            expect_namespaces: vec![],
            prepare: true,
            speculative: false,
        };
        let ready = with_driver(&mut c, T, |d| {
            let id = d.submit(q)?;
            d.tick()?;
            match d.reply("query", id)? {
                Event::QueryResult {
                    operation,
                    miss: None,
                    ..
                } => d.ready(operation).map(Some),
                _ => Ok(None),
            }
        })
        .unwrap();
        let Some(Event::Ready {
            operation, leases, ..
        }) = ready
        else {
            continue;
        };
        hits += 1;
        if c.page(&leases[0]).unwrap() != payload(i) {
            wrong += 1;
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
    let refused = m.wait_metric_until("publish_checksum_refusals_total", |_| true);
    eprintln!(
        "{PAGES} published under a racing writer ({rounds} passes over the staging area): \
         {inserted} stored, {refused} refused, {hits} served, {wrong} wrong"
    );
    assert_eq!(wrong, 0, "a page the writer altered was served");
    assert_eq!(hits, inserted as usize, "every stored page is served");
    assert_eq!(inserted + refused, u64::from(PAGES));
    drop(c);
    drop(agent);
    drop(memory);
}
