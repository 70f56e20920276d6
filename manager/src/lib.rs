//! `orbitkv serve` as a library: the manager process that every engine on
//! a host connects to. One thread owns the runtime and every connection;
//! nothing a client sends or fails to read can stall it, crash it, or touch
//! another connection's state.
//!
//! # Codemap
//!
//! `orbitkv serve` is `Settings::from_args` + `serve(settings, &stop)`. One
//! thread owns the `Runtime` and every connection (rust-analyzer's
//! main_loop / global_state / dispatch split):
//!
//! - `settings.rs`: `Args` (clap), the `[serve]` table, `Settings` (every
//!   bound by name: per connection `max_outbox_bytes`, `stall_timeout`,
//!   `max_sessions_per_connection`, `max_regions_per_connection`,
//!   `max_frames_per_round`; across connections `max_total_outbox_bytes`,
//!   `max_partial_frame_bytes`, `max_sessions_per_process`,
//!   `max_sessions_per_uid`; metrics limits and `metrics_public`; the loop's `spin_after_work`,
//!   `spin_for_streams` and `socket_poll_interval`), `parse_size`; `--remote`
//!   (seed URLs into the runtime's `[remote]` table, validated at start; the
//!   password never passes through here).
//! - `listener.rs`: where the socket may be created (no directory others
//!   can write to unless sticky; never replaces another uid's entry or a
//!   regular file; a dangling symlink is removed, never followed); binds
//!   with umask 0177; `private_dir` makes and checks the per-uid fallback
//!   directory `/tmp/orbitkv-<uid>` (0700, ours, not a symlink).
//!   `from_systemd`: the socket systemd passed (socket activation,
//!   `sd-notify`'s `listen_fds`), checked (one listening Unix stream socket at
//!   a path, this uid's, mode without group/other write) and never removed;
//!   `serve` reports `READY=1`/`STOPPING=1` (sd_notify). Unit files:
//!   `deploy/systemd/`.
//! - `lib.rs`: `serve` takes systemd's socket first, then `not_dumpable`
//!   (`prctl(PR_SET_DUMPABLE, 0)`: no process of the manager's uid may open
//!   `/proc/<manager>/fd/N` or ptrace it).
//! - `connection.rs`: `Conn` (stage `AwaitingHello` → `Ready`, input
//!   `FrameReader` with a read-ahead bound, `partial_claim` (a large frame
//!   partly received, counted against `max_partial_frame_bytes`), `Outbox`
//!   of chunks whose descriptors ride on their first byte, the stall clock,
//!   the peer's pid and uid, quota counts);
//!   `Outbox::flush` never waits.
//! - `dispatch.rs`: one frame → `Hello` (exactly once; the read-only pool
//!   descriptor and the hot area on `Welcome`), `Submit` (quotas per
//!   connection, process and uid, then the runtime), `Ping`, `Inspect`
//!   (payload `null`), `Lookup` (answered from `Runtime::locate`, never a
//!   protocol error); anything else is a typed `Refusal`.
//! - `state.rs`: `State` and what the loop does with it: `submit` (as the
//!   connection's `Origin(id + 1)`), `accept`/`admit` (same uid,
//!   `max_connections`), `tick` (each `Addressed` event to its connection,
//!   no routing table; a region's memfd on a `Descriptor` frame before its
//!   event; for an agent-owned region, the connection's staging area instead,
//!   never a device region export), `flush` (cuts off clients past `max_outbox_bytes` or the stall
//!   timeout, and the largest while all outboxes pass
//!   `max_total_outbox_bytes`), `disconnect` (`close_origin`: sessions close as on a crash).
//! - `main_loop.rs`: `run` (a `ppoll` (`Poller`, buffers kept between
//!   rounds) with `POLLOUT` where an outbox holds bytes; while spinning after
//!   work (`Spin`: `spin_after_work`, stretched to twice the last gap, at most
//!   `spin_for_streams`, while commands come in a stream; a spinning round
//!   with nothing to do `sched_yield`s every `SPIN_YIELD`, and at once after
//!   a round that answered, as the client's spin does, so two sides that
//!   share a CPU hand it over instead of one blocking; a wake through the
//!   hot wake eventfd spins `spin_after_work` even with no request:
//!   `Client::warm`, which vLLM's scheduler side sends at the end of a step
//!   that looked anything up) the hot path is read every round (a
//!   hot lookup with nothing queued ahead is answered there, `Runtime::answer_now`, its reply sent
//!   before the next request is taken, `HotServer::settle`; no tick) and the sockets
//!   polled every `socket_poll_interval`, or every round while a socket is
//!   busy; `State::now` is the round's one clock reading, moved past a tick by
//!   `State::tick`; frames taken per connection per round only while the
//!   inbox has room; 100 ms sleeps when idle) and `shutdown`.
//! - `metrics.rs`: `prometheus-client` counters, gauges, labelled families
//!   (misses, evictions, demotions, disconnects; per tier occupancy and
//!   reads, leased pages by source) and latency histograms
//!   (query, prepare, restore, publish, tick); per-second samples for the
//!   last-minute windows. `http.rs`: `/metrics` on hyper (single-threaded
//!   tokio on a side thread; header-read and connection timeouts, a
//!   connection limit; a loopback TCP address unless `metrics_public`, or
//!   `unix:PATH`, mode 0600, peers of this uid or root), and routers' `POST
//!   /lookup`, handed to the loop through `lookups.rs` (`Door`/`Desk`: a
//!   bounded channel and a socket pair the loop polls; a token bucket, a
//!   body limit, `READING` bodies at once, the hash list bounded while it is
//!   parsed; the loop answers `PER_ROUND` a round through
//!   `dispatch::lookup`). `remote_metrics.rs`: `RemoteCollector`, the
//!   remote tier's counters and latency histograms (`orbitkv_remote_*`,
//!   `docs/remote.md`) encoded from its `RemoteStatsHandle` at each scrape.
//!   `inspect.rs`: the `Snapshot`. `events.rs`: the KV event stream
//!   (`[events]`, `docs/events.md`): after each tick `State::tick` drains the
//!   runtime's page journal and each lower tier's `TierJournal` (medium
//!   `CPU`, `STORAGE`) into per-namespace batches on a bounded channel;
//!   the `orbitkv-events` thread encodes vLLM's `KVEventBatch` (msgpack,
//!   `rmp`), publishes on a ZMQ PUB (`zmq`, libzmq built in) with a topic per
//!   namespace and per-topic sequence numbers from the manager's start time,
//!   and answers replays on a ROUTER. A topic opens with `AllBlocksCleared`,
//!   and any loss (journal or channel full) sends it again; after a journal
//!   loss every medium lists what it holds again.
//!
//! Invariants: nothing in a round waits on a client; no `expect`/`unwrap`/
//! index is reachable from a client's bytes; a connection's misbehaviour
//! (malformed frames, bursts, not reading) affects only that connection.
//!
//! Never knows about: ECS internals (it sees `Runtime`, `Stats`, events).
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
