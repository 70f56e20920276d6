//! The internal I/O engine interface: io_uring or a blocking worker pool
//! behind the same non-blocking submit/reap calls.

use std::os::fd::RawFd;

use super::BackendKind;

/// One positioned I/O. Pointers and fds must stay valid until the
/// operation's completion has been reaped.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Request {
    /// `preadv` into `iovcnt` buffers starting at `iov`.
    Readv {
        fd: RawFd,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    },
    /// `pwrite` of `len` bytes from `ptr`.
    Write {
        fd: RawFd,
        offset: u64,
        ptr: *const u8,
        len: usize,
    },
    /// `pwritev` of `iovcnt` buffers starting at `iov` (one record written
    /// from its header buffer and the host pool).
    Writev {
        fd: RawFd,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    },
    /// `fdatasync`.
    Fdatasync { fd: RawFd },
}

// SAFETY: the pointers are plain addresses whose validity the submitter
// guarantees until completion (see `Engine::submit`).
unsafe impl Send for Request {}

/// A finished operation: bytes transferred, or the errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion {
    pub user: u64,
    pub result: Result<usize, i32>,
}

/// A queue the engine cannot take more from right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

pub(crate) trait Engine: Send {
    fn kind(&self) -> BackendKind;

    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;

    /// Queues one operation; never blocks. The caller keeps
    /// `in_flight() < capacity` so `Full` is only a guard.
    ///
    /// # Safety
    /// Every pointer in `req` stays valid (and is not otherwise accessed)
    /// and every fd stays open until the completion carrying `user` has
    /// been returned by [`Engine::reap`].
    unsafe fn submit(&mut self, user: u64, req: Request) -> Result<(), Full>;

    /// Hands queued operations to the kernel / workers; never blocks.
    fn flush(&mut self);

    /// Operations submitted but not yet handed over by [`Engine::flush`].
    fn unflushed(&self) -> usize;

    /// Appends finished operations; never blocks.
    fn reap(&mut self, out: &mut Vec<Completion>);

    /// Blocks until at least one operation finished (or none is in flight).
    /// Only for `Drop` and explicit draining, never inside a tick.
    fn wait(&mut self);
}

/// `errno` of the last failed libc call.
pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Performs `req` synchronously (EINTR retried). Used by the blocking
/// workers.
///
/// # Safety
/// As for [`Engine::submit`].
pub(crate) unsafe fn perform(req: Request) -> Result<usize, i32> {
    loop {
        // SAFETY: forwarded from the caller.
        let r = unsafe {
            match req {
                Request::Readv {
                    fd,
                    offset,
                    iov,
                    iovcnt,
                } => libc::preadv(fd, iov, iovcnt as i32, offset as libc::off_t),
                Request::Write {
                    fd,
                    offset,
                    ptr,
                    len,
                } => libc::pwrite(fd, ptr.cast(), len, offset as libc::off_t),
                Request::Writev {
                    fd,
                    offset,
                    iov,
                    iovcnt,
                } => libc::pwritev(fd, iov, iovcnt as i32, offset as libc::off_t),
                Request::Fdatasync { fd } => libc::fdatasync(fd) as isize,
            }
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = errno();
        if e != libc::EINTR {
            return Err(e);
        }
    }
}
