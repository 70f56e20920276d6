//! Stage 7, evict: keep DRAM within capacity. When an allocation failed this
//! tick, free least-recently-used unleased pages of that slot class. Leased
//! pages are never in the LRU, so they are never candidates. Each victim is
//! offered to the first lower tier that takes writes (demotion) with the
//! checksum it carries since its bytes landed, which the tier verifies its
//! copy against; a refusal (`checksum` for bytes altered in memory) is
//! counted by reason, and the page is dropped either way.

use bevy_ecs::prelude::*;
use orbitkv_components::ecs::{Leases, Page};

use orbitkv_io::tier::DemoteRefused;

use crate::resources::{Clock, Dram, EvictReason, Limits, Metrics, Tiers};

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
    for (class, wanted) in pressure {
        let mut freed = 0;
        while freed < wanted && budget > 0 {
            let Some(victim) = dram.lru.get_mut(&class).and_then(|lru| lru.pop_oldest()) else {
                break; // nothing evictable in this class
            };
            let (page, leased) = pages.get(victim).expect("the LRU holds live pages");
            assert!(!leased, "a leased page was evictable");
            if let Some(bytes) = dram.slot_bytes(page.residency.dram_slot, page.bytes) {
                let outcome = tiers
                    .iter_mut()
                    .map(|t| t.demote(&page.key, page.format, bytes, page.checksum, clock.now_us))
                    .find(|r| *r != Err(DemoteRefused::NotWritable));
                let key = match outcome {
                    Some(Ok(())) => "submitted",
                    Some(Err(reason)) => reason.as_str(),
                    None => "no_writable_tier",
                };
                *metrics.demotions.entry(key.to_owned()).or_default() += 1;
            }
            dram.index.remove(&page.key);
            dram.free(page.residency.dram_slot);
            commands.entity(victim).despawn();
            *metrics.evictions.entry(EvictReason::Capacity).or_default() += 1;
            freed += 1;
            budget -= 1;
        }
    }
}
