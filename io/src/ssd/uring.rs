//! io_uring engine: one ring owned by the store, submitted and reaped from
//! the store's own thread; no helper threads.

use std::io;

use io_uring::{IoUring, opcode, squeue, types};

use super::BackendKind;
use super::engine::{Completion, Engine, Full, Request};

pub(crate) struct UringEngine {
    ring: IoUring,
    capacity: usize,
    in_flight: usize,
    /// SQEs pushed and not yet consumed by io_uring_enter.
    unsubmitted: usize,
}

impl UringEngine {
    /// A ring with room for `capacity` operations in flight (SQ rounded up
    /// to a power of two; the CQ is twice that, so it cannot overflow).
    pub(crate) fn new(capacity: usize) -> io::Result<UringEngine> {
        let entries = capacity.clamp(8, 4096).next_power_of_two() as u32;
        let ring = IoUring::new(entries)?;
        Ok(UringEngine {
            ring,
            capacity: entries as usize,
            in_flight: 0,
            unsubmitted: 0,
        })
    }

    fn entry(user: u64, req: Request) -> squeue::Entry {
        match req {
            Request::Readv {
                fd,
                offset,
                iov,
                iovcnt,
            } => opcode::Readv::new(types::Fd(fd), iov, iovcnt)
                .offset(offset)
                .build(),
            Request::Write {
                fd,
                offset,
                ptr,
                len,
            } => opcode::Write::new(types::Fd(fd), ptr, len as u32)
                .offset(offset)
                .build(),
            Request::Writev {
                fd,
                offset,
                iov,
                iovcnt,
            } => opcode::Writev::new(types::Fd(fd), iov, iovcnt)
                .offset(offset)
                .build(),
            Request::Fdatasync { fd } => opcode::Fsync::new(types::Fd(fd))
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        }
        .user_data(user)
    }
}

impl Engine for UringEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn submit(&mut self, user: u64, req: Request) -> Result<(), Full> {
        if self.in_flight >= self.capacity {
            return Err(Full);
        }
        if let Request::Write { len, .. } = req
            && len > u32::MAX as usize
        {
            return Err(Full);
        }
        let entry = Self::entry(user, req);
        // SAFETY: the caller keeps every buffer and fd valid until reaped.
        let pushed = unsafe { self.ring.submission().push(&entry).is_ok() };
        if !pushed {
            self.flush();
            // SAFETY: as above.
            if unsafe { self.ring.submission().push(&entry).is_err() } {
                return Err(Full);
            }
        }
        self.in_flight += 1;
        self.unsubmitted += 1;
        Ok(())
    }

    fn flush(&mut self) {
        if self.ring.submission().is_empty() {
            return;
        }
        // io_uring_enter without GETEVENTS: hands the SQEs over and returns.
        // EBUSY / EAGAIN / EINTR leave them queued for the next flush.
        if let Ok(n) = self.ring.submit() {
            self.unsubmitted = self.unsubmitted.saturating_sub(n);
        }
    }

    fn unflushed(&self) -> usize {
        self.unsubmitted
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            let res = cqe.result();
            out.push(Completion {
                user: cqe.user_data(),
                result: if res < 0 { Err(-res) } else { Ok(res as usize) },
            });
            self.in_flight = self.in_flight.saturating_sub(1);
        }
    }

    fn wait(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        if !self.ring.completion().is_empty() {
            return;
        }
        let _ = self.ring.submit_and_wait(1);
    }
}
