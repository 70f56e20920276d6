"""The worker role: runs the loads and saves the scheduler planned.

By default the blocks (host or CUDA memory) are agent-owned regions
(`AgentPageMover`): a load restores straight into the request's blocks (the
client's copy agent runs the copies on the manager's instruction: memcpy
workers for host memory, the CUDA copy engine for CUDA memory) and is
reported once `restore_done` says every byte landed; a save publishes
straight from the blocks, and `wait_for_save` returns only once its
publishes answered, so no block is read after the step that wrote it. The
staged path below (`HostPageMover`) remains for ``copy_agent: false``.

- Saves: at `wait_for_save`, the pages this step completed are copied from
  the engine's blocks into staging slots (`PageMover.stage`) before the
  call returns. The engine's model runner zeroes, copies into and reuses
  blocks at the start of the next step, before any connector hook runs, so
  no engine block is read after the step that wrote it. The staged pages
  are then published by the I/O thread; a slot is reused only after its
  `publish_done` (the runtime pins it until its copy landed).
- The I/O thread owns the manager connection. A load is a query with
  prepare on this worker's own session, a copy of this rank's leased pages
  into the request's blocks, then a release. The release doubles as a
  fence: it succeeds only while the leases are still held, so a copy that
  raced a lease expiry is reported as a failed load (recompute), never used.

Results go back to vLLM through `get_transfer_results` (finished and failed
loads, finished saves of finished requests) and
`get_block_ids_with_load_errors`.

Layer-wise loads (``load_mode: "layerwise"``, copy agent, one KV cache
group): the scheduler counts the hit as a synchronous load, `start_loads`
issues the step's loads, the agent restores each layer as its own copy
batch (in layer order) and counts per layer the pages that landed or
failed. `wait_layer(layer)` returns once, for that layer, every page the
step's restores target is counted (or every load of the step is over):
later layers keep copying while it computes. Before the step's results are
reported (`transfer_results`), every load of the step has ended; a failed
one marks its blocks invalid (`get_block_ids_with_load_errors`), so vLLM
recomputes them and discards the step's output for the request. A layer
that does not land within `timeout_s` fails the step's loads and drops the
connection (the agent waits for its running copies first), so no copy
writes a block after the step gave up on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from .copy import AgentPageMover, EngineBlocks, HostPageMover, PageMover
from .engine import EngineSpec
from .link import LINK_ERRORS, ManagerError, ManagerLink, Refused, Unavailable
from .metadata import NULL_BLOCK, LoadSpec, OrbitKVMetadata, SaveSpec
from .settings import ConfigError, ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

POLL_S = 0.002
"""How long the I/O thread waits for the manager while work is in flight,
before it looks at new jobs again."""


@dataclass
class WorkerStats:
    loads: int = 0
    loads_failed: int = 0
    pages_loaded: int = 0
    pages_published: int = 0
    pages_dropped: int = 0
    publishes_failed: int = 0
    failures_by_reason: Dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        # Copied, not updated in place: the engine thread may be reporting
        # the old one while the I/O thread counts.
        self.failures_by_reason = {
            **self.failures_by_reason,
            reason: self.failures_by_reason.get(reason, 0) + 1,
        }


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    operation: Optional[int] = None
    selected: int = 0
    pages: int = 0
    release_command: Optional[int] = None
    #: Agent path: the device pages the restore targets (the slot table's:
    #: they outlive the load).
    device_pages: List[int] = field(default_factory=list)
    restoring: bool = False
    #: Agent path: one `load` command (query, prepare and restore in one
    #: round trip); the block of each (group, page end) it names.
    load: bool = False
    targets: Dict[Tuple[int, int], int] = field(default_factory=dict)


@dataclass
class _StepLoad:
    """A layer-wise load of the current step, as the engine thread waits
    on it. Guarded by `WorkerSide._lock`."""

    spec: LoadSpec
    #: "pending" (no restore sent yet), "copying" (restore sent), "done".
    state: str = "pending"
    #: Pages per group its restore sent to the agent.
    pages: Dict[int, int] = field(default_factory=dict)
    #: The step gave up on it (a layer timed out): it fails even if its
    #: copies complete later.
    abandoned: bool = False
    #: It ended short of its boundary: the step computed past pages that
    #: did not land.
    failed: bool = False


@dataclass
class _Step:
    loads: Dict[str, _StepLoad]
    #: Per group, the agent's per-layer (landed, failed) counts when the
    #: step started; None when they could not be read (then layers wait for
    #: the whole loads).
    base: Optional[Dict[int, List[Tuple[int, int]]]]


@dataclass
class _Publish:
    req_id: str
    gid: int
    generation: int
    slots: List[int]
    hashes: List[bytes]
    deadline: float = 0.0
    #: Agent path: the engine blocks published, their device pages, and
    #: what `wait_for_save` waits on.
    blocks: List[int] = field(default_factory=list)
    device_pages: List[int] = field(default_factory=list)
    done: Optional[threading.Event] = None


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        spec: EngineSpec,
        rank: int,
        num_blocks: int,
    ):
        self.settings = settings
        self.spec = spec
        self.rank = rank
        self.num_blocks = num_blocks
        self.stats = WorkerStats()
        self.mover: Optional[PageMover] = None
        self.link = ManagerLink(
            settings, spec, f"vllm-worker-{rank}", self._on_connect, rank=rank
        )

        self._lock = threading.Lock()
        # Guarded by _lock:
        self._generation = 0
        self._free_slots: Dict[int, List[int]] = {}
        self._pending_saves: Dict[str, int] = {}
        self._had_saves: Set[str] = set()
        self._finishing: Set[str] = set()
        self._loaded: Set[str] = set()
        self._failed: Set[str] = set()
        self._invalid_blocks: Set[int] = set()
        self._connected = False

        self._step: Optional[_Step] = None
        self._changed = threading.Condition(self._lock)
        self.layerwise = settings.load_mode == "layerwise"

        self._meta: Optional[OrbitKVMetadata] = None
        self._loads_started = False
        self._saves_queued = False
        self._reported_invalid: Set[int] = set()
        self._io_q: "queue.Queue[Any]" = queue.Queue()
        #: The I/O thread's slot table (`_IoState.slots`), readable here.
        self.slot_table: Dict[Tuple[int, int], int] = {}
        self._threads: List[threading.Thread] = []
        self._stopping = False

    # setup ----------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Dict[str, Any], mover: Optional[PageMover] = None
    ) -> None:
        blocks = EngineBlocks(self.spec, kv_caches, self.num_blocks)
        if mover is None and self.settings.copy_agent:
            mover = AgentPageMover(
                blocks, self.rank, self.settings.timeout_s, layered=self.layerwise
            )
        if self.layerwise and not isinstance(mover, AgentPageMover):
            raise ConfigError("load_mode 'layerwise' needs the copy agent's page mover")
        self.mover = mover or HostPageMover(
            blocks, self.rank, self.settings.staging_pages, self.settings.timeout_s
        )
        self._threads = [
            threading.Thread(target=self._io_loop, name=f"orbitkv-io-{self.rank}", daemon=True),
        ]
        # Connect now, so that the first steps' saves have somewhere to go;
        # a manager that is down only delays that (the I/O thread retries),
        # one that refuses this worker (its rank, its layout) stops the
        # engine here with the setting to change.
        self.link.connect_at_startup()
        for t in self._threads:
            t.start()

    def _on_connect(self, client: Any, session: Dict[str, Any]) -> None:
        assert self.mover is not None
        self.mover.connect(client, session)
        with self._lock:
            self._generation += 1
            self._free_slots = {
                g.id: list(range(self.mover.staging_slots(g.id))) for g in self.spec.groups
            }
            self._connected = True

    # engine-thread hooks --------------------------------------------------

    def bind(self, meta: OrbitKVMetadata) -> None:
        self._meta = meta
        self._loads_started = False
        self._saves_queued = False

    def start_loads(self) -> None:
        meta = self._meta
        if meta is None or self._loads_started:
            return
        self._loads_started = True
        if self.layerwise:
            self._begin_step(meta.loads)
        for load in meta.loads:
            self.stats.loads += 1
            if self.mover is None or self._io_q.qsize() >= self.settings.max_pending_jobs:
                self._finish_load(load, None, "overloaded")
                continue
            self._io_q.put(("load", load))

    def queue_saves(self) -> None:
        meta = self._meta
        if meta is None or self._saves_queued:
            return
        self._saves_queued = True
        waits: List[_Publish] = []
        # Layer-wise: a request whose load failed this step computed its new
        # tokens over pages that never landed, so what it computed is wrong
        # in a real model. vLLM recomputes it; those pages are saved then
        # (the scheduler rewinds its saved pages), never now.
        unsound = self._failed_step_loads() if self.layerwise else set()
        for save in meta.saves:
            if save.req_id in unsound:
                self.stats.pages_dropped += len(save.items)
                self.stats.fail("save_after_failed_load")
                continue
            with self._lock:
                self._had_saves.add(save.req_id)
            jobs: List[_Publish] = []
            try:
                jobs = self._gather(save)
            except Exception:  # a copy error drops the save, never the engine
                log.exception("OrbitKV: staging the pages of %s failed", save.req_id)
            with self._lock:
                n = self._pending_saves.get(save.req_id, 0)
                self._pending_saves[save.req_id] = n + len(jobs)
            for job in jobs:
                self._io_q.put(("publish", job))
            waits.extend(jobs)
        self._wait_published(waits)

    def _wait_published(self, jobs: List[_Publish]) -> None:
        """Agent path: the copies read the engine's blocks, so the step may
        not end before they answered. Bounded: a publish past its deadline
        makes the I/O thread drop the connection, whose agent waits for its
        running copies before the failure is reported."""
        bound = time.monotonic() + 2 * self.settings.timeout_s + 15.0
        for job in jobs:
            if job.done is not None:
                job.done.wait(max(0.0, bound - time.monotonic()))

    # layer-wise loads ------------------------------------------------------

    def _begin_step(self, loads: List[LoadSpec]) -> None:
        """Records the step's loads and the agent's per-layer counts before
        any of their restores is sent (the previous step's loads all ended
        in its `transfer_results`)."""
        base: Optional[Dict[int, List[Tuple[int, int]]]] = {}
        if loads:
            try:
                for g in self.spec.groups:
                    counts = self.mover.layer_counts(g.id)  # type: ignore[union-attr]
                    if counts is None:
                        base = None
                        break
                    base[g.id] = counts
            except Exception:  # not connected, or a closed client
                base = None
        with self._lock:
            self._step = _Step(loads={l.req_id: _StepLoad(l) for l in loads}, base=base)

    def _step_load(self, spec: LoadSpec) -> Optional[_StepLoad]:
        """The current step's record of `spec` (caller holds `_lock`)."""
        step = self._step
        sl = step.loads.get(spec.req_id) if step is not None else None
        return sl if sl is not None and sl.spec is spec else None

    def _mark(self, spec: LoadSpec, state: str, pages: Optional[Dict[int, int]] = None) -> None:
        with self._lock:
            sl = self._step_load(spec)
            if sl is not None and sl.state != "done":
                sl.state = state
                if pages is not None:
                    sl.pages = pages
                self._changed.notify_all()

    def wait_layer(self, layer_name: str) -> None:
        """Layer-wise: returns once every page the step's restores target in
        `layer_name`'s group has that layer's bytes landed or failed, or
        every load of the step ended. Bounded by `timeout_s`: past it the
        step's loads fail and the connection is dropped (see module docs)."""
        if not self.layerwise or self.mover is None:
            return
        pos = self.mover.blocks.layer_pos.get(layer_name)
        with self._lock:
            step = self._step
        if step is None or not step.loads or pos is None:
            return
        gid, idx = pos
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            with self._lock:
                loads = list(step.loads.values())
                if all(sl.state == "done" for sl in loads):
                    return
                sending = any(sl.state == "pending" for sl in loads)
                expected = sum(sl.pages.get(gid, 0) for sl in loads if sl.state != "pending")
            if not sending and step.base is not None and self._layer_landed(step, gid, idx, expected):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self._give_up(step, f"layer {layer_name} did not load within {self.settings.timeout_s}s")
                return
            with self._lock:
                # Woken by a load's progress; the agent's counts change
                # without a notification, so look again soon.
                self._changed.wait(min(left, 0.0005))

    def _layer_landed(self, step: _Step, gid: int, idx: int, expected: int) -> bool:
        try:
            now = self.mover.layer_counts(gid)  # type: ignore[union-attr]
        except Exception:
            return False
        base = (step.base or {}).get(gid)
        if now is None or base is None or idx >= len(now) or idx >= len(base):
            return False
        done = (now[idx][0] - base[idx][0]) + (now[idx][1] - base[idx][1])
        return done >= expected

    def _give_up(self, step: _Step, why: str) -> None:
        """A layer timed out: the step's unfinished loads fail (even if their
        copies land later) and the I/O thread drops the connection, whose
        agent waits for running copies; returns once the loads ended."""
        log.warning("OrbitKV: %s; the step's loads fail", why)
        with self._lock:
            for sl in step.loads.values():
                sl.abandoned = True
        self._io_q.put(("lost", why))
        self._wait_step_done(step, 2 * self.settings.timeout_s + 15.0)

    def _wait_step_done(self, step: _Step, bound_s: float) -> bool:
        deadline = time.monotonic() + bound_s
        with self._lock:
            while not all(sl.state == "done" for sl in step.loads.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
        return True

    def _settle_step(self) -> Optional[_Step]:
        """Layer-wise: waits (bounded) until every load of the step ended;
        returns the step."""
        with self._lock:
            step = self._step
        if step is not None and step.loads:
            if not self._wait_step_done(step, self.settings.timeout_s):
                self._give_up(step, "the step's loads did not end in time")
        return step

    def _failed_step_loads(self) -> Set[str]:
        step = self._settle_step()
        with self._lock:
            return {r for r, sl in (step.loads if step else {}).items() if sl.failed}

    def end_step(self) -> None:
        """Layer-wise: every load of the step ends before its results are
        reported, so a failed one is in this step's load errors."""
        step = self._settle_step()
        with self._lock:
            if self._step is step:
                self._step = None

    def transfer_results(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving)."""
        if self.layerwise:
            self.end_step()
        with self._lock:
            self._finishing |= finished_req_ids & self._had_saves
            sending = {r for r in self._finishing if self._pending_saves.get(r, 0) == 0}
            for r in sending:
                self._finishing.discard(r)
                self._had_saves.discard(r)
                self._pending_saves.pop(r, None)
            recving = set(self._loaded) | set(self._failed)
            failed = set(self._failed)
            self._loaded.clear()
            self._failed.clear()
            self._reported_invalid = set(self._invalid_blocks)
            self._invalid_blocks.clear()
        return sending, recving, failed

    def load_errors(self) -> Set[int]:
        out, self._reported_invalid = self._reported_invalid, set()
        return out

    def shutdown(self) -> None:
        self._stopping = True
        self._io_q.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(self.settings.timeout_s)
        self.link.close()

    # results ----------------------------------------------------------------

    def _finish_load(self, load: LoadSpec, selected: Optional[int], failure: Optional[str]) -> None:
        """Reports a load: tokens [origin, boundary) are in the engine's
        blocks up to `selected` (None: nothing usable)."""
        page = self.spec.page_tokens
        good = selected if failure is None and selected is not None else load.origin
        good = max(load.origin, min(good, load.boundary))
        if failure is not None:
            self.stats.loads_failed += 1
            self.stats.fail(failure)
            log.info("OrbitKV load of %s failed (%s): recomputing", load.req_id, failure)
        with self._lock:
            sl = self._step_load(load)
            if sl is not None:
                sl.state = "done"
                self._changed.notify_all()
                if sl.abandoned and failure is None:
                    # The step gave up on it before it landed: vLLM must
                    # recompute what the forward read.
                    failure = "layer_timeout"
                    good = load.origin
                    self.stats.loads_failed += 1
                    self.stats.fail(failure)
        # Block-level errors exist only with one group (layer-wise loads and
        # `single_prefix_group`): that group's blocks past what landed.
        lost = load.block_ids[self.spec.groups[0].vllm_group][good // page : load.boundary // page]
        with self._lock:
            if sl is not None:
                # A synchronous load: nothing to report as received; the
                # blocks past what landed are invalid.
                sl.failed = good < load.boundary
                if good < load.boundary:
                    self._invalid_blocks.update(b for b in lost if b != NULL_BLOCK)
            elif good >= load.boundary:
                self._loaded.add(load.req_id)
            elif self.spec.single_prefix_group:
                # vLLM keeps the pages before the first bad block.
                self._invalid_blocks.update(b for b in lost if b != NULL_BLOCK)
                self._loaded.add(load.req_id)
            else:
                # Several groups: block ids are per group, so vLLM takes a
                # failure per request (and recomputes it from scratch).
                self._failed.add(load.req_id)

    def _publish_done(
        self, job: _Publish, answer: Optional[Dict[str, Any]], free_slots: bool = True
    ) -> None:
        """Ends a publish: `answer` is its `publish_done`, or None when it
        failed. Pages the manager had no room for (`dropped`) count as
        dropped saves; pages it already held (`duplicates`) as published."""
        with self._lock:
            if free_slots and job.generation == self._generation:
                self._free_slots.setdefault(job.gid, []).extend(job.slots)
            n = self._pending_saves.get(job.req_id, 0)
            assert n > 0, f"save accounting of {job.req_id} went below zero"
            self._pending_saves[job.req_id] = n - 1
        if job.done is not None:
            job.done.set()
        if answer is None:
            self.stats.publishes_failed += 1
            return
        self.stats.pages_published += int(answer.get("inserted", 0)) + int(
            answer.get("duplicates", 0)
        )
        self.stats.pages_dropped += int(answer.get("dropped", 0))

    # saves ------------------------------------------------------------------

    def _gather(self, save: SaveSpec) -> List[_Publish]:
        assert self.mover is not None
        jobs: List[_Publish] = []
        batch = self.settings.publish_batch_pages
        for group in self.spec.groups:
            vi = group.vllm_group
            pages = [
                (it.hash, it.block_ids[vi]) for it in save.items if it.block_ids[vi] != NULL_BLOCK
            ]
            if not pages:
                continue
            with self._lock:
                if not self._connected:
                    self.stats.pages_dropped += len(pages)
                    self._io_q.put(("connect",))
                    continue
                generation = self._generation
            if getattr(self.mover, "direct", False):
                self.mover.blocks.check_blocks([b for _, b in pages])
                for i in range(0, len(pages), batch):
                    part = pages[i : i + batch]
                    jobs.append(
                        _Publish(
                            req_id=save.req_id,
                            gid=group.id,
                            generation=generation,
                            slots=[],
                            hashes=[h for h, _ in part],
                            blocks=[b for _, b in part],
                            done=threading.Event(),
                        )
                    )
                continue
            with self._lock:
                free = self._free_slots.get(group.id, [])
                take = min(len(pages), len(free))
                slots = [free.pop() for _ in range(take)]
                generation = self._generation
            if take < len(pages):
                self.stats.pages_dropped += len(pages) - take
                pages = pages[:take]
            if not slots:
                continue
            try:
                self.mover.stage(group.id, slots, [b for _, b in pages])
            except Exception:
                with self._lock:
                    if generation == self._generation:
                        self._free_slots.setdefault(group.id, []).extend(slots)
                raise
            for i in range(0, len(slots), batch):
                jobs.append(
                    _Publish(
                        req_id=save.req_id,
                        gid=group.id,
                        generation=generation,
                        slots=slots[i : i + batch],
                        hashes=[h for h, _ in pages[i : i + batch]],
                    )
                )
        return jobs

    # I/O thread ---------------------------------------------------------------

    def _io_loop(self) -> None:
        io = _IoState(self)
        while True:
            try:
                first = self._io_q.get(timeout=POLL_S if io.busy() else 0.2)
            except queue.Empty:
                first = ()
            items = [first]
            while True:
                try:
                    items.append(self._io_q.get_nowait())
                except queue.Empty:
                    break
            if not self.link.up:
                # Keep trying a manager that went away (rate-limited by the
                # link), so saves resume without waiting for a load.
                items.insert(0, ("connect",))
            for item in items:
                if item is None:
                    io.abandon("shutdown")
                    return
                if item:
                    _guard(io.start, item)
            _guard(io.pump)


def _guard(fn, *args) -> None:
    """Runs one step of the I/O thread; a bug in one step is logged, and the
    thread keeps serving (a dead I/O thread would stall every load)."""
    try:
        fn(*args)
    except Exception:
        log.exception("OrbitKV worker I/O step failed")


class _IoState:
    """The I/O thread's in-flight work, keyed by command id and operation."""

    def __init__(self, w: WorkerSide):
        self.w = w
        self.by_command: Dict[int, Tuple[str, Any]] = {}
        self.by_operation: Dict[int, _Load] = {}
        self.loads: List[_Load] = []
        self.publishes: List[_Publish] = []
        #: Events that arrived while a step waited for its own replies.
        self.deferred: List[Dict[str, Any]] = []
        #: The slot table: the device page of each (agent region, block),
        #: allocated on the block's first load or save and kept for the
        #: connection's life (its regions end with it), so loads and saves
        #: send no allocation or free rounds. Generation fencing is the
        #: manager's, as before; `slots_of` is the link generation it
        #: belongs to.
        self.slots: Dict[Tuple[int, int], int] = w.slot_table
        self.slots_of = -1

    def busy(self) -> bool:
        return bool(self.by_command or self.by_operation or self.deferred)

    def client(self):
        return self.w.link.get()

    def lost(self, why: str) -> None:
        """The connection failed: everything in flight fails; publishes'
        slots belong to the old regions and are not reused."""
        self.w.link.drop(why)
        with self.w._lock:
            self.w._connected = False
        self.abandon(why)

    def abandon(self, why: str) -> None:
        for kind, job in list(self.by_command.values()):
            if kind == "publish":
                self.w._publish_done(job, None, free_slots=False)
        done = {id(j) for j in self.by_operation.values()}
        for kind, job in list(self.by_command.values()):
            if kind in ("query", "release") and id(job) not in done:
                done.add(id(job))
                self.w._finish_load(job.spec, None, why)
        for job in self.by_operation.values():
            self.w._finish_load(job.spec, None, why)
        self.by_command.clear()
        self.by_operation.clear()

    # starting work

    def start(self, item: Tuple[Any, ...]) -> None:
        kind = item[0]
        try:
            if kind == "connect":
                self.client()
            elif kind == "lost":
                if self.w.link.up:
                    self.lost(item[1])
                else:
                    self.abandon(item[1])
            elif kind == "load":
                self.start_load(item[1])
            elif kind == "publish":
                self.start_publish(item[1])
        except Refused as e:
            # Counted and logged (error level) by the link.
            if kind == "load":
                self.w._finish_load(item[1], None, f"refused_{e.reason}")
            elif kind == "publish":
                self.w.stats.fail(f"publish_refused_{e.reason}")
                self.w._publish_done(item[1], None, free_slots=False)
        except Unavailable as e:
            if kind == "load":
                self.w._finish_load(item[1], None, "unavailable")
            elif kind == "publish":
                self.w._publish_done(item[1], None, free_slots=False)
            log.debug("OrbitKV %s skipped: %s", kind, e)
        except LINK_ERRORS as e:
            if kind == "load":
                self.w._finish_load(item[1], None, "unavailable")
            elif kind == "publish":
                self.w._publish_done(item[1], None, free_slots=False)
            self.lost(f"{type(e).__name__}: {e}")

    def start_load(self, spec: LoadSpec) -> None:
        client, session = self.client()
        page = self.w.spec.page_tokens
        if spec.boundary % page or spec.origin % page or spec.boundary <= spec.origin:
            self.w._finish_load(spec, None, "misaligned")
            return
        mover = self.w.mover
        if isinstance(mover, AgentPageMover):
            self.start_agent_load(spec, mover)
            return
        cid = client.submit(self.query_fields("query", session, spec, prepare=True))
        job = _Load(spec=spec, deadline=time.monotonic() + self.w.settings.timeout_s)
        self.by_command[cid] = ("query", job)

    def query_fields(self, command: str, session: Dict[str, Any], spec: LoadSpec, **more: Any) -> Dict[str, Any]:
        """A `query` or `load` of `spec`'s pages, with `more` fields."""
        hashes = [h.hex() for h in spec.hashes]
        return {
            "command": command,
            "session": session,
            "request": hash(spec.req_id) & 0x7FFF_FFFF_FFFF_FFFF,
            "groups": [{"group": g.id, "hashes": hashes} for g in self.w.spec.groups],
            "origin": spec.origin,
            # The scheduler counted on `boundary`: select nothing beyond.
            "prompt_len": spec.boundary + 1,
            "expect_namespaces": self.w.link.namespaces,
            **more,
        }

    def start_agent_load(self, spec: LoadSpec, mover: AgentPageMover) -> None:
        """One `load`: every page of this rank up to the boundary names its
        block's device page (the slot table's) or, with no block (vLLM's
        null block), is attested held; the runtime restores the ranges it
        selects and answers `restore_done` or `miss`."""
        client, session = self.client()
        page = self.w.spec.page_tokens
        rank = self.w.rank
        pages = min(spec.boundary // page, len(spec.hashes))
        job = _Load(spec=spec, deadline=time.monotonic() + self.w.settings.timeout_s, load=True)
        retained: List[Dict[str, int]] = []
        per_group: Dict[int, List[Tuple[int, int]]] = {}
        for g in self.w.spec.groups:
            blocks = spec.block_ids[g.vllm_group]
            for idx in range(min(pages, len(blocks))):
                if blocks[idx] == NULL_BLOCK:
                    retained.append({"rank": rank, "group": g.id, "page_end": (idx + 1) * page})
                else:
                    per_group.setdefault(g.id, []).append((idx, blocks[idx]))
        targets: List[Dict[str, Any]] = []
        try:
            mover.blocks.check_blocks([b for ps in per_group.values() for _, b in ps])
            for gid, ps in per_group.items():
                dps = self.alloc_pages(mover.region(gid), [b for _, b in ps])
                job.device_pages += dps
                for (idx, block), dp in zip(ps, dps):
                    pos = {"rank": rank, "group": gid, "page_end": (idx + 1) * page}
                    targets.append({"pos": pos, "device_page": dp})
                    job.targets[(gid, (idx + 1) * page)] = block
        except (RuntimeError, ValueError) as e:
            log.info("OrbitKV: load of %s: %s", spec.req_id, e)
            self.w._finish_load(spec, None, "restore_alloc")
            return
        cmd = self.query_fields("load", session, spec, ranks=[rank], targets=targets, retained=retained)
        cid = client.submit(cmd)
        self.by_command[cid] = ("query", job)

    def alloc_pages(self, region: int, blocks: List[int]) -> List[int]:
        """Device pages for blocks of an agent region, from the slot table;
        the blocks not in it yet are allocated in one pipelined round
        (other events meanwhile are kept for `pump`). Raises
        `RuntimeError` on a refusal (the pages it got stay in the table)."""
        client, session = self.client()
        if self.slots_of != self.w.link.generation:
            self.slots.clear()
            self.slots_of = self.w.link.generation
        missing = sorted({b for b in blocks if (region, b) not in self.slots})
        ids = {
            client.submit(
                {"command": "device_page_alloc", "session": session, "region": region, "slot": b}
            ): b
            for b in missing
        }
        refused: Optional[str] = None
        want = set(ids)
        deadline = time.monotonic() + self.w.settings.timeout_s
        while want:
            left = deadline - time.monotonic()
            ev = client.wait_event(left) if left > 0 else None
            if ev is None:
                raise TimeoutError("device page allocation timed out")
            cid = ev.get("command")
            if cid not in want:
                self.deferred.append(ev)
                continue
            want.discard(cid)
            if ev.get("event") == "device_page_allocated":
                self.slots[(region, ids[cid])] = ev["device_page"]
            else:
                refused = (ev.get("error") or {}).get("error", ev.get("event"))
        if refused is not None:
            raise RuntimeError(f"device page allocation refused: {refused}")
        return [self.slots[(region, b)] for b in blocks]

    def start_agent_publish(self, job: _Publish, mover: AgentPageMover) -> None:
        client, session = self.client()
        try:
            job.device_pages = self.alloc_pages(mover.region(job.gid), job.blocks)
        except RuntimeError as e:
            self.w.stats.fail("publish_alloc")
            log.info("OrbitKV: publish of %s skipped: %s", job.req_id, e)
            self.w._publish_done(job, None)
            return
        pages = [
            {"rank": self.w.rank, "group": job.gid, "hash": h.hex(), "device_page": dp}
            for h, dp in zip(job.hashes, job.device_pages)
        ]
        cid = client.submit({"command": "publish", "session": session, "request": 0, "pages": pages})
        job.deadline = time.monotonic() + self.w.settings.timeout_s
        self.by_command[cid] = ("publish", job)

    def start_publish(self, job: _Publish) -> None:
        with self.w._lock:
            stale = job.generation != self.w._generation or not self.w._connected
        if stale:
            self.w._publish_done(job, None, free_slots=False)
            return
        client, session = self.client()
        mover = self.w.mover
        assert mover is not None
        if isinstance(mover, AgentPageMover):
            self.start_agent_publish(job, mover)
            return
        pages = [
            {
                "rank": self.w.rank,
                "group": job.gid,
                "hash": h.hex(),
                "device_page": mover.source_page(job.gid, slot),
            }
            for slot, h in zip(job.slots, job.hashes)
        ]
        cid = client.submit(
            {"command": "publish", "session": session, "request": 0, "pages": pages}
        )
        job.deadline = time.monotonic() + self.w.settings.timeout_s
        self.by_command[cid] = ("publish", job)

    # answers

    def pump(self) -> None:
        if not self.busy():
            self.check_alive()
            return
        try:
            client, _ = self.client()
            events, self.deferred = self.deferred, []
            first = client.wait_event(0.0 if events else POLL_S)
            if first is not None:
                events.append(first)
                events += client.poll_events()
            for ev in events:
                self.dispatch(ev)
        except Refused as e:
            self.abandon(f"refused_{e.reason}")
        except Unavailable:
            self.abandon("unavailable")
        except LINK_ERRORS as e:
            self.lost(f"{type(e).__name__}: {e}")
        self.expire()

    def check_alive(self) -> None:
        """While idle, notices a manager that went away (a closed socket),
        so the worker reconnects before the next save needs it."""
        if not self.w.link.up:
            return
        try:
            self.w.link.client.poll_events()
        except LINK_ERRORS as e:
            self.lost(f"{type(e).__name__}: {e}")

    def dispatch(self, ev: Dict[str, Any]) -> None:
        kind = ev.get("event")
        cid = ev.get("command")
        if cid is not None and cid in self.by_command:
            what, job = self.by_command.pop(cid)
            if what == "publish":
                ok = kind == "publish_done"
                if not ok:
                    self.w.stats.fail(f"publish_{(ev.get('error') or {}).get('error', kind)}")
                # A refused publish had no effect: its slots are free again.
                self.w._publish_done(job, ev if ok else None)
            elif what == "query":
                self.on_query_result(job, ev)
            elif what == "release":
                # The release was refused: the leases were gone before it,
                # so the copy may have read reused slots.
                self.by_operation.pop(job.operation, None)
                self.w._finish_load(job.spec, None, "lease_lost")
            elif what == "load":
                # The runtime refused the load's plan once it was ready
                # (its pages did not cover the ranges): nothing was copied.
                self.by_operation.pop(job.operation, None)
                err = (ev.get("error") or {}).get("error", kind)
                log.error("OrbitKV: load of %s refused: %s", job.spec.req_id, ev.get("error"))
                self.w._finish_load(job.spec, None, f"load_{err}")
            return
        op = ev.get("operation")
        job = self.by_operation.get(op) if op is not None else None
        if job is None:
            return
        if kind == "ready" and job.load:
            self.on_load_ready(job, ev)
        elif kind == "ready":
            self.on_ready(job, ev)
        elif kind == "transfer_overdue" and ev.get("kind") == "restore_copy":
            # The miss follows at once, but the agent may still be copying
            # into the request's blocks: the connection goes (its agent
            # waits for running copies) before vLLM reuses them, as at this
            # worker's own deadline.
            self.lost("an agent copy passed its deadline")
        elif kind == "miss":
            del self.by_operation[op]
            if job.release_command is not None:
                self.by_command.pop(job.release_command, None)
            self.w._finish_load(job.spec, None, f"miss_{ev.get('reason')}")
        elif kind == "restore_done":
            # Every byte is in the blocks: the agent reported its copies.
            del self.by_operation[op]
            if job.release_command is not None:
                self.by_command.pop(job.release_command, None)
            self.w.stats.pages_loaded += job.pages
            self.w._finish_load(job.spec, job.selected, None)
        elif kind == "released":
            del self.by_operation[op]
            if job.release_command is not None:
                self.by_command.pop(job.release_command, None)
            self.w.stats.pages_loaded += job.pages
            self.w._finish_load(job.spec, job.selected, None)

    def on_query_result(self, job: _Load, ev: Dict[str, Any]) -> None:
        if ev.get("event") != "query_result":
            err = (ev.get("error") or {}).get("error", ev.get("event"))
            if err == "stale_session":
                self.lost("stale session")
            self.w._finish_load(job.spec, None, f"query_{err}")
            return
        if ev.get("miss") is not None:
            self.w._finish_load(job.spec, None, f"miss_{ev['miss']}")
            return
        job.operation = ev["operation"]
        job.selected = int(ev["selected"])
        self.by_operation[job.operation] = job
        if job.load:
            # A load's plan can still be refused, in reply to its command.
            job.release_command = ev["command"]
            self.by_command[ev["command"]] = ("load", job)

    def on_load_ready(self, job: _Load, ev: Dict[str, Any]) -> None:
        """A load's pages are leased and its restore is under way: the
        engine thread learns how many pages of each group to wait for
        (layer-wise), those of this rank the runtime restores into a block."""
        per_group: Dict[int, int] = {}
        rank = self.w.rank
        for lease in ev.get("leases", []):
            pos = lease["pos"]
            if pos["rank"] == rank and (pos["group"], pos["page_end"]) in job.targets:
                per_group[pos["group"]] = per_group.get(pos["group"], 0) + 1
        job.pages = sum(per_group.values())
        job.restoring = True
        job.deadline = time.monotonic() + self.w.settings.timeout_s
        self.w._mark(job.spec, "copying", per_group)

    def on_ready(self, job: _Load, ev: Dict[str, Any]) -> None:
        spec = job.spec
        page = self.w.spec.page_tokens
        mover = self.w.mover
        assert mover is not None
        client, session = self.client()
        per_group: Dict[int, List[Tuple[int, int, int]]] = {}
        gindex = self.w.spec.vllm_index
        failure = None
        for lease in ev.get("leases", []):
            pos = lease["pos"]
            if pos["rank"] != self.w.rank:
                continue
            gi = gindex.get(pos["group"])
            idx = pos["page_end"] // page - 1
            if gi is None or not 0 <= idx < len(spec.block_ids[gi]):
                failure = "lease_outside_load"
                break
            block = spec.block_ids[gi][idx]
            if block == NULL_BLOCK:
                continue
            per_group.setdefault(pos["group"], []).append((lease["offset"], lease["bytes"], block))
        if failure is None:
            try:
                for gid, pages in per_group.items():
                    mover.restore(gid, pages)
                    job.pages += len(pages)
            except Exception as e:  # a bad copy is a failed load, never a crash
                log.exception("OrbitKV: copying the pages of %s failed", spec.req_id)
                failure = f"copy_{type(e).__name__}"
        cid = client.submit({"command": "release", "session": session, "operation": job.operation})
        if failure is not None:
            del self.by_operation[job.operation]
            self.w._finish_load(spec, None, failure)
            return
        job.release_command = cid
        self.by_command[cid] = ("release", job)

    def expire(self) -> None:
        now = time.monotonic()
        late = [
            (cid, what, job) for cid, (what, job) in self.by_command.items() if job.deadline < now
        ]
        late_ops = [(op, job) for op, job in self.by_operation.items() if job.deadline < now]
        if not late and not late_ops:
            return
        # A load's copies may start in the tick its pages are ready, before
        # this thread has read its result: a late load may be copying too.
        agent_late = any(
            (what == "publish" and job.done is not None) or (what != "publish" and job.load)
            for _, what, job in late
        ) or any(job.restoring or job.load for _, job in late_ops)
        if agent_late:
            # The agent may still be copying engine blocks: the connection
            # goes (its agent waits for running copies), then everything in
            # flight fails.
            self.lost("an agent copy passed its deadline")
            return
        for cid, what, job in late:
            del self.by_command[cid]
            if what == "publish":
                # The runtime may still copy from these slots: never reuse them.
                self.w._publish_done(job, None, free_slots=False)
            else:
                self.by_operation.pop(job.operation, None)
                self.w._finish_load(job.spec, None, "timeout")
        for op, job in late_ops:
            if op in self.by_operation:
                del self.by_operation[op]
                if job.release_command is not None:
                    self.by_command.pop(job.release_command, None)
                self.w._finish_load(job.spec, None, "timeout")
                try:
                    client, session = self.client()
                    client.submit({"command": "cancel", "session": session, "operation": op})
                except (ManagerError, *LINK_ERRORS):
                    pass
