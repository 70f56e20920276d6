"""OrbitKV's pages in vLLM's own KV events (`take_events`), so vLLM's
existing publisher (``--kv-events-config``) tells a router what this
engine can load from OrbitKV, with nothing new for the operator to wire.

The scheduler follows the manager's event stream (``[events]``,
docs/events.md) for the instance's namespaces, one per rank. A page is
advertised in a medium (`BlockStored`, ``CPU`` for the manager's DRAM,
``STORAGE`` for its SSD) once the manager holds it there on every rank,
which is when a load of it from there can succeed, and withdrawn
(`BlockRemoved`) as soon as one rank lost it there, or the stream could
not be followed. The token ids and parent hash of pages this engine saved are
recorded when it plans the save (bounded); pages other engines of the same
computation stored are advertised with empty token ids.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from .. import events as stream

log = logging.getLogger("orbitkv.vllm")

#: Saved pages whose token ids are remembered for their events.
MAX_TRACKED_PAGES = 1 << 20
#: Manager batches taken per `take_events` call (the rest wait a step).
MAX_BATCHES_PER_STEP = 256
#: When (seconds after subscribing) to fetch from the replay socket what
#: was sent before the subscription took effect.
CATCH_UP_AFTER_S = (0.0, 0.5, 2.0)

Key = Tuple[str, int, bytes]  # (medium, storage group, block hash)


class GroupInfo:
    """How one storage group shows in vLLM's events."""

    def __init__(self, vllm_group: int, spec: Any):
        self.vllm_group = vllm_group
        self.kind = get_kv_cache_spec_kind(spec).value
        self.window = get_kv_cache_spec_sliding_window(spec)


class ConnectorEvents:
    """Turns the manager's per-rank stream into vLLM events for one
    instance. ``namespaces()`` gives the instance's namespaces (hex, one
    per rank) once the scheduler is connected, else None."""

    def __init__(
        self,
        publish: str,
        replay: Optional[str],
        groups: Dict[int, GroupInfo],
        page_tokens: int,
        namespaces,
        max_tracked: int = MAX_TRACKED_PAGES,
    ):
        self._publish, self._replay = publish, replay
        self._groups = groups
        self._page_tokens = page_tokens
        self._namespaces = namespaces
        self._sub: Optional[stream.Subscriber] = None
        self._topics: List[str] = []
        #: key -> ranks holding it; advertised when all do.
        self._ranks: Dict[Key, int] = {}
        self._out: List[KVCacheEvent] = []
        #: hash -> (token ids, parent hash) of pages this engine saved.
        self._tokens: Dict[bytes, Tuple[Tuple[int, ...], Optional[bytes]]] = {}
        self._order: Deque[bytes] = collections.deque()
        self._max_tracked = max_tracked
        self._catch_ups: List[float] = []

    def record_save(self, block_hash: bytes, tokens: Tuple[int, ...], parent: Optional[bytes]) -> None:
        if block_hash in self._tokens:
            return
        if len(self._order) >= self._max_tracked:
            self._tokens.pop(self._order.popleft(), None)
        self._tokens[block_hash] = (tokens, parent)
        self._order.append(block_hash)

    def take(self) -> List[KVCacheEvent]:
        """The events since the last call. Never waits."""
        if self._sub is None and not self._open():
            return []
        assert self._sub is not None
        self._sub.poll(0, max_batches=MAX_BATCHES_PER_STEP)
        if self._catch_ups and time.monotonic() >= self._catch_ups[0]:
            # What the manager sent before the subscription took effect
            # (ZMQ joins in its own time): from its replay buffer.
            self._catch_ups.pop(0)
            self._sub.catch_up(self._topics)
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()
            self._sub = None

    def _open(self) -> bool:
        names = self._namespaces()
        if not names:
            return False  # not connected yet: nothing is advertised
        self._topics = list(names)
        self._sub = stream.Subscriber(self._publish, self._replay, topics=self._topics, timeout=0.2)
        self._sub.on_media_change = self._changed
        now = time.monotonic()
        self._catch_ups = [now + d for d in CATCH_UP_AFTER_S]
        log.info("OrbitKV: KV events from %s for %d namespace(s)", self._publish, len(self._topics))
        return True

    def _changed(self, topic: str, medium: str, added_: Set[Tuple[int, bytes]], removed_: Set[Tuple[int, bytes]]) -> None:
        if topic not in self._topics:
            return
        added = {(medium, g, h) for g, h in added_}
        removed = {(medium, g, h) for g, h in removed_}
        full = len(self._topics)
        gone: List[Key] = []
        for key in removed:
            n = self._ranks.get(key, 0)
            if n == full:
                gone.append(key)
            if n <= 1:
                self._ranks.pop(key, None)
            else:
                self._ranks[key] = n - 1
        came: List[Key] = []
        for key in added:
            n = self._ranks.get(key, 0) + 1
            self._ranks[key] = n
            if n == full:
                came.append(key)
        for where, group, h in sorted(gone):
            info = self._groups.get(group)
            if info is not None:
                self._out.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(h)],
                        medium=where or MEDIUM_CPU,
                        group_idx=info.vllm_group,
                        locality="LOCAL",
                    )
                )
        for where, group, h in came:
            info = self._groups.get(group)
            if info is None:
                continue
            tokens, parent = self._tokens.get(h, ((), None))
            self._out.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h)],
                    parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                    token_ids=list(tokens),
                    block_size=self._page_tokens,
                    lora_id=None,
                    medium=where or MEDIUM_CPU,
                    lora_name=None,
                    group_idx=info.vllm_group,
                    kv_cache_spec_kind=info.kind,
                    kv_cache_spec_sliding_window=info.window,
                    locality="LOCAL",
                )
            )
