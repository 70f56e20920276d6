//! Frame encoding and decoding, and sending and receiving frames with
//! attached descriptors (`SCM_RIGHTS`) over a Unix stream socket.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

pub const MAGIC: [u8; 4] = *b"OKVP";
/// 5: the hot path's wake-ups moved from a `Wake` frame (kind 9, retired)
/// and an iceoryx2 event to eventfds passed with `Welcome`.
/// 6: hot responses travel in the descriptor area's mailbox (area layout
/// version 2), not as iceoryx2 responses.
/// 7: hot requests are iceoryx2 publish-subscribe samples, not
/// request-response requests (the responses being in the mailbox since 6).
pub const PROTOCOL_VERSION: u16 = 7;
pub const HEADER_BYTES: usize = 16;
/// The largest payload accepted (a query's hash lists fit comfortably).
pub const MAX_FRAME_BYTES: u32 = 16 << 20;
/// Descriptors one frame may carry.
pub const MAX_FDS_PER_FRAME: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    Submit = 3,
    Accepted = 4,
    Events = 5,
    Error = 6,
    Ping = 7,
    Pong = 8,
    /// Manager → client: one shared-memory descriptor, attached to this
    /// frame's first byte, and the handle it belongs to
    /// ([`crate::Descriptor`]). Descriptors pair with handles by name,
    /// never by position.
    Descriptor = 10,
    /// Client → manager: asks for a [`crate::Snapshot`] (`orbitkv
    /// inspect`). Empty payload.
    Inspect = 11,
    /// Manager → client: the answer to `Inspect`.
    Snapshot = 12,
    /// Client → manager: where a prompt's pages are
    /// ([`orbitkv_components::admin::LookupRequest`], `orbitkv lookup`).
    Lookup = 13,
    /// Manager → client: the answer to `Lookup`
    /// ([`orbitkv_components::admin::LookupReply`]).
    LookupReply = 14,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Submit,
            4 => Kind::Accepted,
            5 => Kind::Events,
            6 => Kind::Error,
            7 => Kind::Ping,
            8 => Kind::Pong,
            10 => Kind::Descriptor,
            11 => Kind::Inspect,
            12 => Kind::Snapshot,
            13 => Kind::Lookup,
            14 => Kind::LookupReply,
            _ => return None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("bad frame magic {0:02x?}")]
    Magic([u8; 4]),
    #[error("unsupported protocol version {0} (this build speaks {PROTOCOL_VERSION})")]
    Version(u16),
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(u32),
    #[error("reserved header field is {0}, not 0")]
    Reserved(u32),
    #[error("bad {kind:?} payload: {reason}")]
    Payload { kind: Kind, reason: String },
    #[error("peer closed the connection")]
    Closed,
    #[error(transparent)]
    Io(#[from] io::Error),
}

pub fn header(kind: Kind, len: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(kind as u16).to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h
}

/// Validates a header; returns the kind and payload length.
pub fn parse_header(h: &[u8; HEADER_BYTES]) -> Result<(Kind, u32), FrameError> {
    let [m0, m1, m2, m3, ..] = *h;
    let magic = [m0, m1, m2, m3];
    if magic != MAGIC {
        return Err(FrameError::Magic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::Version(version));
    }
    let raw_kind = u16::from_le_bytes([h[6], h[7]]);
    let kind = Kind::from_u16(raw_kind).ok_or(FrameError::UnknownKind(raw_kind))?;
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    let reserved = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    if reserved != 0 {
        return Err(FrameError::Reserved(reserved));
    }
    Ok((kind, len))
}

/// Encodes one frame.
pub fn encode<T: serde::Serialize>(kind: Kind, msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("protocol messages serialize");
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.extend_from_slice(&header(kind, body.len() as u32));
    out.extend_from_slice(&body);
    out
}

pub fn decode<T: serde::de::DeserializeOwned>(kind: Kind, payload: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(payload).map_err(|e| FrameError::Payload {
        kind,
        reason: e.to_string(),
    })
}

/// Sends `bytes` (one or more whole frames) with `fds` attached to the first
/// byte. Blocking; retries short writes.
pub fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(
        fds.len() <= MAX_FDS_PER_FRAME,
        "at most {MAX_FDS_PER_FRAME} descriptors per send"
    );
    let mut sent = 0;
    if !fds.is_empty() {
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
        let mut cmsg_buf = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        // SAFETY: msghdr is plain data; every pointer below points into
        // buffers that outlive the sendmsg call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: the control buffer has CMSG_SPACE for `fds.len()` fds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg) as *mut RawFd,
                fds.len(),
            );
        }
        loop {
            // SAFETY: a valid socket and message (above).
            let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n >= 0 {
                sent = n as usize;
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if e.kind() == io::ErrorKind::WouldBlock {
                wait_writable(stream)?;
                continue;
            }
            return Err(e);
        }
    }
    write_all(stream, &bytes[sent..])
}

/// Sends what the socket takes now of `bytes`, with `fds` attached to the
/// first byte; never waits. Returns the bytes sent (the descriptors went
/// with them when that is more than 0); `WouldBlock` when nothing fit.
pub fn send_some(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if bytes.is_empty() {
        return Ok(0);
    }
    let fd_bytes = std::mem::size_of_val(fds);
    let space = if fds.is_empty() {
        0
    } else {
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        unsafe { libc::CMSG_SPACE(fd_bytes as u32) as usize }
    };
    let mut cmsg_buf = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; every pointer below points into buffers
    // that outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cmsg_buf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: the control buffer has CMSG_SPACE for `fds.len()` fds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg) as *mut RawFd,
                fds.len(),
            );
        }
    }
    loop {
        // SAFETY: a valid socket and message (above).
        let n = unsafe {
            libc::sendmsg(
                stream.as_raw_fd(),
                &msg,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn wait_writable(stream: &UnixStream) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, 1000) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `write_all` that also works on non-blocking sockets (waits for room).
pub fn write_all(stream: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut s = stream;
    while !bytes.is_empty() {
        match s.write(bytes) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_writable(stream)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads what is available into `buf` (up to `max`), collecting any
/// descriptors that arrive. Returns bytes read; 0 means the peer closed.
/// `WouldBlock` passes through for non-blocking sockets.
pub fn recv_some(
    stream: &UnixStream,
    buf: &mut Vec<u8>,
    max: usize,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let start = buf.len();
    // Receive into spare capacity: zero-filling a large buffer on every read
    // would cost more than the read. A peer decides how much is asked for
    // (a frame's announced length): failing to get it is an error for this
    // stream, never an abort of the process.
    buf.try_reserve(max)
        .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e))?;
    let mut iov = libc::iovec {
        iov_base: buf.spare_capacity_mut().as_mut_ptr() as *mut libc::c_void,
        iov_len: max,
    };
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS_PER_FRAME * size_of::<RawFd>()) as u32) } as usize;
    let mut cmsg_buf = vec![0u8; space];
    // SAFETY: plain data, pointers into live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    let n = loop {
        // SAFETY: valid socket and message.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // SAFETY: the kernel initialized `n <= max` bytes of the spare capacity.
    unsafe { buf.set_len(start + n) };
    // SAFETY: walking the control messages the kernel wrote.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let count =
                    ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(*data.add(i)));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(n)
}

/// A stream's received bytes, consumed from the front without moving the
/// rest: taking a frame advances a cursor, and the unread tail moves to the
/// front only when the buffer is refilled, so a burst of `n` small frames
/// costs O(n), not O(n^2).
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
}

impl FrameReader {
    /// Unread bytes.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Bytes the next frame still needs before it is complete (0 when a
    /// whole frame or a bad header is buffered).
    pub fn missing(&self) -> usize {
        let unread = &self.buf[self.start..];
        let Some(h) = unread.first_chunk::<HEADER_BYTES>() else {
            return HEADER_BYTES - unread.len();
        };
        match parse_header(h) {
            Ok((_, len)) => (HEADER_BYTES + len as usize).saturating_sub(unread.len()),
            Err(_) => 0,
        }
    }

    /// Receives up to `max` bytes (and any descriptors); see [`recv_some`].
    pub fn fill(
        &mut self,
        stream: &UnixStream,
        max: usize,
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        recv_some(stream, &mut self.buf, max, fds)
    }

    /// The next complete frame, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<(Kind, Vec<u8>)>, FrameError> {
        let unread = &self.buf[self.start..];
        let Some(h) = unread.first_chunk::<HEADER_BYTES>() else {
            return Ok(None);
        };
        let (kind, len) = parse_header(h)?;
        let total = HEADER_BYTES + len as usize;
        let Some(payload) = unread.get(HEADER_BYTES..total) else {
            return Ok(None);
        };
        let payload = payload.to_vec();
        self.start += total;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        Ok(Some((kind, payload)))
    }

    /// Gives back memory after a burst.
    pub fn shrink(&mut self, keep: usize) {
        if self.buf.is_empty() && self.buf.capacity() > keep {
            self.buf = Vec::new();
        }
    }
}

/// Splits complete frames off the front of `buf`.
pub fn take_frame(buf: &mut Vec<u8>) -> Result<Option<(Kind, Vec<u8>)>, FrameError> {
    if buf.len() < HEADER_BYTES {
        return Ok(None);
    }
    let Some(h) = buf.first_chunk::<HEADER_BYTES>() else {
        return Ok(None);
    };
    let (kind, len) = parse_header(h)?;
    let total = HEADER_BYTES + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = buf[HEADER_BYTES..total].to_vec();
    buf.drain(..total);
    Ok(Some((kind, payload)))
}

/// The peer's (pid, uid, gid), from `SO_PEERCRED`.
pub fn peer_credentials(stream: &UnixStream) -> io::Result<(i32, u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a ucred-sized buffer for SO_PEERCRED.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid, cred.gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_memfd(len: u64) -> io::Result<(std::fs::File, memmap2::MmapMut)> {
        let file = memfd::MemfdOptions::default()
            .create("t")
            .map_err(io::Error::other)?
            .into_file();
        file.set_len(len)?;
        // SAFETY: a fresh memfd only this test maps.
        let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
        Ok((file, map))
    }

    #[test]
    fn header_round_trip_and_rejections() {
        let h = header(Kind::Submit, 42);
        assert_eq!(parse_header(&h).unwrap(), (Kind::Submit, 42));
        let mut bad = h;
        bad[0] = b'X';
        assert!(matches!(parse_header(&bad), Err(FrameError::Magic(_))));
        let mut bad = h;
        bad[4] = 9;
        assert!(matches!(parse_header(&bad), Err(FrameError::Version(9))));
        let mut bad = h;
        bad[6] = 99;
        assert!(matches!(
            parse_header(&bad),
            Err(FrameError::UnknownKind(99))
        ));
        let bad = header(Kind::Submit, MAX_FRAME_BYTES + 1);
        assert!(matches!(parse_header(&bad), Err(FrameError::TooLarge(_))));
        let mut bad = h;
        bad[12] = 1;
        assert!(matches!(parse_header(&bad), Err(FrameError::Reserved(1))));
    }

    #[test]
    fn frames_split_from_a_stream_buffer() {
        let mut buf = encode(Kind::Ping, &());
        buf.extend(encode(Kind::Hello, &serde_json::json!({"protocol": 1})));
        buf.extend_from_slice(&header(Kind::Events, 100)[..7]); // partial
        assert_eq!(take_frame(&mut buf).unwrap().unwrap().0, Kind::Ping);
        let (k, p) = take_frame(&mut buf).unwrap().unwrap();
        assert_eq!(k, Kind::Hello);
        assert_eq!(p, br#"{"protocol":1}"#);
        assert!(take_frame(&mut buf).unwrap().is_none());
    }

    #[test]
    fn reader_takes_a_burst_and_waits_for_partial_frames() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut burst = Vec::new();
        for _ in 0..1000 {
            burst.extend(encode(Kind::Ping, &()));
        }
        let hello = encode(Kind::Hello, &serde_json::json!({"protocol": 1}));
        burst.extend_from_slice(&hello[..10]);
        write_all(&a, &burst).unwrap();
        let mut r = FrameReader::default();
        let mut fds = Vec::new();
        while r.buffered() < burst.len() {
            r.fill(&b, 1 << 16, &mut fds).unwrap();
        }
        for _ in 0..1000 {
            assert_eq!(r.next_frame().unwrap().unwrap().0, Kind::Ping);
        }
        assert!(r.next_frame().unwrap().is_none());
        assert_eq!(
            r.missing(),
            HEADER_BYTES - 10,
            "the rest of the header first"
        );
        write_all(&a, &hello[10..]).unwrap();
        r.fill(&b, 1 << 16, &mut fds).unwrap();
        let (k, p) = r.next_frame().unwrap().unwrap();
        assert_eq!((k, &p[..]), (Kind::Hello, &br#"{"protocol":1}"#[..]));
        assert_eq!(r.buffered(), 0);
        // A bad header is an error, not a wait.
        write_all(&a, b"GARBAGE-NOT-A-FRAME!").unwrap();
        r.fill(&b, 1 << 16, &mut fds).unwrap();
        assert!(matches!(r.next_frame(), Err(FrameError::Magic(_))));
    }

    #[test]
    fn descriptors_travel_with_frames() {
        let (a, b) = UnixStream::pair().unwrap();
        let (file, mut map) = test_memfd(4096).unwrap();
        map[..5].copy_from_slice(b"hello");
        send_with_fds(&a, &encode(Kind::Ping, &()), &[file.as_raw_fd()]).unwrap();
        let mut buf = Vec::new();
        let mut fds = Vec::new();
        recv_some(&b, &mut buf, 4096, &mut fds).unwrap();
        assert_eq!(fds.len(), 1);
        let got = std::fs::File::from(fds.pop().unwrap());
        // SAFETY: test-only read mapping of the shared file.
        let view = unsafe { memmap2::Mmap::map(&got).unwrap() };
        assert_eq!(&view[..5], b"hello");
        assert_eq!(take_frame(&mut buf).unwrap().unwrap().0, Kind::Ping);
        let (pid, uid, _) = peer_credentials(&b).unwrap();
        assert_eq!(pid as u32, std::process::id());
        // SAFETY: getuid has no preconditions.
        assert_eq!(uid, unsafe { libc::getuid() });
    }
}
