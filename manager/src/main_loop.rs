//! The event loop: one thread, rounds of wait → accept → read → take →
//! tick → send.
//!
//! A round waits in `ppoll` over the listener, every connection (`POLLIN`
//! while it may read ahead, `POLLOUT` while its outbox holds bytes) and the
//! hot path's wake listener; takes at most `max_frames_per_round` frames
//! per connection (and only while the runtime's inbox has room: a burst
//! waits in its socket, not in memory) and the hot requests; ticks when
//! commands came (or I/O is in flight, or 100 ms passed); then sends what
//! every connection has queued. Nothing in a round waits on a client.
//!
//! For `spin_after_work_us` after a command the loop spins instead of
//! sleeping, since the next request of an engine step usually follows at
//! once. While it spins, the hot path is looked at every round (a load from
//! shared memory) but the sockets only every `socket_poll_interval_us` (a
//! `ppoll` is a system call), unless a socket brought a frame within the
//! spin, when they are polled every round as well. The clock is read once
//! per round, after the wait, and once more after a tick.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use orbitkv_ipc::hot_server::Incoming;
use orbitkv_world::runtime::Answer;
use tracing::info;

use crate::connection::ConnId;
use crate::dispatch;
use crate::state::{Close, State, origin};

/// The longest sleep with nothing in flight: deadlines, stall checks and
/// metrics move at this pace when the host is idle.
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How often the metrics snapshot is refreshed (after a tick changed it).
const METRICS_EVERY: Duration = Duration::from_millis(100);
/// With no client connected and nothing in flight there is nothing to
/// expire soon: the loop ticks (and refreshes the metrics) this rarely, so
/// an idle manager costs next to nothing.
const UNUSED_TICK: Duration = Duration::from_secs(1);
/// While it spins with nothing to do, the loop yields its CPU this often
/// (as a spinning client does, `orbitkv_ipc::client::SPIN_YIELD`): a client
/// that shares the CPU then runs instead of waiting out a time slice (on
/// some VMs a woken client lands on the manager's CPU whatever the other
/// CPUs do; docs/serve.md, "Yielding while spinning").
const SPIN_YIELD: Duration = orbitkv_ipc::client::SPIN_YIELD;

pub fn run(st: &mut State, stop: &AtomicBool) {
    st.now = Instant::now();
    // Spinning until then (a command came in the spin window).
    let mut busy_until = st.now;
    // A socket brought a frame: poll the sockets every round until then.
    let mut sockets_busy_until = st.now;
    let mut next_socket_poll = st.now;
    let mut refreshed = st.now;
    let mut refreshed_tick = st.last_tick;
    let mut poller = Poller::default();
    let mut spin = Spin::new(st.settings.spin_after_work, st.settings.spin_for_streams);
    let mut yield_at = st.now;
    let mut incoming = Vec::new();
    st.refresh_metrics();
    while !stop.load(Ordering::Relaxed) {
        // `st.now` is the previous round's last reading.
        let now = st.now;
        // Transfers in flight, or operations the next tick moves on.
        let io_pending = st.rt.in_flight() > 0 || st.rt.progressing();
        let every = if st.conns.is_empty() && !io_pending {
            UNUSED_TICK
        } else {
            IDLE_WAIT
        };
        let since_tick = now.saturating_duration_since(st.last_tick);
        let spinning = now < busy_until;
        let timeout = if spinning || backlog(st) || st.rt.inbox_len() > 0 || st.lookups_waiting {
            Duration::ZERO
        } else if io_pending {
            st.settings.idle_tick
        } else {
            every.saturating_sub(since_tick)
        };
        let poll_sockets =
            !spinning || st.hot.is_none() || now < sockets_busy_until || now >= next_socket_poll;
        let readable = if poll_sockets {
            let accept = poller.wait(st, timeout);
            if accept {
                st.accept();
            }
            &poller.readable[..]
        } else {
            &[]
        };
        let woken = poll_sockets && poller.woken;
        if woken {
            // Woken by a client: its requests follow (a `warm` sends none).
            busy_until = busy_until.max(Instant::now() + st.settings.spin_after_work);
        }
        st.metrics.counters.loop_rounds.inc();
        // The round's one reading (a wait may have slept).
        st.now = Instant::now();
        let now = st.now;
        if poll_sockets {
            next_socket_poll = now + st.settings.socket_poll_interval;
        }
        read_sockets(st, readable);
        answer_lookups(st);
        let from_sockets = take_frames(st);
        let hot = read_hot(st, &mut incoming);
        let submitted = from_sockets + hot.submitted;
        let since_tick = now.saturating_duration_since(st.last_tick);
        // The inbox also holds what departed connections left (close_origin).
        if submitted > 0
            || st.rt.inbox_len() > 0
            || (io_pending && since_tick >= st.settings.idle_tick)
            || since_tick >= every
        {
            // Moves `st.now` to the reading after the tick.
            st.tick();
        }
        if woken && submitted + hot.answered == 0 {
            st.metrics.counters.hot_warmed.inc();
        }
        if submitted + hot.answered > 0 {
            busy_until = st.now + spin.after_work(now);
            // The next round with nothing to do yields at once: a client
            // sharing this CPU takes its answer now.
            yield_at = st.now;
        } else if spinning && st.now >= yield_at {
            yield_at = st.now + SPIN_YIELD;
            // SAFETY: no arguments.
            unsafe { libc::sched_yield() };
        }
        if from_sockets > 0 {
            sockets_busy_until = busy_until;
        }
        st.flush();
        let since_refresh = st.now.saturating_duration_since(refreshed);
        if since_refresh >= METRICS_EVERY
            && (st.last_tick != refreshed_tick || since_refresh >= UNUSED_TICK)
        {
            refreshed = st.now;
            refreshed_tick = st.last_tick;
            st.refresh_metrics();
        }
    }
}

/// How long the loop spins after a round that took commands: `base` after a
/// lone one; while commands come in a stream (each within `stream` of the
/// one before, as a scheduler step's lookups do, one per waiting request),
/// twice the last gap, at most `stream`, so the next command of the stream
/// finds the loop awake instead of paying its wake-up. (The gap a command
/// that paid a wake-up measures includes that wake-up: doubling it, and
/// taking gaps up to `stream` itself, lets one late command not drop the
/// stream.) A gap longer than `stream` (a model step) falls back to
/// `base`: an engine that is not streaming is not spun for.
struct Spin {
    base: Duration,
    stream: Duration,
    last: Option<Instant>,
}

impl Spin {
    fn new(base: Duration, stream: Duration) -> Spin {
        Spin {
            base,
            stream,
            last: None,
        }
    }

    /// The spin after work taken at `now` (the round's reading).
    fn after_work(&mut self, now: Instant) -> Duration {
        let gap = self.last.map(|t| now.saturating_duration_since(t));
        self.last = Some(now);
        match gap {
            Some(g) if g <= self.stream => g.saturating_mul(2).min(self.stream).max(self.base),
            _ => self.base,
        }
    }
}

/// Reads the ready connections; a connection whose partly received frame
/// does not fit what `max_partial_frame_bytes` leaves (after the others'
/// partial frames) is refused and closed before the rest is read.
fn read_sockets(st: &mut State, readable: &[ConnId]) {
    let mut partial: usize = st.conns.values().map(|c| c.partial_claim()).sum();
    let bound = st.settings.max_partial_frame_bytes;
    for id in readable {
        let Some(c) = st.conns.get_mut(id) else {
            continue;
        };
        let own = c.partial_claim();
        let room = bound.saturating_sub(partial - own);
        match c.read(room) {
            Ok(()) => partial = partial - own + c.partial_claim(),
            Err(frame_bytes) => {
                partial -= own;
                let why = format!(
                    "a {frame_bytes}-byte frame does not fit the {room} bytes left of \
                     max_partial_frame_bytes ({bound}); limit max_partial_frame_bytes"
                );
                st.refuse_with(*id, &why, Close::InputBudget);
            }
        }
    }
}

/// Answers routers' lookups from the HTTP endpoint (a round's worth at
/// most; metadata only, so between ticks is as good as anywhere).
fn answer_lookups(st: &mut State) {
    let Some(desk) = &st.lookups else {
        return;
    };
    let mut asked = Vec::new();
    st.lookups_waiting = desk.take(&mut asked);
    for a in asked {
        let reply = crate::dispatch::lookup(st, &a.request);
        // The endpoint gave up on it (timeout): nothing to do.
        let _ = a.reply.send(reply);
    }
}

/// Whether a connection holds a whole frame the loop has not taken yet.
fn backlog(st: &State) -> bool {
    st.conns
        .values()
        .any(|c| c.input.buffered() > 0 && c.input.missing() == 0)
}

/// The `ppoll` set, kept between rounds so a round allocates nothing.
#[derive(Default)]
struct Poller {
    fds: Vec<libc::pollfd>,
    ids: Vec<ConnId>,
    /// The connections the last wait found ready.
    readable: Vec<ConnId>,
    /// A client signalled the hot path's wake eventfd during the last wait
    /// (a request, or `Client::warm`: requests follow).
    woken: bool,
}

impl Poller {
    /// Blocks until a socket is ready or `timeout` passes; returns whether
    /// the listener is readable, and leaves the ready connections in
    /// `readable`.
    fn wait(&mut self, st: &mut State, timeout: Duration) -> bool {
        use std::os::fd::AsRawFd as _;
        let pollfd = |fd, events| libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        self.fds.clear();
        self.ids.clear();
        self.readable.clear();
        let listening = st.listener.is_some();
        if let Some(l) = &st.listener {
            self.fds.push(pollfd(l.as_raw_fd(), libc::POLLIN));
        }
        if let Some(d) = &st.lookups {
            self.fds.push(pollfd(d.fd(), libc::POLLIN));
        }
        let base = self.fds.len();
        for (id, c) in &st.conns {
            let mut events = 0;
            if c.wants_read() {
                events |= libc::POLLIN;
            }
            if !c.outbox.is_empty() {
                events |= libc::POLLOUT;
            }
            self.fds.push(pollfd(c.stream.as_raw_fd(), events));
            self.ids.push(*id);
        }
        let mut timeout = timeout;
        let mut sleeping = false;
        if let Some(h) = &st.hot {
            self.fds.push(pollfd(h.wake_fd(), libc::POLLIN));
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
                self.fds.as_mut_ptr(),
                self.fds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        // A client signalled the wake eventfd: during the wait, or after it
        // ended and before the drain (which would otherwise swallow a
        // `warm`'s only signal).
        self.woken = sleeping && st.hot.as_ref().is_some_and(|h| h.woke());
        // On an error (EINTR) look at everything once.
        let fds = &self.fds;
        let ready = |i: usize| n < 0 || fds.get(i).is_some_and(|p| p.revents != 0);
        let accept = listening && ready(0);
        for (i, id) in self.ids.iter().enumerate() {
            if ready(base + i) {
                self.readable.push(*id);
            }
        }
        accept
    }
}

/// Takes buffered frames, bounded per connection and by the inbox's room;
/// closes connections whose peer is gone once their frames are handled.
fn take_frames(st: &mut State) -> usize {
    let ids: Vec<ConnId> = st
        .conns
        .iter()
        .filter(|(_, c)| c.eof || (c.input.buffered() > 0 && c.input.missing() == 0))
        .map(|(id, _)| *id)
        .collect();
    let mut submitted = 0;
    for id in ids {
        let mut taken = 0;
        while let Some(c) = st.conns.get_mut(&id) {
            if taken >= st.settings.max_frames_per_round || st.rt.inbox_room() == 0 {
                break;
            }
            match c.input.next_frame() {
                Ok(None) => {
                    if c.eof {
                        st.disconnect(id, Close::PeerClosed);
                    }
                    break;
                }
                Ok(Some((kind, payload))) => {
                    taken += 1;
                    match dispatch::frame(st, id, kind, &payload) {
                        Ok(n) => submitted += n,
                        Err(e) => {
                            st.refuse(id, &e.to_string());
                            break;
                        }
                    }
                }
                Err(e) => {
                    st.refuse(id, &e.to_string());
                    break;
                }
            }
        }
        if let Some(c) = st.conns.get_mut(&id) {
            c.input.shrink(1 << 20);
        }
    }
    submitted
}

/// What [`read_hot`] took.
struct HotTaken {
    /// Commands queued for the tick.
    submitted: usize,
    /// Lookups answered at once (`Runtime::answer_now`): no tick needed.
    answered: usize,
}

/// Takes hot requests (non-blocking, bounded by the inbox's room) and
/// submits their commands; a lookup with nothing queued ahead of it is
/// answered at once, its reply sent before the next request is looked at.
/// Bad requests were answered by the hot server. `incoming`: a buffer kept
/// between rounds, empty between calls.
fn read_hot(st: &mut State, incoming: &mut Vec<Incoming>) -> HotTaken {
    let mut taken = HotTaken {
        submitted: 0,
        answered: 0,
    };
    let room = st.rt.inbox_room().min(1024);
    let Some(h) = st.hot.as_mut() else {
        return taken;
    };
    if room == 0 {
        return taken;
    }
    h.receive(room, incoming);
    for inc in incoming.drain(..) {
        let command = match st.rt.answer_now(origin(inc.conn), inc.command, st.now) {
            Answer::Now(cid, events) => {
                if let Some(h) = st.hot.as_mut() {
                    h.submitted(inc.key, Ok(cid));
                }
                st.deliver_all(events);
                if let Some(h) = st.hot.as_mut() {
                    h.settle(inc.key);
                }
                st.metrics.counters.answered_between_ticks.inc();
                taken.answered += 1;
                continue;
            }
            Answer::Queue(command) => command,
        };
        let result = st.submit(inc.conn, command);
        taken.submitted += usize::from(result.is_ok());
        if let Some(h) = st.hot.as_mut() {
            h.submitted(inc.key, result);
        }
    }
    taken
}

/// Graceful stop: no new connections or commands; submitted I/O drains.
pub fn shutdown(st: &mut State) {
    info!("shutting down: draining submitted I/O");
    st.listener = None;
    if let Some(p) = st.presence.as_mut() {
        p.close();
    }
    let ids: Vec<ConnId> = st.conns.keys().copied().collect();
    for id in ids {
        st.disconnect(id, Close::Shutdown);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        st.now = Instant::now();
        st.tick();
        if st.rt.is_idle() {
            break;
        }
        std::thread::sleep(st.settings.idle_tick);
    }
    if let Err(e) = st.rt.stop_recording() {
        tracing::warn!(error = %e, "the trace recording is incomplete");
    }
    if let Some(h) = st.hot.take() {
        // Every client is disconnected: the incarnation's iceoryx2 files
        // can all go.
        h.shutdown();
    }
    if st.owns_socket {
        let _ = std::fs::remove_file(&st.settings.socket);
    }
    if let Some(path) = st
        .settings
        .metrics_addr
        .as_deref()
        .and_then(|a| a.strip_prefix("unix:"))
    {
        let _ = std::fs::remove_file(path);
    }
    info!("stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_spin_stretches_over_a_stream_and_falls_back_after_a_pause() {
        let mut s = Spin::new(100 * US, 1_000 * US);
        let t0 = Instant::now();
        assert_eq!(s.after_work(t0), 100 * US, "a first command: the base");
        // A stream of commands 150 us apart: spin across the next gap.
        assert_eq!(s.after_work(t0 + 150 * US), 300 * US);
        assert_eq!(s.after_work(t0 + 300 * US), 300 * US);
        // Close together: never below the base.
        assert_eq!(s.after_work(t0 + 310 * US), 100 * US);
        // A gap from half the stream bound up to the bound: the bound.
        assert_eq!(s.after_work(t0 + 810 * US), 1_000 * US);
        assert_eq!(s.after_work(t0 + 1_810 * US), 1_000 * US);
        // A model step's pause (beyond the bound): the base again.
        assert_eq!(s.after_work(t0 + 2_811 * US), 100 * US);
        assert_eq!(s.after_work(t0 + 20_000 * US), 100 * US);
        assert_eq!(s.after_work(t0 + 20_200 * US), 400 * US);
    }

    #[test]
    fn a_stream_bound_at_or_below_the_base_keeps_the_base() {
        for stream in [Duration::ZERO, 100 * US] {
            let mut s = Spin::new(100 * US, stream);
            let t0 = Instant::now();
            for i in 0..5 {
                assert_eq!(s.after_work(t0 + i * 30 * US), 100 * US);
            }
        }
        let mut off = Spin::new(Duration::ZERO, Duration::ZERO);
        let t0 = Instant::now();
        assert_eq!(off.after_work(t0), Duration::ZERO);
        assert_eq!(off.after_work(t0 + 10 * US), Duration::ZERO);
    }
}
