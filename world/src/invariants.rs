//! Invariants of the runtime's state, checked after every tick when
//! `Config::check_invariants` is set (debug builds and tests by default;
//! replays and the fuzzer always check, in release builds too). Each
//! returns a readable violation.
//!
//! What the ECS keeps by itself (relationship lists) is not rechecked;
//! what is kept by hand is: the LRU, the DRAM index and pool, reserved
//! bytes, device-page pins, region slot indexes, registry counts, and that
//! each operation carries exactly the marker of its state.

use std::collections::{HashMap, HashSet};

use bevy_ecs::prelude::*;
use orbitkv_components::api::Origin;
use orbitkv_components::ecs::{
    DevicePage, DeviceRegion, Executor, Handoff, HeldBy, HeldLeases, Instance, ItemState, LeaseOf,
    Leases, NeedState, Operation, Page, PageOf, PublishJob, Recovery, RegionPages, Session,
    Transfer, TransferKind, TransferOf, at,
};
use orbitkv_io::dram::SlotKey;
use orbitkv_systems::resources::{Agents, Budget, Dram, Handoffs, Registry, Tiers};

pub fn check(world: &mut World) -> Vec<String> {
    let mut v = Vec::new();
    leases(world, &mut v);
    handoffs(world, &mut v);
    pages(world, &mut v);
    bytes(world, &mut v);
    needs(world, &mut v);
    pins(world, &mut v);
    regions(world, &mut v);
    states(world, &mut v);
    counts(world, &mut v);
    agents(world, &mut v);
    demotions(world, &mut v);
    evictions(world, &mut v);
    v
}

/// A tick evicts for a slot class at most what its failed allocations
/// still lacked: after evicting, the class's free slots and the slots held
/// for in-place demotions (every victim's slot is one or the other) never
/// exceed the pressure. More would be pages evicted for nothing.
fn evictions(world: &mut World, v: &mut Vec<String>) {
    let dram = world.resource::<Dram>();
    for (&class, e) in &dram.evicted {
        let (free, held) = (dram.pool.free_slots(class), dram.demoting_in(class));
        if e.pages > 0 && free + held > e.pressure {
            v.push(format!(
                "evicted {} page(s) of class {class} for a pressure of {}, \
                 leaving {free} slot(s) free and {held} held",
                e.pages, e.pressure
            ));
        }
    }
}

/// Slots held for in-place demotions are live, owned by no page, counted
/// per class, and each tier holds exactly the tokens the runtime waits on.
fn demotions(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<&Page>();
    let page_slots: HashSet<u64> = q.iter(world).map(|p| p.residency.dram_slot).collect();
    let dram = world.resource::<Dram>();
    let mut by_class: HashMap<u64, u64> = HashMap::new();
    let mut slots = HashSet::new();
    let mut by_tier: HashMap<usize, usize> = HashMap::new();
    for (&(tier, token), &slot) in &dram.demoting {
        if dram.pool.offset(SlotKey::from_bits(slot)).is_none() {
            v.push(format!(
                "in-place demotion {tier}/{token} holds a free slot"
            ));
        }
        if page_slots.contains(&slot) || !slots.insert(slot) {
            v.push(format!("in-place demotion {tier}/{token} shares its slot"));
        }
        *by_class.entry(dram.class_of(slot)).or_default() += 1;
        *by_tier.entry(tier).or_default() += 1;
    }
    let counted: HashMap<u64, u64> = dram
        .demoting_by_class
        .iter()
        .map(|(c, n)| (*c, *n))
        .collect();
    if counted != by_class {
        v.push(format!(
            "demoting slots per class {counted:?}, held {by_class:?}"
        ));
    }
    let Some(mut tiers) = world.get_resource_mut::<Tiers>() else {
        return;
    };
    for (i, tier) in tiers.0.get_mut().iter().enumerate() {
        let held = by_tier.get(&i).copied().unwrap_or(0);
        if tier.demotions_holding() != held {
            v.push(format!(
                "tier {} holds {} in-place demotions, the runtime waits on {held}",
                tier.name(),
                tier.demotions_holding()
            ));
        }
    }
}

/// Every agent copy in flight is exactly one live agent Transfer sent to
/// the origin that owns its regions; each staging slot in use belongs to
/// exactly one copying publish item of that origin.
fn agents(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &Transfer)>();
    let agent_transfers: HashMap<u64, (Entity, Origin)> = q
        .iter(world)
        .filter_map(|(e, t)| match t.executor {
            Executor::Agent(origin) => Some((t.token, (e, origin))),
            Executor::Local => None,
        })
        .collect();
    let agents = world.resource::<Agents>();
    if !agents.reported.is_empty() || !agents.events.is_empty() {
        v.push("agent reports or copy events left over after a tick".into());
    }
    if agents.sent.len() != agent_transfers.len() {
        v.push(format!(
            "{} agent copies sent and unreported, {} agent transfers live",
            agents.sent.len(),
            agent_transfers.len()
        ));
    }
    for (copy, entry) in &agents.sent {
        if agent_transfers.get(copy) != Some(&(entry.transfer, entry.origin)) {
            v.push(format!("agent copy {copy} has no matching transfer"));
        }
    }
    let mut staged: HashMap<Origin, u64> = HashMap::new();
    let mut q = world.query::<(&PublishJob, &Operation)>();
    for (job, op) in q.iter(world) {
        for item in job.items.iter().filter(|i| i.staging.is_some()) {
            if item.state != ItemState::Copying {
                v.push(format!(
                    "a {:?} publish item holds a staging slot",
                    item.state
                ));
            }
            *staged.entry(op.origin).or_default() += 1;
        }
    }
    let agents = world.resource::<Agents>();
    for (origin, pool) in &agents.staging {
        let used = pool.stats().slots_used;
        if used != staged.get(origin).copied().unwrap_or(0) {
            v.push(format!(
                "{origin}'s staging area has {used} slots in use, its publishes hold {}",
                staged.get(origin).copied().unwrap_or(0)
            ));
        }
    }
    for origin in staged.keys() {
        if !agents.staging.contains_key(origin) {
            v.push(format!(
                "{origin} holds staging slots but has no staging area"
            ));
        }
    }
}

/// A lease pins a live page for a live operation (or handoff) of the page's instance
/// (a hit always has the querying instance's namespace).
fn leases(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &LeaseOf, &HeldBy)>();
    for (e, page, op) in q.iter(world) {
        let Some(page) = world.get::<Page>(page.0) else {
            v.push(format!("lease {e:?} points at a missing page"));
            continue;
        };
        // A lease is held by an operation, or by a P/D handoff, of one of
        // the pages it promised (a handoff outlives its instance: a
        // re-registration may retire it).
        let holder = match (world.get::<Operation>(op.0), world.get::<Handoff>(op.0)) {
            (Some(op), _) => op.instance,
            (None, Some(h)) => {
                if !h.promised.contains(&page.key) {
                    v.push(format!(
                        "lease {e:?} pins a page its handoff never promised"
                    ));
                }
                continue;
            }
            (None, None) => {
                v.push(format!("lease {e:?} is held by a missing operation"));
                continue;
            }
        };
        match world.get::<Instance>(holder) {
            Some(inst) if inst.ranks.iter().any(|r| r.namespace == page.key.namespace) => {}
            _ => v.push(format!(
                "lease {e:?} holds a page outside its instance's namespaces"
            )),
        }
    }
}

/// The handoff index matches the standing handoffs: every id once, the
/// reserved bytes their sum, each one's pins its leases, and no key
/// wanted that is in DRAM already (it would never be pinned).
fn handoffs(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &Handoff, Option<&HeldLeases>)>();
    let mut bytes = 0u64;
    let mut count = 0usize;
    let idx = world.resource::<Handoffs>();
    for (e, h, leases) in q.iter(world) {
        count += 1;
        bytes = bytes.saturating_add(h.bytes);
        if idx.by_id.get(&h.id) != Some(&e) {
            v.push(format!(
                "handoff {e:?} ({:#x}) is not indexed by its id",
                h.id
            ));
        }
        let held = leases.map_or(0, |l| l.len()) as u64;
        if held != h.pinned {
            v.push(format!(
                "handoff {e:?} counts {} pins but holds {held} leases",
                h.pinned
            ));
        }
    }
    if count != idx.by_id.len() {
        v.push(format!(
            "{} handoffs indexed, {count} standing",
            idx.by_id.len()
        ));
    }
    if bytes != idx.reserved {
        v.push(format!(
            "handoffs reserve {bytes} bytes, the index says {}",
            idx.reserved
        ));
    }
    let dram = world.resource::<Dram>();
    if let Some(k) = idx.wanted.keys().find(|k| dram.index.contains_key(*k))
        && !dram.landed.contains(k)
    {
        v.push(format!("a handoff waits for a key DRAM holds: {k:?}"));
    }
}

/// Exactly the unleased pages are evictable; each sits alone in a live
/// slot and is indexed under its key.
fn pages(world: &mut World, v: &mut Vec<String>) {
    let mut slots = HashSet::new();
    let mut q = world.query::<(Entity, &Page, Has<Leases>)>();
    let dram = world.resource::<Dram>();
    let mut count = 0;
    for (e, page, leased) in q.iter(world) {
        count += 1;
        let in_lru = dram.lru.values().any(|l| l.contains(&e));
        if in_lru == leased {
            let (is, lru) = if leased { ("", "") } else { ("un", "not ") };
            v.push(format!("page {e:?} is {is}leased and {lru}in the LRU"));
        }
        let key = SlotKey::from_bits(page.residency.dram_slot);
        if dram.pool.offset(key) != Some(page.residency.dram_offset) {
            v.push(format!(
                "page {e:?} is resident in a free or moved DRAM slot"
            ));
        }
        if !slots.insert(page.residency.dram_slot) {
            v.push(format!("page {e:?} shares its DRAM slot"));
        }
        if dram.index.get(&page.key) != Some(&e) {
            v.push(format!("page {e:?} is not indexed under its key"));
        }
    }
    if dram.index.len() != count {
        let n = dram.index.len();
        v.push(format!("DRAM index has {n} keys for {count} pages"));
    }
    if let Err(e) = dram.pool.check_invariants() {
        v.push(format!("host pool: {e}"));
    }
}

/// Reserved bytes equal the sum over live operations, globally and per
/// instance.
fn bytes(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<&Operation>();
    let reserved: u64 = q.iter(world).map(|o| o.bytes_reserved).sum();
    let budget = world.resource::<Budget>().reserved;
    if budget != reserved {
        v.push(format!(
            "budget reserves {budget} bytes, operations hold {reserved}"
        ));
    }
    let mut q = world.query::<&Instance>();
    let by_instance: u64 = q.iter(world).map(|i| i.bytes_reserved).sum();
    if by_instance != reserved {
        v.push(format!(
            "instances reserve {by_instance} bytes, operations hold {reserved}"
        ));
    }
}

/// Needs that claim a lease have one, held by their operation.
fn needs(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &Recovery)>();
    for (e, rec) in q.iter(world) {
        for need in &rec.needs {
            if let NeedState::Leased(l) = need.state
                && world.get::<HeldBy>(l).is_none_or(|h| h.0 != e)
            {
                v.push(format!(
                    "operation {e:?} claims a lease {l:?} it does not hold"
                ));
            }
        }
    }
}

/// A device page's pins are exactly the live operations that use it: as a
/// restore destination (planned, in flight or landed: until the restore
/// retires) or a publish source. A restore batch copies only into pinned
/// destinations.
fn pins(world: &mut World, v: &mut Vec<String>) {
    let mut pins: HashMap<Entity, u32> = HashMap::new();
    let mut q = world.query::<&Recovery>();
    for rec in q.iter(world) {
        for c in &rec.copies {
            *pins.entry(c.device_page).or_default() += 1;
        }
    }
    let mut q = world.query::<(&Transfer, Has<TransferOf>)>();
    for (t, owned) in q.iter(world) {
        if !owned {
            v.push(format!("transfer {} belongs to no operation", t.token));
        }
        if let TransferKind::Restore { device_pages } = &t.kind
            && let Some(dp) = device_pages.iter().find(|dp| !pins.contains_key(dp))
        {
            v.push(format!(
                "restore transfer {} copies into unpinned {dp:?}",
                t.token
            ));
        }
    }
    let mut q = world.query::<&PublishJob>();
    for job in q.iter(world) {
        for item in &job.items {
            *pins.entry(item.device_page).or_default() += 1;
        }
    }
    for (dp, n) in &pins {
        match world.get::<DevicePage>(*dp) {
            None => v.push(format!(
                "device page {dp:?} was freed while {n} copies use it"
            )),
            Some(p) if p.pins != *n => {
                v.push(format!(
                    "device page {dp:?} counts {} pins, {n} exist",
                    p.pins
                ));
            }
            Some(_) => {}
        }
    }
    let mut q = world.query::<(Entity, &DevicePage)>();
    for (e, page) in q.iter(world) {
        if page.pins > 0 && !pins.contains_key(&e) {
            v.push(format!("device page {e:?} is pinned by nothing"));
        }
        if page.free_deferred.is_some() && page.pins == 0 {
            v.push(format!("device page {e:?} was freed but outlived its pins"));
        }
    }
}

/// A region's slot index lists exactly its pages, each at its slot.
fn regions(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &DeviceRegion, Option<&RegionPages>)>();
    for (e, region, pages) in q.iter(world) {
        let listed = pages.map_or(0, |p| p.len());
        if region.by_slot.len() != listed {
            let n = region.by_slot.len();
            v.push(format!("region {e:?} indexes {n} slots for {listed} pages"));
        }
        for (slot, page) in &region.by_slot {
            let ok = world
                .get::<DevicePage>(*page)
                .is_some_and(|p| p.slot == *slot)
                && world.get::<PageOf>(*page).is_some_and(|o| o.0 == e);
            if !ok {
                v.push(format!(
                    "region {e:?} slot {slot} indexes {page:?}, not its page there"
                ));
            }
        }
    }
}

/// Each operation carries exactly one state marker: the one of its state.
fn states(world: &mut World, v: &mut Vec<String>) {
    let mut q = world.query::<(Entity, &Operation)>();
    let ops: Vec<(Entity, orbitkv_components::ecs::OpState)> =
        q.iter(world).map(|(e, o)| (e, o.state())).collect();
    for (e, state) in ops {
        let entity = world.entity(e);
        let marks = [
            entity.contains::<at::Discover>(),
            entity.contains::<at::Validate>(),
            entity.contains::<at::Selected>(),
            entity.contains::<at::Admit>(),
            entity.contains::<at::Reading>(),
            entity.contains::<at::Ready>(),
            entity.contains::<at::RestorePending>(),
            entity.contains::<at::Restoring>(),
            entity.contains::<at::PublishPending>(),
            entity.contains::<at::Publishing>(),
            entity.contains::<at::Finishing>(),
        ];
        // `marks` lists the markers in `OperationState` order.
        let set: Vec<usize> = (0..marks.len()).filter(|&i| marks[i]).collect();
        if set != [state as usize] {
            v.push(format!(
                "operation {e:?} is {state} but carries state markers {set:?}"
            ));
        }
    }
}

/// The registry's counts are the live sessions and operations.
fn counts(world: &mut World, v: &mut Vec<String>) {
    let sessions = world.query::<&Session>().iter(world).count();
    let operations = world.query::<&Operation>().iter(world).count();
    let r = world.resource::<Registry>();
    if (r.sessions, r.operations) != (sessions, operations) {
        v.push(format!(
            "registry counts {} sessions and {} operations; {sessions} and {operations} live",
            r.sessions, r.operations
        ));
    }
}
