//! The presence filter's keeper (`orbitkv_ipc::presence`): after every
//! tick, before the tick's events go out, the pages the tick stored set
//! their bits. The bitmap is rebuilt from the indexes at start, when the
//! page journal lost changes, and when it fills with removed pages' bits.
//! It is open to answers only while every tier can list its pages and
//! none is unreachable.

use std::fs::File;

use orbitkv_ipc::presence::PresenceTable;
use orbitkv_world::{PageChange, Runtime, TierChange};
use tracing::{info, warn};

use crate::metrics::{Counters, Reason};

/// What the page journals said since the last tick, taken once and read by
/// the presence filter and the KV event stream.
#[derive(Default)]
pub struct Changes {
    pub dram: Vec<PageChange>,
    /// DRAM's journal lost changes: `dram` lists every page it holds.
    pub dram_lost: bool,
    pub tiers: Vec<(&'static str, TierChange)>,
    /// A tier's journal lost changes (it lists its index again over the
    /// next drains).
    pub tiers_lost: bool,
}

impl Changes {
    pub fn take(&mut self, rt: &mut Runtime) {
        self.dram_lost = rt.take_page_changes(&mut self.dram);
        self.tiers_lost = rt.take_tier_changes(&mut self.tiers);
    }

    pub fn clear(&mut self) {
        self.dram.clear();
        self.tiers.clear();
        self.dram_lost = false;
        self.tiers_lost = false;
    }
}

/// Above this share of bits set, the bitmap is rebuilt (at least: see
/// `Presence::rebuild_at`).
const REBUILD_FILL: f64 = 0.5;

pub struct Presence {
    table: PresenceTable,
    /// Every tier can list its pages (`BackingTier::list_keys`); if not,
    /// the filter stays closed.
    listable: bool,
    /// The fill that triggers the next rebuild: `REBUILD_FILL`, or twice
    /// the fill right after the last one when the pages held fill more
    /// (infinite when they fill almost half).
    rebuild_at: f64,
    warned_small: bool,
    rebuilds: u64,
    /// Closed for good: the manager is stopping.
    stopping: bool,
}

impl Presence {
    /// A filter of about `bytes` built from what the runtime holds now,
    /// with the page journals turned on (at most `max_changes` between two
    /// ticks). `None` when `bytes` is 0.
    pub fn start(
        bytes: u64,
        max_changes: usize,
        seed: u64,
        rt: &mut Runtime,
        counters: &Counters,
    ) -> std::io::Result<Option<Presence>> {
        if bytes == 0 {
            info!("presence filter off ([serve] presence_filter = 0)");
            return Ok(None);
        }
        let table = PresenceTable::create(bytes, seed)?;
        rt.record_page_changes(max_changes);
        let mut p = Presence {
            table,
            listable: true,
            rebuild_at: REBUILD_FILL,
            warned_small: false,
            rebuilds: 0,
            stopping: false,
        };
        p.rebuild(rt, "start", counters);
        if !p.listable {
            warn!(
                "presence filter closed: a tier (the remote store) cannot list its pages, so \
                 every lookup asks the manager"
            );
        } else {
            info!(
                bytes = p.table.bytes(),
                pages = p.table.bits_set(),
                "presence filter: engines answer certain misses without a round trip"
            );
        }
        p.update_open(rt, counters);
        Ok(Some(p))
    }

    /// What `orbitkv inspect` shows.
    pub fn summary(&self, counters: &Counters) -> orbitkv_ipc::snapshot::Presence {
        let open = self.table.is_open();
        orbitkv_ipc::snapshot::Presence {
            bytes: self.table.bytes(),
            open,
            closed_because: (!open).then(|| {
                if self.listable {
                    "a tier is unreachable".to_owned()
                } else {
                    "a tier cannot list its pages (remote)".to_owned()
                }
            }),
            fill: self.table.fill(),
            misses_answered: counters.presence_misses.get(),
            rebuilds: self.rebuilds,
        }
    }

    /// The descriptor and size a client maps.
    pub fn share(&self) -> std::io::Result<(File, u64)> {
        Ok((self.table.share()?, self.table.bytes()))
    }

    /// Sets the bits of the pages stored since the last tick (or rebuilds),
    /// then opens or closes the filter.
    pub fn apply(&mut self, rt: &mut Runtime, changes: &Changes, counters: &Counters) {
        if changes.dram_lost || changes.tiers_lost {
            self.rebuild(rt, "journal_full", counters);
        } else {
            for c in &changes.dram {
                if let PageChange::Stored(k) = c {
                    self.table.insert(k);
                }
            }
            for (_, c) in &changes.tiers {
                if let TierChange::Stored(k) = c {
                    self.table.insert(k);
                }
            }
            if self.table.fill() > self.rebuild_at {
                self.rebuild(rt, "full", counters);
            }
        }
        self.update_open(rt, counters);
    }

    fn rebuild(&mut self, rt: &mut Runtime, why: &str, counters: &Counters) {
        let started = std::time::Instant::now();
        let mut listable = true;
        self.table
            .rebuild(&mut |insert| listable = rt.list_stored_keys(insert));
        self.listable = listable;
        let fill = self.table.fill();
        // The next rebuild for fullness when removed pages' bits doubled
        // the fill; never, when the pages held alone fill almost half (a
        // rebuild would follow every tick; the filter then fills up and
        // answers less and less, and the warning below says why).
        self.rebuild_at = if fill < 0.45 {
            (2.0 * fill).max(REBUILD_FILL)
        } else {
            f64::INFINITY
        };
        self.rebuilds += 1;
        counters
            .presence_rebuilds
            .get_or_create(&Reason { reason: why.into() })
            .inc();
        info!(
            reason = why,
            pages = self.table.bits_set(),
            took_us = started.elapsed().as_micros() as u64,
            "presence filter rebuilt"
        );
        if fill > REBUILD_FILL / 2.0 && !self.warned_small {
            self.warned_small = true;
            warn!(
                bytes = self.table.bytes(),
                fill,
                "presence filter is small for the pages held: raise [serve] presence_filter \
                 (engines ask the manager more often)"
            );
        }
    }

    /// Closes it for good (a graceful stop): clients ask the socket, and
    /// find the manager gone.
    pub fn close(&mut self) {
        self.stopping = true;
        self.table.set_open(false);
    }

    fn update_open(&mut self, rt: &mut Runtime, counters: &Counters) {
        self.table.beat();
        let open = self.listable && !self.stopping && !rt.some_tier_unavailable();
        if open != self.table.is_open() {
            self.table.set_open(open);
            if self.listable {
                info!(open, "presence filter (closed while a tier is unreachable)");
            }
        }
        counters.presence_open.set(i64::from(open));
        counters
            .presence_fill_permille
            .set((self.table.fill() * 1000.0) as i64);
    }
}
