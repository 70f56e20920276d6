//! A recorded trace replays to the same events.

use std::io::Write;
use std::sync::{Arc, Mutex};

use orbitkv_components::api::{
    Addressed, Command, Event, GroupHashes, Origin, PublishPage, RestoreTarget,
};
use orbitkv_components::{NativeHash, StateKey};
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::tier::MemoryTier;
use orbitkv_scenarios::payload::payload;
use orbitkv_scenarios::replay::Replay;
use orbitkv_world::driver::{dense, register_command};
use orbitkv_world::{Backends, Config, Runtime};

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const PAGE: u64 = 16;
const BYTES: u64 = 4096;

fn reply<T>(
    rt: &mut Runtime,
    cmd: Command,
    pick: impl Fn(&Event) -> Option<T>,
    log: &mut Vec<Event>,
) -> T {
    rt.submit(Origin::EMBEDDED, cmd).unwrap();
    let ev = events(rt.tick());
    log.extend(ev.clone());
    ev.iter().find_map(pick).expect("reply")
}

/// A tick's events, all addressed to the embedded caller.
fn events(addressed: Vec<Addressed>) -> Vec<Event> {
    addressed
        .into_iter()
        .map(|a| {
            assert_eq!(a.to, Origin::EMBEDDED, "{a:?}");
            a.event
        })
        .collect()
}

#[test]
fn recorded_trace_replays_to_the_same_events() {
    let mut config = Config::default();
    config.dram.capacity_bytes = 4 << 20;
    config.dram.extent_bytes = 64 << 10;
    config.dram.first_touch = false;
    // The replay's default latency models, so both sides simulate alike.
    let copy = SimCopyEngine::new(SimCopyConfig {
        latency_us: 20,
        bytes_per_us: 20_000,
        max_in_flight_batches: 64,
    });
    let arena = copy.arena();
    let mut rt = Runtime::with_backends(
        config,
        Backends {
            copy: Box::new(copy),
            tiers: vec![
                Box::new(MemoryTier::new("ssd", 100, 4096)),
                Box::new(MemoryTier::new("remote", 800, 4096)),
            ],
            simulated_clock: true,
        },
    )
    .unwrap();
    let buf = Shared::default();
    rt.record(Box::new(buf.clone()), 10).unwrap();
    let mut log = Vec::new();

    let register = register_command("m", [3; 32], dense(), 1, PAGE, BYTES);
    let ns = reply(
        &mut rt,
        register,
        |e| match e {
            Event::InstanceRegistered { namespaces, .. } => Some(namespaces[0]),
            _ => None,
        },
        &mut log,
    );
    let s = reply(
        &mut rt,
        Command::OpenSession {
            instance: "m".into(),
        },
        |e| match e {
            Event::SessionOpened { session, .. } => Some(*session),
            _ => None,
        },
        &mut log,
    );
    let (region, engine) = reply(
        &mut rt,
        Command::RegisterDeviceRegion {
            session: s,
            rank: 0,
            group: 0,
            slots: 16,
            agent: None,
        },
        |e| match e {
            Event::RegionRegistered {
                region,
                engine_region,
                ..
            } => Some((*region, *engine_region)),
            _ => None,
        },
        &mut log,
    );
    let mut pages = Vec::new();
    for i in 0..3u32 {
        let dp = reply(
            &mut rt,
            Command::DevicePageAlloc {
                session: s,
                region,
                slot: i,
            },
            |e| match e {
                Event::DevicePageAllocated { device_page, .. } => Some(*device_page),
                _ => None,
            },
            &mut log,
        );
        let hash = NativeHash::from_u64(100 + i as u64);
        let key = StateKey {
            namespace: ns,
            group: 0,
            native: hash,
        };
        arena
            .write(engine, i as u64 * BYTES, &payload(&key, BYTES))
            .unwrap();
        pages.push(PublishPage {
            rank: 0,
            group: 0,
            hash,
            device_page: dp,
        });
    }
    rt.submit(
        Origin::EMBEDDED,
        Command::Publish {
            session: s,
            request: 1,
            pages,
        },
    )
    .unwrap();
    for _ in 0..5 {
        rt.submit(Origin::EMBEDDED, Command::AdvanceClock { us: 10 })
            .unwrap();
        log.extend(events(rt.tick()));
    }
    let hashes: Vec<NativeHash> = (0..4).map(|i| NativeHash::from_u64(100 + i)).collect();
    let op = reply(
        &mut rt,
        Command::Query {
            session: s,
            request: 2,
            groups: vec![GroupHashes { group: 0, hashes }],
            origin: 0,
            prompt_len: 4 * PAGE,
            expect_namespaces: vec![],
            prepare: true,
            speculative: false,
        },
        |e| match e {
            Event::QueryResult { operation, .. } => Some(*operation),
            _ => None,
        },
        &mut log,
    );
    let mut targets = Vec::new();
    for i in 0..3u32 {
        let dp = reply(
            &mut rt,
            Command::DevicePageAlloc {
                session: s,
                region,
                slot: 8 + i,
            },
            |e| match e {
                Event::DevicePageAllocated { device_page, .. } => Some(*device_page),
                _ => None,
            },
            &mut log,
        );
        targets.push(RestoreTarget {
            pos: orbitkv_components::api::PagePos {
                rank: 0,
                group: 0,
                page_end: (i as u64 + 1) * PAGE,
            },
            device_page: dp,
        });
    }
    rt.submit(
        Origin::EMBEDDED,
        Command::Restore {
            session: s,
            operation: op,
            targets,
            retained: vec![],
        },
    )
    .unwrap();
    for _ in 0..10 {
        rt.submit(Origin::EMBEDDED, Command::AdvanceClock { us: 10 })
            .unwrap();
        log.extend(events(rt.tick()));
    }
    assert!(
        log.iter()
            .any(|e| matches!(e, Event::RestoreDone { pages: 3, .. })),
        "{log:?}"
    );
    // The client goes away: recorded as a close of each of its sessions.
    rt.close_origin(Origin::EMBEDDED);
    log.extend(events(rt.tick()));
    assert!(
        log.iter()
            .any(|e| matches!(e, Event::SessionClosed { session, .. } if *session == s)),
        "{log:?}"
    );
    rt.stop_recording().unwrap();
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("\"bind\":\"$c"),
        "handles are recorded by name"
    );
    assert!(
        text.contains(r#""cmd":{"command":"close_session","session":"$c"#),
        "{text}"
    );

    let trace = orbitkv_scenarios::trace::parse(&text, 5).unwrap();
    let (report, replayed) = Replay::new(&trace.header)
        .unwrap()
        .run_logged(&trace)
        .unwrap();
    // The departure is recorded as `close_session` commands, so in the
    // replay the close answers one: the same event, with its command.
    for e in &log {
        if let Event::SessionClosed { command, .. } = e {
            assert_eq!(*command, None, "no command closed it");
        }
    }
    let replayed: Vec<Event> = replayed
        .into_iter()
        .map(|e| match e {
            Event::SessionClosed {
                command: Some(_),
                session,
            } => Event::SessionClosed {
                command: None,
                session,
            },
            e => e,
        })
        .collect();
    assert_eq!(replayed, log, "replay diverged");
    assert_eq!(report.invariant_violations, 0);
}
