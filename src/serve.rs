//! `orbitkv serve`: the manager process. One thread runs the runtime and
//! every connection: it reads frames, submits commands, ticks when commands
//! arrive (and at the idle interval while I/O is in flight), and routes each
//! event to the connection that owns it. The DRAM pool and device regions
//! live in shared memory the clients map; KV bytes never travel in frames.
//!
//! The hot path (docs/serve.md, "Hot path"): the same loop serves an
//! iceoryx2 request/response service, polled without blocking each round
//! ([`HotServer`]); its wake listener's descriptor is in the loop's
//! `ppoll`, so a client's request wakes a sleeping manager.

use std::collections::BTreeMap;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use orbitkv_components::api::{CommandError, Origin};
use orbitkv_io::ipc::frame::{self, FrameError, Kind, MAX_FRAME_BYTES};
use orbitkv_io::ipc::hot_server::HotServer;
use orbitkv_io::ipc::{Accepted, Hello, ProtocolError, Submit, Welcome};
use orbitkv_world::{Config, Runtime};
use serde::Deserialize;
use tracing::{info, warn};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Unix socket to listen on (created with mode 0600).
    #[arg(long, env = "ORBITKV_SOCKET")]
    socket: Option<PathBuf>,
    /// DRAM tier size, e.g. 4GiB.
    #[arg(long, env = "ORBITKV_DRAM")]
    dram: Option<String>,
    /// SSD tier as DIR:SIZE, e.g. /mnt/nvme/orbitkv:200GiB.
    #[arg(long, env = "ORBITKV_SSD")]
    ssd: Option<String>,
    /// Remote tier: redis://HOST:PORT, or comma-separated cluster seeds
    /// (docs/remote.md). The password comes from ORBITKV_REMOTE_PASSWORD
    /// or `[remote] password_file`, never from the URL.
    #[arg(long, env = "ORBITKV_REMOTE")]
    remote: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9400.
    #[arg(long, env = "ORBITKV_METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// Record every command as a trace `orbitkv replay` runs.
    #[arg(long, env = "ORBITKV_RECORD")]
    record: Option<PathBuf>,
    /// TOML config: a `[serve]` table with the options above, and the
    /// runtime configuration (`[dram]`, `[budget]`, `[limits]`, ...).
    #[arg(long, env = "ORBITKV_CONFIG")]
    config: Option<PathBuf>,
    /// Tick interval while I/O is in flight and no commands arrive.
    #[arg(long, env = "ORBITKV_IDLE_TICK_US")]
    idle_tick_us: Option<u64>,
}

/// The `[serve]` table of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    socket: Option<PathBuf>,
    dram: Option<String>,
    ssd: Option<String>,
    remote: Option<String>,
    metrics_addr: Option<String>,
    record: Option<PathBuf>,
    idle_tick_us: Option<u64>,
    /// Connections served at once; more are refused.
    max_connections: Option<usize>,
    /// Bytes queued for one client before it is disconnected as stuck.
    max_outbox_bytes: Option<usize>,
    /// Offer the iceoryx2 hot path to clients that ask (default true).
    hot_path: Option<bool>,
    /// Each hot connection's descriptor area, e.g. 1MiB.
    hot_area: Option<String>,
}

#[derive(Debug, Deserialize)]
struct FileConfig {
    #[serde(default)]
    serve: ServeFile,
    #[serde(flatten)]
    runtime: toml::Table,
}

/// Everything `serve` runs with, after file, environment and flags.
#[derive(Debug)]
pub struct Settings {
    pub socket: PathBuf,
    pub metrics_addr: Option<String>,
    pub record: Option<PathBuf>,
    pub idle_tick: Duration,
    pub max_connections: usize,
    pub max_outbox_bytes: usize,
    pub hot_path: bool,
    pub hot_area_bytes: u64,
    pub runtime: Config,
}

/// Parses `4GiB`, `512MiB`, `100MB`, `1G`, or plain bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .with_context(|| format!("size {s:?} has no number"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => bail!("size {s:?} has an unknown unit {other:?}"),
    };
    n.checked_mul(mult)
        .with_context(|| format!("size {s:?} overflows"))
}

fn default_socket() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map_or_else(|| PathBuf::from("/tmp"), PathBuf::from)
        .join("orbitkv.sock")
}

pub fn settings(args: &Args) -> Result<Settings> {
    let file: FileConfig = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?;
            toml::from_str(&text).with_context(|| format!("{}", p.display()))?
        }
        None => FileConfig {
            serve: ServeFile::default(),
            runtime: toml::Table::new(),
        },
    };
    let mut runtime: Config = toml::Value::Table(file.runtime)
        .try_into()
        .context("runtime configuration")?;
    let serve = file.serve;
    if let Some(d) = args.dram.as_ref().or(serve.dram.as_ref()) {
        runtime.dram.capacity_bytes = parse_size(d)?;
    }
    if let Some(spec) = args.ssd.as_ref().or(serve.ssd.as_ref()) {
        let (dir, size) = spec
            .rsplit_once(':')
            .with_context(|| format!("--ssd {spec:?} is not DIR:SIZE"))?;
        let mut ssd = runtime.ssd.take().unwrap_or_default();
        ssd.dir = PathBuf::from(dir);
        ssd.capacity_bytes = parse_size(size)?;
        runtime.ssd = Some(ssd);
    }
    if let Some(spec) = args.remote.as_ref().or(serve.remote.as_ref()) {
        let mut remote = runtime.remote.take().unwrap_or_default();
        remote.urls = orbitkv_io::remote::RemoteConfig::parse_urls(spec);
        runtime.remote = Some(remote);
    }
    if let Some(remote) = &runtime.remote {
        remote.validate()?;
    }
    // The pool and device regions are shared with clients.
    runtime.dram.shared = true;
    runtime.copy.shared_regions = true;
    runtime.incarnation = incarnation();
    runtime.validate()?;
    Ok(Settings {
        socket: args
            .socket
            .clone()
            .or(serve.socket)
            .unwrap_or_else(default_socket),
        metrics_addr: args.metrics_addr.clone().or(serve.metrics_addr),
        record: args.record.clone().or(serve.record),
        idle_tick: Duration::from_micros(
            args.idle_tick_us
                .or(serve.idle_tick_us)
                .unwrap_or(200)
                .max(10),
        ),
        max_connections: serve.max_connections.unwrap_or(256),
        max_outbox_bytes: serve.max_outbox_bytes.unwrap_or(64 << 20),
        hot_path: serve.hot_path.unwrap_or(true)
            && std::env::var("ORBITKV_HOT_PATH").map_or(true, |v| v != "0"),
        hot_area_bytes: match &serve.hot_area {
            Some(s) => parse_size(s)?,
            None => orbitkv_io::ipc::hot::DEFAULT_AREA_BYTES,
        },
        runtime,
    })
}

/// A fresh id per manager start, so handles from a previous manager are
/// stale (`StaleSession`).
fn incarnation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 40)) | 1
}

type ConnId = u64;

struct Conn {
    stream: UnixStream,
    inbuf: Vec<u8>,
    fds: Vec<OwnedFd>,
    out: Vec<u8>,
    out_fds: Vec<OwnedFd>,
    events: Vec<orbitkv_components::api::Event>,
    greeted: bool,
    closing: bool,
    name: String,
}

/// A connection's origin in the runtime (0 is the embedded caller).
fn origin(conn: ConnId) -> Origin {
    Origin(conn + 1)
}

/// The connection an event is addressed to.
fn conn_of(to: Origin) -> Option<ConnId> {
    to.0.checked_sub(1)
}

struct Server {
    rt: Runtime,
    settings: Settings,
    listener: Option<UnixListener>,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    uid: u32,
    metrics: Arc<Mutex<String>>,
    metrics_updated: Instant,
    last_tick: Instant,
    hot: Option<HotServer>,
    /// What the last `ppoll` found readable: the listener, and connections.
    accept_ready: bool,
    ready: Vec<ConnId>,
}

/// How often the metrics snapshot is refreshed.
const METRICS_EVERY: Duration = Duration::from_millis(100);

pub fn run(args: Args) -> Result<()> {
    let settings = settings(&args)?;
    let mut rt = Runtime::new(settings.runtime.clone()).context("starting the runtime")?;
    if let Some(path) = &settings.record {
        let f = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
        rt.record(
            Box::new(io::BufWriter::new(f)),
            settings.idle_tick.as_micros() as u64,
        )?;
    }
    let listener = bind(&settings.socket)?;
    let hot = if settings.hot_path {
        match HotServer::new(
            settings.runtime.incarnation,
            settings.max_connections,
            settings.hot_area_bytes,
        ) {
            Ok(h) => {
                info!(service = h.service(), "hot path on iceoryx2");
                Some(h)
            }
            Err(e) => {
                warn!(error = %e, "no hot path: clients use the socket");
                None
            }
        }
    } else {
        None
    };
    let metrics = Arc::new(Mutex::new(String::new()));
    if let Some(addr) = &settings.metrics_addr {
        serve_metrics(addr, metrics.clone())?;
    }
    let term = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, term.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, term.clone())?;
    info!(
        socket = %settings.socket.display(),
        dram_bytes = settings.runtime.dram.capacity_bytes,
        ssd = ?settings.runtime.ssd.as_ref().map(|s| s.dir.display().to_string()),
        remote = ?settings.runtime.remote.as_ref().map(|r| &r.urls),
        incarnation = settings.runtime.incarnation,
        first_touch_s_per_gib = ?rt.first_touch().map(|f| f.seconds_per_gib),
        "orbitkv serving"
    );
    let mut server = Server {
        rt,
        settings,
        listener: Some(listener),
        conns: BTreeMap::new(),
        next_conn: 0,
        // SAFETY: getuid has no preconditions.
        uid: unsafe { libc::getuid() },
        metrics,
        metrics_updated: Instant::now(),
        last_tick: Instant::now(),
        hot,
        accept_ready: false,
        ready: Vec::new(),
    };
    server.run_loop(&term);
    server.shutdown();
    Ok(())
}

fn bind(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        // A live manager answers; a stale socket file from a crash does not.
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use by another manager", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

impl Server {
    fn run_loop(&mut self, term: &AtomicBool) {
        let mut busy_until = Instant::now();
        while !term.load(Ordering::Relaxed) {
            // Spin (poll without sleeping) briefly after activity: the next
            // request of an engine step usually follows within microseconds.
            let timeout = if Instant::now() < busy_until {
                Duration::ZERO
            } else {
                self.settings.idle_tick
            };
            self.wait(timeout);
            let submitted = self.accept_and_read() + self.read_hot();
            let io_pending = self.rt.in_flight() > 0;
            if submitted > 0
                || (io_pending && self.last_tick.elapsed() >= self.settings.idle_tick)
                || self.last_tick.elapsed() >= Duration::from_millis(100)
            {
                self.tick();
            }
            if submitted > 0 {
                busy_until = Instant::now() + Duration::from_micros(100);
            }
            self.push_wakes();
            self.flush();
        }
    }

    /// Blocks until a socket is readable or `timeout` passes.
    fn wait(&mut self, timeout: Duration) {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.conns.len() + 1);
        if let Some(l) = &self.listener {
            fds.push(libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        for c in self.conns.values() {
            fds.push(libc::pollfd {
                fd: c.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let mut timeout = timeout;
        let mut sleeping = false;
        if let Some(h) = &self.hot {
            fds.push(libc::pollfd {
                fd: h.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            if !timeout.is_zero() {
                // Clients that send now notify the wake listener.
                sleeping = true;
                if h.prepare_sleep() {
                    timeout = Duration::ZERO;
                }
            }
        }
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a valid array of pollfds and a timespec.
        let n = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if sleeping && let Some(h) = &self.hot {
            h.woke();
        }
        // Read only what is readable: a receive per connection per round
        // would cost a syscall each.
        let listening = usize::from(self.listener.is_some());
        self.accept_ready = listening == 1 && (n < 0 || fds[0].revents != 0);
        self.ready.clear();
        for (i, id) in self.conns.keys().enumerate() {
            if n < 0 || fds[listening + i].revents != 0 {
                self.ready.push(*id);
            }
        }
    }

    /// Takes hot requests (non-blocking) and submits their commands;
    /// returns how many were submitted. Bad requests were answered with a
    /// typed error by the hot server.
    fn read_hot(&mut self) -> usize {
        let Some(h) = self.hot.as_mut() else {
            return 0;
        };
        let incoming = h.receive(1024);
        let mut submitted = 0;
        for inc in incoming {
            let result = match self.rt.submit(origin(inc.conn), inc.command) {
                Ok(cid) => {
                    submitted += 1;
                    Ok(cid)
                }
                Err(orbitkv_world::SubmitError::InboxFull(limit)) => Err(CommandError::Limit {
                    name: "max_inbox".into(),
                    limit: limit as u64,
                }),
            };
            if let Some(h) = self.hot.as_mut() {
                h.submitted(inc.key, result);
            }
        }
        submitted
    }

    /// `Wake` frames for hot clients that blocked and got responses.
    fn push_wakes(&mut self) {
        let Some(h) = self.hot.as_mut() else {
            return;
        };
        for id in h.take_wakes() {
            if let Some(c) = self.conns.get_mut(&id) {
                c.out.extend(frame::encode(Kind::Wake, &()));
            }
        }
    }

    /// Accepts new connections and handles every complete frame; returns
    /// how many commands were submitted.
    fn accept_and_read(&mut self) -> usize {
        let mut fresh = Vec::new();
        if self.accept_ready
            && let Some(listener) = &self.listener
        {
            // Bounded: at most a connection limit's worth per pass.
            while fresh.len() < self.settings.max_connections
                && let Ok((stream, _)) = listener.accept()
            {
                fresh.push(stream);
            }
        }
        for stream in fresh {
            self.admit(stream);
        }
        let mut submitted = 0;
        for id in std::mem::take(&mut self.ready) {
            let Some(conn) = self.conns.get_mut(&id) else {
                continue; // closed since the poll
            };
            let mut closed = false;
            loop {
                match frame::recv_some(&conn.stream, &mut conn.inbuf, 256 << 10, &mut conn.fds) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(_) if conn.inbuf.len() > (MAX_FRAME_BYTES as usize) * 2 => break,
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
            // Clients send no descriptors; drop any they did.
            conn.fds.clear();
            loop {
                let conn = self.conns.get_mut(&id).expect("listed");
                match frame::take_frame(&mut conn.inbuf) {
                    Ok(None) => break,
                    Ok(Some((kind, payload))) => match self.handle_frame(id, kind, &payload) {
                        Ok(n) => submitted += n,
                        Err(e) => {
                            self.refuse(id, &e.to_string());
                            break;
                        }
                    },
                    Err(e) => {
                        self.refuse(id, &e.to_string());
                        break;
                    }
                }
            }
            if closed {
                self.disconnect(id, "peer closed");
            }
        }
        submitted
    }

    fn admit(&mut self, stream: UnixStream) {
        // Same user only: the pool and regions hold another tenant's state.
        match frame::peer_credentials(&stream) {
            Ok((pid, uid, _)) if uid == self.uid => {
                if self.conns.len() >= self.settings.max_connections {
                    warn!(pid, "refusing a connection: max_connections reached");
                    let _ = frame::write_all(
                        &stream,
                        &frame::encode(
                            Kind::Error,
                            &ProtocolError {
                                error: "too many connections".into(),
                            },
                        ),
                    );
                    return;
                }
                let _ = stream.set_nonblocking(true);
                let id = self.next_conn;
                self.next_conn += 1;
                info!(conn = id, pid, "client connected");
                self.conns.insert(
                    id,
                    Conn {
                        stream,
                        inbuf: Vec::new(),
                        fds: Vec::new(),
                        out: Vec::new(),
                        out_fds: Vec::new(),
                        events: Vec::new(),
                        greeted: false,
                        closing: false,
                        name: format!("pid {pid}"),
                    },
                );
            }
            Ok((pid, uid, _)) => {
                warn!(pid, uid, "refusing a connection from another user");
                let _ = frame::write_all(
                    &stream,
                    &frame::encode(
                        Kind::Error,
                        &ProtocolError {
                            error: format!("uid {uid} may not use this manager"),
                        },
                    ),
                );
            }
            Err(e) => warn!(error = %e, "refusing a connection without peer credentials"),
        }
    }

    fn handle_frame(
        &mut self,
        id: ConnId,
        kind: Kind,
        payload: &[u8],
    ) -> Result<usize, FrameError> {
        let conn = self.conns.get_mut(&id).expect("caller checked");
        if !conn.greeted && kind != Kind::Hello {
            return Err(FrameError::Payload {
                kind,
                reason: "the first frame must be Hello".into(),
            });
        }
        match kind {
            Kind::Hello => {
                let hello: Hello = frame::decode(kind, payload)?;
                if hello.protocol != frame::PROTOCOL_VERSION {
                    return Err(FrameError::Version(hello.protocol));
                }
                conn.greeted = true;
                if !hello.client.is_empty() {
                    conn.name = hello.client;
                }
                let pool = self.rt.export_pool();
                let hot = match (&mut self.hot, hello.hot) {
                    (Some(h), true) => match h.register(id) {
                        Ok(x) => Some(x),
                        Err(e) => {
                            warn!(conn = id, error = %e, "no hot path for this connection");
                            None
                        }
                    },
                    _ => None,
                };
                let welcome = Welcome {
                    protocol: frame::PROTOCOL_VERSION,
                    incarnation: self.settings.runtime.incarnation,
                    pool_bytes: if pool.is_some() {
                        self.rt.pool_capacity()
                    } else {
                        0
                    },
                    max_frame_bytes: MAX_FRAME_BYTES,
                    hot: hot.as_ref().map(|(info, _)| info.clone()),
                };
                let conn = self.conns.get_mut(&id).expect("caller checked");
                conn.out.extend(frame::encode(Kind::Welcome, &welcome));
                // The pool's descriptor, then the descriptor area's.
                conn.out_fds.extend(pool);
                conn.out_fds
                    .extend(hot.map(|(_, area)| OwnedFd::from(area)));
                // Send now, so the descriptor rides on this frame.
                self.flush_conn(id);
                Ok(0)
            }
            Kind::Submit => {
                let submit: Submit = frame::decode(kind, payload)?;
                let result = match self.rt.submit(origin(id), submit.command) {
                    Ok(cid) => Ok(cid),
                    Err(orbitkv_world::SubmitError::InboxFull(limit)) => Err(CommandError::Limit {
                        name: "max_inbox".into(),
                        limit: limit as u64,
                    }),
                };
                let accepted = Accepted {
                    tag: submit.tag,
                    result,
                };
                self.conns
                    .get_mut(&id)
                    .expect("caller checked")
                    .out
                    .extend(frame::encode(Kind::Accepted, &accepted));
                Ok(1)
            }
            Kind::Ping => {
                conn.out.extend(frame::encode(Kind::Pong, &()));
                Ok(0)
            }
            other => Err(FrameError::Payload {
                kind: other,
                reason: "not a client frame".into(),
            }),
        }
    }

    /// Sends a protocol error and closes the connection.
    fn refuse(&mut self, id: ConnId, why: &str) {
        warn!(
            conn = id,
            error = why,
            "closing a connection after a protocol error"
        );
        if let Some(c) = self.conns.get_mut(&id) {
            c.out.extend(frame::encode(
                Kind::Error,
                &ProtocolError {
                    error: why.to_owned(),
                },
            ));
            c.closing = true;
        }
        self.flush_conn(id);
        self.disconnect(id, why);
    }

    /// Forgets a connection. Its sessions close as if the engine crashed:
    /// submitted I/O drains, then every lease and reserved byte returns.
    fn disconnect(&mut self, id: ConnId, why: &str) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        if let Some(h) = self.hot.as_mut() {
            h.unregister(id);
        }
        info!(conn = id, client = %conn.name, reason = why, "client disconnected");
        self.rt.close_origin(origin(id));
    }

    fn tick(&mut self) {
        let events = self.rt.tick();
        self.last_tick = Instant::now();
        for a in events {
            // The addressee may have disconnected since: its sessions are
            // closing, and nobody is left to tell.
            let Some(conn) = conn_of(a.to).and_then(|id| self.conns.get_mut(&id)) else {
                continue;
            };
            let e = a.event;
            if let orbitkv_components::api::Event::RegionRegistered { engine_region, .. } = &e
                && let Some(fd) = self.rt.export_device_region(*engine_region)
            {
                conn.out_fds.push(fd);
            }
            // Answers to hot requests go back on the hot path.
            if let Some(h) = self.hot.as_mut()
                && h.deliver(&e)
            {
                continue;
            }
            conn.events.push(e);
        }
        if let Some(h) = self.hot.as_mut() {
            h.end_tick();
        }
        if self.metrics_updated.elapsed() >= METRICS_EVERY {
            self.metrics_updated = Instant::now();
            self.update_metrics();
        }
    }

    fn update_metrics(&mut self) {
        if Arc::strong_count(&self.metrics) == 1 {
            return; // no metrics endpoint
        }
        let s = self.rt.stats();
        let m = &s.metrics;
        let mut o = String::new();
        let mut line = |name: &str, help: &str, v: u64| {
            o.push_str(&format!(
                "# HELP orbitkv_{name} {help}\n# TYPE orbitkv_{name} gauge\norbitkv_{name} {v}\n"
            ));
        };
        line("queries_total", "Queries validated", m.queries);
        line("hits_total", "Recoveries restored", m.hits);
        line(
            "hit_tokens_total",
            "Tokens restored instead of recomputed",
            m.hit_tokens,
        );
        line(
            "queried_tokens_total",
            "Tokens queried past the origin",
            m.queried_tokens,
        );
        line(
            "bytes_restored_total",
            "Bytes copied DRAM to device",
            m.bytes_restored,
        );
        line(
            "bytes_published_total",
            "Bytes copied device to DRAM",
            m.bytes_published,
        );
        line(
            "bytes_read_total",
            "Bytes read from lower tiers",
            m.bytes_read,
        );
        line(
            "checksum_failures_total",
            "Pages that failed verification",
            m.checksum_failures,
        );
        line(
            "transfers_overdue_total",
            "Transfers past their timeout",
            m.transfers_overdue,
        );
        line("pages", "Pages resident in DRAM", s.pages as u64);
        line(
            "dram_bytes_used",
            "DRAM pool bytes in use",
            s.pool_bytes_used,
        );
        line(
            "dram_capacity_bytes",
            "DRAM pool capacity",
            s.pool_capacity_bytes,
        );
        line(
            "bytes_reserved",
            "Recovery bytes reserved",
            s.bytes_reserved,
        );
        line("leases", "Live leases", s.leases as u64);
        line("operations", "Live operations", s.operations as u64);
        line("sessions", "Open sessions", s.sessions as u64);
        line("connections", "Connected clients", self.conns.len() as u64);
        if let Some(h) = &self.hot {
            let st = h.stats;
            line(
                "hot_requests_total",
                "Hot-path requests received",
                st.requests,
            );
            line(
                "hot_errors_total",
                "Hot-path requests refused as malformed",
                st.errors,
            );
            line(
                "hot_responses_total",
                "Hot-path responses sent",
                st.responses,
            );
            line(
                "hot_fallbacks_total",
                "Answers to hot requests sent on the socket",
                st.fallbacks,
            );
            line(
                "hot_wakes_total",
                "Wake frames sent to blocked hot clients",
                st.wakes,
            );
            line(
                "hot_open_requests",
                "Hot requests open",
                h.open_requests() as u64,
            );
        }
        o.push_str(
            "# HELP orbitkv_misses_total Misses by reason\n# TYPE orbitkv_misses_total counter\n",
        );
        for r in orbitkv_components::api::MissReason::ALL {
            o.push_str(&format!(
                "orbitkv_misses_total{{reason=\"{r}\"}} {}\n",
                m.misses.get(&r).copied().unwrap_or(0)
            ));
        }
        o.push_str("# HELP orbitkv_evictions_total Evictions by reason\n# TYPE orbitkv_evictions_total counter\n");
        for (r, v) in &m.evictions {
            o.push_str(&format!(
                "orbitkv_evictions_total{{reason=\"{}\"}} {v}\n",
                serde_json::to_value(r)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default()
            ));
        }
        for (k, v) in &m.demotions {
            o.push_str(&format!("orbitkv_demotions_total{{outcome=\"{k}\"}} {v}\n"));
        }
        for (k, v) in &m.write_through {
            o.push_str(&format!(
                "orbitkv_write_through_total{{outcome=\"{k}\"}} {v}\n"
            ));
        }
        if let Some(r) = self.rt.remote_stats() {
            r.render_prometheus(&mut o);
        }
        if let Ok(mut shared) = self.metrics.lock() {
            *shared = o;
        }
    }

    fn flush(&mut self) {
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for id in ids {
            self.flush_conn(id);
        }
    }

    fn flush_conn(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if !conn.events.is_empty() {
            let events = std::mem::take(&mut conn.events);
            conn.out.extend(frame::encode(Kind::Events, &events));
        }
        if conn.out.is_empty() {
            return;
        }
        if conn.out.len() > self.settings.max_outbox_bytes {
            warn!(conn = id, "client does not read its replies; disconnecting");
            self.disconnect(id, "outbox full");
            return;
        }
        let out = std::mem::take(&mut conn.out);
        let fds: Vec<OwnedFd> = std::mem::take(&mut conn.out_fds);
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let r = raw.chunks(frame::MAX_FDS_PER_FRAME).next().map_or_else(
            || frame::write_all(&conn.stream, &out),
            |chunk| frame::send_with_fds(&conn.stream, &out, chunk),
        );
        if let Err(e) = r {
            self.disconnect(id, &format!("write failed: {e}"));
        }
    }

    /// Graceful stop: no new connections or commands; submitted I/O drains.
    fn shutdown(&mut self) {
        info!("shutting down: draining submitted I/O");
        self.listener = None;
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for id in ids {
            self.disconnect(id, "manager shutting down");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            self.tick();
            if self.rt.is_idle() {
                break;
            }
            std::thread::sleep(self.settings.idle_tick);
        }
        if let Err(e) = self.rt.stop_recording() {
            warn!(error = %e, "the trace recording is incomplete");
        }
        if let Some(h) = self.hot.take() {
            // Every client is disconnected: the incarnation's iceoryx2 files
            // can all go.
            h.shutdown();
        }
        let _ = std::fs::remove_file(&self.settings.socket);
        info!("stopped");
    }
}

/// A tiny HTTP endpoint for Prometheus: GET /metrics.
fn serve_metrics(addr: &str, metrics: Arc<Mutex<String>>) -> Result<()> {
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("metrics address {addr}"))?;
    info!(addr, "metrics at /metrics");
    std::thread::Builder::new().name("orbitkv-metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut stream = stream;
            let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
            let mut req = [0u8; 1024];
            let n = stream.read(&mut req).unwrap_or(0);
            let ok = req[..n].starts_with(b"GET /metrics");
            let body = if ok { metrics.lock().map(|m| m.clone()).unwrap_or_default() } else { "not found\n".into() };
            let status = if ok { "200 OK" } else { "404 Not Found" };
            let _ = write!(stream, "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    })?;
    Ok(())
}
