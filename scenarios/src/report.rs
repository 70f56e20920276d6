//! The replay report: per request, totals, simulated latency per stage,
//! invariant violations and final occupancy. Everything is ordered (no hash
//! map iteration), so the same trace gives a byte-identical report.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use orbitkv_components::api::MissReason;
use serde::{Deserialize, Serialize};

pub const REPORT_VERSION: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub report_version: u32,
    pub trace: String,
    pub requests: Vec<RequestReport>,
    pub totals: Totals,
    /// Simulated latency per stage, µs.
    pub latency_us: BTreeMap<String, Percentiles>,
    pub invariant_violations: u64,
    /// The first violations, verbatim.
    pub violations: Vec<String>,
    /// Restored bytes that differ from what their key holds (false hits).
    pub byte_mismatches: u64,
    pub final_occupancy: Occupancy,
    pub sim_time_us: u64,
    pub ticks: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestReport {
    /// Trace line that issued it.
    pub line: usize,
    pub request: u64,
    pub instance: String,
    /// Tokens covered by the query's full pages past the origin.
    pub tokens: u64,
    pub selected: Option<u64>,
    /// Tokens the engine did not have to recompute.
    pub hit_tokens: u64,
    pub pages_from_dram: u64,
    pub pages_from_tiers: u64,
    /// `restored`, `released`, `miss`, `rejected`, `engine_crashed` (its
    /// session crashed first), `lost_in_restart` (the manager restarted
    /// first) or `pending` (never finished, e.g. a lost completion).
    pub outcome: String,
    pub miss_reason: Option<MissReason>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    pub queries: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub queried_tokens: u64,
    pub misses: BTreeMap<MissReason, u64>,
    /// Refused commands, by error kind.
    pub rejected: BTreeMap<String, u64>,
    /// Bytes moved, by `source_to_target`.
    pub bytes: BTreeMap<String, u64>,
    pub evictions: BTreeMap<String, u64>,
    /// Evicted pages offered to a lower tier: `submitted` or the refusal
    /// reason, then `written` or `failed`.
    pub demotions: BTreeMap<String, u64>,
    pub publish_pages: BTreeMap<String, u64>,
    pub transfers_overdue: u64,
    pub faults_injected: u64,
    /// `$name` references that were never bound (their command was refused
    /// or never ran); replayed as invalid handles.
    pub unbound_references: u64,
    /// Copies of simulated copy agents (sessions opened with `agent`), by
    /// what the agent did: `done`, `late`, `failed`, `vanished`; and
    /// `pages_verified`, restored pages in agent memory checked byte for
    /// byte.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub agent_copies: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p95: u64,
    pub max: u64,
}

impl Percentiles {
    pub fn of(samples: &mut [u64]) -> Self {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_unstable();
        let at = |q: usize| samples[(samples.len() - 1) * q / 100];
        Percentiles {
            count: samples.len() as u64,
            p50: at(50),
            p95: at(95),
            max: *samples.last().expect("non-empty"),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Occupancy {
    pub dram_pages: u64,
    pub dram_bytes_used: u64,
    pub dram_capacity_bytes: u64,
    pub tier_pages: BTreeMap<String, u64>,
    pub operations: u64,
    pub leases: u64,
    pub bytes_reserved: u64,
}

/// One point of the time series `--plot` draws.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub t_us: u64,
    pub hit_rate: f64,
    pub dram_bytes_used: u64,
    pub tier_pages: u64,
    pub bytes_reserved: u64,
}

impl Report {
    /// Human-readable form.
    pub fn render_text(&self) -> String {
        let mut o = String::new();
        let t = &self.totals;
        let _ = writeln!(o, "OrbitKV replay: {}", self.trace);
        let _ = writeln!(
            o,
            "simulated {} µs in {} ticks\n",
            self.sim_time_us, self.ticks
        );
        let _ = writeln!(o, "requests");
        let _ = writeln!(
            o,
            "  {:>5} {:>8} {:<10} {:>7} {:>8} {:>8} {:>5} {:>5}  outcome",
            "line", "request", "instance", "tokens", "selected", "hit_tok", "dram", "tier"
        );
        for r in &self.requests {
            let outcome = match r.miss_reason {
                Some(m) => format!("{} ({m})", r.outcome),
                None => r.outcome.clone(),
            };
            let _ = writeln!(
                o,
                "  {:>5} {:>8} {:<10} {:>7} {:>8} {:>8} {:>5} {:>5}  {outcome}",
                r.line,
                r.request,
                r.instance,
                r.tokens,
                r.selected.map_or("-".into(), |s| s.to_string()),
                r.hit_tokens,
                r.pages_from_dram,
                r.pages_from_tiers,
            );
        }
        let hit_rate = if t.queried_tokens > 0 {
            100.0 * t.hit_tokens as f64 / t.queried_tokens as f64
        } else {
            0.0
        };
        let _ = writeln!(o, "\ntotals");
        let _ = writeln!(
            o,
            "  queries {}  hits {}  token hit rate {hit_rate:.1}% ({} of {})",
            t.queries, t.hits, t.hit_tokens, t.queried_tokens
        );
        let list = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                "none".to_owned()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let misses: BTreeMap<String, u64> =
            t.misses.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let _ = writeln!(o, "  misses: {}", list(&misses));
        let _ = writeln!(o, "  rejected commands: {}", list(&t.rejected));
        let _ = writeln!(o, "  bytes moved: {}", list(&t.bytes));
        let _ = writeln!(o, "  published pages: {}", list(&t.publish_pages));
        let _ = writeln!(o, "  evictions: {}", list(&t.evictions));
        let _ = writeln!(o, "  demotions: {}", list(&t.demotions));
        let _ = writeln!(
            o,
            "  faults injected {}  transfers overdue {}  unbound references {}",
            t.faults_injected, t.transfers_overdue, t.unbound_references
        );
        let _ = writeln!(o, "\nsimulated latency (µs)");
        for (stage, p) in &self.latency_us {
            let _ = writeln!(
                o,
                "  {stage:<8} n={:<5} p50={:<7} p95={:<7} max={}",
                p.count, p.p50, p.p95, p.max
            );
        }
        let _ = writeln!(o, "\ninvariant violations: {}", self.invariant_violations);
        for v in &self.violations {
            let _ = writeln!(o, "  {v}");
        }
        let _ = writeln!(o, "byte mismatches (false hits): {}", self.byte_mismatches);
        let f = &self.final_occupancy;
        let _ = writeln!(
            o,
            "\nfinal occupancy: DRAM {} pages, {} of {} bytes; tiers: {}; operations {}, leases {}, reserved {} bytes",
            f.dram_pages,
            f.dram_bytes_used,
            f.dram_capacity_bytes,
            list(&f.tier_pages),
            f.operations,
            f.leases,
            f.bytes_reserved
        );
        o
    }
}
