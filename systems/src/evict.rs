//! Stage 7, evict: keep DRAM within capacity. When an allocation failed this
//! tick, free least-recently-used unleased pages of that slot class. Leased
//! pages are never in the LRU, so they are never candidates. Each victim is
//! offered to the first lower tier that takes writes (demotion) with the
//! checksum it carries since its bytes landed, which the tier verifies its
//! copy against; a refusal (`checksum` for bytes altered in memory) is
//! counted by reason, and the page is dropped either way.
//!
//! A tier that writes straight from the pool (`Demoted::InPlace`, the SSD
//! store) keeps the victim's slot allocated until it releases the token
//! (`Dram::demoting`, freed by the fence stage's `land`); the page itself
//! leaves the index at once, so nothing can lease or alter it meanwhile.
//!
//! A class's pressure is the slots its failed allocations asked for; every
//! slot that will serve them without another eviction counts against it
//! (`Dram::coming_free`): free slots, including those the fence stage freed
//! earlier in this tick, and slots held for in-place demotions. So a tick
//! never evicts twice for one shortage; `Dram::evicted` records what it did
//! for the invariants to check.

use bevy_ecs::prelude::*;
use orbitkv_components::ecs::{Leases, Page};

use orbitkv_io::tier::{BackingTier, DemoteRefused, Demoted};

use crate::resources::{
    Clock, Dram, EvictReason, Evicted, Limits, Metrics, Removal, Tiers, add_named,
};

pub fn evict(
    mut commands: Commands,
    pages: Query<(&Page, Has<Leases>)>,
    mut dram: ResMut<Dram>,
    mut tiers: ResMut<Tiers>,
    mut metrics: ResMut<Metrics>,
    limits: Res<Limits>,
    clock: Res<Clock>,
) {
    let tiers = tiers.0.get_mut();
    let pressure = std::mem::take(&mut dram.pressure);
    let mut budget = limits.max_evictions_per_tick;
    for (class, asked) in pressure {
        let wanted = asked.saturating_sub(dram.coming_free(class));
        let mut freed = 0;
        while freed < wanted && budget > 0 {
            let Some(victim) = dram.lru.get_mut(&class).and_then(|lru| lru.pop_oldest()) else {
                break; // nothing evictable in this class
            };
            let (page, leased) = pages.get(victim).expect("the LRU holds live pages");
            assert!(!leased, "a leased page was evictable");
            let held = demote(page, &dram, tiers, &mut metrics, clock.now_us);
            let slot = page.residency.dram_slot;
            dram.unindex_page(&page.key, Removal::Evicted);
            match held {
                Some((tier, token)) => dram.hold_for_demotion(tier, token, slot),
                None => dram.free(slot),
            }
            commands.entity(victim).despawn();
            *metrics.evictions.entry(EvictReason::Capacity).or_default() += 1;
            freed += 1;
            budget -= 1;
        }
        let tally = Evicted {
            pressure: asked,
            pages: freed,
        };
        dram.evicted.insert(class, tally);
    }
}

/// Offers a victim to the first tier that takes writes; counted by outcome.
/// Returns the (tier, token) of an in-place demotion, whose slot stays
/// held until the tier releases it.
fn demote(
    page: &Page,
    dram: &Dram,
    tiers: &mut [Box<dyn BackingTier>],
    metrics: &mut Metrics,
    now_us: u64,
) -> Option<(usize, u64)> {
    let bytes = dram.slot_bytes(page.residency.dram_slot, page.bytes)?;
    let outcome = tiers
        .iter_mut()
        .enumerate()
        .map(|(i, t)| {
            (
                i,
                t.demote(&page.key, page.format, bytes, page.checksum, now_us),
            )
        })
        .find(|(_, r)| *r != Err(DemoteRefused::NotWritable));
    let mut held = None;
    let key = match outcome {
        Some((_, Ok(Demoted::Copied))) => "submitted",
        Some((tier, Ok(Demoted::InPlace(token)))) => {
            held = Some((tier, token.0));
            add_named(&mut metrics.demotions, "in_place", 1);
            "submitted"
        }
        Some((_, Err(reason))) => reason.as_str(),
        None => "no_writable_tier",
    };
    add_named(&mut metrics.demotions, key, 1);
    held
}
