//! `orbitkv.Runtime`: the embedded runtime, driven in-process.

use std::borrow::Cow;
use std::os::fd::AsFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use std::collections::HashMap;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use orbitkv_components::api::{Addressed, Command, CommandError, CommandId, LimitName, Origin};
use orbitkv_engine::{Port, Sending};
use orbitkv_gpu::CopyEngine;
use orbitkv_gpu::agent::{CopyAgent, HostWindow, MemoryKind};
use orbitkv_ipc::{ClientError, Delivered};

use crate::agent::AgentSetup;
use orbitkv_gpu::host::{DeviceArena, HostCopyConfig, HostCopyEngine};
use orbitkv_gpu::sim::{SimCopyConfig, SimCopyEngine};
use orbitkv_io::tier::BackingTier;
use orbitkv_world::{Backends, Config, Runtime, RuntimeError, SubmitError};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use crate::buffer::{Mapping, memoryview};
use crate::convert::{deserialize_dict, serialize};
use crate::{InvariantError, QueueFull};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The embedded runtime: commands in, events out, one `tick` at a time.
///
/// Every call locks the runtime and runs without the GIL, so a `tick` on one
/// Python thread does not stall the others; calls from several threads are
/// serialized.
#[pyclass(module = "orbitkv", name = "Runtime", frozen)]
pub struct PyRuntime {
    inner: Mutex<Embedded>,
    /// The copy engine's "device" memory, for `device_write`/`device_read`.
    arena: DeviceArena,
    simulated: bool,
    /// Set when a call panicked: the state is no longer trusted.
    broken: AtomicBool,
    /// The Python objects owning each agent region's memory, kept alive
    /// until the region is detached (and after the agent, which drains
    /// its copies when dropped: declared after `inner`).
    keep: Mutex<HashMap<u32, Py<PyAny>>>,
}

/// The runtime and the embedded caller's copy agent (created with its
/// first agent region). `tick` hands the agent its `AgentCopy` events and
/// submits its reports, as a bridge agent does over a manager connection.
pub(crate) struct Embedded {
    rt: Runtime,
    /// The agent and the kind of memory its executor copies.
    agent: Option<(CopyAgent, MemoryKind)>,
    workers: usize,
    /// Events ticked out while a session waited and not yet claimed by
    /// one (every session on this runtime claims its own from here).
    queue: VecDeque<Delivered>,
}

/// Bound on events kept for sessions; past it the oldest go (they belong
/// to no waiting session).
const MAX_QUEUED: usize = 65_536;

/// The embedded runtime as an `orbitkv_engine::Port`: waits tick it.
struct EmbeddedPort<'a>(&'a mut Embedded);

fn inbox_full(e: SubmitError) -> CommandError {
    match e {
        SubmitError::InboxFull(n) => CommandError::Limit {
            name: LimitName::MaxInbox,
            limit: n as u64,
        },
    }
}

impl Port for EmbeddedPort<'_> {
    fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        self.0
            .rt
            .submit(Origin::EMBEDDED, command)
            .map_err(|e| ClientError::Command(inbox_full(e)))
    }

    fn submit_many(
        &mut self,
        commands: Vec<Command>,
    ) -> Result<Vec<Result<CommandId, CommandError>>, ClientError> {
        Ok(commands
            .into_iter()
            .map(|c| self.0.rt.submit(Origin::EMBEDDED, c).map_err(inbox_full))
            .collect())
    }

    fn send_command(&mut self, command: Command) -> Result<Sending, ClientError> {
        self.submit(command).map(Sending::Queued)
    }

    fn accepted_id(&mut self, sent: Sending) -> Result<Option<CommandId>, ClientError> {
        match sent {
            Sending::Queued(id) => Ok(Some(id)),
            Sending::Sent(_) => Err(ClientError::Protocol(
                "a command sent to a manager, asked of the embedded runtime".into(),
            )),
        }
    }

    fn locate(
        &mut self,
        requests: &[orbitkv_components::admin::LookupRequest],
        _timeout: Duration,
    ) -> Result<Vec<orbitkv_components::admin::LookupReply>, ClientError> {
        use orbitkv_components::admin::LookupReply;
        Ok(requests
            .iter()
            .map(|r| LookupReply::from_result(self.0.rt.locate(r)))
            .collect())
    }

    fn wait_event(
        &mut self,
        timeout: Duration,
        pred: &dyn Fn(&orbitkv_components::api::Event) -> bool,
    ) -> Result<Option<Delivered>, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.0.queue.iter().position(|d| pred(&d.event)) {
                return Ok(self.0.queue.remove(i));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            let events = self
                .0
                .tick()
                .map_err(|e| ClientError::Command(inbox_full(e)))?;
            if events.is_empty() {
                // Copies and reads run on other threads: sleep until the
                // runtime's own copies land when they are all there is to
                // wait for, else let the others run.
                let left = deadline.saturating_duration_since(Instant::now());
                if !self.0.rt.wait_io(left.min(Duration::from_micros(200))) {
                    std::thread::yield_now();
                }
            }
            self.0.queue.extend(events.into_iter().map(|a| Delivered {
                event: a.event,
                terminal: a.terminal,
            }));
            while self.0.queue.len() > MAX_QUEUED {
                self.0.queue.pop_front();
            }
        }
    }
}

impl Embedded {
    /// One tick, with the agent's reports submitted first and its copy
    /// events taken out of what the caller sees.
    fn tick(&mut self) -> Result<Vec<Addressed>, SubmitError> {
        if let Some((agent, _)) = &mut self.agent {
            let mut done = Vec::new();
            agent.poll(&mut done);
            for command in done {
                self.rt.submit(Origin::EMBEDDED, command)?;
            }
        }
        let mut events = self.rt.tick();
        self.map_window();
        if let Some((agent, _)) = &mut self.agent {
            events.retain(|a| !(a.to == Origin::EMBEDDED && agent.handle(&a.event)));
        }
        Ok(events)
    }

    /// Maps the agent's window once the caller has a staging area (its
    /// first agent region was registered). Until then a copy could not be
    /// sent to it anyway.
    fn map_window(&mut self) {
        let Some((agent, _)) = &mut self.agent else {
            return;
        };
        if agent.has_window() {
            return;
        }
        let rt = &self.rt;
        let (Some(pool), Some(staging), Some(staging_len)) = (
            rt.export_pool(),
            rt.export_staging(Origin::EMBEDDED),
            rt.staging_capacity(Origin::EMBEDDED),
        ) else {
            return;
        };
        // A window that cannot be mapped leaves the agent without one: its
        // copies then fail (`shutdown`) and the operations miss.
        if let Ok(window) = HostWindow::map(pool, rt.pool_capacity(), staging, staging_len) {
            let _ = agent.set_window(window);
        }
    }

    /// The agent, created for memory of `kind` with the first region;
    /// memory of the other kind is refused (`crate::agent::check_kind`).
    fn agent(&mut self, kind: MemoryKind) -> Result<&mut CopyAgent, AgentSetup> {
        if self.agent.is_none() {
            self.agent = Some((crate::agent::new_agent(kind, self.workers)?, kind));
        }
        let Some((agent, has)) = self.agent.as_mut() else {
            return Err(AgentSetup::Invalid("no copy agent".into()));
        };
        crate::agent::check_kind(*has, kind)?;
        Ok(agent)
    }
}

fn parse_config(config: Option<&Bound<'_, PyAny>>) -> PyResult<Config> {
    let bad = |e: String| PyValueError::new_err(format!("config: {e}"));
    match config {
        None => Ok(Config::default()),
        Some(c) if c.is_none() => Ok(Config::default()),
        Some(c) => match c.cast::<PyString>() {
            Ok(s) => {
                let text: String = s.extract()?;
                serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
            }
            Err(_) => deserialize_dict(c).map_err(bad),
        },
    }
}

fn runtime_error(e: RuntimeError) -> PyErr {
    match e {
        RuntimeError::Config(e) => PyValueError::new_err(e.to_string()),
        RuntimeError::Ssd(e) => PyOSError::new_err(e.to_string()),
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Why a call could not run on the runtime.
enum Failure {
    /// An earlier call panicked; the runtime's state is not trusted.
    Broken,
    /// This call panicked. `violations` when the invariant check inside
    /// `tick` failed (what `check_invariants` reports right after).
    Panicked {
        message: String,
        violations: Option<Vec<String>>,
    },
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panic".to_owned())
}

fn invariant_error(py: Python<'_>, violations: Vec<String>) -> PyErr {
    let err = InvariantError::new_err(format!(
        "{} invariant violation(s):\n{}",
        violations.len(),
        violations.join("\n")
    ));
    if let Err(e) = err.value(py).setattr("violations", violations) {
        return e;
    }
    err
}

impl Failure {
    fn into_pyerr(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Broken => PyRuntimeError::new_err(
                "the runtime panicked in an earlier call and cannot be used; create a new one",
            ),
            Failure::Panicked {
                violations: Some(v),
                ..
            } => invariant_error(py, v),
            Failure::Panicked { message, .. } => {
                PyRuntimeError::new_err(format!("the runtime panicked: {message}"))
            }
        }
    }
}

impl PyRuntime {
    /// Runs `f` on the locked runtime without the GIL. A panic in `f` (the
    /// runtime panics when its per-tick invariant check fails) becomes an
    /// exception, and the runtime refuses every later call.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Runtime) -> T + Send,
    ) -> PyResult<T> {
        self.with_embedded(py, |e| f(&mut e.rt))
    }

    /// Runs `f` on the runtime as a session's port (call without the
    /// GIL); `Err` with why when the runtime is not trusted.
    pub(crate) fn with_port<T>(&self, f: impl FnOnce(&mut dyn Port) -> T) -> Result<T, String> {
        self.locked(|e| f(&mut EmbeddedPort(e)))
            .map_err(|f| match f {
                Failure::Broken => "the runtime is broken (an earlier call panicked)".to_owned(),
                Failure::Panicked { message, .. } => format!("the runtime panicked: {message}"),
            })
    }

    /// Whether time moves only by `advance_clock`.
    pub(crate) fn is_simulated(&self) -> bool {
        self.simulated
    }

    fn with_embedded<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Embedded) -> T + Send,
    ) -> PyResult<T> {
        py.detach(|| self.locked(f)).map_err(|f| f.into_pyerr(py))
    }

    fn locked<T>(&self, f: impl FnOnce(&mut Embedded) -> T) -> Result<T, Failure> {
        {
            if self.broken.load(Ordering::Acquire) {
                return Err(Failure::Broken);
            }
            let mut rt = self.inner.lock().map_err(|_| Failure::Broken)?;
            match catch_unwind(AssertUnwindSafe(|| f(&mut rt))) {
                Ok(v) => Ok(v),
                Err(payload) => {
                    self.broken.store(true, Ordering::Release);
                    let violations = catch_unwind(AssertUnwindSafe(|| rt.rt.check_invariants()))
                        .ok()
                        .and_then(Result::err);
                    Err(Failure::Panicked {
                        message: panic_message(payload.as_ref()),
                        violations,
                    })
                }
            }
        }
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (config=None, *, simulated_clock=false))]
    fn new(
        py: Python<'_>,
        config: Option<&Bound<'_, PyAny>>,
        simulated_clock: bool,
    ) -> PyResult<Self> {
        let mut config = parse_config(config)?;
        // The pool is a memory file, so the in-process copy agent maps it
        // read-only like an agent in another process does.
        config.dram.shared = true;
        let workers = config.copy.workers;
        let (copy, arena, tiers): (Box<dyn CopyEngine>, DeviceArena, Vec<Box<dyn BackingTier>>) =
            if simulated_clock {
                if config.ssd.is_some() {
                    return Err(PyValueError::new_err(
                        "config: a simulated clock runs without lower tiers; remove `ssd`",
                    ));
                }
                let engine = SimCopyEngine::new(SimCopyConfig {
                    max_in_flight_batches: config.copy.max_in_flight_batches,
                    ..SimCopyConfig::default()
                });
                let arena = engine.arena();
                (Box::new(engine), arena, Vec::new())
            } else {
                // What `Runtime::new` builds, with the arena kept.
                // Shared-memory regions, so `device_view` can hand out a
                // zero-copy view of them (an engine's tensors write and read
                // the region directly, as they would GPU memory).
                let engine = HostCopyEngine::new(HostCopyConfig {
                    workers: config.copy.workers,
                    max_in_flight_batches: config.copy.max_in_flight_batches,
                    shared_regions: true,
                });
                let arena = engine.arena();
                let mut tiers: Vec<Box<dyn BackingTier>> = Vec::new();
                if let Some(ssd) = &config.ssd {
                    let store = orbitkv_io::ssd::SsdStore::open(ssd.clone())
                        .map_err(|e| PyOSError::new_err(format!("SSD tier: {e}")))?;
                    tiers.push(Box::new(store));
                }
                (Box::new(engine), arena, tiers)
            };
        let backends = Backends {
            copy,
            tiers,
            simulated_clock,
        };
        // Mapping (and first-touching) the pool can take a while.
        let rt = py
            .detach(|| Runtime::with_backends(config, backends))
            .map_err(runtime_error)?;
        Ok(PyRuntime {
            inner: Mutex::new(Embedded {
                rt,
                agent: None,
                workers,
                queue: VecDeque::new(),
            }),
            arena,
            simulated: simulated_clock,
            broken: AtomicBool::new(false),
            keep: Mutex::new(HashMap::new()),
        })
    }

    /// Whether time moves only by `advance_clock` commands.
    #[getter]
    fn simulated_clock(&self) -> bool {
        self.simulated
    }

    /// Queues a command (its serde JSON shape) for the next tick; returns
    /// the command id the answering events carry.
    fn submit(&self, py: Python<'_>, command: &Bound<'_, PyAny>) -> PyResult<u64> {
        let command: Command = deserialize_dict(command)
            .map_err(|e| PyValueError::new_err(format!("invalid command: {e}")))?;
        // One embedded caller: it owns every session it opens.
        self.with(py, |rt| rt.submit(Origin::EMBEDDED, command))?
            .map_err(|e: SubmitError| QueueFull::new_err(e.to_string()))
    }

    /// Runs every stage once; returns the events it produced. Copies into
    /// and out of agent regions run in the runtime's in-process copy agent
    /// (their `agent_copy` events are its, not the caller's) off the
    /// Python thread; a later tick reports them.
    fn tick<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self
            .with_embedded(py, |e| e.tick())?
            .map_err(|e: SubmitError| QueueFull::new_err(e.to_string()))?;
        let list = PyList::empty(py);
        for a in &events {
            list.append(serialize(py, &a.event)?)?;
        }
        Ok(list)
    }

    /// A snapshot: counts, bytes reserved, pool occupancy, metrics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self.with(py, |rt| rt.stats())?;
        serialize(py, &stats)
    }

    /// Whether nothing is queued, in flight or leased.
    fn is_idle(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |rt| rt.is_idle())
    }

    /// Checks every invariant; raises `InvariantError` listing violations.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |rt| rt.check_invariants())?
            .map_err(|v| invariant_error(py, v))
    }

    /// Records every command and tick from now on to `path` as a trace that
    /// `orbitkv replay` runs. `tick_interval_us` is the caller's idle tick
    /// interval, written for the replay's drain.
    #[pyo3(signature = (path, tick_interval_us=1000))]
    fn record(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        tick_interval_us: u64,
    ) -> PyResult<()> {
        self.with(py, |rt| {
            let file = std::fs::File::create(&path)?;
            let out = std::io::BufWriter::new(file);
            rt.record(Box::new(out), tick_interval_us)
        })?
        .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// Stops recording and flushes the trace; raises `OSError` with the first
    /// write error, if any.
    fn stop_recording(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |rt| rt.stop_recording())?
            .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// Writes "device" bytes into a registered region (the event's
    /// `engine_region`) at a byte offset.
    fn device_write(
        &self,
        py: Python<'_>,
        region: u32,
        offset: u64,
        data: Cow<'_, [u8]>,
    ) -> PyResult<()> {
        let arena = &self.arena;
        py.detach(|| arena.write(region, offset, &data))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Reads `length` "device" bytes of a registered region at a byte offset.
    fn device_read<'py>(
        &self,
        py: Python<'py>,
        region: u32,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let arena = &self.arena;
        let bytes = py
            .detach(|| arena.read(region, offset, length))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// A writable, zero-copy `memoryview` of a whole device region (its
    /// `engine_region`), as an engine sees its GPU memory: slot `s` starts
    /// at `s * page_bytes`. The view keeps its own mapping, so it stays
    /// valid memory after the region's session closes or the runtime goes.
    /// Host copy engine only (`simulated_clock=False`).
    fn device_view<'py>(&self, py: Python<'py>, region: u32) -> PyResult<Bound<'py, PyAny>> {
        if self.simulated {
            return Err(PyValueError::new_err(
                "device_view needs the host copy engine (simulated_clock=False); \
                 use device_read/device_write on a simulated clock",
            ));
        }
        let arena = &self.arena;
        let map = py.detach(|| -> PyResult<Mapping> {
            let unknown = || PyValueError::new_err(format!("unknown device region {region}"));
            let len = arena.region_len(region).ok_or_else(unknown)?;
            let fd = arena.region_fd(region).ok_or_else(unknown)?;
            let len = usize::try_from(len)
                .map_err(|_| PyValueError::new_err("region larger than the address space"))?;
            Mapping::map_shared(fd.as_fd(), len)
                .map_err(|e| PyOSError::new_err(format!("mapping device region {region}: {e}")))
        })?;
        let len = map.len();
        memoryview(py, Arc::new(map), 0, len, false)
    }

    /// Attaches engine memory to the in-process copy agent as one region
    /// of `slots` page slots, laid out as `chunks` per page: each chunk a
    /// `(data_ptr, stride, length)` run, slot `s`'s run at `data_ptr + s *
    /// stride`, the page being the chunks' runs in order (one chunk of
    /// `(ptr, page_bytes, page_bytes)` for a contiguous buffer). Returns
    /// `(region, page_bytes)`: register it with a `register_device_region`
    /// command carrying `"agent": {"region": region, "page_bytes":
    /// page_bytes}`. The runtime never maps this memory; copies run here.
    ///
    /// `owner` (e.g. the tensor or array) is kept alive until
    /// `detach_agent_memory`; the memory must not move or be freed before.
    /// `device`: `"cpu"` (host executor) or `"cuda:N"` (CUDA executor;
    /// `orbitkv.CudaUnavailable` where this process cannot use CUDA). The
    /// first region decides the agent's executor.
    #[pyo3(signature = (slots, chunks, owner, device="cpu", layers=None))]
    fn attach_agent_memory(
        &self,
        py: Python<'_>,
        slots: u32,
        chunks: Vec<(u64, u64, u64)>,
        owner: Py<PyAny>,
        device: &str,
        layers: Option<Vec<u32>>,
    ) -> PyResult<(u32, u64)> {
        let kind = crate::agent::memory_kind(device).map_err(crate::agent::py_err)?;
        let chunks = crate::agent::chunks_of(kind, chunks);
        let (region, page_bytes) = self
            .with_embedded(py, |e| {
                let agent = e.agent(kind)?;
                // SAFETY: the caller promises the memory stays put while
                // attached, and `owner` (kept until detach) keeps it allocated.
                unsafe { agent.attach_layered(slots, &chunks, layers.as_deref()) }
                    .map_err(AgentSetup::from)
            })?
            .map_err(crate::agent::py_err)?;
        lock(&self.keep).insert(region, owner);
        Ok((region, page_bytes))
    }

    /// Detaches an agent region (after its session closed) and lets go of
    /// its owner. Refused while the agent has copies running.
    fn detach_agent_memory(&self, py: Python<'_>, region: u32) -> PyResult<bool> {
        let detached = self.with_embedded(py, |e| match &mut e.agent {
            Some((agent, _)) if agent.busy() => Err(()),
            Some((agent, _)) => Ok(agent.detach(region)),
            None => Ok(false),
        })?;
        match detached {
            Err(()) => Err(PyRuntimeError::new_err(
                "the copy agent has copies running; tick until they are reported",
            )),
            Ok(found) => {
                // The owner goes without the GIL held by the lock.
                let owner = lock(&self.keep).remove(&region);
                drop(owner);
                Ok(found)
            }
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "orbitkv.Runtime(simulated_clock={})",
            if self.simulated { "True" } else { "False" }
        )
    }
}
