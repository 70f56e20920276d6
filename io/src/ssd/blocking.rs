//! Blocking fallback: a pool of worker threads doing pread/pwrite/fdatasync.
//! The store's side only sends jobs and `try_recv`s completions, so it
//! never blocks either.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::BackendKind;
use super::engine::{Completion, Engine, Full, Request, perform};

struct Job {
    user: u64,
    req: Request,
}

pub(crate) struct BlockingEngine {
    jobs: Option<Sender<Job>>,
    done: Receiver<Completion>,
    workers: Vec<JoinHandle<()>>,
    capacity: usize,
    in_flight: usize,
    /// Completions received by `wait`, handed out by the next `reap`.
    stash: Vec<Completion>,
}

impl BlockingEngine {
    pub(crate) fn new(workers: usize, capacity: usize) -> std::io::Result<BlockingEngine> {
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Completion>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut handles = Vec::new();
        for i in 0..workers.max(1) {
            let rx = job_rx.clone();
            let tx = done_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("orbitkv-ssd-io-{i}"))
                .spawn(move || {
                    loop {
                        let job = {
                            let guard = rx.lock().unwrap_or_else(|e| e.into_inner());
                            guard.recv()
                        };
                        let Ok(job) = job else { return };
                        // SAFETY: the store keeps buffers and fds valid until
                        // it has reaped this completion (Engine::submit).
                        let result = unsafe { perform(job.req) };
                        if tx
                            .send(Completion {
                                user: job.user,
                                result,
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                })?;
            handles.push(h);
        }
        Ok(BlockingEngine {
            jobs: Some(job_tx),
            done: done_rx,
            workers: handles,
            capacity: capacity.max(1),
            in_flight: 0,
            stash: Vec::new(),
        })
    }
}

impl Engine for BlockingEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Blocking
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn submit(&mut self, user: u64, req: Request) -> Result<(), Full> {
        if self.in_flight >= self.capacity {
            return Err(Full);
        }
        let Some(jobs) = &self.jobs else {
            return Err(Full);
        };
        jobs.send(Job { user, req }).map_err(|_| Full)?;
        self.in_flight += 1;
        Ok(())
    }

    fn flush(&mut self) {}

    fn unflushed(&self) -> usize {
        0
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        for c in self.stash.drain(..) {
            out.push(c);
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        loop {
            match self.done.try_recv() {
                Ok(c) => {
                    out.push(c);
                    self.in_flight = self.in_flight.saturating_sub(1);
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return,
            }
        }
    }

    fn wait(&mut self) {
        if self.in_flight == 0 || !self.stash.is_empty() {
            return;
        }
        // The channel cannot be peeked: keep what arrives for `reap`.
        match self.done.recv_timeout(Duration::from_millis(50)) {
            Ok(c) => self.stash.push(c),
            Err(RecvTimeoutError::Timeout) => {}
            // Every worker is gone (they only exit when the job channel
            // closes): nothing in flight can complete or touch memory.
            Err(RecvTimeoutError::Disconnected) => self.in_flight = 0,
        }
    }
}

impl Drop for BlockingEngine {
    fn drop(&mut self) {
        self.jobs = None;
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}
