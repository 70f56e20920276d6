//! Counters and latency histograms of the remote tier, updated lock-free by
//! the tick thread and the workers; [`RemoteStats::snapshot`] is what tests
//! read and what the manager's `/metrics` collector encodes at each scrape.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

use crate::tier::DemoteRefused;

/// Upper bounds of the latency buckets, in microseconds (the last bucket
/// is everything above).
pub const LATENCY_BOUNDS_US: [u64; 15] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000,
];

/// Why a remote operation failed, for `errors by kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// No connection: refused, reset, authentication, breaker open.
    Unavailable,
    /// Past the deadline (socket timeout or the tier's own).
    Timeout,
    /// The value failed verification.
    Corrupt,
    /// The directory promised a record that is not there (expired,
    /// evicted by Redis, flushed).
    Missing,
    /// Any other error reply (cluster down for the slot, OOM, ...).
    Server,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::Unavailable,
        ErrorKind::Timeout,
        ErrorKind::Corrupt,
        ErrorKind::Missing,
        ErrorKind::Server,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Missing => "missing",
            ErrorKind::Server => "server",
        }
    }
}

#[derive(Default)]
pub(crate) struct Errors([AtomicU64; 5]);

impl Errors {
    pub(crate) fn bump(&self, kind: ErrorKind) {
        self.0[kind as usize].fetch_add(1, Relaxed);
    }

    fn snapshot(&self) -> ErrorCounts {
        let g = |k: ErrorKind| self.0[k as usize].load(Relaxed);
        ErrorCounts {
            unavailable: g(ErrorKind::Unavailable),
            timeout: g(ErrorKind::Timeout),
            corrupt: g(ErrorKind::Corrupt),
            missing: g(ErrorKind::Missing),
            server: g(ErrorKind::Server),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ErrorCounts {
    pub unavailable: u64,
    pub timeout: u64,
    pub corrupt: u64,
    pub missing: u64,
    pub server: u64,
}

impl ErrorCounts {
    pub fn get(&self, kind: ErrorKind) -> u64 {
        match kind {
            ErrorKind::Unavailable => self.unavailable,
            ErrorKind::Timeout => self.timeout,
            ErrorKind::Corrupt => self.corrupt,
            ErrorKind::Missing => self.missing,
            ErrorKind::Server => self.server,
        }
    }

    pub fn total(&self) -> u64 {
        ErrorKind::ALL.iter().map(|k| self.get(*k)).sum()
    }
}

#[derive(Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub(crate) fn record(&self, us: u64) {
        let i = LATENCY_BOUNDS_US.partition_point(|b| *b < us);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    fn snapshot(&self) -> LatencyHistogram {
        LatencyHistogram {
            bounds_us: LATENCY_BOUNDS_US.to_vec(),
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum_us: self.sum_us.load(Relaxed),
            count: self.count.load(Relaxed),
        }
    }
}

/// A latency histogram: `counts[i]` operations took at most
/// `bounds_us[i]` (and more than the bound before); the last count is
/// everything above the last bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LatencyHistogram {
    pub bounds_us: Vec<u64>,
    pub counts: Vec<u64>,
    pub sum_us: u64,
    pub count: u64,
}

/// Refusals of writes (demotions and write-through), by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WriteRefusals {
    pub unavailable: u64,
    pub too_large: u64,
    pub duplicate: u64,
    pub queue_full: u64,
    pub empty: u64,
    /// The bytes did not match the checksum the page carries.
    pub checksum: u64,
}

#[derive(Default)]
pub(crate) struct RemoteStats {
    pub lookups: AtomicU64,
    pub lookup_hits: AtomicU64,
    pub lookups_suppressed: AtomicU64,
    pub reads_submitted: AtomicU64,
    pub reads_ok: AtomicU64,
    pub bytes_read: AtomicU64,
    pub reads_refused: AtomicU64,
    pub reads_late: AtomicU64,
    pub read_errors: Errors,
    pub read_latency: Histogram,
    pub writes_submitted: AtomicU64,
    pub writes_ok: AtomicU64,
    pub bytes_written: AtomicU64,
    pub write_batches: AtomicU64,
    pub write_errors: Errors,
    pub write_latency: Histogram,
    pub refusal_unavailable: AtomicU64,
    pub refusal_too_large: AtomicU64,
    pub refusal_duplicate: AtomicU64,
    pub refusal_queue_full: AtomicU64,
    pub refusal_empty: AtomicU64,
    pub refusal_checksum: AtomicU64,
    pub refresh_rounds: AtomicU64,
    pub refresh_errors: Errors,
    pub directory_entries_read: AtomicU64,
    pub directory_entries_bad: AtomicU64,
    pub directory_resets: AtomicU64,
    pub metadata_entries: AtomicU64,
    pub metadata_dropped: AtomicU64,
    pub namespaces_followed: AtomicU64,
    pub breaker_opens: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
}

impl RemoteStats {
    /// Counts a refused write. `NotWritable` is never counted: a tier
    /// whose policy skips a write did not refuse anything.
    pub(crate) fn refuse(&self, reason: DemoteRefused) {
        let c = match reason {
            DemoteRefused::Unavailable => &self.refusal_unavailable,
            DemoteRefused::TooLarge => &self.refusal_too_large,
            DemoteRefused::Duplicate => &self.refusal_duplicate,
            DemoteRefused::QueueFull => &self.refusal_queue_full,
            DemoteRefused::Empty => &self.refusal_empty,
            DemoteRefused::Checksum => &self.refusal_checksum,
            DemoteRefused::NotWritable
            | DemoteRefused::AdmissionPolicy
            | DemoteRefused::NoSpace => return,
        };
        c.fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self, live: Live) -> RemoteStatsSnapshot {
        let g = |a: &AtomicU64| a.load(Relaxed);
        RemoteStatsSnapshot {
            mode: live.mode,
            breaker_open: live.breaker_open,
            lookups: g(&self.lookups),
            lookup_hits: g(&self.lookup_hits),
            lookups_suppressed: g(&self.lookups_suppressed),
            reads_submitted: g(&self.reads_submitted),
            reads_ok: g(&self.reads_ok),
            bytes_read: g(&self.bytes_read),
            reads_refused: g(&self.reads_refused),
            reads_in_flight: live.reads_in_flight,
            reads_abandoned: live.reads_abandoned,
            reads_late: g(&self.reads_late),
            read_errors: self.read_errors.snapshot(),
            read_latency: self.read_latency.snapshot(),
            writes_submitted: g(&self.writes_submitted),
            writes_ok: g(&self.writes_ok),
            bytes_written: g(&self.bytes_written),
            write_batches: g(&self.write_batches),
            writes_queued: live.writes_queued,
            write_bytes_queued: live.write_bytes_queued,
            write_errors: self.write_errors.snapshot(),
            write_latency: self.write_latency.snapshot(),
            write_refusals: WriteRefusals {
                unavailable: g(&self.refusal_unavailable),
                too_large: g(&self.refusal_too_large),
                duplicate: g(&self.refusal_duplicate),
                queue_full: g(&self.refusal_queue_full),
                empty: g(&self.refusal_empty),
                checksum: g(&self.refusal_checksum),
            },
            refresh_rounds: g(&self.refresh_rounds),
            refresh_errors: self.refresh_errors.snapshot(),
            directory_entries_read: g(&self.directory_entries_read),
            directory_entries_bad: g(&self.directory_entries_bad),
            directory_resets: g(&self.directory_resets),
            metadata_entries: g(&self.metadata_entries),
            metadata_dropped: g(&self.metadata_dropped),
            namespaces_followed: g(&self.namespaces_followed),
            breaker_opens: g(&self.breaker_opens),
            connects: g(&self.connects),
            connect_failures: g(&self.connect_failures),
        }
    }
}

/// Values only the tier itself knows at snapshot time.
pub(crate) struct Live {
    pub mode: &'static str,
    pub breaker_open: bool,
    pub reads_in_flight: u64,
    pub reads_abandoned: u64,
    pub writes_queued: u64,
    pub write_bytes_queued: u64,
}

/// Everything the remote tier counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RemoteStatsSnapshot {
    /// `single`, `cluster`, or `unknown` before the first connection.
    pub mode: &'static str,
    /// Whether the breaker is open (the tier is treated as down).
    pub breaker_open: bool,
    pub lookups: u64,
    pub lookup_hits: u64,
    /// Lookups answered "absent" because the breaker was open.
    pub lookups_suppressed: u64,
    pub reads_submitted: u64,
    /// Reads that delivered verified bytes into the pool.
    pub reads_ok: u64,
    pub bytes_read: u64,
    /// `submit_read` refusals (breaker open, queue full, unknown key).
    pub reads_refused: u64,
    pub reads_in_flight: u64,
    /// Reads reported as timed out whose worker has not returned yet.
    pub reads_abandoned: u64,
    /// Replies that came after their read was reported timed out.
    pub reads_late: u64,
    pub read_errors: ErrorCounts,
    pub read_latency: LatencyHistogram,
    pub writes_submitted: u64,
    /// Records stored (value and directory entry).
    pub writes_ok: u64,
    pub bytes_written: u64,
    /// Pipelines that stored them (`writes_ok / write_batches` records
    /// per round trip).
    pub write_batches: u64,
    pub writes_queued: u64,
    pub write_bytes_queued: u64,
    pub write_errors: ErrorCounts,
    /// Per pipeline: one record's write, or a batch's.
    pub write_latency: LatencyHistogram,
    pub write_refusals: WriteRefusals,
    pub refresh_rounds: u64,
    pub refresh_errors: ErrorCounts,
    pub directory_entries_read: u64,
    /// Directory entries that failed to decode (skipped).
    pub directory_entries_bad: u64,
    /// Directory streams found gone (flushed or expired): their metadata
    /// was dropped.
    pub directory_resets: u64,
    pub metadata_entries: u64,
    /// Metadata entries dropped: capacity, expiry, failed reads, resets.
    pub metadata_dropped: u64,
    pub namespaces_followed: u64,
    pub breaker_opens: u64,
    pub connects: u64,
    pub connect_failures: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let h = Histogram::default();
        h.record(0);
        h.record(50);
        h.record(51);
        h.record(10_000_000);
        let s = h.snapshot();
        assert_eq!(s.counts[0], 2);
        assert_eq!(s.counts[1], 1);
        assert_eq!(*s.counts.last().unwrap(), 1);
        assert_eq!(s.count, 4);
        assert_eq!(s.sum_us, 10_000_101);
        assert_eq!(s.counts.len(), s.bounds_us.len() + 1);
    }
}
