//! The hot path: the commands an engine step issues (query, lookup, load,
//! prepare, restore, publish, release, cancel) as small fixed-size
//! messages on an iceoryx2 publish-subscribe service, and their replies in
//! the connection's mailbox (see [`Area`]). Large parts
//! (hash lists, page lists, restore targets, lease lists) never travel in a
//! message: they go in a per-connection shared-memory descriptor area, and
//! the message carries `(offset, len, generation, kind)` descriptors.
//!
//! See `docs/serve.md`, "Hot path", for the protocol; this module has the
//! wire types, the area (two rings of records) and the encoding of parts.
//!
//! Every read of the area validates the descriptor first (bounds, record
//! state, generation, length, kind), copies the bytes out of shared memory,
//! then parses the copy: a bad descriptor is a [`HotError`], never an
//! out-of-bounds read, and a peer writing concurrently can only make the
//! parse fail.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use iceoryx2::prelude::{SemanticString as _, ZeroCopySend};
use orbitkv_components::api::{
    Candidates, Command, CommandError, Event, GroupHashes, LeaseInfo, MissReason, PagePos,
    PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::RequiredRange;
use orbitkv_components::{Namespace, NativeHash};

/// The iceoryx2 service flavour both sides use: thread-safe ports, so a
/// [`crate::Client`] stays `Send` (the Python bridge moves it between
/// threads).
pub type Ipc = iceoryx2::service::ipc_threadsafe::Service;

/// `"OKVH"`: the first field of every hot message.
pub const HOT_MAGIC: u32 = u32::from_le_bytes(*b"OKVH");
/// Requests a client may have open at once (a query's stays open until its
/// operation ends); past it the client sends commands on the socket, and
/// the manager refuses more (`TooManyRequests`). Also the request
/// service's buffer.
pub const MAX_ACTIVE_REQUESTS: usize = 32;
/// Responses one request may get on the hot path; later ones (only
/// `transfer_overdue` can get there) go on the socket, so the mailbox
/// holds what every open request can be owed.
pub const MAX_RESPONSES_PER_REQUEST: u32 = 8;
/// Default size of a connection's descriptor area.
pub const DEFAULT_AREA_BYTES: u64 = 1 << 20;
const AREA_HEADER_BYTES: usize = 4096;
/// The area's layout version (see [`Area`]).
const AREA_VERSION: u32 = 2;
/// Responses the mailbox holds: every response a client's open requests
/// can be owed at once (a request gets at most
/// [`MAX_RESPONSES_PER_REQUEST`], a client has at most
/// [`MAX_ACTIVE_REQUESTS`] open, and a request stays open on the client's
/// side until it took the last one).
pub const MAILBOX_SLOTS: usize = MAX_ACTIVE_REQUESTS * MAX_RESPONSES_PER_REQUEST as usize;
const MAILBOX_BYTES: usize = MAILBOX_SLOTS * size_of::<HotResponse>();
const AREA_MAGIC: [u8; 8] = *b"OKVAREA1";
const RECORD_HEADER: usize = 16;
const RECORD_ALIGN: usize = 16;

/// The name every hot service of one manager incarnation starts with
/// (each connection's is [`connection_service_name`]).
pub fn service_name(incarnation: u64) -> String {
    format!("orbitkv/{incarnation:016x}/rpc")
}

/// The request service of one connection (`conn`, the manager's
/// id for it): each hot connection has its own.
pub fn connection_service_name(incarnation: u64, conn: u64) -> String {
    format!("{}/{conn:x}", service_name(incarnation))
}

/// A wake-up signal between the manager and a hot client: an eventfd
/// (the manager makes it and passes it in the `Welcome`; see
/// `docs/serve.md`, "Hot path").
///
/// Not a socket, on purpose. A write on a Unix socket or a pipe wakes its
/// reader as a *sync* wake-up ("the waker is about to sleep"), and Linux
/// then moves the reader onto the waker's CPU. The waker here does not
/// sleep (the manager spins after answering, a client runs the engine on),
/// so the two end up sharing one CPU while another is idle, and every
/// later wait blocks. Measured on a 2-CPU VM with back-to-back lookups:
/// half the lookups paid a ~100 us wake-up. An eventfd write wakes without
/// that hint, so the woken side stays on its own (idle) CPU.
#[derive(Debug)]
pub struct WakeFd(std::os::fd::OwnedFd);

impl WakeFd {
    /// A new eventfd, non-blocking and close-on-exec.
    pub fn new() -> io::Result<WakeFd> {
        use std::os::fd::FromRawFd as _;
        // SAFETY: plain system call; the descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(WakeFd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// One received in a `Welcome`. Anything but an eventfd (a peer's
    /// mistake) makes `signal` and `drain` fail quietly, never block:
    /// the descriptor is set non-blocking here.
    pub fn from_fd(fd: std::os::fd::OwnedFd) -> WakeFd {
        use std::os::fd::AsRawFd as _;
        // SAFETY: fcntl on a descriptor we own.
        unsafe {
            let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        WakeFd(fd)
    }

    pub fn try_clone(&self) -> io::Result<WakeFd> {
        Ok(WakeFd(self.0.try_clone()?))
    }

    /// Wakes whoever polls it. (A saturated counter, `EAGAIN`, is already
    /// a pending wake-up.)
    pub fn signal(&self) {
        use std::os::fd::AsRawFd as _;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Clears pending wake-ups (after a wait); whether there were any.
    pub fn drain(&self) -> bool {
        use std::os::fd::AsRawFd as _;
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a valid buffer.
        let n = unsafe { libc::read(self.0.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) };
        n == 8
    }

    /// For `poll(2)`: readable while a wake-up is pending.
    pub fn raw(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd as _;
        self.0.as_raw_fd()
    }

    pub fn into_fd(self) -> std::os::fd::OwnedFd {
        self.0
    }
}

/// The iceoryx2 file prefix of one incarnation: every file it creates in
/// `/dev/shm` and under `/tmp/iceoryx2` starts with it, so an incarnation's
/// leftovers can be found and removed.
pub fn file_prefix(incarnation: u64) -> String {
    format!("iox2_okv{incarnation:016x}_")
}

/// The iceoryx2 configuration of an incarnation: defaults (no config file
/// is read) with the incarnation's file prefix.
pub fn iox_config(prefix: &str) -> Result<iceoryx2::config::Config, String> {
    let mut c = iceoryx2::config::Config::default();
    c.global.prefix = iceoryx2_bb_system_types::file_name::FileName::new(prefix.as_bytes())
        .map_err(|e| format!("iceoryx2 prefix {prefix:?}: {e:?}"))?;
    Ok(c)
}

/// iceoryx2 logs to stderr at `Info`; only its errors matter here.
pub fn quiet_iceoryx2_logs() {
    if std::env::var_os("IOX2_LOG_LEVEL").is_none() {
        iceoryx2_log::set_log_level(iceoryx2_log::LogLevel::Error);
    }
}

/// A part's place in the descriptor area: a record at `offset` in the
/// sender's ring, `len` payload bytes, written in lap `generation`, holding
/// a part of `kind`. All zero: the part is empty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ZeroCopySend)]
#[repr(C)]
pub struct Desc {
    pub offset: u32,
    pub len: u32,
    pub generation: u32,
    pub kind: u32,
}

impl Desc {
    pub fn is_empty(&self) -> bool {
        *self == Desc::default()
    }
}

/// Part kinds (a record's `kind`, checked against what the message expects).
pub mod part {
    pub const GROUPS: u32 = 1;
    pub const NAMESPACES: u32 = 2;
    pub const TARGETS: u32 = 3;
    pub const RETAINED: u32 = 4;
    pub const PUBLISH: u32 = 5;
    pub const CANDIDATES: u32 = 6;
    pub const COMMON: u32 = 7;
    pub const RANGES: u32 = 8;
    pub const LEASES: u32 = 9;
    pub const JSON: u32 = 10;
    /// A load's plan: ranks, targets, retained positions.
    pub const LOAD: u32 = 11;
    /// Padding at a ring's end (never in a descriptor).
    pub const PAD: u32 = 0xffff;
}

/// Hot commands (`HotRequest::op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Op {
    Query = 1,
    Prepare = 2,
    Restore = 3,
    Publish = 4,
    Release = 5,
    Cancel = 6,
    /// `Command::Lookup`: a query's fields, ended by its result.
    Lookup = 7,
    /// `Command::Load`: a query's fields and its restore plan.
    Load = 8,
}

impl Op {
    pub fn from_u32(v: u32) -> Option<Op> {
        Some(match v {
            1 => Op::Query,
            2 => Op::Prepare,
            3 => Op::Restore,
            4 => Op::Publish,
            5 => Op::Release,
            6 => Op::Cancel,
            7 => Op::Lookup,
            8 => Op::Load,
            _ => return None,
        })
    }
}

/// `HotRequest::flags` bits.
pub const REQ_PREPARE: u32 = 1;
pub const REQ_SPECULATIVE: u32 = 2;

/// A hot command: 128 bytes.
///
/// | op | `a` | parts |
/// | --- | --- | --- |
/// | query, lookup | request | 0 groups, 1 namespaces |
/// | load | request | 0 groups, 1 namespaces, 2 plan |
/// | prepare, release, cancel | operation | |
/// | restore | operation | 0 targets, 1 retained |
/// | publish | request | 0 pages |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ZeroCopySend)]
#[repr(C)]
#[type_name("OrbitKvHotRequestV1")]
pub struct HotRequest {
    pub magic: u32,
    pub op: u32,
    /// The connection's token from `Welcome`: ties the request to the
    /// socket connection (its sessions, its descriptor area).
    pub token: u64,
    /// Chosen by the client; echoed in every response.
    pub tag: u64,
    pub session: [u64; 3],
    pub a: u64,
    pub origin: u64,
    pub prompt_len: u64,
    pub flags: u32,
    pub reserved: u32,
    pub parts: [Desc; 3],
}

/// `HotResponse::kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RespKind {
    /// The command was queued; its events follow (`command` is its id).
    Accepted = 1,
    /// Not queued (the inbox is full): part 0 is the `CommandError` JSON.
    Refused = 2,
    /// The message or a descriptor was bad: `code` is a [`HotErrorCode`],
    /// `a` a detail (the offending offset, token or op).
    Error = 3,
    QueryResult = 4,
    Loading = 5,
    Ready = 6,
    Miss = 7,
    RestoreDone = 8,
    PublishDone = 9,
    Released = 10,
    /// Any other event (`rejected`, `transfer_overdue`): part 0 is its JSON.
    EventJson = 11,
}

impl RespKind {
    pub fn from_u32(v: u32) -> Option<RespKind> {
        use RespKind::*;
        Some(match v {
            1 => Accepted,
            2 => Refused,
            3 => Error,
            4 => QueryResult,
            5 => Loading,
            6 => Ready,
            7 => Miss,
            8 => RestoreDone,
            9 => PublishDone,
            10 => Released,
            11 => EventJson,
            _ => return None,
        })
    }
}

/// `HotResponse::flags` bits.
/// The last response of its request: the manager dropped the request.
pub const RESP_LAST: u32 = 1;
/// `QueryResult`: `c` holds `selected`.
pub const RESP_SELECTED: u32 = 2;

/// A reply or event on the hot path: 128 bytes.
///
/// | kind | `a` | `b` | `c` | `d` | `e` | `code` | parts |
/// | --- | --- | --- | --- | --- | --- | --- | --- |
/// | query_result | operation | request | selected | | | miss + 1 (0: none) | 0 candidates, 1 common |
/// | loading, released | operation | | | | | | |
/// | ready | operation | boundary | from DRAM | from tiers | | | 0 ranges, 1 leases |
/// | miss | operation | | | | | reason + 1 | |
/// | restore_done | operation | pages | bytes | | | | |
/// | publish_done | | request | inserted | duplicates | dropped | | |
/// | error | detail | | | | | `HotErrorCode` | |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ZeroCopySend)]
#[repr(C)]
#[type_name("OrbitKvHotResponseV1")]
pub struct HotResponse {
    pub magic: u32,
    pub kind: u32,
    pub tag: u64,
    pub command: u64,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub e: u64,
    pub code: u32,
    pub flags: u32,
    pub parts: [Desc; 3],
    pub reserved: u64,
}

const _: () = assert!(size_of::<HotRequest>() == 128);
const _: () = assert!(size_of::<HotResponse>() == 128);

/// Why the manager refused a hot message (the manager keeps serving).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum HotErrorCode {
    BadMagic = 1,
    UnknownOp = 2,
    UnknownToken = 3,
    /// A descriptor points outside its ring, or is misaligned.
    DescriptorBounds = 4,
    /// A descriptor's generation does not match its record (a stale
    /// descriptor: the record was freed or overwritten), or the record is
    /// not a live one.
    DescriptorGeneration = 5,
    /// A descriptor's length or kind does not match its record.
    DescriptorMismatch = 6,
    /// A part's bytes do not parse (sizes, counts, hash lengths).
    BadPart = 7,
    /// The connection has `MAX_ACTIVE_REQUESTS` requests open already
    /// (detail: how many); the client caps itself there.
    TooManyRequests = 8,
    Unknown = 0xffff,
}

impl HotErrorCode {
    pub fn from_u32(v: u32) -> HotErrorCode {
        use HotErrorCode::*;
        match v {
            1 => BadMagic,
            2 => UnknownOp,
            3 => UnknownToken,
            4 => DescriptorBounds,
            5 => DescriptorGeneration,
            6 => DescriptorMismatch,
            7 => BadPart,
            8 => TooManyRequests,
            _ => Unknown,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("hot path: {code:?} (detail {detail:#x})")]
pub struct HotError {
    pub code: HotErrorCode,
    pub detail: u64,
}

impl HotError {
    fn new(code: HotErrorCode, detail: u64) -> HotError {
        HotError { code, detail }
    }
}

fn bad_part(detail: u64) -> HotError {
    HotError::new(HotErrorCode::BadPart, detail)
}

// ---------------------------------------------------------------------------
// The descriptor area.

/// Record states (the first word of a record header).
const REC_FULL: u32 = 1;
const REC_FREED: u32 = 2;
const REC_PAD: u32 = 3;

/// One ring of the area: `cap` bytes at `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    pub off: usize,
    pub cap: usize,
}

/// A memfd of `len` bytes that nobody can resize from now on (a client
/// that shrank memory the manager maps would fault its next read).
pub(crate) fn sealed_memfd(name: &str, len: u64) -> io::Result<File> {
    let fd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .allow_sealing(true)
        .create(name)
        .map_err(io::Error::other)?;
    fd.as_file().set_len(len)?;
    fd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealSeal,
    ])
    .map_err(io::Error::other)?;
    Ok(fd.into_file())
}

/// A connection's descriptor area (a memfd both sides map): a 4 KiB header,
/// the response mailbox (manager writes, client reads), the request ring
/// (client writes, manager reads) and the reply ring (manager writes,
/// client reads).
///
/// ```text
/// 0    magic "OKVAREA1" | version:u32 = 2 | header_bytes:u32 = 4096
/// 16   req_off:u64 | req_cap:u64 | rep_off:u64 | rep_cap:u64
/// 48   mailbox_off:u64 | mailbox_slots:u64 (= MAILBOX_SLOTS)
/// 64   manager_sleeping:u32 (the manager is about to block)
/// 128  client_sleeping:u32  (the client is about to block)
/// 192  posted:u64           (responses the manager wrote, ever)
/// 256  taken:u64            (responses the client read, ever)
/// 320  requests_sent:u64    (requests the client sent, ever)
/// 384  answered_here:u64    (lookups the client answered from the presence filter, ever)
/// 4096 the mailbox: MAILBOX_SLOTS × 128-byte `HotResponse`s
/// ```
///
/// Responses go through the mailbox, not through iceoryx2: a response is
/// one 128-byte copy and one release store, where an iceoryx2 response
/// cost the manager 0.6 us (its sender reclaims returned chunks over every
/// request channel at each send) and the client one locked receive per
/// open request per look. Requests still travel on the connection's
/// iceoryx2 service, whose open request also tells the client that the
/// manager still holds it.
pub struct Area {
    map: memmap2::MmapRaw,
    pub req: Ring,
    pub rep: Ring,
    mailbox: usize,
}

// SAFETY: the mapping is shared memory accessed through raw pointers,
// atomics and copies; nothing hands out references into it.
unsafe impl Send for Area {}
unsafe impl Sync for Area {}

impl Area {
    /// The manager's side: a new area of `bytes` (rounded down to whole
    /// record units), halves for requests and replies.
    pub fn create(name: &str, bytes: u64) -> io::Result<(File, Area)> {
        let fixed = AREA_HEADER_BYTES + MAILBOX_BYTES;
        let bytes = (bytes as usize).max(fixed + 2 * 4096);
        let half = ((bytes - fixed) / 2) & !(RECORD_ALIGN - 1);
        // The client writes the area but must not resize it: a shrunk
        // memfd would fault the manager's next read of it (SIGBUS).
        let file = sealed_memfd(name, (fixed + 2 * half) as u64)?;
        let map = memmap2::MmapRaw::map_raw(&file)?;
        let area = Area {
            map,
            req: Ring {
                off: fixed,
                cap: half,
            },
            rep: Ring {
                off: fixed + half,
                cap: half,
            },
            mailbox: AREA_HEADER_BYTES,
        };
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&AREA_MAGIC);
        h[8..12].copy_from_slice(&AREA_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(AREA_HEADER_BYTES as u32).to_le_bytes());
        for (i, v) in [
            area.req.off,
            area.req.cap,
            area.rep.off,
            area.rep.cap,
            area.mailbox,
            MAILBOX_SLOTS,
        ]
        .into_iter()
        .enumerate()
        {
            h[16 + 8 * i..24 + 8 * i].copy_from_slice(&(v as u64).to_le_bytes());
        }
        // SAFETY: the mapping is at least a header long; nobody else maps
        // it yet.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), area.map.as_mut_ptr(), h.len()) };
        Ok((file, area))
    }

    /// The client's side: maps the area the manager sent and checks its
    /// header against the mapping's size.
    pub fn open(file: &File) -> Result<Area, String> {
        let map = memmap2::MmapRaw::map_raw(file).map_err(|e| e.to_string())?;
        if map.len() < AREA_HEADER_BYTES {
            return Err("descriptor area smaller than its header".into());
        }
        let mut h = [0u8; 64];
        // SAFETY: the mapping is longer than 64 bytes.
        unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), h.as_mut_ptr(), h.len()) };
        if h[..8] != AREA_MAGIC || h[8..12] != AREA_VERSION.to_le_bytes() {
            return Err("descriptor area has a bad magic or version".into());
        }
        let f = |i: usize| u64::from_le_bytes(h[16 + 8 * i..24 + 8 * i].try_into().unwrap());
        let ring = |off: u64, cap: u64| -> Result<Ring, String> {
            let end = off.checked_add(cap).ok_or("ring overflows")?;
            if off < AREA_HEADER_BYTES as u64
                || end > map.len() as u64
                || !off.is_multiple_of(RECORD_ALIGN as u64)
                || !cap.is_multiple_of(RECORD_ALIGN as u64)
                || cap < 4096
            {
                return Err(format!("ring {off}+{cap} does not fit the area"));
            }
            Ok(Ring {
                off: off as usize,
                cap: cap as usize,
            })
        };
        let req = ring(f(0), f(1))?;
        let rep = ring(f(2), f(3))?;
        let (mailbox, slots) = (f(4), f(5));
        if slots != MAILBOX_SLOTS as u64
            || mailbox < AREA_HEADER_BYTES as u64
            || !mailbox.is_multiple_of(size_of::<HotResponse>() as u64)
            || mailbox.saturating_add(MAILBOX_BYTES as u64) > map.len() as u64
        {
            return Err(format!(
                "mailbox {mailbox} of {slots} slots does not fit the area"
            ));
        }
        Ok(Area {
            map,
            req,
            rep,
            mailbox: mailbox as usize,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        debug_assert!(at + 4 <= self.map.len() && at.is_multiple_of(4));
        // SAFETY: in bounds and aligned (callers pass header offsets or
        // validated record offsets); shared memory is accessed atomically.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(at) as *mut u32) }
    }

    /// The manager sets this before it blocks; a client that sent a request
    /// then signals the manager's [`WakeFd`].
    pub fn manager_sleeping(&self) -> &AtomicU32 {
        self.word(64)
    }

    /// The client sets this before it blocks; the manager that sent it a
    /// response then signals the client's [`WakeFd`].
    pub fn client_sleeping(&self) -> &AtomicU32 {
        self.word(128)
    }

    /// The client's count of the requests it sent on the connection's
    /// service, stored after each send: the manager asks the service only
    /// when it is ahead of its own count (and at times regardless).
    pub fn requests_sent(&self) -> &AtomicU64 {
        self.counter(320)
    }

    /// The client's count of the lookups it answered as misses from the
    /// presence filter, without sending them (the manager's metrics).
    pub fn answered_here(&self) -> &AtomicU64 {
        self.counter(384)
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at + 8 <= AREA_HEADER_BYTES && at.is_multiple_of(8));
        // SAFETY: a header offset (in bounds, 8-aligned in a page-aligned
        // mapping); shared memory is accessed atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(at) as *mut u64) }
    }

    /// The manager's side: puts `r` in the mailbox. `posted` is the
    /// manager's own count (never read back from shared memory, which the
    /// client can write). `false`: the client has not taken
    /// `MAILBOX_SLOTS` earlier responses (only a client past its request
    /// limits, or one lying about what it took, gets there); nothing was
    /// written.
    pub fn post(&self, posted: &mut u64, r: &HotResponse) -> bool {
        let taken = self.counter(256).load(Ordering::Acquire);
        if posted.wrapping_sub(taken) >= MAILBOX_SLOTS as u64 {
            return false;
        }
        let slot =
            self.mailbox + (*posted % MAILBOX_SLOTS as u64) as usize * size_of::<HotResponse>();
        // SAFETY: `mailbox + MAILBOX_BYTES <= len` (set at `create`), so
        // the slot is in bounds; the client reads it only after the store
        // below.
        unsafe {
            std::ptr::write_unaligned(self.map.as_mut_ptr().add(slot) as *mut HotResponse, *r)
        };
        *posted = posted.wrapping_add(1);
        self.counter(192).store(*posted, Ordering::Release);
        true
    }

    /// The client's side: the responses posted since `taken` (the client's
    /// own count), oldest first, handed to `each`; `taken` moves past them
    /// and the manager learns their slots are free. A manager claiming
    /// more than a mailbox of untaken responses is a protocol error.
    pub fn take(
        &self,
        taken: &mut u64,
        mut each: impl FnMut(HotResponse),
    ) -> Result<usize, HotError> {
        let posted = self.counter(192).load(Ordering::Acquire);
        let n = posted.wrapping_sub(*taken);
        if n == 0 {
            return Ok(0);
        }
        if n > MAILBOX_SLOTS as u64 {
            return Err(HotError::new(HotErrorCode::DescriptorBounds, posted));
        }
        for _ in 0..n {
            let slot =
                self.mailbox + (*taken % MAILBOX_SLOTS as u64) as usize * size_of::<HotResponse>();
            // SAFETY: the slot is in bounds (checked at `open`); any bit
            // pattern is a `HotResponse` (integers only), checked when
            // decoded.
            let r = unsafe {
                std::ptr::read_unaligned(self.map.as_ptr().add(slot) as *const HotResponse)
            };
            *taken = taken.wrapping_add(1);
            each(r);
        }
        self.counter(256).store(*taken, Ordering::Release);
        Ok(n as usize)
    }

    /// Validates `desc` against `ring` and copies its payload out. The
    /// record stays as it is (see [`Area::free`]).
    pub fn read(&self, ring: Ring, desc: &Desc, kind: u32) -> Result<Vec<u8>, HotError> {
        let mut out = Vec::new();
        self.read_into(ring, desc, kind, &mut out)?;
        Ok(out)
    }

    /// [`Area::read`] into `out` (replacing what it held), so a reader
    /// that keeps one buffer allocates nothing per part.
    pub fn read_into(
        &self,
        ring: Ring,
        desc: &Desc,
        kind: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), HotError> {
        out.clear();
        let off = desc.offset as usize;
        let bounds = HotError::new(HotErrorCode::DescriptorBounds, desc.offset as u64);
        if !off.is_multiple_of(RECORD_ALIGN)
            || off.checked_add(RECORD_HEADER).is_none_or(|e| e > ring.cap)
        {
            return Err(bounds);
        }
        if desc.len as usize > ring.cap - off - RECORD_HEADER {
            return Err(bounds);
        }
        let at = ring.off + off;
        let state = self.word(at).load(Ordering::Acquire);
        let mut h = [0u8; 12];
        // SAFETY: `at + 16 <= ring end <= mapping end` (checked above).
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(at + 4), h.as_mut_ptr(), 12) };
        let generation = u32::from_le_bytes(h[0..4].try_into().unwrap());
        let len = u32::from_le_bytes(h[4..8].try_into().unwrap());
        let rkind = u32::from_le_bytes(h[8..12].try_into().unwrap());
        if state != REC_FULL || generation != desc.generation {
            return Err(HotError::new(
                HotErrorCode::DescriptorGeneration,
                desc.generation as u64,
            ));
        }
        if len != desc.len || rkind != desc.kind || desc.kind != kind {
            return Err(HotError::new(
                HotErrorCode::DescriptorMismatch,
                desc.len as u64,
            ));
        }
        let len = desc.len as usize;
        out.reserve(len);
        // SAFETY: `at + 16 + len <= ring end` (checked above), and `out`
        // has room for `len` bytes, which the copy initialises before the
        // length covers them. The peer may write concurrently; the copy is
        // parsed, never trusted.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(at + RECORD_HEADER),
                out.as_mut_ptr(),
                len,
            );
            out.set_len(len);
        }
        Ok(())
    }

    /// Marks a record read (its writer may reuse the space). Ignores
    /// descriptors that do not name a live record.
    pub fn free(&self, ring: Ring, desc: &Desc) {
        let off = desc.offset as usize;
        if desc.is_empty() || !off.is_multiple_of(RECORD_ALIGN) || off + RECORD_HEADER > ring.cap {
            return;
        }
        // Only the record the descriptor names (its generation and length).
        let mut h = [0u8; 8];
        // SAFETY: the header lies inside the ring (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(ring.off + off + 4),
                h.as_mut_ptr(),
                8,
            )
        };
        if h[0..4] != desc.generation.to_le_bytes() || h[4..8] != desc.len.to_le_bytes() {
            return;
        }
        let _ = self.word(ring.off + off).compare_exchange(
            REC_FULL,
            REC_FREED,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// The writer's side of a ring: where the next record goes, and the records
/// not yet freed by the reader (their sizes are kept here, never read back
/// from shared memory).
pub struct RingWriter {
    ring: Ring,
    head: u64,
    records: VecDeque<(u64, u64)>,
}

impl RingWriter {
    pub fn new(ring: Ring) -> RingWriter {
        RingWriter {
            ring,
            head: 0,
            records: VecDeque::new(),
        }
    }

    fn tail(&self) -> u64 {
        self.records.front().map_or(self.head, |r| r.0)
    }

    /// Drops freed records from the front.
    fn reclaim(&mut self, area: &Area) {
        while let Some(&(pos, _)) = self.records.front() {
            let at = self.ring.off + (pos % self.ring.cap as u64) as usize;
            match area.word(at).load(Ordering::Acquire) {
                REC_FREED | REC_PAD => {
                    self.records.pop_front();
                }
                _ => break,
            }
        }
    }

    fn room(&mut self, area: &Area, need: u64) -> bool {
        if self.head + need - self.tail() <= self.ring.cap as u64 {
            return true;
        }
        self.reclaim(area);
        self.head + need - self.tail() <= self.ring.cap as u64
    }

    /// Bytes of records written and not yet freed.
    pub fn in_use(&self) -> u64 {
        self.head - self.tail()
    }

    /// Writes one record; `None` when the ring has no room (the caller
    /// falls back to the socket). Empty parts get the empty descriptor.
    pub fn write(&mut self, area: &Area, kind: u32, bytes: &[u8]) -> Option<Desc> {
        if bytes.is_empty() {
            return Some(Desc::default());
        }
        let cap = self.ring.cap as u64;
        let need = (RECORD_HEADER + bytes.len().next_multiple_of(RECORD_ALIGN)) as u64;
        if need > cap || bytes.len() > u32::MAX as usize {
            return None;
        }
        let off = self.head % cap;
        if off + need > cap {
            // Pad to the ring's end; the record starts the next lap.
            let pad = cap - off;
            if !self.room(area, pad + need) {
                return None;
            }
            let at = self.ring.off + off as usize;
            self.write_header(
                area,
                at,
                0,
                (pad as usize - RECORD_HEADER) as u32,
                part::PAD,
            );
            area.word(at).store(REC_PAD, Ordering::Release);
            self.records.push_back((self.head, pad));
            self.head += pad;
        } else if !self.room(area, need) {
            return None;
        }
        let off = (self.head % cap) as usize;
        let generation = ((self.head / cap) % 0xffff_fffe) as u32 + 1;
        let at = self.ring.off + off;
        // SAFETY: `off + need <= cap`: the record lies inside the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                area.map.as_mut_ptr().add(at + RECORD_HEADER),
                bytes.len(),
            )
        };
        self.write_header(area, at, generation, bytes.len() as u32, kind);
        area.word(at).store(REC_FULL, Ordering::Release);
        self.records.push_back((self.head, need));
        self.head += need;
        Some(Desc {
            offset: off as u32,
            len: bytes.len() as u32,
            generation,
            kind,
        })
    }

    fn write_header(&self, area: &Area, at: usize, generation: u32, len: u32, kind: u32) {
        let mut h = [0u8; 12];
        h[0..4].copy_from_slice(&generation.to_le_bytes());
        h[4..8].copy_from_slice(&len.to_le_bytes());
        h[8..12].copy_from_slice(&kind.to_le_bytes());
        // SAFETY: the header lies inside the ring (callers checked).
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), area.map.as_mut_ptr().add(at + 4), 12) };
    }

    /// Frees a record this writer wrote (a request the reader never got).
    pub fn release(&mut self, area: &Area, desc: &Desc) {
        area.free(self.ring, desc);
    }
}

// ---------------------------------------------------------------------------
// Parts: little-endian, 8-byte aligned fields.

#[derive(Default)]
struct Put(Vec<u8>);

impl Put {
    /// A part of exactly `n` bytes is about to be written: one allocation,
    /// never a regrowth.
    fn with_capacity(n: usize) -> Put {
        Put(Vec::with_capacity(n))
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn pad8(&mut self) -> &mut Self {
        while !self.0.len().is_multiple_of(8) {
            self.0.push(0);
        }
        self
    }
}

struct Get<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Get<'a> {
    fn new(b: &'a [u8]) -> Self {
        Get { b, at: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], HotError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| bad_part(self.at as u64))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, HotError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, HotError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn pad8(&mut self) -> Result<(), HotError> {
        let n = self.at.next_multiple_of(8) - self.at;
        self.take(n).map(|_| ())
    }
    fn done(&self) -> bool {
        self.at == self.b.len()
    }
    /// How many `stride`-byte elements remain; the remainder must be whole.
    fn count(&self, stride: usize) -> Result<usize, HotError> {
        let rest = self.b.len() - self.at;
        if !rest.is_multiple_of(stride) {
            return Err(bad_part(rest as u64));
        }
        Ok(rest / stride)
    }
}

/// All hashes in a list have one length (the hot encoding's assumption);
/// `None` otherwise or when empty.
fn uniform_hash_len<'a>(mut hashes: impl Iterator<Item = &'a NativeHash>) -> Option<usize> {
    let first = hashes.next()?.as_bytes().len();
    hashes.all(|h| h.as_bytes().len() == first).then_some(first)
}

fn hash(bytes: &[u8]) -> Result<NativeHash, HotError> {
    NativeHash::new(bytes).map_err(|_| bad_part(bytes.len() as u64))
}

fn encode_groups(groups: &[GroupHashes]) -> Option<Vec<u8>> {
    let bytes = groups
        .iter()
        .map(|g| 16 + g.hashes.iter().map(|h| h.as_bytes().len()).sum::<usize>() + 7)
        .sum();
    let mut p = Put::with_capacity(bytes);
    for g in groups {
        let len = if g.hashes.is_empty() {
            1
        } else {
            uniform_hash_len(g.hashes.iter())?
        };
        p.u32(g.group)
            .u32(g.hashes.len() as u32)
            .u32(len as u32)
            .u32(0);
        for h in &g.hashes {
            p.bytes(h.as_bytes());
        }
        p.pad8();
    }
    Some(p.0)
}

fn decode_groups(b: &[u8]) -> Result<Vec<GroupHashes>, HotError> {
    let mut g = Get::new(b);
    let mut out = Vec::new();
    while !g.done() {
        let group = g.u32()?;
        let count = g.u32()? as usize;
        let len = g.u32()? as usize;
        g.u32()?;
        if len == 0 || len > orbitkv_components::key::MAX_NATIVE_HASH_BYTES {
            return Err(bad_part(len as u64));
        }
        let bytes = g.take(
            count
                .checked_mul(len)
                .ok_or_else(|| bad_part(count as u64))?,
        )?;
        // Sized once: collecting `Result`s loses the length, and a
        // growing vector of 65-byte hashes reallocates (a fifth of a hot
        // lookup's decoding). `count` is bounded by the bytes just taken.
        let mut hashes = Vec::with_capacity(count);
        for h in bytes.chunks_exact(len) {
            hashes.push(hash(h)?);
        }
        g.pad8()?;
        out.push(GroupHashes { group, hashes });
    }
    Ok(out)
}

fn encode_publish(pages: &[PublishPage]) -> Option<Vec<u8>> {
    let len = if pages.is_empty() {
        1
    } else {
        uniform_hash_len(pages.iter().map(|p| &p.hash))?
    };
    let mut p = Put::with_capacity(8 + pages.len() * (16 + len.next_multiple_of(8)));
    p.u32(len as u32).u32(pages.len() as u32);
    for pg in pages {
        p.u32(pg.rank)
            .u32(pg.group)
            .u64(pg.device_page)
            .bytes(pg.hash.as_bytes())
            .pad8();
    }
    Some(p.0)
}

fn decode_publish(b: &[u8]) -> Result<Vec<PublishPage>, HotError> {
    let mut g = Get::new(b);
    let len = g.u32()? as usize;
    let count = g.u32()? as usize;
    if len == 0 || len > orbitkv_components::key::MAX_NATIVE_HASH_BYTES {
        return Err(bad_part(len as u64));
    }
    let stride = 16 + len.next_multiple_of(8);
    if g.count(stride)? != count {
        return Err(bad_part(count as u64));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let rank = g.u32()?;
        let group = g.u32()?;
        let device_page = g.u64()?;
        let h = hash(g.take(len)?)?;
        g.pad8()?;
        out.push(PublishPage {
            rank,
            group,
            hash: h,
            device_page,
        });
    }
    Ok(out)
}

fn encode_targets(targets: &[RestoreTarget]) -> Vec<u8> {
    let mut p = Put::with_capacity(24 * targets.len());
    for t in targets {
        p.u32(t.pos.rank)
            .u32(t.pos.group)
            .u64(t.pos.page_end)
            .u64(t.device_page);
    }
    p.0
}

fn decode_targets(b: &[u8]) -> Result<Vec<RestoreTarget>, HotError> {
    let mut g = Get::new(b);
    (0..g.count(24)?)
        .map(|_| {
            Ok(RestoreTarget {
                pos: PagePos {
                    rank: g.u32()?,
                    group: g.u32()?,
                    page_end: g.u64()?,
                },
                device_page: g.u64()?,
            })
        })
        .collect()
}

/// A load's plan: rank and target counts (u32 each), the ranks, padding
/// to 8, the targets, then the retained positions to the part's end.
fn encode_load(ranks: &[u32], targets: &[RestoreTarget], retained: &[PagePos]) -> Option<Vec<u8>> {
    let n_ranks = u32::try_from(ranks.len()).ok()?;
    let n_targets = u32::try_from(targets.len()).ok()?;
    let bytes =
        8 + (4 * ranks.len()).next_multiple_of(8) + 24 * targets.len() + 16 * retained.len();
    let mut p = Put::with_capacity(bytes);
    p.u32(n_ranks).u32(n_targets);
    for r in ranks {
        p.u32(*r);
    }
    p.pad8();
    p.bytes(&encode_targets(targets));
    p.bytes(&encode_positions(retained));
    Some(p.0)
}

type LoadParts = (Vec<u32>, Vec<RestoreTarget>, Vec<PagePos>);

fn decode_load(b: &[u8]) -> Result<LoadParts, HotError> {
    let mut g = Get::new(b);
    let n_ranks = g.u32()? as usize;
    let n_targets = g.u32()? as usize;
    let ranks = (0..n_ranks.min(b.len() / 4))
        .map(|_| g.u32())
        .collect::<Result<Vec<_>, _>>()?;
    if ranks.len() != n_ranks {
        return Err(bad_part(n_ranks as u64));
    }
    g.pad8()?;
    let target_bytes = n_targets
        .checked_mul(24)
        .ok_or_else(|| bad_part(n_targets as u64))?;
    let targets = decode_targets(g.take(target_bytes)?)?;
    let retained = decode_positions(g.take(b.len() - g.at)?)?;
    Ok((ranks, targets, retained))
}

fn encode_positions(pos: &[PagePos]) -> Vec<u8> {
    let mut p = Put::with_capacity(16 * pos.len());
    for x in pos {
        p.u32(x.rank).u32(x.group).u64(x.page_end);
    }
    p.0
}

fn decode_positions(b: &[u8]) -> Result<Vec<PagePos>, HotError> {
    let mut g = Get::new(b);
    (0..g.count(16)?)
        .map(|_| {
            Ok(PagePos {
                rank: g.u32()?,
                group: g.u32()?,
                page_end: g.u64()?,
            })
        })
        .collect()
}

fn encode_u64s(xs: &[u64]) -> Vec<u8> {
    let mut p = Put::with_capacity(8 * xs.len());
    for x in xs {
        p.u64(*x);
    }
    p.0
}

fn decode_u64s(b: &[u8]) -> Result<Vec<u64>, HotError> {
    if !b.len().is_multiple_of(8) {
        return Err(bad_part(b.len() as u64));
    }
    // Exact-size chunks: the vector is sized once (collecting fallible
    // reads cannot know the count and grows as it goes).
    Ok(b.chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect())
}

fn encode_candidates(c: &[Candidates]) -> Vec<u8> {
    let mut p = Put::with_capacity(c.iter().map(|x| 16 + 8 * x.page_ends.len()).sum());
    for x in c {
        p.u32(x.rank)
            .u32(x.group)
            .u32(x.page_ends.len() as u32)
            .u32(0);
        for e in &x.page_ends {
            p.u64(*e);
        }
    }
    p.0
}

fn decode_candidates(b: &[u8]) -> Result<Vec<Candidates>, HotError> {
    let mut g = Get::new(b);
    let mut out = Vec::new();
    while !g.done() {
        let rank = g.u32()?;
        let group = g.u32()?;
        let n = g.u32()? as usize;
        g.u32()?;
        let ends = g.take(n.checked_mul(8).ok_or_else(|| bad_part(n as u64))?)?;
        out.push(Candidates {
            rank,
            group,
            page_ends: decode_u64s(ends)?,
        });
    }
    Ok(out)
}

fn encode_ranges(r: &[(u32, RequiredRange)]) -> Vec<u8> {
    let mut p = Put::with_capacity(24 * r.len());
    for (rank, x) in r {
        p.u32(*rank).u32(x.group).u64(x.start).u64(x.end);
    }
    p.0
}

fn decode_ranges(b: &[u8]) -> Result<Vec<(u32, RequiredRange)>, HotError> {
    let mut g = Get::new(b);
    (0..g.count(24)?)
        .map(|_| {
            let rank = g.u32()?;
            Ok((
                rank,
                RequiredRange {
                    group: g.u32()?,
                    start: g.u64()?,
                    end: g.u64()?,
                },
            ))
        })
        .collect()
}

fn encode_leases(l: &[LeaseInfo]) -> Vec<u8> {
    let mut p = Put::with_capacity(56 * l.len());
    for x in l {
        p.u64(x.lease)
            .u32(x.pos.rank)
            .u32(x.pos.group)
            .u64(x.pos.page_end)
            .u64(x.bytes)
            .u64(x.slot)
            .u64(x.offset)
            .u64(x.checksum);
    }
    p.0
}

fn decode_leases(b: &[u8]) -> Result<Vec<LeaseInfo>, HotError> {
    let mut g = Get::new(b);
    (0..g.count(56)?)
        .map(|_| {
            Ok(LeaseInfo {
                lease: g.u64()?,
                pos: PagePos {
                    rank: g.u32()?,
                    group: g.u32()?,
                    page_end: g.u64()?,
                },
                bytes: g.u64()?,
                slot: g.u64()?,
                offset: g.u64()?,
                checksum: g.u64()?,
            })
        })
        .collect()
}

fn encode_namespaces(ns: &[Namespace]) -> Vec<u8> {
    ns.iter().flat_map(|n| n.0).collect()
}

fn decode_namespaces(b: &[u8]) -> Result<Vec<Namespace>, HotError> {
    if !b.len().is_multiple_of(32) {
        return Err(bad_part(b.len() as u64));
    }
    Ok(b.chunks_exact(32)
        .map(|c| Namespace(c.try_into().unwrap()))
        .collect())
}

fn miss_code(m: Option<MissReason>) -> u32 {
    m.map_or(0, |r| {
        MissReason::ALL.iter().position(|x| *x == r).unwrap() as u32 + 1
    })
}

fn miss_from(code: u32) -> Result<Option<MissReason>, HotError> {
    match code {
        0 => Ok(None),
        c => MissReason::ALL
            .get(c as usize - 1)
            .copied()
            .map(Some)
            .ok_or_else(|| bad_part(c as u64)),
    }
}

fn session_words(s: &SessionHandle) -> [u64; 3] {
    [s.id, s.epoch, s.incarnation]
}

fn session_of(w: [u64; 3]) -> SessionHandle {
    SessionHandle {
        id: w[0],
        epoch: w[1],
        incarnation: w[2],
    }
}

/// A message's encoded parts (at most three per message, the most any
/// encoding fills; the list lives on the stack, not in an allocation).
#[derive(Default)]
struct Parts {
    n: usize,
    p: [(u32, Vec<u8>); 3],
}

impl Parts {
    fn push(&mut self, part: (u32, Vec<u8>)) {
        debug_assert!(self.n < self.p.len(), "a message has at most three parts");
        if let Some(slot) = self.p.get_mut(self.n) {
            *slot = part;
            self.n += 1;
        }
    }

    fn as_slice(&self) -> &[(u32, Vec<u8>)] {
        &self.p[..self.n]
    }
}

/// Whether `command` has a hot encoding at all.
pub fn is_hot(command: &Command) -> bool {
    matches!(
        command,
        Command::Query { .. }
            | Command::Lookup { .. }
            | Command::Load { .. }
            | Command::Prepare { .. }
            | Command::Restore { .. }
            | Command::Publish { .. }
            | Command::Release { .. }
            | Command::Cancel { .. }
    )
}

/// Encodes a hot command, writing its large parts to the request ring.
/// `None`: not a hot command, a shape the encoding does not carry (hashes
/// of mixed lengths), or no room in the ring; send it on the socket. On
/// `None` nothing stays allocated.
pub fn encode_request(
    command: &Command,
    token: u64,
    tag: u64,
    area: &Area,
    w: &mut RingWriter,
) -> Option<HotRequest> {
    let mut r = HotRequest {
        magic: HOT_MAGIC,
        token,
        tag,
        ..HotRequest::default()
    };
    let mut parts = Parts::default();
    match command {
        Command::Query {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
            prepare,
            speculative,
        } => {
            let q = (session, *request, groups.as_slice(), *origin, *prompt_len);
            query_head(&mut r, &mut parts, Op::Query, q, expect_namespaces)?;
            r.flags = if *prepare { REQ_PREPARE } else { 0 }
                | if *speculative { REQ_SPECULATIVE } else { 0 };
        }
        Command::Lookup {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
        } => {
            let q = (session, *request, groups.as_slice(), *origin, *prompt_len);
            query_head(&mut r, &mut parts, Op::Lookup, q, expect_namespaces)?;
        }
        Command::Load {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
            ranks,
            targets,
            retained,
            handoff: None,
        } => {
            let q = (session, *request, groups.as_slice(), *origin, *prompt_len);
            query_head(&mut r, &mut parts, Op::Load, q, expect_namespaces)?;
            parts.push((part::LOAD, encode_load(ranks, targets, retained)?));
        }
        Command::Prepare { session, operation }
        | Command::Release { session, operation }
        | Command::Cancel { session, operation } => {
            r.op = match command {
                Command::Prepare { .. } => Op::Prepare,
                Command::Release { .. } => Op::Release,
                _ => Op::Cancel,
            } as u32;
            r.session = session_words(session);
            r.a = *operation;
        }
        Command::Restore {
            session,
            operation,
            targets,
            retained,
        } => {
            r.op = Op::Restore as u32;
            r.session = session_words(session);
            r.a = *operation;
            parts.push((part::TARGETS, encode_targets(targets)));
            parts.push((part::RETAINED, encode_positions(retained)));
        }
        Command::Publish {
            session,
            request,
            pages,
        } => {
            r.op = Op::Publish as u32;
            r.session = session_words(session);
            r.a = *request;
            parts.push((part::PUBLISH, encode_publish(pages)?));
        }
        _ => return None,
    }
    for (i, (kind, bytes)) in parts.as_slice().iter().enumerate() {
        match w.write(area, *kind, bytes) {
            Some(d) => r.parts[i] = d,
            None => {
                for d in &r.parts[..i] {
                    w.release(area, d);
                }
                return None;
            }
        }
    }
    Some(r)
}

/// A query's session, request, groups, origin and prompt length.
type QueryFields<'a> = (&'a SessionHandle, u64, &'a [GroupHashes], u64, u64);

/// The fields every query-like command (query, lookup, load) shares: the
/// message's words and its first two parts (groups, namespaces).
fn query_head(
    r: &mut HotRequest,
    parts: &mut Parts,
    op: Op,
    (session, request, groups, origin, prompt_len): QueryFields,
    namespaces: &[Namespace],
) -> Option<()> {
    r.op = op as u32;
    r.session = session_words(session);
    r.a = request;
    r.origin = origin;
    r.prompt_len = prompt_len;
    parts.push((part::GROUPS, encode_groups(groups)?));
    parts.push((part::NAMESPACES, encode_namespaces(namespaces)));
    Some(())
}

/// The manager's side: a hot request back into a command, validating every
/// descriptor against the connection's request ring.
pub fn decode_request(r: &HotRequest, area: &Area) -> Result<Command, HotError> {
    decode_request_with(r, area, &mut Vec::new())
}

/// [`decode_request`], each part copied into `buf` (which the caller keeps
/// from request to request) before it is parsed.
pub fn decode_request_with(
    r: &HotRequest,
    area: &Area,
    buf: &mut Vec<u8>,
) -> Result<Command, HotError> {
    let ring = area.req;
    // A part's bytes, copied out of the ring; empty for an empty part.
    fn read<'b>(
        area: &Area,
        ring: Ring,
        d: &Desc,
        kind: u32,
        buf: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], HotError> {
        if d.is_empty() {
            buf.clear();
        } else {
            area.read_into(ring, d, kind, buf)?;
        }
        Ok(&buf[..])
    }
    let session = session_of(r.session);
    let op = Op::from_u32(r.op).ok_or(HotError::new(HotErrorCode::UnknownOp, r.op as u64))?;
    Ok(match op {
        Op::Query => Command::Query {
            session,
            request: r.a,
            groups: decode_groups(read(area, ring, &r.parts[0], part::GROUPS, buf)?)?,
            origin: r.origin,
            prompt_len: r.prompt_len,
            expect_namespaces: decode_namespaces(read(
                area,
                ring,
                &r.parts[1],
                part::NAMESPACES,
                buf,
            )?)?,
            prepare: r.flags & REQ_PREPARE != 0,
            speculative: r.flags & REQ_SPECULATIVE != 0,
        },
        Op::Lookup => Command::Lookup {
            session,
            request: r.a,
            groups: decode_groups(read(area, ring, &r.parts[0], part::GROUPS, buf)?)?,
            origin: r.origin,
            prompt_len: r.prompt_len,
            expect_namespaces: decode_namespaces(read(
                area,
                ring,
                &r.parts[1],
                part::NAMESPACES,
                buf,
            )?)?,
        },
        Op::Load => {
            let (ranks, targets, retained) =
                decode_load(read(area, ring, &r.parts[2], part::LOAD, buf)?)?;
            Command::Load {
                session,
                request: r.a,
                groups: decode_groups(read(area, ring, &r.parts[0], part::GROUPS, buf)?)?,
                origin: r.origin,
                prompt_len: r.prompt_len,
                expect_namespaces: decode_namespaces(read(
                    area,
                    ring,
                    &r.parts[1],
                    part::NAMESPACES,
                    buf,
                )?)?,
                ranks,
                targets,
                retained,
                handoff: None,
            }
        }
        Op::Prepare => Command::Prepare {
            session,
            operation: r.a,
        },
        Op::Release => Command::Release {
            session,
            operation: r.a,
        },
        Op::Cancel => Command::Cancel {
            session,
            operation: r.a,
        },
        Op::Restore => Command::Restore {
            session,
            operation: r.a,
            targets: decode_targets(read(area, ring, &r.parts[0], part::TARGETS, buf)?)?,
            retained: decode_positions(read(area, ring, &r.parts[1], part::RETAINED, buf)?)?,
        },
        Op::Publish => {
            let b = read(area, ring, &r.parts[0], part::PUBLISH, buf)?;
            Command::Publish {
                session,
                request: r.a,
                pages: if b.is_empty() {
                    Vec::new()
                } else {
                    decode_publish(b)?
                },
            }
        }
    })
}

/// A response with no event: accepted, refused, or a hot error.
pub fn response(kind: RespKind, tag: u64, command: u64) -> HotResponse {
    HotResponse {
        magic: HOT_MAGIC,
        kind: kind as u32,
        tag,
        command,
        ..HotResponse::default()
    }
}

pub fn error_response(tag: u64, e: HotError) -> HotResponse {
    HotResponse {
        code: e.code as u32,
        a: e.detail,
        flags: RESP_LAST,
        ..response(RespKind::Error, tag, 0)
    }
}

/// The manager's side: an event as a response, its large parts written to
/// the reply ring. `None` when the ring has no room (the event goes on the
/// socket instead); nothing stays allocated then.
pub fn encode_event(
    e: &Event,
    tag: u64,
    command: u64,
    area: &Area,
    w: &mut RingWriter,
) -> Option<HotResponse> {
    let mut r = response(RespKind::EventJson, tag, command);
    let mut parts = Parts::default();
    match e {
        Event::QueryResult {
            command,
            request,
            operation,
            candidates,
            common,
            selected,
            miss,
        } => {
            r.kind = RespKind::QueryResult as u32;
            r.command = *command;
            r.a = *operation;
            r.b = *request;
            if let Some(s) = selected {
                r.c = *s;
                r.flags |= RESP_SELECTED;
            }
            r.code = miss_code(*miss);
            parts.push((part::CANDIDATES, encode_candidates(candidates)));
            parts.push((part::COMMON, encode_u64s(common)));
        }
        Event::Loading { operation } => {
            r.kind = RespKind::Loading as u32;
            r.a = *operation;
        }
        Event::Ready {
            operation,
            boundary,
            ranges,
            leases,
            pages_from_dram,
            pages_from_tiers,
        } => {
            r.kind = RespKind::Ready as u32;
            r.a = *operation;
            r.b = *boundary;
            r.c = *pages_from_dram;
            r.d = *pages_from_tiers;
            parts.push((part::RANGES, encode_ranges(ranges)));
            parts.push((part::LEASES, encode_leases(leases)));
        }
        Event::Miss { operation, reason } => {
            r.kind = RespKind::Miss as u32;
            r.a = *operation;
            r.code = miss_code(Some(*reason));
        }
        Event::RestoreDone {
            operation,
            pages,
            bytes,
        } => {
            r.kind = RespKind::RestoreDone as u32;
            r.a = *operation;
            r.b = *pages;
            r.c = *bytes;
        }
        Event::PublishDone {
            command,
            request,
            inserted,
            duplicates,
            dropped,
        } => {
            r.kind = RespKind::PublishDone as u32;
            r.command = *command;
            r.b = *request;
            r.c = *inserted;
            r.d = *duplicates;
            r.e = *dropped;
        }
        Event::Released { operation } => {
            r.kind = RespKind::Released as u32;
            r.a = *operation;
        }
        other => {
            if let Some(c) = other.command() {
                r.command = c;
            }
            parts.push((
                part::JSON,
                serde_json::to_vec(other).expect("events serialize"),
            ));
        }
    }
    for (i, (kind, bytes)) in parts.as_slice().iter().enumerate() {
        match w.write(area, *kind, bytes) {
            Some(d) => r.parts[i] = d,
            None => {
                for d in &r.parts[..i] {
                    w.release(area, d);
                }
                return None;
            }
        }
    }
    Some(r)
}

/// A refusal (`Refused`): the error's JSON in the reply ring.
pub fn encode_refusal(
    tag: u64,
    error: &CommandError,
    area: &Area,
    w: &mut RingWriter,
) -> Option<HotResponse> {
    let mut r = response(RespKind::Refused, tag, 0);
    r.flags = RESP_LAST;
    r.parts[0] = w.write(
        area,
        part::JSON,
        &serde_json::to_vec(error).expect("errors serialize"),
    )?;
    Some(r)
}

/// What one response says, decoded on the client's side.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Accepted,
    Refused(CommandError),
    Error(HotError),
    Event(Event),
}

/// The client's side: decodes a response, copying its parts out of the
/// reply ring and freeing them. A response that does not parse is an
/// error the caller reports (the manager is the one at fault).
pub fn decode_response(r: &HotResponse, area: &Area) -> Result<Reply, HotError> {
    decode_response_with(r, area, &mut Vec::new())
}

/// [`decode_response`], each part copied into `buf` (which the caller
/// keeps from response to response) before it is parsed.
pub fn decode_response_with(
    r: &HotResponse,
    area: &Area,
    buf: &mut Vec<u8>,
) -> Result<Reply, HotError> {
    let ring = area.rep;
    // A part's bytes, copied out of the ring, whose record is freed
    // either way; empty for an empty part.
    fn read<'b>(
        area: &Area,
        ring: Ring,
        d: &Desc,
        kind: u32,
        buf: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], HotError> {
        buf.clear();
        if d.is_empty() {
            return Ok(&buf[..]);
        }
        let read = area.read_into(ring, d, kind, buf);
        area.free(ring, d);
        read.map(|()| &buf[..])
    }
    if r.magic != HOT_MAGIC {
        return Err(HotError::new(HotErrorCode::BadMagic, r.magic as u64));
    }
    let kind = RespKind::from_u32(r.kind).ok_or(bad_part(r.kind as u64))?;
    fn json<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, HotError> {
        serde_json::from_slice(b).map_err(|_| bad_part(b.len() as u64))
    }
    Ok(match kind {
        RespKind::Accepted => Reply::Accepted,
        RespKind::Refused => Reply::Refused(json(read(area, ring, &r.parts[0], part::JSON, buf)?)?),
        RespKind::Error => Reply::Error(HotError::new(HotErrorCode::from_u32(r.code), r.a)),
        RespKind::EventJson => Reply::Event(json(read(area, ring, &r.parts[0], part::JSON, buf)?)?),
        RespKind::QueryResult => Reply::Event(Event::QueryResult {
            command: r.command,
            request: r.b,
            operation: r.a,
            candidates: decode_candidates(read(area, ring, &r.parts[0], part::CANDIDATES, buf)?)?,
            common: decode_u64s(read(area, ring, &r.parts[1], part::COMMON, buf)?)?,
            selected: (r.flags & RESP_SELECTED != 0).then_some(r.c),
            miss: miss_from(r.code)?,
        }),
        RespKind::Loading => Reply::Event(Event::Loading { operation: r.a }),
        RespKind::Ready => Reply::Event(Event::Ready {
            operation: r.a,
            boundary: r.b,
            ranges: decode_ranges(read(area, ring, &r.parts[0], part::RANGES, buf)?)?,
            leases: decode_leases(read(area, ring, &r.parts[1], part::LEASES, buf)?)?,
            pages_from_dram: r.c,
            pages_from_tiers: r.d,
        }),
        RespKind::Miss => Reply::Event(Event::Miss {
            operation: r.a,
            reason: miss_from(r.code)?.ok_or(bad_part(0))?,
        }),
        RespKind::RestoreDone => Reply::Event(Event::RestoreDone {
            operation: r.a,
            pages: r.b,
            bytes: r.c,
        }),
        RespKind::PublishDone => Reply::Event(Event::PublishDone {
            command: r.command,
            request: r.b,
            inserted: r.c,
            duplicates: r.d,
            dropped: r.e,
        }),
        RespKind::Released => Reply::Event(Event::Released { operation: r.a }),
    })
}

// ---------------------------------------------------------------------------
// Files iceoryx2 leaves behind.

/// The iceoryx2 root directory (`/tmp/iceoryx2` unless configured).
pub fn iox_root() -> std::path::PathBuf {
    let c = iceoryx2::config::Config::default();
    std::path::PathBuf::from(c.global.root_path().to_string())
}

/// Every path of `/dev/shm` and the iceoryx2 root whose name starts with
/// `prefix` (node directories count when they hold such files).
pub fn files_with_prefix(prefix: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let scan = |dir: &Path, out: &mut Vec<std::path::PathBuf>| {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(prefix) {
                    out.push(e.path());
                }
            }
        }
    };
    scan(Path::new("/dev/shm"), &mut out);
    let root = iox_root();
    scan(&root, &mut out);
    scan(&root.join("services"), &mut out);
    let nodes = root.join("nodes");
    scan(&nodes, &mut out);
    if let Ok(rd) = std::fs::read_dir(&nodes) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                scan(&e.path(), &mut out);
            }
        }
    }
    out
}

/// Removes an incarnation's files (after its manager and clients dropped
/// their ports, or died), and node directories left empty.
pub fn remove_files_with_prefix(prefix: &str) -> usize {
    let files = files_with_prefix(prefix);
    let mut removed = 0;
    for f in &files {
        if std::fs::remove_file(f).is_ok() {
            removed += 1;
        }
        if let Some(dir) = f.parent()
            && dir.parent().is_some_and(|p| p.ends_with("nodes"))
        {
            // An empty node directory goes too (fails while not empty).
            let _ = std::fs::remove_dir(dir);
        }
    }
    removed
}

/// Makes every file of an incarnation owner-only (mode 0600): iceoryx2
/// creates its shared management segment writable by everyone, and no
/// other uid may touch a hot path that carries another user's commands.
/// Returns the files that still allow others any access.
pub fn restrict_files_with_prefix(prefix: &str) -> Vec<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut open = Vec::new();
    for f in files_with_prefix(prefix) {
        let Ok(meta) = std::fs::symlink_metadata(&f) else {
            continue; // removed meanwhile
        };
        if meta.is_dir() || meta.file_type().is_symlink() {
            continue;
        }
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0
            && std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode & 0o700)).is_err()
        {
            open.push(f);
        }
    }
    open
}

/// The incarnation prefixes (`iox2_okv<16 hex>_`) that have files here.
pub fn incarnation_prefixes() -> Vec<String> {
    let mut found = std::collections::BTreeSet::new();
    for f in files_with_prefix("iox2_okv") {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name
            && name.len() >= 25
            && name.as_bytes().get(24) == Some(&b'_')
            && name
                .get(8..24)
                .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            && let Some(p) = name.get(..25)
        {
            found.insert(p.to_owned());
        }
    }
    found.into_iter().collect()
}

/// Removes the leftovers of incarnations none of whose iceoryx2 nodes is
/// alive (a manager that crashed, and its clients gone). Incarnations with
/// a live node (another manager, on another socket) are left alone, and so
/// are files without any node that are younger than a few seconds (an
/// incarnation starting right now).
/// The dead nodes under `config`'s prefix (a crashed process's, not yet
/// released).
pub fn dead_nodes(config: &iceoryx2::config::Config) -> usize {
    let mut dead = 0;
    let _ = iceoryx2::node::Node::<Ipc>::list(config, |state| {
        dead += usize::from(matches!(state, iceoryx2::node::NodeState::Dead(_)));
        iceoryx2::prelude::CallbackProgression::Continue
    });
    dead
}

/// Releases what the dead nodes under `config`'s prefix hold (a crashed
/// client's node and its share of the services it used); returns how many
/// were found dead.
pub fn remove_dead_nodes(config: &iceoryx2::config::Config) -> usize {
    let mut dead = 0;
    let _ = iceoryx2::node::Node::<Ipc>::list(config, |state| {
        if let iceoryx2::node::NodeState::Dead(view) = state {
            dead += 1;
            let _ = view.try_remove_stale_resources();
        }
        iceoryx2::prelude::CallbackProgression::Continue
    });
    dead
}

pub fn cleanup_stale(except: &str) -> usize {
    let mut removed = 0;
    for prefix in incarnation_prefixes() {
        if prefix == except {
            continue;
        }
        let Ok(config) = iox_config(&prefix) else {
            continue;
        };
        let (mut alive, mut dead) = (false, 0);
        let _ = iceoryx2::node::Node::<Ipc>::list(&config, |state| {
            match state {
                iceoryx2::node::NodeState::Dead(view) => {
                    dead += 1;
                    let _ = view.try_remove_stale_resources();
                }
                _ => alive = true,
            }
            iceoryx2::prelude::CallbackProgression::Continue
        });
        let settled = || {
            files_with_prefix(&prefix).iter().all(|f| {
                std::fs::metadata(f)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > std::time::Duration::from_secs(10))
            })
        };
        if !alive && (dead > 0 || settled()) {
            removed += remove_files_with_prefix(&prefix);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rings of about 30 KiB each, after the mailbox.
    fn area() -> Area {
        Area::create("hot-test", (64 << 10) + MAILBOX_BYTES as u64)
            .unwrap()
            .1
    }

    fn readable(fd: std::os::fd::RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn a_wake_fd_is_readable_from_signal_to_drain_across_clones() {
        let w = WakeFd::new().unwrap();
        assert!(!readable(w.raw()));
        // The other side holds a duplicate, as a client does.
        let other = WakeFd::from_fd(w.try_clone().unwrap().into_fd());
        other.signal();
        other.signal();
        assert!(readable(w.raw()));
        assert!(w.drain());
        assert!(!readable(w.raw()), "one drain clears every signal");
        // Draining an empty one does not block, and says so.
        assert!(!w.drain());
        assert!(!readable(other.raw()));
    }

    #[test]
    fn the_mailbox_carries_responses_in_order_and_never_overwrites_one_untaken() {
        let (file, manager) = Area::create("hot-test", 64 << 10).unwrap();
        let client = Area::open(&file).unwrap();
        let (mut posted, mut taken) = (0u64, 0u64);
        let resp = |tag: u64| HotResponse {
            tag,
            c: tag * 3,
            ..response(RespKind::Accepted, tag, tag + 1)
        };
        let take = |taken: &mut u64| {
            let mut got = Vec::new();
            let n = client.take(taken, |r| got.push(r)).unwrap();
            assert_eq!(n, got.len());
            got
        };
        assert!(take(&mut taken).is_empty());
        // Three laps, in uneven batches: every response comes out once,
        // in order, bytes intact.
        let mut next = 0u64;
        let mut expect = 0u64;
        for batch in [1usize, 255, 256, 7, 200, 49] {
            for _ in 0..batch {
                assert!(manager.post(&mut posted, &resp(next)));
                next += 1;
            }
            for r in take(&mut taken) {
                assert_eq!(r, resp(expect));
                expect += 1;
            }
        }
        assert_eq!((expect, posted, taken), (next, next, next));
        // Full: the 257th untaken response is refused, and nothing of the
        // 256 is overwritten.
        for _ in 0..MAILBOX_SLOTS {
            assert!(manager.post(&mut posted, &resp(next)));
            next += 1;
        }
        assert!(!manager.post(&mut posted, &resp(next)));
        assert_eq!(posted, next);
        let got = take(&mut taken);
        assert_eq!(got.len(), MAILBOX_SLOTS);
        assert_eq!(got[0], resp(next - MAILBOX_SLOTS as u64));
        assert_eq!(got[MAILBOX_SLOTS - 1], resp(next - 1));
        // A client claiming it took more than was posted only loses its
        // own responses (the manager sees no room); one claiming less
        // than it took sees a full mailbox sooner. Neither makes the
        // manager write outside its slots.
        client.counter(256).store(posted + 5, Ordering::Release);
        assert!(!manager.post(&mut posted, &resp(1)));
        client
            .counter(256)
            .store(posted - MAILBOX_SLOTS as u64, Ordering::Release);
        assert!(!manager.post(&mut posted, &resp(1)));
        client.counter(256).store(posted, Ordering::Release);
        assert!(manager.post(&mut posted, &resp(1)));
        // A manager claiming more than a mailbox of untaken responses is
        // a protocol error for the client, which takes nothing.
        manager
            .counter(192)
            .store(taken + MAILBOX_SLOTS as u64 + 1, Ordering::Release);
        let mut t = taken;
        assert!(client.take(&mut t, |_| panic!("nothing is taken")).is_err());
        assert_eq!(t, taken);
    }

    #[test]
    fn an_area_of_another_layout_is_refused() {
        let (file, a) = Area::create("hot-test", 64 << 10).unwrap();
        // Version 1 (no mailbox).
        // SAFETY: the header's version field, in bounds.
        unsafe { std::ptr::write_unaligned(a.map.as_mut_ptr().add(8) as *mut u32, 1) };
        assert!(Area::open(&file).is_err());
        unsafe { std::ptr::write_unaligned(a.map.as_mut_ptr().add(8) as *mut u32, AREA_VERSION) };
        assert!(Area::open(&file).is_ok());
        // A mailbox that would run past the mapping, or another slot count.
        for (at, v) in [(48usize, (64u64 << 10) - 128), (56, 255)] {
            // SAFETY: header fields, in bounds.
            let old = unsafe { std::ptr::read_unaligned(a.map.as_ptr().add(at) as *const u64) };
            unsafe { std::ptr::write_unaligned(a.map.as_mut_ptr().add(at) as *mut u64, v) };
            assert!(Area::open(&file).is_err(), "field at {at}");
            unsafe { std::ptr::write_unaligned(a.map.as_mut_ptr().add(at) as *mut u64, old) };
        }
        assert!(Area::open(&file).is_ok());
    }

    #[test]
    fn messages_are_small_and_fixed() {
        assert_eq!(size_of::<HotRequest>(), 128);
        assert_eq!(size_of::<HotResponse>(), 128);
        assert_eq!(size_of::<Desc>(), 16);
    }

    #[test]
    fn commands_round_trip_through_the_area() {
        let a = area();
        let mut w = RingWriter::new(a.req);
        let s = SessionHandle {
            id: 7,
            epoch: 2,
            incarnation: 99,
        };
        let cmds = vec![
            Command::Query {
                session: s,
                request: 3,
                groups: vec![
                    GroupHashes {
                        group: 0,
                        hashes: (0..5).map(NativeHash::from_u64).collect(),
                    },
                    GroupHashes {
                        group: 1,
                        hashes: vec![NativeHash::new(&[1, 2, 3]).unwrap()],
                    },
                ],
                origin: 16,
                prompt_len: 80,
                expect_namespaces: vec![Namespace([4; 32])],
                prepare: true,
                speculative: false,
            },
            Command::Prepare {
                session: s,
                operation: 11,
            },
            Command::Load {
                session: s,
                request: 4,
                groups: vec![GroupHashes {
                    group: 0,
                    hashes: (0..3).map(NativeHash::from_u64).collect(),
                }],
                origin: 0,
                prompt_len: 48,
                expect_namespaces: vec![],
                // An odd count of ranks: the targets start after padding.
                ranks: vec![1, 0, 3],
                targets: (0..2)
                    .map(|i| RestoreTarget {
                        pos: PagePos {
                            rank: 1,
                            group: 0,
                            page_end: 16 * (i + 1),
                        },
                        device_page: 0xbeef + i,
                    })
                    .collect(),
                retained: vec![PagePos {
                    rank: 0,
                    group: 0,
                    page_end: 48,
                }],
                handoff: None,
            },
            Command::Load {
                session: s,
                request: 5,
                groups: vec![GroupHashes {
                    group: 0,
                    hashes: vec![NativeHash::from_u64(9)],
                }],
                origin: 0,
                prompt_len: 16,
                expect_namespaces: vec![],
                ranks: vec![],
                targets: vec![],
                retained: vec![],
                handoff: None,
            },
            Command::Restore {
                session: s,
                operation: 12,
                targets: vec![RestoreTarget {
                    pos: PagePos {
                        rank: 1,
                        group: 2,
                        page_end: 32,
                    },
                    device_page: 0xdead,
                }],
                retained: vec![PagePos {
                    rank: 0,
                    group: 0,
                    page_end: 16,
                }],
            },
            Command::Publish {
                session: s,
                request: 5,
                pages: (0..3)
                    .map(|i| PublishPage {
                        rank: 0,
                        group: 0,
                        hash: NativeHash::from_u64(i),
                        device_page: 100 + i,
                    })
                    .collect(),
            },
            Command::Release {
                session: s,
                operation: 13,
            },
            Command::Cancel {
                session: s,
                operation: 14,
            },
        ];
        for c in cmds {
            let r = encode_request(&c, 1, 2, &a, &mut w).unwrap();
            assert_eq!(decode_request(&r, &a).unwrap(), c);
            for d in &r.parts {
                w.release(&a, d);
            }
        }
        assert!(encode_request(&Command::AdvanceClock { us: 1 }, 1, 2, &a, &mut w).is_none());
    }

    #[test]
    fn a_load_plan_that_lies_about_its_counts_is_a_bad_part() {
        let targets = [RestoreTarget {
            pos: PagePos {
                rank: 0,
                group: 0,
                page_end: 16,
            },
            device_page: 1,
        }];
        let good = encode_load(&[0], &targets, &[]).unwrap();
        assert!(decode_load(&good).is_ok());
        for (at, value) in [(0, u32::MAX), (0, 3), (4, u32::MAX), (4, 2)] {
            let mut b = good.clone();
            b[at..at + 4].copy_from_slice(&value.to_le_bytes());
            assert!(decode_load(&b).is_err(), "count at {at} = {value}");
        }
        // Retained bytes that are not whole positions.
        let mut b = good.clone();
        b.extend_from_slice(&[0; 5]);
        assert!(decode_load(&b).is_err());
        assert!(decode_load(&good[..6]).is_err());
    }

    #[test]
    fn events_round_trip_through_the_area() {
        let a = area();
        let mut w = RingWriter::new(a.rep);
        let events = vec![
            Event::QueryResult {
                command: 4,
                request: 5,
                operation: 6,
                candidates: vec![Candidates {
                    rank: 0,
                    group: 1,
                    page_ends: vec![16, 32],
                }],
                common: vec![16, 32],
                selected: Some(32),
                miss: None,
            },
            Event::QueryResult {
                command: 4,
                request: 5,
                operation: 6,
                candidates: vec![],
                common: vec![],
                selected: None,
                miss: Some(MissReason::NotFound),
            },
            Event::Ready {
                operation: 6,
                boundary: 32,
                ranges: vec![(
                    0,
                    RequiredRange {
                        group: 0,
                        start: 0,
                        end: 32,
                    },
                )],
                leases: vec![LeaseInfo {
                    lease: 1,
                    pos: PagePos {
                        rank: 0,
                        group: 0,
                        page_end: 16,
                    },
                    bytes: 4096,
                    slot: 77,
                    offset: 8192,
                    checksum: 0x0123_4567_89ab_cdef,
                }],
                pages_from_dram: 1,
                pages_from_tiers: 0,
            },
            Event::Loading { operation: 6 },
            Event::Miss {
                operation: 6,
                reason: MissReason::Cancelled,
            },
            Event::RestoreDone {
                operation: 6,
                pages: 2,
                bytes: 8192,
            },
            Event::PublishDone {
                command: 9,
                request: 1,
                inserted: 2,
                duplicates: 1,
                dropped: 0,
            },
            Event::Released { operation: 6 },
            Event::Rejected {
                command: 9,
                error: CommandError::StaleSession,
            },
            Event::TransferOverdue {
                operation: 6,
                kind: "restore".into(),
            },
        ];
        for e in events {
            let r = encode_event(&e, 1, 0, &a, &mut w).unwrap();
            assert_eq!(decode_response(&r, &a).unwrap(), Reply::Event(e));
        }
        // Everything was freed by the reader: the ring wraps forever.
        for _ in 0..10_000 {
            let r = encode_event(&Event::Released { operation: 1 }, 1, 0, &a, &mut w).unwrap();
            decode_response(&r, &a).unwrap();
            let big = vec![
                LeaseInfo {
                    lease: 1,
                    pos: PagePos {
                        rank: 0,
                        group: 0,
                        page_end: 16
                    },
                    bytes: 1,
                    slot: 1,
                    offset: 1,
                    checksum: 1,
                };
                50
            ];
            let e = Event::Ready {
                operation: 1,
                boundary: 1,
                ranges: vec![],
                leases: big,
                pages_from_dram: 0,
                pages_from_tiers: 0,
            };
            let r = encode_event(&e, 1, 0, &a, &mut w).unwrap();
            assert_eq!(decode_response(&r, &a).unwrap(), Reply::Event(e));
        }
    }

    #[test]
    fn a_full_ring_says_so_and_recovers() {
        let a = area();
        let mut w = RingWriter::new(a.rep);
        let mut descs = Vec::new();
        while let Some(d) = w.write(&a, part::JSON, &[7u8; 1000]) {
            descs.push(d);
        }
        assert!(descs.len() >= 28, "{}", descs.len());
        // Freeing the oldest makes room again; out-of-order frees wait.
        a.free(a.rep, &descs[1]);
        assert!(w.write(&a, part::JSON, &[7u8; 1000]).is_none());
        a.free(a.rep, &descs[0]);
        assert!(w.write(&a, part::JSON, &[7u8; 1000]).is_some());
    }

    #[test]
    fn bad_descriptors_are_typed_errors() {
        let a = area();
        let mut w = RingWriter::new(a.req);
        let d = w.write(&a, part::TARGETS, &[0u8; 24]).unwrap();
        let cap = a.req.cap as u32;
        let cases = [
            (Desc { offset: cap, ..d }, HotErrorCode::DescriptorBounds),
            (
                Desc {
                    offset: u32::MAX - 3,
                    ..d
                },
                HotErrorCode::DescriptorBounds,
            ),
            (
                Desc {
                    offset: d.offset + 8,
                    ..d
                },
                HotErrorCode::DescriptorBounds,
            ),
            (Desc { len: u32::MAX, ..d }, HotErrorCode::DescriptorBounds),
            (
                Desc {
                    generation: d.generation + 1,
                    ..d
                },
                HotErrorCode::DescriptorGeneration,
            ),
            (Desc { len: 48, ..d }, HotErrorCode::DescriptorMismatch),
            (
                Desc {
                    kind: part::LEASES,
                    ..d
                },
                HotErrorCode::DescriptorMismatch,
            ),
            (
                Desc { offset: 4096, ..d },
                HotErrorCode::DescriptorGeneration,
            ),
        ];
        for (bad, code) in cases {
            assert_eq!(
                a.read(a.req, &bad, part::TARGETS).unwrap_err().code,
                code,
                "{bad:?}"
            );
        }
        assert_eq!(a.read(a.req, &d, part::TARGETS).unwrap().len(), 24);
        // A freed record is stale.
        a.free(a.req, &d);
        assert_eq!(
            a.read(a.req, &d, part::TARGETS).unwrap_err().code,
            HotErrorCode::DescriptorGeneration
        );
        // Parts that do not parse.
        let d = w.write(&a, part::TARGETS, &[0u8; 23]).unwrap();
        let mut r = HotRequest {
            magic: HOT_MAGIC,
            op: Op::Restore as u32,
            ..HotRequest::default()
        };
        r.parts[0] = d;
        assert_eq!(
            decode_request(&r, &a).unwrap_err().code,
            HotErrorCode::BadPart
        );
        r.op = 77;
        assert_eq!(
            decode_request(&r, &a).unwrap_err().code,
            HotErrorCode::UnknownOp
        );
    }
}
