//! Counters and latency histograms of the remote tier, updated lock-free by
//! the tick thread and the workers; [`RemoteStats::snapshot`] is what
//! `/metrics` and tests read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

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
    pub write_errors: Errors,
    pub write_latency: Histogram,
    pub refusal_unavailable: AtomicU64,
    pub refusal_too_large: AtomicU64,
    pub refusal_duplicate: AtomicU64,
    pub refusal_queue_full: AtomicU64,
    pub refusal_empty: AtomicU64,
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
    pub(crate) fn refuse(&self, reason: &'static str) {
        let c = match reason {
            "unavailable" => &self.refusal_unavailable,
            "too_large" => &self.refusal_too_large,
            "duplicate" => &self.refusal_duplicate,
            "queue_full" => &self.refusal_queue_full,
            _ => &self.refusal_empty,
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
    pub writes_queued: u64,
    pub write_bytes_queued: u64,
    pub write_errors: ErrorCounts,
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

impl RemoteStatsSnapshot {
    /// The Prometheus text of these counters (`docs/remote.md`, "Metrics").
    pub fn render_prometheus(&self, o: &mut String) {
        use std::fmt::Write as _;
        let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, u64)]| {
            let _ = writeln!(o, "# HELP orbitkv_remote_{name} {help}");
            let _ = writeln!(o, "# TYPE orbitkv_remote_{name} {kind}");
            for (labels, v) in lines {
                let _ = writeln!(o, "orbitkv_remote_{name}{labels} {v}");
            }
        };
        let one = |v: u64| vec![(String::new(), v)];
        metric(
            "up",
            "gauge",
            "1 unless the breaker is open",
            &one(u64::from(!self.breaker_open)),
        );
        metric(
            "lookups_total",
            "counter",
            "Metadata lookups",
            &one(self.lookups),
        );
        metric(
            "lookup_hits_total",
            "counter",
            "Lookups that found a page",
            &one(self.lookup_hits),
        );
        metric(
            "lookups_suppressed_total",
            "counter",
            "Lookups answered absent while the tier was down",
            &one(self.lookups_suppressed),
        );
        let mut reads = vec![
            ("{outcome=\"ok\"}".to_string(), self.reads_ok),
            ("{outcome=\"refused\"}".to_string(), self.reads_refused),
        ];
        for k in ErrorKind::ALL {
            reads.push((
                format!("{{outcome=\"{}\"}}", k.as_str()),
                self.read_errors.get(k),
            ));
        }
        metric("reads_total", "counter", "Reads by outcome", &reads);
        metric(
            "read_bytes_total",
            "counter",
            "Verified bytes read",
            &one(self.bytes_read),
        );
        metric(
            "written_bytes_total",
            "counter",
            "Page bytes written",
            &one(self.bytes_written),
        );
        metric(
            "writes_total",
            "counter",
            "Records stored",
            &one(self.writes_ok),
        );
        let mut errors = Vec::new();
        for (op, c) in [
            ("read", &self.read_errors),
            ("write", &self.write_errors),
            ("refresh", &self.refresh_errors),
        ] {
            for k in ErrorKind::ALL {
                errors.push((format!("{{op=\"{op}\",kind=\"{}\"}}", k.as_str()), c.get(k)));
            }
        }
        metric(
            "errors_total",
            "counter",
            "Failures by operation and kind",
            &errors,
        );
        let r = &self.write_refusals;
        let refusals: Vec<(String, u64)> = [
            ("unavailable", r.unavailable),
            ("too_large", r.too_large),
            ("duplicate", r.duplicate),
            ("queue_full", r.queue_full),
            ("empty", r.empty),
        ]
        .iter()
        .map(|(k, v)| (format!("{{reason=\"{k}\"}}"), *v))
        .collect();
        metric(
            "write_refusals_total",
            "counter",
            "Writes refused, by reason",
            &refusals,
        );
        metric(
            "metadata_entries",
            "gauge",
            "Pages the metadata cache knows",
            &one(self.metadata_entries),
        );
        metric(
            "namespaces_followed",
            "gauge",
            "Namespaces whose directories are followed",
            &one(self.namespaces_followed),
        );
        metric(
            "directory_resets_total",
            "counter",
            "Directory streams found gone (flushed or expired)",
            &one(self.directory_resets),
        );
        metric(
            "breaker_opens_total",
            "counter",
            "Times the tier was declared down",
            &one(self.breaker_opens),
        );
        metric(
            "reads_in_flight",
            "gauge",
            "Reads accepted and not reported",
            &one(self.reads_in_flight),
        );
        metric(
            "writes_queued",
            "gauge",
            "Writes accepted and not finished",
            &one(self.writes_queued),
        );
        for (name, h) in [
            ("read_latency_us", &self.read_latency),
            ("write_latency_us", &self.write_latency),
        ] {
            let _ = writeln!(
                o,
                "# HELP orbitkv_remote_{name} Latency of successful operations"
            );
            let _ = writeln!(o, "# TYPE orbitkv_remote_{name} histogram");
            let mut cumulative = 0;
            for (i, c) in h.counts.iter().enumerate() {
                cumulative += c;
                let le = h
                    .bounds_us
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), u64::to_string);
                let _ = writeln!(
                    o,
                    "orbitkv_remote_{name}_bucket{{le=\"{le}\"}} {cumulative}"
                );
            }
            let _ = writeln!(o, "orbitkv_remote_{name}_sum {}", h.sum_us);
            let _ = writeln!(o, "orbitkv_remote_{name}_count {}", h.count);
        }
    }
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

    #[test]
    fn prometheus_text() {
        let st = RemoteStats::default();
        st.read_errors.bump(ErrorKind::Corrupt);
        st.read_latency.record(70);
        let snap = st.snapshot(Live {
            mode: "single",
            breaker_open: true,
            reads_in_flight: 2,
            reads_abandoned: 0,
            writes_queued: 0,
            write_bytes_queued: 0,
        });
        let mut o = String::new();
        snap.render_prometheus(&mut o);
        assert!(o.contains("orbitkv_remote_up 0\n"), "{o}");
        assert!(o.contains("orbitkv_remote_reads_total{outcome=\"corrupt\"} 1\n"));
        assert!(o.contains("orbitkv_remote_errors_total{op=\"read\",kind=\"corrupt\"} 1\n"));
        assert!(o.contains("orbitkv_remote_read_latency_us_bucket{le=\"50\"} 0\n"));
        assert!(o.contains("orbitkv_remote_read_latency_us_bucket{le=\"100\"} 1\n"));
        assert!(o.contains("orbitkv_remote_read_latency_us_bucket{le=\"+Inf\"} 1\n"));
        assert!(o.contains("orbitkv_remote_reads_in_flight 2\n"));
    }
}
