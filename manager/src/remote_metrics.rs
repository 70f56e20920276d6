//! The remote tier's counters on `/metrics` (`docs/remote.md`, "Metrics"):
//! a `prometheus-client` collector that reads the tier's own lock-free
//! counters ([`RemoteStatsHandle`]) at each scrape, so nothing is mirrored
//! or kept twice. Names and labels are those of `docs/remote.md`.

use orbitkv_io::remote::{ErrorKind, LatencyHistogram, RemoteStatsHandle, RemoteStatsSnapshot};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Registered under the `orbitkv_remote` prefix.
#[derive(Debug)]
pub struct RemoteCollector(pub RemoteStatsHandle);

type Encoded = Result<(), std::fmt::Error>;

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Encoded {
    let m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(v).encode(m)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Encoded {
    let m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)
}

/// A counter with one label set per sample.
fn counters(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(Vec<(&'static str, &'static str)>, u64)],
) -> Encoded {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in samples {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// The tier's microsecond buckets, as seconds.
fn histogram(e: &mut DescriptorEncoder, name: &str, help: &str, h: &LatencyHistogram) -> Encoded {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    let buckets: Vec<(f64, u64)> = h
        .counts
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let le = h.bounds_us.get(i).map_or(f64::MAX, |us| *us as f64 / 1e6);
            (le, *c)
        })
        .collect();
    m.encode_histogram::<NoLabelSet>(h.sum_us as f64 / 1e6, h.count, &buckets, None)
}

fn kinds(
    c: &orbitkv_io::remote::ErrorCounts,
    label: &'static str,
) -> Vec<(Vec<(&'static str, &'static str)>, u64)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (vec![(label, k.as_str())], c.get(*k)))
        .collect()
}

fn encode(s: &RemoteStatsSnapshot, e: &mut DescriptorEncoder) -> Encoded {
    gauge(
        e,
        "up",
        "1 unless the breaker is open",
        u64::from(!s.breaker_open),
    )?;
    counter(e, "lookups", "Metadata lookups", s.lookups)?;
    counter(e, "lookup_hits", "Lookups that found a page", s.lookup_hits)?;
    counter(
        e,
        "lookups_suppressed",
        "Lookups answered absent while the tier was down",
        s.lookups_suppressed,
    )?;
    let mut reads = vec![
        (vec![("outcome", "ok")], s.reads_ok),
        (vec![("outcome", "refused")], s.reads_refused),
    ];
    reads.extend(kinds(&s.read_errors, "outcome"));
    counters(e, "reads", "Reads by outcome", &reads)?;
    counter(e, "read_bytes", "Verified bytes read", s.bytes_read)?;
    counter(e, "written_bytes", "Page bytes written", s.bytes_written)?;
    counter(e, "writes", "Records stored", s.writes_ok)?;
    counter(
        e,
        "write_batches",
        "Pipelines (one round trip each) that stored those records",
        s.write_batches,
    )?;
    let mut errors = Vec::new();
    for (op, c) in [
        ("read", &s.read_errors),
        ("write", &s.write_errors),
        ("refresh", &s.refresh_errors),
    ] {
        for k in ErrorKind::ALL {
            errors.push((vec![("op", op), ("kind", k.as_str())], c.get(k)));
        }
    }
    counters(e, "errors", "Failures by operation and kind", &errors)?;
    let r = &s.write_refusals;
    let refusals: Vec<_> = [
        ("unavailable", r.unavailable),
        ("too_large", r.too_large),
        ("duplicate", r.duplicate),
        ("queue_full", r.queue_full),
        ("empty", r.empty),
        ("checksum", r.checksum),
    ]
    .into_iter()
    .map(|(k, v)| (vec![("reason", k)], v))
    .collect();
    counters(e, "write_refusals", "Writes refused, by reason", &refusals)?;
    gauge(
        e,
        "metadata_entries",
        "Pages the metadata cache knows",
        s.metadata_entries,
    )?;
    gauge(
        e,
        "namespaces_followed",
        "Namespaces whose directories are followed",
        s.namespaces_followed,
    )?;
    counter(
        e,
        "directory_resets",
        "Directory streams found gone (flushed or expired)",
        s.directory_resets,
    )?;
    counter(
        e,
        "directory_entries_bad",
        "Directory entries dropped: malformed, or failing their MAC (forged)",
        s.directory_entries_bad,
    )?;
    counter(
        e,
        "breaker_opens",
        "Times the tier was declared down",
        s.breaker_opens,
    )?;
    gauge(
        e,
        "reads_in_flight",
        "Reads accepted and not reported",
        s.reads_in_flight,
    )?;
    gauge(
        e,
        "writes_queued",
        "Writes accepted and not finished",
        s.writes_queued,
    )?;
    histogram(
        e,
        "read_latency_seconds",
        "Latency of successful reads",
        &s.read_latency,
    )?;
    histogram(
        e,
        "write_latency_seconds",
        "Latency of successful write pipelines (one record or a batch)",
        &s.write_latency,
    )
}

impl Collector for RemoteCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Encoded {
        encode(&self.0.snapshot(), &mut encoder)
    }
}
