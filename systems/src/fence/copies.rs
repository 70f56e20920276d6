//! Device copies completing, from the copy engine or reported by copy
//! agents: a restore batch records a failure (its destinations stay pinned
//! until the restore retires; a leased page whose bytes no longer match the
//! checksum it carries is a `checksum` miss); a publish batch indexes the
//! pages that landed under the checksums the copy computed in its own pass.
//! A publish an agent ran lands in the origin's staging area: its pages are
//! copied into their pool slots and checksummed in that same pass here, and
//! the staging slots freed. Whether the operation is done is decided by
//! `settle` once the batch's Transfer is gone.

use bevy_ecs::prelude::*;
use orbitkv_components::api::{CopyFailure, MissReason};
use orbitkv_components::checksum::copy_checksummed;
use orbitkv_components::ecs::{
    Executor, ItemState, Outcome, Page, PublishItem, PublishJob, Residency, Transfer, TransferKind,
};
use orbitkv_gpu::{Completion, CopyError};
use orbitkv_io::checksum::page_checksum;
use orbitkv_io::dram::SlotKey;
use orbitkv_io::tier::DemoteRefused;
use rayon::prelude::*;

use super::{Landing, Ops, Transfers};
use crate::resources::{LoadRates, add_named};

/// How a batch ended, whoever ran it.
enum Landed {
    Ok {
        /// Local publishes: the checksums the copy computed in its pass.
        /// Agent publishes: the checksums the agent took from its own
        /// memory, which each staged page must match.
        checksums: Vec<u64>,
    },
    /// A leased page's bytes no longer matched their checksum (a restore;
    /// for a publish it is a failure like any other).
    Checksum,
    Failed,
}

pub(super) fn land_copies(
    commands: &mut Commands,
    ops: &mut Query<Ops>,
    transfers: &Query<Transfers>,
    landing: &mut Landing,
) {
    let mut done: Vec<Completion> = Vec::new();
    let now_us = landing.clock.now_us;
    landing.copier.0.get_mut().poll(now_us, &mut done);
    let mut landed: Vec<(Entity, Landed)> = Vec::new();
    for completion in done {
        let Some(entity) = landing.index.copies.remove(&completion.token.0) else {
            continue;
        };
        let how = match completion.result {
            Ok(()) => Landed::Ok {
                checksums: completion.checksums,
            },
            Err(CopyError::Checksum { .. }) => Landed::Checksum,
            Err(_) => Landed::Failed,
        };
        landed.push((entity, how));
    }
    for (_, entity, result) in std::mem::take(&mut landing.agents.reported) {
        let (transfer, _) = transfers.get(entity).expect("reported transfers are live");
        // Past its deadline a copy has failed, whatever the agent says.
        let (failure, checksums) = match result {
            Err(f) => (Some(f), Vec::new()),
            Ok(_) if transfer.overdue => (Some(CopyFailure::Lost), Vec::new()),
            Ok(sums) => (None, sums),
        };
        let how = match failure {
            Some(f) => {
                let kind = f.kind().to_owned();
                *landing.metrics.agent_copy_failures.entry(kind).or_default() += 1;
                match f {
                    CopyFailure::Checksum(_) => Landed::Checksum,
                    _ => Landed::Failed,
                }
            }
            None => Landed::Ok { checksums },
        };
        landed.push((entity, how));
    }
    for (entity, how) in landed {
        let (transfer, of) = transfers.get(entity).expect("indexed transfers are live");
        commands.entity(entity).despawn();
        // Past its timeout a copy has failed (its operation replied so),
        // whatever it reports now.
        let how = match how {
            Landed::Ok { .. } if transfer.overdue => Landed::Failed,
            how => how,
        };
        let (mut op, _, job) = ops
            .get_mut(of.0)
            .expect("an operation retires only after its transfers");
        if let TransferKind::Restore { .. } = transfer.kind {
            let moved = match how {
                Landed::Ok { .. } => transfer.bytes,
                _ => 0,
            };
            let now_us = landing.clock.now_us;
            landing.rates.finished(LoadRates::DEVICE, moved, now_us);
        }
        match (&transfer.kind, how) {
            (TransferKind::Restore { .. }, Landed::Ok { .. }) => {}
            (TransferKind::Restore { .. }, Landed::Checksum) => {
                // A leased page's bytes changed since they landed: never
                // a hit. The page stays until evicted, where demotion
                // refuses it for the same reason.
                landing.metrics.checksum_failures += 1;
                op.outcome
                    .get_or_insert(Outcome::Miss(MissReason::Checksum));
            }
            (TransferKind::Restore { .. }, Landed::Failed) => {
                let reason = if transfer.overdue {
                    MissReason::Deadline
                } else {
                    MissReason::IoError
                };
                op.outcome.get_or_insert(Outcome::Miss(reason));
            }
            (TransferKind::Publish { items }, how) => {
                // A failed batch drops its own pages; the others go on.
                let mut job = job.expect("publish transfers belong to publish jobs");
                let checksums = match how {
                    Landed::Ok { checksums } => Some(checksums),
                    _ => None,
                };
                landing.land(commands, &mut job, items, checksums, transfer);
            }
            (TransferKind::TierRead { .. }, _) => unreachable!("reads are indexed by tier"),
        }
    }
}

impl Landing<'_> {
    /// Indexes each landed page of the batch under its checksum; a failed
    /// copy (`copied` is `None`) or a key indexed meanwhile gives its slot
    /// back. `copied` are the checksums the copy computed in its pass, in
    /// batch order (empty when it did not compute them).
    fn land(
        &mut self,
        commands: &mut Commands,
        job: &mut PublishJob,
        items: &[usize],
        copied: Option<Vec<u64>>,
        transfer: &Transfer,
    ) {
        let landed = copied.is_some();
        // Per item, the checksum it is indexed under; `None`: refused.
        let sums: Vec<Option<u64>> = match (copied, transfer.executor) {
            (None, _) => Vec::new(),
            (Some(expected), Executor::Agent(origin)) => {
                self.unstage(job, items, origin, &expected)
            }
            (Some(sums), Executor::Local) if sums.len() == items.len() => {
                sums.into_iter().map(Some).collect()
            }
            // A backend that did not checksum in its pass (none of ours).
            (Some(_), Executor::Local) => self.checksums(job, items),
        };
        if let Executor::Agent(origin) = transfer.executor {
            self.free_staging(job, items, origin);
        }
        for (n, &i) in items.iter().enumerate() {
            let item = &mut job.items[i];
            let slot = item.dram_slot.take().expect("copying items own a slot");
            let sum = sums.get(n).copied().flatten();
            if landed && sum.is_none() {
                // The staged bytes are not what the agent copied from its
                // memory: never stored.
                self.metrics.checksum_failures += 1;
                self.metrics.publish_checksum_refused += 1;
            }
            let Some(checksum) = sum.filter(|_| !self.dram.index.contains_key(&item.key)) else {
                self.dram.free(slot);
                item.state = if sum.is_some() {
                    ItemState::Duplicate
                } else {
                    ItemState::Dropped
                };
                continue;
            };
            let page = Page {
                key: item.key,
                bytes: item.bytes,
                checksum,
                format: item.format,
                residency: Residency {
                    dram_slot: slot,
                    dram_offset: item.dram_offset,
                },
            };
            let entity = commands.spawn(page).id();
            self.dram.index_page(item.key, entity);
            self.dram.make_evictable(entity, slot);
            self.metrics.bytes_published += item.bytes;
            self.write_through(item, slot, checksum);
            item.state = ItemState::Inserted;
        }
    }

    /// Offers a page just published to every tier that shares pages with
    /// other hosts (remote, write-through policy) with the checksum the copy
    /// computed; counted by outcome.
    fn write_through(&mut self, item: &PublishItem, slot: u64, checksum: u64) {
        let Some(bytes) = self.dram.slot_bytes(slot, item.bytes) else {
            return;
        };
        let now_us = self.clock.now_us;
        for t in self.tiers.0.get_mut().iter_mut() {
            let outcome = match t.write_through(&item.key, item.format, bytes, checksum, now_us) {
                Ok(()) => "submitted",
                Err(DemoteRefused::NotWritable) => continue,
                Err(reason) => reason.as_str(),
            };
            add_named(&mut self.metrics.write_through, outcome, 1);
        }
    }

    /// Checksums of pages the copy engine wrote into their pool slots.
    fn checksums(&self, job: &PublishJob, items: &[usize]) -> Vec<Option<u64>> {
        let slices: Vec<&[u8]> = items
            .iter()
            .map(|&i| {
                let item = &job.items[i];
                let slot = item.dram_slot.expect("copying items own a slot");
                self.dram.slot_bytes(slot, item.bytes).expect("live slot")
            })
            .collect();
        slices.par_iter().map(|b| Some(page_checksum(b))).collect()
    }

    /// Moves pages an agent wrote into `origin`'s staging area into their
    /// pool slots, checksumming each in the same pass (in parallel), and
    /// verifies each against `expected`, the checksum the agent took from
    /// its own memory: `None` for a page that differs (its staging slot
    /// was written after the agent's copy) or that the agent gave none
    /// for. This runs in the tick that takes the agent's report, before
    /// `publish_done`: whatever lands in a staging slot later is not read.
    fn unstage(
        &mut self,
        job: &PublishJob,
        items: &[usize],
        origin: orbitkv_components::api::Origin,
        expected: &[u64],
    ) -> Vec<Option<u64>> {
        let staging = self
            .agents
            .staging
            .get(&origin)
            .expect("an origin keeps its staging area while it has copies");
        let sources: Vec<&[u8]> = items
            .iter()
            .map(|&i| {
                let item = &job.items[i];
                let (slot, _) = item.staging.expect("agent items own a staging slot");
                staging
                    .bytes(SlotKey::from_bits(slot), item.bytes)
                    .expect("live staging slot")
            })
            .collect();
        let targets: Vec<(SlotKey, u64)> = items
            .iter()
            .map(|&i| {
                let item = &job.items[i];
                let slot = item.dram_slot.expect("copying items own a slot");
                (SlotKey::from_bits(slot), item.bytes)
            })
            .collect();
        let mut targets = self
            .dram
            .pool
            .slots_mut(&targets)
            .expect("distinct live pool slots");
        let complete = expected.len() == items.len();
        let sums: Vec<u64> = targets
            .par_iter_mut()
            .zip(sources.par_iter())
            .map(|(dst, src)| copy_checksummed(dst, src))
            .collect();
        sums.into_iter()
            .enumerate()
            .map(|(n, sum)| (complete && expected.get(n) == Some(&sum)).then_some(sum))
            .collect()
    }

    /// Returns the batch's staging slots, landed or not.
    fn free_staging(
        &mut self,
        job: &mut PublishJob,
        items: &[usize],
        origin: orbitkv_components::api::Origin,
    ) {
        let staging = self
            .agents
            .staging
            .get_mut(&origin)
            .expect("an origin keeps its staging area while it has copies");
        for &i in items {
            let (slot, _) = job.items[i]
                .staging
                .take()
                .expect("agent items own a staging slot");
            let freed = staging.free(SlotKey::from_bits(slot));
            assert!(freed.is_ok(), "a staging slot is freed once");
        }
    }
}
