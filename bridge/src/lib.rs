//! `orbitkv`, the Python package (native module `orbitkv._orbitkv`).
//!
//! PyO3 (abi3, built by maturin; `bridge/pyproject.toml`).
//!
//! # Codemap
//!
//! - `src/runtime.rs`: `Runtime`, the embedded runtime (commands and events
//!   as dicts; the caller's loop calls `tick()`); its host copy engine keeps
//!   device regions in memory files, so `device_view` hands out a writable
//!   zero-copy view of one (what an engine's tensors read and write).
//! - `src/client.rs`: `Client`, wrapping `orbitkv_ipc::Client` for
//!   `orbitkv serve`; blocking calls release the GIL; `lookup` is the typed
//!   lookup verb (hashes as bytes, `(selected, miss)` back, a refusal raises
//!   `Rejected`, late replies of timed-out lookups dropped); a command the
//!   manager refuses to queue raises `Rejected` (a quota) or `QueueFull` (a
//!   full inbox); `attach_agent_memory` /
//!   `detach_agent_memory` (the connection's copy agent), `close` drains it.
//! - `src/session.rs`: `Instance` (what a session registers, each part
//!   parsed into the contract's types where it is made: no command dict
//!   crosses from an adapter) and `Session` (`orbitkv_engine::Session` for
//!   Python) over a socket (its own connection, reconnected at most once per
//!   `reconnect_interval`, the last failure raised again meanwhile: a refusal
//!   stays `Refused`), a caller's `Client` (shared) or a wall-clock
//!   `Runtime`; `on_connect(session)` is the engine's setup (regions) after
//!   every connection; results `Lookup`, `Loaded`, `Saved`, `Ready`;
//!   `MissReason` is an `enum.Enum` built from `MissReason::ALL`; `Refused`
//!   (a `Rejected`) vs `Unavailable` (a `ConnectionError`). Collectable: the
//!   callback is traversed, the last failure kept as data, not a traceback.
//! - `src/agent.rs`: the agent's refusals as Python exceptions
//!   (`CudaUnavailable` for CUDA memory without CUDA, `ValueError`
//!   otherwise); the agent itself is `orbitkv_engine::agent`.
//!   `Client.agent_layer_counts` reads a layered region's per-layer counts;
//!   `Client.close` drops the agent (streams drained, window unpinned, then
//!   unmapped).
//! - `src/buffer.rs`: `SharedBuffer`, the buffer-protocol object behind
//!   `Client.page()` (read-only pool views), `Client.region()` and
//!   `Runtime.device_view()` (writable device views); each holds its own
//!   mapping, so views outlive the client or runtime.
//! - `src/contract.rs`, `src/identity.rs`: the contract functions and
//!   `compute_identity`; `src/convert.rs`: dict ↔ serde.
//! - `src/bench.rs`: a Rust-timed ping loop used by `bench/query_roundtrip.py`.
//! - `python/orbitkv/`: the Python package, its stubs (`_orbitkv.pyi`) and
//!   the engine adapters (ARCHITECTURE.md, section `bridge/`).
//!
//! The `extension-module` feature of pyo3 is deliberately off here (so
//! `cargo test --workspace` links); maturin turns it on
//! (`bridge/pyproject.toml`).

use pyo3::create_exception;
use pyo3::exceptions::{PyConnectionError, PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pub mod agent;
pub mod bench;
pub mod buffer;
pub mod client;
pub mod contract;
pub mod convert;
pub mod identity;
pub mod runtime;
pub mod session;

create_exception!(
    orbitkv,
    ContractError,
    PyValueError,
    "A recovery contract, bundle or span was rejected."
);
create_exception!(
    orbitkv,
    IdentityError,
    PyValueError,
    "An identity input could not be established (OrbitKV fails closed)."
);
create_exception!(
    orbitkv,
    InvariantError,
    PyRuntimeError,
    "The runtime's state violates an invariant; `violations` lists them."
);
create_exception!(
    orbitkv,
    ConnectionError,
    PyConnectionError,
    "The connection to the manager failed or was refused (protocol error, manager gone)."
);
create_exception!(
    orbitkv,
    CudaUnavailable,
    PyRuntimeError,
    "CUDA memory was offered to the copy agent and this process cannot use CUDA (no driver, no such device): the reason is in the message."
);
create_exception!(
    orbitkv,
    QueueFull,
    PyException,
    "The runtime's (or the manager's) inbox is full: nothing was queued; tick to drain it, or submit again later."
);

create_exception!(
    orbitkv,
    Rejected,
    PyException,
    "The manager refused a command: `args` are the error's kind (`stale_session`, `invalid`, `limit`, ...), its reason label (the kind, the malformation's kind for `invalid`, `limit_<name>` for a limit: what `orbitkv_refusals_total` counts), the message, and the error as a `rejected` event carries it (a dict)."
);

create_exception!(
    orbitkv,
    Refused,
    Rejected,
    "The manager answered and refused (`orbitkv.Session`): not unavailability. `args` are as for `Rejected`; `command` names the refused command."
);
create_exception!(
    orbitkv,
    Unavailable,
    ConnectionError,
    "The manager does not answer (down, restarting, too slow), or the session's connection can no longer be trusted and was given up; the next call reconnects (at most once per `reconnect_interval`)."
);

/// The manager's socket when a configuration names none: `ORBITKV_SOCKET`
/// if set, else where `orbitkv serve` listens by default
/// (`$XDG_RUNTIME_DIR/orbitkv.sock`, else `/tmp/orbitkv-<uid>/orbitkv.sock`).
/// The manager's own rule, so an adapter's default always finds it.
#[pyfunction]
fn default_socket() -> String {
    orbitkv_ipc::client_socket().to_string_lossy().into_owned()
}

/// OrbitKV's native module; import `orbitkv` instead.
#[pymodule]
fn _orbitkv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether this extension is a debug build (benchmarks warn about it).
    m.add("_debug_build", cfg!(debug_assertions))?;
    // The manager protocol version this build speaks (raw-frame tests).
    m.add("_protocol_version", orbitkv_ipc::PROTOCOL_VERSION)?;
    m.add("ConnectionError", py.get_type::<ConnectionError>())?;
    m.add("ContractError", py.get_type::<ContractError>())?;
    m.add("IdentityError", py.get_type::<IdentityError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("QueueFull", py.get_type::<QueueFull>())?;
    m.add("Rejected", py.get_type::<Rejected>())?;
    m.add("CudaUnavailable", py.get_type::<CudaUnavailable>())?;
    m.add("Refused", py.get_type::<Refused>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("MissReason", session::miss_reason_type(py)?)?;
    m.add_class::<session::PySession>()?;
    m.add_class::<session::PyInstance>()?;
    m.add_class::<session::PyLookup>()?;
    m.add_class::<session::PyLocated>()?;
    m.add_class::<session::PyLoaded>()?;
    m.add_class::<session::PySaved>()?;
    m.add_class::<session::PyReady>()?;
    m.add_class::<runtime::PyRuntime>()?;
    m.add_class::<client::PyClient>()?;
    m.add("SharedBuffer", buffer::shared_buffer_type(py)?)?;
    m.add_function(wrap_pyfunction!(contract::required_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(contract::restorable_boundaries, m)?)?;
    m.add_function(wrap_pyfunction!(contract::common_boundaries, m)?)?;
    m.add_function(wrap_pyfunction!(contract::select_boundary, m)?)?;
    m.add_function(wrap_pyfunction!(contract::vllm_window_past_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(identity::compute_identity, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_uds_roundtrip, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    Ok(())
}
