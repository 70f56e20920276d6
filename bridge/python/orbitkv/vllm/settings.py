"""The connector's settings: ``kv_connector_extra_config`` and the
environment. Every key is named here; an unknown key is an error at startup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping

import orbitkv


class ConfigError(ValueError):
    """vLLM is configured in a way the connector cannot serve safely. Raised
    at startup, naming the setting."""


LOAD_MODES = ("async", "layerwise")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys (docs/vllm.md lists them)."""

    socket: str
    """The manager's Unix socket."""
    instance: str = ""
    """Instance name in the manager; empty derives it from the identity, so
    engines of one computation share an instance and others never collide."""
    load: bool = True
    """Look up and load prefixes from OrbitKV."""
    save: bool = True
    """Publish computed pages to OrbitKV."""
    copy_agent: bool = True
    """KV caches (host or CUDA memory) are agent-owned regions: loads
    restore into and saves publish from the engine's blocks, the copies run
    by the worker's copy agent on the manager's instruction (the CUDA copy
    engine for a KV cache on a GPU). False: staged copies done by the
    worker itself."""
    staging_pages: int = 128
    """Staged copies only: pages per KV cache group in each worker's staging region: the most
    pages of one group that can be on their way to the pool at once. Saves
    beyond it are dropped (a later miss, never a wrong byte)."""
    publish_batch_pages: int = 64
    """Pages per publish command."""
    timeout_s: float = 5.0
    """Bound on every wait for the manager in a worker (a load or publish
    past it fails: the request recomputes, the page is not saved)."""
    query_timeout_s: float = 1.0
    """Bound on the scheduler's lookup: past it, the request is a miss."""
    lookup_wait: bool = True
    """True: the scheduler waits for each lookup's answer (at most
    ``query_timeout_s``). False: it sends the lookup and tells vLLM "not
    yet" (``None``): vLLM skips the request for this step and asks again
    at a later one, when the answer is collected without waiting. The
    lookup then never holds up the scheduler's thread, and a request whose
    answer was not back in time is scheduled a step later."""
    lookup_spin_us: int = 300
    """How long the scheduler's wait for a lookup's answer spins before it
    blocks (0..=10000; the client's own default is 20). The scheduler's
    thread is on every step's critical path, and a blocking wait costs a
    kernel wake-up (about 95 us on a small VM); an answer normally comes in
    15-50 us, or in 100-200 us when the manager slept. Spinning turns
    itself off while the machine is oversubscribed. Pair it with the
    manager's ``[serve] spin_after_work_us`` (docs/vllm.md, "Lookup
    latency")."""
    lookup_batch: int = 8
    """``lookup_wait: true``: when vLLM first asks about a request, the
    scheduler also looks up the requests that arrived after it and were
    not asked about yet, this many in all, in one round trip
    (``Session.lookup_many``), each from token 0. A batched answer is used
    when vLLM asks about its request within ``lookup_batch_max_age_us``
    and holds no tokens of it locally; otherwise that request is looked up
    alone. 1..=32; 1 looks every request up alone."""
    lookup_batch_max_age_us: int = 2000
    """How long a batched answer stays usable (1..=1000000 us): the
    manager's pages may change after it."""
    reconnect_interval_s: float = 1.0
    """How often a process retries a manager that is down; in between,
    lookups miss at once and saves are dropped."""
    max_pending_jobs: int = 4096
    """Bound on a worker's queued loads and saves; past it, saves are
    dropped and loads fail (recompute)."""
    events: str = ""
    """The manager's KV event stream (its ``[events] publish`` address, e.g.
    ``ipc:///run/orbitkv/events``; default ``ORBITKV_EVENTS_ADDR``). With
    vLLM's ``--kv-events-config`` on, the pages this engine can load from
    OrbitKV go out through vLLM's own publisher (docs/events.md)."""
    events_replay: str = ""
    """The stream's replay address (``[events] replay``), to fill gaps."""
    load_mode: str = "async"
    """``"async"``: a request with a hit waits (``WAITING_FOR_REMOTE_KVS``)
    until its whole load landed, reported through ``get_finished``.
    ``"layerwise"``: loads are synchronous; they start in
    ``start_load_kv``, one copy batch per layer in layer order, and
    ``wait_for_layer_load(layer)`` waits only for that layer's copies, so a
    layer's attention runs while later layers still copy. A failed load is
    reported through ``get_block_ids_with_load_errors`` and vLLM
    recomputes. Needs ``copy_agent`` and a single KV cache group."""
    handoff_pin_ms: int = 30_000
    """P/D, the prefill engine (``kv_producer``): how long the manager keeps
    the pages it promised a decode engine pinned in DRAM (never evicted,
    never demoted) when no decode engine takes them (1..=120000, the
    manager's ``limits.max_handoff_deadline_us``). docs/pd.md."""
    handoff_wait_s: float = 10.0
    """P/D, the decode engine (``kv_consumer``): how long a request with a
    handoff waits for the prefill engine's pages to land before it gives
    up (a miss with reason ``handoff_timeout``: vLLM recomputes the
    prompt). The wait keeps the request in vLLM's waiting queue, holding
    no KV blocks. docs/pd.md."""

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any]) -> "ConnectorSettings":
        known = {f.name: f for f in fields(ConnectorSettings)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(
                "unknown kv_connector_extra_config key(s) for OrbitKVConnector: "
                + ", ".join(repr(k) for k in unknown)
                + f" (known: {', '.join(sorted(known))})"
            )
        values: Dict[str, Any] = {
            "socket": orbitkv.default_socket(),
            "events": os.environ.get("ORBITKV_EVENTS_ADDR", ""),
        }
        for key, value in extra.items():
            want = known[key].type
            values[key] = _check(key, value, want)
        s = ConnectorSettings(**values)
        for key in ("staging_pages", "publish_batch_pages", "max_pending_jobs"):
            if getattr(s, key) < 1:
                raise ConfigError(f"kv_connector_extra_config.{key} must be >= 1")
        for key in ("timeout_s", "query_timeout_s", "reconnect_interval_s", "handoff_wait_s"):
            if not getattr(s, key) > 0:
                raise ConfigError(f"kv_connector_extra_config.{key} must be > 0")
        if not 1 <= s.lookup_batch <= 32:
            raise ConfigError(
                f"kv_connector_extra_config.lookup_batch must be in 1..=32, got {s.lookup_batch}"
            )
        if not 1 <= s.lookup_batch_max_age_us <= 1_000_000:
            raise ConfigError(
                "kv_connector_extra_config.lookup_batch_max_age_us must be in 1..=1000000, "
                f"got {s.lookup_batch_max_age_us}"
            )
        if not 0 <= s.lookup_spin_us <= 10_000:
            raise ConfigError(
                f"kv_connector_extra_config.lookup_spin_us must be in 0..=10000, got {s.lookup_spin_us}"
            )
        if not 1 <= s.handoff_pin_ms <= 120_000:
            raise ConfigError(
                f"kv_connector_extra_config.handoff_pin_ms must be in 1..=120000, got {s.handoff_pin_ms}"
            )
        if not s.socket:
            raise ConfigError("kv_connector_extra_config.socket is empty")
        for key in ("events", "events_replay"):
            addr = getattr(s, key)
            if addr and not addr.startswith(("tcp://", "ipc://")):
                raise ConfigError(
                    f"kv_connector_extra_config.{key} must be a tcp:// or ipc:// address, got {addr!r}"
                )
        if s.events_replay and not s.events:
            raise ConfigError("kv_connector_extra_config.events_replay needs events (the stream itself)")
        if s.load_mode not in LOAD_MODES:
            raise ConfigError(
                f"kv_connector_extra_config.load_mode must be one of {', '.join(map(repr, LOAD_MODES))}, "
                f"got {s.load_mode!r}"
            )
        if s.load_mode == "layerwise" and not s.copy_agent:
            raise ConfigError(
                "kv_connector_extra_config.load_mode 'layerwise' needs copy_agent: true "
                "(layers are loaded by the copy agent)"
            )
        return s


def _check(key: str, value: Any, want: Any) -> Any:
    # dataclass field types are strings under `from __future__ import annotations`.
    want = str(want)
    if want == "bool":
        ok = isinstance(value, bool)
    elif want == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a {want}, got {value!r}")
    return value
