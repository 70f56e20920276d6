//! One client frame at a time: the protocol's state machine. A connection
//! must greet once (`Hello`), then may submit commands, ping and inspect.
//! Anything else is a [`Refusal`]: the loop sends it as an `Error` frame
//! and closes that connection only.

use std::os::fd::OwnedFd;

use orbitkv_components::admin::{LookupReply, LookupRequest};
use orbitkv_components::api::{Command, CommandError, LimitName};
use orbitkv_ipc::frame::{self, FrameError, Kind, MAX_FRAME_BYTES};
use orbitkv_ipc::{Accepted, Hello, Submit, Welcome};
use tracing::warn;

use crate::connection::{ConnId, Quota, Stage};
use crate::state::State;

/// Why a connection is closed: sent to it as an `Error` frame.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the first frame must be Hello, not {0:?}")]
    NotGreeted(Kind),
    #[error("a second Hello on one connection")]
    SecondHello,
    #[error("{0:?} is not a client frame")]
    NotClientFrame(Kind),
}

/// Handles one frame of connection `id`; returns the commands submitted.
pub fn frame(st: &mut State, id: ConnId, kind: Kind, payload: &[u8]) -> Result<usize, Refusal> {
    let Some(conn) = st.conns.get(&id) else {
        return Ok(0);
    };
    match (conn.stage, kind) {
        (Stage::AwaitingHello, Kind::Hello) => hello(st, id, payload).map(|()| 0),
        (Stage::AwaitingHello, other) => Err(Refusal::NotGreeted(other)),
        (Stage::Ready, Kind::Hello) => Err(Refusal::SecondHello),
        (Stage::Ready, Kind::Submit) => submit(st, id, payload),
        (Stage::Ready, Kind::Ping) => {
            // The payload is `null`, like every frame's is checked.
            frame::decode::<()>(kind, payload)?;
            push(st, id, frame::encode(Kind::Pong, &()));
            Ok(0)
        }
        (Stage::Ready, Kind::Inspect) => {
            frame::decode::<()>(kind, payload)?;
            let snapshot = crate::inspect::snapshot(st);
            push(st, id, frame::encode(Kind::Snapshot, &snapshot));
            Ok(0)
        }
        (Stage::Ready, Kind::Lookup) => {
            let request: LookupRequest = frame::decode(Kind::Lookup, payload)?;
            let reply = lookup(st, &request);
            push(st, id, frame::encode(Kind::LookupReply, &reply));
            Ok(0)
        }
        (Stage::Ready, other) => Err(Refusal::NotClientFrame(other)),
    }
}

/// A lookup's answer (a connection's `Lookup` frame, a router's `POST
/// /lookup`). A request the runtime refuses is answered with the reason,
/// not a protocol error: the connection stays open.
pub fn lookup(st: &mut State, request: &LookupRequest) -> LookupReply {
    let reply = LookupReply::from_result(st.rt.locate(request));
    let outcome = if reply.error.is_none() {
        "answered"
    } else {
        "refused"
    };
    st.metrics
        .counters
        .lookups
        .get_or_create(&crate::metrics::Outcome {
            outcome: outcome.into(),
        })
        .inc();
    reply
}

fn push(st: &mut State, id: ConnId, bytes: Vec<u8>) {
    if let Some(c) = st.conns.get_mut(&id) {
        c.outbox.push(bytes);
    }
}

fn hello(st: &mut State, id: ConnId, payload: &[u8]) -> Result<(), Refusal> {
    let hello: Hello = frame::decode(Kind::Hello, payload)?;
    if hello.protocol != frame::PROTOCOL_VERSION {
        return Err(FrameError::Version(hello.protocol).into());
    }
    let pool = st.rt.export_pool();
    let hot = match (&mut st.hot, hello.hot) {
        (Some(h), true) => match h.register(id) {
            Ok(x) => Some(x),
            Err(e) => {
                warn!(conn = id, error = %e, "no hot path for this connection");
                None
            }
        },
        _ => None,
    };
    let welcome = Welcome {
        protocol: frame::PROTOCOL_VERSION,
        incarnation: st.settings.runtime.incarnation,
        pool_bytes: if pool.is_some() {
            st.rt.pool_capacity()
        } else {
            0
        },
        max_frame_bytes: MAX_FRAME_BYTES,
        hot: hot.as_ref().map(|h| h.info.clone()),
        presence: None,
    };
    // The pool's descriptor (read-only), then the hot path's three, then
    // the presence filter's (with the hot path only: its area counts the
    // lookups the client answers).
    let mut fds: Vec<OwnedFd> = pool.into_iter().collect();
    let is_hot = hot.is_some();
    fds.extend(hot.into_iter().flat_map(|h| h.fds));
    let mut welcome = welcome;
    if is_hot && let Some(p) = &st.presence {
        match p.share() {
            Ok((file, bytes)) => {
                fds.push(OwnedFd::from(file));
                welcome.presence = Some(bytes);
            }
            Err(e) => warn!(conn = id, error = %e, "no presence filter for this connection"),
        }
    }
    let Some(conn) = st.conns.get_mut(&id) else {
        return Ok(());
    };
    conn.stage = Stage::Ready;
    conn.hot = is_hot;
    if !hello.client.is_empty() {
        // Bounded: it is only for logs and `inspect`.
        conn.name = hello.client.chars().take(128).collect();
    }
    conn.outbox
        .push_with_fds(frame::encode(Kind::Welcome, &welcome), fds);
    Ok(())
}

fn submit(st: &mut State, id: ConnId, payload: &[u8]) -> Result<usize, Refusal> {
    let Submit { tag, command } = frame::decode(Kind::Submit, payload)?;
    let quota = match &command {
        Command::OpenSession { .. } => Some(Quota::Session),
        Command::RegisterDeviceRegion { session, .. } => Some(Quota::Region {
            session: session.id,
        }),
        _ => None,
    };
    let refused = quota.and_then(|q| over_quota(st, id, q));
    let kind = command.kind();
    let result = match refused {
        Some(e) => Err(e),
        None => st.submit(id, command),
    };
    if let Err(e) = &result {
        st.metrics.refused_at_submit(kind, e);
    }
    let submitted = usize::from(result.is_ok());
    if let (Ok(cid), Some(q)) = (&result, quota)
        && let Some(c) = st.conns.get_mut(&id)
    {
        c.quota_pending.insert(*cid, q);
    }
    push(
        st,
        id,
        frame::encode(Kind::Accepted, &Accepted { tag, result }),
    );
    Ok(submitted)
}

/// The typed refusal of a command past the connection's quota, or past
/// its process's or uid's share of the sessions.
fn over_quota(st: &State, id: ConnId, q: Quota) -> Option<CommandError> {
    let c = st.conns.get(&id)?;
    let over = |name, claimed: usize, limit: usize| {
        (claimed >= limit).then_some(CommandError::Limit {
            name,
            limit: limit as u64,
        })
    };
    match q {
        Quota::Session => {
            let (mut of_uid, mut of_process) = (0, 0);
            for other in st.conns.values().filter(|o| o.uid == c.uid) {
                let n = other.sessions_claimed();
                of_uid += n;
                if other.pid == c.pid {
                    of_process += n;
                }
            }
            let s = &st.settings;
            over(
                LimitName::MaxSessionsPerConnection,
                c.sessions_claimed(),
                s.max_sessions_per_connection,
            )
            .or_else(|| {
                over(
                    LimitName::MaxSessionsPerProcess,
                    of_process,
                    s.max_sessions_per_process,
                )
            })
            .or_else(|| over(LimitName::MaxSessionsPerUid, of_uid, s.max_sessions_per_uid))
        }
        Quota::Region { .. } => over(
            LimitName::MaxRegionsPerConnection,
            c.regions_claimed(),
            st.settings.max_regions_per_connection,
        ),
    }
}
