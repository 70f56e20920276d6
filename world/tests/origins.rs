//! Addressed events and ownership: every event goes to the origin that owns
//! what it concerns, a command may only name its own origin's sessions,
//! operations, device regions and device pages, no reply is lost however
//! many commands arrive before a tick, and `close_origin` returns
//! everything an origin held.

mod common;

use std::collections::BTreeMap;

use common::*;
use orbitkv_components::api::{
    Addressed, Command, CommandError, CommandId, Event, MissReason, Origin, SessionHandle,
};
use orbitkv_components::{Namespace, NativeHash};

const ID: [u8; 32] = [0x5a; 32];
const A: Origin = Origin(1);
const B: Origin = Origin(2);

/// Submits one command from `origin`, ticks, and returns the reply, which
/// must be addressed to `origin`; other events of the tick are returned too.
fn ask(h: &mut Harness, origin: Origin, command: Command) -> (Event, Vec<Addressed>) {
    let id = h.rt().submit(origin, command).unwrap();
    let events = h.rt().tick();
    let reply = events
        .iter()
        .find(|a| a.event.command() == Some(id))
        .unwrap_or_else(|| panic!("no reply to command {id}: {events:?}"))
        .clone();
    assert_eq!(reply.to, origin, "{reply:?}");
    (reply.event, events)
}

/// Ticks (advancing simulated time) until an event matches `pred`; every
/// event on the way is kept in `seen`.
fn until(
    h: &mut Harness,
    seen: &mut Vec<Addressed>,
    what: &str,
    pred: impl Fn(&Addressed) -> bool,
) -> Addressed {
    for _ in 0..10_000 {
        h.rt()
            .submit(Origin::EMBEDDED, Command::AdvanceClock { us: TICK_US })
            .unwrap();
        let events = h.rt().tick();
        let found = events.iter().find(|a| pred(a)).cloned();
        seen.extend(events);
        if let Some(a) = found {
            return a;
        }
    }
    panic!("no {what} after 10000 ticks; saw {seen:?}");
}

fn open(h: &mut Harness, origin: Origin) -> SessionHandle {
    match ask(
        h,
        origin,
        Command::OpenSession {
            instance: "llama".into(),
        },
    )
    .0
    {
        Event::SessionOpened { session, .. } => session,
        e => panic!("open: {e:?}"),
    }
}

/// A device region of `session`: (region, engine region).
fn region(h: &mut Harness, origin: Origin, session: SessionHandle) -> (u64, u32) {
    let command = Command::RegisterDeviceRegion {
        session,
        rank: 0,
        group: 0,
        slots: 32,
        agent: None,
    };
    match ask(h, origin, command).0 {
        Event::RegionRegistered {
            region,
            engine_region,
            ..
        } => (region, engine_region),
        e => panic!("region: {e:?}"),
    }
}

fn alloc(h: &mut Harness, origin: Origin, session: SessionHandle, region: u64, slot: u32) -> u64 {
    let command = Command::DevicePageAlloc {
        session,
        region,
        slot,
    };
    match ask(h, origin, command).0 {
        Event::DevicePageAllocated { device_page, .. } => device_page,
        e => panic!("alloc: {e:?}"),
    }
}

/// One origin's engine: its session, device region and namespace.
struct Engine {
    origin: Origin,
    s: SessionHandle,
    region: u64,
    engine_region: u32,
    ns: Namespace,
}

impl Engine {
    fn new(h: &mut Harness, origin: Origin, ns: Namespace) -> Self {
        let s = open(h, origin);
        let (region, engine_region) = region(h, origin, s);
        Engine {
            origin,
            s,
            region,
            engine_region,
            ns,
        }
    }

    /// Publishes pages `0..n` of prompt `seed` from device slots `first..`;
    /// returns the source device pages (still allocated).
    fn publish(&self, h: &mut Harness, seed: u64, n: u64, first: u32) -> Vec<u64> {
        let mut pages = Vec::new();
        for i in 0..n {
            let slot = first + i as u32;
            let dp = alloc(h, self.origin, self.s, self.region, slot);
            let native = hash(seed, 0, i);
            h.write_slot(self.engine_region, slot, &payload(&self.ns, 0, &native));
            pages.push((0, native, dp));
        }
        let sources = pages.iter().map(|p| p.2).collect();
        let id = h
            .rt()
            .submit(self.origin, publish_cmd(self.s, seed, 0, pages))
            .unwrap();
        let mut seen = Vec::new();
        let done = until(
            h,
            &mut seen,
            "publish",
            |a| matches!(a.event, Event::PublishDone { command, .. } if command == id),
        );
        assert_eq!(done.to, self.origin);
        assert!(
            matches!(done.event, Event::PublishDone { inserted, .. } if inserted == n),
            "{done:?}"
        );
        sources
    }

    /// Query + prepare of `n` pages of `seed`; returns the operation once
    /// it is `Ready` (its leases held).
    fn ready(&self, h: &mut Harness, seed: u64, n: u64) -> u64 {
        let command = query(self.s, seed, seed, &[0], n, n * PAGE + 1, true);
        let (reply, events) = ask(h, self.origin, command);
        let Event::QueryResult {
            operation,
            miss: None,
            ..
        } = reply
        else {
            panic!("query: {reply:?}");
        };
        let mut seen = events;
        let ready = match seen.iter().find(|a| matches!(a.event, Event::Ready { .. })) {
            Some(a) => a.clone(),
            None => until(h, &mut seen, "ready", |a| {
                matches!(a.event, Event::Ready { .. } | Event::Miss { .. })
            }),
        };
        assert_eq!(ready.to, self.origin, "{ready:?}");
        assert!(matches!(ready.event, Event::Ready { operation: o, .. } if o == operation));
        operation
    }
}

/// Live state that a refused command must leave exactly as it was.
fn snapshot(
    h: &mut Harness,
) -> (
    usize,
    usize,
    usize,
    usize,
    u64,
    u64,
    BTreeMap<&'static str, usize>,
) {
    let s = h.rt().stats();
    (
        s.sessions,
        s.operations,
        s.leases,
        s.device_pages,
        s.bytes_reserved,
        s.pool_bytes_used,
        s.operations_by_state,
    )
}

/// Two origins with a dense instance each can reach: A has published 4
/// pages and holds a `Ready` recovery of them; B has its own session.
fn two_engines() -> (Harness, Engine, Engine) {
    let mut h = Harness::new(config(4 << 20));
    let ns = h.register("llama", ID, dense(), 1)[0];
    let a = Engine::new(&mut h, A, ns);
    let b = Engine::new(&mut h, B, ns);
    (h, a, b)
}

/// Releases `op`, the last operation alive, and checks nothing is left.
fn release_last(h: &mut Harness, e: &Engine, op: u64) {
    let release = Command::Release {
        session: e.s,
        operation: op,
    };
    h.rt().submit(e.origin, release).unwrap();
    assert_eq!(
        h.rt().tick(),
        vec![Addressed {
            to: e.origin,
            event: Event::Released { operation: op },
            terminal: true,
        }]
    );
    h.assert_idle();
}

#[test]
fn every_cross_origin_command_is_refused_without_effect() {
    let (mut h, a, b) = two_engines();
    let sources = a.publish(&mut h, 1, 4, 0);
    let op_a = a.ready(&mut h, 1, 4);
    let op_b = b.ready(&mut h, 1, 4);
    let target_a = alloc(&mut h, A, a.s, a.region, 20);
    let target_b = alloc(&mut h, B, b.s, b.region, 20);
    let before = snapshot(&mut h);
    assert!(
        before.2 > 0 && before.4 > 0,
        "leases and bytes held: {before:?}"
    );

    let restore = |session, operation, device_page| Command::Restore {
        session,
        operation,
        targets: vec![target(0, 0, PAGE, device_page)],
        retained: (2..=4).map(|i| pos(i * PAGE)).collect(),
    };
    let publish = |session, device_page| {
        publish_cmd(
            session,
            9,
            0,
            vec![(0, NativeHash::from_u64(9), device_page)],
        )
    };
    // Each of issue 9's seven actions, naming A's entity both through A's
    // session and through B's own session, plus the remaining commands that
    // name a session, operation or region.
    let attempts: Vec<(&str, Command)> = vec![
        (
            "release via A's session",
            Command::Release {
                session: a.s,
                operation: op_a,
            },
        ),
        (
            "release via B's session",
            Command::Release {
                session: b.s,
                operation: op_a,
            },
        ),
        (
            "cancel via A's session",
            Command::Cancel {
                session: a.s,
                operation: op_a,
            },
        ),
        (
            "cancel via B's session",
            Command::Cancel {
                session: b.s,
                operation: op_a,
            },
        ),
        ("restore A's operation", restore(a.s, op_a, target_a)),
        ("restore into A's page", restore(b.s, op_b, target_a)),
        (
            "restore A's operation into B's page",
            restore(b.s, op_a, target_b),
        ),
        (
            "free via A's session",
            Command::DevicePageFree {
                session: a.s,
                device_page: sources[0],
            },
        ),
        (
            "free via B's session",
            Command::DevicePageFree {
                session: b.s,
                device_page: sources[0],
            },
        ),
        ("publish via A's session", publish(a.s, sources[1])),
        ("publish from A's page", publish(b.s, sources[1])),
        (
            "query on A's session",
            query(a.s, 1, 1, &[0], 4, 4 * PAGE + 1, true),
        ),
        ("close A's session", Command::CloseSession { session: a.s }),
        (
            "prepare A's operation",
            Command::Prepare {
                session: b.s,
                operation: op_a,
            },
        ),
        (
            "alloc in A's region",
            Command::DevicePageAlloc {
                session: b.s,
                region: a.region,
                slot: 30,
            },
        ),
        (
            "alloc via A's session",
            Command::DevicePageAlloc {
                session: a.s,
                region: a.region,
                slot: 30,
            },
        ),
        (
            "region on A's session",
            Command::RegisterDeviceRegion {
                session: a.s,
                rank: 0,
                group: 0,
                slots: 4,
                agent: None,
            },
        ),
    ];
    for (what, command) in attempts {
        let id = h.rt().submit(B, command).unwrap();
        let events = h.rt().tick();
        assert_eq!(
            events,
            vec![Addressed {
                to: B,
                event: Event::Rejected {
                    command: id,
                    error: CommandError::NotOwner
                },
                terminal: true,
            }],
            "{what}"
        );
        assert_eq!(snapshot(&mut h), before, "{what} changed the runtime");
    }

    // A's state is intact: its recovery restores exact bytes into its own
    // page, and its device pages are still its own to free.
    let id = h.rt().submit(A, restore(a.s, op_a, target_a)).unwrap();
    let mut seen = Vec::new();
    let done = until(&mut h, &mut seen, "restore", |x| {
        matches!(x.event, Event::RestoreDone { .. } | Event::Miss { .. })
    });
    assert!(
        !seen.iter().any(|x| x.event.command() == Some(id)),
        "{seen:?}"
    );
    assert_eq!(
        done,
        Addressed {
            to: A,
            event: Event::RestoreDone {
                operation: op_a,
                pages: 1,
                bytes: PAGE_BYTES
            },
            terminal: true,
        }
    );
    assert_eq!(
        h.read_slot(a.engine_region, 20),
        payload(&a.ns, 0, &hash(1, 0, 0))
    );
    for dp in sources {
        let free = Command::DevicePageFree {
            session: a.s,
            device_page: dp,
        };
        let command = h.rt().submit(A, free).unwrap();
        assert_eq!(
            h.rt().tick(),
            vec![Addressed {
                to: A,
                event: Event::DevicePageFreed {
                    command,
                    device_page: dp,
                    deferred: false
                },
                terminal: true,
            }]
        );
    }
    // B's recovery was never touched either.
    release_last(&mut h, &b, op_b);
}

fn pos(page_end: u64) -> orbitkv_components::api::PagePos {
    orbitkv_components::api::PagePos {
        rank: 0,
        group: 0,
        page_end,
    }
}

#[test]
fn ten_thousand_commands_before_one_tick_are_all_answered_to_their_origin() {
    let mut h = Harness::new(config(4 << 20));
    let ns = h.register("llama", ID, dense(), 1)[0];
    let origins: Vec<Origin> = (1..=4).map(Origin).collect();
    let engines: Vec<Engine> = origins
        .iter()
        .map(|&o| Engine::new(&mut h, o, ns))
        .collect();
    // Queries that miss (nothing is stored) are answered in their tick; a
    // tenth of the commands name another origin's session and are refused.
    let mut expected: BTreeMap<CommandId, (Origin, bool)> = BTreeMap::new();
    for i in 0..10_000u64 {
        let e = &engines[(i % 4) as usize];
        let (session, refused) = if i % 10 == 9 {
            (engines[((i + 1) % 4) as usize].s, true)
        } else {
            (e.s, false)
        };
        let command = query(session, i, 1000 + i, &[0], 1, PAGE + 1, false);
        let id = h.rt().submit(e.origin, command).unwrap();
        expected.insert(id, (e.origin, refused));
    }
    assert!(
        h.rt().limits().max_commands_per_tick < 10_000,
        "the inbox must take more than one tick to drain"
    );
    let mut answered: BTreeMap<CommandId, Addressed> = BTreeMap::new();
    for _ in 0..10 {
        for a in h.rt().tick() {
            let id = a.event.command().expect("only replies: every query missed");
            assert!(answered.insert(id, a).is_none(), "two replies to {id}");
        }
    }
    assert_eq!(answered.len(), expected.len());
    for (id, (origin, refused)) in expected {
        let a = &answered[&id];
        assert_eq!(a.to, origin, "{a:?}");
        match &a.event {
            Event::Rejected {
                error: CommandError::NotOwner,
                ..
            } => assert!(refused, "{a:?}"),
            Event::QueryResult {
                miss: Some(MissReason::NotFound),
                ..
            } => assert!(!refused, "{a:?}"),
            other => panic!("unexpected reply {other:?}"),
        }
    }
    h.assert_idle();
}

#[test]
fn close_origin_returns_leases_and_bytes_once_submitted_io_drained() {
    let (mut h, a, b) = two_engines();
    a.publish(&mut h, 1, 4, 0);
    let leased = a.ready(&mut h, 1, 4);
    let op_b = b.ready(&mut h, 1, 4);
    // A second recovery of A's, with its device copy held in flight.
    let restoring = a.ready(&mut h, 1, 4);
    let dp = alloc(&mut h, A, a.s, a.region, 20);
    h.copies.hold(true);
    let restore = Command::Restore {
        session: a.s,
        operation: restoring,
        targets: vec![target(0, 0, PAGE, dp)],
        retained: (2..=4).map(|i| pos(i * PAGE)).collect(),
    };
    h.rt().submit(A, restore).unwrap();
    assert_eq!(h.rt().tick(), vec![]);
    assert_eq!(h.rt().stats().transfers, 1);

    h.rt().close_origin(A);
    let events = h.rt().tick();
    // The recovery without I/O retires at once, and its leases go back; the
    // one with a copy in flight keeps its leases, device page and session.
    assert_eq!(
        events,
        vec![Addressed {
            to: A,
            event: Event::Miss {
                operation: leased,
                reason: MissReason::Cancelled
            },
            terminal: true,
        }]
    );
    let s = h.rt().stats();
    assert_eq!((s.sessions, s.operations, s.transfers), (2, 2, 1), "{s:#?}");
    assert!(s.device_pages > 0);
    // A's session refuses new work meanwhile.
    let late = query(a.s, 7, 1, &[0], 4, 4 * PAGE + 1, true);
    let (reply, _) = ask(&mut h, A, late);
    assert!(
        matches!(
            reply,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{reply:?}"
    );

    // The copy lands: the restore retires cancelled, then the session
    // closes with its region and device pages.
    h.copies.hold(false);
    let mut seen = Vec::new();
    let closed = until(&mut h, &mut seen, "session closed", |x| {
        matches!(x.event, Event::SessionClosed { .. })
    });
    assert_eq!(
        closed,
        Addressed {
            to: A,
            // No command closed it: its origin went away.
            event: Event::SessionClosed {
                command: None,
                session: a.s
            },
            terminal: false,
        }
    );
    assert!(
        seen.contains(&Addressed {
            to: A,
            event: Event::Miss {
                operation: restoring,
                reason: MissReason::Cancelled
            },
            terminal: true,
        }),
        "{seen:?}"
    );
    assert!(seen.iter().all(|x| x.to == A), "{seen:?}");
    // Only B's recovery is left, with its own leases and bytes.
    let s = h.rt().stats();
    assert_eq!(
        (
            s.sessions,
            s.operations,
            s.leases,
            s.device_pages,
            s.transfers
        ),
        (1, 1, 4, 0, 0),
        "{s:#?}"
    );
    assert_eq!(s.bytes_reserved, 4 * PAGE_BYTES);
    h.rt().check_invariants().unwrap();
    release_last(&mut h, &b, op_b);
}

#[test]
fn close_origin_leaves_other_origins_and_later_sessions_alone() {
    let (mut h, a, b) = two_engines();
    // Commands queued before the close apply first: the session this open
    // creates is closed by it too. A session opened after it stays open.
    h.rt()
        .submit(
            A,
            Command::OpenSession {
                instance: "llama".into(),
            },
        )
        .unwrap();
    h.rt().close_origin(A);
    let events = h.rt().tick();
    let opened: Vec<SessionHandle> = events
        .iter()
        .filter_map(|x| match x.event {
            Event::SessionOpened { session, .. } => Some(session),
            _ => None,
        })
        .collect();
    assert_eq!(opened.len(), 1);
    let mut closed: Vec<u64> = events
        .iter()
        .filter_map(|x| match x.event {
            Event::SessionClosed { session, command } => {
                assert_eq!(x.to, A);
                assert_eq!(command, None);
                Some(session.id)
            }
            _ => None,
        })
        .collect();
    closed.sort();
    let mut want = vec![a.s.id, opened[0].id];
    want.sort();
    assert_eq!(closed, want, "{events:?}");
    let again = open(&mut h, A);
    let s = h.rt().stats();
    assert_eq!(s.sessions, 2, "B's and A's new session: {s:#?}");
    // Both still work.
    for (origin, session) in [(A, again), (B, b.s)] {
        let (reply, _) = ask(
            &mut h,
            origin,
            query(session, 1, 1, &[0], 1, PAGE + 1, false),
        );
        assert!(
            matches!(
                reply,
                Event::QueryResult {
                    miss: Some(MissReason::NotFound),
                    ..
                }
            ),
            "{reply:?}"
        );
    }
    h.assert_idle();
}
