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
    /// At most [`MAX_LOOKUP_HASHES`]: a longer list is refused while it is
    /// read, before it takes memory.
    #[serde(deserialize_with = "bounded_hashes")]
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

/// Reads a list of hashes, refusing it past [`MAX_LOOKUP_HASHES`] as
/// soon as the count is passed.
fn bounded_hashes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<NativeHash>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<NativeHash>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_LOOKUP_HASHES} hex hashes")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
            while let Some(h) = seq.next_element::<NativeHash>()? {
                if out.len() == MAX_LOOKUP_HASHES {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX_LOOKUP_HASHES} hashes; a lookup names at most {MAX_LOOKUP_HASHES}"
                    )));
                }
                out.push(h);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn request(n: usize) -> String {
        let hashes: Vec<String> = (0..n).map(|i| format!("\"{:04x}\"", i % 65536)).collect();
        format!(r#"{{"instance": "m", "hashes": [{}]}}"#, hashes.join(","))
    }

    #[test]
    fn a_lookup_past_its_hash_bound_is_refused_while_it_is_read() {
        let ok: LookupRequest = serde_json::from_str(&request(MAX_LOOKUP_HASHES)).unwrap();
        assert_eq!(ok.hashes.len(), MAX_LOOKUP_HASHES);
        assert_eq!((ok.group, ok.prompt_len), (0, None));
        let e = serde_json::from_str::<LookupRequest>(&request(MAX_LOOKUP_HASHES + 1)).unwrap_err();
        assert!(e.to_string().contains("at most 16384"), "{e}");
        let e = serde_json::from_str::<LookupRequest>(r#"{"instance": "m", "hashes": ["zz"]}"#)
            .unwrap_err();
        assert!(
            e.to_string().contains("hash") || e.to_string().contains("Invalid"),
            "{e}"
        );
    }
}
