//! `Runtime::locate`: where a prompt's pages are, for `orbitkv lookup`.
//! Metadata only (the DRAM index, then each lower tier's `lookup`): it
//! leases, reads and changes nothing, so it needs no session or operation.

use std::collections::BTreeMap;

use bevy_ecs::world::Mut;
use orbitkv_components::admin::{LookupRequest, MAX_LOOKUP_HASHES, NamespacePages, Restorable};
use orbitkv_components::api::MissReason;
use orbitkv_components::contract::{GroupEvidence, StateBundle};
use orbitkv_components::ecs::{Instance, RankState};
use orbitkv_components::{Namespace, StateKey, common_boundaries, prompt_limit, select_boundary};
use orbitkv_io::tier::BackingTier;
use orbitkv_systems::discover::{rank_candidates, unreachable};
use orbitkv_systems::resources::{Dram, RestorePolicy, Tiers};

use crate::runtime::Runtime;

/// A namespace to look in, its rank (tp, pp) and page size when an
/// instance registered it.
type Known = (Namespace, Option<(u32, u32)>, Option<u64>);

impl Runtime {
    /// Where each of `req.hashes` (chained hashes of one group) is stored,
    /// per namespace: the instance's ranks, or the one namespace named.
    /// A request naming neither, both, an unknown instance or more than
    /// [`MAX_LOOKUP_HASHES`] hashes is refused with the reason.
    pub fn locate(
        &mut self,
        req: &LookupRequest,
    ) -> Result<(Vec<NamespacePages>, Option<Restorable>), String> {
        if req.hashes.len() > MAX_LOOKUP_HASHES {
            return Err(format!(
                "{} hashes; a lookup names at most {MAX_LOOKUP_HASHES}",
                req.hashes.len()
            ));
        }
        let w = &mut *self.world;
        let mut known: Vec<Known> = Vec::new();
        // The ranks whose contracts decide what is restorable, with the
        // instance's page size.
        let mut q = w.query::<&Instance>();
        let instances: Vec<&Instance> = q.iter(w).filter(|i| !i.retired).collect();
        let deciding: Option<(Vec<RankState>, u64)> = match (&req.instance, &req.namespace) {
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
                Some((i.ranks.clone(), i.page_tokens))
            }
            (None, Some(ns)) => {
                let owner = instances.iter().find_map(|i| {
                    let r = i.ranks.iter().find(|r| r.namespace == *ns)?;
                    Some((r, i.page_tokens))
                });
                known.push((
                    *ns,
                    owner.map(|(r, _)| (r.rank.tp, r.rank.pp)),
                    owner.map(|o| o.1),
                ));
                owner.map(|(r, page)| (vec![r.clone()], page))
            }
            _ => return Err("name an instance or a namespace (one of them)".into()),
        };
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
        let restorable = deciding.map(|(ranks, page)| {
            let min_load = w.resource::<RestorePolicy>().min_load_tokens;
            w.resource_scope(|w, mut tiers: Mut<Tiers>| {
                let tiers = tiers.0.get_mut();
                restorable(req, &ranks, page, min_load, w.resource::<Dram>(), tiers)
            })
        });
        Ok((out, restorable))
    }
}

/// What a load of `req.hashes` (every group's chained hashes) would
/// restore now on `ranks`: the runtime's own selection (discover's
/// candidates, each rank's contract, the intersection, the prompt's cap),
/// and the tier each page position would be read from.
fn restorable(
    req: &LookupRequest,
    ranks: &[RankState],
    page: u64,
    min_load_tokens: u64,
    dram: &Dram,
    tiers: &[Box<dyn BackingTier>],
) -> Restorable {
    let miss = |reason| Restorable {
        tokens: 0,
        by_tier: BTreeMap::new(),
        miss: Some(reason),
    };
    let end = (req.hashes.len() as u64).saturating_mul(page);
    if page == 0 || end == 0 {
        return miss(MissReason::NotFound);
    }
    let hashes = |_group: u32| &req.hashes[..];
    let bundles: Vec<StateBundle> = ranks
        .iter()
        .map(|rank| StateBundle {
            namespace: rank.namespace,
            start: 0,
            end,
            groups: rank_candidates(&hashes, (0, end), page, rank, dram, tiers)
                .into_iter()
                .map(|(group, page_ends)| GroupEvidence { group, page_ends })
                .collect(),
        })
        .collect();
    let found = |b: &StateBundle| b.groups.iter().any(|g| !g.page_ends.is_empty());
    if !bundles.iter().any(found) {
        return miss(unreachable(tiers).unwrap_or(MissReason::NotFound));
    }
    // As the validate stage decides: a rank with no legal boundary is an
    // incomplete group, whatever the others hold.
    let mut per_rank = Vec::with_capacity(ranks.len());
    for (rank, bundle) in ranks.iter().zip(&bundles) {
        match rank.contract.restorable_boundaries(bundle) {
            Ok(b) if !b.is_empty() => per_rank.push(b),
            _ => return miss(MissReason::IncompleteGroup),
        }
    }
    let limit = req.prompt_len.map_or(end, prompt_limit);
    let common = common_boundaries(&per_rank);
    let Some(selected) = select_boundary(&common, limit) else {
        return miss(MissReason::NoLegalBoundary);
    };
    if selected < min_load_tokens {
        return miss(MissReason::NotWorthLoading);
    }
    // Per page position, the slowest source any required page is read
    // from: 0 is DRAM, 1.. the lower tiers in order.
    let pages = (selected / page) as usize;
    let mut slowest = vec![0usize; pages];
    for rank in ranks {
        let Ok(ranges) = rank.contract.required_ranges(rank.namespace, 0, selected) else {
            return miss(MissReason::IncompleteGroup);
        };
        for range in ranges {
            for index in range.start / page..range.end / page {
                // Ranges lie below the selected boundary, within the hashes.
                let Some(native) = req.hashes.get(index as usize) else {
                    return miss(MissReason::IncompleteGroup);
                };
                let key = StateKey {
                    namespace: rank.namespace,
                    group: range.group,
                    native: *native,
                };
                let source = if dram.index.contains_key(&key) {
                    0
                } else {
                    match tiers.iter().position(|t| t.lookup(&key).is_some()) {
                        Some(t) => t + 1,
                        // Gone since discovery: nothing honest to report.
                        None => return miss(MissReason::NotFound),
                    }
                };
                if let Some(s) = slowest.get_mut(index as usize) {
                    *s = (*s).max(source);
                }
            }
        }
    }
    let mut by_tier = BTreeMap::new();
    for source in slowest {
        let name = match source {
            0 => "dram",
            t => tiers.get(t - 1).map_or("unknown", |t| t.name()),
        };
        *by_tier.entry(name.to_owned()).or_default() += page;
    }
    Restorable {
        tokens: selected,
        by_tier,
        miss: None,
    }
}
