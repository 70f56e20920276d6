"""One process's connection to the manager: connect, register the instance,
open a session; after a failure, reconnect with a new session, at most once
per `reconnect_interval_s`. While the manager is away, callers get
`Unavailable` and treat it as a miss (or a dropped save)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import orbitkv

from .engine import EngineSpec
from .settings import ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

# What a failed manager interaction raises: the connection is gone or the
# manager did not answer in time.
LINK_ERRORS = (orbitkv.ConnectionError, ConnectionError, TimeoutError, OSError)


class Unavailable(Exception):
    """The manager is down, restarting, or refused this engine."""


class ManagerLink:
    def __init__(
        self,
        settings: ConnectorSettings,
        spec: EngineSpec,
        name: str,
        on_connect: Optional[Callable[[Any, Dict[str, Any]], None]] = None,
    ):
        self.settings = settings
        self.spec = spec
        self.name = name
        self.on_connect = on_connect
        self.client: Any = None
        self.session: Optional[Dict[str, Any]] = None
        self.namespaces: List[str] = []
        self.generation = 0
        """Counts sessions opened; handles of an older generation are dead."""
        self.connects = 0
        self.failures = 0
        self._retry_at = 0.0
        self.last_error = ""

    @property
    def up(self) -> bool:
        return self.client is not None

    def get(self) -> Tuple[Any, Dict[str, Any]]:
        """(client, session), connecting if needed; raises `Unavailable`."""
        if self.client is not None and self.session is not None:
            return self.client, self.session
        now = time.monotonic()
        if now < self._retry_at:
            raise Unavailable(f"manager unavailable: {self.last_error}")
        self._retry_at = now + self.settings.reconnect_interval_s
        client = None
        try:
            client = orbitkv.Client(self.settings.socket, self.name)
            t = self.settings.timeout_s
            reg = client.call(self.spec.register_command, t)
            if reg.get("event") != "instance_registered":
                raise Unavailable(f"registering instance {self.spec.instance!r}: {reg}")
            opened = client.call({"command": "open_session", "instance": self.spec.instance}, t)
            if opened.get("event") != "session_opened":
                raise Unavailable(f"opening a session: {opened}")
            session = opened["session"]
            if self.on_connect is not None:
                self.on_connect(client, session)
        except (Unavailable, *LINK_ERRORS) as e:
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "OrbitKV manager at %s unavailable (%s); lookups miss and saves are "
                    "dropped until it is back",
                    self.settings.socket,
                    self.last_error,
                )
            if client is not None:
                client.close()
            raise Unavailable(self.last_error) from e
        self.client, self.session = client, session
        self.namespaces = list(reg["namespaces"])
        self.generation += 1
        self.connects += 1
        log.info(
            "OrbitKV: %s connected to %s (instance %s, session %s, incarnation %x)",
            self.name,
            self.settings.socket,
            self.spec.instance,
            session["id"],
            client.incarnation,
        )
        return client, session

    def drop(self, why: str) -> None:
        """Forgets the connection after a failure; the next `get` reconnects."""
        if self.client is None:
            return
        log.warning("OrbitKV: %s lost the manager (%s); reconnecting", self.name, why)
        self.last_error = why
        try:
            self.client.close()
        finally:
            self.client, self.session = None, None

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            finally:
                self.client, self.session = None, None
