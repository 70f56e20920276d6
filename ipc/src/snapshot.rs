//! [`Snapshot`]: a running manager's live state, the answer to an
//! `Inspect` frame (`orbitkv inspect`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One connected client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionSummary {
    pub id: u64,
    /// The name the client gave in `Hello` (or its pid).
    pub client: String,
    pub pid: i32,
    pub sessions: usize,
    pub regions: usize,
    /// Bytes queued for it that it has not read yet.
    pub outbox_bytes: usize,
    pub hot: bool,
}

/// Counts over a recent window (`orbitkv inspect` shows the last minute).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub seconds: f64,
    pub queries: u64,
    pub hits: u64,
    /// `hits / queries`, 0 without queries.
    pub hit_rate: f64,
    pub hit_tokens: u64,
    pub queried_tokens: u64,
    pub bytes_restored: u64,
    pub bytes_published: u64,
    /// Misses by reason (`MissReason` names).
    pub misses: BTreeMap<String, u64>,
    /// Evictions by reason.
    pub evictions: BTreeMap<String, u64>,
    /// Refused commands by `"<command>.<reason>"` (e.g.
    /// `register_device_region.unknown_rank`): an engine the manager
    /// refuses gets no hits, and this says why.
    #[serde(default)]
    pub refusals: BTreeMap<String, u64>,
    pub checksum_failures: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub incarnation: u64,
    pub uptime_s: f64,
    pub connections: Vec<ConnectionSummary>,
    pub instances: usize,
    pub sessions: usize,
    pub operations: usize,
    pub operations_by_state: BTreeMap<String, usize>,
    pub leases: usize,
    pub transfers: usize,
    pub device_pages: usize,
    pub bytes_reserved: u64,
    /// Pages resident in DRAM.
    pub pages: usize,
    pub pool_bytes_used: u64,
    pub pool_capacity_bytes: u64,
    /// Lower tiers: name → (bytes used, capacity), where the tier says.
    pub tiers: BTreeMap<String, (u64, u64)>,
    /// Since the manager started.
    pub total: Window,
    /// The last minute (or since start, when younger).
    pub last_minute: Window,
    /// What `orbitkv health` decides readiness on.
    #[serde(default)]
    pub health: Health,
    /// P/D handoffs (`Hold`): standing now, and how the ended ones ended.
    #[serde(default)]
    pub handoffs: Handoffs,
    /// The presence filter, when the manager keeps one.
    #[serde(default)]
    pub presence: Option<Presence>,
}

/// The presence filter's line of `orbitkv inspect`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Presence {
    pub bytes: u64,
    /// Whether engines may answer certain misses from it now; if not, why.
    pub open: bool,
    pub closed_because: Option<String>,
    /// Share of its bits set.
    pub fill: f64,
    /// Misses engines answered from it, since the manager started.
    pub misses_answered: u64,
    pub rebuilds: u64,
}

/// The P/D handoffs' line of `orbitkv inspect`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoffs {
    pub standing: usize,
    pub pinned_pages: u64,
    pub reserved_bytes: u64,
    pub budget_bytes: u64,
    pub held: u64,
    pub taken: u64,
    pub expired: u64,
}

/// Readiness signals (`orbitkv health`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Lower tiers that say they are down (the remote tier's breaker).
    pub tiers_down: Vec<String>,
    /// Live operations holding an overdue transfer: what they pinned stays
    /// pinned until the late I/O reports (the pool cannot take it back).
    pub overdue_operations: usize,
    /// Commands the runtime's inbox still takes (0: the loop is behind).
    pub inbox_room: usize,
}
