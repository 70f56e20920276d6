//! The blocking Rust client of `orbitkv serve`.
//!
//! `call` submits a command and waits for its reply event; events for the
//! client's operations (Ready, RestoreDone, ...) queue up and are taken with
//! `poll_events` (non-blocking) or `wait_event`. Waiting spins briefly
//! before blocking in `poll(2)`: a reply usually arrives within the spin,
//! and under contention the thread sleeps instead of burning the core.
//!
//! With the hot path (the default; [`ClientOptions::hot_path`] or
//! `ORBITKV_HOT_PATH=0` turn it off), query, prepare, restore, publish,
//! release and cancel go over iceoryx2 and their events come back the same
//! way ([`crate::hot`]); the API does not change. A command the hot path
//! cannot carry at the moment (its parts do not fit the descriptor area,
//! too many requests open) silently takes the socket. A client that blocks
//! says so in the descriptor area first; the manager then signals its wake
//! eventfd, which it polls beside the socket ([`hot::WakeFd`] says why not
//! the socket).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use iceoryx2::prelude::{BackpressureStrategy, NodeBuilder, SignalHandlingMode};
use orbitkv_components::api::{Command, CommandError, CommandId, Event, LeaseInfo};

use crate::frame::{self, FrameError, Kind};
use crate::hot::{self, Desc, HotError, HotRequest, Ipc, Reply};
use crate::{
    Accepted, Delivered, Descriptor, DescriptorKind, Hello, HotPathInfo, ProtocolError, Snapshot,
    Submit, Welcome,
};

/// How long a waiting client spins before it blocks. Measured (see
/// docs/serve.md, "Hot path"): a hot round trip takes 7-10 us while the
/// manager is spinning, and 20 us is the shortest budget that catches its
/// p99; under 10 us most waits block. On an oversubscribed machine the
/// client stops spinning by itself (see [`Client::set_spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);
/// A gap this long between two clock readings of a spin means the thread
/// was descheduled.
pub const PREEMPTED: Duration = Duration::from_micros(30);
/// How long spinning stays off after a preempted spin.
pub const SPIN_BACKOFF: Duration = Duration::from_millis(20);
/// How long `submit` and `ping` wait for the manager before giving up.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(30);
const READ_CHUNK: usize = 256 << 10;
/// While hot requests are open, how often a spinning wait also reads the
/// socket (a system call, about as long as a whole hot round trip; the
/// socket carries only what the hot path could not).
const SOCKET_LOOK: Duration = Duration::from_micros(8);
/// A spinning wait yields its CPU this often. Alone on its CPU a yield
/// returns at once; sharing it with the manager (which spins too), it lets
/// the manager answer instead of both waiting out a time slice, and the
/// client stays runnable instead of blocking (a blocked client, once woken,
/// tends to land on the manager's CPU: see `hot::WakeFd` and
/// docs/serve.md, "Yielding while spinning").
pub const SPIN_YIELD: Duration = Duration::from_micros(8);

/// A moving share of samples that were bad (1/8 per sample), for the spin
/// guard: one bad sample is an interrupt, a quarter of recent ones is an
/// oversubscribed machine.
#[derive(Debug, Default, Clone, Copy)]
struct Share(f32);

impl Share {
    /// Takes one sample; `true` (and the share starts over) once over a
    /// quarter of recent samples were bad.
    fn sample(&mut self, bad: bool) -> bool {
        let x = if bad { 1.0 } else { 0.0 };
        self.0 += (x - self.0) / 8.0;
        if self.0 > 0.25 {
            self.0 = 0.0;
            return true;
        }
        false
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect: {0}")]
    Connect(io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the manager refused: {0}")]
    Protocol(String),
    #[error("command refused: {0}")]
    Command(#[from] CommandError),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("mapping shared memory: {0}")]
    Map(io::Error),
    #[error(transparent)]
    Hot(#[from] HotError),
    #[error("the manager shared no pool (no descriptor in its Welcome)")]
    NoPool,
    #[error("lease {lease}: bytes {offset}+{bytes} lie outside the {pool_bytes}-byte pool")]
    LeaseOutsidePool {
        lease: u64,
        offset: u64,
        bytes: u64,
        pool_bytes: u64,
    },
    #[error("lease {lease}: the pool bytes at {offset} do not match the page's checksum")]
    PageChecksum { lease: u64, offset: u64 },
    #[error(
        "the socket is served by uid {uid}, which is neither this process's nor trusted \
         ({trusted:?}; ORBITKV_TRUSTED_UIDS)"
    )]
    Untrusted { uid: u32, trusted: Vec<u32> },
}

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Use the hot path when the manager offers it. Default: true, unless
    /// `ORBITKV_HOT_PATH=0`.
    pub hot_path: bool,
    /// How long waits spin before blocking.
    pub spin: Duration,
    /// Manager uids trusted besides this process's own. Default:
    /// `ORBITKV_TRUSTED_UIDS` (comma-separated), else none.
    pub trusted_uids: Vec<u32>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            hot_path: std::env::var("ORBITKV_HOT_PATH").map_or(true, |v| v != "0"),
            spin: DEFAULT_SPIN,
            trusted_uids: std::env::var("ORBITKV_TRUSTED_UIDS")
                .map(|v| v.split(',').filter_map(|u| u.trim().parse().ok()).collect())
                .unwrap_or_default(),
        }
    }
}

impl ClientOptions {
    /// Whether a manager running as `uid` may serve this client: this
    /// process's own uid, root, or one listed. Root because a socket that
    /// systemd creates (socket activation) reports PID 1's credentials, and
    /// root can read and write this process's memory anyway.
    pub fn trusts(&self, uid: u32) -> bool {
        // SAFETY: getuid has no preconditions.
        uid == unsafe { libc::getuid() } || uid == 0 || self.trusted_uids.contains(&uid)
    }
}

/// A command sent without waiting (see [`Client::send_command`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    tag: u64,
    hot: bool,
}

type HotPort = iceoryx2::port::publisher::Publisher<Ipc, HotRequest, ()>;

/// One open hot request: its tag and the request-ring records it wrote
/// (freed once the manager answered: it copied them by then).
struct Pending {
    tag: u64,
    parts: [Desc; 3],
    answered: bool,
}

/// The client's end of the hot path: requests go out on the connection's
/// iceoryx2 service, responses come back in the area's mailbox. Fields
/// drop in order: the port before its service, the node last.
struct HotPath {
    /// At most `cap`: the manager refuses more than `MAX_ACTIVE_REQUESTS`,
    /// and the mailbox holds the responses of that many.
    pending: Vec<Pending>,
    /// `MAX_ACTIVE_REQUESTS`, but for tests of the manager's own bound.
    cap: usize,
    /// Where response parts are copied out of the reply ring to be parsed.
    scratch: Vec<u8>,
    port: HotPort,
    /// Signalled after a request while the manager sleeps.
    manager_wake: hot::WakeFd,
    /// The manager signals it after a response while this client sleeps.
    wake: hot::WakeFd,
    area: hot::Area,
    writer: hot::RingWriter,
    /// Responses taken from the area's mailbox (see `hot::Area::take`).
    taken: u64,
    /// Requests sent (see `hot::Area::requests_sent`).
    sent: u64,
    /// Subtracted from `sent` in the area (tests: a client whose count
    /// is off); 0 otherwise.
    undercount: u64,
    token: u64,
    /// First response per tag: the command's id, or why it was not queued.
    first: HashMap<u64, Result<CommandId, ClientError>, foldhash::fast::RandomState>,
    _service: iceoryx2::service::port_factory::publish_subscribe::PortFactory<Ipc, HotRequest, ()>,
    _node: iceoryx2::node::Node<Ipc>,
    service: String,
}

impl HotPath {
    fn open(
        info: &HotPathInfo,
        area: &std::fs::File,
        manager_wake: hot::WakeFd,
        wake: hot::WakeFd,
    ) -> Result<HotPath, String> {
        hot::quiet_iceoryx2_logs();
        let config = hot::iox_config(&info.prefix)?;
        let e = |what: &str| {
            let what = what.to_owned();
            move |e: &dyn std::fmt::Debug| format!("{what}: {e:?}")
        };
        let node = NodeBuilder::new()
            .config(&config)
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<Ipc>()
            .map_err(|x| e("iceoryx2 node")(&x))?;
        let name = info
            .service
            .as_str()
            .try_into()
            .map_err(|x| e("service name")(&x))?;
        let service = node
            .service_builder(&name)
            .publish_subscribe::<HotRequest>()
            .open()
            .map_err(|x| e("opening the hot service")(&x))?;
        let port = service
            .publisher_builder()
            .max_loaned_samples(1)
            // Never block the engine on the manager: a request its buffer
            // has no room for is not delivered, and goes on the socket.
            .backpressure_strategy(BackpressureStrategy::DiscardData)
            .create()
            .map_err(|x| e("hot publisher port")(&x))?;
        let area = hot::Area::open(area)?;
        Ok(HotPath {
            pending: Vec::new(),
            cap: hot::MAX_ACTIVE_REQUESTS,
            scratch: Vec::new(),
            port,
            manager_wake,
            wake,
            writer: hot::RingWriter::new(area.req),
            taken: 0,
            sent: 0,
            undercount: 0,
            area,
            token: info.token,
            first: HashMap::default(),
            _service: service,
            _node: node,
            service: info.service.clone(),
        })
    }

    /// Sends a request; `None` when it was not delivered (too many open,
    /// or the manager's buffer is full or gone).
    fn send(&mut self, req: HotRequest) -> Option<()> {
        if self.pending.len() >= self.cap {
            return None;
        }
        match self.port.send_copy(req) {
            Ok(delivered) if delivered > 0 => {
                self.pending.push(Pending {
                    tag: req.tag,
                    parts: req.parts,
                    answered: false,
                });
                // Tells the manager there is a request to take.
                self.sent = self.sent.wrapping_add(1);
                self.area
                    .requests_sent()
                    .store(self.sent.wrapping_sub(self.undercount), Ordering::Release);
                // Pairs with the manager's fence between setting
                // `manager_sleeping` and its last look for requests.
                fence(Ordering::SeqCst);
                if self.area.manager_sleeping().load(Ordering::Relaxed) != 0 {
                    self.manager_wake.signal();
                }
                Some(())
            }
            _ => None,
        }
    }

    /// Takes the mailbox's new responses: each to its open request, whose
    /// first response records the command's id (or why it was not
    /// queued); a request ends with its last response.
    ///
    /// Every request the manager took ends with a last response (the
    /// manager holds it open until it posted one); one whose mailbox was
    /// full, which an honest client never fills, waits out its deadline.
    fn take(&mut self, events: &mut VecDeque<Delivered>) -> Result<usize, ClientError> {
        let (area, pending, first, scratch) = (
            &self.area,
            &mut self.pending,
            &mut self.first,
            &mut self.scratch,
        );
        area.take(&mut self.taken, |r| {
            let reply = hot::decode_response_with(&r, area, scratch);
            // A response for no open request (one a client cannot have
            // asked for): its parts are freed by the decode, and it is
            // dropped.
            let Some(i) = pending.iter().position(|p| p.tag == r.tag) else {
                return;
            };
            let p = &mut pending[i];
            if !p.answered {
                p.answered = true;
                for d in &p.parts {
                    area.free(area.req, d);
                }
                let result = match &reply {
                    Ok(Reply::Accepted | Reply::Event(_)) => Ok(r.command),
                    Ok(Reply::Refused(e)) => Err(ClientError::Command(e.clone())),
                    Ok(Reply::Error(e)) | Err(e) => Err(ClientError::Hot(*e)),
                };
                first.insert(p.tag, result);
            }
            let last = r.flags & hot::RESP_LAST != 0;
            if let Ok(Reply::Event(event)) = reply {
                // The request's last response is its terminal event: the
                // server closes a request with the runtime's flag.
                events.push_back(Delivered {
                    event,
                    terminal: last,
                });
            }
            if last {
                pending.swap_remove(i);
            }
        })
        .map_err(|e| ClientError::Protocol(format!("hot path mailbox: {e}")))
    }
}

/// A copy agent riding on a client (the bridge's, over its executor): it
/// takes the events the client's user never sees (`AgentCopy`) and sends
/// its reports (`CopyDone`), inside every wait of the client, so a copy the
/// manager sends while the user waits for its outcome runs meanwhile.
pub trait Agent: Send {
    /// The pool (read-only) and the connection's staging area arrived.
    fn window(
        &mut self,
        pool: &std::fs::File,
        pool_len: u64,
        staging: std::fs::File,
        staging_len: u64,
    ) -> Result<(), String>;
    /// Takes `event` if it is the agent's.
    fn take(&mut self, event: &Event) -> bool;
    /// Appends the reports to send now.
    fn reports(&mut self, out: &mut Vec<Command>);
    /// Copies are running: waits look again soon rather than block.
    fn busy(&self) -> bool;
    /// The connection is gone: wait for running copies (they write engine
    /// memory the engine may reuse once the failure is reported).
    fn lost(&mut self);
}

/// How long a wait blocks at most while the agent has copies running
/// (their completions do not wake the socket).
const AGENT_POLL: Duration = Duration::from_micros(100);

pub struct Client {
    stream: UnixStream,
    buf: frame::FrameReader,
    /// Descriptors received and not yet claimed by the frame they came
    /// with, in arrival order.
    fds: VecDeque<OwnedFd>,
    /// Scratch for `recv_some`.
    fresh_fds: Vec<OwnedFd>,
    welcome: Welcome,
    pool: Option<memmap2::Mmap>,
    /// The pool's (read-only) descriptor, for the agent's window.
    pool_file: Option<std::fs::File>,
    /// The staging area's descriptor, until an agent takes it.
    staging: Option<(std::fs::File, u64)>,
    agent: Option<Box<dyn Agent>>,
    /// Tags of the agent's reports: their acceptances are not waited for.
    report_tags: std::collections::HashSet<u64>,
    /// Reports the manager refused (a copy it had already failed).
    pub reports_refused: u64,
    regions: HashMap<u64, memmap2::MmapMut>,
    next_tag: u64,
    accepted: HashMap<u64, Result<u64, CommandError>>,
    events: VecDeque<Delivered>,
    spin: Duration,
    /// Spinning is off until then: spins kept getting preempted, or
    /// acknowledgements kept outlasting them (see `pump`).
    no_spin_until: Instant,
    /// Acknowledgements that outlasted a spin.
    blocked_share: Share,
    /// Spins that were preempted.
    preempted_share: Share,
    /// What the last `pump` did: spun (waited in the spin at least once),
    /// and was preempted while spinning.
    spun: bool,
    preempted: bool,
    /// The last `pump` gave up spinning and blocked.
    blocked: bool,
    adaptive: bool,
    pongs: u64,
    snapshot: Option<Snapshot>,
    /// Lookup replies not taken yet, in the order they came (the manager
    /// answers a connection's lookups in the order it sent them).
    lookup_replies: std::collections::VecDeque<orbitkv_components::admin::LookupReply>,
    /// Lookups sent whose replies have not been taken.
    lookups_unanswered: usize,
    hot: Option<HotPath>,
    hot_error: Option<String>,
    /// The manager's presence filter, mapped read-only (with the hot path).
    presence: Option<crate::presence::PresenceView>,
    /// Commands sent, by kind (`Command::kind`).
    sent: HashMap<&'static str, u64>,
}

// The Python bridge moves clients between threads.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Client>();
};

impl Client {
    /// Connects and shakes hands; maps the shared pool when the manager
    /// has one.
    pub fn connect(path: impl AsRef<Path>, name: &str) -> Result<Client, ClientError> {
        Client::connect_with(path, name, ClientOptions::default())
    }

    /// [`Client::connect`] with options (e.g. the socket path only).
    pub fn connect_with(
        path: impl AsRef<Path>,
        name: &str,
        options: ClientOptions,
    ) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(ClientError::Connect)?;
        // Nothing is sent before the manager proved who it is: an impostor
        // bound at the path could otherwise serve "hits" of its choosing.
        let (_, uid, _) = frame::peer_credentials(&stream).map_err(ClientError::Connect)?;
        if !options.trusts(uid) {
            return Err(ClientError::Untrusted {
                uid,
                trusted: options.trusted_uids.clone(),
            });
        }
        stream.set_nonblocking(true).map_err(ClientError::Connect)?;
        let mut c = Client {
            stream,
            buf: frame::FrameReader::default(),
            fds: VecDeque::new(),
            fresh_fds: Vec::new(),
            welcome: Welcome {
                protocol: 0,
                incarnation: 0,
                pool_bytes: 0,
                max_frame_bytes: 0,
                hot: None,
                presence: None,
            },
            pool: None,
            pool_file: None,
            staging: None,
            agent: None,
            report_tags: Default::default(),
            reports_refused: 0,
            regions: HashMap::new(),
            next_tag: 0,
            accepted: HashMap::new(),
            events: VecDeque::new(),
            spin: options.spin,
            no_spin_until: Instant::now(),
            blocked_share: Share::default(),
            preempted_share: Share::default(),
            spun: false,
            preempted: false,
            blocked: false,
            adaptive: true,
            pongs: 0,
            snapshot: None,
            lookup_replies: Default::default(),
            lookups_unanswered: 0,
            hot: None,
            hot_error: None,
            presence: None,
            sent: HashMap::new(),
        };
        c.send(&frame::encode(
            Kind::Hello,
            &Hello {
                protocol: frame::PROTOCOL_VERSION,
                client: name.to_owned(),
                hot: options.hot_path,
            },
        ))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c.next_frame(Some(deadline))? {
                Some((Kind::Welcome, payload)) => {
                    c.welcome = frame::decode(Kind::Welcome, &payload)?;
                    // The pool's descriptor first, then the hot path's.
                    let mut fds = std::mem::take(&mut c.fds).into_iter();
                    if c.welcome.pool_bytes > 0 {
                        let fd = fds.next().ok_or_else(|| {
                            ClientError::Protocol("welcome without the pool descriptor".into())
                        })?;
                        let file = std::fs::File::from(fd);
                        // SAFETY: a read-only view of the manager's pool. Bytes
                        // under a lease this client holds do not change.
                        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(ClientError::Map)?;
                        c.pool = Some(map);
                        c.pool_file = Some(file);
                    }
                    if let Some(info) = c.welcome.hot.clone() {
                        // The area, the manager's wake eventfd, ours.
                        match (fds.next(), fds.next(), fds.next()) {
                            (Some(area), Some(manager_wake), Some(wake)) => match HotPath::open(
                                &info,
                                &std::fs::File::from(area),
                                hot::WakeFd::from_fd(manager_wake),
                                hot::WakeFd::from_fd(wake),
                            ) {
                                Ok(h) => c.hot = Some(h),
                                Err(e) => c.hot_error = Some(e),
                            },
                            _ => {
                                c.hot_error =
                                    Some("welcome without the hot path's three descriptors".into())
                            }
                        }
                    }
                    // The presence filter's last; only used with the hot
                    // path (whose area counts what it answers).
                    if c.welcome.presence.is_some()
                        && let Some(fd) = fds.next()
                        && c.hot.is_some()
                    {
                        match crate::presence::PresenceView::open(&std::fs::File::from(fd)) {
                            Ok(v) => c.presence = Some(v),
                            Err(e) => c.hot_error = Some(format!("presence filter not used: {e}")),
                        }
                    }
                    return Ok(c);
                }
                Some((Kind::Error, payload)) => {
                    let e: ProtocolError = frame::decode(Kind::Error, &payload)?;
                    return Err(ClientError::Protocol(e.error));
                }
                Some(_) => continue,
                None => return Err(ClientError::Timeout(Duration::from_secs(10))),
            }
        }
    }

    pub fn incarnation(&self) -> u64 {
        self.welcome.incarnation
    }

    /// The manager's presence filter, when this client has it.
    pub fn presence(&self) -> Option<&crate::presence::PresenceView> {
        self.presence.as_ref()
    }

    /// Counts `n` lookups answered from the presence filter (for the
    /// manager's metrics).
    pub fn note_answered_here(&self, n: u64) {
        if let Some(h) = &self.hot {
            h.area
                .answered_here()
                .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The hot path's iceoryx2 service when this client uses it.
    pub fn hot_service(&self) -> Option<&str> {
        self.hot.as_ref().map(|h| h.service.as_str())
    }

    /// Why the hot path the manager offered could not be set up.
    pub fn hot_path_error(&self) -> Option<&str> {
        self.hot_error.as_deref()
    }

    /// Sets how long waits spin before blocking (0: block at once).
    /// Spinning turns itself off for [`SPIN_BACKOFF`] when over a quarter
    /// of recent spins got preempted (a gap in their clock readings) or
    /// of recent acknowledgements outlasted the spin: on an oversubscribed
    /// machine spinning only delays the manager. (A preempted spin ends
    /// there, and its wait blocks.)
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
        self.no_spin_until = Instant::now();
        self.blocked_share = Share::default();
        self.preempted_share = Share::default();
        self.adaptive = true;
    }

    /// A fixed spin budget, without adapting (measurements).
    pub fn set_spin_fixed(&mut self, spin: Duration) {
        self.set_spin(spin);
        self.adaptive = false;
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        frame::write_all(&self.stream, bytes).map_err(|e| ClientError::Frame(e.into()))
    }

    /// Reads until one frame is available or `deadline` passes.
    fn next_frame(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(Kind, Vec<u8>)>, ClientError> {
        let spin_until = Instant::now() + self.spin;
        loop {
            if let Some(f) = self.buf.next_frame()? {
                return Ok(Some(f));
            }
            match self.recv() {
                Ok(0) => return Err(FrameError::Closed.into()),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(FrameError::Io(e).into()),
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            let wait_ms = deadline.map_or(-1, |d| {
                d.saturating_duration_since(now)
                    .as_millis()
                    .clamp(1, i32::MAX as u128) as i32
            });
            let mut p = libc::pollfd {
                fd: self.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, wait_ms) };
        }
    }

    /// Receives what the socket has, queueing descriptors in arrival order.
    fn recv(&mut self) -> io::Result<usize> {
        let n = self
            .buf
            .fill(&self.stream, READ_CHUNK, &mut self.fresh_fds)?;
        self.fds.extend(self.fresh_fds.drain(..));
        Ok(n)
    }

    /// Waits until something arrives (a frame, handled; or hot responses,
    /// queued), spinning for the spin budget, then blocking on the socket
    /// (a hot-path client first says it sleeps, so the manager wakes it).
    /// `Ok(false)` at the deadline.
    fn pump(&mut self, deadline: Option<Instant>) -> Result<bool, ClientError> {
        let r = self.pump_inner(deadline);
        if self.adaptive && (self.spun || self.preempted) {
            self.adapt_preempted();
        }
        if r.is_err()
            && let Some(agent) = self.agent.as_mut()
        {
            agent.lost();
        }
        r
    }

    /// Sends the agent's reports, without waiting for their acceptance.
    fn send_reports(&mut self) -> Result<(), ClientError> {
        let Some(agent) = self.agent.as_mut() else {
            return Ok(());
        };
        let mut out = Vec::new();
        agent.reports(&mut out);
        for command in out {
            let tag = self.next_tag;
            self.next_tag += 1;
            self.report_tags.insert(tag);
            self.send(&frame::encode(Kind::Submit, &Submit { tag, command }))?;
        }
        Ok(())
    }

    fn pump_inner(&mut self, deadline: Option<Instant>) -> Result<bool, ClientError> {
        let start = Instant::now();
        let spin = if self.adaptive && start < self.no_spin_until {
            Duration::ZERO
        } else {
            self.spin
        };
        let spin_until = start + spin;
        let mut last = start;
        self.blocked = false;
        self.spun = false;
        self.preempted = false;
        // The socket is looked at in the first round, then every
        // `SOCKET_LOOK` while hot requests are open.
        let mut socket_at = start;
        let mut yield_at = start + SPIN_YIELD;
        loop {
            self.send_reports()?;
            if let Some((kind, payload)) = self.buf.next_frame()? {
                self.absorb(kind, payload)?;
                return Ok(true);
            }
            let look = last >= socket_at;
            if let Some(h) = self.hot.as_mut()
                && h.take(&mut self.events)? > 0
            {
                return Ok(true);
            }
            let hot_open = self.hot.as_ref().is_some_and(|h| !h.pending.is_empty());
            if !hot_open || look {
                socket_at = last + SOCKET_LOOK;
                match self.recv() {
                    Ok(0) => return Err(FrameError::Closed.into()),
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(FrameError::Io(e).into()),
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(false);
            }
            if now < spin_until && !self.preempted {
                if self.adaptive && now.duration_since(last) > PREEMPTED {
                    // Descheduled mid-spin: this wait blocks; spinning
                    // stops only if it keeps happening (`adapt_preempted`),
                    // not for one interrupt of a busy VM.
                    self.preempted = true;
                } else {
                    self.spun = true;
                    last = now;
                    if now >= yield_at {
                        yield_at = now + SPIN_YIELD;
                        // SAFETY: no arguments.
                        unsafe { libc::sched_yield() };
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
            }
            if let Some(h) = self.hot.as_mut() {
                h.area.client_sleeping().store(1, Ordering::Relaxed);
                // Pairs with the manager's fence between sending a response
                // and looking at the flag.
                fence(Ordering::SeqCst);
                if h.take(&mut self.events)? > 0 {
                    h.area.client_sleeping().store(0, Ordering::Relaxed);
                    return Ok(true);
                }
            }
            self.blocked = true;
            let mut wait_ms = deadline.map_or(-1, |d| {
                d.saturating_duration_since(now)
                    .as_millis()
                    .clamp(1, i32::MAX as u128) as i32
            });
            // A request the manager has not answered yet: look again every
            // few ms even without a `Wake` (one the manager cannot send: a
            // request it could not tie to this connection).
            if self
                .hot
                .as_ref()
                .is_some_and(|h| h.pending.iter().any(|p| !p.answered))
            {
                wait_ms = if wait_ms < 0 { 10 } else { wait_ms.min(10) };
            }
            // The socket, and the hot path's wake eventfd (the manager
            // signals it after a response, having seen `client_sleeping`).
            let mut p = [
                libc::pollfd {
                    fd: self.stream.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.hot.as_ref().map_or(-1, |h| h.wake.raw()),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            if self.agent.as_ref().is_some_and(|a| a.busy()) {
                // Copies are running: look again soon for their reports.
                let remaining = deadline.map_or(AGENT_POLL, |d| {
                    d.saturating_duration_since(now).min(AGENT_POLL)
                });
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: remaining.as_nanos() as libc::c_long,
                };
                // SAFETY: two valid pollfds (a negative fd is ignored), a
                // valid timespec, no signal mask.
                unsafe { libc::ppoll(p.as_mut_ptr(), 2, &ts, std::ptr::null()) };
            } else {
                // SAFETY: two valid pollfds (a negative fd is ignored).
                unsafe { libc::poll(p.as_mut_ptr(), 2, wait_ms) };
            }
            if let Some(h) = self.hot.as_ref() {
                h.area.client_sleeping().store(0, Ordering::Relaxed);
                if p[1].revents != 0 {
                    h.wake.drain();
                }
            }
            // Woken (or timed out): read the socket in the next round.
            socket_at = last;
        }
    }

    /// Handles one frame: queues events, records acceptances.
    fn absorb(&mut self, kind: Kind, payload: Vec<u8>) -> Result<(), ClientError> {
        match kind {
            Kind::Accepted => {
                let a: Accepted = frame::decode(kind, &payload)?;
                if self.report_tags.remove(&a.tag) {
                    // A report of a copy the manager already failed (lost
                    // or past its deadline): nothing waits for it.
                    self.reports_refused += u64::from(a.result.is_err());
                } else {
                    self.accepted.insert(a.tag, a.result);
                }
            }
            Kind::Events => {
                let events: Vec<Delivered> = frame::decode(kind, &payload)?;
                for d in events {
                    let taken = self.agent.as_mut().is_some_and(|a| a.take(&d.event));
                    if !taken {
                        self.events.push_back(d);
                    }
                }
            }
            Kind::Descriptor => {
                let d: Descriptor = frame::decode(kind, &payload)?;
                // The descriptor rode on this frame's first byte, so it
                // arrived no later than the frame's last byte.
                let fd = self.fds.pop_front().ok_or_else(|| {
                    ClientError::Protocol(format!("descriptor for {:#x} did not arrive", d.handle))
                })?;
                match d.kind {
                    DescriptorKind::Region => {
                        let file = std::fs::File::from(fd);
                        // SAFETY: the engine side of a shared device region:
                        // this client writes the pages it publishes and reads
                        // the ones restored into it, as an engine does GPU
                        // memory.
                        let map = unsafe { memmap2::MmapMut::map_mut(&file) }
                            .map_err(ClientError::Map)?;
                        if (map.len() as u64) < d.bytes {
                            return Err(ClientError::Protocol(format!(
                                "region {:#x} maps {} bytes, not {}",
                                d.handle,
                                map.len(),
                                d.bytes
                            )));
                        }
                        self.regions.insert(d.handle, map);
                    }
                    DescriptorKind::Staging => {
                        self.staging = Some((std::fs::File::from(fd), d.bytes));
                        self.give_window()?;
                    }
                }
            }
            Kind::Snapshot => {
                self.snapshot = Some(frame::decode(kind, &payload)?);
            }
            Kind::LookupReply => {
                // Bounded by the lookups in flight: one reply each.
                self.lookup_replies
                    .push_back(frame::decode(kind, &payload)?);
            }
            Kind::Error => {
                let e: ProtocolError = frame::decode(kind, &payload)?;
                return Err(ClientError::Protocol(e.error));
            }
            Kind::Pong => self.pongs += 1,
            Kind::Ping
            | Kind::Hello
            | Kind::Welcome
            | Kind::Submit
            | Kind::Inspect
            | Kind::Lookup => {}
        }
        Ok(())
    }

    /// Lets `agent` run this connection's copies: it takes every
    /// `AgentCopy` event from now on (the user never sees them) and its
    /// reports go out inside every wait. Replaces an earlier agent.
    pub fn set_agent(&mut self, agent: Box<dyn Agent>) -> Result<(), ClientError> {
        self.agent = Some(agent);
        self.give_window()
    }

    /// Whether this client has an agent.
    pub fn has_agent(&self) -> bool {
        self.agent.is_some()
    }

    /// Hands the agent the pool and the staging area, once both are here.
    fn give_window(&mut self) -> Result<(), ClientError> {
        let (Some(agent), Some(pool)) = (self.agent.as_mut(), self.pool_file.as_ref()) else {
            return Ok(());
        };
        let Some((staging, bytes)) = self.staging.take() else {
            return Ok(());
        };
        agent
            .window(pool, self.welcome.pool_bytes, staging, bytes)
            .map_err(|e| ClientError::Protocol(format!("the copy agent's window: {e}")))
    }

    /// Queues a command; returns its id once the manager accepted it.
    pub fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        *self.sent.entry(command.kind()).or_default() += 1;
        if let Some(tag) = self.send_hot(&command) {
            return self.wait_first(tag);
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        self.send(&frame::encode(Kind::Submit, &Submit { tag, command }))?;
        let deadline = Instant::now() + ACK_TIMEOUT;
        let mut blocked = false;
        loop {
            if let Some(result) = self.accepted.remove(&tag) {
                self.adapt_spin(blocked);
                return Ok(result?);
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(ACK_TIMEOUT));
            }
            blocked |= self.blocked;
        }
    }

    /// Queues several commands in one round trip: every one is sent
    /// before any acknowledgement is awaited (a scheduler step's lookups, a
    /// load's device-page allocations). Each gets its id, or the error the
    /// manager refused to queue it with (a quota, a full inbox); a failure
    /// of the connection fails the whole batch.
    pub fn submit_many(
        &mut self,
        commands: Vec<Command>,
    ) -> Result<Vec<Result<CommandId, CommandError>>, ClientError> {
        let mut sent = Vec::with_capacity(commands.len());
        for command in commands {
            *self.sent.entry(command.kind()).or_default() += 1;
            if let Some(tag) = self.send_hot(&command) {
                sent.push((tag, true));
                continue;
            }
            let tag = self.next_tag;
            self.next_tag += 1;
            self.send(&frame::encode(Kind::Submit, &Submit { tag, command }))?;
            sent.push((tag, false));
        }
        let deadline = Instant::now() + ACK_TIMEOUT;
        let mut out = Vec::with_capacity(sent.len());
        let mut blocked = false;
        for (tag, hot) in sent {
            loop {
                let got = if hot {
                    self.hot.as_mut().and_then(|h| h.first.remove(&tag))
                } else {
                    self.accepted
                        .remove(&tag)
                        .map(|r| r.map_err(ClientError::Command))
                };
                match got {
                    Some(Ok(id)) => {
                        out.push(Ok(id));
                        break;
                    }
                    Some(Err(ClientError::Command(e))) => {
                        out.push(Err(e));
                        break;
                    }
                    Some(Err(e)) => return Err(e),
                    None => {}
                }
                if !self.pump(Some(deadline))? {
                    return Err(ClientError::Timeout(ACK_TIMEOUT));
                }
                blocked |= self.blocked;
            }
        }
        self.adapt_spin(blocked);
        Ok(out)
    }

    /// Sends a command without waiting for the manager to queue it (a
    /// scheduler that must not block on a lookup); [`Client::accepted_id`]
    /// tells its id once the manager answered.
    pub fn send_command(&mut self, command: Command) -> Result<Sent, ClientError> {
        *self.sent.entry(command.kind()).or_default() += 1;
        if let Some(tag) = self.send_hot(&command) {
            return Ok(Sent { tag, hot: true });
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        self.send(&frame::encode(Kind::Submit, &Submit { tag, command }))?;
        Ok(Sent { tag, hot: false })
    }

    /// The id of a command [`Client::send_command`] sent, once the manager
    /// queued it; `None` while it has not answered. Reads what arrived,
    /// never blocks. A command the manager refused to queue is
    /// [`ClientError::Command`].
    pub fn accepted_id(&mut self, sent: Sent) -> Result<Option<CommandId>, ClientError> {
        let take = |c: &mut Client| {
            if sent.hot {
                c.hot.as_mut().and_then(|h| h.first.remove(&sent.tag))
            } else {
                c.accepted
                    .remove(&sent.tag)
                    .map(|r| r.map_err(ClientError::Command))
            }
        };
        if let Some(r) = take(self) {
            return r.map(Some);
        }
        let saved = self.spin;
        self.spin = Duration::ZERO;
        let pumped = (|| {
            while self.pump(Some(Instant::now()))? {}
            Ok::<(), ClientError>(())
        })();
        self.spin = saved;
        pumped?;
        take(self).transpose()
    }

    /// Commands sent so far, by kind (`register_instance`, `lookup`, ...).
    pub fn commands_sent(&self) -> &HashMap<&'static str, u64> {
        &self.sent
    }

    /// How many events are queued, not yet taken.
    pub fn queued(&self) -> usize {
        self.events.len()
    }

    /// Learns from the spin `pump` just ran: when over a quarter of recent
    /// spins were preempted, the cores are oversubscribed, and spinning
    /// stops for [`SPIN_BACKOFF`].
    fn adapt_preempted(&mut self) {
        if self.preempted_share.sample(self.preempted) {
            self.no_spin_until = Instant::now() + SPIN_BACKOFF;
        }
    }

    /// Learns from an acknowledgement (the manager answers every command
    /// in its next tick, so these waits are all alike): when many outlast
    /// the spin, the manager is losing its core to the spinning itself or
    /// to a third process, and spinning stops for [`SPIN_BACKOFF`].
    fn adapt_spin(&mut self, blocked: bool) {
        if !self.adaptive || self.spin.is_zero() || Instant::now() < self.no_spin_until {
            return;
        }
        if self.blocked_share.sample(blocked) {
            self.no_spin_until = Instant::now() + SPIN_BACKOFF;
        }
    }

    /// Wakes a sleeping manager without a request, when the caller will
    /// send some soon (a scheduler about to plan its next step): the
    /// manager then spins its `spin_after_work_us`, and the first request
    /// does not pay its wake-up. Nothing without the hot path or while the
    /// manager is awake (a look at shared memory).
    pub fn warm(&self) {
        if let Some(h) = self.hot.as_ref()
            && h.area.manager_sleeping().load(Ordering::Relaxed) != 0
        {
            h.manager_wake.signal();
        }
    }

    /// Sends a hot command on the hot path; `None` to use the socket.
    fn send_hot(&mut self, command: &Command) -> Option<u64> {
        let h = self.hot.as_mut()?;
        if !hot::is_hot(command) || h.pending.len() >= h.cap {
            return None;
        }
        let tag = self.next_tag;
        let req = hot::encode_request(command, h.token, tag, &h.area, &mut h.writer)?;
        if h.send(req).is_none() {
            for d in &req.parts {
                h.writer.release(&h.area, d);
            }
            return None;
        }
        self.next_tag += 1;
        Some(tag)
    }

    /// Waits for a hot request's first response: its command id.
    fn wait_first(&mut self, tag: u64) -> Result<CommandId, ClientError> {
        let deadline = Instant::now() + ACK_TIMEOUT;
        let mut blocked = false;
        loop {
            if let Some(r) = self.hot.as_mut().and_then(|h| h.first.remove(&tag)) {
                self.adapt_spin(blocked);
                return r;
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(ACK_TIMEOUT));
            }
            blocked |= self.blocked;
        }
    }

    /// The connection's hot-path token (tests that craft raw requests).
    #[doc(hidden)]
    pub fn hot_token(&self) -> Option<u64> {
        self.hot.as_ref().map(|h| h.token)
    }

    /// Makes the request count this client keeps in its area `by` short
    /// of what it sent (tests: the manager must not depend on it).
    #[doc(hidden)]
    pub fn hot_undercount_requests(&mut self, by: u64) {
        if let Some(h) = self.hot.as_mut() {
            h.undercount = by;
        }
    }

    /// Lets this client have `cap` hot requests open instead of
    /// `MAX_ACTIVE_REQUESTS` (tests: the manager must refuse past its
    /// bound on its own).
    #[doc(hidden)]
    pub fn hot_set_request_cap(&mut self, cap: usize) {
        if let Some(h) = self.hot.as_mut() {
            h.cap = cap;
        }
    }

    /// Writes a part to the request ring (tests that craft raw requests).
    #[doc(hidden)]
    pub fn hot_write_part(&mut self, kind: u32, bytes: &[u8]) -> Option<Desc> {
        let h = self.hot.as_mut()?;
        h.writer.write(&h.area, kind, bytes)
    }

    /// Sends a raw hot request (its tag replaced) and waits for its first
    /// response, as `submit` does (tests of the manager's validation).
    #[doc(hidden)]
    pub fn hot_submit_raw(&mut self, mut req: HotRequest) -> Result<CommandId, ClientError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        req.tag = tag;
        self.hot
            .as_mut()
            .ok_or_else(|| ClientError::Protocol("no hot path".into()))?
            .send(req)
            .ok_or_else(|| ClientError::Protocol("hot request not sent".into()))?;
        self.wait_first(tag)
    }

    /// Submits and waits for the command's reply event (a `Rejected` reply is
    /// returned as an event, not an error).
    pub fn call(&mut self, command: Command, timeout: Duration) -> Result<Event, ClientError> {
        let id = self.submit(command)?;
        self.wait_event(timeout, |e| e.command() == Some(id))?
            .ok_or(ClientError::Timeout(timeout))
    }

    /// Takes the first queued or arriving event matching `pred`; other
    /// events stay queued.
    pub fn wait_event(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&Event) -> bool,
    ) -> Result<Option<Event>, ClientError> {
        Ok(self.wait_delivered(timeout, pred)?.map(|d| d.event))
    }

    /// [`wait_event`](Self::wait_event) with the runtime's `terminal` flag.
    pub fn wait_delivered(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&Event) -> bool,
    ) -> Result<Option<Delivered>, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.events.iter().position(|d| pred(&d.event)) {
                return Ok(self.events.remove(i));
            }
            if !self.pump(Some(deadline))? {
                return Ok(None);
            }
        }
    }

    /// Every event that arrived, without blocking.
    pub fn poll_events(&mut self) -> Result<Vec<Event>, ClientError> {
        Ok(self
            .poll_delivered()?
            .into_iter()
            .map(|d| d.event)
            .collect())
    }

    /// [`poll_events`](Self::poll_events) with each event's `terminal` flag.
    pub fn poll_delivered(&mut self) -> Result<Vec<Delivered>, ClientError> {
        let saved = self.spin;
        self.spin = Duration::ZERO;
        let r = (|| {
            while self.pump(Some(Instant::now()))? {}
            Ok(self.events.drain(..).collect())
        })();
        self.spin = saved;
        r
    }

    /// Puts events taken by [`poll_delivered`](Self::poll_delivered) and not
    /// consumed back in front of the queue, in their order (a driver that
    /// borrowed the connection returns what it did not wait for).
    pub fn requeue(&mut self, events: Vec<Delivered>) {
        for e in events.into_iter().rev() {
            self.events.push_front(e);
        }
    }

    /// Round trip of an empty frame through the manager's loop.
    pub fn ping(&mut self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        self.send(&frame::encode(Kind::Ping, &()))?;
        let deadline = start + ACK_TIMEOUT;
        let want = self.pongs + 1;
        loop {
            if self.pongs >= want {
                return Ok(start.elapsed());
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(ACK_TIMEOUT));
            }
        }
    }

    /// The manager's live state (`orbitkv inspect`).
    pub fn inspect(&mut self, timeout: Duration) -> Result<Snapshot, ClientError> {
        self.snapshot = None;
        self.send(&frame::encode(Kind::Inspect, &()))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.snapshot.take() {
                return Ok(s);
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(timeout));
            }
        }
    }

    /// Where a prompt's pages are (`orbitkv lookup`): metadata only, the
    /// manager leases and reads nothing.
    pub fn lookup(
        &mut self,
        request: &orbitkv_components::admin::LookupRequest,
        timeout: Duration,
    ) -> Result<orbitkv_components::admin::LookupReply, ClientError> {
        let mut replies = self.lookup_many(std::slice::from_ref(request), timeout)?;
        replies
            .pop()
            .ok_or_else(|| ClientError::Protocol("a lookup without its reply".into()))
    }

    /// Several lookups: all are sent before any reply is awaited (one
    /// round trip), and the replies come back in the order asked. Replies
    /// of earlier lookups that timed out are dropped first.
    pub fn lookup_many(
        &mut self,
        requests: &[orbitkv_components::admin::LookupRequest],
        timeout: Duration,
    ) -> Result<Vec<orbitkv_components::admin::LookupReply>, ClientError> {
        // A lookup that timed out leaves its reply to come; none may be
        // taken for a later request's.
        let deadline = Instant::now() + timeout;
        while self.lookups_unanswered > 0 {
            if let Some(_late) = self.lookup_replies.pop_front() {
                self.lookups_unanswered -= 1;
                continue;
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(timeout));
            }
        }
        self.lookup_replies.clear();
        for r in requests {
            self.send(&frame::encode(Kind::Lookup, r))?;
        }
        self.lookups_unanswered = requests.len();
        let mut out = Vec::with_capacity(requests.len());
        while out.len() < requests.len() {
            if let Some(r) = self.lookup_replies.pop_front() {
                self.lookups_unanswered -= 1;
                out.push(r);
                continue;
            }
            if !self.pump(Some(deadline))? {
                return Err(ClientError::Timeout(timeout));
            }
        }
        Ok(out)
    }

    /// Sends raw bytes (tests of the manager's handling of bad input).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.send(bytes)
    }

    /// The shared pool, read-only.
    pub fn pool(&self) -> Option<&[u8]> {
        self.pool.as_deref()
    }

    /// A leased page's bytes in the shared pool, verified against the
    /// checksum the page carries (valid while the lease is held: the runtime
    /// does not reuse a leased slot). Bytes that do not match are an error,
    /// never returned.
    pub fn page(&self, lease: &LeaseInfo) -> Result<&[u8], ClientError> {
        let pool = self.pool.as_deref().ok_or(ClientError::NoPool)?;
        let bytes = verified_page(pool, lease)?;
        Ok(bytes)
    }

    /// A device region this client registered, as the engine sees its GPU
    /// memory: write pages before publishing them, read them after restores.
    pub fn region_mut(&mut self, region: u64) -> Option<&mut [u8]> {
        self.regions.get_mut(&region).map(|m| &mut m[..])
    }
}
/// The bytes `lease` names in `pool`, if they lie inside it and match the
/// checksum the page carries.
pub fn verified_page<'p>(pool: &'p [u8], lease: &LeaseInfo) -> Result<&'p [u8], ClientError> {
    let outside = || ClientError::LeaseOutsidePool {
        lease: lease.lease,
        offset: lease.offset,
        bytes: lease.bytes,
        pool_bytes: pool.len() as u64,
    };
    let start = usize::try_from(lease.offset).map_err(|_| outside())?;
    let len = usize::try_from(lease.bytes).map_err(|_| outside())?;
    let end = start.checked_add(len).ok_or_else(outside)?;
    let bytes = pool.get(start..end).ok_or_else(outside)?;
    if orbitkv_components::checksum::page_checksum(bytes) != lease.checksum {
        return Err(ClientError::PageChecksum {
            lease: lease.lease,
            offset: lease.offset,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_components::api::PagePos;

    #[test]
    fn the_spin_guard_ignores_a_lone_bad_sample_and_trips_on_a_run() {
        let mut s = Share::default();
        // One preempted spin among good ones never trips it, however often
        // that pattern repeats.
        for _ in 0..100 {
            assert!(!s.sample(true));
            for _ in 0..7 {
                assert!(!s.sample(false));
            }
        }
        // Three in a row do (1/8, 15/64, 169/512 > 1/4), and it starts over.
        let mut s = Share::default();
        assert!(!s.sample(true));
        assert!(!s.sample(true));
        assert!(s.sample(true));
        assert!(!s.sample(true));
    }

    fn lease(offset: u64, bytes: u64, checksum: u64) -> LeaseInfo {
        LeaseInfo {
            lease: 7,
            pos: PagePos {
                rank: 0,
                group: 0,
                page_end: 16,
            },
            bytes,
            slot: 0,
            offset,
            checksum,
        }
    }

    #[test]
    fn a_page_is_returned_only_when_its_bytes_match_the_checksum() {
        let pool: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let sum = xxhash_rust::xxh3::xxh3_64(&pool[1024..2048]);
        let got = verified_page(&pool, &lease(1024, 1024, sum)).unwrap();
        assert_eq!(got, &pool[1024..2048]);
        let err = verified_page(&pool, &lease(1024, 1024, sum ^ 1)).unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::PageChecksum {
                    lease: 7,
                    offset: 1024
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_lease_outside_the_pool_is_refused_without_reading() {
        let pool = vec![0u8; 4096];
        for (offset, bytes) in [(4096, 1), (4000, 200), (u64::MAX, 2), (1, u64::MAX)] {
            let err = verified_page(&pool, &lease(offset, bytes, 0)).unwrap_err();
            assert!(
                matches!(
                    err,
                    ClientError::LeaseOutsidePool {
                        pool_bytes: 4096,
                        ..
                    }
                ),
                "{offset}+{bytes}: {err}"
            );
        }
    }
}
