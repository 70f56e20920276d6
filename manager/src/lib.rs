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
pub mod events;
pub mod http;
pub mod inspect;
pub mod listener;
pub mod lookups;
pub mod main_loop;
pub mod metrics;
pub mod presence;
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
    #[error("socket activation: {0}")]
    Activation(String),
    #[error("metrics address {addr}: {reason}")]
    Metrics { addr: String, reason: String },
    #[error("starting the runtime: {0}")]
    Runtime(#[from] orbitkv_world::RuntimeError),
}

/// Runs the manager until `stop` is set (SIGTERM), then drains and
/// removes its socket (unless systemd passed it) and iceoryx2 files.
///
/// Socket-activated (systemd passed a listening socket: `LISTEN_FDS`), it
/// serves on that socket; `--socket`, when given, must name the same path.
/// Under systemd (`NOTIFY_SOCKET`) it reports `READY=1` once it accepts
/// connections and `STOPPING=1` when it begins to drain.
pub fn serve(mut settings: Settings, stop: &AtomicBool) -> Result<(), ServeError> {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    // First: it edits the environment, which no other thread may read yet.
    let activated = listener::from_systemd(uid)?;
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
    let (listener, owns_socket) = match activated {
        Some((l, path)) => {
            if settings.socket_explicit && path != settings.socket {
                return Err(ServeError::Activation(format!(
                    "--socket (ORBITKV_SOCKET, [serve] socket) names {} but systemd passed the \
                     socket {}: leave the setting out or make them equal",
                    settings.socket.display(),
                    path.display()
                )));
            }
            settings.socket = path;
            (l, false)
        }
        None => (listener::bind(&settings.socket)?, true),
    };
    let hot = if settings.hot_path {
        match HotServer::new(settings.runtime.incarnation, settings.hot_area_bytes) {
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
    let events = match &settings.events {
        Some(cfg) => Some(events::EventStream::start(
            cfg,
            &mut rt,
            metrics.events.clone(),
        )?),
        None => None,
    };
    // After the event stream: the page journals keep the larger bound.
    let presence = presence::Presence::start(
        settings.presence_filter_bytes,
        settings.presence_max_pending_changes.max(
            settings
                .events
                .as_ref()
                .map_or(0, |e| e.max_pending_changes),
        ),
        settings.runtime.incarnation.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15,
        &mut rt,
        &metrics.counters,
    )
    .map_err(|e| ServeError::Io {
        what: "the presence filter".into(),
        source: e,
    })?;
    let mut lookups = None;
    if let Some(addr) = &settings.metrics_addr {
        let (desk, door) = lookups::open(
            settings.lookup_per_second,
            settings.lookup_max_body_bytes,
            metrics.counters.lookups.clone(),
        )
        .map_err(|e| ServeError::Metrics {
            addr: addr.clone(),
            reason: e.to_string(),
        })?;
        http::serve(
            addr,
            settings.metrics_public,
            metrics.registry.clone(),
            door,
            settings.max_metrics_connections,
            settings.metrics_timeout,
        )?;
        lookups = Some(desk);
    }
    info!(
        socket = %settings.socket.display(),
        dram_bytes = settings.runtime.dram.capacity_bytes,
        ssd = ?settings.runtime.ssd.as_ref().map(|s| s.dir.display().to_string()),
        // Seed URLs only: they carry no credentials (`RemoteConfig::validate`
        // refuses one that does), and the password is never in the config.
        remote = ?settings.runtime.remote.as_ref().map(|r| &r.urls),
        incarnation = settings.runtime.incarnation,
        socket_activated = !owns_socket,
        first_touch_s_per_gib = ?rt.first_touch().map(|f| f.seconds_per_gib),
        "orbitkv serving"
    );
    let mut st = state::State {
        rt,
        settings,
        listener: Some(listener),
        owns_socket,
        conns: Default::default(),
        next_conn: 0,
        uid,
        metrics,
        hot,
        events,
        presence,
        changes: Default::default(),
        lookups,
        lookups_waiting: false,
        last_tick: Instant::now(),
        started: Instant::now(),
        now: Instant::now(),
    };
    notify(sd_notify::NotifyState::Ready);
    main_loop::run(&mut st, stop);
    notify(sd_notify::NotifyState::Stopping);
    main_loop::shutdown(&mut st);
    Ok(())
}

/// Tells systemd (when `NOTIFY_SOCKET` is set: `Type=notify`) how the
/// manager is doing. A failure is logged: systemd then reports the unit's
/// start as timed out, and this line says why.
fn notify(state: sd_notify::NotifyState) {
    // The variable stays: STOPPING=1 is sent through it later.
    if let Err(e) = sd_notify::notify(false, &[state]) {
        warn!(error = %e, "sd_notify failed (NOTIFY_SOCKET)");
    }
}
