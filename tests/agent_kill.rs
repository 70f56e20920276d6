//! An engine process killed (SIGKILL) in the middle of its copy agent's
//! copies leaves the manager consistent: the manager keeps answering other
//! clients, and once the dead connection's session is gone no lease,
//! reserved byte, operation or transfer is left; the pages it serves are
//! intact and a new engine restores them exactly.
//!
//! The engine is a child process running this binary with `--engine`: an
//! `orbitkv_ipc::Client` with a copy agent (`orbitkv_gpu::agent`) whose
//! memory is host memory (CI) or CUDA memory on device 0 (the GPU check,
//! `scripts/gpu-check.d/agent-kill.sh`). It is killed in two states:
//!
//! - `stalled`: a restore into its agent region and a publish from it
//!   submitted, their copies sent to the agent (the manager counts the
//!   transfers in flight), never reported;
//! - `copying`: restoring, checking and publishing in a loop, killed at
//!   whatever point of the copies the signal lands.
//!
//! ```text
//! agent_kill                    host memory (run by `cargo test`)
//! agent_kill --cuda [--orbitkv PATH]
//!                               CUDA memory; exit 2 when CUDA is unusable
//! ```
//!
//! A plain binary (`harness = false`) so that the GPU check can carry it
//! (with the `orbitkv` binary, `--orbitkv`) to a machine without Rust.

mod support;

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command as Proc, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use orbitkv_components::NativeHash;
use orbitkv_components::api::{
    AgentRegion, Command, Event, GroupHashes, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_gpu::agent::{Chunk, CopyAgent, HostWindow, MemoryKind, executor_for};
use orbitkv_gpu::cuda::{CudaConfig, testing::DeviceMemory};
use orbitkv_gpu::host::HostCopyConfig;
use orbitkv_ipc::{Client, hot};
use support::{BASE_CONFIG, BYTES, Manager, PAGE, T, register, with_driver};

/// Pages restored and published per round.
const N: u32 = 64;
/// Agent region slots: restores land in `0..N`, publishes read `N..2N`.
const SLOTS: u32 = 2 * N;

type Result<T> = std::result::Result<T, String>;

fn fail<T>(what: impl std::fmt::Display) -> Result<T> {
    Err(what.to_string())
}

/// The bytes of the published page `i` of `seed`.
fn payload(i: u64, seed: u64) -> Vec<u8> {
    (0..BYTES)
        .map(|b| (b.wrapping_mul(31) ^ i.wrapping_mul(7) ^ seed.wrapping_mul(101)) as u8)
        .collect()
}

fn hash(i: u64, seed: u64) -> NativeHash {
    NativeHash::from_u64(0x7000_0000 + (seed << 20) + i)
}

fn query(session: SessionHandle, n: u64, seed: u64) -> Command {
    Command::Query {
        session,
        request: seed,
        groups: vec![GroupHashes {
            group: 0,
            hashes: (0..n + 1).map(|i| hash(i, seed)).collect(),
        }],
        origin: 0,
        prompt_len: (n + 1) * PAGE,
        expect_namespaces: vec![],
        prepare: true,
        speculative: false,
    }
}

// The engine process ---------------------------------------------------------

/// Engine memory: a page is one contiguous `BYTES` run per slot.
enum Memory {
    Host(Box<[u8]>),
    Cuda(DeviceMemory),
}

impl Memory {
    fn new(device: &str) -> Result<Memory> {
        let len = u64::from(SLOTS) * BYTES;
        Ok(match device {
            "cpu" => Memory::Host(vec![0u8; len as usize].into_boxed_slice()),
            "cuda:0" => Memory::Cuda(DeviceMemory::alloc(0, len).map_err(|e| e.to_string())?),
            other => return fail(format!("unknown device {other}")),
        })
    }

    fn chunk(&mut self) -> Chunk {
        let (kind, ptr) = match self {
            Memory::Host(b) => (MemoryKind::Host, b.as_mut_ptr() as u64),
            Memory::Cuda(d) => (MemoryKind::Cuda { device: 0 }, d.ptr()),
        };
        Chunk {
            kind,
            ptr,
            stride: BYTES,
            len: BYTES,
        }
    }

    /// Only while no copy covers the slot.
    fn write(&mut self, slot: u32, data: &[u8]) -> Result<()> {
        let at = u64::from(slot) * BYTES;
        match self {
            Memory::Host(b) => {
                b[at as usize..at as usize + data.len()].copy_from_slice(data);
                Ok(())
            }
            Memory::Cuda(d) => d.write(at, data).map_err(|e| e.to_string()),
        }
    }

    fn read(&self, slot: u32) -> Result<Vec<u8>> {
        let at = u64::from(slot) * BYTES;
        match self {
            Memory::Host(b) => Ok(b[at as usize..(at + BYTES) as usize].to_vec()),
            Memory::Cuda(d) => d.read(at, BYTES as usize).map_err(|e| e.to_string()),
        }
    }
}

/// The copy agent riding on the connection, as the bridge's is. While
/// `hold` is set it runs the copies it is sent and keeps their reports.
struct Agent {
    agent: Arc<Mutex<CopyAgent>>,
    hold: Arc<AtomicBool>,
}

impl Agent {
    fn lock(&self) -> std::sync::MutexGuard<'_, CopyAgent> {
        self.agent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl orbitkv_ipc::Agent for Agent {
    fn window(
        &mut self,
        pool: &std::fs::File,
        pool_len: u64,
        staging: std::fs::File,
        staging_len: u64,
    ) -> std::result::Result<(), String> {
        let mut agent = self.lock();
        if agent.has_window() {
            return Ok(());
        }
        let window = HostWindow::map(pool.as_fd(), pool_len, staging.as_fd(), staging_len)
            .map_err(|e| e.to_string())?;
        agent.set_window(window).map_err(|e| e.to_string())
    }

    fn take(&mut self, event: &Event) -> bool {
        matches!(event, Event::AgentCopy { .. }) && self.lock().handle(event)
    }

    fn reports(&mut self, out: &mut Vec<Command>) {
        if !self.hold.load(Ordering::Relaxed) {
            self.lock().poll(out);
        }
    }

    fn busy(&self) -> bool {
        self.lock().busy()
    }

    fn lost(&mut self) {
        let mut discard = Vec::new();
        self.lock().drain(Duration::from_secs(10), &mut discard);
    }
}

struct Engine {
    client: Client,
    hold: Arc<AtomicBool>,
    session: SessionHandle,
    region: u64,
    memory: Memory,
}

impl Engine {
    fn open(socket: &Path, device: &str) -> Result<Engine> {
        let mut memory = Memory::new(device)?;
        let kind = memory.chunk().kind;
        let executor = executor_for(kind, HostCopyConfig::default(), CudaConfig::default())
            .map_err(|e| e.to_string())?;
        let agent = Arc::new(Mutex::new(CopyAgent::new(executor)));
        // SAFETY: `memory` lives in the returned engine, as long as the
        // process (which is killed or exits with it).
        let (engine_region, page_bytes) = unsafe {
            agent
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .attach(SLOTS, &[memory.chunk()])
        }
        .map_err(|e| e.to_string())?;
        let mut client = Client::connect(socket, "doomed-engine").map_err(|e| e.to_string())?;
        let hold = Arc::new(AtomicBool::new(false));
        client
            .set_agent(Box::new(Agent {
                agent,
                hold: hold.clone(),
            }))
            .map_err(|e| e.to_string())?;
        register(&mut client);
        let (session, region) = with_driver(&mut client, T, |d| {
            let session = d.open("llama")?;
            let registered = d.call(
                "region",
                Command::RegisterDeviceRegion {
                    session,
                    rank: 0,
                    group: 0,
                    slots: SLOTS,
                    agent: Some(AgentRegion {
                        region: engine_region,
                        page_bytes,
                    }),
                },
            )?;
            Ok::<_, orbitkv_world::driver::DriverError<_>>((session, registered))
        })
        .map_err(|e| format!("{e:?}"))?;
        let Event::RegionRegistered { region, .. } = region else {
            return fail(format!("agent region: {region:?}"));
        };
        Ok(Engine {
            client,
            hold,
            session,
            region,
            memory,
        })
    }

    /// Queries with prepare `N` pages of `seed`, allocates device pages on
    /// slots `0..N` and submits the restore; returns its operation and
    /// device pages.
    fn submit_restore(&mut self, seed: u64) -> Result<(u64, Vec<u64>)> {
        let (session, region) = (self.session, self.region);
        with_driver(&mut self.client, T, |d| {
            let reply = d.query(query(session, u64::from(N), seed))?;
            let ready = d.ready(reply.operation)?;
            let Event::Ready { leases, .. } = ready else {
                return Ok(Err(format!("prepare: {ready:?}")));
            };
            if leases.len() != N as usize {
                return Ok(Err(format!("{} leases, not {N}", leases.len())));
            }
            let pages = d.alloc_many(session, region, 0..N)?;
            let targets = leases
                .iter()
                .zip(&pages)
                .map(|(l, &device_page)| RestoreTarget {
                    pos: l.pos,
                    device_page,
                })
                .collect();
            d.submit(Command::Restore {
                session,
                operation: reply.operation,
                targets,
                retained: vec![],
            })?;
            Ok(Ok((reply.operation, pages)))
        })
        .map_err(|e: orbitkv_world::driver::DriverError<_>| format!("{e:?}"))?
    }

    /// Writes `N` pages of `seed` into slots `N..2N` and submits their
    /// publish; returns the device pages.
    fn submit_publish(&mut self, seed: u64) -> Result<Vec<u64>> {
        for i in 0..N {
            self.memory.write(N + i, &payload(u64::from(i), seed))?;
        }
        let (session, region) = (self.session, self.region);
        with_driver(&mut self.client, T, |d| {
            let pages = d.alloc_many(session, region, N..2 * N)?;
            let publish = pages
                .iter()
                .enumerate()
                .map(|(i, &device_page)| PublishPage {
                    rank: 0,
                    group: 0,
                    hash: hash(i as u64, seed),
                    device_page,
                })
                .collect();
            d.submit(Command::Publish {
                session,
                request: seed,
                pages: publish,
            })?;
            Ok(pages)
        })
        .map_err(|e: orbitkv_world::driver::DriverError<_>| format!("{e:?}"))
    }

    /// Waits for `done` (restore done or publish done) and frees `pages`.
    fn finish(
        &mut self,
        what: &'static str,
        pages: Vec<u64>,
        done: impl Fn(&Event) -> bool,
    ) -> Result<Event> {
        let session = self.session;
        with_driver(&mut self.client, T, |d| {
            let event = d.wait(what, |e| {
                done(e) || matches!(e, Event::Miss { .. } | Event::Rejected { .. })
            })?;
            for device_page in pages {
                d.submit(Command::DevicePageFree {
                    session,
                    device_page,
                })?;
            }
            Ok(event)
        })
        .map_err(|e: orbitkv_world::driver::DriverError<_>| format!("{e:?}"))
    }

    /// One full round: restore `seed`'s pages (exact bytes checked) and
    /// publish `N` pages of `publish_seed` from the agent region.
    fn round(&mut self, seed: u64, publish_seed: u64) -> Result<()> {
        let (operation, pages) = self.submit_restore(seed)?;
        let done = self.finish(
            "restore",
            pages,
            |e| matches!(e, Event::RestoreDone { operation: o, .. } if *o == operation),
        )?;
        if !matches!(done, Event::RestoreDone { pages, .. } if pages == u64::from(N)) {
            return fail(format!("restore: {done:?}"));
        }
        for i in 0..N {
            if self.memory.read(i)? != payload(u64::from(i), seed) {
                return fail(format!("slot {i} does not hold page {i} of seed {seed}"));
            }
        }
        let pages = self.submit_publish(publish_seed)?;
        let done = self.finish("publish", pages, |e| matches!(e, Event::PublishDone { .. }))?;
        match done {
            Event::PublishDone {
                inserted,
                duplicates,
                ..
            } if inserted + duplicates == u64::from(N) => Ok(()),
            other => fail(format!("publish: {other:?}")),
        }
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn engine_main(socket: &Path, device: &str, mode: &str) -> Result<()> {
    let mut e = Engine::open(socket, device)?;
    match mode {
        "stalled" => {
            // The agent runs what it is sent and reports nothing.
            e.hold.store(true, Ordering::Relaxed);
            let (_op, _restore_pages) = e.submit_restore(0)?;
            let _publish_pages = e.submit_publish(9)?;
            let _ = e.client.poll_events();
            say("STALLED");
        }
        "copying" => {
            for k in 0u64.. {
                e.round(0, 100 + k)?;
                say(&format!("ROUND {k}"));
            }
        }
        "verify" => {
            e.round(0, 50)?;
            say("VERIFIED");
            return Ok(());
        }
        other => return fail(format!("unknown mode {other}")),
    }
    std::thread::sleep(Duration::from_secs(3600));
    Ok(())
}

// The test ---------------------------------------------------------------------

struct EngineProc {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl EngineProc {
    fn spawn(socket: &Path, device: &str, mode: &str) -> Result<EngineProc> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Proc::new(exe)
            .args(["--engine", &socket.to_string_lossy(), device, mode])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        Ok(EngineProc { child, out })
    }

    /// The engine's next line (blocking; the engine bounds its own waits).
    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        self.out.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.is_empty() {
            let status = self.child.wait().map_err(|e| e.to_string())?;
            return fail(format!(
                "the engine exited ({status}) before saying anything"
            ));
        }
        Ok(line.trim_end().to_string())
    }

    fn kill(mut self) -> Result<()> {
        use std::os::unix::process::ExitStatusExt as _;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if status.signal() != Some(libc::SIGKILL) {
            return fail(format!("the engine was not killed: {status}"));
        }
        Ok(())
    }
}

/// Publishes `N` pages of seed 0 from a manager-owned region and keeps the
/// connection (and its session) open: the other client of the test.
fn publisher(m: &Manager) -> Result<Client> {
    let mut c = Client::connect(&m.socket, "publisher").map_err(|e| e.to_string())?;
    register(&mut c);
    let (s, region) = with_driver(&mut c, T, |d| {
        let s = d.open("llama")?;
        Ok::<_, orbitkv_world::driver::DriverError<_>>((s, d.region(s, (0, 0), N)?.region))
    })
    .map_err(|e| format!("{e:?}"))?;
    let pages =
        with_driver(&mut c, T, |d| d.alloc_many(s, region, 0..N)).map_err(|e| format!("{e:?}"))?;
    let view = c.region_mut(region).ok_or("no region memory")?;
    for i in 0..N as usize {
        view[i * BYTES as usize..(i + 1) * BYTES as usize].copy_from_slice(&payload(i as u64, 0));
    }
    let publish = pages
        .iter()
        .enumerate()
        .map(|(i, &device_page)| PublishPage {
            rank: 0,
            group: 0,
            hash: hash(i as u64, 0),
            device_page,
        })
        .collect();
    let done =
        with_driver(&mut c, T, |d| d.publish(s, 1, publish)).map_err(|e| format!("{e:?}"))?;
    if done.inserted != u64::from(N) {
        return fail(format!("publish: {done:?}"));
    }
    Ok(c)
}

/// The manager answers the publisher: a query with prepare leases every
/// page, each exactly as published, and the release returns them.
fn publisher_still_served(c: &mut Client) -> Result<()> {
    let ready = with_driver(c, T, |d| {
        let s = d.open("llama")?;
        let reply = d.query(query(s, u64::from(N), 0))?;
        let ready = d.ready(reply.operation)?;
        Ok::<_, orbitkv_world::driver::DriverError<_>>((s, reply.operation, ready))
    })
    .map_err(|e| format!("{e:?}"))?;
    let (s, operation, Event::Ready { leases, .. }) = ready else {
        return fail(format!("prepare after the kill: {:?}", ready.2));
    };
    if leases.len() != N as usize {
        return fail(format!("{} leases after the kill, not {N}", leases.len()));
    }
    for l in &leases {
        let i = l.pos.page_end / PAGE - 1;
        match c.page(l) {
            Ok(bytes) if bytes == &payload(i, 0)[..] => {}
            Ok(_) => return fail(format!("page {i} changed")),
            Err(e) => return fail(format!("page {i}: {e}")),
        }
    }
    with_driver(c, T, |d| {
        d.submit(Command::Release {
            session: s,
            operation,
        })?;
        d.submit(Command::CloseSession { session: s })?;
        d.wait(
            "close",
            |e| matches!(e, Event::SessionClosed { session, .. } if *session == s),
        )
    })
    .map_err(|e| format!("{e:?}"))?;
    Ok(())
}

/// Nothing of the dead engine is left: only the publisher's connection
/// and session, no lease, reservation, operation or transfer (each wait
/// panics, naming the gauge, after `T`), and no dead iceoryx2 node of its
/// hot path (the manager releases those at the disconnect, not at its
/// shutdown).
fn consistent(m: &Manager, incarnation: u64) -> Result<()> {
    m.wait_metric("connections", 1);
    m.wait_metric("sessions", 1);
    m.wait_metric("leases", 0);
    m.wait_metric("bytes_reserved", 0);
    m.wait_metric("operations", 0);
    m.wait_metric("transfers", 0);
    let config = hot::iox_config(&hot::file_prefix(incarnation))?;
    let deadline = Instant::now() + T;
    loop {
        match hot::dead_nodes(&config) {
            0 => return Ok(()),
            n if Instant::now() >= deadline => {
                return fail(format!("{n} dead iceoryx2 nodes left after {T:?}"));
            }
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn scenario(binary: &Path, device: &str) -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let m = Manager::start_binary(binary, dir.path(), "orbitkv", "64MiB", BASE_CONFIG, &[]);
    m.wait_metric("connections", 0);
    let mut publisher = publisher(&m)?;
    let incarnation = publisher.incarnation();
    let t0 = Instant::now();

    // Stalled: copies sent to the agent and never reported.
    let mut e = EngineProc::spawn(&m.socket, device, "stalled")?;
    let line = e.line()?;
    if line != "STALLED" {
        return fail(format!("stalled engine: {line}"));
    }
    // The restore's and the publish's copies, both with the agent.
    let transfers = m.wait_metric_until("transfers", |v| v >= 2);
    let leases = m.wait_metric_until("leases", |v| v >= u64::from(N));
    e.kill()?;
    consistent(&m, incarnation)?;
    publisher_still_served(&mut publisher)?;
    consistent(&m, incarnation)?;
    println!(
        "stalled: killed with {transfers} transfers and {leases} leases in flight; consistent"
    );

    // Copying: killed somewhere in a loop of restores and publishes.
    let mut e = EngineProc::spawn(&m.socket, device, "copying")?;
    for k in 0..3 {
        let line = e.line()?;
        if line != format!("ROUND {k}") {
            return fail(format!("copying engine: {line}"));
        }
    }
    // Into the next round's copies.
    std::thread::sleep(Duration::from_millis(2));
    e.kill()?;
    consistent(&m, incarnation)?;
    publisher_still_served(&mut publisher)?;
    println!("copying: killed after 3 rounds; consistent");

    // A new engine restores the pages exactly and publishes.
    let mut e = EngineProc::spawn(&m.socket, device, "verify")?;
    let line = e.line()?;
    if line != "VERIFIED" {
        return fail(format!("verify engine: {line}"));
    }
    let status = e.child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return fail(format!("verify engine exited {status}"));
    }
    consistent(&m, incarnation)?;
    drop(publisher);
    m.wait_metric("connections", 0);
    m.wait_metric("sessions", 0);
    println!(
        "agent_kill ({device}): the manager stayed consistent ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--engine") {
        let [_, socket, device, mode] = &args[..] else {
            eprintln!("usage: agent_kill --engine SOCKET DEVICE MODE");
            return ExitCode::from(2);
        };
        return match engine_main(Path::new(socket), device, mode) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                say(&format!("ERROR {e}"));
                ExitCode::FAILURE
            }
        };
    }
    let cuda = args.iter().any(|a| a == "--cuda");
    let binary = args
        .iter()
        .position(|a| a == "--orbitkv")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_orbitkv")));
    let device = if cuda {
        if let Err(why) = orbitkv_gpu::cuda::probe() {
            println!("agent_kill: no CUDA ({why}); nothing run");
            return ExitCode::from(2);
        }
        "cuda:0"
    } else {
        "cpu"
    };
    match scenario(&binary, device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent_kill ({device}) FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
