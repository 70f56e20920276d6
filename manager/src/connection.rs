//! One client connection: its socket, framing, bounded outbox and quotas.
//!
//! Nothing here blocks. Reads take what the socket has (bounded per
//! round); writes go through the [`Outbox`], which sends what the socket
//! takes and keeps the rest for `POLLOUT`. A descriptor rides on the first
//! byte of the frame that names it, so the client pairs it with its handle
//! by name.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd as _, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use orbitkv_components::api::{CommandId, Event, SessionHandle};
use orbitkv_ipc::Delivered;
use orbitkv_ipc::frame::{self, FrameReader, Kind};

pub type ConnId = u64;

/// Bytes asked of the socket per receive.
const READ_CHUNK: usize = 256 << 10;
/// Input read ahead of what the loop has handled, per connection: past it
/// the socket is left alone until frames are taken (back-pressure on the
/// client, not memory in the manager).
const MAX_READ_AHEAD: usize = 1 << 20;
/// Frames appended to one send chunk before a new one starts.
const CHUNK_BYTES: usize = 256 << 10;

/// Frames waiting to be sent. A chunk's descriptors go with its first byte.
#[derive(Default)]
pub struct Outbox {
    chunks: VecDeque<Chunk>,
    bytes: usize,
}

struct Chunk {
    bytes: Vec<u8>,
    sent: usize,
    fds: Vec<OwnedFd>,
}

/// What a flush did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flushed {
    /// Everything went out.
    Empty,
    /// The socket is full; the rest waits for `POLLOUT`.
    Pending { progressed: bool },
}

impl Outbox {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Queues one encoded frame.
    pub fn push(&mut self, bytes: Vec<u8>) {
        self.bytes += bytes.len();
        if let Some(last) = self.chunks.back_mut()
            && last.bytes.len() < CHUNK_BYTES
        {
            last.bytes.extend_from_slice(&bytes);
            return;
        }
        self.chunks.push_back(Chunk {
            bytes,
            sent: 0,
            fds: Vec::new(),
        });
    }

    /// Queues one frame with descriptors attached to its first byte.
    pub fn push_with_fds(&mut self, bytes: Vec<u8>, fds: Vec<OwnedFd>) {
        self.bytes += bytes.len();
        self.chunks.push_back(Chunk {
            bytes,
            sent: 0,
            fds,
        });
    }

    /// Sends what the socket takes now.
    pub fn flush(&mut self, stream: &UnixStream) -> io::Result<Flushed> {
        let mut progressed = false;
        while let Some(chunk) = self.chunks.front_mut() {
            let raw: Vec<RawFd> = if chunk.sent == 0 {
                chunk.fds.iter().map(|f| f.as_raw_fd()).collect()
            } else {
                Vec::new()
            };
            match frame::send_some(stream, &chunk.bytes[chunk.sent..], &raw) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    progressed = true;
                    // The kernel holds its own references now.
                    chunk.fds.clear();
                    chunk.sent += n;
                    debug_assert!(self.bytes >= n, "outbox byte count underflow");
                    self.bytes -= n;
                    if chunk.sent == chunk.bytes.len() {
                        self.chunks.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(Flushed::Pending { progressed });
                }
                Err(e) => return Err(e),
            }
        }
        debug_assert_eq!(self.bytes, 0, "an empty outbox holds no bytes");
        Ok(Flushed::Empty)
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Connected; the first frame must be `Hello`.
    AwaitingHello,
    /// Greeted: commands, pings and inspections.
    Ready,
}

/// Commands whose replies change a connection's quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    Session,
    /// A region for the session with this id.
    Region {
        session: u64,
    },
}

pub struct Conn {
    pub id: ConnId,
    pub stream: UnixStream,
    pub pid: i32,
    /// The peer's uid (`SO_PEERCRED` at connect): sessions are counted per
    /// uid and per process across connections.
    pub uid: u32,
    pub name: String,
    pub stage: Stage,
    pub hot: bool,
    pub input: FrameReader,
    pub outbox: Outbox,
    /// Events for this connection, sent as one `Events` frame per flush.
    pub events: Vec<Delivered>,
    /// The peer closed its end; handle what it sent, then disconnect.
    pub eof: bool,
    /// When the outbox last made progress or was empty (the stall clock).
    pub last_progress: Instant,
    /// Open sessions, closed for it when it goes away.
    pub sessions: BTreeMap<u64, SessionHandle>,
    /// Live device regions and the session each belongs to.
    pub regions: HashMap<u64, u64>,
    /// Submitted commands that will open a session or region, until their
    /// reply: they count against the quotas already.
    pub quota_pending: HashMap<CommandId, Quota>,
}

impl Conn {
    pub fn new(id: ConnId, stream: UnixStream, pid: i32, uid: u32) -> Conn {
        Conn {
            id,
            stream,
            pid,
            uid,
            name: format!("pid {pid}"),
            stage: Stage::AwaitingHello,
            hot: false,
            input: FrameReader::default(),
            outbox: Outbox::default(),
            events: Vec::new(),
            eof: false,
            last_progress: Instant::now(),
            sessions: BTreeMap::new(),
            regions: HashMap::new(),
            quota_pending: HashMap::new(),
        }
    }

    /// Whether the loop should read the socket: not past the read-ahead
    /// bound, unless the next frame needs more to complete.
    pub fn wants_read(&self) -> bool {
        !self.eof && (self.input.buffered() < MAX_READ_AHEAD || self.input.missing() > 0)
    }

    /// Bytes held for a frame that is not complete yet and is larger than
    /// the read-ahead: the whole frame, once its header said how long it
    /// is (it is kept until complete). 0 otherwise: frames within the
    /// read-ahead are bounded per connection already.
    pub fn partial_claim(&self) -> usize {
        let missing = self.input.missing();
        let whole = self.input.buffered() + missing;
        if missing > 0 && whole > MAX_READ_AHEAD {
            whole
        } else {
            0
        }
    }

    /// Reads what the socket has, up to the read-ahead bound, and a large
    /// frame only while it fits `partial_room` (what the global bound on
    /// partly received frames leaves this connection): `Err` with the
    /// frame's size when it does not, before the rest of it is read.
    /// Descriptors a client sends are dropped (clients send none).
    pub fn read(&mut self, partial_room: usize) -> Result<(), usize> {
        let mut fds = Vec::new();
        while self.wants_read() {
            let claim = self.partial_claim();
            if claim > partial_room {
                return Err(claim);
            }
            let want = READ_CHUNK.max(self.input.missing());
            match self.input.fill(&self.stream, want, &mut fds) {
                Ok(0) => self.eof = true,
                Ok(_) => fds.clear(),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => self.eof = true,
            }
        }
        let claim = self.partial_claim();
        if claim > partial_room {
            return Err(claim);
        }
        Ok(())
    }

    pub fn sessions_claimed(&self) -> usize {
        let pending = self
            .quota_pending
            .values()
            .filter(|p| matches!(p, Quota::Session))
            .count();
        self.sessions.len() + pending
    }

    pub fn regions_claimed(&self) -> usize {
        let pending = self
            .quota_pending
            .values()
            .filter(|p| matches!(p, Quota::Region { .. }))
            .count();
        self.regions.len() + pending
    }

    /// Updates the quota counts from an event addressed to this connection.
    pub fn learn(&mut self, e: &Event) {
        let pending = e.command().and_then(|cid| self.quota_pending.remove(&cid));
        match e {
            Event::SessionOpened { session, .. } => {
                self.sessions.insert(session.id, *session);
            }
            Event::RegionRegistered { region, .. } => {
                if let Some(Quota::Region { session }) = pending {
                    self.regions.insert(*region, session);
                }
            }
            Event::SessionClosed { session, .. } => {
                self.sessions.remove(&session.id);
                self.regions.retain(|_, s| *s != session.id);
            }
            _ => {}
        }
    }

    /// Queues the batched events as one frame.
    pub fn seal_events(&mut self) {
        if !self.events.is_empty() {
            let events = std::mem::take(&mut self.events);
            self.outbox.push(frame::encode(Kind::Events, &events));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outbox_keeps_what_the_socket_refuses_and_descriptors_ride_once() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut out = Outbox::default();
        let big = vec![7u8; 4 << 20];
        out.push(frame::encode(Kind::Ping, &()));
        let (file, _) = {
            let f = tempfile::tempfile().unwrap();
            (f, ())
        };
        out.push_with_fds(frame::encode(Kind::Pong, &()), vec![OwnedFd::from(file)]);
        out.push(big.clone());
        let total = out.bytes();
        let first = out.flush(&a).unwrap();
        assert!(matches!(first, Flushed::Pending { progressed: true }));
        assert!(out.bytes() > 0 && out.bytes() < total);
        // The peer drains; every byte and exactly one descriptor arrive.
        b.set_nonblocking(true).unwrap();
        let mut r = FrameReader::default();
        let mut fds = Vec::new();
        let mut got = 0;
        while got < total {
            match r.fill(&b, 1 << 20, &mut fds) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = out.flush(&a).unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(out.flush(&a).unwrap(), Flushed::Empty);
        assert_eq!(out.bytes(), 0);
        assert_eq!(fds.len(), 1);
        assert_eq!(r.next_frame().unwrap().unwrap().0, Kind::Ping);
        assert_eq!(r.next_frame().unwrap().unwrap().0, Kind::Pong);
        assert_eq!(r.buffered(), big.len());
    }
}
