//! Stage 4, read: for the selected boundary only, admit the operation against
//! the byte budget (`admit`), then lease what DRAM already holds and read
//! the rest from lower tiers into DRAM slots, at most `max_reads_per_group`
//! at a time per group (`read`). A group is complete when every page of its
//! range is leased; the operation is `Ready` when every group is.

use bevy_ecs::prelude::*;
use bevy_ecs::system::SystemParam;
use orbitkv_components::StateKey;
use orbitkv_components::api::{Event, LeaseInfo, MissReason, PagePos};
use orbitkv_components::ecs::{
    Executor, Instance, LoadPlan, NeedState, OpState, Operation, Outcome, Page, PageNeed, Recovery,
    Transfer, TransferKind, TransferOf, at,
};
use orbitkv_io::tier::{BackingTier, TierError};

use crate::lifecycle::{finish, set_state, take_lease};
use crate::resources::{
    Budget, Clock, Dram, Limits, LoadRates, Metrics, Outbox, Tiers, TransferIndex,
};

type Recoveries<'a> = (Entity, &'a mut Operation, &'a mut Recovery);
type AdmitOrRead = Or<(With<at::Admit>, With<at::Reading>)>;

/// The byte budget and the instances' shares of it.
#[derive(SystemParam)]
pub struct Admission<'w, 's> {
    instances: Query<'w, 's, &'static mut Instance>,
    budget: ResMut<'w, Budget>,
}

/// Admits waiting recoveries, then reads for every admitted one (those
/// admitted now included: both in one system, so an admitted recovery
/// starts reading in the same tick). A recovery past its deadline starts
/// nothing more: `expire` ends it in this tick, and every transfer it has
/// was submitted before its deadline (so it replies by its deadline plus
/// the transfer timeout).
pub fn read(
    mut commands: Commands,
    mut ops: Query<Recoveries, AdmitOrRead>,
    mut admission: Admission,
    pages: Query<&Page>,
    mut dram: ResMut<Dram>,
    mut reads: Reads,
) {
    let now_us = reads.clock.now_us;
    admit(&mut commands, &mut ops, &mut admission, now_us);
    for (entity, mut op, mut rec) in &mut ops {
        if op.state() != OpState::Reading || op.deadline_us <= now_us {
            continue;
        }
        let Ok(instance) = admission.instances.get(op.instance) else {
            finish(
                &mut commands,
                entity,
                &mut op,
                Outcome::Miss(MissReason::Namespace),
            );
            continue;
        };
        let step = ReadStep { entity, instance };
        let started = step.run(&mut commands, &mut rec, &pages, &mut dram, &mut reads);
        if let Err(reason) = started {
            // A partial result is released (at retire) and becomes a miss.
            finish(&mut commands, entity, &mut op, Outcome::Miss(reason));
            continue;
        }
        if rec
            .needs
            .iter()
            .all(|n| matches!(n.state, NeedState::Leased(_)))
        {
            reads.outbox.push(op.origin, ready_event(entity, &rec));
            match rec.load.take() {
                None => set_state(&mut commands, entity, &mut op, OpState::Ready),
                Some(plan) => {
                    step.go_on_to_restore(&mut commands, &mut op, &mut rec, plan, &mut reads)
                }
            }
        } else if !op.loading_sent {
            op.loading_sent = true;
            let event = Event::Loading {
                operation: entity.to_bits(),
            };
            reads.outbox.push(op.origin, event);
        }
    }
}

/// Admission in arrival order, so an early large query is not starved by
/// later small ones slipping past it forever.
fn admit(
    commands: &mut Commands,
    ops: &mut Query<Recoveries, AdmitOrRead>,
    admission: &mut Admission,
    now_us: u64,
) {
    let mut waiting: Vec<(u64, Entity)> = ops
        .iter()
        .filter(|(_, op, _)| op.state() == OpState::Admit && op.deadline_us > now_us)
        .map(|(e, op, _)| (op.command, e))
        .collect();
    waiting.sort_unstable();
    let Admission { instances, budget } = admission;
    for (_, entity) in waiting {
        let (_, mut op, mut rec) = ops.get_mut(entity).expect("collected above");
        let Ok(mut instance) = instances.get_mut(op.instance) else {
            finish(
                commands,
                entity,
                &mut op,
                Outcome::Miss(MissReason::Namespace),
            );
            continue;
        };
        let needs = page_needs(&rec, &instance);
        let total: u64 = needs.iter().map(|n| n.bytes).sum();
        match decide(&op, &instance, budget, total) {
            Decision::Never => {
                finish(commands, entity, &mut op, Outcome::Miss(MissReason::Budget));
            }
            // Over budget means wait (the deadline bounds it).
            Decision::Wait => {}
            Decision::Now => {
                budget.reserve(total, op.speculative);
                instance.bytes_reserved += total;
                op.bytes_reserved = total;
                rec.needs = needs;
                set_state(commands, entity, &mut op, OpState::Reading);
            }
        }
    }
}

enum Decision {
    Now,
    Wait,
    /// Larger than the budget can ever grant, or speculative work past its
    /// share: waiting would not help.
    Never,
}

fn decide(op: &Operation, instance: &Instance, budget: &Budget, total: u64) -> Decision {
    if total > budget.global_limit.min(budget.instance_limit)
        || (op.speculative && budget.speculative_reserved + total > budget.speculative_limit)
    {
        Decision::Never
    } else if budget.reserved + total > budget.global_limit
        || instance.bytes_reserved + total > budget.instance_limit
    {
        Decision::Wait
    } else {
        Decision::Now
    }
}

/// One need per page of the selected ranges.
fn page_needs(rec: &Recovery, instance: &Instance) -> Vec<PageNeed> {
    let page = instance.page_tokens;
    let mut needs = Vec::new();
    for (rank, range) in &rec.ranges {
        let state = &instance.ranks[*rank as usize];
        let bytes = state
            .page_bytes(range.group)
            .expect("contract groups have page sizes");
        for index in range.start / page..range.end / page {
            let page_end = (index + 1) * page;
            let native = rec
                .hash_at(range.group, page_end, page)
                .expect("ranges lie within the hashed span");
            needs.push(PageNeed {
                pos: PagePos {
                    rank: *rank,
                    group: range.group,
                    page_end,
                },
                key: StateKey {
                    namespace: state.namespace,
                    group: range.group,
                    native,
                },
                bytes,
                state: NeedState::Pending,
                from_tier: false,
                residency: None,
                checksum: 0,
            });
        }
    }
    needs
}

/// Lower tiers and the bounds on reading from them.
#[derive(SystemParam)]
pub struct Reads<'w> {
    tiers: ResMut<'w, Tiers>,
    index: ResMut<'w, TransferIndex>,
    metrics: ResMut<'w, Metrics>,
    outbox: ResMut<'w, Outbox>,
    limits: Res<'w, Limits>,
    clock: Res<'w, Clock>,
    rates: ResMut<'w, LoadRates>,
}

/// One tick of reading for one operation.
struct ReadStep<'a> {
    entity: Entity,
    instance: &'a Instance,
}

impl ReadStep<'_> {
    /// A ready `Load` restores in this tick's restore stage, as an accepted
    /// `Restore` would; a plan that does not cover its ranges is refused
    /// (`Rejected`, its final reply) and the operation released.
    fn go_on_to_restore(
        &self,
        commands: &mut Commands,
        op: &mut Operation,
        rec: &mut Recovery,
        plan: LoadPlan,
        reads: &mut Reads,
    ) {
        match crate::load::accept(self.instance, rec, plan) {
            Ok((targets, retained)) => {
                rec.restore = targets;
                rec.retained = retained;
                op.deadline_us = reads
                    .clock
                    .now_us
                    .saturating_add(reads.limits.restore_deadline_us);
                set_state(commands, self.entity, op, OpState::RestorePending);
            }
            Err(error) => {
                // Counted with the refusals at ingest, under its command.
                reads.metrics.refused("load", &error);
                let refusal = Event::Rejected {
                    command: op.command,
                    error,
                };
                reads.outbox.push_ending(op.origin, refusal, true);
                op.reported = true;
                finish(commands, self.entity, op, Outcome::Released);
            }
        }
    }

    /// Leases resident pages and starts the reads that fit; a page that
    /// vanished or changed size since discovery is a miss.
    fn run(
        &self,
        commands: &mut Commands,
        rec: &mut Recovery,
        pages: &Query<&Page>,
        dram: &mut Dram,
        reads: &mut Reads,
    ) -> Result<(), MissReason> {
        let mut budget = ReadBudget::new(rec, reads);
        for need in rec.needs.iter_mut() {
            if need.state != NeedState::Pending {
                continue;
            }
            if let Some(&page) = dram.index.get(&need.key) {
                let Ok(p) = pages.get(page) else {
                    continue; // inserted this tick; leased next tick
                };
                need.state = NeedState::Leased(take_lease(commands, page, self.entity));
                need.residency = Some(p.residency);
                need.checksum = p.checksum;
                continue;
            }
            if dram.reading.contains_key(&need.key) {
                continue; // another operation's read brings it
            }
            self.start_read(commands, need, dram, reads, &mut budget)?;
        }
        Ok(())
    }

    fn start_read(
        &self,
        commands: &mut Commands,
        need: &mut PageNeed,
        dram: &mut Dram,
        reads: &mut Reads,
        budget: &mut ReadBudget,
    ) -> Result<(), MissReason> {
        let tiers = reads.tiers.0.get_mut();
        let Some((tier, entry)) = tiers
            .iter()
            .enumerate()
            .find_map(|(i, t)| t.lookup(&need.key).map(|e| (i, e)))
        else {
            return Err(vanished(tiers)); // discovery saw it
        };
        if entry.bytes != need.bytes {
            return Err(MissReason::IncompleteGroup);
        }
        let group = (need.pos.rank, need.pos.group);
        if !budget.allows(group, &reads.limits) {
            return Ok(());
        }
        let Some((dram_slot, dram_offset)) = dram.alloc(need.bytes) else {
            return Ok(()); // the evict stage makes room; retry next tick
        };
        let now_us = reads.clock.now_us;
        let token = match submit(tiers[tier].as_mut(), need, dram_offset, now_us) {
            Ok(token) => token,
            Err(TierError::QueueFull(..)) => {
                dram.free(dram_slot);
                return Ok(());
            }
            Err(e) => {
                dram.free(dram_slot);
                return Err(tiers[tier].miss_reason(&e));
            }
        };
        let kind = TransferKind::TierRead {
            tier,
            key: need.key,
            format: self.instance.ranks[need.pos.rank as usize].format_digest,
            dram_slot,
            dram_offset,
            bytes: need.bytes,
            checksum: entry.checksum,
            pos: need.pos,
        };
        let transfer = Transfer {
            token,
            executor: Executor::Local,
            kind,
            submitted_us: now_us,
            bytes: need.bytes,
            overdue: false,
        };
        let t = commands.spawn((transfer, TransferOf(self.entity))).id();
        reads.index.reads.insert((tier, token), t);
        reads.rates.started(1 + tier, now_us);
        dram.reading.insert(need.key, t);
        reads.metrics.tier_reads += 1;
        need.state = NeedState::Reading;
        need.from_tier = true;
        budget.took(group);
        Ok(())
    }
}

/// Why a page discovery saw is in no tier now: behind a tier that cannot
/// be reached (an outage is not churn), or evicted meanwhile.
fn vanished(tiers: &[Box<dyn BackingTier>]) -> MissReason {
    crate::discover::unreachable(tiers).unwrap_or(MissReason::EvictedDuringRead)
}

fn submit(
    tier: &mut dyn BackingTier,
    need: &PageNeed,
    offset: u64,
    now_us: u64,
) -> Result<u64, TierError> {
    tier.submit_read(&need.key, offset, need.bytes, now_us)
        .map(|t| t.0)
}

/// Reads in flight: per (rank, group) of this operation, and in total.
struct ReadBudget {
    per_group: Vec<((u32, u32), usize)>,
    total: usize,
}

impl ReadBudget {
    fn new(rec: &Recovery, reads: &mut Reads) -> Self {
        let total = reads.tiers.0.get_mut().iter().map(|t| t.in_flight()).sum();
        let mut budget = ReadBudget {
            per_group: Vec::new(),
            total,
        };
        for need in rec.needs.iter().filter(|n| n.state == NeedState::Reading) {
            budget.bump((need.pos.rank, need.pos.group));
        }
        budget.total = total;
        budget
    }

    fn count(&self, key: (u32, u32)) -> usize {
        self.per_group
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, n)| *n)
    }

    fn bump(&mut self, key: (u32, u32)) {
        match self.per_group.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => self.per_group.push((key, 1)),
        }
    }

    fn allows(&self, key: (u32, u32), limits: &Limits) -> bool {
        self.count(key) < limits.max_reads_per_group && self.total < limits.max_inflight_reads
    }

    fn took(&mut self, key: (u32, u32)) {
        self.bump(key);
        self.total += 1;
    }
}

pub fn ready_event(entity: Entity, rec: &Recovery) -> Event {
    let from_tiers = rec.needs.iter().filter(|n| n.from_tier).count() as u64;
    Event::Ready {
        pages_from_dram: rec.needs.len() as u64 - from_tiers,
        pages_from_tiers: from_tiers,
        operation: entity.to_bits(),
        boundary: rec.selected.expect("a ready operation has a boundary"),
        ranges: rec.ranges.clone(),
        leases: rec
            .needs
            .iter()
            .map(|n| {
                let at = n.residency.expect("leased needs record their residency");
                let NeedState::Leased(lease) = n.state else {
                    unreachable!("ready means every need is leased");
                };
                LeaseInfo {
                    lease: lease.to_bits(),
                    pos: n.pos,
                    bytes: n.bytes,
                    slot: at.dram_slot,
                    offset: at.dram_offset,
                    checksum: n.checksum,
                }
            })
            .collect(),
    }
}
