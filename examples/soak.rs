//! Soak benchmark of `orbitkv serve`: engine-like clients for a long run.
//! Not a test: it asserts nothing about time; it reports.
//!
//! ```sh
//! cargo build --release --bin orbitkv
//! cargo run --release --example soak -- [--clients 8] [--minutes 10] [--report-every 30]
//! ```
//!
//! Starts the release manager (`target/release/orbitkv`; `ORBITKV_BIN`
//! overrides) with a 16 MiB DRAM tier, so pages are evicted all along.
//! Each client registers, opens a session and a 64-slot device region,
//! then loops like an engine step: publish 4 pages of a prompt (one of 512
//! per client, in turn), query it with prepare, restore the leased pages
//! into its device region and compare every byte (a hit), or take the miss
//! (evicted meanwhile). Every `--report-every` seconds it prints the
//! manager's RSS, the round trips' p50/p99 over that interval (query until
//! `ready`, and restore), and the counts; at the end, after the clients
//! have disconnected, the manager's leases and reserved bytes, which must
//! be 0.

use std::path::PathBuf;
use std::process::{Command as Proc, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orbitkv_components::api::{
    Command, Event, GroupHashes, PagePos, PublishPage, Rank, RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::{NativeHash, StorageLayout, StorageSlot};
use orbitkv_ipc::Client;

const PAGE: u64 = 16;
const BYTES: u64 = 4096;
const PROMPT_PAGES: u64 = 4;
const PROMPTS: u64 = 512;
const T: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Interval {
    query_us: Vec<f64>,
    restore_us: Vec<f64>,
    hits: u64,
    misses: u64,
    publishes: u64,
    errors: u64,
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pct(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() as f64 * p) as usize).min(xs.len() - 1)]
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn payload(client: u64, prompt: u64, page: u64) -> Vec<u8> {
    let seed = client * 1_000_003 + prompt * 131 + page;
    (0..BYTES)
        .map(|b| (b as u8).wrapping_mul(29).wrapping_add(seed as u8) ^ (seed >> 8) as u8)
        .collect()
}

fn hashes(client: u64, prompt: u64) -> Vec<NativeHash> {
    (0..PROMPT_PAGES)
        .map(|i| NativeHash::from_u64((client << 40) | (prompt << 8) | i))
        .collect()
}

fn setup(c: &mut Client) -> (SessionHandle, u64, Vec<u64>) {
    let slot = StorageSlot {
        layer: 0,
        group: 0,
        tp_rank: 0,
        pp_rank: 0,
        segment_bytes: BYTES,
        padded_page_bytes: BYTES,
        page_tokens: PAGE as u32,
        dtype: "bf16".into(),
        layout: "NHD".into(),
        strides: vec![1],
        device_addr: 0,
    };
    c.call(
        Command::RegisterInstance {
            instance: "soak".into(),
            identity: [3; 32],
            layout: StorageLayout {
                slots: vec![slot],
                pool_capacity_pages: 0,
            },
            page_tokens: PAGE,
            groups: vec![GroupSpec {
                id: 0,
                rule: Rule::Prefix,
                components: vec![ComponentKind::AttentionKv],
            }],
            ranks: vec![Rank { tp: 0, pp: 0 }],
        },
        T,
    )
    .expect("register");
    let s = match c.call(
        Command::OpenSession {
            instance: "soak".into(),
        },
        T,
    ) {
        Ok(Event::SessionOpened { session, .. }) => session,
        e => panic!("open: {e:?}"),
    };
    let region = match c.call(
        Command::RegisterDeviceRegion {
            session: s,
            rank: 0,
            group: 0,
            slots: 64,
            agent: None,
        },
        T,
    ) {
        Ok(Event::RegionRegistered { region, .. }) => region,
        e => panic!("region: {e:?}"),
    };
    let pages = (0..2 * PROMPT_PAGES as u32)
        .map(|slot| {
            match c.call(
                Command::DevicePageAlloc {
                    session: s,
                    region,
                    slot,
                },
                T,
            ) {
                Ok(Event::DevicePageAllocated { device_page, .. }) => device_page,
                e => panic!("alloc: {e:?}"),
            }
        })
        .collect();
    (s, region, pages)
}

/// One engine step; `Err` on anything unexpected.
fn step(
    c: &mut Client,
    id: u64,
    prompt: u64,
    s: SessionHandle,
    region: u64,
    pages: &[u64],
    iv: &Mutex<Interval>,
) -> Result<(), String> {
    let hs = hashes(id, prompt);
    // Publish from device slots 0..4.
    for p in 0..PROMPT_PAGES {
        let at = (p * BYTES) as usize;
        let r = c.region_mut(region).ok_or("no region mapping")?;
        r[at..at + BYTES as usize].copy_from_slice(&payload(id, prompt, p));
    }
    let publish = Command::Publish {
        session: s,
        request: prompt,
        pages: (0..PROMPT_PAGES)
            .map(|p| PublishPage {
                rank: 0,
                group: 0,
                hash: hs[p as usize],
                device_page: pages[p as usize],
            })
            .collect(),
    };
    match c.call(publish, T).map_err(|e| e.to_string())? {
        Event::PublishDone { .. } => {}
        e => return Err(format!("publish: {e:?}")),
    }
    // Query with prepare until ready.
    let t = Instant::now();
    let q = Command::Query {
        session: s,
        request: prompt,
        groups: vec![GroupHashes {
            group: 0,
            hashes: hs,
        }],
        origin: 0,
        prompt_len: (PROMPT_PAGES + 1) * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    };
    let operation = match c.call(q, T).map_err(|e| e.to_string())? {
        Event::QueryResult {
            operation,
            miss: None,
            ..
        } => operation,
        Event::QueryResult { miss: Some(_), .. } => {
            iv.lock().unwrap().misses += 1;
            return Ok(());
        }
        e => return Err(format!("query: {e:?}")),
    };
    let ready = c
        .wait_event(T, |e| {
            matches!(e, Event::Ready { operation: o, .. } | Event::Miss { operation: o, .. } if *o == operation)
        })
        .map_err(|e| e.to_string())?
        .ok_or("no ready")?;
    let query_us = t.elapsed().as_secs_f64() * 1e6;
    let Event::Ready { leases, .. } = ready else {
        iv.lock().unwrap().misses += 1;
        return Ok(());
    };
    // Restore into device slots 4..8 and compare.
    let t = Instant::now();
    let targets: Vec<RestoreTarget> = leases
        .iter()
        .map(|l| RestoreTarget {
            pos: PagePos {
                rank: 0,
                group: 0,
                page_end: l.pos.page_end,
            },
            device_page: pages[(PROMPT_PAGES + l.pos.page_end / PAGE - 1) as usize],
        })
        .collect();
    c.submit(Command::Restore {
        session: s,
        operation,
        targets,
        retained: vec![],
    })
    .map_err(|e| e.to_string())?;
    let done = c
        .wait_event(T, |e| {
            matches!(e, Event::RestoreDone { operation: o, .. } | Event::Miss { operation: o, .. } if *o == operation)
        })
        .map_err(|e| e.to_string())?
        .ok_or("no restore_done")?;
    let restore_us = t.elapsed().as_secs_f64() * 1e6;
    let Event::RestoreDone { .. } = done else {
        iv.lock().unwrap().misses += 1;
        return Ok(());
    };
    let r = c.region_mut(region).ok_or("no region mapping")?;
    for l in &leases {
        let p = l.pos.page_end / PAGE - 1;
        let at = ((PROMPT_PAGES + p) * BYTES) as usize;
        if r[at..at + BYTES as usize] != payload(id, prompt, p)[..] {
            return Err(format!("client {id} prompt {prompt} page {p}: wrong bytes"));
        }
    }
    let mut iv = iv.lock().unwrap();
    iv.hits += 1;
    iv.publishes += 1;
    iv.query_us.push(query_us);
    iv.restore_us.push(restore_us);
    Ok(())
}

fn main() {
    let clients = arg("--clients", 8);
    let minutes = arg("--minutes", 10);
    let every = arg("--report-every", 30);
    let bin = std::env::var("ORBITKV_BIN").unwrap_or_else(|_| "target/release/orbitkv".into());
    let dir = tempfile::tempdir().expect("tempdir");
    let socket: PathBuf = dir.path().join("soak.sock");
    let config = dir.path().join("soak.toml");
    std::fs::write(
        &config,
        "[dram]\nfirst_touch = false\nextent_bytes = 65536\n",
    )
    .unwrap();
    let mut manager = Proc::new(&bin)
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram",
            "16MiB",
        ])
        .args(["--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    let pid = manager.id();
    let deadline = Instant::now() + T;
    while Client::connect(&socket, "probe").is_err() {
        assert!(Instant::now() < deadline, "manager did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "soak: {clients} clients, {minutes} min, manager pid {pid}, RSS at start {} KiB",
        rss_kib(pid)
    );
    let stop = Arc::new(AtomicBool::new(false));
    let iv = Arc::new(Mutex::new(Interval::default()));
    let workers: Vec<_> = (0..clients)
        .map(|id| {
            let (stop, iv, socket) = (stop.clone(), iv.clone(), socket.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket, &format!("soak-{id}")).expect("connect");
                let (s, region, pages) = setup(&mut c);
                let mut prompt = 0;
                while !stop.load(Ordering::Relaxed) {
                    if let Err(e) = step(&mut c, id, prompt % PROMPTS, s, region, &pages, &iv) {
                        eprintln!("client {id}: {e}");
                        iv.lock().unwrap().errors += 1;
                    }
                    prompt += 1;
                }
            })
        })
        .collect();
    let start = Instant::now();
    let end = start + Duration::from_secs(minutes * 60);
    let mut rss = Vec::new();
    println!(
        "   t(s)  rss(KiB)  hits  misses  errors  query+ready p50/p99 (us)  restore p50/p99 (us)"
    );
    while Instant::now() < end {
        std::thread::sleep(Duration::from_secs(every).min(end - Instant::now()));
        let mut x = std::mem::take(&mut *iv.lock().unwrap());
        let r = rss_kib(pid);
        rss.push(r);
        println!(
            "{:7.0} {:9} {:5} {:7} {:7}  {:10.1} / {:10.1}  {:10.1} / {:10.1}",
            start.elapsed().as_secs_f64(),
            r,
            x.hits,
            x.misses,
            x.errors,
            pct(&mut x.query_us, 0.5),
            pct(&mut x.query_us, 0.99),
            pct(&mut x.restore_us, 0.5),
            pct(&mut x.restore_us, 0.99),
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    // The clients are gone: every lease and reserved byte must be back.
    let mut c = Client::connect(&socket, "soak-end").expect("connect");
    let deadline = Instant::now() + T;
    let snap = loop {
        let s = c.inspect(T).expect("inspect");
        if (s.leases == 0 && s.bytes_reserved == 0 && s.sessions == 0) || Instant::now() > deadline
        {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let warm = rss.get(1).copied().unwrap_or(0);
    let last = rss.last().copied().unwrap_or(0);
    println!(
        "end: leases {} bytes_reserved {} sessions {} operations {}; RSS after warm-up {} KiB, at the end {} KiB ({:+} KiB)",
        snap.leases,
        snap.bytes_reserved,
        snap.sessions,
        snap.operations,
        warm,
        last,
        last as i64 - warm as i64
    );
    println!(
        "since start: queries {} hits {} misses {:?} checksum failures {}",
        snap.total.queries, snap.total.hits, snap.total.misses, snap.total.checksum_failures
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = manager.wait();
}
