"""A subscriber of a manager's KV event stream (`[events]`, docs/events.md).

The stream is vLLM's KV event format: ZMQ multipart ``[topic, seq, payload]``
with one topic per namespace (64 hex digits), ``seq`` counting that topic's
batches (8 bytes, big-endian; a manager starts each topic at a number above
every number an earlier one used), and ``payload`` a msgpack
``KVEventBatch``. :class:`Subscriber` follows it for a router: it keeps, per
topic, the set of (group, block hash) a manager advertises, notices a gap in
a topic's sequence and fills it from the replay socket, and forgets a topic
on ``AllBlocksCleared`` (sent first on every topic in a manager's life, and
whenever the manager lost track of changes) or when it cannot fill a gap.

Needs ``pyzmq`` and ``msgspec`` (``pip install orbitkv[events]``). The
batch classes mirror vLLM 0.33's ``vllm.distributed.kv_events``, so the
payload decodes the same with either.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple, Union

import msgspec
import zmq

BlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change of what a tier holds."""


class BlockStored(KVCacheEvent):
    block_hashes: List[BlockHash]
    parent_block_hash: Optional[BlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[BlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


END_SEQ = -1


def _clears(payload: bytes) -> bool:
    events = decode(payload).events
    return bool(events) and isinstance(events[0], AllBlocksCleared)


def decode(payload: bytes) -> KVEventBatch:
    """One batch's payload, decoded (``msgspec.ValidationError`` if it is
    not a KVEventBatch)."""
    return _decoder.decode(payload)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """Follows a manager's stream at ``publish`` (and ``replay``, to fill
    gaps). ``topics``: namespace hex digits to follow (prefixes), all by
    default. Every wait is bounded by ``timeout`` seconds."""

    def __init__(
        self,
        publish: str,
        replay: Optional[str] = None,
        topics: Iterable[str] = ("",),
        timeout: float = 5.0,
        log_batches: int = 10_000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        for t in topics:
            self._sub.setsockopt(zmq.SUBSCRIBE, t.encode())
        self._sub.connect(publish)
        self._replay_addr = replay
        self.timeout = timeout
        #: topic -> the next sequence number expected.
        self.next_seq: Dict[str, int] = {}
        #: topic -> {(group, block hash)} advertised in some medium and not
        #: removed from it since: what the host holds, anywhere.
        self.held: Dict[str, Set[Tuple[int, BlockHash]]] = {}
        #: topic -> {(group, block hash): {medium}}: where each held page is
        #: (``CPU`` for DRAM, ``STORAGE`` for the SSD).
        self.media: Dict[str, Dict[Tuple[int, BlockHash], Set[str]]] = {}
        #: The last ``log_batches`` batches applied, in order: (topic, seq, batch).
        self.log: Deque[Tuple[str, int, KVEventBatch]] = collections.deque(maxlen=log_batches)
        #: Gaps filled from the replay socket, and gaps it could not fill.
        self.replayed = 0
        self.unfilled = 0
        #: Messages that were not a batch (skipped; their topic forgotten).
        self.malformed = 0
        #: Called as ``on_change(topic, added, removed)`` (sets of
        #: (group, hash)) whenever what a topic holds changes.
        self.on_change = None
        #: Called as ``on_media_change(topic, medium, added, removed)``
        #: (sets of (group, hash)) whenever what one medium of a topic
        #: holds changes.
        self.on_media_change = None

    def close(self) -> None:
        self._sub.close(0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, timeout: Optional[float] = None, max_batches: Optional[int] = None) -> int:
        """Applies the batches that arrive within ``timeout`` (after the
        first, only those already queued), taking at most ``max_batches``;
        returns how many."""
        n = received = 0
        wait_ms = int(1000 * (self.timeout if timeout is None else timeout))
        while (max_batches is None or received < max_batches) and self._sub.poll(wait_ms):
            frames = self._sub.recv_multipart()
            received += 1
            wait_ms = 0
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            topic, seq, payload = frames
            try:
                n += self._arrived(topic.decode(), int.from_bytes(seq, "big"), payload)
            except (msgspec.DecodeError, UnicodeDecodeError):
                # Not a batch this subscriber can follow: the topic is
                # forgotten rather than half-applied.
                self.malformed += 1
                self._forget(topic.decode(errors="replace"))
        return n

    def wait_until(self, done, timeout: Optional[float] = None) -> None:
        """Polls until ``done(self)`` holds (AssertionError past ``timeout``)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not done(self):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the event stream never got there: {self.held}")
            self.poll(min(left, 0.05))

    def catch_up(self, topics: Optional[Iterable[str]] = None) -> None:
        """Applies what the replay socket holds past what was applied, for
        ``topics`` (default: every topic seen). A new subscriber calls it
        once its subscription is in place: batches sent before it joined
        arrive no other way until the topic's next batch shows the gap."""
        for topic in list(self.next_seq if topics is None else topics):
            self._catch(topic, None)

    def _arrived(self, topic: str, seq: int, payload: bytes) -> int:
        want = self.next_seq.get(topic)
        if want is not None and seq < want:
            return 0  # already applied from a replay: numbers never go back
        if seq != want:
            # Missed batches, a restarted manager (its numbers jump ahead),
            # or a late join.
            self._catch(topic, seq)
        self._apply(topic, seq, payload)
        return 1

    def _catch(self, topic: str, upto: Optional[int]) -> None:
        """Applies the run of replayed batches that ends just before
        ``upto`` (or at the last one buffered)."""
        want = self.next_seq.get(topic)
        try:
            replayed = self.replay(topic, want or 0)
        except (TimeoutError, zmq.ZMQError):
            replayed = []  # the manager is not answering: the gap stays unfilled
        got = sorted((b for b in replayed if upto is None or b[1] < upto), key=lambda b: b[1])
        end = upto if upto is not None else (got[-1][1] + 1 if got else None)
        if end is None:
            return
        tail: List[Tuple[str, int, bytes]] = []
        for b in reversed(got):
            if b[1] != end - 1 - len(tail):
                break
            tail.append(b)
        tail.reverse()
        if want is not None and tail and tail[0][1] <= want:
            tail = [b for b in tail if b[1] >= want]  # a continuation
        else:
            # Not a continuation: start from nothing (never over-trust). A
            # run that begins with AllBlocksCleared is a new manager's whole
            # story; anything else after known state is a loss.
            self._forget(topic)
            if want is not None and not (tail and _clears(tail[0][2])):
                self.unfilled += 1
        if tail:
            self.replayed += 1
        for _, seq, payload in tail:
            self._apply(topic, seq, payload)

    def _forget(self, topic: str) -> None:
        gone = self.held.get(topic, set())
        self.held[topic] = set()
        if self.on_media_change is not None:
            by_medium: Dict[str, Set[Tuple[int, BlockHash]]] = {}
            for k, where in self.media.get(topic, {}).items():
                for medium in where:
                    by_medium.setdefault(medium, set()).add(k)
            for medium, keys in by_medium.items():
                self.on_media_change(topic, medium, set(), keys)
        self.media[topic] = {}
        if gone and self.on_change is not None:
            self.on_change(topic, set(), gone)

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        batch = decode(payload)
        held = self.held.setdefault(topic, set())
        media = self.media.setdefault(topic, {})
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self._forget(topic)
                held = self.held[topic]
                media = self.media[topic]
                continue
            keys = {(ev.group_idx or 0, h) for h in ev.block_hashes}
            medium = ev.medium or ""
            added, removed = set(), set()
            came, went = set(), set()
            for k in keys:
                where = media.get(k)
                if isinstance(ev, BlockStored):
                    if where is None:
                        media[k] = {medium}
                        added.add(k)
                        came.add(k)
                    elif medium not in where:
                        where.add(medium)
                        came.add(k)
                elif where is not None and medium in where:
                    where.discard(medium)
                    went.add(k)
                    if not where:
                        del media[k]
                        removed.add(k)
            held |= added
            held -= removed
            if (came or went) and self.on_media_change is not None:
                self.on_media_change(topic, medium, came, went)
            if (added or removed) and self.on_change is not None:
                self.on_change(topic, added, removed)
        self.next_seq[topic] = seq + 1
        self.log.append((topic, seq, batch))

    def replay(self, topic: Optional[str], start: int) -> List[Tuple[str, int, bytes]]:
        """The batches the manager still buffers from ``start`` on (of
        ``topic``, or of every topic), as (topic, seq, payload)."""
        if self._replay_addr is None:
            return []
        # A DEALER with REQ's empty delimiter: one request, many replies.
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self._replay_addr)
            start_b = start.to_bytes(8, "big")
            parts = [topic.encode(), start_b] if topic is not None else [start_b]
            req.send_multipart([b"", *parts])
            out = []
            while True:
                if not req.poll(int(1000 * self.timeout)):
                    raise TimeoutError(f"no replay from {self._replay_addr} in {self.timeout}s")
                t, s, p = req.recv_multipart()[-3:]
                seq = int.from_bytes(s, "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((t.decode(), seq, p))
        finally:
            req.close(0)
