"""A manager's refusal, told the operator once and in the same words by
every engine adapter: what to change to end it (`explain`), and how it is
counted and logged while it lasts (`RefusalLog`).

A refusal is not unavailability: the manager answered and will not serve
this engine as it is configured (another computation took the instance
name, a page larger than a DRAM extent, a rank the instance does not
register, a limit). At startup the adapter stops the engine with
`explain`'s sentence; later (a manager restarted with other settings) each
refused call is a miss counted by reason, and the sentence is logged at
error level at most once per interval, for as long as it lasts.

The adapters only say how their engine names the settings involved
(`Names`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ._orbitkv import Refused

__all__ = ["Names", "explain", "message", "RefusalLog", "SERVE_QUOTAS"]

SERVE_QUOTAS = (
    "max_sessions_per_connection",
    "max_regions_per_connection",
    "max_sessions_per_uid",
    "max_sessions_per_process",
)
"""The manager's per-client quotas (`orbitkv serve` settings), refused
before a command is queued."""


@dataclass(frozen=True)
class Names:
    """How an engine names what a refusal points at."""

    ranks: str
    """The setting that fixes the parallel ranks (``--tp-size``)."""
    instance: str
    """The setting that names the instance."""
    page_size: str
    """The setting that sizes a page (tokens per block or page)."""
    groups: str
    """Where the storage groups and their rules come from."""
    layout: str = ""
    """The settings the storage layout is derived from (default: the page
    size and the groups)."""
    rank_count: Optional[int] = None
    """How many ranks the engine registers, where it is known."""


def explain(reason: str, detail: Any, names: Names, rank: Optional[int] = None) -> str:
    """What the operator changes to end a refusal with reason label
    `reason` (the manager's metric label: the error's kind, ``limit_<name>``
    for a limit) and the error's `detail`."""
    d = detail if isinstance(detail, dict) else {}
    if reason == "unknown_rank":
        n = names.rank_count
        which = f"is outside 0..{n}" if n is not None else "is not one of the ranks the instance registers"
        return f"rank {d.get('rank', rank)} {which} ({names.ranks}): every worker's rank must be registered"
    if reason == "contract":
        return f"{names.groups} do not form a recovery contract: {d.get('reason', '')}"
    if reason in ("layout", "slot_page_tokens", "slot_group", "slot_rank", "rank_without_group"):
        layout = names.layout or f"{names.page_size} and {names.groups}"
        return f"the storage layout ({layout}) was refused: {d or reason}"
    if reason == "page_exceeds_extent":
        return (
            f"a page of group {d.get('group')} is {d.get('page_bytes')} bytes, more than one "
            f"DRAM extent of the manager ({d.get('extent_bytes')} bytes): raise the manager's "
            f"dram.extent_bytes, or use a smaller {names.page_size}"
        )
    if reason == "instance_conflict":
        name = detail if isinstance(detail, str) else d.get("instance", "")
        return (
            f"{names.instance} {name!r} is registered in the manager with another identity or "
            "layout (another model, configuration or parallelism uses this name): give each "
            "computation its own instance name, or leave it empty to derive it from the identity"
        )
    if reason.startswith("limit_"):
        limit = reason[len("limit_") :]
        where = ""
        if limit in SERVE_QUOTAS:
            where = (
                f": raise [serve] {limit} in the manager's configuration, or run fewer "
                "engine processes against it"
            )
        return f"the manager's limit {limit} ({d.get('limit')}) is reached{where}"
    return f"the manager refused it ({reason}: {detail})"


def message(e: Refused, names: Names, rank: Optional[int] = None) -> str:
    """The sentence for the session's refusal `e`: the refused command, the
    reason, and what to change."""
    reason, error = str(e.args[1]), e.args[3] or {}
    setting = explain(reason, error.get("detail"), names, rank)
    return f"the OrbitKV manager refused {e.command} ({reason}): {setting}"


class RefusalLog:
    """Refusals counted by reason, each logged at error level at most once
    per `interval_s` (by time, not by count, so one that repeats stays
    visible), with how many were not logged since. Thread-safe."""

    def __init__(self, logger: logging.Logger, prefix: str, interval_s: float = 10.0):
        self._logger = logger
        self._prefix = prefix
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        """Refusals by reason since the process started (replaced, never
        mutated, so a reader may keep a reference)."""
        self.last = ""
        """The last refusal's sentence."""
        self._logged_at = -interval_s
        self._unlogged = 0

    def record(self, reason: str, text: str, log: bool = True) -> None:
        """Counts a refusal; logs `text` unless `log` is false (a refusal
        that stops the engine is raised, not logged) or one was logged less
        than the interval ago."""
        with self._lock:
            self.counts = {**self.counts, reason: self.counts.get(reason, 0) + 1}
            self.last = text
            if not log:
                return
            now = time.monotonic()
            if now - self._logged_at < self._interval_s:
                self._unlogged += 1
                return
            more, self._logged_at, self._unlogged = self._unlogged, now, 0
        self._logger.error(
            "%s%s; %s%s",
            self._prefix,
            text,
            "lookups miss and saves are dropped until this is fixed",
            f" ({more} more refusals since the last report)" if more else "",
        )
