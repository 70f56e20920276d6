//! `orbitkv serve` as a library: the manager process that every engine on
//! a host connects to. One thread owns the runtime and every connection;
//! nothing a client sends or fails to read can stall it, crash it, or touch
//! another connection's state.
//!
//! The shape follows rust-analyzer's server split:
//! - [`settings`]: flags, environment and config file → [`Settings`].
//! - [`listener`]: where the socket may be created; stale entries.
//! - [`connection`]: one client: framing, bounded outbox, quotas.
//! - [`dispatch`]: one frame at a time (the protocol's state machine).
//! - [`state`]: the loop's state and the operations on it (submit, tick
//!   and deliver events, flush, disconnect).
//! - [`main_loop`]: when things happen (`ppoll`, rounds, ticks).
//! - [`metrics`], [`http`]: Prometheus metrics and their endpoint.
//! - [`inspect`]: the `orbitkv inspect` snapshot.
//!
//! The hot path's server is [`orbitkv_ipc::hot_server`]; this crate drives
//! it from the loop.

pub mod connection;
pub mod dispatch;
pub mod http;
pub mod inspect;
pub mod listener;
pub mod main_loop;
pub mod metrics;
pub mod remote_metrics;
pub mod settings;
pub mod state;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use orbitkv_ipc::hot_server::HotServer;
use orbitkv_world::Runtime;
use tracing::{info, warn};

pub use settings::{Args, Settings};

/// Makes the manager non-dumpable before it creates any shared memory.
///
/// Without it any process of the manager's uid could open
/// `/proc/<manager>/fd/N` read-write (the `/proc` check is the ptrace
/// check) and rewrite a staging area or a device region between a copy and
/// the manager's copy-in, without ever connecting. Non-dumpable, the
/// manager's `/proc` entries belong to root and only a process with
/// `CAP_SYS_PTRACE` gets in. Refusing to start is better than serving
/// without it.
pub fn not_dumpable() -> Result<(), ServeError> {
    use rustix::process::{DumpableBehavior, set_dumpable_behavior};
    set_dumpable_behavior(DumpableBehavior::NotDumpable).map_err(|e| ServeError::Io {
        what: "prctl(PR_SET_DUMPABLE, 0)".into(),
        source: e.into(),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Setting(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("socket {path}: {reason}")]
    Socket { path: PathBuf, reason: String },
    #[error("metrics address {addr}: {reason}")]
    Metrics { addr: String, reason: String },
    #[error("starting the runtime: {0}")]
    Runtime(#[from] orbitkv_world::RuntimeError),
}

/// Runs the manager until `stop` is set (SIGTERM), then drains and
/// removes its socket and iceoryx2 files.
pub fn serve(settings: Settings, stop: &AtomicBool) -> Result<(), ServeError> {
    not_dumpable()?;
    // Everything this process creates is its user's alone (iceoryx2 files,
    // the trace); the socket's mode is set explicitly too.
    // SAFETY: umask only swaps the process's mask.
    unsafe { libc::umask(0o077) };
    let mut rt = Runtime::new(settings.runtime.clone())?;
    if let Some(path) = &settings.record {
        let f = std::fs::File::create(path).map_err(|e| ServeError::Io {
            what: path.display().to_string(),
            source: e,
        })?;
        rt.record(
            Box::new(std::io::BufWriter::new(f)),
            settings.idle_tick.as_micros() as u64,
        )
        .map_err(|e| ServeError::Io {
            what: path.display().to_string(),
            source: e,
        })?;
    }
    let listener = listener::bind(&settings.socket)?;
    let hot = if settings.hot_path {
        match HotServer::new(
            settings.runtime.incarnation,
            settings.max_connections,
            settings.hot_area_bytes,
        ) {
            Ok(h) => {
                let open = orbitkv_ipc::hot::restrict_files_with_prefix(h.prefix());
                if open.is_empty() {
                    info!(service = h.service(), "hot path on iceoryx2");
                    Some(h)
                } else {
                    warn!(files = ?open, "no hot path: its files could not be made owner-only");
                    h.shutdown();
                    None
                }
            }
            Err(e) => {
                warn!(error = %e, "no hot path: clients use the socket");
                None
            }
        }
    } else {
        None
    };
    let metrics = metrics::Metrics::new(rt.remote_stats_handle());
    if let Some(addr) = &settings.metrics_addr {
        http::serve(
            addr,
            settings.metrics_public,
            metrics.registry.clone(),
            settings.max_metrics_connections,
            settings.metrics_timeout,
        )?;
    }
    info!(
        socket = %settings.socket.display(),
        dram_bytes = settings.runtime.dram.capacity_bytes,
        ssd = ?settings.runtime.ssd.as_ref().map(|s| s.dir.display().to_string()),
        // Seed URLs only: they carry no credentials (`RemoteConfig::validate`
        // refuses one that does), and the password is never in the config.
        remote = ?settings.runtime.remote.as_ref().map(|r| &r.urls),
        incarnation = settings.runtime.incarnation,
        first_touch_s_per_gib = ?rt.first_touch().map(|f| f.seconds_per_gib),
        "orbitkv serving"
    );
    let mut st = state::State {
        rt,
        settings,
        listener: Some(listener),
        conns: Default::default(),
        next_conn: 0,
        // SAFETY: getuid has no preconditions.
        uid: unsafe { libc::getuid() },
        metrics,
        hot,
        last_tick: Instant::now(),
        started: Instant::now(),
        now: Instant::now(),
    };
    main_loop::run(&mut st, stop);
    main_loop::shutdown(&mut st);
    Ok(())
}
