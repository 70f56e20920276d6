//! Invariants of the runtime's state, checked after every tick in debug
//! builds and tests (and on demand). Each returns a readable violation.

use std::collections::{HashMap, HashSet};

use bevy_ecs::prelude::*;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Instance, Lease, NeedState, Operation, Page, Recovery, Transfer,
    TransferKind,
};
use orbitkv_io::dram::SlotKey;
use orbitkv_systems::resources::{Budget, Dram};

pub fn check(world: &mut World) -> Vec<String> {
    let mut v = Vec::new();

    // Every lease points to a live page and a live operation, and its page
    // belongs to the operation's instance (a hit always has the querying
    // instance's namespace).
    let leases: Vec<(Entity, Lease)> = world
        .query::<(Entity, &Lease)>()
        .iter(world)
        .map(|(e, l)| (e, *l))
        .collect();
    let mut per_page: HashMap<Entity, u32> = HashMap::new();
    for (e, lease) in &leases {
        *per_page.entry(lease.page).or_default() += 1;
        let Some(page) = world.get::<Page>(lease.page) else {
            v.push(format!(
                "lease {e:?} points at a missing page {:?}",
                lease.page
            ));
            continue;
        };
        let Some(op) = world.get::<Operation>(lease.operation) else {
            v.push(format!(
                "lease {e:?} points at a missing operation {:?}",
                lease.operation
            ));
            continue;
        };
        match world.get::<Instance>(op.instance) {
            Some(inst) if inst.ranks.iter().any(|r| r.namespace == page.key.namespace) => {}
            _ => v.push(format!(
                "lease {e:?} holds a page outside its instance's namespaces"
            )),
        }
    }

    // Page lease counts match, and exactly the unleased pages are evictable.
    let mut slots = HashSet::new();
    let pages: Vec<(Entity, Page)> = {
        let mut q = world.query::<(Entity, &Page)>();
        q.iter(world).map(|(e, p)| (e, p.clone())).collect()
    };
    let dram = world.resource::<Dram>();
    for (e, page) in &pages {
        let leased = per_page.get(e).copied().unwrap_or(0);
        if leased != page.leases {
            v.push(format!(
                "page {e:?} counts {} leases, {} exist",
                page.leases, leased
            ));
        }
        let in_lru = dram.lru.values().any(|l| l.contains(e));
        if in_lru != (page.leases == 0) {
            v.push(format!(
                "page {e:?} with {} leases is {}in the LRU",
                page.leases,
                if in_lru { "" } else { "not " }
            ));
        }
        // No page is both free and resident.
        let key = SlotKey::from_bits(page.residency.dram_slot);
        if dram.pool.offset(key) != Some(page.residency.dram_offset) {
            v.push(format!(
                "page {e:?} is resident in a free or moved DRAM slot"
            ));
        }
        if !slots.insert(page.residency.dram_slot) {
            v.push(format!("page {e:?} shares its DRAM slot"));
        }
        if dram.index.get(&page.key) != Some(e) {
            v.push(format!("page {e:?} is not indexed under its key"));
        }
    }
    if dram.index.len() != pages.len() {
        v.push(format!(
            "DRAM index has {} keys for {} pages",
            dram.index.len(),
            pages.len()
        ));
    }
    if let Err(e) = dram.pool.check_invariants() {
        v.push(format!("host pool: {e}"));
    }

    // Reserved bytes equal the sum over live operations.
    let ops: Vec<(Entity, Operation)> = world
        .query::<(Entity, &Operation)>()
        .iter(world)
        .map(|(e, o)| (e, o.clone()))
        .collect();
    let reserved: u64 = ops.iter().map(|(_, o)| o.bytes_reserved).sum();
    let budget = world.resource::<Budget>();
    if budget.reserved != reserved {
        v.push(format!(
            "budget reserves {} bytes, operations hold {reserved}",
            budget.reserved
        ));
    }
    let by_instance: u64 = world
        .query::<&Instance>()
        .iter(world)
        .map(|i| i.bytes_reserved)
        .sum();
    if by_instance != reserved {
        v.push(format!(
            "instances reserve {by_instance} bytes, operations hold {reserved}"
        ));
    }

    // Needs that claim a lease have one.
    for (e, rec) in world.query::<(Entity, &Recovery)>().iter(world) {
        for need in &rec.needs {
            if let NeedState::Leased(l) = need.state
                && world
                    .get::<Lease>(l)
                    .is_none_or(|lease| lease.operation != e)
            {
                v.push(format!(
                    "operation {e:?} claims a lease {l:?} it does not hold"
                ));
            }
        }
    }

    // No device page is freed while a transfer targets it, and pins match.
    let mut pins: HashMap<Entity, u32> = HashMap::new();
    let transfers: Vec<Transfer> = world.query::<&Transfer>().iter(world).cloned().collect();
    for t in &transfers {
        if world.get::<Operation>(t.operation).is_none() {
            v.push(format!("transfer {} outlived its operation", t.token));
        }
        if let TransferKind::Restore { device_pages } = &t.kind {
            for dp in device_pages {
                *pins.entry(*dp).or_default() += 1;
            }
        }
    }
    // Restore copies waiting for copy room pin their destinations too.
    for rec in world.query::<&Recovery>().iter(world) {
        for c in rec.copies.get(rec.copies_sent..).unwrap_or_default() {
            *pins.entry(c.device_page).or_default() += 1;
        }
    }
    for job in world
        .query::<&orbitkv_components::ecs::PublishJob>()
        .iter(world)
    {
        for item in &job.items {
            *pins.entry(item.device_page).or_default() += 1;
        }
    }
    for (dp, n) in &pins {
        match world.get::<DevicePage>(*dp) {
            None => v.push(format!(
                "device page {dp:?} was freed while {n} transfers target it"
            )),
            Some(page) if page.pins != *n => v.push(format!(
                "device page {dp:?} counts {} pins, {n} exist",
                page.pins
            )),
            Some(_) => {}
        }
    }
    for (e, page) in world.query::<(Entity, &DevicePage)>().iter(world) {
        if page.pins > 0 && !pins.contains_key(&e) {
            v.push(format!("device page {e:?} is pinned by nothing"));
        }
        match world.get::<DeviceRegion>(page.region) {
            Some(r) if r.live.get(&page.slot) == Some(&e) => {}
            _ => v.push(format!("device page {e:?} is not its region's live slot")),
        }
    }
    v
}
