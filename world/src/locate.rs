//! `Runtime::locate`: where a prompt's pages are, for `orbitkv lookup`.
//! Metadata only (the DRAM index, then each lower tier's `lookup`): it
//! leases, reads and changes nothing, so it needs no session or operation.

use std::collections::BTreeMap;

use orbitkv_components::admin::{LookupRequest, MAX_LOOKUP_HASHES, NamespacePages};
use orbitkv_components::ecs::Instance;
use orbitkv_components::{Namespace, StateKey};
use orbitkv_systems::resources::{Dram, Tiers};

use crate::runtime::Runtime;

/// A namespace to look in, its rank (tp, pp) and page size when an
/// instance registered it.
type Known = (Namespace, Option<(u32, u32)>, Option<u64>);

impl Runtime {
    /// Where each of `req.hashes` (chained hashes of one group) is stored,
    /// per namespace: the instance's ranks, or the one namespace named.
    /// A request naming neither, both, an unknown instance or more than
    /// [`MAX_LOOKUP_HASHES`] hashes is refused with the reason.
    pub fn locate(&mut self, req: &LookupRequest) -> Result<Vec<NamespacePages>, String> {
        if req.hashes.len() > MAX_LOOKUP_HASHES {
            return Err(format!(
                "{} hashes; a lookup names at most {MAX_LOOKUP_HASHES}",
                req.hashes.len()
            ));
        }
        let w = &mut *self.world;
        let mut known: Vec<Known> = Vec::new();
        let mut q = w.query::<&Instance>();
        let instances: Vec<&Instance> = q.iter(w).filter(|i| !i.retired).collect();
        match (&req.instance, &req.namespace) {
            (Some(name), None) => {
                let i = instances
                    .iter()
                    .find(|i| &i.name == name)
                    .ok_or_else(|| format!("no instance {name:?} is registered"))?;
                for r in &i.ranks {
                    known.push((
                        r.namespace,
                        Some((r.rank.tp, r.rank.pp)),
                        Some(i.page_tokens),
                    ));
                }
            }
            (None, Some(ns)) => {
                let owner = instances.iter().find_map(|i| {
                    let r = i.ranks.iter().find(|r| r.namespace == *ns)?;
                    Some(((r.rank.tp, r.rank.pp), i.page_tokens))
                });
                known.push((*ns, owner.map(|o| o.0), owner.map(|o| o.1)));
            }
            _ => return Err("name an instance or a namespace (one of them)".into()),
        }
        let mut out = Vec::with_capacity(known.len());
        for (namespace, rank, page_tokens) in known {
            let found: Vec<Option<String>> = req
                .hashes
                .iter()
                .map(|h| {
                    let key = StateKey {
                        namespace,
                        group: req.group,
                        native: *h,
                    };
                    if w.resource::<Dram>().index.contains_key(&key) {
                        return Some("dram".to_owned());
                    }
                    let mut tiers = w.resource_mut::<Tiers>();
                    let tiers = tiers.0.get_mut();
                    tiers
                        .iter()
                        .find(|t| t.lookup(&key).is_some())
                        .map(|t| t.name().to_owned())
                })
                .collect();
            let mut prefix_by_tier = BTreeMap::new();
            let mut prefix_pages = 0;
            for tier in found.iter().map_while(Option::as_ref) {
                *prefix_by_tier.entry(tier.clone()).or_default() += 1;
                prefix_pages += 1;
            }
            out.push(NamespacePages {
                namespace,
                rank,
                page_tokens,
                found,
                prefix_pages,
                prefix_by_tier,
                restorable_tokens: page_tokens.map(|t| t * prefix_pages),
            });
        }
        Ok(out)
    }
}
