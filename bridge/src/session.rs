//! `orbitkv.Session`: the engine side (`orbitkv_engine::Session`) for
//! Python engines. One session lifecycle (connect, register, open, the
//! engine's `on_connect` setup, reconnect at most once per interval), the
//! slot table, and the verbs with typed results: `Lookup`, `Loaded`,
//! `Saved`, `MissReason`; failures as `Refused` (the manager said no, with
//! its reason) or `Unavailable` (it did not answer), never one for the
//! other.
//!
//! Hashes cross as `bytes`; commands are built in Rust, never as dicts.
//! Every verb runs without the GIL. Calls are serialized.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use orbitkv_components::api::{
    AgentRegion, Command, MissReason, PagePos, PublishPage, Rank, RestoreTarget,
};
use orbitkv_components::contract::GroupSpec;
use orbitkv_components::key::NativeHash;
use orbitkv_components::layout::StorageLayout;
use orbitkv_components::namespace::parse_hex32;
use orbitkv_engine::{
    Backoff, EngineError, LoadPlan, Loaded, Lookup, Progress, Query, Session, SessionOptions,
    Ticket,
};
use orbitkv_ipc::Client;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::client::PyClient;
use crate::convert::{deserialize, deserialize_dict, serialize};
use crate::runtime::PyRuntime;
use crate::{QueueFull, Refused, Unavailable};

static MISS_REASON: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `orbitkv.MissReason`: an `enum.Enum` of `str` values (`"not_found"`,
/// ...), made from `MissReason::ALL` so Python and Rust cannot disagree.
pub fn miss_reason_type(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    MISS_REASON
        .get_or_try_init(py, || {
            let members: Vec<(String, &str)> = MissReason::ALL
                .iter()
                .map(|r| (r.as_str().to_uppercase(), r.as_str()))
                .collect();
            let kwargs = PyDict::new(py);
            kwargs.set_item("module", "orbitkv")?;
            kwargs.set_item("type", py.get_type::<pyo3::types::PyString>())?;
            let t = py
                .import("enum")?
                .getattr("Enum")?
                .call(("MissReason", members), Some(&kwargs))?;
            // `str()` is the value ("not_found"), as metrics labels use it.
            let str_fn = py.eval(c"lambda self: self.value", None, None)?;
            t.setattr("__str__", str_fn)?;
            t.setattr(
                "__doc__",
                "Why a lookup or load missed (`orbitkv_components::api::MissReason`); \
                 the value is the name metrics and logs use.",
            )?;
            Ok(t.unbind())
        })
        .map(|t| t.bind(py))
}

/// The members of `orbitkv.MissReason`, in `MissReason::ALL`'s order:
/// calling the enum class for each miss runs `enum`'s Python lookup.
static MISS_MEMBERS: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();

fn miss<'py>(py: Python<'py>, r: MissReason) -> PyResult<Bound<'py, PyAny>> {
    let members = MISS_MEMBERS.get_or_try_init(py, || {
        let t = miss_reason_type(py)?;
        MissReason::ALL
            .iter()
            .map(|m| t.call1((m.as_str(),)).map(Bound::unbind))
            .collect::<PyResult<Vec<_>>>()
    })?;
    match MissReason::ALL
        .iter()
        .position(|m| *m == r)
        .and_then(|i| members.get(i))
    {
        Some(m) => Ok(m.bind(py).clone()),
        None => miss_reason_type(py)?.call1((r.as_str(),)),
    }
}

/// A Python exception for an engine error.
fn py_err(py: Python<'_>, e: EngineError) -> PyErr {
    match e {
        EngineError::Refused {
            command,
            reason,
            error,
        } => {
            let message = format!("the OrbitKV manager refused {command} ({reason}): {error}");
            let dict = serialize(py, &error).map(Bound::unbind).ok();
            let err = Refused::new_err((error.kind(), reason, message, dict));
            let _ = err.value(py).setattr("command", command);
            err
        }
        EngineError::Unavailable(m) => Unavailable::new_err(m),
        EngineError::TimedOut { command, timeout } => pyo3::exceptions::PyTimeoutError::new_err(
            format!("no answer to {command} within {timeout:?}"),
        ),
        EngineError::Busy { command } => QueueFull::new_err(format!(
            "the manager's inbox is full: {command} was not queued"
        )),
        EngineError::Invalid(m) => PyValueError::new_err(m),
    }
}

fn hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<NativeHash>> {
    let not_bytes = |i: usize, h: &Bound<'_, PyAny>| {
        PyValueError::new_err(format!("hash {i} is not bytes but {}", h.get_type()))
    };
    let one = |i: usize, bytes: &[u8]| {
        NativeHash::new(bytes).map_err(|e| PyValueError::new_err(format!("hash {i}: {e}")))
    };
    // A list (what adapters pass): borrowed items and one C call for each
    // hash's bytes, into a vector sized once. Through pyo3's owned items,
    // cast and `as_bytes` this was about 240 instructions a hash, which a
    // scheduler's 32-page lookup pays on its critical path.
    if let Ok(list) = obj.cast::<PyList>() {
        let n = list.len();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the GIL is held and nothing in this loop runs Python
            // code, so the list keeps its items; `i < n` is in range, and
            // the borrowed item lives as long as the list holds it.
            let item =
                unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
            let mut ptr: *mut std::ffi::c_char = std::ptr::null_mut();
            let mut len: pyo3::ffi::Py_ssize_t = 0;
            // SAFETY: `item` is a valid borrowed object (or null, which
            // the call reports as an error); the out-pointers are ours.
            let rc = unsafe { pyo3::ffi::PyBytes_AsStringAndSize(item, &mut ptr, &mut len) };
            if item.is_null() || rc != 0 || ptr.is_null() || len < 0 {
                // Its own TypeError is replaced by ours, naming the index.
                drop(PyErr::take(list.py()));
                return Err(not_bytes(i, &list.get_item(i)?));
            }
            // SAFETY: a bytes object's buffer of `len` bytes, immutable
            // and alive while the list holds it (as above).
            let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len as usize) };
            out.push(one(i, bytes)?);
        }
        return Ok(out);
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, h) in obj.try_iter()?.enumerate() {
        let h = h?;
        let bytes = h.cast::<PyBytes>().map_err(|_| not_bytes(i, &h))?;
        out.push(one(i, bytes.as_bytes())?);
    }
    Ok(out)
}

/// A lookup's group ids: a list of a few ints, read item by item (pyo3's
/// generic sequence extraction was 600 instructions of every lookup);
/// any other sequence as pyo3 extracts it.
/// Item `i` of a sequence of page hashes, as a native hash
/// (`ValueError` naming it when it is not `bytes` of a hash's length).
fn hash_item(hashes: &Bound<'_, PyAny>, i: usize) -> PyResult<NativeHash> {
    let h = hashes.get_item(i)?;
    let b = h.cast::<PyBytes>().map_err(|_| {
        PyValueError::new_err(format!("hash {i} is not bytes but {}", h.get_type()))
    })?;
    NativeHash::new(b.as_bytes()).map_err(|e| PyValueError::new_err(format!("hash {i}: {e}")))
}

fn group_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    match obj.cast::<PyList>() {
        Ok(list) => list.iter().map(|g| g.extract::<u32>()).collect(),
        Err(_) => obj.extract(),
    }
}

fn query(groups: Vec<u32>, h: &Bound<'_, PyAny>, origin: u64, prompt_len: u64) -> PyResult<Query> {
    Ok(Query {
        groups,
        hashes: hashes(h)?,
        origin,
        prompt_len,
    })
}

/// What a lookup found: `selected` (tokens a load would restore to) or
/// `miss` (a `MissReason`). Nothing is held.
#[pyclass(module = "orbitkv", name = "Lookup", frozen, get_all)]
pub struct PyLookup {
    selected: Option<u64>,
    miss: Option<Py<PyAny>>,
    /// `(rank, group, page_ends)` the manager holds for each group.
    candidates: Vec<(u32, u32, Vec<u64>)>,
    /// Boundaries every group could resume at.
    common: Vec<u64>,
    /// `str(miss)`, without the enum's Python `__str__`.
    reason: Option<&'static str>,
    /// Answered in this process from the manager's presence filter (a
    /// certain miss), without a round trip.
    local: bool,
}

#[pymethods]
impl PyLookup {
    /// Whether a load would restore something.
    #[getter]
    fn hit(&self) -> bool {
        self.selected.is_some_and(|s| s > 0) && self.miss.is_none()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match &self.miss {
            Some(m) => format!("Lookup(miss={})", m.bind(py)),
            None => format!("Lookup(selected={:?})", self.selected),
        }
    }
}

fn py_lookup(py: Python<'_>, l: Lookup) -> PyResult<PyLookup> {
    Ok(PyLookup {
        selected: l.selected,
        reason: l.miss.map(|m| m.as_str()),
        local: l.local,
        miss: l.miss.map(|m| miss(py, m).map(Bound::unbind)).transpose()?,
        candidates: l
            .candidates
            .into_iter()
            .map(|c| (c.rank, c.group, c.page_ends))
            .collect(),
        common: l.common,
    })
}

/// What a load of a prompt would restore on this host now (a router's
/// question): `tokens`, `by_tier` (tokens per tier a page position would
/// be read from: `dram`, `ssd`, `remote`), or `miss` (a `MissReason`).
/// Nothing is held: an eviction before the load can still make it less.
#[pyclass(module = "orbitkv", name = "Located", frozen, get_all)]
pub struct PyLocated {
    tokens: u64,
    by_tier: std::collections::BTreeMap<String, u64>,
    miss: Option<Py<PyAny>>,
}

#[pymethods]
impl PyLocated {
    fn __repr__(&self, py: Python<'_>) -> String {
        match &self.miss {
            Some(m) => format!("Located(miss={})", m.bind(py)),
            None => format!(
                "Located(tokens={}, by_tier={:?})",
                self.tokens, self.by_tier
            ),
        }
    }
}

fn py_located(py: Python<'_>, r: orbitkv_components::admin::Restorable) -> PyResult<PyLocated> {
    Ok(PyLocated {
        tokens: r.tokens,
        by_tier: r.by_tier,
        miss: r.miss.map(|m| miss(py, m).map(Bound::unbind)).transpose()?,
    })
}

/// A load's outcome: `hit` with the `boundary` restored to (every page
/// named for it landed and was verified), or `miss` (a `MissReason`).
#[pyclass(module = "orbitkv", name = "Loaded", frozen, get_all)]
pub struct PyLoaded {
    boundary: u64,
    miss: Option<Py<PyAny>>,
    /// `(rank, group, page_end)` of every page leased for the boundary
    /// (the engine's `retained` pages included).
    leased: Vec<(u32, u32, u64)>,
    /// `(rank, group, start, end)`: what each group needed.
    ranges: Vec<(u32, u32, u64, u64)>,
    /// Pages and bytes copied into device pages.
    pages: u64,
    bytes: u64,
    /// Pages read from a lower tier (SSD, remote) rather than DRAM.
    pages_from_tiers: u64,
}

#[pymethods]
impl PyLoaded {
    #[getter]
    fn hit(&self) -> bool {
        self.miss.is_none()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match &self.miss {
            Some(m) => format!("Loaded(miss={})", m.bind(py)),
            None => format!("Loaded(boundary={}, pages={})", self.boundary, self.pages),
        }
    }
}

fn py_loaded(py: Python<'_>, l: Loaded) -> PyResult<PyLoaded> {
    Ok(match l {
        Loaded::Hit {
            boundary,
            ranges,
            leases,
            pages,
            bytes,
            pages_from_tiers,
        } => PyLoaded {
            boundary,
            miss: None,
            leased: leases
                .iter()
                .map(|l| (l.pos.rank, l.pos.group, l.pos.page_end))
                .collect(),
            ranges: ranges
                .iter()
                .map(|(rank, r)| (*rank, r.group, r.start, r.end))
                .collect(),
            pages,
            bytes,
            pages_from_tiers,
        },
        Loaded::Miss(r) => PyLoaded {
            boundary: 0,
            miss: Some(miss(py, r)?.unbind()),
            leased: vec![],
            ranges: vec![],
            pages: 0,
            bytes: 0,
            pages_from_tiers: 0,
        },
    })
}

/// A save's outcome: pages stored now, already stored, dropped.
#[pyclass(module = "orbitkv", name = "Saved", frozen, get_all)]
pub struct PySaved {
    inserted: u64,
    duplicates: u64,
    dropped: u64,
}

#[pymethods]
impl PySaved {
    /// Pages the manager holds after the save.
    #[getter]
    fn stored(&self) -> u64 {
        self.inserted + self.duplicates
    }

    fn __repr__(&self) -> String {
        format!(
            "Saved(inserted={}, duplicates={}, dropped={})",
            self.inserted, self.duplicates, self.dropped
        )
    }
}

/// A started load's pages are leased and being copied (from
/// `Session.poll`).
#[pyclass(module = "orbitkv", name = "Ready", frozen, get_all)]
pub struct PyReady {
    boundary: u64,
    /// `(rank, group, page_end)` of every page leased for the boundary.
    leased: Vec<(u32, u32, u64)>,
    /// `(rank, group, page_end, offset, bytes, checksum)`: where each
    /// leased page lies in the manager's pool (`client.pool()`), and its
    /// XXH3-64, for an engine that reads them itself (`start_lease`).
    pool_pages: Vec<(u32, u32, u64, u64, u64, u64)>,
}

#[pymethods]
impl PyReady {
    fn __repr__(&self) -> String {
        format!(
            "Ready(boundary={}, pages={})",
            self.boundary,
            self.leased.len()
        )
    }
}

fn plan(
    ranks: Vec<u32>,
    targets: Vec<(u32, u32, u64, u64)>,
    retained: Vec<(u32, u32, u64)>,
    handoff: Option<u64>,
) -> LoadPlan {
    LoadPlan {
        ranks,
        targets: targets
            .into_iter()
            .map(|(rank, group, page_end, device_page)| RestoreTarget {
                pos: PagePos {
                    rank,
                    group,
                    page_end,
                },
                device_page,
            })
            .collect(),
        retained: retained
            .into_iter()
            .map(|(rank, group, page_end)| PagePos {
                rank,
                group,
                page_end,
            })
            .collect(),
        handoff,
    }
}

fn publish_pages(pages: &[(u32, u32, Bound<'_, PyBytes>, u64)]) -> PyResult<Vec<PublishPage>> {
    pages
        .iter()
        .enumerate()
        .map(|(i, (rank, group, hash, device_page))| {
            Ok(PublishPage {
                rank: *rank,
                group: *group,
                hash: NativeHash::new(hash.as_bytes())
                    .map_err(|e| PyValueError::new_err(format!("hash {i}: {e}")))?,
                device_page: *device_page,
            })
        })
        .collect()
}

fn py_progress(py: Python<'_>, p: Progress) -> PyResult<(Ticket, Py<PyAny>)> {
    Ok(match p {
        Progress::Ready {
            ticket,
            boundary,
            leases,
            ..
        } => (
            ticket,
            Py::new(
                py,
                PyReady {
                    boundary,
                    leased: leases
                        .iter()
                        .map(|l| (l.pos.rank, l.pos.group, l.pos.page_end))
                        .collect(),
                    pool_pages: leases
                        .iter()
                        .map(|l| {
                            (
                                l.pos.rank,
                                l.pos.group,
                                l.pos.page_end,
                                l.offset,
                                l.bytes,
                                l.checksum,
                            )
                        })
                        .collect(),
                },
            )?
            .into_any(),
        ),
        Progress::Loaded { ticket, outcome } => {
            (ticket, Py::new(py, py_loaded(py, outcome)?)?.into_any())
        }
        Progress::Saved { ticket, outcome } => {
            (ticket, Py::new(py, PySaved::from(outcome))?.into_any())
        }
        Progress::Refused { ticket, error } => {
            (ticket, py_err(py, error).into_value(py).into_any())
        }
    })
}

/// What a session talks through.
enum Backend {
    Client(Py<PyClient>),
    Runtime(Py<PyRuntime>),
}

impl Backend {
    fn clone_ref(&self, py: Python<'_>) -> Backend {
        match self {
            Backend::Client(c) => Backend::Client(c.clone_ref(py)),
            Backend::Runtime(r) => Backend::Runtime(r.clone_ref(py)),
        }
    }

    fn object(&self, py: Python<'_>) -> Py<PyAny> {
        match self {
            Backend::Client(c) => c.clone_ref(py).into_any(),
            Backend::Runtime(r) => r.clone_ref(py).into_any(),
        }
    }

    /// Runs `f` on the port (call without the GIL).
    fn with_port<R>(
        &self,
        f: impl FnOnce(&mut dyn orbitkv_engine::Port) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        match self {
            Backend::Client(c) => c
                .get()
                .with_client(|c| f(c))
                .unwrap_or_else(|| Err(EngineError::Unavailable("the client is closed".into()))),
            Backend::Runtime(r) => r
                .get()
                .with_port(f)
                .unwrap_or_else(|why| Err(EngineError::Unavailable(why))),
        }
    }
}

/// Where a session's connection comes from.
enum Source {
    /// Its own connection to the manager at this socket (reconnected
    /// after a failure, closed with the session).
    Socket(PathBuf),
    /// The caller's connection (shared with other sessions; never closed
    /// here).
    Client(Py<PyClient>),
    /// An embedded runtime this process ticks.
    Runtime(Py<PyRuntime>),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Socket(p) => format!("the OrbitKV manager at {}", p.display()),
            Source::Client(_) => "the OrbitKV manager (the caller's connection)".into(),
            Source::Runtime(_) => "the embedded OrbitKV runtime".into(),
        }
    }
}

impl From<orbitkv_engine::Saved> for PySaved {
    fn from(s: orbitkv_engine::Saved) -> Self {
        PySaved {
            inserted: s.inserted,
            duplicates: s.duplicates,
            dropped: s.dropped,
        }
    }
}

struct Inner {
    client: Option<Backend>,
    session: Option<Session>,
    backoff: Backoff,
    /// The last failure, raised again while the backoff waits: a
    /// refusal's arguments (plain data, so no traceback keeps the caller's
    /// frames alive), or why the manager was unavailable.
    last: Option<Last>,
    last_error: Option<String>,
    generation: u64,
    connecting: bool,
}

enum Last {
    Refused {
        args: Py<PyAny>,
        command: Option<Py<PyAny>>,
    },
    Unavailable(String),
}

impl Last {
    fn of(py: Python<'_>, e: &PyErr) -> Last {
        let v = e.value(py);
        if v.is_instance_of::<Refused>()
            && let Ok(args) = v.getattr("args")
        {
            return Last::Refused {
                args: args.unbind(),
                command: v.getattr("command").ok().map(Bound::unbind),
            };
        }
        Last::Unavailable(e.to_string())
    }

    fn raise(&self, py: Python<'_>) -> PyErr {
        match self {
            Last::Refused { args, command } => {
                let err = PyErr::from_type(py.get_type::<Refused>(), args.clone_ref(py));
                if let Some(c) = command {
                    let _ = err.value(py).setattr("command", c.bind(py));
                }
                err
            }
            Last::Unavailable(m) => Unavailable::new_err(m.clone()),
        }
    }
}

/// One engine process's session with a manager.
#[pyclass(module = "orbitkv", name = "Session", frozen)]
pub struct PySession {
    source: Source,
    name: String,
    register: Command,
    options: SessionOptions,
    spin_us: Option<u64>,
    /// Behind a lock so the garbage collector can clear it: the engine's
    /// callback usually refers back to what holds this session.
    on_connect: Mutex<Option<Py<PyAny>>>,
    inner: Mutex<Inner>,
}

impl PySession {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection, connecting first if needed.
    fn ensure(slf: &Bound<'_, Self>) -> PyResult<Backend> {
        let py = slf.py();
        let me = slf.get();
        // The usual case keeps the GIL: a `try_lock` never waits, so it
        // cannot deadlock against a thread that holds the lock and wants
        // the GIL, and each release of the GIL is a chance for another
        // Python thread to take it for a switch interval.
        if let Ok(inner) = me.inner.try_lock()
            && let (Some(c), Some(_)) = (&inner.client, &inner.session)
        {
            return Ok(c.clone_ref(py));
        }
        enum Step {
            Up(Backend),
            Wait(Option<PyErr>, Option<String>),
            Connect,
        }
        let step = py.detach(|| {
            let mut inner = me.lock();
            if let (Some(c), Some(_)) = (&inner.client, &inner.session) {
                return Step::Up(Python::attach(|py| c.clone_ref(py)));
            }
            if inner.connecting || !inner.backoff.attempt(Instant::now()) {
                let last = Python::attach(|py| inner.last.as_ref().map(|l| l.raise(py)));
                return Step::Wait(last, inner.last_error.clone());
            }
            inner.connecting = true;
            Step::Connect
        });
        match step {
            Step::Up(c) => return Ok(c),
            Step::Wait(Some(e), _) => return Err(e),
            Step::Wait(None, why) => {
                return Err(Unavailable::new_err(format!(
                    "{} is unavailable{}",
                    me.source.describe(),
                    why.map(|w| format!(": {w}")).unwrap_or_default()
                )));
            }
            Step::Connect => {}
        }
        let r = me.connect_now(slf);
        py.detach(|| {
            let mut inner = me.lock();
            inner.connecting = false;
            match &r {
                Ok(_) => {
                    inner.backoff.succeeded();
                    inner.last = None;
                    inner.last_error = None;
                }
                Err(e) => {
                    inner.backoff.failed();
                    Python::attach(|py| {
                        inner.last_error = Some(e.to_string());
                        inner.last = Some(Last::of(py, e));
                    });
                }
            }
        });
        r
    }

    fn connect_now(&self, slf: &Bound<'_, Self>) -> PyResult<Backend> {
        let py = slf.py();
        let open = |port: &mut dyn orbitkv_engine::Port| {
            Session::open(port, self.register.clone(), self.options.clone())
        };
        let (backend, session) = match &self.source {
            Source::Socket(socket) => {
                let opened = py.detach(|| -> Result<(Client, Session), EngineError> {
                    let mut c = Client::connect(socket, &self.name).map_err(|e| {
                        EngineError::Unavailable(format!("connect to {}: {e}", socket.display()))
                    })?;
                    if let Some(us) = self.spin_us {
                        c.set_spin(Duration::from_micros(us));
                    }
                    let s = open(&mut c)?;
                    Ok((c, s))
                });
                let (client, session) = opened.map_err(|e| py_err(py, e))?;
                let client = Py::new(py, PyClient::wrap(client, socket, &self.name))?;
                (Backend::Client(client), session)
            }
            Source::Client(c) => {
                let b = Backend::Client(c.clone_ref(py));
                let session = py.detach(|| b.with_port(open)).map_err(|e| py_err(py, e))?;
                (b, session)
            }
            Source::Runtime(r) => {
                let b = Backend::Runtime(r.clone_ref(py));
                let session = py.detach(|| b.with_port(open)).map_err(|e| py_err(py, e))?;
                (b, session)
            }
        };
        let handle = backend.clone_ref(py);
        py.detach(|| {
            let mut inner = self.lock();
            inner.client = Some(handle);
            inner.session = Some(session);
            inner.generation += 1;
        });
        let f = self
            .on_connect
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|f| f.clone_ref(py));
        if let Some(f) = f
            && let Err(e) = f.call1(py, (slf,))
        {
            self.drop_connection(py);
            return Err(e);
        }
        Ok(backend)
    }

    /// Forgets the session; its own connection is closed (the manager then
    /// closes the session; the copy agent drains first). A caller's
    /// connection or runtime is left to the caller.
    fn drop_connection(&self, py: Python<'_>) {
        py.detach(|| {
            let backend = {
                let mut inner = self.lock();
                inner.session = None;
                inner.client.take()
            };
            if let (Source::Socket(_), Some(Backend::Client(c))) = (&self.source, &backend) {
                c.get().close_detached();
            }
            Python::attach(|_py| drop(backend));
        });
    }

    /// The miss the presence filter answers `q` with, if it does.
    fn filter_miss(slf: &Bound<'_, Self>, q: &Query) -> Option<Lookup> {
        Self::filter_miss_by(slf, &q.groups, q.origin, &|i| Ok(q.hashes.get(i).copied()))
            .ok()
            .flatten()
    }

    /// The miss the presence filter answers a lookup of `groups` from
    /// `origin` with, if it does; `hash(i)` gives the one hash it reads
    /// (`None`: not there). Looked at with the GIL held; it never waits for
    /// a lock: when one is taken the lookup goes the full way (which
    /// checks the filter again).
    fn filter_miss_by(
        slf: &Bound<'_, Self>,
        groups: &[u32],
        origin: u64,
        hash: &dyn Fn(usize) -> PyResult<Option<NativeHash>>,
    ) -> PyResult<Option<Lookup>> {
        Self::with_filter(slf, None, |session, client| {
            let Some(first) = session
                .filter_index(client, origin)
                .map(hash)
                .transpose()?
                .flatten()
            else {
                return Ok(None);
            };
            Ok(session
                .answer_from_filter(client, groups, &first)
                .then(|| session.local_miss()))
        })
    }

    /// `f` on the session and its hot-path client, to read the presence
    /// filter; `otherwise` when either is taken or absent (never waits:
    /// the caller then goes the full way, which checks the filter again).
    fn with_filter<R>(
        slf: &Bound<'_, Self>,
        otherwise: R,
        f: impl FnOnce(&mut Session, &mut Client) -> PyResult<R>,
    ) -> PyResult<R> {
        let Ok(mut inner) = slf.get().inner.try_lock() else {
            return Ok(otherwise);
        };
        let Inner {
            client: Some(Backend::Client(c)),
            session: Some(session),
            ..
        } = &mut *inner
        else {
            return Ok(otherwise);
        };
        match c.get().try_with_client(|client| f(session, client)) {
            Some(r) => r,
            None => Ok(otherwise),
        }
    }

    /// Runs a verb on the session; a failure that makes the connection
    /// untrustworthy drops it (the next call reconnects).
    fn run<R: Send>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&mut Session, &mut dyn orbitkv_engine::Port) -> Result<R, EngineError> + Send,
    ) -> PyResult<R> {
        let py = slf.py();
        let me = slf.get();
        let backend = Self::ensure(slf)?;
        let r = py.detach(|| {
            let mut inner = me.lock();
            let Some(session) = inner.session.as_mut() else {
                return Err(EngineError::Unavailable("the session was dropped".into()));
            };
            backend.with_port(|p| f(session, p))
        });
        match r {
            Ok(v) => Ok(v),
            Err(e) => {
                if e.is_unavailable() {
                    let why = e.to_string();
                    me.drop_connection(py);
                    py.detach(|| me.lock().last_error = Some(why));
                }
                Err(py_err(py, e))
            }
        }
    }
}

/// An engine instance as the manager registers it: its name, its identity,
/// where its pages live on each rank (`layout`), its page size in tokens,
/// its attention groups and its ranks. Checked when made, each part against
/// the contract's types, so a bad description stops the engine where it is
/// built, naming the part.
#[pyclass(name = "Instance", module = "orbitkv", frozen)]
#[derive(PartialEq)]
pub struct PyInstance {
    name: String,
    identity: [u8; 32],
    layout: StorageLayout,
    page_tokens: u64,
    groups: Vec<GroupSpec>,
    ranks: Vec<Rank>,
}

impl PyInstance {
    /// The `register_instance` command that registers it.
    fn register(&self) -> Command {
        Command::RegisterInstance {
            instance: self.name.clone(),
            identity: self.identity,
            layout: self.layout.clone(),
            page_tokens: self.page_tokens,
            groups: self.groups.clone(),
            ranks: self.ranks.clone(),
        }
    }
}

#[pymethods]
impl PyInstance {
    /// :raises ValueError: a part does not describe what the contract
    ///     expects (the message names the part), or the identity is not 64
    ///     lowercase hex digits.
    #[new]
    #[pyo3(signature = (*, name, identity, layout, page_tokens, groups, ranks))]
    fn new(
        name: String,
        identity: &str,
        layout: &Bound<'_, PyAny>,
        page_tokens: u64,
        groups: &Bound<'_, PyAny>,
        ranks: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let bad = |part: &str, e: String| {
            PyValueError::new_err(format!("instance {name:?}: {part}: {e}"))
        };
        if name.is_empty() {
            return Err(bad("name", "empty".into()));
        }
        let identity = parse_hex32(identity).ok_or_else(|| {
            bad(
                "identity",
                format!("{identity:?} is not 64 lowercase hex digits"),
            )
        })?;
        if page_tokens == 0 {
            return Err(bad("page_tokens", "must be > 0".into()));
        }
        let layout: StorageLayout = deserialize_dict(layout).map_err(|e| bad("layout", e))?;
        let groups: Vec<GroupSpec> = deserialize(groups).map_err(|e| bad("groups", e))?;
        let ranks: Vec<Rank> = deserialize(ranks).map_err(|e| bad("ranks", e))?;
        if groups.is_empty() {
            return Err(bad("groups", "none given".into()));
        }
        if ranks.is_empty() {
            return Err(bad("ranks", "none given".into()));
        }
        Ok(PyInstance {
            name,
            identity,
            layout,
            page_tokens,
            groups,
            ranks,
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The identity, as 64 lowercase hex digits.
    #[getter]
    fn identity(&self) -> String {
        hex::encode(self.identity)
    }

    #[getter]
    fn page_tokens(&self) -> u64 {
        self.page_tokens
    }

    /// The layout, as plain Python data (a new copy each time).
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        serialize(py, &self.layout)
    }

    /// The groups, as plain Python data (a new copy each time).
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        serialize(py, &self.groups)
    }

    /// The ranks, as plain Python data (a new copy each time).
    #[getter]
    fn ranks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        serialize(py, &self.ranks)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyInstance>().is_ok_and(|o| o.get() == self)
    }

    fn __repr__(&self) -> String {
        format!(
            "Instance(name={:?}, identity={}…, page_tokens={}, groups={}, ranks={})",
            self.name,
            hex::encode(&self.identity[..8]),
            self.page_tokens,
            self.groups.len(),
            self.ranks.len()
        )
    }
}

#[pymethods]
impl PySession {
    /// A session of `instance` (an `Instance`) on `backend`: a manager's socket path (the session's own
    /// connection, reconnected after a failure), a `Client` (the caller's
    /// connection, shared, never closed here) or a wall-clock `Runtime`
    /// (embedded; waits tick it). Nothing connects until `connect()` or the
    /// first verb. `on_connect(session)` runs after every (re)connection, before
    /// any verb uses it: the engine attaches its memory and registers its
    /// regions there. After a failure, connecting is tried again at most
    /// once per `reconnect_interval` seconds; calls in between raise the
    /// failure again.
    #[new]
    #[pyo3(signature = (backend, instance, *, name="python", timeout=10.0, reconnect_interval=1.0, spin_us=None, on_connect=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        backend: &Bound<'_, PyAny>,
        instance: &Bound<'_, PyAny>,
        name: &str,
        timeout: f64,
        reconnect_interval: f64,
        spin_us: Option<u64>,
        on_connect: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let register = instance
            .cast::<PyInstance>()
            .map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "instance must be an orbitkv.Instance, not {}",
                    instance.get_type()
                ))
            })?
            .get()
            .register();
        let secs = |v: f64, what: &str| {
            Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    PyValueError::new_err(format!("{what} must be > 0 seconds, got {v}"))
                })
        };
        if spin_us.is_some_and(|us| us > 10_000) {
            return Err(PyValueError::new_err("spin_us: at most 10000"));
        }
        let source = if let Ok(r) = backend.cast::<PyRuntime>() {
            if r.get().is_simulated() {
                return Err(PyValueError::new_err(
                    "a session needs a wall-clock Runtime (simulated_clock=False): its waits \
                     tick the runtime, and a simulated clock moves only by advance_clock",
                ));
            }
            Source::Runtime(r.clone().unbind())
        } else if let Ok(c) = backend.cast::<PyClient>() {
            Source::Client(c.clone().unbind())
        } else {
            Source::Socket(backend.extract::<PathBuf>().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "backend must be a socket path, an orbitkv.Client or an orbitkv.Runtime, \
                     not {}",
                    backend.get_type()
                ))
            })?)
        };
        Ok(PySession {
            source,
            name: name.to_owned(),
            register,
            options: SessionOptions {
                timeout: secs(timeout, "timeout")?,
            },
            spin_us,
            on_connect: Mutex::new(on_connect),
            inner: Mutex::new(Inner {
                client: None,
                session: None,
                backoff: Backoff::new(secs(reconnect_interval, "reconnect_interval")?),
                last: None,
                last_error: None,
                generation: 0,
                connecting: false,
            }),
        })
    }

    /// Connects now if not connected (raises as a verb would).
    fn connect(slf: &Bound<'_, Self>) -> PyResult<()> {
        Self::ensure(slf).map(drop)
    }

    /// Whether a session is open.
    #[getter]
    fn up(&self, py: Python<'_>) -> bool {
        // Without giving up the GIL when nobody holds the lock (`ensure`).
        if let Ok(inner) = self.inner.try_lock() {
            return inner.session.is_some();
        }
        py.detach(|| self.lock().session.is_some())
    }

    /// Sessions opened so far: handles of an older generation are dead.
    #[getter]
    fn generation(&self, py: Python<'_>) -> u64 {
        if let Ok(inner) = self.inner.try_lock() {
            return inner.generation;
        }
        py.detach(|| self.lock().generation)
    }

    /// Failed connection attempts since the last success.
    #[getter]
    fn failures(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.lock().backoff.failures)
    }

    /// Why the last attempt or verb failed, if it did.
    #[getter]
    fn last_error(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| self.lock().last_error.clone())
    }

    /// The connection (for memory views and the copy agent:
    /// `attach_agent_memory`, `region`, `page`), connecting first if
    /// needed: a `Client`, or the embedded `Runtime`.
    ///
    /// :raises Unavailable: the manager does not answer.
    /// :raises Refused: the manager refused the session.
    #[getter]
    fn client(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(Self::ensure(slf)?.object(slf.py()))
    }

    /// A writable, zero-copy view of a device region this session
    /// registered (slot `s` at `s * page_bytes`), whatever the backend.
    fn region_view<'py>(slf: &Bound<'py, Self>, region: u64) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let backend = Self::ensure(slf)?;
        let me = slf.get();
        let engine_region = py.detach(|| {
            me.lock()
                .session
                .as_ref()
                .and_then(|s| s.region(region).map(|r| r.engine_region))
        });
        let Some(engine_region) = engine_region else {
            return Err(PyValueError::new_err(format!(
                "region {region} is not one this session registered"
            )));
        };
        match backend {
            Backend::Client(c) => c.bind(py).call_method1("region", (region,)),
            Backend::Runtime(r) => r.bind(py).call_method1("device_view", (engine_region,)),
        }
    }

    /// The session handle (`{"id", "epoch", "incarnation"}`).
    #[getter]
    fn handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = py.detach(|| self.lock().session.as_ref().map(|s| s.handle()));
        let h = h.ok_or_else(|| Unavailable::new_err("the session is not connected"))?;
        serialize(py, &h)
    }

    /// The namespaces the manager sealed for the instance (hex).
    #[getter]
    fn namespaces(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let ns = py.detach(|| {
            self.lock()
                .session
                .as_ref()
                .map(|s| s.namespaces().iter().map(|n| n.to_string()).collect())
        });
        ns.ok_or_else(|| Unavailable::new_err("the session is not connected"))
    }

    /// Device pages held in the slot table.
    #[getter]
    fn device_pages_held(&self, py: Python<'_>) -> usize {
        py.detach(|| {
            self.lock()
                .session
                .as_ref()
                .map_or(0, Session::device_page_count)
        })
    }

    /// Registers a device region of `slots` slots for one rank's group;
    /// `agent` is the `(region, page_bytes)` `client.attach_agent_memory`
    /// returned. Returns the region handle. Call from `on_connect`.
    #[pyo3(signature = (rank, group, slots, agent=None))]
    fn register_region(
        slf: &Bound<'_, Self>,
        rank: u32,
        group: u32,
        slots: u32,
        agent: Option<(u32, u64)>,
    ) -> PyResult<u64> {
        let agent = agent.map(|(region, page_bytes)| AgentRegion { region, page_bytes });
        Self::run(slf, |s, c| {
            s.register_region(c, rank, group, slots, agent)
                .map(|r| r.region)
        })
    }

    /// The device pages of `slots` of `region`: allocated once per slot
    /// (missing ones in one round trip), kept while the session lives.
    fn device_pages(slf: &Bound<'_, Self>, region: u64, slots: Vec<u32>) -> PyResult<Vec<u64>> {
        Self::run(slf, |s, c| s.device_pages(c, region, &slots))
    }

    /// The miss `lookup` would answer from the manager's presence filter
    /// without a round trip (a `Lookup` with ``local`` set), or ``None``
    /// when only the manager can answer. Never waits; reads only the hash
    /// the filter checks (``ValueError`` if it is not a hash).
    fn lookup_local(
        slf: &Bound<'_, Self>,
        groups: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
    ) -> PyResult<Option<PyLookup>> {
        let groups = group_ids(groups)?;
        // Only the hash the filter reads is converted (a long prompt's
        // others are read by the lookup that follows, if one does).
        let hash = |i: usize| -> PyResult<Option<NativeHash>> {
            if i >= hashes.len()? {
                return Ok(None);
            }
            hash_item(hashes, i).map(Some)
        };
        Self::filter_miss_by(slf, &groups, origin, &hash)?
            .map(|l| py_lookup(slf.py(), l))
            .transpose()
    }

    /// How many of `hashes` a lookup from `origin` needs to send: the
    /// index of a page the presence filter proves is in no tier (the
    /// answer cannot resume past it, so a lookup of ``hashes[:n]`` selects
    /// the same boundary, or misses for the same reason), else
    /// ``len(hashes)``. Probes at most ``log2(len(hashes))`` hashes, never
    /// waits (``ValueError`` if a probed item is not a hash). For a long
    /// prompt with a short stored prefix, the lookup then converts, sends
    /// and discovers a few pages instead of thousands.
    fn pages_worth_asking(
        slf: &Bound<'_, Self>,
        groups: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
    ) -> PyResult<usize> {
        let n = hashes.len()?;
        let groups = group_ids(groups)?;
        let mut hash = |i: usize| hash_item(hashes, i).map(Some);
        Self::with_filter(slf, n, |session, client| {
            session.pages_worth_asking(client, &groups, n, origin, &mut hash)
        })
    }

    /// Where the manager would resume a prompt whose page hashes (`bytes`,
    /// page order, the same for every group of `groups`) are `hashes`,
    /// past `origin` tokens of `prompt_len`. One round trip (none for a
    /// miss the presence filter proves, see `lookup_local`); holds nothing.
    ///
    /// :param timeout: seconds to wait (default: the session's); past it
    ///     ``TimeoutError``, and the connection stays.
    #[pyo3(signature = (groups, hashes, origin, prompt_len, timeout=None))]
    fn lookup(
        slf: &Bound<'_, Self>,
        groups: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
        timeout: Option<f64>,
    ) -> PyResult<PyLookup> {
        let q = query(group_ids(groups)?, hashes, origin, prompt_len)?;
        if let Some(l) = Self::filter_miss(slf, &q) {
            return py_lookup(slf.py(), l);
        }
        let t = match timeout {
            Some(t) => Duration::try_from_secs_f64(t)
                .map_err(|_| PyValueError::new_err(format!("timeout {t}: seconds >= 0")))?,
            None => slf.get().options.timeout,
        };
        let l = Self::run(slf, |s, c| s.lookup_within(c, &q, t))?;
        py_lookup(slf.py(), l)
    }

    /// Sends a lookup (arguments as for `lookup`) without waiting for
    /// anything; returns its ticket. `lookup_result(ticket)` collects the
    /// answer; `forget_lookup(ticket)` gives it up.
    fn start_lookup(
        slf: &Bound<'_, Self>,
        groups: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
    ) -> PyResult<u64> {
        let q = query(group_ids(groups)?, hashes, origin, prompt_len)?;
        Self::run(slf, |s, c| s.start_lookup(c, &q))
    }

    /// A started lookup's `Lookup` if its answer has arrived, else `None`
    /// (never blocks). After an answer (or a failure) the ticket is done.
    fn lookup_result(slf: &Bound<'_, Self>, ticket: u64) -> PyResult<Option<PyLookup>> {
        let l = Self::run(slf, |s, c| s.lookup_result(c, ticket))?;
        l.map(|l| py_lookup(slf.py(), l)).transpose()
    }

    /// Wakes a sleeping manager without a request, when requests follow
    /// soon (a scheduler that looked prefixes up this step is about to plan
    /// the next): the first of them then does not pay the manager's
    /// wake-up. Never blocks on the manager and never connects; nothing
    /// while not connected, on the socket path, or while the manager is
    /// awake.
    fn warm(&self, py: Python<'_>) {
        let client = match self.inner.try_lock() {
            Ok(inner) => match &inner.client {
                Some(Backend::Client(c)) => Some(c.clone_ref(py)),
                _ => None,
            },
            Err(_) => None,
        };
        if let Some(c) = client {
            py.detach(|| c.get().with_client(|c| c.warm()));
        }
    }

    /// Gives a started lookup up; its answer is dropped when it comes.
    fn forget_lookup(&self, py: Python<'_>, ticket: u64) {
        py.detach(|| {
            if let Some(s) = self.lock().session.as_mut() {
                s.forget_lookup(ticket);
            }
        });
    }

    /// Many lookups (`(groups, hashes, origin, prompt_len)` each) in one
    /// round trip per 64.
    #[pyo3(signature = (queries, timeout=None))]
    fn lookup_many(
        slf: &Bound<'_, Self>,
        queries: Vec<(Vec<u32>, Bound<'_, PyAny>, u64, u64)>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<PyLookup>> {
        // Certain misses are answered here; the others in one round.
        let mut out: Vec<Option<Lookup>> = Vec::with_capacity(queries.len());
        let mut qs = Vec::new();
        for (g, h, o, p) in queries {
            let q = query(g, &h, o, p)?;
            match Self::filter_miss(slf, &q) {
                Some(l) => out.push(Some(l)),
                None => {
                    qs.push(q);
                    out.push(None);
                }
            }
        }
        let t = match timeout {
            Some(t) => Duration::try_from_secs_f64(t)
                .map_err(|_| PyValueError::new_err(format!("timeout {t}: seconds >= 0")))?,
            None => slf.get().options.timeout,
        };
        let mut asked = if qs.is_empty() {
            Vec::new()
        } else {
            Self::run(slf, |s, c| s.lookup_many_within(c, &qs, t))?
        }
        .into_iter();
        out.into_iter()
            .map(|l| match l.or_else(|| asked.next()) {
                Some(l) => py_lookup(slf.py(), l),
                None => Err(PyRuntimeError::new_err("a lookup without an answer")),
            })
            .collect()
    }

    /// What a load of a prompt would restore on this host now, and from
    /// which tier (a router's question; the manager's `POST /lookup`
    /// answers the same): `hashes` are the prompt's page hashes (`bytes`,
    /// the same for every group), `prompt_len` its length when known.
    /// Every rank and group of this session's instance is required;
    /// nothing is held.
    #[pyo3(signature = (hashes, prompt_len=None))]
    fn locate(
        slf: &Bound<'_, Self>,
        hashes: &Bound<'_, PyAny>,
        prompt_len: Option<u64>,
    ) -> PyResult<PyLocated> {
        let mut all = Self::locate_many(slf, vec![(hashes.clone(), prompt_len)])?;
        all.pop()
            .ok_or_else(|| PyValueError::new_err("locate: no answer"))
    }

    /// Many `locate`s (`(hashes, prompt_len)` each) in one round trip per
    /// 64.
    fn locate_many(
        slf: &Bound<'_, Self>,
        prompts: Vec<(Bound<'_, PyAny>, Option<u64>)>,
    ) -> PyResult<Vec<PyLocated>> {
        let owned = prompts
            .iter()
            .map(|(h, p)| Ok((hashes(h)?, *p)))
            .collect::<PyResult<Vec<_>>>()?;
        let borrowed: Vec<(&[NativeHash], Option<u64>)> =
            owned.iter().map(|(h, p)| (&h[..], *p)).collect();
        let rs = Self::run(slf, |s, c| s.locate_many(c, &borrowed))?;
        rs.into_iter().map(|r| py_located(slf.py(), r)).collect()
    }

    /// Loads a prompt (as for `lookup`) in one command: `targets` are
    /// `(rank, group, page_end, device_page)` for every page the engine
    /// could take, `retained` `(rank, group, page_end)` for the pages it
    /// holds. Returns after the last event.
    #[pyo3(signature = (groups, hashes, origin, prompt_len, *, ranks, targets, retained=Vec::new(), handoff=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        slf: &Bound<'_, Self>,
        groups: Vec<u32>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
        ranks: Vec<u32>,
        targets: Vec<(u32, u32, u64, u64)>,
        retained: Vec<(u32, u32, u64)>,
        handoff: Option<u64>,
    ) -> PyResult<PyLoaded> {
        let q = query(groups, hashes, origin, prompt_len)?;
        let plan = plan(ranks, targets, retained, handoff);
        let l = Self::run(slf, |s, c| s.load(c, &q, plan))?;
        py_loaded(slf.py(), l)
    }

    /// A P/D producer's promise to a decode engine: the pages of `hashes`
    /// (bytes each) in `groups`, on every rank, stay pinned in the
    /// manager's DRAM as they land, until a load passing
    /// `handoff=handoff` took them or `deadline_ms` passed. Returns
    /// `(promised, pinned_now, bytes_reserved)`; a bound or a duplicate
    /// id raises `orbitkv.Refused` and pins nothing.
    fn hold(
        slf: &Bound<'_, Self>,
        groups: Vec<u32>,
        hashes: &Bound<'_, PyAny>,
        handoff: u64,
        deadline_ms: u64,
    ) -> PyResult<(u64, u64, u64)> {
        let q = query(groups, hashes, 0, 0)?;
        let h = Self::run(slf, |s, c| {
            s.hold(c, &q.groups, &q.hashes, handoff, deadline_ms)
        })?;
        Ok((h.promised, h.pinned, h.bytes))
    }

    /// Saves pages: `(rank, group, hash, device_page)` each, `hash` bytes.
    fn save(
        slf: &Bound<'_, Self>,
        pages: Vec<(u32, u32, Bound<'_, PyBytes>, u64)>,
    ) -> PyResult<PySaved> {
        let pages = publish_pages(&pages)?;
        Ok(Self::run(slf, |s, c| s.save(c, pages))?.into())
    }

    /// Starts a `load` (arguments as for `load`); returns its ticket.
    /// `poll` reports a `Ready` once its pages are leased and copying,
    /// then its `Loaded` (or a `Refused`).
    #[pyo3(signature = (groups, hashes, origin, prompt_len, *, ranks, targets, retained=Vec::new(), handoff=None))]
    #[allow(clippy::too_many_arguments)]
    fn start_load(
        slf: &Bound<'_, Self>,
        groups: Vec<u32>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
        ranks: Vec<u32>,
        targets: Vec<(u32, u32, u64, u64)>,
        retained: Vec<(u32, u32, u64)>,
        handoff: Option<u64>,
    ) -> PyResult<Ticket> {
        let q = query(groups, hashes, origin, prompt_len)?;
        let plan = plan(ranks, targets, retained, handoff);
        Self::run(slf, |s, c| s.start_load(c, &q, plan))
    }

    /// Starts a lease of the selected pages (arguments as for `lookup`)
    /// for an engine that reads them from the manager's pool itself: its
    /// `Ready` names them (`pool_pages`); read them, then `release(ticket)`;
    /// `poll` then reports its `Loaded`.
    fn start_lease(
        slf: &Bound<'_, Self>,
        groups: Vec<u32>,
        hashes: &Bound<'_, PyAny>,
        origin: u64,
        prompt_len: u64,
    ) -> PyResult<Ticket> {
        let q = query(groups, hashes, origin, prompt_len)?;
        Self::run(slf, |s, c| s.start_lease(c, &q))
    }

    /// Ends a lease whose pages were read.
    fn release(slf: &Bound<'_, Self>, ticket: Ticket) -> PyResult<()> {
        Self::run(slf, |s, c| s.release(c, ticket))
    }

    /// Cancels a started lease whose operation is known; returns whether a
    /// cancel was sent (its `Loaded` still comes from `poll`).
    fn cancel(slf: &Bound<'_, Self>, ticket: Ticket) -> PyResult<bool> {
        Self::run(slf, |s, c| s.cancel(c, ticket))
    }

    /// Starts a `save`; returns its ticket (`poll` reports its `Saved`).
    fn start_save(
        slf: &Bound<'_, Self>,
        pages: Vec<(u32, u32, Bound<'_, PyBytes>, u64)>,
    ) -> PyResult<Ticket> {
        let pages = publish_pages(&pages)?;
        Self::run(slf, |s, c| s.start_save(c, pages))
    }

    /// Progress of started verbs: `(ticket, outcome)` pairs, the outcome a
    /// `Ready`, `Loaded`, `Saved` or `Refused` (an exception instance, not
    /// raised). Waits up to `timeout` seconds when nothing is known yet.
    ///
    /// :raises Unavailable: the connection failed, or a copy passed its
    ///     deadline (every verb in flight is lost; the connection is given
    ///     up after its agent drained).
    #[pyo3(signature = (timeout=0.0))]
    fn poll(slf: &Bound<'_, Self>, timeout: f64) -> PyResult<Vec<(Ticket, Py<PyAny>)>> {
        let t = Duration::try_from_secs_f64(timeout)
            .map_err(|_| PyValueError::new_err(format!("timeout {timeout}: seconds >= 0")))?;
        let ps = Self::run(slf, |s, c| s.poll(c, t))?;
        ps.into_iter().map(|p| py_progress(slf.py(), p)).collect()
    }

    /// Started verbs not yet ended.
    #[getter]
    fn in_flight(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().session.as_ref().map_or(0, Session::in_flight))
    }

    /// Gives the connection up (after a failure the caller saw): the
    /// manager closes the session and returns its leases; the copy agent
    /// drains first. The next call reconnects.
    #[pyo3(signature = (why=None))]
    fn drop(&self, py: Python<'_>, why: Option<String>) {
        self.drop_connection(py);
        if let Some(w) = why {
            py.detach(|| self.lock().last_error = Some(w));
        }
    }

    /// Closes the session and the connection (idempotent).
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let mut inner = self.lock();
            if let (Some(s), Some(b)) = (inner.session.take(), inner.client.as_ref()) {
                // Best effort: the manager closes it with the connection.
                let _ = b.with_port(|p| s.close(p));
            }
        });
        self.drop_connection(py);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        // Never block in the collector: a callback being called is reached
        // through its caller's frame anyway.
        if let Ok(f) = self.on_connect.try_lock()
            && let Some(f) = f.as_ref()
        {
            visit.call(f)?;
        }
        Ok(())
    }

    fn __clear__(&self) {
        if let Ok(mut f) = self.on_connect.try_lock() {
            f.take();
        }
    }
}
