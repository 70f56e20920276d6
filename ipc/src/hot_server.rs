//! The manager's end of the hot path: the iceoryx2 node and wake eventfd of
//! one incarnation, each hot connection's request subscriber, wake eventfd
//! and descriptor area (whose mailbox carries the responses), the open
//! requests, and which open request each event answers.
//!
//! The manager's loop (`src/serve.rs`) drives it: [`HotServer::receive`]
//! validates requests into commands (bad ones get a typed error reply
//! here), the loop submits them and reports back with
//! [`HotServer::submitted`]; after each tick [`HotServer::deliver`] takes
//! every event an open request answers, and [`HotServer::end_tick`] closes
//! the requests whose replies are complete. Events that cannot go on the
//! hot path (no open request, the area is full) stay with the socket.
//!
//! A request stays open while more events answer it: a query's request
//! carries its operation's events (`loading`, `ready`, `transfer_overdue`)
//! until the operation ends (`miss`, `restore_done`, `released`); a
//! publish's until `publish_done`; prepare, restore, release and cancel get
//! `accepted` (or `rejected`) after the tick that ran them, their effects
//! arriving on the query's request.

use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::{Ordering, fence};

use iceoryx2::prelude::{NodeBuilder, SignalHandlingMode};
use orbitkv_components::api::{Command, CommandError, CommandId, Event};

use crate::HotPathInfo;
use crate::hot::{
    self, Area, HotError, HotErrorCode, HotRequest, Ipc, Op, RESP_LAST, RespKind, RingWriter,
    WakeFd,
};

/// The server's maps: keyed by counters, tokens and ids; only looked up
/// with a client's bytes (its token), never filled from them.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// `receive` asks every connection's service once in this many calls,
/// whatever the client's request count says; in between only services
/// whose client counted a request not yet received.
const FULL_LOOK_EVERY: u64 = 64;

/// The shortest time between two sweeps for dead clients' nodes.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

type RequestPorts =
    iceoryx2::service::port_factory::publish_subscribe::PortFactory<Ipc, HotRequest, ()>;

/// The socket connection a hot request belongs to (the manager's id).
pub type ConnId = u64;

/// A hot request the manager validated, for the loop to submit.
#[derive(Debug)]
pub struct Incoming {
    pub key: u64,
    pub conn: ConnId,
    pub command: Command,
}

/// A hot connection: its descriptor area and its own request service
/// (publish-subscribe: the client publishes, the manager subscribes; the
/// responses go to the area's mailbox). One service per connection, not
/// one for all: a port's bookkeeping at each send and receive grows with
/// the channels of the service.
struct Conn {
    conn: ConnId,
    area: Area,
    writer: RingWriter,
    /// Responses put in the area's mailbox (see [`Area::post`]).
    posted: u64,
    /// Requests taken from the service (the manager's own count, against
    /// the client's `Area::requests_sent`).
    received: u64,
    /// The client's `Area::answered_here` as last read.
    answered_seen: u64,
    /// Where request parts are copied out of the request ring to be
    /// parsed (kept between requests; never more than the ring holds).
    scratch: Vec<u8>,
    /// Requests of this connection in `HotServer::active`: at most
    /// `MAX_ACTIVE_REQUESTS` (a client's mailbox holds the responses of
    /// that many).
    open: usize,
    /// Declared before the service, so the port drops first.
    requests: iceoryx2::port::subscriber::Subscriber<Ipc, HotRequest, ()>,
    /// Signalled after a response to a client that said it blocks.
    client_wake: WakeFd,
    _service: RequestPorts,
}

struct Active {
    token: u64,
    tag: u64,
    op: Op,
    command: Option<CommandId>,
    sent: u32,
    /// The operation this (query's) request carries the events of.
    operation: Option<u64>,
    /// Submitted before the tick now running (its key is in
    /// `HotServer::fresh`).
    this_tick: bool,
}

/// Counters for logs and tests.
#[derive(Debug, Default, Clone, Copy)]
pub struct HotStats {
    pub requests: u64,
    pub errors: u64,
    pub responses: u64,
    /// Events that went on the socket although their request was hot.
    pub fallbacks: u64,
    pub wakes: u64,
    /// Crashed clients' iceoryx2 nodes released at their disconnect.
    pub dead_nodes_released: u64,
}

pub struct HotServer {
    active: HashMap<u64, Active>,
    conns: HashMap<u64, Conn>,
    tokens: HashMap<ConnId, u64>,
    by_command: HashMap<CommandId, u64>,
    by_operation: HashMap<u64, u64>,
    /// Keys of the requests received since the last `end_tick`.
    fresh: Vec<u64>,
    next_key: u64,
    area_bytes: u64,
    pub stats: HotStats,
    /// The connections' tokens in the order `receive` visits them; the
    /// first visited moves on by one each call, so no connection is
    /// always last when the bound is reached.
    order: Vec<u64>,
    turn: usize,
    /// Calls of `receive` (see `FULL_LOOK_EVERY`).
    looks: u64,
    /// Clients signal it after a request while the manager sleeps.
    wake: WakeFd,
    _node: iceoryx2::node::Node<Ipc>,
    incarnation: u64,
    config: iceoryx2::config::Config,
    /// A connection went away since the last dead-node sweep.
    sweep_due: bool,
    last_sweep: Option<std::time::Instant>,
    service: String,
    prefix: String,
    /// Lookups answered from the presence filter by connections gone
    /// since the last `take_answered_here`.
    answered_here: u64,
}

/// How far the client's count of lookups it answered itself moved past
/// what was last read (0 if it went back: the client writes it).
fn answered_since(c: &Conn) -> u64 {
    c.area
        .answered_here()
        .load(Ordering::Relaxed)
        .saturating_sub(c.answered_seen)
}

fn err(what: &str) -> impl Fn(&dyn std::fmt::Debug) -> String {
    let what = what.to_owned();
    move |e| format!("{what}: {e:?}")
}

/// What a connection needs for the hot path, sent with its `Welcome`.
pub struct Registered {
    pub info: HotPathInfo,
    /// In this order: the descriptor area, the manager's wake eventfd, the
    /// client's wake eventfd.
    pub fds: [OwnedFd; 3],
}

impl HotServer {
    /// Creates the incarnation's node and wake eventfd, after removing what
    /// crashed incarnations left behind (each connection gets its own
    /// service at `register`).
    pub fn new(incarnation: u64, area_bytes: u64) -> Result<HotServer, String> {
        hot::quiet_iceoryx2_logs();
        let prefix = hot::file_prefix(incarnation);
        hot::cleanup_stale(&prefix);
        // Our own prefix is new; anything under it is from a reused id.
        hot::remove_files_with_prefix(&prefix);
        let config = hot::iox_config(&prefix)?;
        let node = NodeBuilder::new()
            .config(&config)
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<Ipc>()
            .map_err(|e| err("iceoryx2 node")(&e))?;
        let service = hot::service_name(incarnation);
        let wake = WakeFd::new().map_err(|e| format!("the wake eventfd: {e}"))?;
        Ok(HotServer {
            active: HashMap::default(),
            conns: HashMap::default(),
            tokens: HashMap::default(),
            by_command: HashMap::default(),
            by_operation: HashMap::default(),
            fresh: Vec::new(),
            next_key: 0,
            area_bytes,
            stats: HotStats::default(),
            order: Vec::new(),
            turn: 0,
            looks: 0,
            wake,
            _node: node,
            incarnation,
            config,
            sweep_due: false,
            last_sweep: None,
            service,
            prefix,
            answered_here: 0,
        })
    }

    pub fn service(&self) -> &str {
        &self.service
    }

    /// The incarnation's iceoryx2 file prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Readable when a client signalled the manager's wake eventfd (for
    /// `poll(2)`).
    pub fn wake_fd(&self) -> RawFd {
        self.wake.raw()
    }

    /// Sets a connection up for the hot path: its area and token, for its
    /// `Welcome`.
    pub fn register(&mut self, conn: ConnId) -> std::io::Result<Registered> {
        let token = loop {
            let t = random_u64();
            if t != 0 && !self.conns.contains_key(&t) {
                break t;
            }
        };
        let (file, area) = Area::create("orbitkv-hot-area", self.area_bytes)?;
        let service = hot::connection_service_name(self.incarnation, conn);
        let (ports, requests) = self.open_service(&service).map_err(std::io::Error::other)?;
        let client_wake = WakeFd::new()?;
        let fds = [
            OwnedFd::from(file),
            self.wake.try_clone()?.into_fd(),
            client_wake.try_clone()?.into_fd(),
        ];
        let info = HotPathInfo {
            service,
            prefix: self.prefix.clone(),
            token,
            area_bytes: area.len() as u64,
        };
        self.conns.insert(
            token,
            Conn {
                conn,
                writer: RingWriter::new(area.rep),
                posted: 0,
                received: 0,
                answered_seen: 0,
                open: 0,
                scratch: Vec::new(),
                area,
                requests,
                client_wake,
                _service: ports,
            },
        );
        self.tokens.insert(conn, token);
        self.order.push(token);
        Ok(Registered { info, fds })
    }

    /// Creates one connection's request service and the manager's
    /// subscriber. Its buffer holds a client's `MAX_ACTIVE_REQUESTS`, and a
    /// full buffer refuses a request (the client sends it on the socket)
    /// rather than overwrite the oldest: no request is ever lost unseen.
    fn open_service(
        &self,
        name: &str,
    ) -> Result<
        (
            RequestPorts,
            iceoryx2::port::subscriber::Subscriber<Ipc, HotRequest, ()>,
        ),
        String,
    > {
        let ports = self
            ._node
            .service_builder(&name.try_into().map_err(|e| err("name")(&e))?)
            .publish_subscribe::<HotRequest>()
            .max_publishers(1)
            .max_subscribers(1)
            // The manager's node and the client's, and one a restarted
            // client's node may still hold for a moment.
            .max_nodes(3)
            .history_size(0)
            .subscriber_max_buffer_size(hot::MAX_ACTIVE_REQUESTS)
            .subscriber_max_borrowed_samples(1)
            .enable_safe_overflow(false)
            .create()
            .map_err(|e| err("creating a hot service")(&e))?;
        let requests = ports
            .subscriber_builder()
            .buffer_size(hot::MAX_ACTIVE_REQUESTS)
            .create()
            .map_err(|e| err("hot subscriber port")(&e))?;
        Ok((ports, requests))
    }

    /// Forgets a connection: its open requests close unanswered.
    pub fn unregister(&mut self, conn: ConnId) {
        let Some(token) = self.tokens.remove(&conn) else {
            return;
        };
        let keys: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| a.token == token)
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            self.close(k);
        }
        // Its requests are gone: its service can go (its last count of
        // lookups answered from the presence filter is kept).
        if let Some(c) = self.conns.remove(&token) {
            self.answered_here += answered_since(&c);
        }
        self.order.retain(|t| *t != token);
        // A client that crashed left its iceoryx2 node behind, holding its
        // share of the services it used: `receive` releases what dead
        // nodes hold soon, not at the manager's shutdown.
        self.sweep_due = true;
    }

    /// Releases what dead clients' nodes hold, when a connection went away
    /// since the last sweep; at most every `SWEEP_EVERY` (a node list per
    /// sweep, so a storm of disconnects costs a bounded few).
    fn sweep_dead_nodes(&mut self) {
        let now = std::time::Instant::now();
        if !self.sweep_due || self.last_sweep.is_some_and(|t| now < t + SWEEP_EVERY) {
            return;
        }
        self.sweep_due = false;
        self.last_sweep = Some(now);
        self.stats.dead_nodes_released += hot::remove_dead_nodes(&self.config) as u64;
    }

    /// Whether requests wait (a look before the loop blocks).
    pub fn has_requests(&self) -> bool {
        self.conns
            .values()
            .any(|c| c.requests.has_samples().unwrap_or(false))
    }

    /// Before blocking: tells every hot client to notify the wake service
    /// after sending. Returns whether requests already wait (then do not
    /// block).
    pub fn prepare_sleep(&self) -> bool {
        for c in self.conns.values() {
            c.area.manager_sleeping().store(1, Ordering::Relaxed);
        }
        // Pairs with the client's fence between sending and looking at
        // the flag: either it sees the flag, or we see its request.
        fence(Ordering::SeqCst);
        self.has_requests()
    }

    /// After blocking: clients need not notify; drains the wake events.
    /// Whether a client had signalled (during the wait, or since it ended:
    /// a signal is never lost to the drain).
    pub fn woke(&self) -> bool {
        for c in self.conns.values() {
            c.area.manager_sleeping().store(0, Ordering::Relaxed);
        }
        self.wake.drain()
    }

    /// Takes up to `max` requests. Valid ones are appended to `out` as
    /// commands to submit (the caller keeps the buffer between rounds);
    /// bad ones are answered with a typed error here.
    pub fn receive(&mut self, max: usize, out: &mut Vec<Incoming>) {
        self.sweep_dead_nodes();
        let start = out.len();
        let n = self.order.len();
        if n == 0 {
            return;
        }
        self.turn = (self.turn + 1) % n;
        // Every `FULL_LOOK_EVERY`th call looks at every service whatever
        // its client says it sent (a client's count is its own word).
        self.looks = self.looks.wrapping_add(1);
        let full = self.looks.is_multiple_of(FULL_LOOK_EVERY);
        for i in 0..n {
            let Some(&token) = self.order.get((self.turn + i) % n) else {
                break;
            };
            while out.len() - start < max {
                let Some(c) = self.conns.get_mut(&token) else {
                    break;
                };
                // The client counts its requests in the area after each
                // send: a service with nothing new is not asked (an
                // iceoryx2 receive that finds nothing is most of an idle
                // loop round, and followed every request).
                if !full && c.area.requests_sent().load(Ordering::Acquire) == c.received {
                    break;
                }
                let r: HotRequest = match c.requests.receive() {
                    // Copied out: the sample goes back to the client now.
                    Ok(Some(sample)) => *sample.payload(),
                    _ => break,
                };
                c.received = c.received.wrapping_add(1);
                self.stats.requests += 1;
                // A request speaks for the connection whose service it came
                // through, and must carry that connection's token.
                let checked = if c.open >= hot::MAX_ACTIVE_REQUESTS {
                    Err(HotError {
                        code: HotErrorCode::TooManyRequests,
                        detail: c.open as u64,
                    })
                } else if r.magic != hot::HOT_MAGIC {
                    Err(HotError {
                        code: HotErrorCode::BadMagic,
                        detail: r.magic as u64,
                    })
                } else if r.token != token {
                    Err(HotError {
                        code: HotErrorCode::UnknownToken,
                        detail: r.token,
                    })
                } else {
                    hot::decode_request_with(&r, &c.area, &mut c.scratch)
                };
                // `decode_request` accepted the op, so it is known.
                let checked = checked.and_then(|command| {
                    Op::from_u32(r.op).map(|op| (command, op)).ok_or(HotError {
                        code: HotErrorCode::UnknownOp,
                        detail: u64::from(r.op),
                    })
                });
                let conn = c.conn;
                match checked {
                    Ok((command, op)) => {
                        let key = self.next_key;
                        self.next_key += 1;
                        c.open += 1;
                        self.active.insert(
                            key,
                            Active {
                                token,
                                tag: r.tag,
                                op,
                                command: None,
                                sent: 0,
                                operation: None,
                                this_tick: true,
                            },
                        );
                        self.fresh.push(key);
                        out.push(Incoming { key, conn, command });
                    }
                    Err(e) => {
                        self.stats.errors += 1;
                        if let Some(c) = self.conns.get_mut(&token) {
                            c.area.post(&mut c.posted, &hot::error_response(r.tag, e));
                        }
                        self.wake_check(token);
                    }
                }
            }
        }
    }

    /// The loop submitted `key`'s command: its id, or why not (answered
    /// with `Refused` at once).
    pub fn submitted(&mut self, key: u64, result: Result<CommandId, CommandError>) {
        match result {
            Ok(cid) => {
                if let Some(a) = self.active.get_mut(&key) {
                    a.command = Some(cid);
                    self.by_command.insert(cid, key);
                }
            }
            Err(e) => {
                let Some(a) = self.active.get(&key) else {
                    return;
                };
                let (tag, token) = (a.tag, a.token);
                let Some(c) = self.conns.get_mut(&token) else {
                    return;
                };
                let r = hot::encode_refusal(tag, &e, &c.area, &mut c.writer).unwrap_or_else(|| {
                    hot::error_response(
                        tag,
                        HotError {
                            code: HotErrorCode::Unknown,
                            detail: 0,
                        },
                    )
                });
                if c.area.post(&mut c.posted, &r) {
                    self.stats.responses += 1;
                } else {
                    // Never read: its part goes back to the ring.
                    for d in &r.parts {
                        c.area.free(c.area.rep, d);
                    }
                }
                self.wake_check(token);
                self.close(key);
            }
        }
    }

    /// Which open request an event answers.
    fn route(&self, e: &Event) -> Option<u64> {
        use Event::*;
        match e {
            Rejected { command, .. }
            | QueryResult { command, .. }
            | PublishDone { command, .. } => self.by_command.get(command).copied(),
            Loading { operation }
            | Ready { operation, .. }
            | Miss { operation, .. }
            | RestoreDone { operation, .. }
            | Released { operation }
            | TransferOverdue { operation, .. } => self.by_operation.get(operation).copied(),
            _ => None,
        }
    }

    /// Sends `e` (addressed to connection `conn`) on the hot path when an
    /// open request of that connection answers it. `false`:
    /// the caller sends it on the socket (no open request, or no room);
    /// the request is then still acknowledged and closed as it should be.
    /// `terminal`: the runtime's word that `e` ends its command and
    /// operation (`Addressed::terminal`); the request closes with it.
    pub fn deliver(&mut self, conn: ConnId, e: &Event, terminal: bool) -> bool {
        let Some(key) = self.route(e) else {
            return false;
        };
        // Only the addressee's own open request may carry its event.
        let owner = self
            .active
            .get(&key)
            .and_then(|a| self.conns.get(&a.token))
            .map(|c| c.conn);
        if owner != Some(conn) {
            return false;
        }
        // A result that does not end its operation: the operation's later
        // events (ready, miss, released) answer the same request.
        if let Event::QueryResult { operation, .. } = e
            && !terminal
        {
            self.by_operation.insert(*operation, key);
            if let Some(a) = self.active.get_mut(&key) {
                a.operation = Some(*operation);
            }
        }
        let last = terminal;
        let sent = self.send_event(key, e, last);
        if last {
            self.close(key);
        }
        if !sent {
            self.stats.fallbacks += 1;
        }
        sent
    }

    fn send_event(&mut self, key: u64, e: &Event, last: bool) -> bool {
        let Some(a) = self.active.get_mut(&key) else {
            return false;
        };
        let Some(c) = self.conns.get_mut(&a.token) else {
            return false;
        };
        let command = a.command.unwrap_or(0);
        // Keep one response of the buffer for a final `accepted`.
        let room = a.sent + 1 < hot::MAX_RESPONSES_PER_REQUEST;
        let encoded = if room {
            hot::encode_event(e, a.tag, command, &c.area, &mut c.writer)
        } else {
            None
        };
        let token = a.token;
        match encoded {
            Some(mut r) => {
                if last {
                    r.flags |= RESP_LAST;
                }
                if !c.area.post(&mut c.posted, &r) {
                    for d in &r.parts {
                        c.area.free(c.area.rep, d);
                    }
                    return false;
                }
                a.sent += 1;
                self.stats.responses += 1;
                self.wake_check(token);
                true
            }
            None => {
                // The event takes the socket; the client still learns the
                // command's id, and that the request ended.
                if a.sent == 0 || last {
                    let mut r = hot::response(RespKind::Accepted, a.tag, command);
                    if last {
                        r.flags |= RESP_LAST;
                    }
                    if c.area.post(&mut c.posted, &r) {
                        a.sent += 1;
                        self.stats.responses += 1;
                        self.wake_check(token);
                    }
                }
                false
            }
        }
    }

    /// After a tick's events: requests submitted before it whose replies
    /// are complete get `accepted` (if nothing answered them yet) and
    /// close; a publish's stays open for `publish_done`.
    /// Lookups the clients answered from the presence filter since the
    /// last call (their `Area::answered_here`; a client can only misstate
    /// its own).
    pub fn take_answered_here(&mut self) -> u64 {
        let mut n = std::mem::take(&mut self.answered_here);
        for c in self.conns.values_mut() {
            let d = answered_since(c);
            c.answered_seen += d;
            n = n.saturating_add(d);
        }
        n
    }

    pub fn end_tick(&mut self) {
        // The list keeps its allocation from tick to tick.
        let mut fresh = std::mem::take(&mut self.fresh);
        for key in fresh.drain(..) {
            self.finish(key);
        }
        self.fresh = fresh;
    }

    /// After the events of a command the runtime answered between ticks
    /// (`Runtime::answer_now`): its request ends as it would after the
    /// tick, and is no longer one the next tick finishes.
    pub fn settle(&mut self, key: u64) {
        self.finish(key);
        // It is the last one received, or close to it.
        if let Some(at) = self.fresh.iter().rposition(|k| *k == key) {
            self.fresh.swap_remove(at);
        }
    }

    /// `end_tick` for one request.
    fn finish(&mut self, key: u64) {
        // Closed by its last event, or seen already.
        let Some(a) = self.active.get_mut(&key).filter(|a| a.this_tick) else {
            return;
        };
        a.this_tick = false;
        let keep = match a.op {
            Op::Publish => true,
            Op::Query => a.operation.is_some(),
            _ => false,
        };
        if !keep || a.sent == 0 {
            let mut r = hot::response(RespKind::Accepted, a.tag, a.command.unwrap_or(0));
            if !keep {
                r.flags |= RESP_LAST;
            }
            if let Some(c) = self.conns.get_mut(&a.token)
                && c.area.post(&mut c.posted, &r)
            {
                a.sent += 1;
                self.stats.responses += 1;
                let token = a.token;
                self.wake_check(token);
            }
        }
        let Some(a) = self.active.get(&key) else {
            return;
        };
        if !matches!(a.op, Op::Publish)
            && let Some(cid) = a.command
            && self.by_command.get(&cid) == Some(&key)
        {
            self.by_command.remove(&cid);
        }
        if !keep {
            self.close(key);
        }
    }

    fn close(&mut self, key: u64) {
        if let Some(a) = self.active.remove(&key) {
            if let Some(c) = self.conns.get_mut(&a.token) {
                assert!(
                    c.open > 0,
                    "closing a request its connection does not count"
                );
                c.open -= 1;
            }
            if let Some(cid) = a.command
                && self.by_command.get(&cid) == Some(&key)
            {
                self.by_command.remove(&cid);
            }
            if let Some(op) = a.operation
                && self.by_operation.get(&op) == Some(&key)
            {
                self.by_operation.remove(&op);
            }
        }
    }

    /// After a response to a client that said it is about to block: its
    /// wake eventfd is signalled (once per sleep).
    ///
    fn wake_check(&mut self, token: u64) {
        let Some(c) = self.conns.get(&token) else {
            return;
        };
        // Pairs with the client's fence between setting the flag and its
        // last look at its responses.
        fence(Ordering::SeqCst);
        if c.area
            .client_sleeping()
            .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        self.stats.wakes += 1;
        c.client_wake.signal();
    }

    /// Open requests (tests, metrics).
    pub fn open_requests(&self) -> usize {
        self.active.len()
    }

    /// Drops every port, then removes the incarnation's files.
    pub fn shutdown(self) -> usize {
        let prefix = self.prefix.clone();
        drop(self);
        hot::remove_files_with_prefix(&prefix)
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: an 8-byte buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, 8, 0) };
    if n == 8 {
        u64::from_le_bytes(b)
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 32)
    }
}
