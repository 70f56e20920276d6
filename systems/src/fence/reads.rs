//! Lower-tier reads landing in DRAM: verified against the checksum the
//! tier indexed, then indexed and (if an operation still wants the page)
//! leased at once, so eviction cannot take it before the read stage sees
//! it. Also counts finished demotions and frees the slots of in-place
//! demotions their tier released.

use bevy_ecs::prelude::*;
use orbitkv_components::api::MissReason;
use orbitkv_components::ecs::{
    NeedState, OpState, Outcome, Page, Recovery, Residency, Transfer, TransferKind,
};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::tier::{BackingTier, ReadDone, TierError, local_miss_reason};

use super::{Landing, Ops, Transfers};
use crate::lifecycle::{finish, take_lease};
use crate::resources::{Dram, Metrics, add_named};

/// One landed page: what the read was for.
struct Landed {
    tier: usize,
    operation: Entity,
    key: orbitkv_components::StateKey,
    page: Page,
    pos: orbitkv_components::api::PagePos,
}

pub(super) fn land_reads(
    commands: &mut Commands,
    ops: &mut Query<Ops>,
    transfers: &Query<Transfers>,
    landing: &mut Landing,
) {
    for (tier, done) in landing.poll() {
        let Some(entity) = landing.index.reads.remove(&(tier, done.token.0)) else {
            continue; // not ours: a backend bug, reported by the invariants
        };
        let (transfer, of) = transfers.get(entity).expect("indexed transfers are live");
        commands.entity(entity).despawn();
        let Some(landed) = landed(tier, of.0, transfer) else {
            continue;
        };
        landing.dram.reading.remove(&landed.key);
        let mut op = ops.get_mut(landed.operation).ok();
        let verified = landing.verify(&landed, done);
        let moved = if verified.is_ok() { transfer.bytes } else { 0 };
        let now_us = landing.clock.now_us;
        landing.rates.finished(1 + tier, moved, now_us);
        if let Err(reason) = verified {
            landing.dram.free(landed.page.residency.dram_slot);
            if let Some((op, ..)) = op.as_mut()
                && op.state() == OpState::Reading
            {
                finish(commands, landed.operation, op, Outcome::Miss(reason));
            }
            continue;
        }
        let wanted = op.and_then(|(op, rec, _)| rec.filter(|_| op.state() == OpState::Reading));
        landing.index_page(commands, landed, wanted);
    }
}

fn landed(tier: usize, operation: Entity, t: &Transfer) -> Option<Landed> {
    let TransferKind::TierRead {
        key,
        format,
        dram_slot,
        dram_offset,
        bytes,
        checksum,
        pos,
        ..
    } = t.kind
    else {
        return None;
    };
    let page = Page {
        key,
        bytes,
        checksum,
        format,
        residency: Residency {
            dram_slot,
            dram_offset,
        },
    };
    Some(Landed {
        tier,
        operation,
        key,
        page,
        pos,
    })
}

impl Landing<'_> {
    /// Every tier's finished reads; finished demotions are counted, and
    /// released in-place demotions give their slots back.
    fn poll(&mut self) -> Vec<(usize, ReadDone)> {
        let now_us = self.clock.now_us;
        let mut reads = Vec::new();
        let tiers = self.tiers.0.get_mut();
        for (i, tier) in tiers.iter_mut().enumerate() {
            let mut done = Vec::new();
            tier.poll(now_us, &mut done);
            reads.extend(done.into_iter().map(|d| (i, d)));
        }
        settle_demotions(tiers, &mut self.dram, &mut self.metrics, now_us);
        reads
    }

    /// Right after the read: a page is indexed only with the checksum it
    /// was written with.
    fn verify(&mut self, landed: &Landed, done: ReadDone) -> Result<(), MissReason> {
        let p = &landed.page;
        match done.result {
            Ok(()) => match self.dram.slot_bytes(p.residency.dram_slot, p.bytes) {
                Some(b) if page_checksum(b) == p.checksum => {}
                _ => {
                    self.metrics.checksum_failures += 1;
                    return Err(MissReason::Checksum);
                }
            },
            // The tier's own header or checksum check failed: never served.
            // Each tier names its failures (a remote store's are `remote_*`).
            Err(e) => {
                if e == TierError::Corrupt {
                    self.metrics.checksum_failures += 1;
                }
                let reason = match self.tiers.0.get_mut().get(landed.tier) {
                    Some(t) => t.miss_reason(&e),
                    None => local_miss_reason(&e),
                };
                return Err(reason);
            }
        }
        self.metrics.bytes_read += p.bytes;
        if let Some(t) = self.tiers.0.get_mut().get(landed.tier) {
            add_named(&mut self.metrics.bytes_read_by_tier, t.name(), p.bytes);
        }
        Ok(())
    }

    /// Indexes a verified page, leased to the operation that read it if it
    /// still wants it; evictable otherwise.
    fn index_page(
        &mut self,
        commands: &mut Commands,
        landed: Landed,
        wanted: Option<Mut<Recovery>>,
    ) {
        let slot = landed.page.residency.dram_slot;
        if self.dram.index.contains_key(&landed.key) {
            // Published meanwhile: keep the indexed copy, and let the read
            // stage lease that one.
            self.dram.free(slot);
            if let Some(mut rec) = wanted
                && let Some(need) = rec.needs.iter_mut().find(|n| n.pos == landed.pos)
                && need.state == NeedState::Reading
            {
                need.state = NeedState::Pending;
            }
            return;
        }
        let (residency, checksum) = (landed.page.residency, landed.page.checksum);
        let page = commands.spawn(landed.page).id();
        self.dram.index_page(landed.key, page);
        let need = wanted.and_then(|rec| {
            let rec = rec.into_inner();
            rec.needs
                .iter_mut()
                .find(|n| n.pos == landed.pos && n.state == NeedState::Reading)
        });
        match need {
            Some(need) => {
                need.state = NeedState::Leased(take_lease(commands, page, landed.operation));
                need.residency = Some(residency);
                need.checksum = checksum;
            }
            None => self.dram.make_evictable(page, slot),
        }
    }
}

/// Counts the demotions each tier finished (`written` or `failed`) and
/// frees the slots of in-place demotions it released. The fence stage runs
/// it every tick; `Runtime::finish_demotions` once more at shutdown, after
/// the tiers finished everything they accepted.
pub fn settle_demotions(
    tiers: &mut [Box<dyn BackingTier>],
    dram: &mut Dram,
    metrics: &mut Metrics,
    now_us: u64,
) {
    let mut demoted = Vec::new();
    let mut released = Vec::new();
    for (i, tier) in tiers.iter_mut().enumerate() {
        tier.poll_demotions(now_us, &mut demoted);
        tier.poll_released(&mut released);
        for token in released.drain(..) {
            if !dram.release_demotion(i, token.0) {
                // A tier bug, never a double free: counted, and the
                // invariants compare each tier's holding count with the
                // runtime's.
                let key = "release_of_unknown_token".to_owned();
                *metrics.demotions.entry(key).or_default() += 1;
            }
        }
    }
    for d in demoted {
        let key = if d.is_ok() { "written" } else { "failed" };
        add_named(&mut metrics.demotions, key, 1);
    }
}
