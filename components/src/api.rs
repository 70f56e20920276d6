//! The runtime's commands and events: everything an engine can ask and every
//! answer it gets. Plain data, so the wire, the Python bridge and traces can
//! carry them unchanged.
//!
//! Handles given to the engine are `Entity::to_bits()` values (index +
//! generation), so a handle to a retired entity can never reach its
//! successor. Sessions additionally carry their epoch and the manager
//! incarnation.

use serde::{Deserialize, Serialize};

use crate::contract::{GroupSpec, RequiredRange};
use crate::encoding::Digest32;
use crate::key::NativeHash;
use crate::layout::StorageLayout;
use crate::namespace::Namespace;

/// Sequence number of a submitted command; events answer it.
pub type CommandId = u64;

/// Who submitted a command: a manager connection, or the embedded caller.
/// Sessions remember the origin that opened them; every command that names a
/// session (or its operations, device regions and device pages) must come
/// from that origin, and every event is addressed to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Origin(pub u64);

impl Origin {
    /// The embedded caller (the Python embedded runtime, tests) and the
    /// replay driver.
    pub const EMBEDDED: Origin = Origin(0);
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "origin {}", self.0)
    }
}

/// An event and the origin it belongs to: a command's reply goes to the
/// command's origin; an operation's, device page's or session's event goes
/// to the origin of the session that owns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Addressed {
    pub to: Origin,
    pub event: Event,
    /// The event ends its command (and its operation, if it has one):
    /// nothing more is addressed to either. Decided by the runtime where
    /// the outcome is decided (`Event::ends_by_default`, or the stage that
    /// knows better, such as a `Lookup`'s result), so the hot-path server
    /// and clients read it instead of deriving it again.
    #[serde(default)]
    pub terminal: bool,
}

/// Why state was not handed back. One enum everywhere: events, reports,
/// metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissReason {
    NotFound,
    Namespace,
    IncompleteGroup,
    NoLegalBoundary,
    Budget,
    Deadline,
    StaleGeneration,
    StaleSession,
    IoError,
    Checksum,
    Cancelled,
    EvictedDuringRead,
    /// The remote store's metadata named a record that is gone (expired,
    /// evicted by Redis, flushed).
    RemoteMissing,
    /// The remote record failed verification (header, key, length,
    /// checksum) or was rewritten since the lookup.
    RemoteCorrupt,
    /// The remote store could not be reached (down, partitioned, breaker
    /// open).
    RemoteUnavailable,
    /// A remote read passed its deadline (slow node).
    RemoteTimeout,
    /// The prefix is there, but loading it is not worth it: it would add
    /// fewer tokens than `[restore] min_load_tokens`, or take longer at the
    /// measured load rates than recomputing them at `[restore]
    /// prefill_tokens_per_s`.
    NotWorthLoading,
}

impl MissReason {
    pub const ALL: [MissReason; 17] = [
        MissReason::NotFound,
        MissReason::Namespace,
        MissReason::IncompleteGroup,
        MissReason::NoLegalBoundary,
        MissReason::Budget,
        MissReason::Deadline,
        MissReason::StaleGeneration,
        MissReason::StaleSession,
        MissReason::IoError,
        MissReason::Checksum,
        MissReason::Cancelled,
        MissReason::EvictedDuringRead,
        MissReason::RemoteMissing,
        MissReason::RemoteCorrupt,
        MissReason::RemoteUnavailable,
        MissReason::RemoteTimeout,
        MissReason::NotWorthLoading,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MissReason::NotFound => "not_found",
            MissReason::Namespace => "namespace",
            MissReason::IncompleteGroup => "incomplete_group",
            MissReason::NoLegalBoundary => "no_legal_boundary",
            MissReason::Budget => "budget",
            MissReason::Deadline => "deadline",
            MissReason::StaleGeneration => "stale_generation",
            MissReason::StaleSession => "stale_session",
            MissReason::IoError => "io_error",
            MissReason::Checksum => "checksum",
            MissReason::Cancelled => "cancelled",
            MissReason::EvictedDuringRead => "evicted_during_read",
            MissReason::RemoteMissing => "remote_missing",
            MissReason::RemoteCorrupt => "remote_corrupt",
            MissReason::RemoteUnavailable => "remote_unavailable",
            MissReason::RemoteTimeout => "remote_timeout",
            MissReason::NotWorthLoading => "not_worth_loading",
        }
    }
}

impl std::fmt::Display for MissReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A session handle: entity bits, the epoch it was opened with, and the
/// manager incarnation that issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionHandle {
    pub id: u64,
    pub epoch: u64,
    pub incarnation: u64,
}

/// One parallel rank: a (tensor, pipeline) position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rank {
    pub tp: u32,
    pub pp: u32,
}

/// The engine's chained hashes for one group: `hashes[i]` names the page
/// covering tokens `[i * page_tokens, (i + 1) * page_tokens)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupHashes {
    pub group: u32,
    pub hashes: Vec<NativeHash>,
}

/// A page position in a query: which rank and group, and its absolute token
/// end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PagePos {
    pub rank: u32,
    pub group: u32,
    pub page_end: u64,
}

/// A restore destination: the page at `pos` goes into device page `device_page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreTarget {
    pub pos: PagePos,
    pub device_page: u64,
}

/// A page to publish from a device page of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishPage {
    pub rank: u32,
    pub group: u32,
    pub hash: NativeHash,
    pub device_page: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Register (or re-attach to) an engine instance. Each rank's slots in
    /// `layout` are sealed with `identity` into that rank's namespace.
    RegisterInstance {
        instance: String,
        #[serde(with = "hex32")]
        identity: Digest32,
        layout: StorageLayout,
        page_tokens: u64,
        groups: Vec<GroupSpec>,
        ranks: Vec<Rank>,
    },
    OpenSession {
        instance: String,
    },
    CloseSession {
        session: SessionHandle,
    },
    /// A device KV pool for one (rank, group) with `slots` page slots.
    /// Without `agent` the manager's copy engine allocates it (tests,
    /// replays); with `agent` it is memory the submitting origin owns, and
    /// every copy into or out of it runs in that origin's copy agent
    /// (`Event::AgentCopy`, answered by `Command::CopyDone`).
    RegisterDeviceRegion {
        session: SessionHandle,
        rank: u32,
        group: u32,
        slots: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<AgentRegion>,
    },
    /// The engine put a page into `slot`; the reply is a fresh handle.
    DevicePageAlloc {
        session: SessionHandle,
        region: u64,
        slot: u32,
    },
    /// The engine is done with a device page; deferred while a copy targets it.
    DevicePageFree {
        session: SessionHandle,
        device_page: u64,
    },
    /// Metadata-only discovery and boundary selection. With `prepare`, the
    /// selected boundary goes straight on to read_recovery.
    Query {
        session: SessionHandle,
        request: u64,
        groups: Vec<GroupHashes>,
        /// Valid HBM prefix origin (page-aligned).
        origin: u64,
        prompt_len: u64,
        /// The namespaces the adapter computed, per rank; a mismatch is a
        /// miss with reason `namespace`. Empty means "not checked".
        #[serde(default)]
        expect_namespaces: Vec<Namespace>,
        #[serde(default)]
        prepare: bool,
        #[serde(default)]
        speculative: bool,
    },
    /// A peek: the same discovery and boundary selection as `Query`
    /// without `prepare`, answered at once with a terminal `QueryResult`
    /// whose `operation` is 0: nothing is leased, reserved or parked, and
    /// there is nothing to release.
    Lookup {
        session: SessionHandle,
        request: u64,
        groups: Vec<GroupHashes>,
        origin: u64,
        prompt_len: u64,
        #[serde(default)]
        expect_namespaces: Vec<Namespace>,
    },
    /// A query with `prepare` that goes on to restore by itself: once
    /// every required page is leased (`Ready`, still sent), the pages of
    /// the ranges of `ranks` that `targets` name are restored into their
    /// device pages and the rest must be in `retained`, exactly as a
    /// `Restore` would be checked (a load whose targets and retained
    /// positions do not cover the ranges ends with `Rejected`, and nothing
    /// is copied). Targets and retained positions outside the selected
    /// ranges are ignored: the engine names every page it could take, the
    /// runtime picks the boundary. Pages of ranks not in `ranks` are
    /// restored by their own ranks' loads. One round trip for a hit:
    /// `QueryResult`, `Ready`, then `RestoreDone` or `Miss`.
    Load {
        session: SessionHandle,
        request: u64,
        groups: Vec<GroupHashes>,
        origin: u64,
        prompt_len: u64,
        #[serde(default)]
        expect_namespaces: Vec<Namespace>,
        ranks: Vec<u32>,
        targets: Vec<RestoreTarget>,
        #[serde(default)]
        retained: Vec<PagePos>,
        /// A P/D handoff this load takes (`Hold`): once the load has
        /// leased its pages (or ended), the handoff's pins are returned.
        /// Unknown or expired ids are ignored: the load is the same load.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        handoff: Option<u64>,
    },
    /// A prefill engine's promise to a decode engine (P/D handoff
    /// `handoff`, an id the producer chose at random): the pages of these
    /// hashes, of every rank of the session's instance, stay pinned in DRAM
    /// (never evicted, never demoted) as they land, until a `Load` naming
    /// the handoff took them or `deadline_ms` passed. Bounded by
    /// `limits.max_handoffs`, `limits.max_handoff_deadline_us` and the
    /// budget's `handoff_bytes`; the reply is `Held`.
    Hold {
        session: SessionHandle,
        handoff: u64,
        groups: Vec<GroupHashes>,
        deadline_ms: u64,
    },
    /// read_recovery for the selected boundary of a query.
    Prepare {
        session: SessionHandle,
        operation: u64,
    },
    Restore {
        session: SessionHandle,
        operation: u64,
        targets: Vec<RestoreTarget>,
        /// Pages of the required ranges the engine attests it still holds.
        retained: Vec<PagePos>,
    },
    /// Save pages of one or more ranks. The sources stay pinned, and the
    /// reply waits, until every rank's copy completed.
    Publish {
        session: SessionHandle,
        request: u64,
        pages: Vec<PublishPage>,
    },
    Release {
        session: SessionHandle,
        operation: u64,
    },
    Cancel {
        session: SessionHandle,
        operation: u64,
    },
    /// A copy agent finished copy `copy` (of an `Event::AgentCopy` it was
    /// sent): every page landed, or `failure` says why not. Only the origin
    /// the copy was sent to may report it, once.
    CopyDone {
        copy: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failure: Option<CopyFailure>,
        /// `region_to_staging`: the XXH3-64 of each page, in the copy's
        /// page order, computed by the agent from its own memory while it
        /// copied. The manager verifies each staged page against it when
        /// it moves the page into the pool; a page that differs (its
        /// staging slot was written after the agent's copy) is refused, and
        /// a publish report without them stores nothing.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        checksums: Vec<u64>,
    },
    /// Simulated clock only: move time forward.
    AdvanceClock {
        us: u64,
    },
    /// Drops every stored page of these namespaces from DRAM and from each
    /// lower tier (`orbitkv clear`). Refused whole while one of their
    /// pages is leased or being read.
    Clear {
        namespaces: Vec<Namespace>,
    },
}

/// An agent-owned device region: the agent's own id for the memory (echoed
/// in every `AgentCopy`) and the page size the agent laid out, which must
/// equal the group's page size on that rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentRegion {
    pub region: u32,
    pub page_bytes: u64,
}

/// Which way an agent copy moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentDirection {
    /// Restore: from the shared pool (mapped read-only in the agent) into
    /// the region. `host_offset` is a pool offset.
    PoolToRegion,
    /// Publish: from the region into the origin's own staging area; the
    /// manager then moves the bytes into the pool. `host_offset` is a
    /// staging offset.
    RegionToStaging,
}

/// One page of an agent copy: `len` bytes between `host_offset` (in the
/// pool or the staging area, per the direction) and `region_offset` of the
/// agent's region `region` (slot `s` starts at `s * page_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentPageCopy {
    pub host_offset: u64,
    pub region: u32,
    pub region_offset: u64,
    pub len: u64,
    /// `pool_to_region`: the checksum the pool page carries. The agent
    /// verifies the bytes it copied against it and reports `checksum`
    /// otherwise: a page altered in memory is never a hit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u64>,
}

/// Why a copy agent could not complete a copy. The copy failed as a whole;
/// the runtime treats every page of it as not copied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "reason", content = "detail", rename_all = "snake_case")]
pub enum CopyFailure {
    #[error("the agent has no region {0}")]
    UnknownRegion(u32),
    #[error("a copy lies outside its region, the pool or the staging area: {0}")]
    OutOfBounds(String),
    #[error("the agent's executor failed: {0}")]
    Executor(String),
    #[error("the agent is shutting down")]
    Shutdown,
    /// A pool page's bytes did not match the checksum it carries.
    #[error("pool bytes at {0} do not match their checksum")]
    Checksum(u64),
    /// Set by the runtime, never sent: the origin went away with the copy
    /// in flight, or did not report it within `agent_copy_deadline_us`.
    #[error("the copy agent was lost or missed its deadline")]
    Lost,
}

impl CopyFailure {
    /// The serde name of the variant, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            CopyFailure::UnknownRegion(_) => "unknown_region",
            CopyFailure::OutOfBounds(_) => "out_of_bounds",
            CopyFailure::Executor(_) => "executor",
            CopyFailure::Shutdown => "shutdown",
            CopyFailure::Checksum(_) => "checksum",
            CopyFailure::Lost => "lost",
        }
    }
}

/// A typed refusal of a command. The command had no effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "error", content = "detail", rename_all = "snake_case")]
pub enum CommandError {
    #[error("stale session: it was closed, or issued by another manager incarnation")]
    StaleSession,
    #[error("stale generation: device page {0:#x} was freed or reused")]
    StaleGeneration(u64),
    #[error("unknown instance {0:?}")]
    UnknownInstance(String),
    #[error("instance {0:?} is registered with a different identity or layout")]
    InstanceConflict(String),
    #[error("unknown or finished operation {0:#x}")]
    UnknownOperation(u64),
    #[error("operation {operation:#x} is {state}, not {}", one_of(expected))]
    WrongState {
        operation: u64,
        state: OperationState,
        /// The states the command applies in.
        expected: Vec<OperationState>,
    },
    #[error("unknown device region {0:#x}")]
    UnknownRegion(u64),
    #[error("device slot {slot} of region {region:#x} is already allocated")]
    SlotInUse { region: u64, slot: u32 },
    #[error("invalid command: {0}")]
    Invalid(InvalidCommand),
    #[error("limit {name} ({limit}) exceeded")]
    Limit { name: LimitName, limit: u64 },
    #[error("load does not cover the required range exactly: {0}")]
    LoadInvalid(LoadRefusal),
    #[error("copy engine: {0}")]
    Copy(CopyRefusal),
    #[error("the runtime's clock is not simulated")]
    WallClock,
    #[error(
        "the command names a session, operation, device region, device page or copy of another origin"
    )]
    NotOwner,
    #[error("unknown or finished agent copy {0:#x}")]
    UnknownCopy(u64),
}

/// Why a command is malformed: its shape, not the runtime's state
/// (`CommandError::Invalid`). On the wire, `detail` is this enum with its
/// `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum InvalidCommand {
    #[error("instance name is empty")]
    EmptyInstanceName,
    #[error("instance declares no ranks")]
    NoRanks,
    #[error("a rank is listed twice")]
    DuplicateRank,
    #[error("slot of layer {layer} names rank (tp {tp}, pp {pp}), which is not registered")]
    SlotRank { layer: u32, tp: u32, pp: u32 },
    #[error("slot of layer {layer} names unknown group {group}")]
    SlotGroup { layer: u32, group: u32 },
    #[error("slot of layer {layer} has {slot} tokens per page, the instance {instance}")]
    SlotPageTokens {
        layer: u32,
        slot: u32,
        instance: u64,
    },
    /// The rank's storage layout cannot be sealed or encoded
    /// (`LayoutError`'s text).
    #[error("rank (tp {tp}, pp {pp}): {reason}")]
    Layout { tp: u32, pp: u32, reason: String },
    /// The groups do not compile into a recovery contract
    /// (`ContractError`'s text).
    #[error("{reason}")]
    Contract { reason: String },
    #[error("rank (tp {tp}, pp {pp}) has no slots for group {group}")]
    RankWithoutGroup { tp: u32, pp: u32, group: u32 },
    #[error("a region needs 1..={max} slots, got {slots}")]
    RegionSlots { slots: u32, max: u32 },
    #[error("unknown rank index {rank}")]
    UnknownRank { rank: u32 },
    #[error("unknown group {group}")]
    UnknownGroup { group: u32 },
    #[error("region size overflows")]
    RegionTooLarge,
    /// A page must fit in one DRAM extent (`dram.extent_bytes`), or no
    /// publish of it could ever be stored.
    #[error(
        "group {group} pages are {page_bytes} bytes, more than one DRAM extent \
         ({extent_bytes} bytes: raise dram.extent_bytes)"
    )]
    PageExceedsExtent {
        group: u32,
        page_bytes: u64,
        extent_bytes: u64,
    },
    #[error(
        "the agent laid out pages of {agent} bytes; (rank {rank}, group {group}) pages are {page_bytes}"
    )]
    AgentPageBytes {
        agent: u64,
        rank: u32,
        group: u32,
        page_bytes: u64,
    },
    #[error("slot {slot} is outside the region's {slots} slots")]
    SlotOutOfRange { slot: u32, slots: u32 },
    #[error("publish has no pages")]
    EmptyPublish,
    #[error("a clear names 1..={max} namespaces, got {count}")]
    ClearNamespaces { count: usize, max: usize },
    #[error(
        "{leased} pages of the namespaces are leased and {reading} being read: clear when they are released"
    )]
    ClearBusy { leased: u64, reading: u64 },
    #[error(
        "device page {device_page:#x} is in (rank {region_rank}, group {region_group}), not (rank {rank}, group {group})"
    )]
    WrongRegion {
        device_page: u64,
        region_rank: u32,
        region_group: u32,
        rank: u32,
        group: u32,
    },
    #[error("a key or device page appears twice in one publish")]
    DuplicatePublishPage,
    #[error("query gives hashes for groups {given:?}; the instance has {declared:?}")]
    QueryGroups { given: Vec<u32>, declared: Vec<u32> },
    #[error("every group must give the same number of page hashes")]
    UnevenHashes,
    #[error("origin {origin} must be page-aligned and within the {end} hashed tokens")]
    Origin { origin: u64, end: u64 },
    #[error("expect_namespaces must give one namespace per rank")]
    ExpectNamespaces,
    #[error("operation is not a recovery")]
    NotRecovery,
    #[error("device page {device_page:#x} is targeted twice")]
    DuplicateTarget { device_page: u64 },
    #[error("no hash for page ending at {page_end}")]
    NoHash { page_end: u64 },
    #[error("group {group} is named twice")]
    DuplicateGroup { group: u32 },
    #[error("handoff {handoff:#x} is already held")]
    HandoffExists { handoff: u64 },
    #[error("a handoff must name some pages and a deadline above zero")]
    EmptyHandoff,
}

/// Why a restore's pages do not cover its required ranges exactly
/// (`CommandError::LoadInvalid`). Keys are their encoding in hex.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LoadRefusal {
    #[error("range of group {group} [{start}, {end}) needs {expected} keys, {got} were given")]
    RangeKeyCount {
        group: u32,
        start: u64,
        end: u64,
        expected: u64,
        got: u64,
    },
    #[error("key {key} does not belong to this range's namespace and group")]
    ForeignKey { key: String },
    #[error("key {key} appears twice")]
    DuplicateKey { key: String },
    #[error("key {key} is both transferred and retained")]
    Overlap { key: String },
    #[error("key {key} of the range is neither transferred nor retained")]
    Missing { key: String },
    #[error("key {key} is not part of the range")]
    Unexpected { key: String },
    #[error("page {pos:?} is outside the required ranges")]
    OutsideRanges { pos: PagePos },
}

impl From<crate::contract::LoadError> for LoadRefusal {
    fn from(e: crate::contract::LoadError) -> Self {
        use crate::contract::LoadError as L;
        let hex = |k: crate::key::StateKey| hex::encode(k.encode());
        match e {
            L::RangeKeyCount {
                group,
                start,
                end,
                expected,
                got,
            } => LoadRefusal::RangeKeyCount {
                group,
                start,
                end,
                expected,
                got: got as u64,
            },
            L::ForeignKey(k) => LoadRefusal::ForeignKey { key: hex(k) },
            L::DuplicateKey(k) => LoadRefusal::DuplicateKey { key: hex(k) },
            L::Overlap(k) => LoadRefusal::Overlap { key: hex(k) },
            L::Missing(k) => LoadRefusal::Missing { key: hex(k) },
            L::Unexpected(k) => LoadRefusal::Unexpected { key: hex(k) },
        }
    }
}

/// Why the copy engine refused a command's work (`CommandError::Copy`).
/// The reason is the engine's own words (an OS or driver error).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CopyRefusal {
    #[error("a device region of {bytes} bytes was refused: {reason}")]
    RegionRejected { bytes: u64, reason: String },
    #[error("{reason}")]
    Failed { reason: String },
}

/// Where an operation is. A recovery goes discover → validate → selected →
/// admit → reading → ready → restore_pending → restoring; a publish goes
/// publish_pending → publishing; both end finishing (draining submitted I/O
/// before their leases, bytes and pins return).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperationState {
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
    /// Restore accepted; its copies are resolved this tick.
    RestorePending,
    /// Device copies submitted (or waiting for copy room); leases held.
    Restoring,
    /// Publish accepted; DRAM slots are allocated this tick or later.
    PublishPending,
    /// Device → DRAM copies submitted (or waiting for copy room).
    Publishing,
    /// Retiring: waits until its submitted I/O drained, then releases.
    Finishing,
}

impl OperationState {
    pub fn as_str(self) -> &'static str {
        match self {
            OperationState::Discover => "discover",
            OperationState::Validate => "validate",
            OperationState::Selected => "selected",
            OperationState::Admit => "admit",
            OperationState::Reading => "reading",
            OperationState::Ready => "ready",
            OperationState::RestorePending => "restore_pending",
            OperationState::Restoring => "restoring",
            OperationState::PublishPending => "publish_pending",
            OperationState::Publishing => "publishing",
            OperationState::Finishing => "finishing",
        }
    }
}

impl std::fmt::Display for OperationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn one_of(states: &[OperationState]) -> String {
    let names: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    match names.split_last() {
        None => "in any state".into(),
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// A named bound (`Limits` in the runtime's config, or the manager's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitName {
    MaxInbox,
    MaxRanks,
    MaxGroups,
    MaxInstances,
    MaxSessions,
    MaxOperations,
    MaxQueryPages,
    MaxPublishPages,
    MaxRegionSlots,
    /// The manager's per-connection quotas (`orbitkv serve` settings).
    MaxSessionsPerConnection,
    MaxRegionsPerConnection,
    /// Bytes of every manager-owned device region together (each is mapped
    /// in full, so this bounds the manager's address space).
    MaxRegionBytes,
    /// Sessions of one client uid across its connections.
    MaxSessionsPerUid,
    /// Sessions of one client process across its connections.
    MaxSessionsPerProcess,
    /// P/D handoffs pinned at once (`limits.max_handoffs`).
    MaxHandoffs,
    /// Bytes P/D handoffs may pin together (`budget.handoff_bytes`).
    HandoffBytes,
    /// The longest a handoff may pin its pages
    /// (`limits.max_handoff_deadline_us`).
    MaxHandoffDeadline,
}

impl LimitName {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitName::MaxInbox => "max_inbox",
            LimitName::MaxRanks => "max_ranks",
            LimitName::MaxGroups => "max_groups",
            LimitName::MaxInstances => "max_instances",
            LimitName::MaxSessions => "max_sessions",
            LimitName::MaxOperations => "max_operations",
            LimitName::MaxQueryPages => "max_query_pages",
            LimitName::MaxPublishPages => "max_publish_pages",
            LimitName::MaxRegionSlots => "max_region_slots",
            LimitName::MaxSessionsPerConnection => "max_sessions_per_connection",
            LimitName::MaxRegionsPerConnection => "max_regions_per_connection",
            LimitName::MaxRegionBytes => "max_region_bytes",
            LimitName::MaxSessionsPerUid => "max_sessions_per_uid",
            LimitName::MaxSessionsPerProcess => "max_sessions_per_process",
            LimitName::MaxHandoffs => "max_handoffs",
            LimitName::HandoffBytes => "handoff_bytes",
            LimitName::MaxHandoffDeadline => "max_handoff_deadline",
        }
    }
}

impl std::fmt::Display for LimitName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Command {
    /// The wire name of the command (`"command"` on the wire).
    pub fn kind(&self) -> &'static str {
        match self {
            Command::RegisterInstance { .. } => "register_instance",
            Command::OpenSession { .. } => "open_session",
            Command::CloseSession { .. } => "close_session",
            Command::RegisterDeviceRegion { .. } => "register_device_region",
            Command::DevicePageAlloc { .. } => "device_page_alloc",
            Command::DevicePageFree { .. } => "device_page_free",
            Command::Query { .. } => "query",
            Command::Lookup { .. } => "lookup",
            Command::Load { .. } => "load",
            Command::Hold { .. } => "hold",
            Command::Prepare { .. } => "prepare",
            Command::Restore { .. } => "restore",
            Command::Publish { .. } => "publish",
            Command::Release { .. } => "release",
            Command::Cancel { .. } => "cancel",
            Command::CopyDone { .. } => "copy_done",
            Command::AdvanceClock { .. } => "advance_clock",
            Command::Clear { .. } => "clear",
        }
    }
}

impl CommandError {
    /// The serde name of the variant: reports and metrics count by it.
    pub fn kind(&self) -> &'static str {
        match self {
            CommandError::StaleSession => "stale_session",
            CommandError::StaleGeneration(_) => "stale_generation",
            CommandError::UnknownInstance(_) => "unknown_instance",
            CommandError::InstanceConflict(_) => "instance_conflict",
            CommandError::UnknownOperation(_) => "unknown_operation",
            CommandError::WrongState { .. } => "wrong_state",
            CommandError::UnknownRegion(_) => "unknown_region",
            CommandError::SlotInUse { .. } => "slot_in_use",
            CommandError::Invalid(_) => "invalid",
            CommandError::Limit { .. } => "limit",
            CommandError::LoadInvalid(_) => "load_invalid",
            CommandError::Copy(_) => "copy",
            CommandError::WallClock => "wall_clock",
            CommandError::NotOwner => "not_owner",
            CommandError::UnknownCopy(_) => "unknown_copy",
        }
    }

    /// What a refusal is counted by (`orbitkv_refusals_total{reason}`,
    /// `orbitkv inspect`): the malformation's kind for `invalid`
    /// (`unknown_rank`, `contract`, ...), `limit_<name>` for a limit, the
    /// variant's name otherwise. The same label the Python adapters give
    /// a refusal.
    pub fn reason(&self) -> String {
        match self {
            CommandError::Invalid(inv) => serde_json::to_value(inv)
                .ok()
                .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(String::from))
                .unwrap_or_else(|| "invalid".to_owned()),
            CommandError::Limit { name, .. } => format!("limit_{}", name.as_str()),
            other => other.kind().to_owned(),
        }
    }
}

/// A leased page in a `Ready` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    pub lease: u64,
    pub pos: PagePos,
    pub bytes: u64,
    /// The page's DRAM slot (`SlotKey` bits: index and generation) and its
    /// byte offset in the shared pool. Valid while the lease is held.
    pub slot: u64,
    pub offset: u64,
    /// xxh3-64 of the page's bytes, as computed when it was published: a
    /// reader of the shared pool verifies what it read against it.
    pub checksum: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Rejected {
        command: CommandId,
        error: CommandError,
    },
    InstanceRegistered {
        command: CommandId,
        instance: u64,
        namespaces: Vec<Namespace>,
        /// True when this registration re-attached to an existing instance.
        existing: bool,
    },
    SessionOpened {
        command: CommandId,
        session: SessionHandle,
    },
    /// The session is gone, once its I/O drained: the answer to the
    /// `CloseSession` named by `command`; `None` when its origin went away.
    SessionClosed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        command: Option<CommandId>,
        session: SessionHandle,
    },
    RegionRegistered {
        command: CommandId,
        region: u64,
        /// The executor's id for the region: the manager's copy engine's,
        /// or (an agent region) the agent's own, echoed.
        engine_region: u32,
        page_bytes: u64,
        /// An agent-owned region: the manager has no memory of it to share.
        #[serde(default, skip_serializing_if = "is_false")]
        agent: bool,
    },
    DevicePageAllocated {
        command: CommandId,
        device_page: u64,
    },
    /// The device page is gone: the answer to the `DevicePageFree` named by
    /// `command`; `deferred` when a copy held it past the free, so the
    /// answer came with the copy's last pin.
    DevicePageFreed {
        command: CommandId,
        device_page: u64,
        deferred: bool,
    },
    QueryResult {
        command: CommandId,
        request: u64,
        operation: u64,
        /// Page ends found per (rank, group), from discovery (metadata only).
        candidates: Vec<Candidates>,
        common: Vec<u64>,
        selected: Option<u64>,
        miss: Option<MissReason>,
    },
    /// Some required pages are being read; `Ready` or `Miss` follows.
    Loading {
        operation: u64,
    },
    Ready {
        operation: u64,
        boundary: u64,
        ranges: Vec<(u32, RequiredRange)>,
        leases: Vec<LeaseInfo>,
        /// Of the leased pages: already in DRAM, and read from lower tiers.
        pages_from_dram: u64,
        pages_from_tiers: u64,
    },
    /// A transfer passed `transfer_timeout_us` without completing. Its
    /// operation has failed, but the buffers, leases and device pages stay
    /// held: a late completion could still write them.
    TransferOverdue {
        operation: u64,
        kind: String,
    },
    Miss {
        operation: u64,
        reason: MissReason,
    },
    RestoreDone {
        operation: u64,
        pages: u64,
        bytes: u64,
    },
    PublishDone {
        command: CommandId,
        request: u64,
        inserted: u64,
        duplicates: u64,
        dropped: u64,
    },
    /// The answer to `Clear`: pages dropped from DRAM, and per lower tier
    /// the pages it dropped or why it could not.
    Cleared {
        command: CommandId,
        dram_pages: u64,
        tiers: Vec<TierCleared>,
    },
    Released {
        operation: u64,
    },
    /// The answer to `Hold`: the handoff's pages are pinned as they land;
    /// `pinned` of the `promised` were already in DRAM.
    Held {
        command: CommandId,
        handoff: u64,
        promised: u64,
        pinned: u64,
        bytes: u64,
    },
    /// Addressed to the origin that owns the regions: run these page copies
    /// in its copy agent and answer with `Command::CopyDone { copy }`. The
    /// pages stay pinned and the pool pages leased until then.
    AgentCopy {
        copy: u64,
        direction: AgentDirection,
        pages: Vec<AgentPageCopy>,
    },
}

impl Event {
    /// Whether this event ends its command and operation unless the stage
    /// that sends it knows otherwise (`Addressed::terminal`): a command's
    /// only reply, a refusal, or an operation's final outcome. A
    /// `QueryResult` ends its operation only with a miss (a hit goes on to
    /// prepare or release; a `Lookup`'s hit is marked terminal where it is
    /// sent).
    pub fn ends_by_default(&self) -> bool {
        match self {
            Event::Rejected { .. }
            | Event::InstanceRegistered { .. }
            | Event::SessionOpened { .. }
            | Event::RegionRegistered { .. }
            | Event::DevicePageAllocated { .. }
            | Event::Miss { .. }
            | Event::RestoreDone { .. }
            | Event::PublishDone { .. }
            | Event::Cleared { .. }
            | Event::Held { .. }
            | Event::DevicePageFreed { .. }
            | Event::Released { .. } => true,
            Event::QueryResult { miss, .. } => miss.is_some(),
            Event::SessionClosed { command, .. } => command.is_some(),
            Event::Loading { .. }
            | Event::Ready { .. }
            | Event::TransferOverdue { .. }
            | Event::AgentCopy { .. } => false,
        }
    }

    /// The command this event replies to, for events that are a command's
    /// reply (the other events concern an operation, device page or
    /// session the command created).
    pub fn command(&self) -> Option<CommandId> {
        match self {
            Event::Rejected { command, .. }
            | Event::InstanceRegistered { command, .. }
            | Event::SessionOpened { command, .. }
            | Event::RegionRegistered { command, .. }
            | Event::DevicePageAllocated { command, .. }
            | Event::QueryResult { command, .. }
            | Event::PublishDone { command, .. }
            | Event::Held { command, .. }
            | Event::DevicePageFreed { command, .. }
            | Event::Cleared { command, .. } => Some(*command),
            Event::SessionClosed { command, .. } => *command,
            _ => None,
        }
    }

    /// The operation this event is about, for the events of a query's
    /// operation (its `query_result` included).
    pub fn operation(&self) -> Option<u64> {
        match self {
            Event::QueryResult { operation, .. }
            | Event::Loading { operation }
            | Event::Ready { operation, .. }
            | Event::TransferOverdue { operation, .. }
            | Event::Miss { operation, .. }
            | Event::RestoreDone { operation, .. }
            | Event::Released { operation } => Some(*operation),
            _ => None,
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One lower tier's part of a `Cleared`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCleared {
    pub tier: String,
    /// Pages it dropped; `None` with `error` when it could not.
    pub pages: Option<u64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidates {
    pub rank: u32,
    pub group: u32,
    pub page_ends: Vec<u64>,
}

mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s = String::deserialize(d)?;
        crate::namespace::parse_hex32(&s)
            .ok_or_else(|| serde::de::Error::custom("expected 64 lowercase hex digits"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds_are_the_serde_names() {
        let all = [
            CommandError::StaleSession,
            CommandError::StaleGeneration(1),
            CommandError::UnknownInstance("x".into()),
            CommandError::InstanceConflict("x".into()),
            CommandError::UnknownOperation(1),
            CommandError::WrongState {
                operation: 1,
                state: OperationState::Ready,
                expected: vec![OperationState::Selected],
            },
            CommandError::UnknownRegion(1),
            CommandError::SlotInUse { region: 1, slot: 2 },
            CommandError::Invalid(InvalidCommand::NoRanks),
            CommandError::Limit {
                name: LimitName::MaxInbox,
                limit: 1,
            },
            CommandError::LoadInvalid(LoadRefusal::OutsideRanges {
                pos: PagePos {
                    rank: 0,
                    group: 0,
                    page_end: 16,
                },
            }),
            CommandError::Copy(CopyRefusal::Failed { reason: "x".into() }),
            CommandError::WallClock,
            CommandError::NotOwner,
            CommandError::UnknownCopy(1),
        ];
        for e in all {
            let v = serde_json::to_value(&e).unwrap();
            assert_eq!(v["error"], e.kind(), "{e:?}");
        }
    }

    #[test]
    fn typed_error_fields_keep_their_wire_names() {
        let e = CommandError::WrongState {
            operation: 7,
            state: OperationState::RestorePending,
            expected: vec![
                OperationState::Selected,
                OperationState::Admit,
                OperationState::Ready,
            ],
        };
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            serde_json::json!({"error": "wrong_state", "detail": {"operation": 7,
                "state": "restore_pending", "expected": ["selected", "admit", "ready"]}})
        );
        assert_eq!(
            e.to_string(),
            "operation 0x7 is restore_pending, not selected, admit or ready"
        );
        for name in [LimitName::MaxInbox, LimitName::MaxRegionSlots] {
            let v = serde_json::to_value(CommandError::Limit { name, limit: 3 }).unwrap();
            assert_eq!(v["detail"]["name"], name.as_str());
        }
    }

    #[test]
    fn refusal_details_are_typed_on_the_wire() {
        let cases = [
            (
                CommandError::Invalid(InvalidCommand::SlotOutOfRange { slot: 9, slots: 4 }),
                serde_json::json!({"error": "invalid", "detail": {"kind": "slot_out_of_range", "slot": 9, "slots": 4}}),
            ),
            (
                CommandError::Invalid(InvalidCommand::UnknownGroup { group: 3 }),
                serde_json::json!({"error": "invalid", "detail": {"kind": "unknown_group", "group": 3}}),
            ),
            (
                CommandError::LoadInvalid(LoadRefusal::Missing { key: "ab".into() }),
                serde_json::json!({"error": "load_invalid", "detail": {"kind": "missing", "key": "ab"}}),
            ),
            (
                CommandError::Copy(CopyRefusal::RegionRejected {
                    bytes: 64,
                    reason: "no memory".into(),
                }),
                serde_json::json!({"error": "copy", "detail": {"kind": "region_rejected", "bytes": 64, "reason": "no memory"}}),
            ),
        ];
        for (e, wire) in cases {
            assert_eq!(serde_json::to_value(&e).unwrap(), wire, "{e}");
            assert_eq!(serde_json::from_value::<CommandError>(wire).unwrap(), e);
        }
    }

    #[test]
    fn addressed_events_serialize_with_their_origin() {
        let a = Addressed {
            to: Origin(3),
            event: Event::Released { operation: 7 },
            terminal: true,
        };
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"to": 3, "event": {"event": "released", "operation": 7}, "terminal": true})
        );
        assert_eq!(serde_json::from_value::<Addressed>(v).unwrap(), a);
        assert_eq!(Origin::EMBEDDED, Origin(0));
    }

    #[test]
    fn refusal_reasons_name_the_malformation_or_the_limit() {
        let rank = CommandError::Invalid(InvalidCommand::UnknownRank { rank: 3 });
        assert_eq!(rank.reason(), "unknown_rank");
        let contract = CommandError::Invalid(InvalidCommand::Contract {
            reason: "group 1: a window must keep at least one past token".into(),
        });
        assert_eq!(contract.reason(), "contract");
        let limit = CommandError::Limit {
            name: LimitName::MaxSessions,
            limit: 4,
        };
        assert_eq!(limit.reason(), "limit_max_sessions");
        assert_eq!(
            CommandError::InstanceConflict("x".into()).reason(),
            "instance_conflict"
        );
        assert_eq!(CommandError::StaleSession.reason(), "stale_session");
    }

    #[test]
    fn command_kinds_are_the_wire_names() {
        let cmds = [
            serde_json::json!({"command": "open_session", "instance": "a"}),
            serde_json::json!({"command": "advance_clock", "us": 1}),
            serde_json::json!({"command": "cancel", "session": {"id": 1, "epoch": 1, "incarnation": 1}, "operation": 2}),
        ];
        for v in cmds {
            let want = v["command"].as_str().unwrap().to_owned();
            let c: Command = serde_json::from_value(v).unwrap();
            assert_eq!(c.kind(), want);
            assert_eq!(serde_json::to_value(&c).unwrap()["command"], want.as_str());
        }
    }
}
