//! ECS component types: the runtime's live state, one component per entity
//! kind of the design (Instance, Group, Session, Page, Lease, Operation,
//! Transfer, DevicePage, plus DeviceRegion). Systems in `orbitkv-systems`
//! change them; nothing else does.
//!
//! Ownership is bevy relationships (end of this file): group → instance,
//! session → instance, operation → session, transfer → operation, lease →
//! page and → operation, region → session, device page → region. The ECS
//! keeps each target's list of sources, so "how many leases does this page
//! have" or "has this operation I/O in flight" is never a counter kept by
//! hand, and despawning an owner despawns what it owns where that is
//! right (an operation's leases, a region's pages, a session's regions).
//!
//! Cross-references are `Entity` values. An `Entity` carries a generation, so
//! a reference to a despawned entity never resolves to its successor: that is
//! the page-generation fence.

use bevy_ecs::entity::EntityHashSet;
use bevy_ecs::prelude::*;

use crate::api::{
    CommandId, GroupHashes, MissReason, OperationState, Origin, PagePos, Rank, RestoreTarget,
    SessionHandle,
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

/// One cache group of an instance (`GroupOf` its instance, which despawns
/// its groups with it).
#[derive(Component, Debug, Clone)]
pub struct Group {
    pub id: u32,
    pub page_bytes: u64,
}

#[derive(Component, Debug, Clone)]
pub struct Session {
    /// The origin that opened it: the only one whose commands may name the
    /// session, its operations, regions and device pages, and the addressee
    /// of their events.
    pub origin: Origin,
    pub epoch: u64,
    pub closing: bool,
    /// The `CloseSession` that began the close, answered by its
    /// `SessionClosed`; `None` when its origin went away.
    pub closed_by: Option<CommandId>,
}

/// Where a page's bytes are. Only DRAM exists in this issue; lower tiers are
/// consulted through their own indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// `SlotKey::to_bits()` of the DRAM slot.
    pub dram_slot: u64,
    pub dram_offset: u64,
}

/// A stored page. Its live leases are its `Leases` (kept by the ECS); a
/// leased page is never evicted.
#[derive(Component, Debug, Clone)]
pub struct Page {
    pub key: StateKey,
    pub bytes: u64,
    pub checksum: u64,
    /// Format digest of the rank that wrote it (see `RankState`).
    pub format: Digest32,
    pub residency: Residency,
}

/// A pin of one page (`LeaseOf`) for one operation (`HeldBy`), until the
/// operation retires: despawning the operation returns its leases.
#[derive(Component, Debug, Clone, Copy, Default)]
pub struct Lease;

/// Where an operation is (see `OperationState`). Each state is also a marker
/// component on the operation (`at::Reading`, ...), so a stage queries
/// only the operations it works on; `Operation::state` names it for errors
/// and reports. Only the transition helpers of `orbitkv-systems` change
/// either, together.
pub type OpState = OperationState;

/// The state markers, one per `OpState`.
pub mod at {
    use bevy_ecs::prelude::*;

    macro_rules! markers {
        ($($name:ident),*) => {
            $(
                #[derive(Component, Debug, Clone, Copy, Default)]
                pub struct $name;
            )*
            /// Every marker: removing this bundle clears the state.
            pub type Any = ($($name,)*);
        };
    }
    markers!(
        Discover,
        Validate,
        Selected,
        Admit,
        Reading,
        Ready,
        RestorePending,
        Restoring,
        PublishPending,
        Publishing,
        Finishing
    );
}

/// Something a state marker can be put on: deferred (`EntityCommands`) or
/// at once (`EntityWorldMut`, in the exclusive ingest stage).
pub trait MarkerTarget {
    fn put<M: Component>(&mut self, marker: M);
    fn clear_markers(&mut self);
}

impl MarkerTarget for EntityCommands<'_> {
    fn put<M: Component>(&mut self, marker: M) {
        self.insert(marker);
    }
    fn clear_markers(&mut self) {
        self.remove::<at::Any>();
    }
}

impl MarkerTarget for EntityWorldMut<'_> {
    fn put<M: Component>(&mut self, marker: M) {
        self.insert(marker);
    }
    fn clear_markers(&mut self) {
        self.remove::<at::Any>();
    }
}

/// Replaces the state marker with the one of `state`.
pub fn mark_state(entity: &mut impl MarkerTarget, state: OpState) {
    entity.clear_markers();
    match state {
        OpState::Discover => entity.put(at::Discover),
        OpState::Validate => entity.put(at::Validate),
        OpState::Selected => entity.put(at::Selected),
        OpState::Admit => entity.put(at::Admit),
        OpState::Reading => entity.put(at::Reading),
        OpState::Ready => entity.put(at::Ready),
        OpState::RestorePending => entity.put(at::RestorePending),
        OpState::Restoring => entity.put(at::Restoring),
        OpState::PublishPending => entity.put(at::PublishPending),
        OpState::Publishing => entity.put(at::Publishing),
        OpState::Finishing => entity.put(at::Finishing),
    }
}

/// States the preparation deadline applies to: everything before the
/// restore's copies are resolved.
pub fn before_restore(state: OpState) -> bool {
    matches!(
        state,
        OpState::Discover
            | OpState::Validate
            | OpState::Selected
            | OpState::Admit
            | OpState::Reading
            | OpState::Ready
    )
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

/// One query/recovery or publish. Owned by a session (`OperationOf`); its
/// in-flight I/O is its `Transfers`, its leases its `HeldLeases`, both
/// kept by the ECS.
#[derive(Component, Debug, Clone)]
pub struct Operation {
    pub command: CommandId,
    /// The owning session's origin (it never changes): where the
    /// operation's events go.
    pub origin: Origin,
    pub instance: Entity,
    pub request: u64,
    state: OpState,
    pub deadline_us: u64,
    pub bytes_reserved: u64,
    pub speculative: bool,
    /// Set once; decided when the operation retires.
    pub outcome: Option<Outcome>,
    /// Whether a `Loading` reply was sent.
    pub loading_sent: bool,
    /// Whether the final reply was already sent (a query that missed, a
    /// lookup's result, or an overdue copy's miss at its deadline).
    pub reported: bool,
}

impl Operation {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        command: CommandId,
        origin: Origin,
        instance: Entity,
        request: u64,
        state: OpState,
        deadline_us: u64,
        speculative: bool,
    ) -> Self {
        Operation {
            command,
            origin,
            instance,
            request,
            state,
            deadline_us,
            bytes_reserved: 0,
            speculative,
            outcome: None,
            loading_sent: false,
            reported: false,
        }
    }

    pub fn state(&self) -> OpState {
        self.state
    }

    /// Records a new state; returns whether it changed. Only the transition
    /// helpers call this, and they move the marker with it.
    #[doc(hidden)]
    pub fn record_state(&mut self, state: OpState) -> bool {
        let changed = self.state != state;
        self.state = state;
        changed
    }
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
    /// The leased page's checksum (set with the lease; 0 before).
    pub checksum: u64,
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
    /// A `Lookup`: the operation ends with its `QueryResult`.
    pub peek: bool,
    /// A `Load`: restores by itself once ready (taken then).
    pub load: Option<LoadPlan>,
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

/// What a `Load` restores once its operation is ready: the engine's
/// destinations and attested positions, for the ranges of `ranks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    pub ranks: Vec<u32>,
    pub targets: Vec<RestoreTarget>,
    pub retained: Vec<PagePos>,
}

/// One page copy of a restore: a leased DRAM page into a pinned device page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedCopy {
    pub device_page: Entity,
    pub host_offset: u64,
    /// The executor's region id (the copy engine's, or the agent's).
    pub region: u32,
    pub device_offset: u64,
    pub len: u64,
    /// The leased page's checksum, which the copy verifies the bytes it
    /// delivers against.
    pub checksum: u64,
    /// Who runs it: the manager's copy engine, or the region owner's agent.
    pub executor: Executor,
}

/// Who runs a device copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Executor {
    /// The runtime's own copy engine (`Copier`): manager-owned regions.
    Local,
    /// The copy agent of the origin that owns the region.
    Agent(Origin),
}

impl Recovery {
    /// A query's recovery before discovery: the hashes (sorted by group),
    /// the HBM origin, the hashed span's end and the prompt's length.
    pub fn new(groups: Vec<GroupHashes>, origin: u64, end: u64, prompt_len: u64) -> Self {
        Recovery {
            miss: None,
            groups,
            origin,
            end,
            prompt_len,
            expect_namespaces: Vec::new(),
            prepare: false,
            peek: false,
            load: None,
            candidates: Vec::new(),
            selected: None,
            ranges: Vec::new(),
            needs: Vec::new(),
            restore: Vec::new(),
            retained: Vec::new(),
            copies: Vec::new(),
            copies_sent: 0,
        }
    }

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

    /// The need at each of `positions`, in order (`None` where no page is
    /// needed). Engines name their targets in the order the needs were
    /// made, so each position is tried at its own index first; any other
    /// order is looked up in a map built once: linear either way, where a
    /// search per target was quadratic in the pages of one restore.
    pub fn needs_at<'a>(
        &'a self,
        positions: impl IntoIterator<Item = &'a PagePos>,
    ) -> impl Iterator<Item = Option<&'a PageNeed>> {
        let mut by_pos: Option<std::collections::HashMap<PagePos, usize>> = None;
        positions.into_iter().enumerate().map(move |(i, pos)| {
            if let Some(need) = self.needs.get(i).filter(|n| n.pos == *pos) {
                return Some(need);
            }
            let map = by_pos.get_or_insert_with(|| {
                self.needs
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (n.pos, i))
                    .collect()
            });
            map.get(pos).and_then(|&i| self.needs.get(i))
        })
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
    /// From an agent-owned region: the origin's staging slot the agent
    /// writes into (`SlotKey::to_bits()` and offset), held while copying.
    pub staging: Option<(u64, u64)>,
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

/// One in-flight I/O (`TransferOf` its operation). It owns its buffers
/// until completion, whatever happens to its operation meanwhile: an
/// operation retires only once it has no `Transfers`.
#[derive(Component, Debug, Clone)]
pub struct Transfer {
    /// The copy engine's completion token, a tier's read token, or the
    /// agent copy id (`executor`).
    pub token: u64,
    /// Device copies: who runs it. Tier reads are `Local`.
    pub executor: Executor,
    pub kind: TransferKind,
    pub submitted_us: u64,
    /// Bytes it moves (what the load rates count when it lands).
    pub bytes: u64,
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

/// A device KV pool of one session (`RegionOf`), for one (rank, group). Its
/// live pages are its `RegionPages`; despawning it despawns them.
#[derive(Component, Debug, Clone)]
pub struct DeviceRegion {
    /// The owning session's origin: where its pages' events go.
    pub origin: Origin,
    pub rank: u32,
    pub group: u32,
    pub slots: u32,
    pub page_bytes: u64,
    /// The executor's region id: the copy engine's for a manager-owned
    /// region, the agent's own for an agent-owned one.
    pub engine_region: u32,
    /// Who owns the memory and runs its copies: `Local` (the manager's
    /// copy engine allocated it) or `Agent(origin)` (the engine process's).
    pub executor: Executor,
    /// The live device page of each allocated slot: an index over
    /// `RegionPages`, as large as what is allocated (not the slot count).
    pub by_slot: std::collections::HashMap<u32, Entity>,
}

/// One engine page slot (`PageOf` its region), respawned with a new
/// generation whenever the engine reuses the slot.
#[derive(Component, Debug, Clone)]
pub struct DevicePage {
    pub slot: u32,
    /// Copies that target or read this page, planned or in flight: the page
    /// is not despawned while any does.
    pub pins: u32,
    /// The engine freed it while pinned (this `DevicePageFree`): despawn
    /// when the last pin goes, and answer that command then.
    pub free_deferred: Option<CommandId>,
}

// Relationships: the source holds the target entity; the ECS keeps the
// target's list of sources, and a `linked_spawn` target despawns its
// sources with it.

/// Group → Instance.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Groups)]
pub struct GroupOf(pub Entity);

#[derive(Component, Debug, Default)]
#[relationship_target(relationship = GroupOf, linked_spawn)]
pub struct Groups(Vec<Entity>);

/// Session → Instance.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Sessions)]
pub struct SessionOf(pub Entity);

#[derive(Component, Debug, Default)]
#[relationship_target(relationship = SessionOf)]
pub struct Sessions(Vec<Entity>);

/// Operation → Session. A session closes only once it has no
/// `Operations`.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Operations)]
pub struct OperationOf(pub Entity);

#[derive(Component, Debug, Default)]
#[relationship_target(relationship = OperationOf)]
pub struct Operations(Vec<Entity>);

/// Transfer → Operation.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Transfers)]
pub struct TransferOf(pub Entity);

#[derive(Component, Debug, Default)]
#[relationship_target(relationship = TransferOf)]
pub struct Transfers(Vec<Entity>);

/// Lease → Page. A page with `Leases` is out of the LRU.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Leases)]
pub struct LeaseOf(pub Entity);

/// Every restore adds it to its pages and removes it again: a sparse set,
/// so neither moves the page's table row (about 575 fewer tick-thread
/// instructions per restored page, `world/benches/throughput.rs` under
/// callgrind at 16 KiB).
#[derive(Component, Debug, Default)]
#[relationship_target(relationship = LeaseOf)]
#[component(storage = "SparseSet")]
pub struct Leases(Vec<Entity>);

/// Lease → Operation: despawning the operation returns its leases.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = HeldLeases)]
pub struct HeldBy(pub Entity);

/// A set, not a list: a restore returns its leases one by one in page
/// order (`return_leases`), and each removal from a `Vec` would scan and
/// shift it, quadratic in the pages of one operation.
#[derive(Component, Debug, Default)]
#[relationship_target(relationship = HeldBy, linked_spawn)]
pub struct HeldLeases(EntityHashSet);

/// A P/D handoff (`Command::Hold`): its leases (`HeldLeases`, each
/// `HeldBy` it) pin the promised pages that have landed in DRAM, so they
/// are neither evicted nor demoted, until a `Load` naming it has taken
/// them (`taker`) or `deadline_us` passed. It belongs to no session: a
/// producer that exits after its prefill leaves its promise standing.
#[derive(Component, Debug, Clone)]
pub struct Handoff {
    pub id: u64,
    /// Who promised (for reports).
    pub origin: Origin,
    /// The instance it was promised for (it may retire first: nothing
    /// relies on it being live).
    pub instance: Entity,
    pub deadline_us: u64,
    /// Every promised page: each rank's namespace × group × hash.
    pub promised: Vec<StateKey>,
    /// Promised pages pinned so far.
    pub pinned: u64,
    /// Bytes reserved from the handoff budget (every promised page at its
    /// rank's page size), returned when the handoff ends.
    pub bytes: u64,
    /// The load that takes the pages: the pins return once it retired.
    pub taker: Option<Entity>,
}

/// Device region → Session: a closed session's regions (and their pages)
/// go with it.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = Regions)]
pub struct RegionOf(pub Entity);

#[derive(Component, Debug, Default)]
#[relationship_target(relationship = RegionOf, linked_spawn)]
pub struct Regions(Vec<Entity>);

/// Device page → Device region.
#[derive(Component, Debug, Clone, Copy, PartialEq, Eq)]
#[relationship(relationship_target = RegionPages)]
pub struct PageOf(pub Entity);

/// A set: a region holds a page per engine slot (thousands), and each
/// free would scan and shift a `Vec`.
#[derive(Component, Debug, Default)]
#[relationship_target(relationship = PageOf, linked_spawn)]
pub struct RegionPages(EntityHashSet);

/// The session handle an entity answers to.
pub fn session_handle(entity: Entity, epoch: u64, incarnation: u64) -> SessionHandle {
    SessionHandle {
        id: entity.to_bits(),
        epoch,
        incarnation,
    }
}
