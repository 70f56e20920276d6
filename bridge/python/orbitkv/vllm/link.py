"""One process's connection to the manager: connect, register the instance,
open a session; after a failure, reconnect with a new session, at most once
per `reconnect_interval_s`.

Two different failures, never confused:

- `Unavailable`: the manager does not answer (down, restarting, timed
  out). Callers treat it as a miss or a dropped save, and it is logged as
  a warning.
- `Refused`: the manager answered and refused this engine (an impossible
  rank, a contract or layout it cannot serve, an instance name taken by
  another computation, a limit). At startup it becomes a `ConfigError`
  naming the setting (`connect_at_startup`); later (a manager restarted
  with other settings) every refusal is a miss or a dropped save counted
  by reason (`refusals`), and is logged at error level with the manager's
  reason, at most once per `REFUSAL_LOG_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional

import orbitkv

from .engine import EngineSpec
from .settings import ConfigError, ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

# What a failed manager interaction raises: the connection is gone.
LINK_ERRORS = (orbitkv.ConnectionError, ConnectionError, OSError)


REFUSAL_LOG_INTERVAL_S = 10.0
"""Refusals are logged at error level at most this often (by time, not by
count: a refusal that repeats stays visible)."""


class ManagerError(Exception):
    """The manager could not serve this process: `Unavailable` or
    `Refused`."""


class Unavailable(ManagerError):
    """The manager does not answer: down, restarting, or too slow."""


class Refused(ManagerError):
    """The manager answered a command with a typed refusal.

    `command` is the refused command, `error` the manager's `CommandError`
    as it arrived (``{"error": kind, "detail": ...}``), `reason` the
    manager's label for it, as its refusal metric counts it
    (``unknown_rank``, ``contract``, ``instance_conflict``,
    ``limit_<name>`` ...), `setting` what the operator must change."""

    def __init__(self, command: str, reason: str, error: Dict[str, Any], setting: str, message: str):
        super().__init__(message)
        self.command = command
        self.reason = reason
        self.error = error
        self.setting = setting


_SERVE_QUOTAS = (
    "max_sessions_per_connection",
    "max_regions_per_connection",
    "max_sessions_per_uid",
    "max_sessions_per_process",
)
"""The manager's quotas (`orbitkv serve` settings), refused before a
command is queued."""


def _setting_for(reason: str, detail: Any, spec: EngineSpec, rank: Optional[int]) -> str:
    """The setting an operator changes to end a refusal, in words."""
    d = detail if isinstance(detail, dict) else {}
    if reason == "unknown_rank":
        return (
            f"tensor parallel rank {d.get('rank', rank)} is outside 0..{spec.tp_size} "
            f"(parallel_config.tensor_parallel_size = {spec.tp_size}): every worker's rank "
            "must be one of the ranks the engine registers"
        )
    if reason == "contract":
        return (
            "the KV cache groups (kv_cache_config.kv_cache_groups, from the model's "
            f"layer types and sliding_window) do not form a recovery contract: {d.get('reason', '')}"
        )
    if reason in ("layout", "slot_page_tokens", "slot_group", "slot_rank", "rank_without_group"):
        return (
            "the storage layout (cache_config.block_size, kv_cache_layout, the KV cache "
            f"groups' layers) was refused: {d or reason}"
        )
    if reason == "page_exceeds_extent":
        return (
            f"a page of group {d.get('group')} is {d.get('page_bytes')} bytes, more than one "
            f"DRAM extent of the manager ({d.get('extent_bytes')} bytes): raise the manager's "
            "dram.extent_bytes, or use a smaller cache_config.block_size"
        )
    if reason == "instance_conflict":
        return (
            f"kv_connector_extra_config.instance {spec.instance!r} is registered in the manager "
            "with another identity or layout (another model, configuration or parallelism "
            "uses this name): give each computation its own instance name, or leave it "
            "empty to derive it from the identity"
        )
    if reason.startswith("limit_"):
        name = reason[len("limit_") :]
        where = ""
        if name in _SERVE_QUOTAS:
            where = (
                f": raise [serve] {name} in the manager's configuration, or run fewer "
                "engine processes against it"
            )
        return f"the manager's limit {name} ({d.get('limit')}) is reached{where}"
    return f"the manager refused it ({reason}: {d})"


def refused(e: orbitkv.Refused, spec: EngineSpec, rank: Optional[int] = None) -> Refused:
    """A `Refused` naming the setting, for the session's refusal `e`
    (`args`: kind, the manager's reason label, message, error)."""
    kind, reason, error = str(e.args[0]), str(e.args[1]), e.args[3] or {}
    error = error or {"error": kind}
    setting = _setting_for(reason, error.get("detail"), spec, rank)
    return Refused(
        e.command, reason, error, setting, f"the OrbitKV manager refused {e.command} ({reason}): {setting}"
    )


class ManagerLink:
    """The process's `orbitkv.Session`, with this connector's reporting:
    unavailability as warnings, refusals counted by reason and logged with
    the setting to change."""

    def __init__(
        self,
        settings: ConnectorSettings,
        spec: EngineSpec,
        name: str,
        on_connect: Optional[Callable[[orbitkv.Session], None]] = None,
        rank: Optional[int] = None,
        spin_us: Optional[int] = None,
    ):
        self.settings = settings
        self.rank = rank
        self.spec = spec
        self.name = name
        self.on_connect = on_connect
        self.session = orbitkv.Session(
            settings.socket,
            spec.description,
            name=name,
            timeout=settings.timeout_s,
            reconnect_interval=settings.reconnect_interval_s,
            spin_us=spin_us,
            on_connect=on_connect,
        )
        self.connects = 0
        self.last_error = ""
        self.refusals: Dict[str, int] = {}
        """Refusals by reason (`Refused.reason`), since the process started."""
        self.last_refusal: Optional[Refused] = None
        self._refusal_logged_at = -REFUSAL_LOG_INTERVAL_S
        self._refusals_unlogged = 0
        self._starting = False
        self._failures_seen = 0

    @property
    def up(self) -> bool:
        return self.session.up

    @property
    def generation(self) -> int:
        """Sessions opened so far; device pages of an older one are dead."""
        return self.session.generation

    def get(self) -> orbitkv.Session:
        """The connected session; raises `Unavailable` or `Refused`."""
        s = self.session
        if s.up:
            return s
        try:
            s.connect()
        except orbitkv.Refused as e:
            if not self._attempted():
                raise Unavailable(f"manager unavailable: {self.last_error}") from e
            r = self.refused(e)
            raise r from e
        except ConfigError:
            raise
        except (orbitkv.Unavailable, *LINK_ERRORS) as e:
            if not self._attempted():
                raise Unavailable(f"manager unavailable: {self.last_error}") from e
            self.last_error = f"{type(e).__name__}: {e}"
            failures = s.failures
            if failures == 1 or failures % 100 == 0:
                log.warning(
                    "OrbitKV manager at %s unavailable (%s); lookups miss and saves are "
                    "dropped until it is back",
                    self.settings.socket,
                    self.last_error,
                )
            raise Unavailable(self.last_error) from e
        self._failures_seen = 0
        self.connects += 1
        log.info(
            "OrbitKV: %s connected to %s (instance %s, session %s, incarnation %x)",
            self.name,
            self.settings.socket,
            self.spec.instance,
            s.handle["id"],
            s.client.incarnation,
        )
        return s

    def _attempted(self) -> bool:
        """Whether the last `connect` tried (rather than waited for the
        reconnect interval and raised the last failure again)."""
        failures = self.session.failures
        tried = failures != self._failures_seen
        self._failures_seen = failures
        return tried

    def refused(self, e: orbitkv.Refused) -> Refused:
        """Counts and logs a refusal; returns it as a `Refused`."""
        r = refused(e, self.spec, self.rank)
        self._refused(r)
        return r

    def connect_at_startup(self) -> None:
        """Connects once while the engine starts: a refusal is a
        `ConfigError` naming the setting (the engine does not start); a
        manager that does not answer only delays the connection."""
        self._starting = True
        try:
            self.get()
        except Refused as e:
            raise ConfigError(str(e)) from e
        except Unavailable:
            pass  # logged by `get`; the first use retries
        finally:
            self._starting = False

    def _refused(self, e: Refused) -> None:
        """Counts a refusal and logs it at error level, at most once per
        `REFUSAL_LOG_INTERVAL_S` (with how many were not logged since)."""
        self.refusals = {**self.refusals, e.reason: self.refusals.get(e.reason, 0) + 1}
        self.last_refusal = e
        self.last_error = f"refused: {e}"
        if self._starting:
            return  # the engine stops with it (`connect_at_startup`)
        now = time.monotonic()
        if now - self._refusal_logged_at < REFUSAL_LOG_INTERVAL_S:
            self._refusals_unlogged += 1
            return
        more = self._refusals_unlogged
        self._refusal_logged_at, self._refusals_unlogged = now, 0
        log.error(
            "OrbitKV: %s: %s; lookups miss and saves are dropped until this is fixed%s",
            self.name,
            e,
            f" ({more} more refusals since the last report)" if more else "",
        )

    def warm(self) -> None:
        """Wakes the manager if it sleeps (`Session.warm`): lookups follow.
        Never raises: a hint."""
        try:
            self.session.warm()
        except Exception:  # pragma: no cover - a hint must not fail a step
            pass

    def drop(self, why: str) -> None:
        """Forgets the connection after a failure (the session may have
        given it up already); the next `get` reconnects."""
        log.warning("OrbitKV: %s lost the manager (%s); reconnecting", self.name, why)
        self.last_error = why
        self.session.drop(why)

    def close(self) -> None:
        self.session.close()
