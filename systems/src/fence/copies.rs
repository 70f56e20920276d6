//! Device copies completing: a restore batch records a failure (its
//! destinations stay pinned until the restore retires; a leased page whose
//! bytes no longer match the checksum it carries is a `checksum` miss); a
//! publish batch indexes the pages that landed under the checksums the copy
//! computed in its own pass. Whether the operation is done is decided by
//! `settle` once the batch's Transfer is gone.

use bevy_ecs::prelude::*;
use orbitkv_components::api::MissReason;
use orbitkv_components::ecs::{ItemState, Outcome, Page, PublishJob, Residency, TransferKind};
use orbitkv_gpu::{Completion, CopyError};
use orbitkv_io::checksum::page_checksum;
use rayon::prelude::*;

use super::{Landing, Ops, Transfers};

pub(super) fn land_copies(
    commands: &mut Commands,
    ops: &mut Query<Ops>,
    transfers: &Query<Transfers>,
    landing: &mut Landing,
) {
    let mut done: Vec<Completion> = Vec::new();
    let now_us = landing.clock.now_us;
    landing.copier.0.get_mut().poll(now_us, &mut done);
    for completion in done {
        let Some(entity) = landing.index.copies.remove(&completion.token.0) else {
            continue;
        };
        let (transfer, of) = transfers.get(entity).expect("indexed transfers are live");
        commands.entity(entity).despawn();
        let (mut op, _, job) = ops
            .get_mut(of.0)
            .expect("an operation retires only after its transfers");
        let landed = completion.result.is_ok();
        match &transfer.kind {
            TransferKind::Restore { .. } => match completion.result {
                Ok(()) => {}
                Err(CopyError::Checksum { .. }) => {
                    // A leased page's bytes changed since they landed: never
                    // a hit. The page stays until evicted, where demotion
                    // refuses it for the same reason.
                    landing.metrics.checksum_failures += 1;
                    op.outcome
                        .get_or_insert(Outcome::Miss(MissReason::Checksum));
                }
                Err(_) => {
                    op.outcome.get_or_insert(Outcome::Miss(MissReason::IoError));
                }
            },
            TransferKind::Publish { items } => {
                // A failed batch drops its own pages; the others go on.
                let mut job = job.expect("publish transfers belong to publish jobs");
                landing.land(commands, &mut job, items, landed, &completion.checksums);
            }
            TransferKind::TierRead { .. } => unreachable!("reads are indexed by tier"),
        }
    }
}

impl Landing<'_> {
    /// Indexes each landed page of the batch under its checksum; a failed
    /// copy or a key indexed meanwhile gives its slot back. `copied` are the
    /// checksums the copy computed in its pass, in batch order.
    fn land(
        &mut self,
        commands: &mut Commands,
        job: &mut PublishJob,
        items: &[usize],
        landed: bool,
        copied: &[u64],
    ) {
        let sums: Vec<u64> = if landed && copied.len() == items.len() {
            copied.to_vec()
        } else if landed {
            // A backend that did not checksum in its pass (none of ours):
            // computed here, in parallel, as a publish is often hundreds of
            // pages.
            let slices: Vec<&[u8]> = items
                .iter()
                .map(|&i| {
                    let item = &job.items[i];
                    let slot = item.dram_slot.expect("copying items own a slot");
                    self.dram.slot_bytes(slot, item.bytes).expect("live slot")
                })
                .collect();
            slices.par_iter().map(|b| page_checksum(b)).collect()
        } else {
            Vec::new()
        };
        for (n, &i) in items.iter().enumerate() {
            let item = &mut job.items[i];
            let slot = item.dram_slot.take().expect("copying items own a slot");
            if !landed || self.dram.index.contains_key(&item.key) {
                self.dram.free(slot);
                item.state = if landed {
                    ItemState::Duplicate
                } else {
                    ItemState::Dropped
                };
                continue;
            }
            let page = Page {
                key: item.key,
                bytes: item.bytes,
                checksum: sums[n],
                format: item.format,
                residency: Residency {
                    dram_slot: slot,
                    dram_offset: item.dram_offset,
                },
            };
            let entity = commands.spawn(page).id();
            self.dram.index.insert(item.key, entity);
            self.dram.make_evictable(entity, slot);
            self.metrics.bytes_published += item.bytes;
            item.state = ItemState::Inserted;
        }
    }
}
