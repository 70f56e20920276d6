//! Operator requests answered without an engine session, as plain data
//! for the wire and the command line: where a prompt's pages are
//! (`orbitkv lookup`). Nothing here leases, reads or changes a page.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
    pub group: u32,
    pub hashes: Vec<NativeHash>,
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
    pub error: Option<String>,
}
