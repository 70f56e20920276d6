//! The blocking Rust client of `orbitkv serve`.
//!
//! `call` submits a command and waits for its reply event; events for the
//! client's operations (Ready, RestoreDone, ...) queue up and are taken with
//! `poll_events` (non-blocking) or `wait_event`. Waiting spins briefly
//! before blocking in `poll(2)`: a reply usually arrives within the spin,
//! and under contention the thread sleeps instead of burning the core.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use orbitkv_components::api::{Command, CommandError, CommandId, Event, LeaseInfo};

use super::frame::{self, FrameError, Kind};
use super::{Accepted, Hello, ProtocolError, Submit, Welcome};

/// How long a waiting client spins before it blocks.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// How long `submit` and `ping` wait for the manager before giving up.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(30);
const READ_CHUNK: usize = 256 << 10;

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
}

pub struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    welcome: Welcome,
    pool: Option<memmap2::Mmap>,
    regions: HashMap<u64, memmap2::MmapMut>,
    next_tag: u64,
    accepted: HashMap<u64, Result<u64, CommandError>>,
    events: VecDeque<Event>,
    spin: Duration,
}

impl Client {
    /// Connects and shakes hands; maps the shared pool when the manager
    /// has one.
    pub fn connect(path: impl AsRef<Path>, name: &str) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(ClientError::Connect)?;
        stream.set_nonblocking(true).map_err(ClientError::Connect)?;
        let mut c = Client {
            stream,
            buf: Vec::new(),
            fds: Vec::new(),
            welcome: Welcome {
                protocol: 0,
                incarnation: 0,
                pool_bytes: 0,
                max_frame_bytes: 0,
            },
            pool: None,
            regions: HashMap::new(),
            next_tag: 0,
            accepted: HashMap::new(),
            events: VecDeque::new(),
            spin: DEFAULT_SPIN,
        };
        c.send(&frame::encode(
            Kind::Hello,
            &Hello {
                protocol: frame::PROTOCOL_VERSION,
                client: name.to_owned(),
            },
        ))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c.next_frame(Some(deadline))? {
                Some((Kind::Welcome, payload)) => {
                    c.welcome = frame::decode(Kind::Welcome, &payload)?;
                    if c.welcome.pool_bytes > 0 {
                        let fd = c.fds.pop().ok_or_else(|| {
                            ClientError::Protocol("welcome without the pool descriptor".into())
                        })?;
                        let file = std::fs::File::from(fd);
                        // SAFETY: a read-only view of the manager's pool. Bytes
                        // under a lease this client holds do not change.
                        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(ClientError::Map)?;
                        c.pool = Some(map);
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

    /// Sets how long waits spin before blocking (0: block at once).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
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
            if let Some(f) = frame::take_frame(&mut self.buf)? {
                return Ok(Some(f));
            }
            match frame::recv_some(&self.stream, &mut self.buf, READ_CHUNK, &mut self.fds) {
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

    /// Handles one frame: queues events, records acceptances.
    fn absorb(&mut self, kind: Kind, payload: Vec<u8>) -> Result<(), ClientError> {
        match kind {
            Kind::Accepted => {
                let a: Accepted = frame::decode(kind, &payload)?;
                self.accepted.insert(a.tag, a.result);
            }
            Kind::Events => {
                let events: Vec<Event> = frame::decode(kind, &payload)?;
                for e in events {
                    if let Event::RegionRegistered { region, .. } = &e
                        && let Some(fd) = (!self.fds.is_empty()).then(|| self.fds.remove(0))
                    {
                        let file = std::fs::File::from(fd);
                        // SAFETY: the engine side of a shared device region:
                        // this client writes the pages it publishes and reads
                        // the ones restored into it, as an engine does GPU
                        // memory.
                        let map = unsafe { memmap2::MmapMut::map_mut(&file) }
                            .map_err(ClientError::Map)?;
                        self.regions.insert(*region, map);
                    }
                    self.events.push_back(e);
                }
            }
            Kind::Error => {
                let e: ProtocolError = frame::decode(kind, &payload)?;
                return Err(ClientError::Protocol(e.error));
            }
            Kind::Pong | Kind::Ping | Kind::Hello | Kind::Welcome | Kind::Submit => {}
        }
        Ok(())
    }

    /// Queues a command; returns its id once the manager accepted it.
    pub fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.send(&frame::encode(Kind::Submit, &Submit { tag, command }))?;
        let deadline = Instant::now() + ACK_TIMEOUT;
        loop {
            if let Some(result) = self.accepted.remove(&tag) {
                return Ok(result?);
            }
            let (kind, payload) = self
                .next_frame(Some(deadline))?
                .ok_or(ClientError::Timeout(ACK_TIMEOUT))?;
            self.absorb(kind, payload)?;
        }
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
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.events.iter().position(&pred) {
                return Ok(self.events.remove(i));
            }
            match self.next_frame(Some(deadline))? {
                Some((kind, payload)) => self.absorb(kind, payload)?,
                None => return Ok(None),
            }
        }
    }

    /// Every event that arrived, without blocking.
    pub fn poll_events(&mut self) -> Result<Vec<Event>, ClientError> {
        let saved = self.spin;
        self.spin = Duration::ZERO;
        let r = (|| {
            while let Some((kind, payload)) = self.next_frame(Some(Instant::now()))? {
                self.absorb(kind, payload)?;
            }
            Ok(self.events.drain(..).collect())
        })();
        self.spin = saved;
        r
    }

    /// Round trip of an empty frame through the manager's loop.
    pub fn ping(&mut self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        self.send(&frame::encode(Kind::Ping, &()))?;
        let deadline = start + ACK_TIMEOUT;
        loop {
            let (kind, payload) = self
                .next_frame(Some(deadline))?
                .ok_or(ClientError::Timeout(ACK_TIMEOUT))?;
            if kind == Kind::Pong {
                return Ok(start.elapsed());
            }
            self.absorb(kind, payload)?;
        }
    }

    /// Sends raw bytes (tests of the manager's handling of bad input).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.send(bytes)
    }

    /// The shared pool, read-only.
    pub fn pool(&self) -> Option<&[u8]> {
        self.pool.as_deref()
    }

    /// A leased page's bytes in the shared pool (valid while the lease is
    /// held: the runtime does not reuse a leased slot).
    pub fn page(&self, lease: &LeaseInfo) -> Option<&[u8]> {
        let pool = self.pool.as_deref()?;
        pool.get(lease.offset as usize..(lease.offset + lease.bytes) as usize)
    }

    /// A device region this client registered, as the engine sees its GPU
    /// memory: write pages before publishing them, read them after restores.
    pub fn region_mut(&mut self, region: u64) -> Option<&mut [u8]> {
        self.regions.get_mut(&region).map(|m| &mut m[..])
    }
}
