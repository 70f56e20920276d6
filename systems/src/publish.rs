//! Stage 5, publish: device → DRAM copies. DRAM slots are allocated for new
//! keys all or none (so two publishes cannot each hold half of the space
//! the other needs), then the pinned source pages are copied in batches as
//! copy room allows, until the publish's deadline.

use bevy_ecs::prelude::*;
use orbitkv_components::api::Origin;
use orbitkv_components::ecs::{
    Executor, ItemState, OpState, Operation, Outcome, PublishItem, PublishJob, TransferKind,
    Transfers, at,
};
use orbitkv_gpu::{Direction, PageCopy};

use crate::copies::{Copies, Devices, Refused};
use crate::lifecycle::{finish, set_state};
use crate::resources::Dram;

type PublishOps<'a> = (
    Entity,
    &'a mut Operation,
    &'a mut PublishJob,
    Option<&'a Transfers>,
);

type Publishes = Or<(With<at::PublishPending>, With<at::Publishing>)>;

pub fn publish(
    mut commands: Commands,
    mut ops: Query<PublishOps, Publishes>,
    devices: Devices,
    mut dram: ResMut<Dram>,
    mut copies: Copies,
) {
    for (entity, mut op, mut job, in_flight) in &mut ops {
        if op.state() == OpState::PublishPending {
            match allocate(&mut job, &mut dram) {
                Allocated::All => set_state(&mut commands, entity, &mut op, OpState::Publishing),
                Allocated::Short => continue,
                Allocated::Never => {
                    finish(&mut commands, entity, &mut op, Outcome::Published);
                    continue;
                }
            }
        }
        // Past the deadline, or cancelled, or failed: pages still waiting
        // for copy room are dropped.
        if copies.now_us() >= op.deadline_us || op.outcome.is_some() {
            drop_unsent(&mut job, &mut dram);
        }
        let sent = send(
            &mut commands,
            entity,
            &mut job,
            &devices,
            &mut dram,
            &mut copies,
        );
        let in_flight = in_flight.map_or(0, |t| t.len()) + sent;
        if in_flight == 0 && !job.items.iter().any(|i| i.state == ItemState::Waiting) {
            finish(&mut commands, entity, &mut op, Outcome::Published);
        }
    }
}

enum Allocated {
    /// Every new key has a slot (or there were none).
    All,
    /// Not now: the evict stage makes room.
    Short,
    /// More than DRAM can ever hold: the waiting pages are dropped.
    Never,
}

/// Allocates a DRAM slot for every new key, all or none.
fn allocate(job: &mut PublishJob, dram: &mut Dram) -> Allocated {
    let wanted: u64 = job
        .items
        .iter()
        .filter(|i| i.state == ItemState::Waiting)
        .map(|i| i.bytes.next_multiple_of(dram.pool.slot_align()))
        .sum();
    if wanted > dram.pool.capacity() {
        for item in job
            .items
            .iter_mut()
            .filter(|i| i.state == ItemState::Waiting)
        {
            item.state = ItemState::Dropped;
        }
        return Allocated::Never;
    }
    let mut fresh = Vec::new();
    for (index, item) in job.items.iter_mut().enumerate() {
        if item.state != ItemState::Waiting || item.dram_slot.is_some() {
            continue;
        }
        if dram.index.contains_key(&item.key) || dram.reading.contains_key(&item.key) {
            item.state = ItemState::Duplicate;
            continue;
        }
        let Some((slot, offset)) = dram.alloc(item.bytes) else {
            give_back(job, fresh, dram);
            return Allocated::Short;
        };
        item.dram_slot = Some(slot);
        item.dram_offset = offset;
        fresh.push(index);
    }
    Allocated::All
}

/// Frees this tick's slots, and asks the evict stage at once for every
/// slot the job needs, not one slot per tick: the ones still missing and
/// the ones given back (free again, they count against the pressure, so
/// the eviction covers exactly the shortfall).
fn give_back(job: &mut PublishJob, fresh: Vec<usize>, dram: &mut Dram) {
    let align = dram.pool.slot_align();
    let needed: Vec<u64> = job
        .items
        .iter()
        .filter(|i| i.state == ItemState::Waiting)
        .map(|i| i.bytes.next_multiple_of(align))
        .collect();
    // The failed allocation already recorded one.
    for class in needed.into_iter().skip(1) {
        *dram.pressure.entry(class).or_default() += 1;
    }
    for index in fresh {
        let item = &mut job.items[index];
        dram.free(item.dram_slot.take().expect("allocated above"));
    }
}

fn drop_unsent(job: &mut PublishJob, dram: &mut Dram) {
    for item in job
        .items
        .iter_mut()
        .filter(|i| i.state == ItemState::Waiting)
    {
        if let Some(slot) = item.dram_slot.take() {
            dram.free(slot);
        }
        item.state = ItemState::Dropped;
    }
}

/// Submits batches of allocated pages while there is room; returns how
/// many batches it submitted. A batch goes to one executor; pages from an
/// agent-owned region each take a slot of the origin's staging area first
/// (the agent writes there, never into the pool).
fn send(
    commands: &mut Commands,
    entity: Entity,
    job: &mut PublishJob,
    devices: &Devices,
    dram: &mut Dram,
    copies: &mut Copies,
) -> usize {
    let mut sent = 0;
    loop {
        let Some(first) = job.items.iter().position(|i| i.state == ItemState::Waiting) else {
            return sent;
        };
        let executor = devices.source(job.items[first].device_page).1.executor;
        let mut batch: Vec<usize> = (first..job.items.len())
            .filter(|&i| {
                job.items[i].state == ItemState::Waiting
                    && devices.source(job.items[i].device_page).1.executor == executor
            })
            .take(copies.batch_pages())
            .collect();
        if let Executor::Agent(origin) = executor {
            if !copies.has_room(executor) {
                return sent;
            }
            let staged = stage(job, &batch, copies, origin);
            if staged == 0 {
                return sent; // the staging area is full: wait for landings
            }
            batch.truncate(staged);
        }
        let page_copies: Vec<PageCopy> = batch
            .iter()
            .map(|&i| source_copy(&job.items[i], devices))
            .collect();
        let kind = TransferKind::Publish {
            items: batch.clone(),
        };
        let from_device = Direction::DeviceToHost;
        match copies.submit(commands, entity, from_device, &page_copies, kind, executor) {
            Ok(()) => {
                sent += 1;
                for &i in &batch {
                    job.items[i].state = ItemState::Copying;
                }
            }
            Err(Refused::Full) => return sent,
            Err(Refused::Failed) => {
                for &i in &batch {
                    let item = &mut job.items[i];
                    dram.free(item.dram_slot.take().expect("allocated"));
                    item.state = ItemState::Dropped;
                }
            }
        }
    }
}

/// An agent's publish batch takes at most this share of its staging area,
/// so the agent fills the next batch while the manager moves the last one
/// into the pool: one batch as large as the area serializes the two.
const STAGING_PARTS: u64 = 4;

/// Gives the leading items of `batch` a staging slot each, stopping at the
/// first that does not fit, or once the batch holds its share of the area
/// (`STAGING_PARTS`; always at least one page); returns how many got one.
fn stage(job: &mut PublishJob, batch: &[usize], copies: &mut Copies, origin: Origin) -> usize {
    let Some(staging) = copies.staging(origin) else {
        return 0; // no staging area: the items wait and drop at the deadline
    };
    let share = staging.capacity() / STAGING_PARTS;
    let mut bytes = 0;
    let mut staged = 0;
    for &i in batch {
        let item = &mut job.items[i];
        debug_assert!(item.staging.is_none(), "waiting items hold no staging");
        if staged > 0 && bytes + item.bytes > share {
            break;
        }
        let Ok(slot) = staging.alloc(item.bytes) else {
            break;
        };
        bytes += item.bytes;
        let offset = staging.offset(slot).expect("a fresh slot has an offset");
        item.staging = Some((slot.to_bits(), offset));
        staged += 1;
    }
    staged
}

/// The copy of one item: from its source device page into its DRAM slot,
/// or into its staging slot when an agent runs it.
fn source_copy(item: &PublishItem, devices: &Devices) -> PageCopy {
    let (page, region) = devices.source(item.device_page);
    PageCopy {
        host_offset: item.staging.map_or(item.dram_offset, |(_, offset)| offset),
        region: region.engine_region,
        device_offset: u64::from(page.slot) * region.page_bytes,
        len: item.bytes,
        // Device -> host: the copy reports the checksum of what landed.
        expect_checksum: None,
        sum: orbitkv_gpu::SumOf::Destination,
    }
}
