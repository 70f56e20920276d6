//! ECS component types: the runtime's live state, one component per entity
//! kind of the design (Instance, Group, Session, Page, Lease, Operation,
//! Transfer, DevicePage, plus DeviceRegion). Systems in `orbitkv-systems`
//! change them; nothing else does.
//!
//! Cross-references are `Entity` values. An `Entity` carries a generation, so
//! a reference to a despawned entity never resolves to its successor: that is
//! the page-generation fence.

use bevy_ecs::prelude::*;

use crate::api::{
    CommandId, GroupHashes, MissReason, Origin, PagePos, Rank, RestoreTarget, SessionHandle,
};
use crate::contract::{RecoveryContract, RequiredRange};
use crate::encoding::Digest32;
use crate::key::StateKey;
use crate::layout::StorageLayout;
use crate::namespace::Namespace;

/// One rank of an instance: its sealed namespace and compiled contract.
#[derive(Debug, Clone)]
pub struct RankState {
    pub rank: Rank,
    pub namespace: Namespace,
    pub contract: RecoveryContract,
    /// Bytes of one page of each group on this rank (all its layers).
    pub page_bytes: Vec<(u32, u64)>,
    /// SHA-256 of this rank's sealed layout: the format digest lower tiers
    /// store in their record headers.
    pub format_digest: Digest32,
}

impl RankState {
    pub fn page_bytes(&self, group: u32) -> Option<u64> {
        self.page_bytes
            .iter()
            .find(|(g, _)| *g == group)
            .map(|(_, b)| *b)
    }
}

#[derive(Component, Debug, Clone)]
pub struct Instance {
    pub name: String,
    pub identity: Digest32,
    pub layout: StorageLayout,
    pub page_tokens: u64,
    /// Sorted by (pp, tp); commands address ranks by index into this list.
    pub ranks: Vec<RankState>,
    pub groups: Vec<crate::contract::GroupSpec>,
    pub bytes_reserved: u64,
    /// Replaced by a new registration under the same name while sessions
    /// were still closing; despawned with the last of them.
    pub retired: bool,
}

impl Instance {
    pub fn rank(&self, index: u32) -> Option<&RankState> {
        self.ranks.get(index as usize)
    }
}

#[derive(Component, Debug, Clone)]
pub struct Group {
    pub instance: Entity,
    pub id: u32,
    pub page_bytes: u64,
}

#[derive(Component, Debug, Clone)]
pub struct Session {
    pub instance: Entity,
    /// The origin that opened it: the only one whose commands may name the
    /// session, its operations, regions and device pages, and the addressee
    /// of their events.
    pub origin: Origin,
    pub epoch: u64,
    pub closing: bool,
}

/// Where a page's bytes are. Only DRAM exists in this issue; lower tiers are
/// consulted through their own indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// `SlotKey::to_bits()` of the DRAM slot.
    pub dram_slot: u64,
    pub dram_offset: u64,
}

#[derive(Component, Debug, Clone)]
pub struct Page {
    pub key: StateKey,
    pub bytes: u64,
    pub checksum: u64,
    /// Format digest of the rank that wrote it (see `RankState`).
    pub format: Digest32,
    pub residency: Residency,
    /// Live leases on this page; a leased page is never evicted.
    pub leases: u32,
}

#[derive(Component, Debug, Clone, Copy)]
pub struct Lease {
    pub page: Entity,
    pub operation: Entity,
}

/// Where an operation is. Transitions only move forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpState {
    /// Query submitted; discovery runs this tick.
    Discover,
    /// Candidates found; boundaries computed this tick.
    Validate,
    /// Boundary selected; waiting for `Prepare`.
    Selected,
    /// Waiting for byte-budget admission.
    Admit,
    /// Reading missing pages and leasing complete groups.
    Reading,
    /// Every required page is leased.
    Ready,
    /// Restore accepted; copies are submitted this tick.
    RestorePending,
    /// Device copies in flight; leases held until the fence.
    Restoring,
    /// Publish accepted; copies are submitted this tick.
    PublishPending,
    /// Device → DRAM copies in flight.
    Publishing,
    /// Retiring: waits until its submitted I/O drained, then releases.
    Finishing,
}

impl OpState {
    pub fn name(self) -> &'static str {
        match self {
            OpState::Discover => "discover",
            OpState::Validate => "validate",
            OpState::Selected => "selected",
            OpState::Admit => "admit",
            OpState::Reading => "reading",
            OpState::Ready => "ready",
            OpState::RestorePending => "restore_pending",
            OpState::Restoring => "restoring",
            OpState::PublishPending => "publish_pending",
            OpState::Publishing => "publishing",
            OpState::Finishing => "finishing",
        }
    }

    /// States the preparation deadline applies to: everything before the
    /// restore's copies are submitted.
    pub fn before_restore(self) -> bool {
        matches!(
            self,
            OpState::Discover
                | OpState::Validate
                | OpState::Selected
                | OpState::Admit
                | OpState::Reading
                | OpState::Ready
        )
    }
}

/// How a finishing operation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Miss(MissReason),
    Released,
    /// Copies landed; counts come from the recovery at retire.
    Restored,
    /// Counts come from the publish job's items at retire.
    Published,
}

#[derive(Component, Debug, Clone)]
pub struct Operation {
    pub command: CommandId,
    pub session: Entity,
    /// The owning session's origin (it never changes): where the
    /// operation's events go.
    pub origin: Origin,
    pub instance: Entity,
    pub request: u64,
    pub state: OpState,
    pub deadline_us: u64,
    pub bytes_reserved: u64,
    pub speculative: bool,
    /// Transfers submitted for this operation and not yet fenced.
    pub in_flight: u32,
    /// Set once; decided when the operation retires.
    pub outcome: Option<Outcome>,
    /// Whether a `Loading` reply was sent.
    pub loading_sent: bool,
    /// Whether the final reply was already sent (a query that missed).
    pub reported: bool,
}

/// Progress of one required page of a recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedState {
    Pending,
    Reading,
    Leased(Entity),
}

#[derive(Debug, Clone)]
pub struct PageNeed {
    pub pos: PagePos,
    pub key: StateKey,
    pub bytes: u64,
    pub state: NeedState,
    /// This operation read the page from a lower tier.
    pub from_tier: bool,
    /// Where the leased page sits in DRAM (set with the lease).
    pub residency: Option<Residency>,
}

/// The query/recovery part of an operation.
#[derive(Component, Debug, Clone)]
pub struct Recovery {
    /// Set by discovery when the query cannot hit at all (e.g. namespace).
    pub miss: Option<MissReason>,
    pub groups: Vec<GroupHashes>,
    pub origin: u64,
    pub end: u64,
    pub prompt_len: u64,
    pub expect_namespaces: Vec<Namespace>,
    pub prepare: bool,
    /// Page ends found per (rank index, group), ascending.
    pub candidates: Vec<(u32, u32, Vec<u64>)>,
    pub selected: Option<u64>,
    /// `required_ranges` per rank, at the selected boundary.
    pub ranges: Vec<(u32, RequiredRange)>,
    pub needs: Vec<PageNeed>,
    pub restore: Vec<RestoreTarget>,
    pub retained: Vec<PagePos>,
    /// The restore's copies, resolved (and their destinations pinned) once
    /// when it is accepted; submitted in batches as copy room allows.
    pub copies: Vec<PlannedCopy>,
    /// How many of `copies` were submitted (or abandoned).
    pub copies_sent: usize,
}

/// One page copy of a restore: a leased DRAM page into a pinned device page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedCopy {
    pub device_page: Entity,
    pub host_offset: u64,
    /// The copy engine's region id.
    pub region: u32,
    pub device_offset: u64,
    pub len: u64,
    /// The leased page's checksum, which the copy verifies the bytes it
    /// delivers against.
    pub checksum: u64,
}

impl Recovery {
    /// The key of page `page_end` of `group` on rank `rank`.
    pub fn hash_at(
        &self,
        group: u32,
        page_end: u64,
        page_tokens: u64,
    ) -> Option<crate::key::NativeHash> {
        let g = self.groups.iter().find(|g| g.group == group)?;
        let index = (page_end / page_tokens).checked_sub(1)?;
        g.hashes.get(index as usize).copied()
    }
}

/// Where one published page is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemState {
    /// Waiting for a DRAM slot or a copy submission.
    Waiting,
    /// DRAM already held (or was reading) the key: nothing to copy.
    Duplicate,
    Copying,
    /// Bytes complete, checksummed and indexed.
    Inserted,
    /// Not stored: the copy failed, or time ran out waiting for space.
    Dropped,
}

/// A page being published: source device page and destination DRAM slot.
#[derive(Debug, Clone, Copy)]
pub struct PublishItem {
    pub key: StateKey,
    pub format: Digest32,
    pub device_page: Entity,
    pub bytes: u64,
    /// `SlotKey::to_bits()` once allocated.
    pub dram_slot: Option<u64>,
    pub dram_offset: u64,
    pub state: ItemState,
}

#[derive(Component, Debug, Clone)]
pub struct PublishJob {
    /// Source device pages are pinned from ingest until the operation
    /// retires, after every copy of the publish completed.
    pub items: Vec<PublishItem>,
}

impl PublishJob {
    pub fn count(&self, state: ItemState) -> u64 {
        self.items.iter().filter(|i| i.state == state).count() as u64
    }
}

/// What a transfer moves.
#[derive(Debug, Clone)]
pub enum TransferKind {
    /// A lower tier → DRAM read of one page.
    TierRead {
        tier: usize,
        key: StateKey,
        format: Digest32,
        dram_slot: u64,
        dram_offset: u64,
        bytes: u64,
        checksum: u64,
        pos: PagePos,
    },
    /// DRAM → device pages (restore).
    Restore { device_pages: Vec<Entity> },
    /// Device pages → DRAM (publish): indexes into the job's items.
    Publish { items: Vec<usize> },
}

/// One in-flight I/O. It owns its buffers until completion, whatever happens
/// to its operation meanwhile.
#[derive(Component, Debug, Clone)]
pub struct Transfer {
    pub operation: Entity,
    pub token: u64,
    pub kind: TransferKind,
    pub submitted_us: u64,
    /// Reported overdue once; it keeps its buffers regardless, because a
    /// late completion could still write them.
    pub overdue: bool,
}

impl TransferKind {
    pub fn name(&self) -> &'static str {
        match self {
            TransferKind::TierRead { .. } => "tier_read",
            TransferKind::Restore { .. } => "restore_copy",
            TransferKind::Publish { .. } => "publish_copy",
        }
    }
}

#[derive(Component, Debug, Clone)]
pub struct DeviceRegion {
    pub session: Entity,
    /// The owning session's origin: where its pages' events go.
    pub origin: Origin,
    pub rank: u32,
    pub group: u32,
    pub slots: u32,
    pub page_bytes: u64,
    /// The copy engine's region id.
    pub engine_region: u32,
    /// The live device page of each allocated slot. Only allocated slots
    /// have an entry: a region's bookkeeping grows with its use, not with
    /// `slots` (which may be millions).
    pub live: std::collections::BTreeMap<u32, Entity>,
}

#[derive(Component, Debug, Clone)]
pub struct DevicePage {
    pub region: Entity,
    pub slot: u32,
    /// Transfers targeting or reading this page.
    pub pins: u32,
    /// The engine freed it while pinned: despawn at the fence.
    pub free_deferred: bool,
}

/// The session handle an entity answers to.
pub fn session_handle(entity: Entity, epoch: u64, incarnation: u64) -> SessionHandle {
    SessionHandle {
        id: entity.to_bits(),
        epoch,
        incarnation,
    }
}
