//! The engine side (`orbitkv_engine::Session`) against a real `orbitkv
//! serve`: exact bytes through save and load, the slot table (one
//! allocation per slot, across loads and saves), batch lookups equal to
//! single ones in one round, typed refusals never confused with
//! unavailability, a session of a restarted manager, a load plan the
//! manager refuses, and the slot table across a session's end (its pages
//! freed with it, fenced afterwards, the next session's allocated afresh).

mod support;
use support::*;

use orbitkv_components::NativeHash;
use orbitkv_components::api::{CommandError, MissReason, PublishPage};
use orbitkv_engine::{
    EngineError, LoadPlan, Loaded, Port, Query, Sending, Session, SessionOptions,
};
use orbitkv_ipc::Client;
use orbitkv_world::driver;

fn hashes(seed: u64, n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(seed + i)).collect()
}

fn payload(i: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(31).wrapping_add(i as u8 * 7 + 1))
        .collect()
}

fn query(hashes: &[NativeHash]) -> Query {
    Query {
        groups: vec![0],
        hashes: hashes.to_vec(),
        origin: 0,
        prompt_len: hashes.len() as u64 * PAGE + 1,
    }
}

fn open(c: &mut Client) -> Session {
    Session::open(c, register_command(), SessionOptions::default()).unwrap()
}

/// Saves `payload(i)` for page `i` of `h` from slots `0..n` of `region`.
fn save_pages(c: &mut Client, s: &mut Session, region: u64, h: &[NativeHash]) {
    let slots: Vec<u32> = (0..h.len() as u32).collect();
    let dps = s.device_pages(c, region, &slots).unwrap();
    for (i, _) in h.iter().enumerate() {
        let b = BYTES as usize;
        c.region_mut(region).unwrap()[i * b..(i + 1) * b].copy_from_slice(&payload(i as u64));
    }
    let pages = h
        .iter()
        .zip(dps)
        .map(|(&hash, device_page)| PublishPage {
            rank: 0,
            group: 0,
            hash,
            device_page,
        })
        .collect();
    let saved = s.save(c, pages).unwrap();
    assert_eq!(
        (saved.inserted, saved.dropped),
        (h.len() as u64, 0),
        "{saved:?}"
    );
}

/// A load into `dps`, page `i` of the prefix into `dps[i]`.
fn plan_for(dps: &[u64]) -> LoadPlan {
    LoadPlan {
        ranks: vec![0],
        targets: dps
            .iter()
            .enumerate()
            .map(|(i, &dp)| driver::target(0, 0, (i as u64 + 1) * PAGE, dp))
            .collect(),
        retained: vec![],
        handoff: None,
    }
}

fn plan(s: &mut Session, c: &mut Client, region: u64, first_slot: u32, n: u64) -> LoadPlan {
    let slots: Vec<u32> = (0..n as u32).map(|i| first_slot + i).collect();
    plan_for(&s.device_pages(c, region, &slots).unwrap())
}

#[test]
fn a_saved_prefix_loads_back_byte_for_byte_through_the_slot_table() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let h = hashes(0x100, 4);

    let before = s.lookup(&mut c, &query(&h)).unwrap();
    assert_eq!(
        (before.selected, before.miss),
        (None, Some(MissReason::NotFound))
    );

    save_pages(&mut c, &mut s, region, &h);
    let found = s.lookup(&mut c, &query(&h)).unwrap();
    assert_eq!(found.selected, Some(4 * PAGE), "{found:?}");
    assert_eq!(found.miss, None);

    // Two loads into slots 8..12: the second allocates nothing new.
    for round in 0..2 {
        c.region_mut(region).unwrap().fill(0);
        let p = plan(&mut s, &mut c, region, 8, 4);
        assert_eq!(
            s.device_page_count(),
            8,
            "round {round}: one page per slot, once"
        );
        match s.load(&mut c, &query(&h), p).unwrap() {
            Loaded::Hit {
                boundary, pages, ..
            } => assert_eq!((boundary, pages), (4 * PAGE, 4)),
            other => panic!("round {round}: {other:?}"),
        }
        let b = BYTES as usize;
        let mem = c.region_mut(region).unwrap();
        for i in 0..4 {
            assert_eq!(
                mem[(8 + i) * b..(9 + i) * b],
                payload(i as u64)[..],
                "page {i}"
            );
        }
    }

    // Nothing is left leased or parked once the verbs return.
    let snap = c.inspect(T).unwrap();
    assert_eq!(snap.leases, 0, "{snap:?}");
    assert_eq!(snap.operations, 0, "{snap:?}");
    s.close(&mut c).unwrap();
    let snap = c.inspect(T).unwrap();
    assert_eq!((snap.sessions, snap.device_pages), (0, 0), "{snap:?}");
}

#[test]
fn a_batch_of_lookups_answers_as_the_single_ones_do() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let stored = hashes(0x200, 4);
    save_pages(&mut c, &mut s, region, &stored);
    // 150 queries (three rounds of `MAX_BATCH`): the whole prefix, a
    // shorter one, one that diverges after two pages, one never stored.
    let mut queries = Vec::new();
    for i in 0..150u64 {
        let q = match i % 4 {
            0 => query(&stored),
            1 => query(&stored[..3]),
            2 => {
                let mut h = stored[..2].to_vec();
                h.extend(hashes(0x9000 + i * 8, 2));
                query(&h)
            }
            _ => query(&hashes(0x7000 + i * 8, 4)),
        };
        queries.push(q);
    }
    let batch = s.lookup_many(&mut c, &queries).unwrap();
    assert_eq!(batch.len(), queries.len());
    for (i, (q, got)) in queries.iter().zip(&batch).enumerate() {
        assert_eq!(*got, s.lookup(&mut c, q).unwrap(), "query {i}");
        let want = match i % 4 {
            0 => Some(4 * PAGE),
            1 => Some(3 * PAGE),
            2 => Some(2 * PAGE),
            _ => None,
        };
        assert_eq!(got.selected, want, "query {i}: {got:?}");
    }
    let snap = c.inspect(T).unwrap();
    assert_eq!(
        (snap.operations, snap.leases),
        (0, 0),
        "a lookup holds nothing: {snap:?}"
    );
}

#[test]
fn refusals_are_typed_and_never_unavailability() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);

    // The same instance name with another identity.
    let mut other = Client::connect(&m.socket, "other").unwrap();
    let conflict = driver::register_command("llama", [7; 32], driver::dense(), 1, PAGE, BYTES);
    match Session::open(&mut other, conflict, SessionOptions::default()) {
        Err(EngineError::Refused {
            command,
            reason,
            error,
        }) => {
            assert_eq!(
                (command, reason.as_str()),
                ("register_instance", "instance_conflict")
            );
            assert!(
                matches!(error, CommandError::InstanceConflict(_)),
                "{error:?}"
            );
        }
        other => panic!("{other:?}"),
    }

    // A region of a rank the instance does not have.
    match s.register_region(&mut c, 5, 0, 8, None) {
        Err(EngineError::Refused { command, .. }) => assert_eq!(command, "register_device_region"),
        other => panic!("{other:?}"),
    }
    // A slot outside the region, and an unknown region: the caller's
    // mistakes, refused before anything is sent.
    let region = s.register_region(&mut c, 0, 0, 8, None).unwrap().region;
    assert!(matches!(
        s.device_pages(&mut c, region, &[8]),
        Err(EngineError::Invalid(_))
    ));
    assert!(matches!(
        s.device_pages(&mut c, region + 99, &[0]),
        Err(EngineError::Invalid(_))
    ));

    // A load plan that names no page for what the manager selects: refused
    // as the load's coverage check refuses it, nothing copied.
    let h = hashes(0x300, 2);
    save_pages(&mut c, &mut s, region, &h);
    match s.load(
        &mut c,
        &query(&h),
        LoadPlan {
            ranks: vec![0],
            ..LoadPlan::default()
        },
    ) {
        Err(EngineError::Refused {
            command, reason, ..
        }) => {
            assert_eq!((command, reason.as_str()), ("load", "load_invalid"))
        }
        other => panic!("{other:?}"),
    }
    let snap = c.inspect(T).unwrap();
    assert_eq!((snap.operations, snap.leases), (0, 0), "{snap:?}");
}

#[test]
fn a_manager_gone_is_unavailable_and_a_new_session_serves_after_its_restart() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let h = hashes(0x400, 3);
    save_pages(&mut c, &mut s, region, &h);
    m.stop();

    let e = s.lookup(&mut c, &query(&h)).unwrap_err();
    assert!(e.is_unavailable(), "{e:?}");
    assert!(Client::connect(dir.path().join("orbitkv.sock"), "engine").is_err());

    // A new manager: the old connection is gone, a new session works and
    // finds nothing of the old incarnation's DRAM.
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let got = s.lookup(&mut c, &query(&h)).unwrap();
    assert_eq!(got.miss, Some(MissReason::NotFound), "{got:?}");
}

/// Polls until every ticket of `want` ended; returns the progress seen.
fn poll_all(c: &mut Client, s: &mut Session, want: usize) -> Vec<orbitkv_engine::Progress> {
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + T;
    let ended = |p: &orbitkv_engine::Progress| !matches!(p, orbitkv_engine::Progress::Ready { .. });
    while seen.iter().filter(|p| ended(p)).count() < want {
        assert!(std::time::Instant::now() < deadline, "{seen:?}");
        seen.extend(s.poll(c, std::time::Duration::from_millis(50)).unwrap());
    }
    seen
}

#[test]
fn started_verbs_end_through_poll_each_with_its_own_outcome() {
    use orbitkv_engine::Progress;
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let h = hashes(0x500, 4);
    save_pages(&mut c, &mut s, region, &h);

    // Three loads (two hits into different slots, one miss) and a save,
    // all in flight at once.
    c.region_mut(region).unwrap().fill(0);
    let p1 = plan(&mut s, &mut c, region, 8, 4);
    let p2 = plan(&mut s, &mut c, region, 16, 2);
    let a = s.start_load(&mut c, &query(&h), p1).unwrap();
    let b = s.start_load(&mut c, &query(&h[..2]), p2).unwrap();
    let missing = hashes(0x5500, 2);
    let p3 = plan(&mut s, &mut c, region, 24, 2);
    let m3 = s.start_load(&mut c, &query(&missing), p3).unwrap();
    let dps = s.device_pages(&mut c, region, &[40]).unwrap();
    let sv = s
        .start_save(
            &mut c,
            vec![PublishPage {
                rank: 0,
                group: 0,
                hash: NativeHash::from_u64(0x5599),
                device_page: dps[0],
            }],
        )
        .unwrap();
    assert_eq!(s.in_flight(), 4);
    let seen = poll_all(&mut c, &mut s, 4);
    assert_eq!(s.in_flight(), 0);
    let ready: Vec<_> = seen
        .iter()
        .filter(|p| matches!(p, Progress::Ready { .. }))
        .map(Progress::ticket)
        .collect();
    assert_eq!(ready.len(), 2, "{seen:?}");
    for p in &seen {
        match p {
            Progress::Ready { .. } => {}
            Progress::Loaded { ticket, outcome } if *ticket == a || *ticket == b => {
                let want = if *ticket == a { 4 } else { 2 };
                assert!(
                    matches!(outcome, Loaded::Hit { pages, .. } if *pages == want),
                    "{outcome:?}"
                );
            }
            Progress::Loaded { ticket, outcome } => {
                assert_eq!(
                    (*ticket, outcome),
                    (m3, &Loaded::Miss(MissReason::NotFound))
                )
            }
            Progress::Saved { ticket, outcome } => {
                assert_eq!((*ticket, outcome.inserted), (sv, 1))
            }
            other => panic!("{other:?}"),
        }
    }
    let b = BYTES as usize;
    let mem = c.region_mut(region).unwrap();
    for i in 0..4 {
        assert_eq!(
            mem[(8 + i) * b..(9 + i) * b],
            payload(i as u64)[..],
            "a, page {i}"
        );
    }
    for i in 0..2 {
        assert_eq!(
            mem[(16 + i) * b..(17 + i) * b],
            payload(i as u64)[..],
            "b, page {i}"
        );
    }
    assert_eq!(s.strays, 0);
}

#[test]
fn a_lease_is_read_from_the_pool_verified_then_released() {
    use orbitkv_engine::Progress;
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let h = hashes(0x600, 3);
    save_pages(&mut c, &mut s, region, &h);

    let t = s.start_lease(&mut c, &query(&h)).unwrap();
    assert!(
        matches!(s.release(&mut c, t), Err(EngineError::Invalid(_))),
        "not ready yet"
    );
    let mut leases = None;
    while leases.is_none() {
        for p in s.poll(&mut c, T).unwrap() {
            match p {
                Progress::Ready {
                    ticket, leases: l, ..
                } => {
                    assert_eq!(ticket, t);
                    leases = Some(l);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let leases = leases.unwrap();
    assert_eq!(leases.len(), 3);
    for l in &leases {
        let i = l.pos.page_end / PAGE - 1;
        assert_eq!(c.page(l).unwrap(), &payload(i)[..], "page {i}");
    }
    s.release(&mut c, t).unwrap();
    let done = poll_all(&mut c, &mut s, 1);
    assert!(
        matches!(&done[..], [Progress::Loaded { ticket, outcome: Loaded::Hit { pages: 3, .. } }] if *ticket == t),
        "{done:?}"
    );
    let snap = c.inspect(T).unwrap();
    assert_eq!((snap.operations, snap.leases), (0, 0), "{snap:?}");
    assert!(
        matches!(s.release(&mut c, t), Err(EngineError::Invalid(_))),
        "ended"
    );
}

#[test]
fn lookups_sent_without_waiting_are_collected_later_and_forgotten_ones_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 64, None).unwrap().region;
    let stored = hashes(0x700, 4);
    save_pages(&mut c, &mut s, region, &stored);

    let qs = [
        query(&stored),
        query(&stored[..2]),
        query(&hashes(0x7700, 3)),
    ];
    let tickets: Vec<u64> = qs
        .iter()
        .map(|q| s.start_lookup(&mut c, q).unwrap())
        .collect();
    // A blocking lookup meanwhile leaves the started ones' answers alone.
    let blocking = s.lookup(&mut c, &query(&stored[..3])).unwrap();
    assert_eq!(blocking.selected, Some(3 * PAGE));
    let forgotten = s.start_lookup(&mut c, &query(&stored)).unwrap();
    s.forget_lookup(forgotten);
    assert!(matches!(
        s.lookup_result(&mut c, forgotten),
        Err(EngineError::Invalid(_))
    ));
    let mut got: Vec<Option<orbitkv_engine::Lookup>> = vec![None; qs.len()];
    let deadline = std::time::Instant::now() + T;
    while got.iter().any(Option::is_none) {
        assert!(std::time::Instant::now() < deadline, "{got:?}");
        for (i, t) in tickets.iter().enumerate() {
            if got[i].is_none() {
                got[i] = s.lookup_result(&mut c, *t).unwrap();
            }
        }
    }
    let selected: Vec<Option<u64>> = got.iter().map(|l| l.as_ref().unwrap().selected).collect();
    assert_eq!(selected, vec![Some(4 * PAGE), Some(2 * PAGE), None]);
    for (q, l) in qs.iter().zip(&got) {
        // The same answer; the blocking one's certain miss is answered
        // here from the presence filter (`local`), a started one's is not.
        let (l, now) = (l.as_ref().unwrap(), s.lookup(&mut c, q).unwrap());
        assert_eq!(
            (&l.selected, &l.miss, &l.candidates, &l.common),
            (&now.selected, &now.miss, &now.candidates, &now.common)
        );
    }
    assert!(
        matches!(
            s.lookup_result(&mut c, tickets[0]),
            Err(EngineError::Invalid(_))
        ),
        "an answered ticket is done"
    );
    // The forgotten lookup's answer is dropped, not left queued.
    let deadline = std::time::Instant::now() + T;
    while s.strays == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "its answer never came"
        );
        let t = s.start_lookup(&mut c, &query(&stored)).unwrap();
        while s.lookup_result(&mut c, t).unwrap().is_none() {}
    }
    assert_eq!(c.queued(), 0, "nothing left in the connection's queue");
}

#[test]
fn the_slot_table_ends_with_its_session_and_the_next_one_allocates_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut a = open(&mut c);
    let ra = a.register_region(&mut c, 0, 0, 16, None).unwrap().region;
    let h = hashes(0x500, 4);
    save_pages(&mut c, &mut a, ra, &h);
    // The table answers again without allocating.
    let old = a.device_pages(&mut c, ra, &[0, 1, 2, 3]).unwrap();
    assert_eq!(a.device_page_count(), 4);
    assert_eq!(c.inspect(T).unwrap().device_pages, 4);
    a.close(&mut c).unwrap();
    let snap = c.inspect(T).unwrap();
    assert_eq!(
        (snap.sessions, snap.device_pages, snap.leases),
        (0, 0, 0),
        "the region's pages went with its session: {snap:?}"
    );

    let mut b = open(&mut c);
    assert_eq!(b.device_page_count(), 0);
    let rb = b.register_region(&mut c, 0, 0, 16, None).unwrap().region;
    assert_ne!(ra, rb, "a region id is never reused");
    // The closed session's region is not this session's: the caller's
    // mistake, refused before anything is sent.
    assert!(matches!(
        b.device_pages(&mut c, ra, &[0]),
        Err(EngineError::Invalid(_))
    ));
    // The closed session's device pages named as load targets: a miss
    // with its reason (generation-fenced), nothing copied, nothing held.
    let stale = plan_for(&old);
    match b.load(&mut c, &query(&h), stale) {
        Ok(Loaded::Miss(MissReason::StaleGeneration)) => {}
        other => panic!("a dead session's pages: {other:?}"),
    }
    let snap = c.inspect(T).unwrap();
    assert_eq!((snap.operations, snap.leases), (0, 0), "{snap:?}");

    // This session's own pages: fresh handles, the saved bytes exactly.
    c.region_mut(rb).unwrap().fill(0);
    let p = plan(&mut b, &mut c, rb, 0, 4);
    assert!(p.targets.iter().all(|t| !old.contains(&t.device_page)));
    match b.load(&mut c, &query(&h), p).unwrap() {
        Loaded::Hit { pages, .. } => assert_eq!(pages, 4),
        other => panic!("{other:?}"),
    }
    let bytes = BYTES as usize;
    let mem = c.region_mut(rb).unwrap();
    for i in 0..4 {
        assert_eq!(
            mem[i * bytes..(i + 1) * bytes],
            payload(i as u64)[..],
            "page {i}"
        );
    }
    b.close(&mut c).unwrap();
    let snap = c.inspect(T).unwrap();
    assert_eq!((snap.sessions, snap.device_pages, snap.leases), (0, 0, 0));
}

/// Picks the events whose flag [`Lying`] flips.
type Lie = fn(&orbitkv_components::api::Event) -> bool;

/// A manager connection whose `terminal` flags are flipped for the events
/// `lie` picks: the session must give the connection up, never guess.
struct Lying<'a> {
    c: &'a mut Client,
    lie: Lie,
}

impl Port for Lying<'_> {
    fn submit(
        &mut self,
        command: orbitkv_components::api::Command,
    ) -> Result<u64, orbitkv_ipc::ClientError> {
        self.c.submit(command)
    }

    fn submit_many(
        &mut self,
        commands: Vec<orbitkv_components::api::Command>,
    ) -> Result<Vec<Result<u64, CommandError>>, orbitkv_ipc::ClientError> {
        self.c.submit_many(commands)
    }

    fn wait_event(
        &mut self,
        timeout: std::time::Duration,
        pred: &dyn Fn(&orbitkv_components::api::Event) -> bool,
    ) -> Result<Option<orbitkv_ipc::Delivered>, orbitkv_ipc::ClientError> {
        let lie = self.lie;
        Ok(self.c.wait_delivered(timeout, pred)?.map(|mut d| {
            if lie(&d.event) {
                d.terminal = !d.terminal;
            }
            d
        }))
    }

    fn send_command(
        &mut self,
        command: orbitkv_components::api::Command,
    ) -> Result<Sending, orbitkv_ipc::ClientError> {
        <Client as Port>::send_command(self.c, command)
    }

    fn accepted_id(&mut self, sent: Sending) -> Result<Option<u64>, orbitkv_ipc::ClientError> {
        <Client as Port>::accepted_id(self.c, sent)
    }
}

#[test]
fn the_session_ends_jobs_by_the_runtimes_terminal_flag_and_gives_up_when_it_disagrees() {
    use orbitkv_components::api::Event;
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let mut s = open(&mut c);
    let region = s.register_region(&mut c, 0, 0, 32, None).unwrap().region;
    let h = hashes(0x700, 4);
    save_pages(&mut c, &mut s, region, &h);
    let p = plan(&mut s, &mut c, region, 8, 4);

    // Told the truth, a load ends with its restore: a hit.
    assert!(matches!(
        s.load(&mut c, &query(&h), p.clone()),
        Ok(Loaded::Hit { pages: 4, .. })
    ));
    let cases: [(&str, Lie); 3] = [
        // A lookup's answer that does not end it.
        ("lookup", |e| matches!(e, Event::QueryResult { .. })),
        // A load's `ready` marked as its end.
        ("load", |e| matches!(e, Event::Ready { .. })),
        // A save's reply that does not end it.
        ("save", |e| matches!(e, Event::PublishDone { .. })),
    ];
    for (verb, lie) in cases {
        let mut port = Lying { c: &mut c, lie };
        let got = match verb {
            "lookup" => s.lookup(&mut port, &query(&h)).map(drop),
            "load" => s.load(&mut port, &query(&h), p.clone()).map(drop),
            _ => {
                let pages = h
                    .iter()
                    .zip(&p.targets)
                    .map(|(&hash, t)| PublishPage {
                        rank: 0,
                        group: 0,
                        hash,
                        device_page: t.device_page,
                    })
                    .collect();
                s.save(&mut port, pages).map(drop)
            }
        };
        match got {
            Err(EngineError::Unavailable(why)) => {
                assert!(why.contains("protocol"), "{verb}: {why}")
            }
            other => panic!("{verb}: a flag that disagrees with the event: {other:?}"),
        }
    }
}
