//! Stage 2, discover: which required pages exist, per rank and group.
//! Metadata only: the DRAM index and each lower tier's index; no payload
//! reads and no byte reservations.

use bevy_ecs::prelude::*;
use orbitkv_components::StateKey;
use orbitkv_components::api::MissReason;
use orbitkv_components::contract::Rule;
use orbitkv_components::ecs::{Instance, OpState, Operation, Recovery};

use crate::resources::{Dram, Tiers};

pub fn discover(
    mut ops: Query<(&mut Operation, &mut Recovery)>,
    instances: Query<&Instance>,
    dram: Res<Dram>,
    mut tiers: ResMut<Tiers>,
) {
    let tiers = tiers.0.get_mut();
    for (mut op, mut rec) in &mut ops {
        if op.state != OpState::Discover {
            continue;
        }
        op.state = OpState::Validate;
        let Ok(instance) = instances.get(op.instance) else {
            rec.miss = Some(MissReason::Namespace);
            continue;
        };
        let namespaces = instance.ranks.iter().map(|r| r.namespace);
        if !rec.expect_namespaces.is_empty()
            && !namespaces.eq(rec.expect_namespaces.iter().copied())
        {
            rec.miss = Some(MissReason::Namespace);
            continue;
        }
        let page = instance.page_tokens;
        let first = rec.origin / page;
        let mut candidates = Vec::new();
        for (rank_index, rank) in instance.ranks.iter().enumerate() {
            // Groups are sorted, so group 0 comes first (the prefix group when
            // there is one); every rule needs the page ending at a legal
            // boundary, so pages past group 0's last found page can never be
            // part of one.
            let mut last = rec.end / page;
            for group in rank.contract.groups() {
                let hashes = &rec
                    .groups
                    .iter()
                    .find(|g| g.group == group.id)
                    .expect("validated at ingest")
                    .hashes;
                let mut ends = Vec::new();
                for index in first..last {
                    let key = StateKey {
                        namespace: rank.namespace,
                        group: group.id,
                        native: hashes[index as usize],
                    };
                    let present = dram.index.contains_key(&key)
                        || tiers.iter().any(|t| t.lookup(&key).is_some());
                    if present {
                        ends.push((index + 1) * page);
                    } else if group.rule == Rule::Prefix {
                        break;
                    }
                }
                if group.id == 0 {
                    last = ends.last().map_or(first, |e| e / page);
                }
                candidates.push((rank_index as u32, group.id, ends));
            }
        }
        rec.candidates = candidates;
    }
}
