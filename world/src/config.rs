//! The runtime's configuration. Every bound has a name here; `Config` is
//! serde-deserializable (TOML/JSON) and checked by [`Config::validate`].

use orbitkv_systems::resources::{Limits, RestorePolicy};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub dram: DramConfig,
    pub budget: BudgetConfig,
    pub copy: CopyConfig,
    /// The SSD tier under DRAM; none when absent.
    pub ssd: Option<orbitkv_io::ssd::SsdConfig>,
    /// The remote tier (Redis / Redis Cluster) under the SSD; none when
    /// absent. `docs/remote.md`.
    pub remote: Option<orbitkv_io::remote::RemoteConfig>,
    pub limits: Limits,
    /// When a found prefix is worth loading.
    pub restore: RestorePolicy,
    /// Manager incarnation; session handles from another incarnation are
    /// stale. The manager sets a fresh one at every start.
    pub incarnation: u64,
    /// Check the invariants after every tick (on in debug builds).
    pub check_invariants: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            dram: DramConfig::default(),
            budget: BudgetConfig::default(),
            copy: CopyConfig::default(),
            ssd: None,
            remote: None,
            limits: Limits::default(),
            restore: RestorePolicy::default(),
            incarnation: 1,
            check_invariants: cfg!(debug_assertions),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DramConfig {
    /// Host pool size.
    pub capacity_bytes: u64,
    /// Slab extent: the largest page a slot class can hold.
    pub extent_bytes: u64,
    /// Slot alignment: page sizes round up to it (4 KiB keeps slots
    /// O_DIRECT-ready for the SSD tier).
    pub slot_align_bytes: u64,
    /// Touch every OS page at startup (in parallel) so the first requests do
    /// not pay for page faults.
    pub first_touch: bool,
    /// Put the pool in shared memory that clients map (`orbitkv serve`), so
    /// page bytes never travel in messages.
    pub shared: bool,
}

impl Default for DramConfig {
    fn default() -> Self {
        DramConfig {
            capacity_bytes: 1 << 30,
            extent_bytes: 2 << 20,
            slot_align_bytes: 4096,
            first_touch: true,
            shared: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// Bytes all recoveries may hold reserved together; default 75% of DRAM.
    pub query_budget_bytes: Option<u64>,
    /// Bytes one instance's recoveries may hold; default the query budget.
    pub instance_budget_bytes: Option<u64>,
    /// Share of the query budget speculative work may hold, in percent.
    pub speculative_percent: u8,
    /// Bytes P/D handoffs (`Hold`) may pin together; default 25% of DRAM.
    /// A handoff reserves every page it promises at once; past this it is
    /// refused (`limit_handoff_bytes`) and its pages are not pinned.
    pub handoff_bytes: Option<u64>,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            query_budget_bytes: None,
            instance_budget_bytes: None,
            speculative_percent: 25,
            handoff_bytes: None,
        }
    }
}

/// The most threads `copy.workers` may ask for.
pub const MAX_COPY_WORKERS: usize = 256;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CopyConfig {
    /// Worker threads of the host copy engine (default: one per CPU, at
    /// most 8: `orbitkv_gpu::host::default_copy_workers`).
    pub workers: usize,
    /// Copy batches the engine accepts before `QueueFull`.
    pub max_in_flight_batches: usize,
    /// Device regions live in shared memory engine processes map (set by
    /// `orbitkv serve` for the host backend).
    pub shared_regions: bool,
}

impl Default for CopyConfig {
    fn default() -> Self {
        CopyConfig {
            workers: orbitkv_gpu::host::default_copy_workers(),
            max_in_flight_batches: 64,
            shared_regions: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Invalid(String),
    #[error("DRAM pool: {0}")]
    Pool(String),
}

/// `percent`% of `bytes`, exact but for the final rounding down: the
/// product is taken first, in 128 bits, so a share is never short by the
/// rounding of `bytes / 100`.
pub fn percent_of(bytes: u64, percent: u64) -> u64 {
    let share = u128::from(bytes) * u128::from(percent) / 100;
    u64::try_from(share).unwrap_or(u64::MAX)
}

impl Config {
    pub fn query_budget(&self) -> u64 {
        self.budget
            .query_budget_bytes
            .unwrap_or(percent_of(self.dram.capacity_bytes, 75))
    }

    /// Bytes speculative recoveries may hold together.
    pub fn speculative_budget(&self) -> u64 {
        percent_of(
            self.query_budget(),
            u64::from(self.budget.speculative_percent),
        )
    }

    /// Bytes P/D handoffs may pin together.
    pub fn handoff_budget(&self) -> u64 {
        self.budget
            .handoff_bytes
            .unwrap_or(percent_of(self.dram.capacity_bytes, 25))
    }

    pub fn instance_budget(&self) -> u64 {
        self.budget
            .instance_budget_bytes
            .unwrap_or(self.query_budget())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        let l = &self.limits;
        if self.budget.speculative_percent > 100 {
            return bad("budget.speculative_percent must be at most 100");
        }
        if self.query_budget() == 0 || self.instance_budget() == 0 {
            return bad("budgets must be positive");
        }
        if self.query_budget() > self.dram.capacity_bytes {
            return bad("budget.query_budget_bytes exceeds dram.capacity_bytes");
        }
        // Zero is allowed: no P/D handoff pins anything (each `hold` is
        // refused, and the prefill engine hands its pages over unpinned).
        if self.handoff_budget() > self.dram.capacity_bytes {
            return bad("budget.handoff_bytes exceeds dram.capacity_bytes");
        }
        for (name, v) in [
            ("limits.max_commands_per_tick", l.max_commands_per_tick),
            ("limits.max_inbox", l.max_inbox),
            ("limits.max_reads_per_group", l.max_reads_per_group),
            ("limits.max_inflight_reads", l.max_inflight_reads),
            ("limits.max_copy_batch_pages", l.max_copy_batch_pages),
            ("limits.max_inflight_copies", l.max_inflight_copies),
            ("limits.max_query_pages", l.max_query_pages),
            ("limits.max_publish_pages", l.max_publish_pages),
            ("limits.max_operations", l.max_operations),
            ("limits.max_evictions_per_tick", l.max_evictions_per_tick),
            (
                "limits.max_agent_copies_per_origin",
                l.max_agent_copies_per_origin,
            ),
            ("copy.workers", self.copy.workers),
            (
                "copy.max_in_flight_batches",
                self.copy.max_in_flight_batches,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
        }
        if self.copy.workers > MAX_COPY_WORKERS {
            return bad(&format!("copy.workers is at most {MAX_COPY_WORKERS}"));
        }
        if l.max_region_bytes == 0 {
            return bad("limits.max_region_bytes must be positive");
        }
        if l.max_staging_bytes < self.dram.extent_bytes {
            return bad(
                "limits.max_staging_bytes must hold at least one extent (dram.extent_bytes)",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_workers_default_from_the_cpus_and_are_bounded() {
        let c = Config::default();
        assert!((1..=8).contains(&c.copy.workers), "{}", c.copy.workers);
        c.validate().expect("the default config is valid");
        for (workers, why) in [
            (0, "copy.workers must be positive"),
            (MAX_COPY_WORKERS + 1, "copy.workers is at most 256"),
        ] {
            let mut c = Config::default();
            c.copy.workers = workers;
            match c.validate() {
                Err(ConfigError::Invalid(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{workers} workers: {other:?}"),
            }
        }
        let mut c = Config::default();
        c.copy.workers = MAX_COPY_WORKERS;
        c.validate().expect("the bound itself is allowed");
    }
}
