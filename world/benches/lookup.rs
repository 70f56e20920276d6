//! A lookup's cost in the runtime: answered by a tick (submit, then every
//! stage) against answered between ticks (`Runtime::answer_now`: the
//! ingest stage alone), for the same hit of a 32-page prompt in a runtime
//! that holds 1,024 pages. Not a test: it asserts nothing about time.
//!
//! ```sh
//! cargo bench -p orbitkv-world --bench lookup
//! ```

mod common;

use std::time::{Duration, Instant};

use common::*;
use orbitkv_components::api::{Command, Event, GroupHashes, Origin, PublishPage};
use orbitkv_world::Answer;

const PAGE_TOKENS: u64 = 16;
const PAGE_BYTES: u64 = 4096;
const STORED: u64 = 1024;
const ASKED: u64 = 32;

fn main() {
    let mut d = Driver::sim(config(64 << 20, 4096, 1 << 20), 0);
    d.register(register_cmd("dense", dense(), 1, PAGE_TOKENS, PAGE_BYTES));
    let session = d.open("dense");
    let (region, _, _) = d.region(session, 0, 0, STORED as u32);
    let sources = d.alloc_many(session, region, 0..STORED as u32);
    let pages = (0..STORED)
        .map(|i| PublishPage {
            rank: 0,
            group: 0,
            hash: digest(1, 0, i),
            device_page: sources[i as usize],
        })
        .collect();
    assert_eq!(d.publish(session, 0, pages), STORED);
    d.clear();
    let lookup = Command::Lookup {
        session,
        request: 1,
        groups: vec![GroupHashes {
            group: 0,
            hashes: (0..ASKED).map(|i| digest(1, 0, i)).collect(),
        }],
        origin: 0,
        prompt_len: ASKED * PAGE_TOKENS + 1,
        expect_namespaces: Vec::new(),
    };
    let hit = |events: &[orbitkv_components::api::Addressed]| {
        assert!(
            matches!(
                events,
                [a] if matches!(&a.event, Event::QueryResult { selected: Some(s), .. }
                    if *s == ASKED * PAGE_TOKENS) && a.terminal
            ),
            "{events:?}"
        );
    };
    let rt = std::cell::RefCell::new(d);
    let ticked = |n: u64| {
        let mut d = rt.borrow_mut();
        let rt = d.rt();
        let t0 = Instant::now();
        for _ in 0..n {
            rt.submit(Origin::EMBEDDED, lookup.clone()).expect("room");
            let events = rt.tick();
            hit(&events);
        }
        t0.elapsed()
    };
    let now = |n: u64| {
        let mut d = rt.borrow_mut();
        let rt = d.rt();
        let t0 = Instant::now();
        for _ in 0..n {
            match rt.answer_now(Origin::EMBEDDED, lookup.clone(), Instant::now()) {
                Answer::Now(_, events) => hit(&events),
                Answer::Queue(c) => panic!("a lookup with nothing queued was queued: {c:?}"),
            }
        }
        t0.elapsed()
    };
    let (a, b, _, _) = interleaved(11, Duration::from_millis(300), ticked, now);
    println!(
        "lookup of {ASKED} stored pages ({STORED} held): by a tick {:.0} ns, between ticks {:.0} ns ({:.2}x)",
        a,
        b,
        a / b
    );
}
