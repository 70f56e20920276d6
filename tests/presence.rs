//! The presence filter (`orbitkv_ipc::presence`) against a real `orbitkv
//! serve`: a lookup whose first page no tier holds is answered in the
//! engine process, with no message sent, and counted by the manager; a
//! page saved is never answered absent afterwards (its bit is set before
//! the save's answer leaves); a journal that lost changes rebuilds the
//! filter; a restarted manager finds the pages of its SSD tier in it; and
//! `presence_filter = 0` turns it off.

mod support;
use support::*;

use orbitkv_components::NativeHash;
use orbitkv_components::api::{MissReason, PublishPage};
use orbitkv_engine::{Query, Session, SessionOptions};
use orbitkv_ipc::Client;

fn hashes(seed: u64, n: u64) -> Vec<NativeHash> {
    (0..n).map(|i| NativeHash::from_u64(seed + i)).collect()
}

fn query(hashes: &[NativeHash], origin: u64) -> Query {
    Query {
        groups: vec![0],
        hashes: hashes.to_vec(),
        origin,
        prompt_len: hashes.len() as u64 * PAGE + 1,
    }
}

fn open(c: &mut Client) -> (Session, u64) {
    let mut s = Session::open(c, register_command(), SessionOptions::default()).unwrap();
    let region = s.register_region(c, 0, 0, 64, None).unwrap().region;
    (s, region)
}

/// Saves `h` (at most 64 pages) from slots `0..h.len()` of `region`.
fn save(c: &mut Client, s: &mut Session, region: u64, h: &[NativeHash]) {
    let slots: Vec<u32> = (0..h.len() as u32).collect();
    let dps = s.device_pages(c, region, &slots).unwrap();
    for i in 0..h.len() {
        let b = BYTES as usize;
        c.region_mut(region).unwrap()[i * b..(i + 1) * b].fill(i as u8 + 1);
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
    assert_eq!(saved.inserted + saved.dropped, h.len() as u64, "{saved:?}");
}

fn lookups_sent(c: &Client) -> u64 {
    c.commands_sent().get("lookup").copied().unwrap_or(0)
}

#[test]
fn a_certain_miss_is_answered_here_and_a_saved_page_is_never_absent() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    assert!(c.presence().is_some(), "a hot client maps the filter");
    let (mut s, region) = open(&mut c);
    let stored = hashes(0x100, 4);
    let never = hashes(0x9000, 4);

    let miss = s.lookup(&mut c, &query(&never, 0)).unwrap();
    assert_eq!(miss.miss, Some(MissReason::NotFound));
    assert!(miss.local && miss.selected.is_none(), "{miss:?}");
    assert_eq!(lookups_sent(&c), 0, "no message for a certain miss");

    // Saved, then looked up at once: the bit was set before the save's
    // answer left the manager.
    save(&mut c, &mut s, region, &stored);
    let hit = s.lookup(&mut c, &query(&stored, 0)).unwrap();
    assert_eq!(
        (hit.selected, hit.local),
        (Some(4 * PAGE), false),
        "{hit:?}"
    );
    assert_eq!(lookups_sent(&c), 1);

    // The first page asked for decides: from a stored one the manager is
    // asked; from one never stored (past a stored prefix) it is not.
    let mut diverging = stored[..2].to_vec();
    diverging.extend(hashes(0x9100, 2));
    let partial = s.lookup(&mut c, &query(&diverging, 0)).unwrap();
    assert_eq!((partial.selected, partial.local), (Some(2 * PAGE), false));
    let past = s.lookup(&mut c, &query(&diverging, 2 * PAGE)).unwrap();
    assert!(
        past.local && past.miss == Some(MissReason::NotFound),
        "{past:?}"
    );
    assert_eq!(lookups_sent(&c), 2);

    // A batch: certain misses here, the rest in one round.
    let queries = [
        query(&stored, 0),
        query(&never, 0),
        query(&stored[..3], 0),
        query(&hashes(0x9200, 3), 0),
    ];
    let got = s.lookup_many(&mut c, &queries).unwrap();
    let summary: Vec<(Option<u64>, bool)> = got.iter().map(|l| (l.selected, l.local)).collect();
    assert_eq!(
        summary,
        [
            (Some(4 * PAGE), false),
            (None, true),
            (Some(3 * PAGE), false),
            (None, true)
        ]
    );
    assert_eq!(lookups_sent(&c), 4);
    assert_eq!(s.answered_here, 4);

    // A query the manager must judge (not every group of the instance)
    // is never answered here.
    let mut odd = query(&never, 0);
    odd.groups = vec![0, 7];
    assert!(s.lookup(&mut c, &odd).is_err(), "the manager refuses it");
    assert_eq!(lookups_sent(&c), 5);

    // The manager counts what the engine answered.
    m.wait_metric("presence_misses_total", 4);
    assert_eq!(m.metric("presence_open"), Some(1));
    assert_eq!(
        m.metric("presence_rebuilds_total{reason=\"start\"}"),
        Some(1)
    );
}

/// A long lookup needs only the pages before one the filter proves
/// absent: the bounded lookup selects what the whole one does, with one
/// message for each; a miss the bound does not change stays the same miss.
#[test]
fn a_long_lookup_is_bounded_by_a_page_the_filter_proves_absent() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let (mut s, region) = open(&mut c);
    let stored = hashes(0x200, 5);
    save(&mut c, &mut s, region, &stored);
    let mut long = stored.clone();
    long.extend(hashes(0xA000, 300));
    let probe = |s: &Session, c: &Client, q: &Query| {
        let mut read = Vec::new();
        let n = s
            .pages_worth_asking::<()>(c, &q.groups, q.hashes.len(), q.origin, &mut |i| {
                read.push(i);
                Ok(q.hashes.get(i).copied())
            })
            .unwrap();
        (n, read)
    };
    // From page 0: pages 1, 2 and 4 are held, page 8 is the first probe
    // the filter proves absent.
    let whole = query(&long, 0);
    assert_eq!(probe(&s, &c, &whole), (8, vec![1, 2, 4, 8]));
    let bounded = Query {
        hashes: long[..8].to_vec(),
        ..whole.clone()
    };
    let (a, b) = (
        s.lookup(&mut c, &whole).unwrap(),
        s.lookup(&mut c, &bounded).unwrap(),
    );
    assert_eq!((a.selected, a.miss), (Some(5 * PAGE), None));
    assert_eq!(
        (b.selected, b.miss, &b.common),
        (a.selected, a.miss, &a.common)
    );
    assert_eq!(lookups_sent(&c), 2);
    // From page 2 the probes are 3, 4 and 6.
    assert_eq!(probe(&s, &c, &query(&long, 2 * PAGE)).0, 6);
    // Nothing proven absent: every page.
    assert_eq!(probe(&s, &c, &query(&stored, 0)), (5, vec![1, 2, 4]));
    // Queries the filter may not judge are never bounded, and read nothing.
    let mut odd = whole.clone();
    odd.groups = vec![0, 7];
    assert_eq!(probe(&s, &c, &odd), (long.len(), vec![]));
    assert_eq!(probe(&s, &c, &query(&long, PAGE / 2)), (long.len(), vec![]));
    // A probe's error is the caller's, unchanged.
    let err = s.pages_worth_asking(&c, &[0], 10, 0, &mut |i| Err(i));
    assert_eq!(err, Err(1));
}

#[test]
fn a_journal_that_lost_changes_rebuilds_the_filter() {
    let dir = tempfile::tempdir().unwrap();
    let config = BASE_CONFIG.replace("[serve]\n", "[serve]\npresence_max_pending_changes = 1\n");
    let m = Manager::start(dir.path(), "orbitkv", "16MiB", &config, &[]);
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let (mut s, region) = open(&mut c);
    // Four pages stored in one tick: three changes past the bound.
    let stored = hashes(0x300, 4);
    save(&mut c, &mut s, region, &stored);
    for n in 1..=4 {
        let l = s.lookup(&mut c, &query(&stored[..n], 0)).unwrap();
        assert_eq!(
            (l.selected, l.local),
            (Some(n as u64 * PAGE), false),
            "{l:?}"
        );
    }
    assert!(
        m.metric("presence_rebuilds_total{reason=\"journal_full\"}")
            .unwrap()
            >= 1
    );
    let miss = s.lookup(&mut c, &query(&hashes(0x9300, 2), 0)).unwrap();
    assert!(miss.local, "the rebuilt filter still answers: {miss:?}");
}

#[test]
fn a_restarted_manager_finds_its_ssd_pages_in_the_filter() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let config = format!(
        "{BASE_CONFIG}[ssd]\ndir = {:?}\ncapacity_bytes = 67108864\nsegment_bytes = 4194304\n",
        ssd.display().to_string()
    );
    // 1 MiB of DRAM holds 256 pages: the first of 6 x 64 are evicted to
    // the SSD tier.
    let batches: Vec<Vec<NativeHash>> = (0..6).map(|b| hashes(0x10_000 * (b + 1), 64)).collect();
    {
        let m = Manager::start(dir.path(), "orbitkv", "1MiB", &config, &[]);
        let mut c = Client::connect(&m.socket, "engine").unwrap();
        let (mut s, region) = open(&mut c);
        for b in &batches {
            save(&mut c, &mut s, region, b);
        }
        m.stop();
    }
    let m = Manager::start(dir.path(), "orbitkv", "1MiB", &config, &[]);
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let (mut s, _) = open(&mut c);
    // A client without the filter asks the manager every time.
    let plain = orbitkv_ipc::ClientOptions {
        hot_path: false,
        ..Default::default()
    };
    let mut asks = Client::connect_with(&m.socket, "asks", plain).unwrap();
    assert!(asks.presence().is_none());
    let (mut a, _) = open(&mut asks);
    // What the filter answers here, the manager answers too; and pages of
    // the SSD tier, found by the restart's scan, are asked for and load.
    let mut hits = 0;
    for (i, b) in batches.iter().enumerate() {
        let here = s.lookup(&mut c, &query(&b[..4], 0)).unwrap();
        let there = a.lookup(&mut asks, &query(&b[..4], 0)).unwrap();
        assert!(!there.local);
        assert_eq!(
            (here.selected, here.miss),
            (there.selected, there.miss),
            "batch {i}"
        );
        if there.selected.is_some() {
            assert!(!here.local, "batch {i}");
            hits += 1;
        }
    }
    assert!(hits >= 1, "the SSD tier's pages load after a restart");
    assert!(
        s.lookup(&mut c, &query(&hashes(0x9400, 4), 0))
            .unwrap()
            .local
    );
}

#[test]
fn a_filter_of_zero_bytes_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let config = BASE_CONFIG.replace("[serve]\n", "[serve]\npresence_filter = 0\n");
    let m = Manager::start(dir.path(), "orbitkv", "16MiB", &config, &[]);
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    assert!(c.presence().is_none());
    let (mut s, _) = open(&mut c);
    let l = s.lookup(&mut c, &query(&hashes(0x9500, 2), 0)).unwrap();
    assert_eq!((l.miss, l.local), (Some(MissReason::NotFound), false));
    assert_eq!(lookups_sent(&c), 1);
    assert_eq!(m.metric("presence_open"), Some(0));
}

#[test]
fn a_manager_gone_is_never_answered_for_by_its_filter() {
    let dir = tempfile::tempdir().unwrap();
    let never = hashes(0x9600, 2);
    // A graceful stop closes the filter first.
    let m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let (mut s, _) = open(&mut c);
    assert!(s.lookup(&mut c, &query(&never, 0)).unwrap().local);
    m.stop();
    let e = s.lookup(&mut c, &query(&never, 0)).unwrap_err();
    assert!(e.is_unavailable(), "{e:?}");

    // A manager killed leaves its filter open and frozen: once its beat
    // is `STALE_MS` old, lookups ask the socket and find it gone.
    let mut m = Manager::start_default(dir.path());
    let mut c = Client::connect(&m.socket, "engine").unwrap();
    let (mut s, _) = open(&mut c);
    assert!(s.lookup(&mut c, &query(&never, 0)).unwrap().local);
    // SAFETY: signals our own child.
    unsafe { libc::kill(m.pid() as i32, libc::SIGKILL) };
    let _ = m.child.wait();
    std::thread::sleep(std::time::Duration::from_millis(
        orbitkv_ipc::presence::STALE_MS + 300,
    ));
    let e = s.lookup(&mut c, &query(&never, 0)).unwrap_err();
    assert!(e.is_unavailable(), "{e:?}");
}
