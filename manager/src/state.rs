//! The manager's state, owned by the event-loop thread: the runtime, the
//! connections, the hot server and the metrics. The loop
//! ([`crate::main_loop`]) decides when things happen; [`crate::dispatch`]
//! handles each frame; this module holds the operations both use.

use std::collections::BTreeMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use orbitkv_components::api::{
    Addressed, Command, CommandError, CommandId, Event, LimitName, Origin,
};
use orbitkv_ipc::frame::{self, Kind};
use orbitkv_ipc::hot_server::HotServer;
use orbitkv_ipc::{Delivered, Descriptor, DescriptorKind, ProtocolError};
use orbitkv_world::Runtime;
use tracing::{info, warn};

use crate::connection::{Conn, ConnId, Flushed};
use crate::metrics::Metrics;
use crate::settings::Settings;

/// The runtime origin of connection `id` (0 is the embedded caller's).
pub fn origin(id: ConnId) -> Origin {
    Origin(id + 1)
}

/// The connection an event is addressed to.
pub fn conn_of(to: Origin) -> Option<ConnId> {
    to.0.checked_sub(1)
}

pub struct State {
    pub rt: Runtime,
    pub settings: Settings,
    pub listener: Option<UnixListener>,
    /// Whether the socket file is the manager's to remove at shutdown (not
    /// when systemd passed it: its `.socket` unit keeps listening).
    pub owns_socket: bool,
    pub conns: BTreeMap<ConnId, Conn>,
    pub next_conn: ConnId,
    pub uid: u32,
    pub metrics: Metrics,
    pub hot: Option<HotServer>,
    /// The KV event stream, when `[events]` is configured.
    pub events: Option<crate::events::EventStream>,
    /// The presence filter, unless `[serve] presence_filter = 0`.
    pub presence: Option<crate::presence::Presence>,
    /// The page journals' changes of the last tick (presence, events).
    pub changes: crate::presence::Changes,
    /// Routers' lookups from the HTTP endpoint, when it runs.
    pub lookups: Option<crate::lookups::Desk>,
    /// A full round of lookups was answered: more may wait, so the loop
    /// does not sleep.
    pub lookups_waiting: bool,
    pub last_tick: Instant,
    pub started: Instant,
    /// The round's clock: read once per loop round (after its wait) and
    /// once more after a tick; commands submitted in the round start their
    /// latency clocks at it, and the tick's events stop theirs at the
    /// reading after it.
    pub now: Instant,
}

/// Why a connection is closed, as a metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    PeerClosed,
    Protocol,
    OutboxFull,
    /// All outboxes together passed `max_total_outbox_bytes`: the largest
    /// goes.
    OutboxBudget,
    /// Its partly received frame did not fit `max_partial_frame_bytes`.
    InputBudget,
    Stalled,
    WriteFailed,
    Shutdown,
}

impl Close {
    pub fn label(self) -> &'static str {
        match self {
            Close::PeerClosed => "peer_closed",
            Close::Protocol => "protocol_error",
            Close::OutboxFull => "outbox_full",
            Close::OutboxBudget => "outbox_budget",
            Close::InputBudget => "input_budget",
            Close::Stalled => "stalled",
            Close::WriteFailed => "write_failed",
            Close::Shutdown => "shutdown",
        }
    }
}

impl State {
    /// Submits a command as connection `conn`'s origin: the runtime refuses
    /// it (`not_owner`) when it names another origin's session, operation,
    /// region or page, and addresses its events to `conn`. A full inbox is
    /// a typed refusal (the loop stops taking frames before that happens).
    pub fn submit(&mut self, conn: ConnId, command: Command) -> Result<CommandId, CommandError> {
        let clock = Metrics::clock_of(&command);
        match self.rt.submit(origin(conn), command) {
            Ok(cid) => {
                if let Some(clock) = clock {
                    self.metrics.submitted(cid, clock, self.now);
                }
                Ok(cid)
            }
            Err(orbitkv_world::SubmitError::InboxFull(limit)) => Err(CommandError::Limit {
                name: LimitName::MaxInbox,
                limit: limit as u64,
            }),
        }
    }

    /// Accepts pending connections (same uid only, up to the limit).
    pub fn accept(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        let mut fresh = Vec::new();
        // Bounded: at most a connection limit's worth per round.
        while fresh.len() < self.settings.max_connections {
            match listener.accept() {
                Ok((stream, _)) => fresh.push(stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // Out of descriptors, most likely: try again next round.
                    warn!(error = %e, "accept failed");
                    break;
                }
            }
        }
        for stream in fresh {
            self.admit(stream);
        }
    }

    fn admit(&mut self, stream: UnixStream) {
        let refuse = |stream: &UnixStream, why: String| {
            let _ = stream.set_nonblocking(true);
            let bytes = frame::encode(Kind::Error, &ProtocolError { error: why });
            // Best effort, never waiting: a fresh socket's buffer takes it.
            let _ = frame::send_some(stream, &bytes, &[]);
        };
        // Same user only: the pool and regions hold this user's state.
        let (pid, uid) = match frame::peer_credentials(&stream) {
            Ok((pid, uid, _)) => (pid, uid),
            Err(e) => {
                warn!(error = %e, "refusing a connection without peer credentials");
                return;
            }
        };
        if uid != self.uid {
            warn!(pid, uid, "refusing a connection from another user");
            refuse(&stream, format!("uid {uid} may not use this manager"));
            return;
        }
        if self.conns.len() >= self.settings.max_connections {
            warn!(pid, "refusing a connection: max_connections reached");
            refuse(&stream, "too many connections (max_connections)".into());
            return;
        }
        if let Err(e) = stream.set_nonblocking(true) {
            warn!(pid, error = %e, "refusing a connection that cannot be non-blocking");
            return;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        info!(conn = id, pid, "client connected");
        self.conns.insert(id, Conn::new(id, stream, pid, uid));
    }

    /// Sends a protocol error and closes the connection.
    pub fn refuse(&mut self, id: ConnId, why: &str) {
        self.metrics.counters.protocol_errors.inc();
        self.refuse_with(id, why, Close::Protocol);
    }

    /// Sends an `Error` frame saying `why` and closes the connection,
    /// counted under `close`.
    pub fn refuse_with(&mut self, id: ConnId, why: &str, close: Close) {
        warn!(
            conn = id,
            error = why,
            reason = close.label(),
            "closing a connection"
        );
        if let Some(c) = self.conns.get_mut(&id) {
            c.seal_events();
            c.outbox.push(frame::encode(
                Kind::Error,
                &ProtocolError {
                    error: why.to_owned(),
                },
            ));
            // Best effort: what the socket takes now goes; nothing waits.
            let _ = c.outbox.flush(&c.stream);
        }
        self.disconnect(id, close);
    }

    /// Forgets a connection. Its sessions close as if the engine crashed:
    /// submitted I/O drains, then every lease and reserved byte returns.
    pub fn disconnect(&mut self, id: ConnId, why: Close) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        if let Some(h) = self.hot.as_mut() {
            h.unregister(id);
        }
        info!(conn = id, client = %conn.name, reason = why.label(), sessions = conn.sessions.len(), "client disconnected");
        self.metrics.disconnected(why.label());
        // Never refused: the runtime closes every session it opened.
        self.rt.close_origin(origin(id));
    }

    /// One runtime tick at the round's clock; every event goes to the
    /// connection it belongs to. Reads the clock once, after the tick, and
    /// moves the round's clock there.
    pub fn tick(&mut self) {
        let t0 = self.now;
        let events = self.rt.tick_wall(t0);
        self.now = Instant::now();
        self.last_tick = self.now;
        // From the round's reading: the tick and the commands taken before it.
        self.metrics.tick_took(self.now - t0);
        // The pages the tick stored set their presence bits before its
        // events go out: an engine told of a page never finds it absent.
        if self.presence.is_some() || self.events.is_some() {
            self.changes.take(&mut self.rt);
        }
        if let Some(p) = self.presence.as_mut() {
            p.apply(&mut self.rt, &self.changes, &self.metrics.counters);
        }
        self.deliver_all(events);
        if let Some(h) = self.hot.as_mut() {
            h.end_tick();
            let n = h.take_answered_here();
            if n > 0 {
                self.metrics.counters.presence_misses.inc_by(n);
            }
        }
        if let Some(ev) = self.events.as_mut() {
            ev.drain(&mut self.rt, &mut self.changes);
        }
        self.changes.clear();
    }

    /// Counts and delivers the runtime's events (a tick's, or those of a
    /// command answered between ticks).
    pub fn deliver_all(&mut self, events: Vec<Addressed>) {
        for a in events {
            self.metrics.event(&a.event, self.now);
            self.deliver(a);
        }
    }

    fn deliver(
        &mut self,
        Addressed {
            to,
            event: e,
            terminal,
        }: Addressed,
    ) {
        // The addressee may have disconnected since: its sessions are
        // closing, and nobody is left to tell.
        let Some(conn) = conn_of(to).and_then(|id| self.conns.get_mut(&id)) else {
            return;
        };
        conn.learn(&e);
        if let Event::RegionRegistered {
            region,
            agent: true,
            ..
        } = &e
        {
            // Engine memory the manager never maps: the client's agent gets
            // the connection's staging area instead (each time: a new one
            // follows a session-less spell), before the event.
            if let (Some(fd), Some(bytes)) =
                (self.rt.export_staging(to), self.rt.staging_capacity(to))
            {
                conn.seal_events();
                let d = Descriptor {
                    kind: DescriptorKind::Staging,
                    handle: *region,
                    bytes,
                };
                conn.outbox
                    .push_with_fds(frame::encode(Kind::Descriptor, &d), vec![fd]);
            }
        } else if let Event::RegionRegistered {
            region,
            engine_region,
            ..
        } = &e
            && let Some(fd) = self.rt.export_device_region(*engine_region)
        {
            let file = std::fs::File::from(fd);
            let bytes = file.metadata().map_or(0, |m| m.len());
            // Events batched so far go first; the descriptor's frame
            // precedes the event that names its region.
            conn.seal_events();
            let d = Descriptor {
                kind: DescriptorKind::Region,
                handle: *region,
                bytes,
            };
            conn.outbox.push_with_fds(
                frame::encode(Kind::Descriptor, &d),
                vec![std::os::fd::OwnedFd::from(file)],
            );
        }
        // Answers to hot requests go back on the hot path.
        if let Some(h) = self.hot.as_mut()
            && h.deliver(conn.id, &e, terminal)
        {
            return;
        }
        conn.events.push(Delivered { event: e, terminal });
    }

    /// Sends what every connection has queued, without waiting; closes the
    /// ones past their outbox bound or stalled past the stall timeout.
    pub fn flush(&mut self) {
        let now = self.now;
        let mut close = Vec::new();
        for (id, c) in self.conns.iter_mut() {
            c.seal_events();
            if c.outbox.is_empty() {
                c.last_progress = now;
                continue;
            }
            match c.outbox.flush(&c.stream) {
                Ok(Flushed::Empty) | Ok(Flushed::Pending { progressed: true }) => {
                    c.last_progress = now;
                }
                Ok(Flushed::Pending { progressed: false }) => {}
                Err(_) => {
                    close.push((*id, Close::WriteFailed));
                    continue;
                }
            }
            if c.outbox.bytes() > self.settings.max_outbox_bytes {
                warn!(
                    conn = id,
                    bytes = c.outbox.bytes(),
                    "client does not read its replies; disconnecting"
                );
                close.push((*id, Close::OutboxFull));
            } else if !c.outbox.is_empty()
                && now.duration_since(c.last_progress) > self.settings.stall_timeout
            {
                warn!(
                    conn = id,
                    "client read nothing within stall_timeout_ms; disconnecting"
                );
                close.push((*id, Close::Stalled));
            }
        }
        self.over_outbox_budget(&mut close);
        for (id, why) in close {
            self.disconnect(id, why);
        }
    }

    /// While the outboxes together hold more than `max_total_outbox_bytes`,
    /// picks the largest of those not already closing: one client that
    /// reads slowly over many connections cannot grow the manager past it.
    fn over_outbox_budget(&self, close: &mut Vec<(ConnId, Close)>) {
        let closing = |id: &ConnId, close: &[(ConnId, Close)]| close.iter().any(|(c, _)| c == id);
        let mut total: usize = self
            .conns
            .iter()
            .filter(|(id, _)| !closing(id, close))
            .map(|(_, c)| c.outbox.bytes())
            .sum();
        while total > self.settings.max_total_outbox_bytes {
            let Some((id, bytes)) = self
                .conns
                .iter()
                .filter(|(id, c)| !closing(id, close) && c.outbox.bytes() > 0)
                .map(|(id, c)| (*id, c.outbox.bytes()))
                .max_by_key(|&(_, b)| b)
            else {
                break;
            };
            warn!(
                conn = id,
                bytes, total, "all outboxes past max_total_outbox_bytes; disconnecting the largest"
            );
            close.push((id, Close::OutboxBudget));
            total -= bytes;
        }
    }

    /// Refreshes the metrics from the runtime's snapshot.
    pub fn refresh_metrics(&mut self) {
        let s = self.rt.stats();
        let outbox: usize = self.conns.values().map(|c| c.outbox.bytes()).sum();
        let hot_open = self.hot.as_ref().map_or(0, |h| h.open_requests());
        self.metrics.refresh(&s, self.conns.len(), outbox, hot_open);
        let lower = self.rt.tier_occupancy();
        self.metrics.occupancy(&s, &lower);
        if let Some(h) = &self.hot {
            self.metrics.hot(h.stats);
        }
    }
}
