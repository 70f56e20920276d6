//! Operator requests answered without an engine session, as plain data
//! for the wire and the command line: where a prompt's pages are
//! (`orbitkv lookup`). Nothing here leases, reads or changes a page.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::api::MissReason;
use crate::key::NativeHash;
use crate::namespace::Namespace;

/// The most hashes one lookup names: a bound on the reply's size.
pub const MAX_LOOKUP_HASHES: usize = 16_384;

/// Where the pages of one group's chained hashes are, in a registered
/// instance's namespaces (every rank) or in one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    #[serde(default)]
    pub instance: Option<String>,
    #[serde(default)]
    pub namespace: Option<Namespace>,
    /// The group `found` and the `prefix_*` fields look in (0, the
    /// attention group, by default); `restorable` covers every group.
    #[serde(default)]
    pub group: u32,
    pub hashes: Vec<NativeHash>,
    /// The prompt's length in tokens, when known: a load ends at most at
    /// its last token but one (the engine computes that one). Without it,
    /// every full page of `hashes` may be restored.
    #[serde(default)]
    pub prompt_len: Option<u64>,
}

/// One namespace's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespacePages {
    pub namespace: Namespace,
    /// The rank (tp, pp) of the instance this namespace is, when known.
    pub rank: Option<(u32, u32)>,
    /// Tokens per page, when an instance registered with this namespace.
    pub page_tokens: Option<u64>,
    /// Per hash, the first tier that holds its page (`dram`, `ssd`,
    /// `remote`), or `None`. Lower tiers answer from their metadata.
    pub found: Vec<Option<String>>,
    /// Pages present from the first hash on, without a gap: what a prefix
    /// group could restore.
    pub prefix_pages: u64,
    /// Those pages per tier.
    pub prefix_by_tier: BTreeMap<String, u64>,
    /// `prefix_pages * page_tokens`, when the page size is known.
    pub restorable_tokens: Option<u64>,
}

/// The answer to a [`LookupRequest`]: every namespace asked about, or why
/// the request was refused (unknown instance, too many hashes, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupReply {
    pub namespaces: Vec<NamespacePages>,
    /// What a load of this prompt would restore now, by the recovery
    /// contract (the router's answer): `hashes` taken as the chained
    /// hashes of every group, every rank of the instance (or the one
    /// namespace named) required. `None` when no registered instance owns
    /// the namespaces, or the request was refused.
    #[serde(default)]
    pub restorable: Option<Restorable>,
    pub error: Option<String>,
}

impl LookupReply {
    /// The reply to a lookup the runtime answered (`Runtime::locate`) or
    /// refused with the reason.
    pub fn from_result(r: Result<(Vec<NamespacePages>, Option<Restorable>), String>) -> Self {
        match r {
            Ok((namespaces, restorable)) => LookupReply {
                namespaces,
                restorable,
                error: None,
            },
            Err(e) => LookupReply {
                namespaces: vec![],
                restorable: None,
                error: Some(e),
            },
        }
    }
}

/// Prefix tokens a load would restore now, as the runtime would select
/// them (every group's rule on every rank, capped by the prompt and by
/// `[restore] min_load_tokens`); nothing is leased, so a later load can
/// still find less (an eviction in between).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restorable {
    /// Tokens a load would restore to; 0 on a miss.
    pub tokens: u64,
    /// Those tokens by the tier they would be read from (`dram`, `ssd`,
    /// `remote`): a page position counts in the slowest tier any of its
    /// required pages (any rank, any group) is read from.
    pub by_tier: BTreeMap<String, u64>,
    /// Why nothing is restorable, when `tokens` is 0.
    pub miss: Option<MissReason>,
}
