//! The OrbitKV state model.
//!
//! This crate names what OrbitKV stores and decides when stored state may be
//! handed back. It depends on nothing else of ours.
//!
//! No I/O beyond reading a model directory at identity time.
//!
//! # Codemap
//!
//! - `identity.rs`: `IdentityInputs` (what an adapter knows) →
//!   `IdentityInputs::resolve` → `ResolvedIdentity { digest, parts, fingerprint }`.
//!   `IdentityParts::digest` is pure. `IdentityError` is the only way an input
//!   can fail: nothing defaults silently. Precedence of artifact sources:
//!   `ORBITKV_MODEL_FINGERPRINT` > hub revision > directory content
//!   (`ArtifactIdentity`).
//! - `artifacts.rs`: `fingerprint_dir`, the content digest of a model directory:
//!   relative paths and contents only, 64 MiB chunks hashed in parallel (rayon).
//!   `classify` decides which files count.
//! - `layout.rs`: `StorageLayout`, `StorageSlot`, `seal(identity, layout,
//!   groups) -> Namespace`. Invariants: `device_addr` and
//!   `pool_capacity_pages` never reach the sealed bytes; each group's id, rule
//!   (with its window) and component kinds do, so two registrations that read
//!   a group's pages differently never share a namespace.
//! - `namespace.rs`: `Namespace` (32 bytes, hex on the wire; all-zero = empty).
//! - `key.rs`: `StateKey { namespace, group, native }` with `encode`/`decode`
//!   (layout in the module docs, golden vectors in `tests/golden.rs`),
//!   `NativeHash` (≤ 64 bytes inline, so keys are `Copy`), `StateFormat`;
//!   `KeyMap` (hashbrown + `KeyHasher`: folded multiplies keyed by per-process
//!   secrets, one per 128 bits written; every index keyed by `StateKey`) and
//!   `KeyRef` (a key's borrowed parts: discovery looks pages up without
//!   building keys; hashes exactly as the `StateKey`, the native hash in
//!   whole words, every used byte).
//! - `contract.rs`: `ContractSpec` → `RecoveryContract::compile` →
//!   `required_ranges`, `restorable_boundaries(StateBundle)`,
//!   `common_restorable`, `validate_load`; free functions `common_boundaries`,
//!   `select_boundary`, `prompt_limit`, `vllm_window_past_tokens`. Invariant:
//!   legality is computed from the same `demand` that `required_ranges` returns,
//!   so the two cannot disagree. `Dsa`, `Draft`, `Auxiliary` never compile.
//! - `checksum.rs`: the page checksum (XXH3-64, twox-hash's kernel picked
//!   at run time) and the fused copies that hash in the same pass:
//!   `copy_hashing_written` (the bytes that land) and `copy_hashing_read`
//!   (the source as it is read); copies of 256 KiB or more stream past the
//!   cache (AVX2 non-temporal stores, fenced before they return).
//! - `encoding.rs`, `value.rs`: `Frame` (domain-separated, versioned,
//!   length-framed) and `CanonicalValue` (one byte encoding per JSON value;
//!   duplicate keys rejected). Every digest above goes through these.
//!
//! Never knows about: ECS, tiers, the wire, engines' Python objects.
//!
//! Also here, as plain data so the wire, Python and traces can carry them:
//!
//! - `admin.rs`: `LookupRequest`, `LookupReply`, `NamespacePages` (`orbitkv
//!   lookup`; at most `MAX_LOOKUP_HASHES`).
//! - `api.rs`: `Command`, `Event`, `CommandError` (a refused command had no
//!   effect; `NotOwner` when it names another origin's entity; its details
//!   are typed: `LimitName`, `InvalidCommand`, `LoadRefusal`, `CopyRefusal`,
//!   each a `kind` on the wire), `Origin` (who
//!   submitted a command: a connection, or `Origin::EMBEDDED`), `Addressed`
//!   (an event, the origin it goes to, and `terminal`: the event ends its
//!   command and operation, decided by the stage that decides the outcome;
//!   `Event::ends_by_default` where that is the whole story, the validate
//!   stage for a query's result (a `Lookup`'s always ends); every reply names its command, a
//!   deferred `DevicePageFreed` and a drained `SessionClosed` too), `Command::Lookup` (a query that ends
//!   with its result, answered at ingest without an operation: its result
//!   names operation 0), `Command::Load` (a query that restores by itself once
//!   ready: the engine names every destination it could take and what it
//!   holds, the runtime picks the boundary; one round trip per hit),
//!   `MissReason` (the one miss enum:
//!   reports, metrics, events),
//!   `SessionHandle { id, epoch, incarnation }`, `PagePos`, `RestoreTarget`,
//!   `PublishPage`. Handles are `Entity::to_bits()`.
//! - `ecs.rs`: the ECS components: `Instance` (per-rank `RankState`:
//!   namespace, compiled contract, page bytes), `Group`, `Session` (its
//!   `Origin`), `Page` (`StateKey`, bytes, checksum, `Residency`), `Lease`,
//!   `Operation` (its origin, state, deadline, bytes reserved, `Outcome`),
//!   `Recovery` (query/prepare/restore data, `PageNeed`s, planned copies),
//!   `PublishJob` (`PublishItem`s with `ItemState`), `Transfer`
//!   (`TransferKind`), `DeviceRegion` (slot index of its live pages),
//!   `DevicePage` (pins, deferred free). Ownership is bevy relationships:
//!   `GroupOf`/`Groups`, `SessionOf`/`Sessions`, `OperationOf`/`Operations`,
//!   `TransferOf`/`Transfers`, `LeaseOf`/`Leases` (page), `HeldBy`/
//!   `HeldLeases` (operation; despawning it returns its leases), `RegionOf`/
//!   `Regions`, `PageOf`/`RegionPages` (despawning a session despawns its
//!   regions and their pages). `HeldLeases` and `RegionPages` are entity
//!   sets: bevy's `Vec` removes by scanning, quadratic for a restore's
//!   thousand leases or a region's thousands of slots. Each `OperationState` is also a marker
//!   component (`at::Reading`, ...) that stages filter on; `mark_state`
//!   swaps it. Invariant: no count of leases, in-flight I/O or session
//!   operations is kept by hand; the counters that remain (device-page pins,
//!   reserved bytes, registry counts) are decremented only through
//!   `resources::decrement`, which asserts.
//!
//! # Byte layouts
//!
//! Every digest is SHA-256 over one canonical frame ([`encoding::Frame`]):
//! `domain_len:u32 ‖ domain ‖ version:u16 ‖ (field_id:u16 ‖ len:u64 ‖ body)*`,
//! little-endian, fields in increasing id order. The domains in use:
//!
//! | domain | version | defined in |
//! | --- | --- | --- |
//! | `orbitkv/computation-identity` | 1 | [`identity`] |
//! | `orbitkv/model-artifacts` | 1 | [`artifacts`] |
//! | `orbitkv/artifact-file` | 1 | [`artifacts`] |
//! | `orbitkv/namespace` | 1 | [`layout`] |
//! | `orbitkv/state-format` | 1 | [`key`] |
//!
//! JSON-like inputs use the canonical value encoding of [`value`]. The
//! [`StateKey`] byte encoding is documented in [`key`] and pinned by golden
//! vectors in `tests/golden.rs`. Changing any of these is a version bump:
//! old entries stop matching, which is the intended failure mode.

pub mod admin;
pub mod api;
pub mod artifacts;
pub mod checksum;
pub mod contract;
pub mod ecs;
pub mod encoding;
pub mod identity;
pub mod key;
pub mod layout;
pub mod namespace;
pub mod value;

pub use contract::{
    ComponentKind, ContractError, ContractSpec, GroupEvidence, GroupSpec, LoadError,
    RecoveryContract, RequiredRange, Rule, StateBundle, common_boundaries, prompt_limit,
    select_boundary, vllm_window_past_tokens,
};
pub use identity::{IdentityError, IdentityInputs, IdentityParts, ResolvedIdentity};
pub use key::{KeyError, KeyHasher, KeyMap, KeyRef, KeySet, NativeHash, StateFormat, StateKey};
pub use layout::{LayoutError, StorageLayout, StorageSlot, seal};
pub use namespace::Namespace;
