//! Routers' lookups over HTTP (`POST /lookup` beside `/metrics`): the
//! endpoint's thread hands each request to the event loop, which alone
//! owns the runtime, and waits for its answer. Bounded: a request body of
//! at most `[serve] lookup_max_body_bytes`, at most [`READING`] bodies
//! read at once (past it `503`), at most `MAX_LOOKUP_HASHES` hashes
//! (refused while parsed), at most `[serve] lookup_per_second` requests
//! (a token bucket; past it `429`), and at most [`QUEUED`] waiting for the
//! loop (past it `503`). The loop answers at most [`PER_ROUND`] per round,
//! so a burst cannot hold it.

use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use orbitkv_components::admin::{LookupReply, LookupRequest};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::oneshot;

use crate::metrics::Outcome;

/// Lookups waiting for the loop, at most.
pub const QUEUED: usize = 256;
/// Request bodies read at once, at most: with `lookup_max_body_bytes` and
/// the hashes a body may hold, the memory lookups can take.
pub const READING: usize = 16;
/// Lookups the loop answers per round, at most.
pub const PER_ROUND: usize = 32;

/// One request and where its answer goes.
pub struct Asked {
    pub request: LookupRequest,
    pub reply: oneshot::Sender<LookupReply>,
}

/// The loop's side: the queue, and a socket that becomes readable when
/// the queue has work (so a sleeping loop wakes for it).
pub struct Desk {
    rx: Receiver<Asked>,
    wake: UnixStream,
    /// Set by a door after its wake byte: the loop looks at the channel
    /// and the socket only then (an atomic load a round, not a syscall).
    asked: Arc<AtomicBool>,
}

/// The endpoint's side.
#[derive(Clone)]
pub struct Door {
    tx: SyncSender<Asked>,
    wake: Arc<UnixStream>,
    asked: Arc<AtomicBool>,
    bucket: Arc<Mutex<Bucket>>,
    pub max_body_bytes: usize,
    /// Permits to read a body ([`READING`]).
    pub reading: Arc<tokio::sync::Semaphore>,
    /// `orbitkv_lookups_total`: the endpoint counts what it turns away.
    outcomes: Family<Outcome, Counter>,
}

/// Why a lookup was not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Turned {
    /// Past `lookup_per_second`.
    Rate,
    /// [`QUEUED`] are waiting already.
    Busy,
    /// The loop is gone (shutdown).
    Closed,
}

/// A desk and its door; `per_second` requests a second (and as many at
/// once), bodies of at most `max_body_bytes`.
pub fn open(
    per_second: u32,
    max_body_bytes: usize,
    outcomes: Family<Outcome, Counter>,
) -> std::io::Result<(Desk, Door)> {
    let (tx, rx) = sync_channel(QUEUED);
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    theirs.set_nonblocking(true)?;
    let bucket = Bucket {
        rate: f64::from(per_second),
        tokens: f64::from(per_second),
        at: Instant::now(),
    };
    let asked = Arc::new(AtomicBool::new(false));
    Ok((
        Desk {
            rx,
            wake: ours,
            asked: asked.clone(),
        },
        Door {
            tx,
            wake: Arc::new(theirs),
            asked,
            bucket: Arc::new(Mutex::new(bucket)),
            max_body_bytes,
            reading: Arc::new(tokio::sync::Semaphore::new(READING)),
            outcomes,
        },
    ))
}

impl Door {
    /// Counts a lookup the endpoint turned away (or gave up on).
    pub fn count(&self, outcome: &str) {
        self.outcomes
            .get_or_create(&Outcome {
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Queues `request` for the loop; its answer comes on the receiver.
    pub fn ask(&self, request: LookupRequest) -> Result<oneshot::Receiver<LookupReply>, Turned> {
        if !self
            .bucket
            .lock()
            .map(|mut b| b.take(Instant::now()))
            .unwrap_or(false)
        {
            return Err(Turned::Rate);
        }
        let (reply, answer) = oneshot::channel();
        match self.tx.try_send(Asked { request, reply }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(Turned::Busy),
            Err(TrySendError::Disconnected(_)) => return Err(Turned::Closed),
        }
        // A full socket buffer means the loop has wakes pending already.
        let _ = (&*self.wake).write(&[1]);
        // After the byte: a set flag is always followed by a drain of
        // every byte written before it, so none lingers to keep `poll`
        // readable once the flag is down.
        self.asked.store(true, Ordering::Release);
        Ok(answer)
    }
}

impl Desk {
    /// The descriptor the loop polls for readability.
    pub fn fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Up to [`PER_ROUND`] waiting lookups; drains the wake bytes first,
    /// so a request queued after this still wakes the next poll. Returns
    /// whether more may wait (a full round was taken): the loop must not
    /// sleep then.
    pub fn take(&self, out: &mut Vec<Asked>) -> bool {
        // Most rounds: nobody asked (the loop spins through here while
        // engines' lookups come).
        if !self.asked.swap(false, Ordering::AcqRel) {
            return false;
        }
        let mut sink = [0u8; 256];
        while matches!((&self.wake).read(&mut sink), Ok(n) if n > 0) {}
        while out.len() < PER_ROUND {
            match self.rx.try_recv() {
                Ok(a) => out.push(a),
                Err(_) => return false,
            }
        }
        // A full round: more may wait, and their doors' flags may be
        // down already (swapped above).
        self.asked.store(true, Ordering::Release);
        true
    }
}

/// A token bucket: `rate` a second, at most `rate` at once.
struct Bucket {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> LookupRequest {
        LookupRequest {
            instance: Some("m".into()),
            namespace: None,
            group: 0,
            hashes: vec![],
            prompt_len: None,
        }
    }

    #[test]
    fn the_bucket_refuses_past_its_rate_and_refills() {
        let t0 = Instant::now();
        let mut b = Bucket {
            rate: 2.0,
            tokens: 2.0,
            at: t0,
        };
        assert!(b.take(t0));
        assert!(b.take(t0));
        assert!(!b.take(t0));
        assert!(b.take(t0 + std::time::Duration::from_millis(500)));
        assert!(!b.take(t0 + std::time::Duration::from_millis(500)));
    }

    #[test]
    fn a_full_queue_is_busy_and_the_desk_takes_a_round_at_a_time() {
        let (desk, door) = open(10_000, 1 << 20, Family::default()).unwrap();
        let mut answers = Vec::new();
        for _ in 0..QUEUED {
            answers.push(door.ask(request()).unwrap());
        }
        assert_eq!(door.ask(request()).unwrap_err(), Turned::Busy);
        let mut out = Vec::new();
        assert!(desk.take(&mut out), "a full round: more may wait");
        assert_eq!(out.len(), PER_ROUND);
        drop(desk);
        out.clear();
        assert_eq!(door.ask(request()).unwrap_err(), Turned::Closed);
    }

    #[test]
    fn the_desk_looks_only_when_asked_and_keeps_looking_after_a_full_round() {
        let (desk, door) = open(10_000, 1 << 20, Family::default()).unwrap();
        let mut out = Vec::new();
        // Nobody asked: nothing taken, and the wake socket is not read.
        assert!(!desk.take(&mut out));
        assert!(out.is_empty());
        let mut answers: Vec<_> = (0..PER_ROUND + 1)
            .map(|_| door.ask(request()).unwrap())
            .collect();
        assert!(desk.take(&mut out));
        assert_eq!(out.len(), PER_ROUND);
        // The flag stays up after a full round: the one left is taken next,
        // although no door raised it since.
        out.clear();
        assert!(!desk.take(&mut out));
        assert_eq!(out.len(), 1);
        out.clear();
        // Every wake byte was drained: the descriptor is not readable.
        let mut pfd = libc::pollfd {
            fd: desk.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0);
        assert!(!desk.take(&mut out));
        answers.clear();
    }
}
