//! The OrbitKV state model.
//!
//! This crate names what OrbitKV stores and decides when stored state may be
//! handed back. It depends on nothing else of ours.
//!
//! - [`identity`]: the computation identity (engine, model artifacts,
//!   configuration, settings, cache representation, cache scope). Fails
//!   closed.
//! - [`artifacts`]: content fingerprint of a local model directory.
//! - [`layout`]: storage layout and [`layout::seal`], which binds an identity
//!   to a layout and yields the [`Namespace`].
//! - [`key`] holds [`StateKey`] (namespace, group, engine-native chained hash)
//!   and [`StateFormat`].
//! - [`contract`]: the compiled [`RecoveryContract`]: required ranges, legal
//!   boundaries, cross-rank intersection, boundary selection, load validation.
//! - [`checksum`]: the page checksum (XXH3-64) every crate computes and
//!   verifies.
//! - [`encoding`] and [`value`]: the canonical byte encodings everything above
//!   hashes.
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
