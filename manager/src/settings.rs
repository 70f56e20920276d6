//! What the manager runs with: flags, environment and the config file's
//! `[serve]` table, merged into [`Settings`] (flags win over the
//! environment, which wins over the file). Every bound of a connection is
//! here, by name.

use std::path::PathBuf;
use std::time::Duration;

use orbitkv_world::Config;
use serde::Deserialize;

use crate::ServeError;

#[derive(clap::Args, Debug, Default)]
pub struct Args {
    /// Unix socket to listen on (created with mode 0600).
    #[arg(long, env = "ORBITKV_SOCKET")]
    pub socket: Option<PathBuf>,
    /// DRAM tier size, e.g. 4GiB.
    #[arg(long, env = "ORBITKV_DRAM")]
    pub dram: Option<String>,
    /// SSD tier as DIR:SIZE, e.g. /mnt/nvme/orbitkv:200GiB.
    #[arg(long, env = "ORBITKV_SSD")]
    pub ssd: Option<String>,
    /// Remote tier: redis://HOST:PORT, or comma-separated cluster seeds
    /// (docs/remote.md). The password comes from ORBITKV_REMOTE_PASSWORD
    /// or `[remote] password_file`, never from the URL.
    #[arg(long, env = "ORBITKV_REMOTE")]
    pub remote: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9400.
    #[arg(long, env = "ORBITKV_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Record every command as a trace `orbitkv replay` runs.
    #[arg(long, env = "ORBITKV_RECORD")]
    pub record: Option<PathBuf>,
    /// TOML config: a `[serve]` table with the options above, and the
    /// runtime configuration (`[dram]`, `[budget]`, `[limits]`, ...).
    #[arg(long, env = "ORBITKV_CONFIG")]
    pub config: Option<PathBuf>,
    /// Tick interval while I/O is in flight and no commands arrive.
    #[arg(long, env = "ORBITKV_IDLE_TICK_US")]
    pub idle_tick_us: Option<u64>,
    /// Publish KV events (ZMQ PUB, vLLM's KVEventBatch) at this address,
    /// e.g. tcp://127.0.0.1:5557; `[events]` holds the other settings.
    #[arg(long, env = "ORBITKV_EVENTS_ADDR")]
    pub events_addr: Option<String>,
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
    max_connections: Option<usize>,
    max_outbox_bytes: Option<SizeValue>,
    max_total_outbox_bytes: Option<SizeValue>,
    max_partial_frame_bytes: Option<SizeValue>,
    stall_timeout_ms: Option<u64>,
    max_sessions_per_connection: Option<usize>,
    max_sessions_per_uid: Option<usize>,
    max_sessions_per_process: Option<usize>,
    max_regions_per_connection: Option<usize>,
    max_frames_per_round: Option<usize>,
    max_metrics_connections: Option<usize>,
    metrics_public: Option<bool>,
    metrics_timeout_ms: Option<u64>,
    lookup_per_second: Option<u32>,
    lookup_max_body_bytes: Option<SizeValue>,
    hot_path: Option<bool>,
    hot_area: Option<String>,
    spin_after_work_us: Option<u64>,
    spin_for_streams_us: Option<u64>,
    socket_poll_interval_us: Option<u64>,
    presence_filter: Option<SizeValue>,
    presence_max_pending_changes: Option<usize>,
}

/// A size in the config file: bytes, or a string with a unit (`"64MiB"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn bytes(&self) -> Result<u64, ServeError> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => parse_size(s),
        }
    }
}

#[derive(Debug, Deserialize)]
struct FileConfig {
    #[serde(default)]
    serve: ServeFile,
    #[serde(default)]
    events: Option<crate::events::EventsConfig>,
    #[serde(flatten)]
    runtime: toml::Table,
}

/// Everything the manager runs with, after file, environment and flags.
#[derive(Debug, Clone)]
pub struct Settings {
    pub socket: PathBuf,
    /// Whether the socket path was set (flag, environment or file) rather
    /// than defaulted: a socket systemd passes must then be at that path.
    pub socket_explicit: bool,
    /// `HOST:PORT` (loopback unless `metrics_public`) or `unix:PATH`.
    pub metrics_addr: Option<String>,
    /// Lets `metrics_addr` be a non-loopback address (readable by every
    /// host that reaches it).
    pub metrics_public: bool,
    pub record: Option<PathBuf>,
    /// Tick interval while I/O is in flight.
    pub idle_tick: Duration,
    /// Connections served at once; more get an `Error` frame.
    pub max_connections: usize,
    /// Bytes queued for one client (frames it has not read); past it the
    /// client is disconnected and its sessions close as on a crash.
    pub max_outbox_bytes: usize,
    /// Bytes queued for all clients together. Past it the client with the
    /// most queued is disconnected (`outbox_budget`), as if it crashed.
    pub max_total_outbox_bytes: usize,
    /// Bytes of frames partly received, all connections together (a frame
    /// is held whole until it completes, up to 16 MiB each). A connection
    /// whose frame does not fit is refused (`Error` frame naming the limit)
    /// and closed; frames within the per-connection read-ahead always fit.
    pub max_partial_frame_bytes: usize,
    /// A client with bytes queued that reads none of them for this long is
    /// disconnected the same way.
    pub stall_timeout: Duration,
    /// Sessions one connection may hold open (or have asked for).
    pub max_sessions_per_connection: usize,
    /// Sessions the connections of one uid may hold together, at most
    /// `limits.max_sessions`: no uid takes every session.
    pub max_sessions_per_uid: usize,
    /// Sessions the connections of one process may hold together, at most
    /// `max_sessions_per_uid`: engines of the same user share the manager,
    /// and one process that opens connection after connection does not
    /// lock the others out.
    pub max_sessions_per_process: usize,
    /// Device regions one connection may hold (or have asked for).
    pub max_regions_per_connection: usize,
    /// Frames taken from one connection per loop round, so one client's
    /// burst cannot hold the loop while others wait.
    pub max_frames_per_round: usize,
    /// Open connections to the metrics endpoint; more wait in the backlog.
    pub max_metrics_connections: usize,
    /// A metrics connection that does not finish its request (or sits idle
    /// between requests) for this long is closed.
    pub metrics_timeout: Duration,
    /// Routers' `POST /lookup` requests answered per second, at most (a
    /// token bucket: as many at once); past it `429`.
    pub lookup_per_second: u32,
    /// The largest `POST /lookup` body taken; past it `413`.
    pub lookup_max_body_bytes: usize,
    pub hot_path: bool,
    pub hot_area_bytes: u64,
    /// How long the loop spins (polls without sleeping) after a command:
    /// the next request of an engine step usually follows at once. 0 turns
    /// spinning off (every round then may sleep).
    pub spin_after_work: Duration,
    /// The longest spin after a command that came in a stream (within this
    /// of the previous one, as a scheduler step's lookups do): then the
    /// loop spins twice the last gap (at most this), so the next command of
    /// the stream finds it awake. Not above `spin_after_work` turns it off.
    pub spin_for_streams: Duration,
    /// While spinning with the hot path on, the sockets are polled at most
    /// this often (unless a socket brought a frame within the spin): the
    /// hot path is a look at shared memory, a poll is a system call. The
    /// most a socket frame or a new connection waits behind hot traffic.
    pub socket_poll_interval: Duration,
    /// Bytes of the presence filter (`orbitkv_ipc::presence`) hot-path
    /// clients answer certain misses from without a round trip; 0 turns
    /// it off. Rounded down to a power of two.
    pub presence_filter_bytes: u64,
    /// Page changes kept between two ticks for the filter, at most; past
    /// it they are dropped and the filter is rebuilt from the indexes.
    pub presence_max_pending_changes: usize,
    /// The KV event stream (`[events]`), off unless configured.
    pub events: Option<crate::events::EventsConfig>,
    pub runtime: Config,
}

/// Parses `4GiB`, `512MiB`, `100MB`, `1G`, or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, ServeError> {
    let bad = |why: &str| ServeError::Setting(format!("size {s:?} {why}"));
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad("has no number"))?;
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
        _ => return Err(bad("has an unknown unit")),
    };
    n.checked_mul(mult).ok_or_else(|| bad("overflows"))
}

pub use orbitkv_ipc::{default_socket, fallback_socket_dir};

impl Settings {
    pub fn from_args(args: &Args) -> Result<Settings, ServeError> {
        let file: FileConfig = match &args.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| ServeError::Io {
                    what: p.display().to_string(),
                    source: e,
                })?;
                toml::from_str(&text)
                    .map_err(|e| ServeError::Setting(format!("{}: {}", p.display(), e.message())))?
            }
            None => FileConfig {
                serve: ServeFile::default(),
                events: None,
                runtime: toml::Table::new(),
            },
        };
        let mut runtime: Config =
            toml::Value::Table(file.runtime)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    ServeError::Setting(format!("runtime configuration: {}", e.message()))
                })?;
        let serve = file.serve;
        let events = match (&args.events_addr, file.events) {
            (Some(addr), Some(mut e)) => {
                e.publish = addr.clone();
                Some(e)
            }
            (Some(addr), None) => Some(crate::events::EventsConfig::at(addr.clone())),
            (None, e) => e,
        };
        if let Some(e) = &events {
            e.validate()?;
        }
        if let Some(d) = args.dram.as_ref().or(serve.dram.as_ref()) {
            runtime.dram.capacity_bytes = parse_size(d)?;
        }
        if let Some(spec) = args.ssd.as_ref().or(serve.ssd.as_ref()) {
            let (dir, size) = spec
                .rsplit_once(':')
                .ok_or_else(|| ServeError::Setting(format!("--ssd {spec:?} is not DIR:SIZE")))?;
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
            remote
                .validate()
                .map_err(|e| ServeError::Setting(e.to_string()))?;
        }
        // The pool and device regions are shared with clients.
        runtime.dram.shared = true;
        runtime.copy.shared_regions = true;
        runtime.incarnation = incarnation();
        runtime
            .validate()
            .map_err(|e| ServeError::Setting(e.to_string()))?;
        let positive = |name: &str, v: usize| {
            if v == 0 {
                Err(ServeError::Setting(format!("[serve] {name} must be > 0")))
            } else {
                Ok(v)
            }
        };
        let size = |name: &str, v: &Option<SizeValue>, default: usize| match v {
            Some(s) => usize::try_from(s.bytes()?)
                .map_err(|_| ServeError::Setting(format!("[serve] {name} overflows"))),
            None => Ok(default),
        };
        let max_outbox_bytes = size("max_outbox_bytes", &serve.max_outbox_bytes, 64 << 20)?;
        let max_total_outbox_bytes = size(
            "max_total_outbox_bytes",
            &serve.max_total_outbox_bytes,
            1 << 30,
        )?;
        let max_partial_frame_bytes = size(
            "max_partial_frame_bytes",
            &serve.max_partial_frame_bytes,
            256 << 20,
        )?;
        let max_sessions = runtime.limits.max_sessions;
        let max_sessions_per_uid = positive(
            "max_sessions_per_uid",
            serve
                .max_sessions_per_uid
                .unwrap_or(max_sessions - max_sessions / 4),
        )?;
        if max_sessions_per_uid > max_sessions {
            return Err(ServeError::Setting(format!(
                "[serve] max_sessions_per_uid = {max_sessions_per_uid} is above \
                 limits.max_sessions = {max_sessions}"
            )));
        }
        let max_sessions_per_process = positive(
            "max_sessions_per_process",
            serve
                .max_sessions_per_process
                .unwrap_or(DEFAULT_SESSIONS_PER_PROCESS.min(max_sessions_per_uid)),
        )?;
        if max_sessions_per_process > max_sessions_per_uid {
            return Err(ServeError::Setting(format!(
                "[serve] max_sessions_per_process = {max_sessions_per_process} is above \
                 max_sessions_per_uid = {max_sessions_per_uid}"
            )));
        }
        let socket = args.socket.clone().or(serve.socket);
        Ok(Settings {
            socket_explicit: socket.is_some(),
            socket: socket.unwrap_or_else(default_socket),
            metrics_addr: args.metrics_addr.clone().or(serve.metrics_addr),
            metrics_public: serve.metrics_public.unwrap_or(false),
            record: args.record.clone().or(serve.record),
            idle_tick: Duration::from_micros(
                args.idle_tick_us
                    .or(serve.idle_tick_us)
                    .unwrap_or(200)
                    .max(10),
            ),
            max_connections: positive("max_connections", serve.max_connections.unwrap_or(256))?,
            max_outbox_bytes: positive("max_outbox_bytes", max_outbox_bytes)?,
            max_total_outbox_bytes: positive("max_total_outbox_bytes", max_total_outbox_bytes)?,
            max_partial_frame_bytes: positive("max_partial_frame_bytes", max_partial_frame_bytes)?,
            max_sessions_per_uid,
            max_sessions_per_process,
            stall_timeout: Duration::from_millis(serve.stall_timeout_ms.unwrap_or(30_000).max(1)),
            max_sessions_per_connection: positive(
                "max_sessions_per_connection",
                serve.max_sessions_per_connection.unwrap_or(64),
            )?,
            max_regions_per_connection: positive(
                "max_regions_per_connection",
                serve.max_regions_per_connection.unwrap_or(256),
            )?,
            max_frames_per_round: positive(
                "max_frames_per_round",
                serve.max_frames_per_round.unwrap_or(512),
            )?,
            max_metrics_connections: positive(
                "max_metrics_connections",
                serve.max_metrics_connections.unwrap_or(512),
            )?,
            metrics_timeout: Duration::from_millis(
                serve.metrics_timeout_ms.unwrap_or(10_000).max(1),
            ),
            lookup_per_second: positive(
                "lookup_per_second",
                serve.lookup_per_second.unwrap_or(1_000) as usize,
            )? as u32,
            lookup_max_body_bytes: positive(
                "lookup_max_body_bytes",
                size(
                    "lookup_max_body_bytes",
                    &serve.lookup_max_body_bytes,
                    3 << 20,
                )?,
            )?,
            hot_path: serve.hot_path.unwrap_or(true)
                && std::env::var("ORBITKV_HOT_PATH").map_or(true, |v| v != "0"),
            hot_area_bytes: match &serve.hot_area {
                Some(s) => parse_size(s)?,
                None => orbitkv_ipc::hot::DEFAULT_AREA_BYTES,
            },
            spin_after_work: Duration::from_micros(at_most(
                "spin_after_work_us",
                serve
                    .spin_after_work_us
                    .unwrap_or(DEFAULT_SPIN_AFTER_WORK_US),
                0,
                MAX_SPIN_AFTER_WORK_US,
            )?),
            spin_for_streams: Duration::from_micros(at_most(
                "spin_for_streams_us",
                serve
                    .spin_for_streams_us
                    .unwrap_or(DEFAULT_SPIN_FOR_STREAMS_US),
                0,
                MAX_SPIN_AFTER_WORK_US,
            )?),
            socket_poll_interval: Duration::from_micros(at_most(
                "socket_poll_interval_us",
                serve
                    .socket_poll_interval_us
                    .unwrap_or(DEFAULT_SOCKET_POLL_INTERVAL_US),
                1,
                MAX_SOCKET_POLL_INTERVAL_US,
            )?),
            presence_filter_bytes: at_most(
                "presence_filter",
                size(
                    "presence_filter",
                    &serve.presence_filter,
                    DEFAULT_PRESENCE_FILTER_BYTES as usize,
                )? as u64,
                0,
                MAX_PRESENCE_FILTER_BYTES,
            )?,
            presence_max_pending_changes: positive(
                "presence_max_pending_changes",
                serve
                    .presence_max_pending_changes
                    .unwrap_or(DEFAULT_PRESENCE_MAX_PENDING_CHANGES),
            )?,
            events,
            runtime,
        })
    }
}

/// Four connections' worth at the default per-connection quota: an engine
/// process holds a handful of sessions.
pub const DEFAULT_SESSIONS_PER_PROCESS: usize = 256;
pub const DEFAULT_SPIN_AFTER_WORK_US: u64 = 100;
/// Covers the gaps between the lookups of one scheduler step (the engine's
/// own work per request, 100-300 us on the benches' machine) but not the
/// gap between model steps: an engine that is not streaming commands is
/// not spun for.
pub const DEFAULT_SPIN_FOR_STREAMS_US: u64 = 1_000;
/// Spinning longer burns a core for little: an engine's next request
/// comes within microseconds or after a model step (milliseconds).
pub const MAX_SPIN_AFTER_WORK_US: u64 = 10_000;
pub const DEFAULT_SOCKET_POLL_INTERVAL_US: u64 = 20;
/// 4 MiB: 32 Mi bits, so a manager holding a million pages answers about
/// 97% of certain misses from the filter (a clear bit), counting removed
/// pages' bits until the next rebuild.
pub const DEFAULT_PRESENCE_FILTER_BYTES: u64 = 4 << 20;
pub const MAX_PRESENCE_FILTER_BYTES: u64 = 1 << 30;
pub const DEFAULT_PRESENCE_MAX_PENDING_CHANGES: usize = 1 << 16;
/// A longer interval would keep socket clients and new connections
/// waiting behind hot traffic for a noticeable time.
pub const MAX_SOCKET_POLL_INTERVAL_US: u64 = 10_000;

fn at_most(name: &str, v: u64, min: u64, max: u64) -> Result<u64, ServeError> {
    if (min..=max).contains(&v) {
        Ok(v)
    } else {
        Err(ServeError::Setting(format!(
            "[serve] {name} = {v} is outside {min}..={max}"
        )))
    }
}

/// A fresh id per manager start, so handles from a previous manager are
/// stale (`StaleSession`).
fn incarnation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 40)) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_refuse_nonsense() {
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("100MB").unwrap(), 100_000_000);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    fn from_file(text: &str) -> Result<Settings, ServeError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("orbitkv.toml");
        std::fs::write(&path, text).unwrap();
        Settings::from_args(&Args {
            config: Some(path),
            ..Args::default()
        })
    }

    #[test]
    fn the_events_address_comes_from_the_flag_or_the_file_and_is_checked() {
        let s = Settings::from_args(&Args {
            events_addr: Some("ipc:///tmp/x/events".into()),
            ..Args::default()
        })
        .unwrap();
        let e = s.events.unwrap();
        assert_eq!(
            (e.publish.as_str(), e.buffer_batches),
            ("ipc:///tmp/x/events", 10_000)
        );
        let s = from_file("[events]\npublish = \"tcp://127.0.0.1:5557\"\nhwm = 10\n").unwrap();
        assert_eq!(s.events.unwrap().hwm, 10);
        assert!(from_file("[serve]\n").unwrap().events.is_none());
        let e = Settings::from_args(&Args {
            events_addr: Some("tcp://0.0.0.0:5557".into()),
            ..Args::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("public"), "{e}");
    }

    #[test]
    fn the_spin_bounds_are_read_and_out_of_range_values_refused() {
        let s = from_file("[serve]\n").unwrap();
        assert_eq!(s.spin_after_work, Duration::from_micros(100));
        assert_eq!(s.socket_poll_interval, Duration::from_micros(20));
        assert_eq!(s.spin_for_streams, Duration::from_micros(1_000));
        let s =
            from_file("[serve]\nspin_after_work_us = 0\nsocket_poll_interval_us = 500\n").unwrap();
        assert_eq!(s.spin_after_work, Duration::ZERO);
        assert_eq!(s.socket_poll_interval, Duration::from_micros(500));
        for bad in [
            "spin_after_work_us = 10001",
            "spin_for_streams_us = 10001",
            "socket_poll_interval_us = 0",
            "socket_poll_interval_us = 10001",
        ] {
            let e = from_file(&format!("[serve]\n{bad}\n")).unwrap_err();
            let name = bad.split(' ').next().unwrap();
            assert!(e.to_string().contains(name), "{e}");
        }
    }
}
