//! `orbitkv serve` as a real subprocess, driven through the Rust client:
//! exact bytes across two connections through shared memory, a client that
//! vanishes mid-restore, malformed frames, and a manager restart.

mod support;
use support::*;

use std::path::Path;

use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, CommandError, Event, GroupHashes, SessionHandle};
use orbitkv_ipc::Client;

fn start(dir: &Path) -> Manager {
    Manager::start_default(dir)
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(31).wrapping_add(i as u8 * 7 + 1))
        .collect()
}

fn hashes(n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(0xabc0 + i)).collect()
}

fn query(s: SessionHandle, pages: u64) -> Command {
    Command::Query {
        session: s,
        request: 1,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hashes(pages),
        }],
        origin: 0,
        prompt_len: pages * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    }
}

#[test]
fn serve_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path());
    // The socket is private to its user.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&m.socket).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Client A publishes 4 pages from its device region.
    let mut a = Client::connect(&m.socket, "engine-a").unwrap();
    publish_four(&mut a, &hashes(4), payload);

    // Client B, another connection, restores them.
    let mut b = Client::connect(&m.socket, "engine-b").unwrap();
    register(&mut b);
    let (sb, rb) = open(&mut b);
    let qr = b.call(query(sb, 5), T).unwrap();
    let Event::QueryResult {
        operation,
        selected: Some(sel),
        ..
    } = qr
    else {
        panic!("{qr:?}")
    };
    assert_eq!(sel, 4 * PAGE);
    let ready = b
        .wait_event(
            T,
            |e| matches!(e, Event::Ready { operation: o, .. } if *o == operation),
        )
        .unwrap()
        .unwrap();
    let Event::Ready { leases, .. } = ready else {
        unreachable!()
    };
    // Zero copy: the leased pages are readable straight from the shared pool.
    for l in &leases {
        assert_eq!(b.page(l).unwrap(), &payload(l.pos.page_end / PAGE - 1)[..]);
    }
    restore_four(&mut b, sb, rb, operation, 10, payload);
    m.wait_metric("leases", 0);

    // A client that vanishes holding leases: its session closes, its leases
    // and reserved bytes return.
    {
        let mut c = Client::connect(&m.socket, "doomed").unwrap();
        let (sc, _) = open(&mut c);
        let _ = c.call(query(sc, 5), T).unwrap();
        c.wait_event(T, |e| matches!(e, Event::Ready { .. }))
            .unwrap()
            .unwrap();
        m.wait_metric("leases", 4);
        m.wait_metric("bytes_reserved", 4 * BYTES);
    } // dropped: the connection closes
    m.wait_metric("leases", 0);
    m.wait_metric("bytes_reserved", 0);

    // Malformed input closes only the offending connection.
    let mut bad = Client::connect(&m.socket, "fuzzer").unwrap();
    bad.send_raw(b"GARBAGE-NOT-A-FRAME!").unwrap();
    let err = bad.wait_event(T, |_| true).unwrap_err();
    assert!(err.to_string().contains("magic"), "{err}");
    let mut big = Client::connect(&m.socket, "big").unwrap();
    let mut frame = orbitkv_ipc::frame::header(orbitkv_ipc::Kind::Submit, 8);
    frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    big.send_raw(&frame).unwrap();
    assert!(
        big.wait_event(T, |_| true)
            .unwrap_err()
            .to_string()
            .contains("exceeds")
    );
    let mut junk = Client::connect(&m.socket, "junk").unwrap();
    junk.send_raw(&orbitkv_ipc::frame::encode(
        orbitkv_ipc::Kind::Submit,
        &serde_json::json!({"tag": 1, "command": {"command": "teleport"}}),
    ))
    .unwrap();
    assert!(
        junk.wait_event(T, |_| true)
            .unwrap_err()
            .to_string()
            .contains("Submit")
    );
    // A well-formed command with a bad handle is a typed refusal, not a close.
    let r = b
        .call(
            query(
                SessionHandle {
                    id: 1,
                    epoch: 1,
                    incarnation: 1,
                },
                2,
            ),
            T,
        )
        .unwrap();
    assert!(
        matches!(
            r,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(a.ping().unwrap() < T);
    assert!(b.ping().unwrap() < T);

    // Restart: old handles are stale; reconnecting works.
    let old_incarnation = b.incarnation();
    drop((a, b, bad, big, junk));
    m.stop();
    let m = start(dir.path());
    let mut b = Client::connect(&m.socket, "engine-b").unwrap();
    assert_ne!(b.incarnation(), old_incarnation);
    let r = b.call(query(sb, 2), T).unwrap();
    assert!(
        matches!(
            r,
            Event::Rejected {
                error: CommandError::StaleSession,
                ..
            }
        ),
        "{r:?}"
    );
    register(&mut b);
    let (sb2, _) = open(&mut b);
    let r = b.call(query(sb2, 5), T).unwrap();
    // DRAM did not survive the restart (no SSD tier configured).
    assert!(
        matches!(r, Event::QueryResult { miss: Some(_), .. }),
        "{r:?}"
    );
    m.stop();
}
