//! `orbitkv.Client`: a connection to `orbitkv serve`, wrapping
//! [`orbitkv_ipc::Client`]. Commands and events are dicts in their
//! serde JSON shapes (as for `Runtime`); page bytes are zero-copy
//! `memoryview`s over the shared pool and the client's device regions
//! (`crate::buffer`).
//!
//! Every blocking call runs without the GIL. Long waits run in slices of
//! [`SLICE`], checking for signals between them, so Ctrl-C interrupts a
//! `wait_event(60)`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use orbitkv_components::api::{
    Command, CommandError, Event, GroupHashes, LeaseInfo, LimitName, SessionHandle,
};
use orbitkv_components::key::NativeHash;
use orbitkv_components::namespace::Namespace;

use orbitkv_ipc::{Client, ClientError};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::agent::{AgentSetup, SharedAgent, check_kind, chunks_of, memory_kind};
use crate::buffer::{Mapping, memoryview};
use crate::convert::{deserialize, deserialize_dict, serialize};
use crate::{ConnectionError, QueueFull, Rejected};

/// The longest stretch a call blocks without checking for signals.
const SLICE: Duration = Duration::from_millis(100);

/// A connection to the manager: commands in, events out.
///
/// Calls from several threads are serialized by an internal lock.
#[pyclass(module = "orbitkv", name = "Client", frozen)]
pub struct PyClient {
    state: Mutex<State>,
    /// The copy agent (created with the first agent memory), then the
    /// owners of the memory attached to it: dropped after the agent, which
    /// drains its copies when dropped.
    agent: Mutex<Option<SharedAgent>>,
    keep: Mutex<HashMap<u32, Py<PyAny>>>,
    socket: String,
    name: String,
    incarnation: u64,
    pool_bytes: u64,
}

struct State {
    /// `None` once closed.
    client: Option<Client>,
    /// Our duplicates of the client's mappings, shared with every view
    /// handed out (`crate::buffer`).
    pool: Option<Arc<Mapping>>,
    regions: HashMap<u64, Arc<Mapping>>,
}

impl State {
    fn client(&mut self) -> Result<&mut Client, Failure> {
        self.client.as_mut().ok_or(Failure::Closed)
    }

    /// This client's mapping of the shared pool (made on first use).
    fn pool_mapping(&mut self) -> Result<Arc<Mapping>, Failure> {
        if let Some(p) = &self.pool {
            return Ok(p.clone());
        }
        let c = self.client()?;
        let Some(pool) = c.pool() else {
            return Err(Failure::Os(
                "the manager did not share its pool (no descriptor in Welcome)".into(),
            ));
        };
        // SAFETY: the client's live shared mapping of the pool.
        let m = unsafe { Mapping::duplicate(pool.as_ptr(), pool.len()) }
            .map_err(|e| Failure::Os(format!("mapping the shared pool: {e}")))?;
        let m = Arc::new(m);
        self.pool = Some(m.clone());
        Ok(m)
    }
}

/// Why a call failed, before it becomes a Python exception (built with the
/// GIL held).
enum Failure {
    Client(ClientError),
    Closed,
    Value(String),
    Os(String),
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::Client(e)
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        match f {
            Failure::Client(ClientError::Timeout(d)) => {
                PyTimeoutError::new_err(format!("no reply from the manager within {d:?}"))
            }
            // `Accepted` carries an error when the manager did not queue
            // the command: its inbox is full (try again), or a quota of
            // the connection, uid or process is reached (a refusal).
            Failure::Client(ClientError::Command(e)) => match e {
                CommandError::Limit {
                    name: LimitName::MaxInbox,
                    ..
                } => QueueFull::new_err(format!("the manager did not queue the command: {e}")),
                e => rejected(&e),
            },
            Failure::Client(e) => ConnectionError::new_err(e.to_string()),
            Failure::Closed => ConnectionError::new_err("the client is closed"),
            Failure::Value(m) => PyValueError::new_err(m),
            Failure::Os(m) => PyRuntimeError::new_err(m),
        }
    }
}

/// `Rejected`: the error's kind, its reason label, the message, and the
/// error as a `rejected` event carries it (a dict).
fn rejected(e: &CommandError) -> PyErr {
    let error = Python::attach(|py| serialize(py, e).map(Bound::unbind).ok());
    Rejected::new_err((e.kind(), e.reason(), e.to_string(), error))
}

fn duration(secs: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, got {secs}"
        ))
    })
}

/// The event's `"event"` name (its serde tag).
fn event_kind(e: &Event) -> Option<String> {
    match serde_json::to_value(e).ok()? {
        serde_json::Value::Object(mut m) => match m.remove("event")? {
            serde_json::Value::String(s) => Some(s),
            _ => None,
        },
        _ => None,
    }
}

impl PyClient {
    /// Locks the state without holding the GIL (another thread may hold the
    /// lock for up to a [`SLICE`] while it waits).
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while locked can only come from a bug in the client; its
        // state is still a valid connection or a closed one.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits (in slices, checking signals between them) for the first
    /// queued or arriving event matching `pred`; `None` at the deadline.
    fn wait_matching(
        &self,
        py: Python<'_>,
        timeout: Duration,
        pred: impl Fn(&Event) -> bool + Send + Sync,
    ) -> PyResult<Option<Event>> {
        let deadline = Instant::now() + timeout;
        loop {
            let found = py.detach(|| -> Result<Option<Event>, Failure> {
                let mut st = self.lock();
                let slice = deadline
                    .saturating_duration_since(Instant::now())
                    .min(SLICE);
                Ok(st.client()?.wait_event(slice, &pred)?)
            })?;
            if found.is_some() || Instant::now() >= deadline {
                return Ok(found);
            }
            py.check_signals()?;
        }
    }

    /// Submits `command` and waits until `deadline` for the first event
    /// `reply(id)` accepts (`id`: the command's id). The common case runs
    /// in one GIL release: the submit, and the reply within the first
    /// slice.
    fn submit_then_wait<P>(
        &self,
        py: Python<'_>,
        command: Command,
        deadline: Instant,
        reply: impl Fn(u64) -> P + Send + Sync,
    ) -> PyResult<(u64, Option<Event>)>
    where
        P: Fn(&Event) -> bool + Send + Sync,
    {
        let (id, found) = py.detach(|| -> Result<(u64, Option<Event>), Failure> {
            let mut st = self.lock();
            let c = st.client()?;
            let id = c.submit(command)?;
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(SLICE);
            Ok((id, c.wait_event(slice, reply(id))?))
        })?;
        if found.is_some() {
            return Ok((id, found));
        }
        py.check_signals()?;
        let left = deadline.saturating_duration_since(Instant::now());
        Ok((id, self.wait_matching(py, left, reply(id))?))
    }

    /// A read-only view of a pool page after checking its bytes against
    /// the lease's checksum.
    fn verified<'py>(&self, py: Python<'py>, lease: LeaseInfo) -> PyResult<Bound<'py, PyAny>> {
        let pool = py.detach(|| -> Result<Arc<Mapping>, Failure> {
            let mut st = self.lock();
            let c = st.client()?;
            // Hashing a large page runs without the GIL.
            match c.page(&lease) {
                Ok(_) => {}
                Err(e @ ClientError::LeaseOutsidePool { .. }) => {
                    return Err(Failure::Value(e.to_string()));
                }
                Err(e) => return Err(e.into()),
            }
            st.pool_mapping()
        })?;
        memoryview(py, pool, lease.offset as usize, lease.bytes as usize, true)
    }

    /// A `Client` over a connection made in Rust (`orbitkv.Session`).
    pub(crate) fn wrap(client: Client, socket: &std::path::Path, name: &str) -> PyClient {
        let incarnation = client.incarnation();
        let pool_bytes = client.pool().map_or(0, |p| p.len() as u64);
        PyClient {
            state: Mutex::new(State {
                client: Some(client),
                pool: None,
                regions: HashMap::new(),
            }),
            agent: Mutex::new(None),
            keep: Mutex::new(HashMap::new()),
            socket: socket.display().to_string(),
            name: name.to_owned(),
            incarnation,
            pool_bytes,
        }
    }

    /// Runs `f` on the connection (call without the GIL); `None` once the
    /// client is closed.
    pub(crate) fn with_client<R>(&self, f: impl FnOnce(&mut Client) -> R) -> Option<R> {
        let mut st = self.lock();
        st.client.as_mut().map(f)
    }

    /// Runs `f` on the connection if its lock is free now (callable with
    /// the GIL: it never waits); `None` when it is taken or closed.
    pub(crate) fn try_with_client<R>(&self, f: impl FnOnce(&mut Client) -> R) -> Option<R> {
        let mut st = self.state.try_lock().ok()?;
        st.client.as_mut().map(f)
    }

    /// Closes the connection without the GIL (see `close`).
    pub(crate) fn close_detached(&self) {
        let client = {
            let mut st = self.lock();
            st.pool = None;
            st.regions.clear();
            st.client.take()
        };
        drop(client);
        // The manager fails the copies it sent; none may still write
        // engine memory once close returns. The agent goes with the
        // connection (the client held the only other reference): its
        // executor waits for its streams and unpins the host window,
        // then the window is unmapped. The memory's owners stay until
        // this object goes.
        let agent = self.agent.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(agent) = agent {
            let mut discard = Vec::new();
            agent.lock().agent.drain(crate::agent::DRAIN, &mut discard);
            drop(agent);
        }
    }

    fn events<'py>(py: Python<'py>, events: &[Event]) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for e in events {
            list.append(serialize(py, e)?)?;
        }
        Ok(list)
    }
}

#[pymethods]
impl PyClient {
    /// Connects to the manager's socket and shakes hands (mapping the
    /// shared pool). `name` shows in the manager's logs.
    #[new]
    #[pyo3(signature = (socket, name="python"))]
    fn new(py: Python<'_>, socket: std::path::PathBuf, name: &str) -> PyResult<Self> {
        let client = py
            .detach(|| Client::connect(&socket, name))
            .map_err(Failure::from)?;
        Ok(PyClient::wrap(client, &socket, name))
    }

    /// The manager's incarnation: changes at every manager start; session
    /// handles of another incarnation are stale.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Bytes of the shared pool (0 if the manager did not share it).
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.pool_bytes
    }

    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().client.is_none())
    }

    /// Queues a command; returns its id once the manager accepted it (the
    /// id its reply events carry as `"command"`).
    fn submit(&self, py: Python<'_>, command: &Bound<'_, PyAny>) -> PyResult<u64> {
        let command: Command = deserialize_dict(command)
            .map_err(|e| PyValueError::new_err(format!("invalid command: {e}")))?;
        py.detach(|| -> Result<u64, Failure> { Ok(self.lock().client()?.submit(command)?) })
            .map_err(PyErr::from)
    }

    /// Submits a command and returns its reply event (a refused command's
    /// reply is a `rejected` event). Other events stay queued.
    #[pyo3(signature = (command, timeout=10.0))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        command: &Bound<'py, PyAny>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = duration(timeout, "timeout")?;
        let command: Command = deserialize_dict(command)
            .map_err(|e| PyValueError::new_err(format!("invalid command: {e}")))?;
        let deadline = Instant::now() + timeout;
        let (id, reply) = self.submit_then_wait(py, command, deadline, |id| {
            move |e: &Event| e.command() == Some(id)
        })?;
        match reply {
            Some(e) => serialize(py, &e),
            None => Err(PyTimeoutError::new_err(format!(
                "no reply to command {id} within {timeout:?}"
            ))),
        }
    }

    /// A lookup, typed: a peek at the boundary the manager would select
    /// for a request whose page hashes (`bytes`, in page order) are
    /// `hashes` in every group of `groups`, past `origin` tokens of a
    /// `prompt_len`-token prompt. It holds nothing, so there is nothing to
    /// release. Returns `(selected, None)`, or `(None, reason)` for a miss
    /// (`MissReason`'s name). A refused lookup raises `Rejected` (`args`:
    /// the error's kind, its reason label, the message). The command is
    /// built here from the bytes (no dict, no hex), and only the answer
    /// comes back; replies to earlier lookups that timed out are dropped.
    #[pyo3(signature = (session, request, groups, hashes, origin, prompt_len, expect_namespaces=None, timeout=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &self,
        py: Python<'_>,
        session: &Bound<'_, PyAny>,
        request: u64,
        groups: Vec<u32>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
        expect_namespaces: Option<&Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<(Option<u64>, Option<&'static str>)> {
        let timeout = duration(timeout, "timeout")?;
        let session: SessionHandle = deserialize_dict(session)
            .map_err(|e| PyValueError::new_err(format!("invalid session: {e}")))?;
        let expect_namespaces: Vec<Namespace> = match expect_namespaces {
            Some(ns) => deserialize(ns)
                .map_err(|e| PyValueError::new_err(format!("invalid namespaces: {e}")))?,
            None => Vec::new(),
        };
        let mut page_hashes = Vec::with_capacity(hashes.len().unwrap_or(0));
        for (i, h) in hashes.try_iter()?.enumerate() {
            let h = h?;
            let bytes = h.cast::<PyBytes>().map_err(|_| {
                PyValueError::new_err(format!("hash {i} is not bytes but {}", h.get_type()))
            })?;
            let hash = NativeHash::new(bytes.as_bytes())
                .map_err(|e| PyValueError::new_err(format!("hash {i}: {e}")))?;
            page_hashes.push(hash);
        }
        let groups = groups
            .into_iter()
            .map(|group| GroupHashes {
                group,
                hashes: page_hashes.clone(),
            })
            .collect();
        let command = Command::Lookup {
            session,
            request,
            groups,
            origin,
            prompt_len,
            expect_namespaces,
        };
        let deadline = Instant::now() + timeout;
        // A lookup's reply, or a late reply of an earlier one (dropped).
        let reply = move |id: u64| move |e: &Event| e.command().is_some_and(|c| c <= id);
        let (id, mut found) = self.submit_then_wait(py, command, deadline, reply)?;
        loop {
            match found {
                Some(e) if e.command() == Some(id) => {
                    return match e {
                        Event::QueryResult { selected, miss, .. } => match miss {
                            Some(m) => Ok((None, Some(m.as_str()))),
                            None => Ok((selected, None)),
                        },
                        Event::Rejected { error, .. } => Err(rejected(&error)),
                        other => Err(PyRuntimeError::new_err(format!(
                            "unexpected reply to a lookup: {other:?}"
                        ))),
                    };
                }
                // A late reply of an earlier lookup: dropped.
                Some(_) => {
                    py.check_signals()?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    found = self.wait_matching(py, left, reply(id))?;
                }
                None => {
                    return Err(PyTimeoutError::new_err(format!(
                        "no reply to lookup {id} within {timeout:?}"
                    )));
                }
            }
        }
    }

    /// The first queued or arriving event matching the filters (`kind`: the
    /// event's `"event"` name; `operation`: its `"operation"`), or `None`
    /// after `timeout` seconds. Other events stay queued.
    #[pyo3(signature = (timeout, kind=None, operation=None))]
    fn wait_event<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
        kind: Option<String>,
        operation: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let timeout = duration(timeout, "timeout")?;
        let pred = move |e: &Event| {
            operation.is_none_or(|op| e.operation() == Some(op))
                && kind
                    .as_deref()
                    .is_none_or(|k| event_kind(e).as_deref() == Some(k))
        };
        self.wait_matching(py, timeout, pred)?
            .map(|e| serialize(py, &e))
            .transpose()
    }

    /// Every queued and arrived event, without blocking.
    fn poll_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = py.detach(|| -> Result<Vec<Event>, Failure> {
            Ok(self.lock().client()?.poll_events()?)
        })?;
        Self::events(py, &events)
    }

    /// How long this client's waits spin before they block, in
    /// microseconds (default 20; 0 blocks at once; at most 10000). Spinning
    /// still turns itself off for a while when it keeps getting preempted
    /// or when many replies outlast it. A blocking wait costs a kernel wake-up on
    /// both sides (about 95 us on a small VM): a thread on an engine's
    /// critical path, such as vLLM's scheduler, may spin longer.
    fn set_spin_us(&self, py: Python<'_>, us: u64) -> PyResult<()> {
        if us > 10_000 {
            return Err(PyValueError::new_err(format!(
                "spin of {us} us: at most 10000"
            )));
        }
        py.detach(|| -> Result<(), Failure> {
            self.lock().client()?.set_spin(Duration::from_micros(us));
            Ok(())
        })
        .map_err(PyErr::from)
    }

    /// Commands this connection sent, by kind (``lookup``, ``load``, ...):
    /// what its users cost the manager, in round trips.
    #[getter]
    fn commands_sent(&self, py: Python<'_>) -> PyResult<HashMap<String, u64>> {
        py.detach(|| -> Result<_, Failure> {
            let mut st = self.lock();
            Ok(st
                .client()?
                .commands_sent()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect())
        })
        .map_err(PyErr::from)
    }

    /// Round trip of an empty frame through the manager's loop, in seconds.
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        let d = py.detach(|| -> Result<Duration, Failure> { Ok(self.lock().client()?.ping()?) })?;
        Ok(d.as_secs_f64())
    }

    /// Benchmark helper: `n` pings timed inside Rust, without Python per
    /// iteration (seconds each); separates the wrapper's cost from the
    /// client's and the manager's.
    fn _ping_many(&self, py: Python<'_>, n: usize) -> PyResult<Vec<f64>> {
        let times = py.detach(|| -> Result<Vec<f64>, Failure> {
            let mut st = self.lock();
            let c = st.client()?;
            (0..n).map(|_| Ok(c.ping()?.as_secs_f64())).collect()
        })?;
        Ok(times)
    }

    /// A leased page's bytes (a lease dict of a `ready` event), read-only
    /// and zero-copy over the shared pool, after checking them against the
    /// checksum the lease carries (bytes that do not match raise
    /// `orbitkv.ConnectionError` naming the lease; they are never returned).
    /// Valid while the lease is held: after `release`/`restore_done` the
    /// slot may hold another page.
    fn page<'py>(&self, py: Python<'py>, lease: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let lease: LeaseInfo = deserialize_dict(lease)
            .map_err(|e| PyValueError::new_err(format!("invalid lease: {e}")))?;
        self.verified(py, lease)
    }

    /// `page` for a page named by where it lies: `offset`, `bytes` and
    /// `checksum` of a `Ready`'s `pool_pages` (`Session.start_lease`).
    fn page_at<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        bytes: u64,
        checksum: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let lease = LeaseInfo {
            lease: 0,
            pos: orbitkv_components::api::PagePos {
                rank: 0,
                group: 0,
                page_end: 0,
            },
            bytes,
            slot: 0,
            offset,
            checksum,
        };
        self.verified(py, lease)
    }

    /// The whole shared pool, read-only and zero-copy (no checksum is
    /// checked: a reader verifies each page against its lease, as `page`
    /// does).
    fn pool<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pool = py.detach(|| self.lock().pool_mapping())?;
        let len = pool.len();
        memoryview(py, pool, 0, len, true)
    }

    /// A device region this client registered (the `region` of its
    /// `region_registered` event), writable and zero-copy: write pages
    /// there before publishing them, read them after restores. Slot `s`
    /// starts at `s * page_bytes`.
    fn region<'py>(&self, py: Python<'py>, region: u64) -> PyResult<Bound<'py, PyAny>> {
        let map = py.detach(|| -> Result<Arc<Mapping>, Failure> {
            let mut st = self.lock();
            if let Some(m) = st.regions.get(&region) {
                return Ok(m.clone());
            }
            let Some(bytes) = st.client()?.region_mut(region) else {
                return Err(Failure::Value(format!(
                    "region {region} is not a device region this client registered \
                     (or its region_registered event has not been received yet)"
                )));
            };
            // SAFETY: the client's live shared mapping of the region.
            let m = unsafe { Mapping::duplicate(bytes.as_ptr(), bytes.len()) }
                .map_err(|e| Failure::Os(format!("mapping region {region}: {e}")))?;
            let m = Arc::new(m);
            st.regions.insert(region, m.clone());
            Ok(m)
        })?;
        let len = map.len();
        memoryview(py, map, 0, len, false)
    }

    /// Attaches engine memory to this connection's copy agent as one region
    /// of `slots` page slots laid out as `chunks` per page (each a
    /// `(data_ptr, stride, length)` run; see `Runtime.attach_agent_memory`).
    /// Returns `(region, page_bytes)` for a `register_device_region`
    /// command's `"agent"`. The manager never maps this memory: its copies
    /// run in this process, off the Python thread, inside this client's
    /// waits (the `agent_copy` events never reach the caller). `owner` is
    /// kept alive until `detach_agent_memory`.
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
        let kind = memory_kind(device).map_err(crate::agent::py_err)?;
        let chunks = chunks_of(kind, chunks);
        let got = py
            .detach(|| -> Result<Result<(u32, u64), AgentSetup>, Failure> {
                self.lock().client()?;
                let agent = {
                    let mut a = self.agent.lock().unwrap_or_else(|p| p.into_inner());
                    match a.as_ref() {
                        Some(agent) => agent.clone(),
                        None => match agent_workers().and_then(|n| SharedAgent::new(kind, n)) {
                            Ok(agent) => a.insert(agent).clone(),
                            Err(e) => return Ok(Err(e)),
                        },
                    }
                };
                if let Err(e) = check_kind(agent.lock().kind, kind) {
                    return Ok(Err(e));
                }
                let mut st = self.lock();
                let client = st.client()?;
                if !client.has_agent() {
                    client.set_agent(Box::new(agent.clone()))?;
                }
                drop(st);
                // SAFETY: the caller promises the memory stays put while
                // attached, and `owner` (kept until detach) keeps it allocated.
                Ok(unsafe {
                    agent
                        .lock()
                        .agent
                        .attach_layered(slots, &chunks, layers.as_deref())
                }
                .map_err(AgentSetup::from))
            })?
            .map_err(crate::agent::py_err)?;
        self.keep
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(got.0, owner);
        Ok(got)
    }

    /// Per layer of an agent region attached with `layers`: `(landed,
    /// failed)` pages restored into it since it was attached (cumulative;
    /// a layer-wise loader compares them with what it submitted). Empty for
    /// a region attached without layers; `ValueError` for an unknown one.
    fn agent_layer_counts(&self, py: Python<'_>, region: u32) -> PyResult<Vec<(u64, u64)>> {
        let counts = py.detach(|| {
            let a = self.agent.lock().unwrap_or_else(|p| p.into_inner());
            let agent = a.as_ref()?;
            let mut st = agent.lock();
            // Completions since the last wait count now; their reports go
            // out with the connection's next wait.
            st.agent.progress();
            st.agent
                .layer_counts(region)
                .map(|c| c.iter().map(|c| (c.landed, c.failed)).collect::<Vec<_>>())
        });
        counts.ok_or_else(|| PyValueError::new_err(format!("no agent region {region}")))
    }

    /// Detaches an agent region (after its session closed) and lets go of
    /// its owner; `False` if there is no such region. Refused while the
    /// agent has copies running.
    fn detach_agent_memory(&self, py: Python<'_>, region: u32) -> PyResult<bool> {
        let found = py.detach(|| -> Result<bool, Failure> {
            let a = self.agent.lock().unwrap_or_else(|p| p.into_inner());
            let Some(agent) = a.as_ref() else {
                return Ok(false);
            };
            let mut st = agent.lock();
            if st.agent.busy() {
                return Err(Failure::Os(
                    "the copy agent has copies running; wait for their operations first".into(),
                ));
            }
            Ok(st.agent.detach(region))
        })?;
        let owner = self
            .keep
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&region);
        drop(owner);
        Ok(found)
    }

    /// Closes the connection (after the copy agent's running copies, if
    /// any, finished): the manager closes this client's sessions
    /// (their leases and reservations return). Views already handed out stay
    /// valid memory. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.close_detached());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "orbitkv.Client(socket={:?}, name={:?}, incarnation={}{})",
            self.socket,
            self.name,
            self.incarnation,
            if self.closed(py) { ", closed" } else { "" }
        )
    }
}

/// The environment variable that sets how many copy threads a
/// connection's copy agent runs for host memory (CUDA memory is copied by
/// the device's copy engine, not by these threads).
const AGENT_WORKERS_ENV: &str = "ORBITKV_AGENT_COPY_WORKERS";

/// Copy threads of a connection's copy agent: [`AGENT_WORKERS_ENV`]
/// (1..=64), else one per CPU, at most 8. A bad value refuses the attach,
/// naming the variable.
fn agent_workers() -> Result<usize, AgentSetup> {
    let Some(v) = std::env::var_os(AGENT_WORKERS_ENV) else {
        return Ok(orbitkv_gpu::host::default_copy_workers());
    };
    v.to_str()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=64).contains(n))
        .ok_or_else(|| {
            AgentSetup::Invalid(format!(
                "{AGENT_WORKERS_ENV}={v:?}: the copy agent's threads, a number in 1..=64"
            ))
        })
}
