//! The iceoryx2 hot path of `orbitkv serve`, against a real manager
//! subprocess: exact bytes across two hot clients (publish, query, prepare,
//! restore, release, cancel), malformed messages and descriptors answered
//! with typed errors while the manager keeps serving, the socket-only
//! option, wake-ups of a blocked manager and client through their eventfds,
//! and the incarnation's iceoryx2 files: gone after shutdown, a new service
//! name after a restart, a crashed manager's files removed by the next one.

mod support;
use support::*;

use std::path::{Path, PathBuf};
use std::time::Duration;

use orbitkv_components::NativeHash;
use orbitkv_components::api::{
    Command, CommandError, Event, GroupHashes, MissReason, SessionHandle,
};
use orbitkv_ipc::hot::{self, Desc, HotErrorCode, HotRequest, Op, part};
use orbitkv_ipc::{Client, ClientError, ClientOptions};

fn start(dir: &Path) -> Manager {
    Manager::start_default(dir)
}

fn connect(m: &Manager, name: &str) -> Client {
    let c = Client::connect_with(
        &m.socket,
        name,
        ClientOptions {
            hot_path: true,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    assert_eq!(c.hot_path_error(), None);
    // The hot path is on, on a service of this connection's own.
    let service = c.hot_service().expect("the hot path is on");
    let base = hot::service_name(c.incarnation());
    assert!(
        service.len() > base.len() + 1 && service.starts_with(&format!("{base}/")),
        "{service} is not a connection's service of {base}"
    );
    c
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(29).wrapping_add(i as u8 * 11 + 3))
        .collect()
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0x5eed0 + i)).collect()
}

fn query(s: SessionHandle, pages: u64, prepare: bool) -> Command {
    Command::Query {
        session: s,
        request: 7,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes(pages),
        }],
        origin: 0,
        prompt_len: pages * PAGE,
        expect_namespaces: vec![],
        prepare,
        speculative: false,
    }
}

/// Query (prepare) → Ready; returns the operation, checking the leased
/// bytes in the shared pool.
fn query_ready(b: &mut Client, s: SessionHandle) -> u64 {
    let (qr, ready) = with_driver(b, T, |d| {
        let qr = d.query(query(s, 5, true))?;
        let ready = d.ready(qr.operation)?;
        Ok::<_, orbitkv_world::driver::DriverError<_>>((qr, ready))
    })
    .unwrap();
    assert_eq!(qr.selected, Some(4 * PAGE), "{qr:?}");
    assert_eq!(qr.candidates.len(), 1);
    assert_eq!(qr.candidates[0].page_ends, vec![16, 32, 48, 64]);
    assert!(qr.common.contains(&64), "{:?}", qr.common);
    let operation = qr.operation;
    let Event::Ready { leases, .. } = ready else {
        panic!("{ready:?}")
    };
    assert_eq!(leases.len(), 4);
    for l in &leases {
        assert_eq!(b.page(l).unwrap(), &payload(l.pos.page_end / PAGE - 1)[..]);
    }
    operation
}

#[test]
fn hot_round_trip_moves_exact_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut a = connect(&m, "engine-a");
    publish_four(&mut a, &hashes(4), payload);

    let mut b = connect(&m, "engine-b");
    register(&mut b);
    let (sb, rb) = open(&mut b);

    // publish → query → prepare(d) → restore, all hot.
    let operation = query_ready(&mut b, sb);
    let done = restore_four(&mut b, sb, rb, operation, 10, payload);
    assert_eq!(
        done,
        Event::RestoreDone {
            operation,
            pages: 4,
            bytes: 4 * BYTES
        }
    );

    // A separate prepare, then release.
    let qr = b.call(query(sb, 5, false), T).unwrap();
    let Event::QueryResult { operation, .. } = qr else {
        panic!("{qr:?}")
    };
    b.submit(Command::Prepare {
        session: sb,
        operation,
    })
    .unwrap();
    let ready = b
        .wait_event(T, |e| matches!(e, Event::Ready { .. } | Event::Miss { .. }))
        .unwrap()
        .unwrap();
    assert!(matches!(ready, Event::Ready { operation: o, .. } if o == operation));
    b.submit(Command::Release {
        session: sb,
        operation,
    })
    .unwrap();
    let released = b
        .wait_event(T, |e| matches!(e, Event::Released { .. }))
        .unwrap()
        .unwrap();
    assert_eq!(released, Event::Released { operation });

    // Cancel ends an operation with a `cancelled` miss.
    let qr = b.call(query(sb, 5, false), T).unwrap();
    let Event::QueryResult { operation, .. } = qr else {
        panic!("{qr:?}")
    };
    b.submit(Command::Cancel {
        session: sb,
        operation,
    })
    .unwrap();
    let miss = b
        .wait_event(T, |e| matches!(e, Event::Miss { .. }))
        .unwrap()
        .unwrap();
    assert_eq!(
        miss,
        Event::Miss {
            operation,
            reason: MissReason::Cancelled
        }
    );

    // A refused command (wrong state) is a `rejected` event, as on the
    // socket.
    let stale = SessionHandle {
        id: 1,
        epoch: 1,
        incarnation: 1,
    };
    let r = b.call(query(stale, 2, true), T).unwrap();
    assert!(matches!(r, Event::Rejected { .. }), "{r:?}");

    // Many round trips reuse the descriptor area (its rings wrap).
    for _ in 0..300 {
        let qr = b.call(query(sb, 5, false), T).unwrap();
        let Event::QueryResult { operation, .. } = qr else {
            panic!("{qr:?}")
        };
        b.submit(Command::Release {
            session: sb,
            operation,
        })
        .unwrap();
        b.wait_event(
            T,
            |e| matches!(e, Event::Released { operation: o } if *o == operation),
        )
        .unwrap()
        .unwrap();
    }

    // A lookup is one request and one answer, terminal: the hot request
    // closes with it and no operation is left to release. With nothing
    // queued ahead of it, each is answered between ticks.
    let between = m.metric("answered_between_ticks_total").unwrap();
    assert_eq!(between, 0, "only lookups are answered between ticks");
    for _ in 0..300 {
        let Command::Query {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
            ..
        } = query(sb, 5, false)
        else {
            unreachable!()
        };
        let lookup = Command::Lookup {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
        };
        let qr = b.call(lookup, T).unwrap();
        assert!(
            matches!(
                qr,
                Event::QueryResult {
                    selected: Some(64),
                    miss: None,
                    ..
                }
            ),
            "{qr:?}"
        );
    }
    // A lookup the runtime refuses (a session of another incarnation) is
    // answered between ticks too, with its typed refusal.
    let refused = b
        .call(
            Command::Lookup {
                session: stale,
                request: 9,
                groups: Vec::new(),
                origin: 0,
                prompt_len: 1,
                expect_namespaces: Vec::new(),
            },
            T,
        )
        .unwrap();
    assert!(
        matches!(
            refused,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{refused:?}"
    );
    assert_eq!(b.poll_events().unwrap(), vec![]);
    m.wait_metric_until("operations", |v| v == 0);
    m.wait_metric_until("answered_between_ticks_total", |v| v == 301);

    // Everything went on the hot path; nothing is left open.
    assert!(m.wait_metric_until("hot_requests_total", |v| v >= 900) >= 900);
    assert_eq!(m.metric("hot_fallbacks_total"), Some(0));
    assert_eq!(m.metric("hot_errors_total"), Some(0));
    m.wait_metric_until("hot_open_requests", |v| v == 0);
    m.wait_metric_until("leases", |v| v == 0);
    assert!(a.ping().unwrap() < T);
    drop((a, b));
    m.stop();
}

#[test]
fn malformed_hot_requests_get_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut a = connect(&m, "engine-a");
    publish_four(&mut a, &hashes(4), payload);
    let mut c = connect(&m, "fuzzer");
    register(&mut c);
    let (s, _) = open(&mut c);
    let token = c.hot_token().unwrap();
    let base = HotRequest {
        magic: hot::HOT_MAGIC,
        op: Op::Restore as u32,
        token,
        session: [s.id, s.epoch, s.incarnation],
        a: 1,
        ..HotRequest::default()
    };
    let code = |r: Result<u64, ClientError>| match r {
        Err(ClientError::Hot(e)) => e.code,
        other => panic!("{other:?}"),
    };
    // Each case names a fresh, live record, changed in one way.
    let bad = |c: &mut Client, change: &dyn Fn(Desc) -> Desc| {
        let good = c.hot_write_part(part::TARGETS, &[0u8; 24]).unwrap();
        let mut r = base;
        r.parts[0] = change(good);
        code(c.hot_submit_raw(r))
    };
    // Out of bounds, misaligned, overlong.
    assert_eq!(
        bad(&mut c, &|d| Desc {
            offset: 1 << 30,
            ..d
        }),
        HotErrorCode::DescriptorBounds
    );
    assert_eq!(
        bad(&mut c, &|d| Desc {
            offset: d.offset + 4,
            ..d
        }),
        HotErrorCode::DescriptorBounds
    );
    assert_eq!(
        bad(&mut c, &|d| Desc { len: u32::MAX, ..d }),
        HotErrorCode::DescriptorBounds
    );
    // Stale: the wrong generation.
    assert_eq!(
        bad(&mut c, &|d| Desc {
            generation: d.generation + 1,
            ..d
        }),
        HotErrorCode::DescriptorGeneration
    );
    // A length or kind that does not match the record.
    assert_eq!(
        bad(&mut c, &|d| Desc { len: 48, ..d }),
        HotErrorCode::DescriptorMismatch
    );
    assert_eq!(
        bad(&mut c, &|d| Desc {
            kind: part::LEASES,
            ..d
        }),
        HotErrorCode::DescriptorMismatch
    );
    let with = |d: Desc| {
        let mut r = base;
        r.parts[0] = d;
        r
    };
    // Bytes that do not parse.
    let short = c.hot_write_part(part::TARGETS, &[0u8; 23]).unwrap();
    assert_eq!(code(c.hot_submit_raw(with(short))), HotErrorCode::BadPart);
    // Bad header fields.
    assert_eq!(
        code(c.hot_submit_raw(HotRequest { magic: 1, ..base })),
        HotErrorCode::BadMagic
    );
    assert_eq!(
        code(c.hot_submit_raw(HotRequest { op: 99, ..base })),
        HotErrorCode::UnknownOp
    );
    assert_eq!(
        code(c.hot_submit_raw(HotRequest {
            token: token ^ 1,
            ..base
        })),
        HotErrorCode::UnknownToken
    );
    // Another live connection's token, through this connection's own
    // service: a request speaks only for the connection it came from.
    assert_eq!(
        code(c.hot_submit_raw(HotRequest {
            token: a.hot_token().unwrap(),
            ..base
        })),
        HotErrorCode::UnknownToken
    );
    m.wait_metric_until("hot_errors_total", |v| v == 11);

    // The manager keeps serving, this client and others.
    let op = query_ready(&mut c, s);
    c.submit(Command::Release {
        session: s,
        operation: op,
    })
    .unwrap();
    c.wait_event(T, |e| matches!(e, Event::Released { .. }))
        .unwrap()
        .unwrap();
    assert!(a.ping().unwrap() < T);
    drop((a, c));
    m.stop();
}

#[test]
fn socket_only_clients_still_work() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut a = connect(&m, "engine-a");
    publish_four(&mut a, &hashes(4), payload);
    let mut b = Client::connect_with(
        &m.socket,
        "socket-only",
        ClientOptions {
            hot_path: false,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    assert_eq!(b.hot_service(), None);
    register(&mut b);
    let (s, _) = open(&mut b);
    std::thread::sleep(Duration::from_millis(250));
    let before = m.wait_metric_until("hot_requests_total", |_| true);
    let op = query_ready(&mut b, s);
    b.submit(Command::Release {
        session: s,
        operation: op,
    })
    .unwrap();
    b.wait_event(T, |e| matches!(e, Event::Released { .. }))
        .unwrap()
        .unwrap();
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(m.metric("hot_requests_total"), Some(before));
    drop((a, b));
    m.stop();
}

#[test]
fn incarnations_clean_up_their_iceoryx2_files() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut c = connect(&m, "engine");
    register(&mut c);
    let (s, _) = open(&mut c);
    let r = c.call(query(s, 2, true), T).unwrap();
    assert!(matches!(r, Event::QueryResult { .. }), "{r:?}");
    let first = c.incarnation();
    let first_service = c.hot_service().unwrap().to_owned();
    let prefix = hot::file_prefix(first);
    assert!(
        !hot::files_with_prefix(&prefix).is_empty(),
        "the incarnation's files exist while it runs"
    );
    drop(c);
    m.stop();
    assert_eq!(
        hot::files_with_prefix(&prefix),
        Vec::<PathBuf>::new(),
        "no /dev/shm or {} entries of the incarnation remain",
        hot::iox_root().display()
    );

    // A restarted manager has a new service name.
    let m = start(dir.path());
    let c = connect(&m, "engine");
    assert_ne!(c.incarnation(), first);
    assert_ne!(c.hot_service().unwrap(), first_service);

    // A manager that crashes leaves files; the next one removes them.
    let crashed = hot::file_prefix(c.incarnation());
    drop(c);
    let mut m = m;
    m.child.kill().unwrap();
    m.child.wait().unwrap();
    assert!(!hot::files_with_prefix(&crashed).is_empty());
    let _ = std::fs::remove_file(&m.socket);
    drop(m);
    let m = start(dir.path());
    assert_eq!(
        hot::files_with_prefix(&crashed),
        Vec::<PathBuf>::new(),
        "the crashed incarnation's files were cleaned up"
    );
    let last = hot::file_prefix(connect(&m, "engine").incarnation());
    m.stop();
    assert_eq!(hot::files_with_prefix(&last), Vec::<PathBuf>::new());
}

/// Both sides block between requests here: the manager never spins
/// (`spin_after_work_us = 0`) and the client does not spin either. Each
/// request must then signal the manager's wake eventfd, and each response
/// the client's: without those a request waits out the manager's idle
/// sleep (up to 100 ms) and a response the client's 10 ms re-look.
#[test]
fn blocked_sides_are_woken_through_their_eventfds() {
    let dir = tempfile::tempdir().unwrap();
    let config = BASE_CONFIG.replacen("[serve]\n", "[serve]\nspin_after_work_us = 0\n", 1);
    let m = Manager::start(dir.path(), "orbitkv", "16MiB", &config, &[]);
    let mut c = connect(&m, "engine");
    c.set_spin_fixed(Duration::ZERO);
    register(&mut c);
    let (s, _) = open(&mut c);
    let requests = m.wait_metric_until("hot_requests_total", |_| true);
    let wakes = m.wait_metric_until("hot_wakes_total", |_| true);
    let mut slow = 0;
    for _ in 0..40 {
        // Nothing is stored: each query misses and ends at once.
        let t = std::time::Instant::now();
        let r = c.call(query(s, 2, false), T).unwrap();
        assert!(matches!(r, Event::QueryResult { .. }), "{r:?}");
        // A wide margin over a wake-up (microseconds), and under the
        // 100 ms the manager sleeps when nobody signals it.
        slow += usize::from(t.elapsed() > Duration::from_millis(60));
    }
    assert!(slow <= 2, "{slow} of 40 hot queries waited out a sleep");
    m.wait_metric_until("hot_requests_total", |n| n >= requests + 40);
    // The client blocked (no spin) and the manager signalled it.
    m.wait_metric_until("hot_wakes_total", |n| n > wakes);
    drop(c);
    m.stop();
}

/// The manager asks a connection's service for requests only while the
/// client's count in the area is ahead of what it took, and every
/// service once in a while regardless: a client whose count is short
/// (or that never counts) is still answered, only later.
#[test]
fn requests_the_client_did_not_count_are_still_taken() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut c = connect(&m, "engine");
    register(&mut c);
    let (s, _) = open(&mut c);
    let requests = m.wait_metric_until("hot_requests_total", |_| true);
    // Each query's count stops one short: the manager's count equals it,
    // so only its periodic full look finds the query.
    c.hot_undercount_requests(1);
    for _ in 0..20 {
        let r = c.call(query(s, 2, false), T).unwrap();
        assert!(matches!(r, Event::QueryResult { .. }), "{r:?}");
    }
    // Counting again: every request counted, none lost on the way.
    c.hot_undercount_requests(0);
    for _ in 0..5 {
        let r = c.call(query(s, 2, false), T).unwrap();
        assert!(matches!(r, Event::QueryResult { .. }), "{r:?}");
    }
    m.wait_metric_until("hot_requests_total", |n| n >= requests + 25);
    drop(c);
    m.stop();
}

/// The manager holds at most `MAX_ACTIVE_REQUESTS` open requests of a
/// connection, whatever the client does: a client that does not cap
/// itself gets the next one refused with a typed error in its mailbox
/// (the client's own cap sends it on the socket instead), keeps being
/// served, and the refused request holds nothing.
#[test]
fn the_manager_bounds_a_connections_open_requests() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut a = connect(&m, "publisher");
    publish_four(&mut a, &hashes(4), payload);
    let mut c = connect(&m, "engine");
    register(&mut c);
    let (s, _) = open(&mut c);
    c.hot_set_request_cap(hot::MAX_ACTIVE_REQUESTS + 1);
    // Queries without prepare that hit park their operation: each keeps
    // its request open until released.
    let mut operations = Vec::new();
    for _ in 0..hot::MAX_ACTIVE_REQUESTS {
        let r = c.call(query(s, 5, false), T).unwrap();
        let Event::QueryResult {
            operation,
            selected: Some(_),
            ..
        } = r
        else {
            panic!("{r:?}")
        };
        operations.push(operation);
    }
    m.wait_metric_until("hot_open_requests", |n| {
        n == hot::MAX_ACTIVE_REQUESTS as u64
    });
    let refused = c.submit(query(s, 5, false));
    assert!(
        matches!(&refused, Err(ClientError::Hot(e)) if e.code == HotErrorCode::TooManyRequests
            && e.detail == hot::MAX_ACTIVE_REQUESTS as u64),
        "{refused:?}"
    );
    // Nothing was opened for it.
    assert_eq!(
        m.wait_metric_until("hot_open_requests", |_| true),
        hot::MAX_ACTIVE_REQUESTS as u64
    );
    // Within its bound again, the client sends the releases on the socket
    // while its 32 requests are open; each ends its query's request.
    c.hot_set_request_cap(hot::MAX_ACTIVE_REQUESTS);
    for operation in operations {
        c.submit(Command::Release {
            session: s,
            operation,
        })
        .unwrap();
        let r = c
            .wait_event(
                T,
                |e| matches!(e, Event::Released { operation: o } if *o == operation),
            )
            .unwrap();
        assert!(r.is_some(), "no release of {operation}");
    }
    m.wait_metric_until("hot_open_requests", |n| n == 0);
    let r = c.call(query(s, 5, false), T).unwrap();
    assert!(
        matches!(
            r,
            Event::QueryResult {
                selected: Some(_),
                ..
            }
        ),
        "{r:?}"
    );
    drop(c);
    m.stop();
}

/// `Client::warm` wakes a sleeping manager without a request (a scheduler
/// about to plan its next step), counted as `hot_warmed`; without it
/// nothing wakes the manager and the counter stays.
#[test]
fn warm_wakes_a_sleeping_manager_without_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    let mut c = connect(&m, "engine");
    register(&mut c);
    let _ = open(&mut c);
    // Past its spin after the last command, the manager sleeps.
    std::thread::sleep(Duration::from_millis(300));
    let before = m.wait_metric_until("hot_warmed_total", |_| true);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        m.metric("hot_warmed_total"),
        Some(before),
        "nothing warmed it"
    );
    // A warm that finds the manager awake (its idle tick's round) does
    // nothing, by design: warm again until one finds it asleep.
    let deadline = std::time::Instant::now() + T;
    loop {
        c.warm();
        std::thread::sleep(Duration::from_millis(150));
        if m.metric("hot_warmed_total").is_some_and(|n| n > before) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no warm woke the manager"
        );
    }
    drop(c);
    m.stop();
}
