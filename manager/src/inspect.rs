//! The answer to an `Inspect` frame: a [`Snapshot`] of the live state.

use orbitkv_ipc::{ConnectionSummary, Health, Snapshot};

use crate::state::State;

pub fn snapshot(st: &mut State) -> Snapshot {
    st.refresh_metrics();
    let s = st.rt.stats();
    let (total, last_minute) = st.metrics.windows();
    Snapshot {
        incarnation: st.settings.runtime.incarnation,
        uptime_s: st.started.elapsed().as_secs_f64(),
        connections: st
            .conns
            .values()
            .map(|c| ConnectionSummary {
                id: c.id,
                client: c.name.clone(),
                pid: c.pid,
                sessions: c.sessions.len(),
                regions: c.regions.len(),
                outbox_bytes: c.outbox.bytes(),
                hot: c.hot,
            })
            .collect(),
        instances: s.instances,
        sessions: s.sessions,
        operations: s.operations,
        operations_by_state: s
            .operations_by_state
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect(),
        leases: s.leases,
        transfers: s.transfers,
        device_pages: s.device_pages,
        bytes_reserved: s.bytes_reserved,
        pages: s.pages,
        pool_bytes_used: s.pool_bytes_used,
        pool_capacity_bytes: s.pool_capacity_bytes,
        tiers: st.rt.tier_occupancy(),
        total,
        last_minute,
        health: health(st),
        handoffs: orbitkv_ipc::snapshot::Handoffs {
            standing: s.handoffs.standing,
            pinned_pages: s.handoffs.pinned_pages,
            reserved_bytes: s.handoffs.reserved_bytes,
            budget_bytes: s.handoffs.budget_bytes,
            held: s.handoffs.counts.held,
            taken: s.handoffs.counts.taken,
            expired: s.handoffs.counts.expired,
        },
        presence: st
            .presence
            .as_ref()
            .map(|p| p.summary(&st.metrics.counters)),
    }
}

fn health(st: &mut State) -> Health {
    let remote_down = st.rt.remote_stats().is_some_and(|r| r.breaker_open);
    Health {
        tiers_down: if remote_down {
            vec!["remote".into()]
        } else {
            vec![]
        },
        overdue_operations: st
            .rt
            .operations()
            .iter()
            .filter(|o| o.overdue_transfers > 0)
            .count(),
        inbox_room: st.rt.inbox_room(),
    }
}
