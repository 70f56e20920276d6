//! The runtime's stages, one module each, in the order `orbitkv-world`
//! declares: ingest, discover, validate, read, restore, fence, evict.
//!
//! Each stage is a plain function over queries and resources; its signature
//! says what it reads and writes. Structural changes go through `Commands`.
//!
//! # Codemap
//!
//! One module per stage; each is a function whose signature lists what it
//! reads and writes, querying only the operations in its states (state
//! markers); inputs that travel together are `SystemParam` bundles
//! (`Copies`, `Devices`, `Reads`, `Landing`, `Returns`). `ingest` is the only
//! exclusive system (commands of every kind apply in arrival order, and a
//! refused command must have no effect). Invariant: no non-test function here
//! is over 80 lines.
//!
//! - `ingest/`: `Command` → entities, one module per command family
//!   (`instances`, `sessions`, `devices`, `recovery`, `publish`, `clear`:
//!   drop namespaces from DRAM and every tier's `clear_namespace`, refused
//!   `ClearBusy` while leased or read); each handler
//!   is a `plan` that only reads (and refuses with a typed error) and an
//!   `apply` that cannot fail. `resolve` checks handles: sessions
//!   (`StaleSession`), ownership (`NotOwner`: the session must be the
//!   submitting origin's, and the operation, region or device page the
//!   session's), device pages (`StaleGeneration`). `Inbound::CloseOrigin`
//!   closes an origin's sessions in arrival order with its commands.
//!   `devices` refuses a manager-owned region past `max_region_bytes`,
//!   summed from the live regions (no count kept by hand). `recovery`
//!   answers a `Lookup` in place (`discover_one` then `conclude`, what the
//!   next two stages run per operation), against the index as the command
//!   finds it: it holds nothing, so it spawns no operation.
//! - `discover.rs`: per rank and group, which pages exist (DRAM index by
//!   `KeyRef`, then each tier's `lookup`). Stops a prefix group at its first
//!   gap. Nothing found while a tier is `unavailable`: that tier's miss
//!   reason (an outage is not `not_found`; the read stage does the same for a
//!   page gone from every tier).
//! - `validate.rs`: `restorable_boundaries` per rank → `common_boundaries` →
//!   `select_boundary(prompt_limit(prompt_len))`; then the `RestorePolicy`
//!   gate (`min_load_tokens`; `prefill_tokens_per_s` against the load's time
//!   at the measured `LoadRates`, never on an unmeasured source) may turn the
//!   hit into `not_worth_loading`; emits `QueryResult` (`conclude`).
//! - `read.rs`: `read`: budget admission in arrival order (`Admission`;
//!   `PageNeed`s for the selected ranges), then, in the same system so an
//!   admitted recovery reads in its tick, leases on resident pages and
//!   lower-tier reads bounded by `max_reads_per_group` and
//!   `max_inflight_reads`; shares a read when two operations need the same
//!   key (`Dram::reading`). A ready `Load` goes on to `RestorePending` in
//!   the same tick, its plan cut to the selected ranges of its ranks and
//!   checked by `load.rs` (the one coverage check, shared with `Restore`'s
//!   ingest); a plan that does not cover them ends with `Rejected`.
//! - `restore.rs`: resolves every destination live once, when the restore's
//!   copies are planned (else `StaleGeneration`, nothing copied), pins them
//!   all (`Recovery::copies`) until the restore retires (a free meanwhile is
//!   deferred and reported after the reply), and submits batches as
//!   `max_inflight_copies` allows until `restore_deadline_us`. `publish.rs`: allocates
//!   all-or-none and copies device → DRAM in batches the same way; an
//!   agent's batch takes at most a quarter of its staging area, so the agent
//!   fills the next while the fence moves the last into the pool.
//!   `copies.rs`: `Copies` (submit within the bounds to the batch's
//!   `Executor`: the copy engine, or an `Event::AgentCopy` to the origin that
//!   owns the region, at most `max_agent_copies_per_origin` in flight;
//!   `QueueFull` waits), `flush_agent_events`, and
//!   `Devices` (resolve, pin, unpin).
//! - `ingest/handoff.rs` + `handoff.rs` (P/D, docs/pd.md): `Hold` spawns a
//!   `Handoff` (no session owns it: a producer that exits leaves its promise)
//!   that reserves its promised pages' bytes from `Handoffs` (the budget),
//!   leases (`HeldBy` the handoff) those in DRAM and lists the rest in
//!   `Handoffs::wanted`; while any are wanted, `Dram::index_page` records
//!   landings and the fence stage's `pin` leases them; `sweep` ends a handoff
//!   once the `Load` naming it (`Load::handoff`, recorded at its ingest) has
//!   retired, or at its deadline, returning leases (despawn) and bytes. The
//!   invariants check the index, the reserved sum and pins = leases.
//! - `ingest/agents.rs`: `CopyDone` (only from the origin the copy was sent
//!   to, once: else `NotOwner`/`UnknownCopy`, no effect). `close_origin`
//!   fails the origin's agent copies (`CopyFailure::Lost`).
//! - `fence/`: `land` (tier reads: verify checksums, index, lease to the
//!   reader, a failed read's reason from its tier's `miss_reason`; device
//!   copies, from the copy engine or reported by agents: record restore
//!   failures, a restore whose bytes do not match their page's checksum is a
//!   `checksum` miss; published pages are indexed under the checksums the
//!   copy computed in its pass and offered to write-through tiers with them;
//!   a publish an agent ran is moved from the origin's staging slots into its
//!   pool slots with `copy_with_checksum`, then the staging slots are freed),
//!   `expire` (overdue transfers, and agent copies past
//!   `agent_copy_deadline_us`: each fails and finishes its operation but keeps
//!   what it holds until reported or lost; deadlines), `retire` (two steps:
//!   the final reply goes out once the outcome is decided and every transfer
//!   left is overdue or none is, so a deadline is a deadline however long a
//!   hung copy holds on; then, once an operation has no `Transfers`, the only
//!   place leases, reservations and device pins are returned),
//!   `close_sessions`. `settle_demotions` (called by `land`, and by
//!   `Runtime::finish_demotions`): finished demotions counted, released
//!   in-place slots freed.
//! - `evict.rs`: frees LRU unleased pages of classes an allocation failed for,
//!   demoting each to the first tier that takes writes (`BackingTier::demote`
//!   with the checksum the page carries; a refusal is a typed `DemoteRefused`,
//!   counted by reason; `Checksum` for bytes altered since they landed, from
//!   tiers that copy). A tier that writes straight from the pool
//!   (`Demoted::InPlace`, the SSD store) gets the victim's slot held in
//!   `Dram::demoting`, owned by no page and out of the index, until the fence
//!   stage's `land` sees the tier release the token. The index changes only
//!   through `Dram::index_page`/`unindex_page`, which also feed the page
//!   journal (`PageJournal`: `PageChange::Stored`/`Removed`, off until
//!   `Runtime::record_page_changes`, bounded, a loss reported on the drain;
//!   it remembers the last `RECENT_REMOVALS` removed keys, and discover
//!   counts a query that stops at one as an event race). A class's pressure is
//!   the slots its failed allocations asked for (a publish that gives its
//!   slots back asks for all it needs); every slot that will serve them counts
//!   against it (`Dram::coming_free`: free slots, those freed earlier in the
//!   tick included, and held ones), so a tick never evicts twice for one
//!   shortage; `Dram::evicted` records what it did. The invariants tie the
//!   held slots to each tier's `demotions_holding` and check the eviction
//!   bound.
//! - `resources.rs`: `Clock`, `Limits` (every bound, by name), `Inbox`,
//!   `Outbox`, `Dram`, `Copier`, `Tiers`, `Budget`, `Registry`,
//!   `TransferIndex`, `Agents` (agent copies sent and reported, this tick's
//!   `AgentCopy` events, each origin's staging `HostPool`), `Metrics`,
//!   `RestorePolicy` (`[restore]`), `LoadRates` (each load source's rate over
//!   its busy periods: device copies started in `copies.rs` and tier reads in
//!   `read.rs`, ended in the fence; timed by the wall clock unless the clock
//!   is simulated, since a copy often lands within its tick;
//!   `Runtime::load_rates`, `/metrics`).
//! - `lifecycle.rs`: `set_state`/`set_state_now` (field and marker
//!   together), `finish`, `take_lease`, `unpin_device_page`, and the
//!   hooks `on_leased`/`on_unleased` (on `Leases`' add and remove) that
//!   keep the LRU to exactly the unleased pages as `Leases` lists gain their first or lose their last
//!   lease.
//!
//! Invariant: no system reads the OS clock or touches a file; time is
//! `Res<Clock>`, I/O goes through `Copier` and `Tiers`.

pub mod copies;
pub mod discover;
pub mod evict;
pub mod fence;
pub mod handoff;
pub mod ingest;
pub mod lifecycle;
mod load;
pub mod publish;
pub mod read;
pub mod resources;
pub mod restore;
pub mod validate;
