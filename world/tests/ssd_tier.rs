//! The SSD tier under the runtime: pages DRAM evicts are demoted to SSD, come
//! back through the read stage with exact bytes, survive a manager restart,
//! and a record corrupted on disk is a `checksum` miss, never a hit. Every
//! test runs on both I/O backends (io_uring and the pread/pwrite pool).

use std::path::Path;
use std::time::Duration;

use orbitkv_components::api::{
    Command, Event, MissReason, Origin, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_components::{Namespace, NativeHash, StateKey};
use orbitkv_gpu::host::DeviceArena;
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::ssd::{IoBackend, SsdConfig, SsdStore};
use orbitkv_world::{Backends, Runtime};

mod common;
use common::{PAGE, PAGE_BYTES, dense, payload, register_cmd};

const SLOTS: u64 = 8;

struct Node {
    rt: Runtime,
    arena: DeviceArena,
    s: SessionHandle,
    ns: Namespace,
    region: u64,
    engine: u32,
}

fn ssd_config(dir: &Path, backend: IoBackend) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        capacity_bytes: 64 << 20,
        segment_bytes: 4 << 20,
        backend,
        ..SsdConfig::default()
    }
}

/// A runtime whose DRAM holds 8 pages, over an SSD store in `dir`.
fn node(dir: &Path, backend: IoBackend) -> Node {
    let mut c = common::config(SLOTS * PAGE_BYTES);
    c.dram.extent_bytes = 4 * PAGE_BYTES;
    c.budget.query_budget_bytes = Some(SLOTS * PAGE_BYTES);
    let copy = SimCopyEngine::new(SimCopyConfig {
        latency_us: 5,
        bytes_per_us: 0,
        max_in_flight_batches: 64,
    });
    let arena = copy.arena();
    let store = SsdStore::open(ssd_config(dir, backend)).unwrap();
    let rt = Runtime::with_backends(
        c,
        Backends {
            copy: Box::new(copy),
            tiers: vec![Box::new(store)],
            simulated_clock: true,
        },
    )
    .unwrap();
    let mut n = Node {
        rt,
        arena,
        s: SessionHandle {
            id: 0,
            epoch: 0,
            incarnation: 0,
        },
        ns: Namespace::EMPTY,
        region: 0,
        engine: 0,
    };
    n.ns = match n.one(register_cmd("llama", [4; 32], dense(), 1, &[0])) {
        Event::InstanceRegistered { namespaces, .. } => namespaces[0],
        e => panic!("{e:?}"),
    };
    n.s = match n.one(Command::OpenSession {
        instance: "llama".into(),
    }) {
        Event::SessionOpened { session, .. } => session,
        e => panic!("{e:?}"),
    };
    (n.region, n.engine) = match n.one(Command::RegisterDeviceRegion {
        session: n.s,
        rank: 0,
        group: 0,
        slots: 64,
        agent: None,
    }) {
        Event::RegionRegistered {
            region,
            engine_region,
            ..
        } => (region, engine_region),
        e => panic!("{e:?}"),
    };

    n
}

impl Node {
    fn one(&mut self, c: Command) -> Event {
        self.rt.submit(Origin::EMBEDDED, c).unwrap();
        let ev = common::embedded(self.rt.tick());
        assert_eq!(ev.len(), 1, "{ev:?}");
        ev.into_iter().next().unwrap()
    }

    /// Ticks (advancing 10 µs each) until `pred`; real SSD I/O completes in
    /// real time, so this also sleeps a little between ticks. Bounded.
    fn until(&mut self, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        for _ in 0..20_000 {
            self.rt
                .submit(Origin::EMBEDDED, Command::AdvanceClock { us: 10 })
                .unwrap();
            if let Some(e) = common::embedded(self.rt.tick())
                .into_iter()
                .find(|e| pred(e))
            {
                return e;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        panic!("no {what}: {:#?}", self.rt.stats());
    }

    fn key(&self, seed: u64, i: u64) -> StateKey {
        StateKey {
            namespace: self.ns,
            group: 0,
            native: common::hash(seed, 0, i),
        }
    }

    fn publish(&mut self, seed: u64, first_slot: u32) {
        let mut pages = Vec::new();
        for i in 0..SLOTS {
            let slot = first_slot + i as u32;
            let dp = match self.one(Command::DevicePageAlloc {
                session: self.s,
                region: self.region,
                slot,
            }) {
                Event::DevicePageAllocated { device_page, .. } => device_page,
                e => panic!("{e:?}"),
            };
            let native = common::hash(seed, 0, i);
            self.arena
                .write(
                    self.engine,
                    slot as u64 * PAGE_BYTES,
                    &payload(&self.ns, 0, &native),
                )
                .unwrap();
            pages.push(PublishPage {
                rank: 0,
                group: 0,
                hash: native,
                device_page: dp,
            });
        }
        self.rt
            .submit(
                Origin::EMBEDDED,
                Command::Publish {
                    session: self.s,
                    request: seed,
                    pages: pages.clone(),
                },
            )
            .unwrap();
        let done = self.until("publish", |e| matches!(e, Event::PublishDone { .. }));
        assert!(
            matches!(
                done,
                Event::PublishDone {
                    inserted: SLOTS,
                    ..
                }
            ),
            "{done:?}"
        );
        for p in pages {
            self.rt
                .submit(
                    Origin::EMBEDDED,
                    Command::DevicePageFree {
                        session: self.s,
                        device_page: p.device_page,
                    },
                )
                .unwrap();
        }
        common::embedded(self.rt.tick());
    }

    fn wait_demoted(&mut self, written: u64) {
        for _ in 0..20_000 {
            let m = self.rt.stats().metrics;
            if m.demotions.get("written").copied().unwrap_or(0) >= written {
                return;
            }
            self.rt
                .submit(Origin::EMBEDDED, Command::AdvanceClock { us: 10 })
                .unwrap();
            common::embedded(self.rt.tick());
            std::thread::sleep(Duration::from_micros(100));
        }
        panic!(
            "demotions never written: {:#?}",
            self.rt.stats().metrics.demotions
        );
    }

    /// Query + prepare + restore whatever the runtime offers for seed's 8
    /// pages into slots 40..; checks the bytes and returns the Ready's
    /// (pages restored, from DRAM, from tiers), or the miss reason.
    fn recover(&mut self, seed: u64) -> Result<(u64, u64, u64), MissReason> {
        let hashes: Vec<NativeHash> = (0..=SLOTS).map(|i| common::hash(seed, 0, i)).collect();
        self.rt
            .submit(
                Origin::EMBEDDED,
                Command::Query {
                    session: self.s,
                    request: seed,
                    groups: vec![orbitkv_components::api::GroupHashes { group: 0, hashes }],
                    origin: 0,
                    prompt_len: (SLOTS + 1) * PAGE,
                    expect_namespaces: vec![],
                    prepare: true,
                    speculative: false,
                },
            )
            .unwrap();
        let ready = self.until("ready", |e| {
            matches!(
                e,
                Event::Ready { .. } | Event::Miss { .. } | Event::QueryResult { miss: Some(_), .. }
            )
        });
        let (op, leases, from_dram, from_tiers) = match ready {
            Event::Ready {
                operation,
                leases,
                pages_from_dram,
                pages_from_tiers,
                ..
            } => (operation, leases, pages_from_dram, pages_from_tiers),
            Event::Miss { reason, .. }
            | Event::QueryResult {
                miss: Some(reason), ..
            } => return Err(reason),
            e => panic!("{e:?}"),
        };
        let mut targets = Vec::new();
        for (i, l) in leases.iter().enumerate() {
            let dp = match self.one(Command::DevicePageAlloc {
                session: self.s,
                region: self.region,
                slot: 40 + i as u32,
            }) {
                Event::DevicePageAllocated { device_page, .. } => device_page,
                e => panic!("{e:?}"),
            };
            targets.push(RestoreTarget {
                pos: l.pos,
                device_page: dp,
            });
        }
        self.rt
            .submit(
                Origin::EMBEDDED,
                Command::Restore {
                    session: self.s,
                    operation: op,
                    targets: targets.clone(),
                    retained: vec![],
                },
            )
            .unwrap();
        let done = self.until("restore", |e| {
            matches!(e, Event::RestoreDone { .. } | Event::Miss { .. })
        });
        assert!(matches!(done, Event::RestoreDone { .. }), "{done:?}");
        for (i, t) in targets.iter().enumerate() {
            let page = t.pos.page_end / PAGE - 1;
            let got = self
                .arena
                .read(self.engine, (40 + i as u64) * PAGE_BYTES, PAGE_BYTES)
                .unwrap();
            assert_eq!(
                got,
                payload(&self.ns, 0, &self.key(seed, page).native),
                "page {page} of seed {seed}"
            );
        }
        for t in targets.iter() {
            self.rt
                .submit(
                    Origin::EMBEDDED,
                    Command::DevicePageFree {
                        session: self.s,
                        device_page: t.device_page,
                    },
                )
                .unwrap();
        }
        common::embedded(self.rt.tick());
        self.rt.check_invariants().unwrap();
        Ok((leases.len() as u64, from_dram, from_tiers))
    }
}

/// Flips one payload byte of `key`'s record on disk (the store in `dir`
/// must be closed: it holds a lock).
fn corrupt_on_disk(dir: &Path, backend: IoBackend, key: &StateKey) {
    let store = SsdStore::open(ssd_config(dir, backend)).unwrap();
    let info = store.record_info(key).expect("the page is on SSD");
    let path = store.segment_path(info.segment_id);
    drop(store);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(info.payload_offset + 100) as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

fn backends() -> [IoBackend; 2] {
    [IoBackend::IoUring, IoBackend::Blocking]
}

#[test]
fn evicted_pages_round_trip_through_ssd_with_exact_bytes() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let mut n = node(dir.path(), backend);
        n.publish(1, 0);
        // DRAM holds 8 pages: publishing 8 more demotes the first 8 to SSD.
        n.publish(2, 8);
        n.wait_demoted(SLOTS);
        let st = n.rt.stats();
        assert_eq!(st.metrics.evictions.values().sum::<u64>(), SLOTS);
        // Written straight from their DRAM slots, which are all back: the
        // pool holds exactly seed 2's pages.
        assert_eq!(st.metrics.demotions.get("in_place"), Some(&SLOTS));
        assert_eq!(st.pool_bytes_used, SLOTS * PAGE_BYTES, "{backend:?}");
        n.rt.check_invariants().unwrap();
        // Seed 1 comes back from SSD (evicting seed 2 in turn).
        assert_eq!(n.recover(1), Ok((SLOTS, 0, SLOTS)), "{backend:?}");
        // And now it is in DRAM.
        assert_eq!(n.recover(1), Ok((SLOTS, SLOTS, 0)), "{backend:?}");
        let st = n.rt.stats();
        assert_eq!((st.leases, st.bytes_reserved, st.operations), (0, 0, 0));
        assert_eq!(
            st.metrics.bytes_read_by_tier.get("ssd"),
            Some(&(SLOTS * PAGE_BYTES))
        );
    }
}

#[test]
fn demoted_pages_survive_a_manager_restart() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut n = node(dir.path(), backend);
            n.publish(3, 0);
            n.publish(4, 8);
            n.wait_demoted(SLOTS);
        }
        // A new manager process over the same directory.
        let mut n = node(dir.path(), backend);
        assert_eq!(n.recover(3), Ok((SLOTS, 0, SLOTS)), "{backend:?}");
        // Seed 4 was only in DRAM: gone with the old process.
        assert_eq!(n.recover(4), Err(MissReason::NotFound), "{backend:?}");
    }
}

#[test]
fn a_record_corrupted_at_rest_is_never_served() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let victim;
        {
            let mut n = node(dir.path(), backend);
            n.publish(5, 0);
            n.publish(6, 8);
            n.wait_demoted(SLOTS);
            victim = n.key(5, 3);
        }
        corrupt_on_disk(dir.path(), backend, &victim);
        // The reopen scan verifies every record and skips the corrupt one:
        // the prefix stops at page 3, so only pages 0..3 are restored.
        let mut n = node(dir.path(), backend);
        assert_eq!(n.recover(5), Ok((3, 0, 3)), "{backend:?}");
    }
}

#[test]
fn a_record_corrupted_under_a_running_manager_is_a_checksum_miss() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        // Demote, restart (so the record is indexed from the scan), then
        // corrupt the file behind the running store's back.
        {
            let mut n = node(dir.path(), backend);
            n.publish(7, 0);
            n.publish(8, 8);
            n.wait_demoted(SLOTS);
        }
        let (info, path) = {
            let store = SsdStore::open(ssd_config(dir.path(), backend)).unwrap();
            let key = StateKey {
                namespace: store.keys()[0].namespace,
                group: 0,
                native: common::hash(7, 0, 3),
            };
            let info = store.record_info(&key).unwrap();
            (info, store.segment_path(info.segment_id))
        };
        let mut n = node(dir.path(), backend);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(info.payload_offset + 100) as usize] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(n.recover(7), Err(MissReason::Checksum), "{backend:?}");
        assert_eq!(n.rt.stats().metrics.checksum_failures, 1);
        // The corrupt record is gone from the index: the next query restores
        // the intact prefix only.
        assert_eq!(n.recover(7), Ok((3, 3, 0)), "{backend:?}");
    }
}
