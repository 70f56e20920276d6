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
  reason, at most once every 10 s (`orbitkv.refusals`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import orbitkv
from orbitkv.refusals import Names, RefusalLog, explain

from .engine import EngineSpec
from .settings import ConfigError, ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

# What a failed manager interaction raises: the connection is gone.
LINK_ERRORS = (orbitkv.ConnectionError, ConnectionError, OSError)


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


def refused(e: orbitkv.Refused, spec: EngineSpec, rank: Optional[int] = None) -> Refused:
    """A `Refused` naming the setting, for the session's refusal `e`
    (`args`: kind, the manager's reason label, message, error)."""
    kind, reason, error = str(e.args[0]), str(e.args[1]), e.args[3] or {}
    error = error or {"error": kind}
    names = Names(
        ranks=f"parallel_config.tensor_parallel_size = {spec.tp_size}",
        instance="kv_connector_extra_config.instance",
        page_size="cache_config.block_size",
        groups="the KV cache groups (kv_cache_config.kv_cache_groups, from the model's layer types and sliding_window)",
        layout="cache_config.block_size, kv_cache_layout, the KV cache groups' layers",
        rank_count=spec.tp_size,
    )
    setting = explain(reason, error.get("detail"), names, rank)
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
        self.refusals = RefusalLog(log, f"OrbitKV: {name}: ")
        """Refusals by reason (`Refused.reason`), logged at error level."""
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
        """Counts a refusal and logs it (`RefusalLog`), unless the engine
        is starting: it stops with it (`connect_at_startup`)."""
        self.last_error = f"refused: {e}"
        self.refusals.record(e.reason, str(e), log=not self._starting)

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
