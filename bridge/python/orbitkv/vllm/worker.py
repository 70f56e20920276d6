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

import orbitkv

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
    selected: int = 0
    pages: int = 0
    restoring: bool = False
    #: Agent path: one `load` (query, prepare and restore in one round
    #: trip); the block of each (group, page end) it names.
    load: bool = False
    targets: Dict[Tuple[int, int], int] = field(default_factory=dict)
    #: Staged path: why the copy out of the pool failed (the load then
    #: fails even if its release is answered).
    copied: Optional[str] = None


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

    def _on_connect(self, session: orbitkv.Session) -> None:
        assert self.mover is not None
        self.mover.connect(session)
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
                self.stats.pages_dropped += save.pages
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
        self, job: _Publish, answer: Optional[orbitkv.Saved], free_slots: bool = True
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
        self.stats.pages_published += answer.stored
        self.stats.pages_dropped += answer.dropped

    # saves ------------------------------------------------------------------

    def _gather(self, save: SaveSpec) -> List[_Publish]:
        assert self.mover is not None
        jobs: List[_Publish] = []
        batch = self.settings.publish_batch_pages
        for group in self.spec.groups:
            vi = group.vllm_group
            pages = [(h, b) for h, b in zip(save.hashes, save.block_ids[vi]) if b != NULL_BLOCK]
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
    """The I/O thread's verbs in flight, by their session ticket."""

    def __init__(self, w: WorkerSide):
        self.w = w
        self.jobs: Dict[int, Tuple[str, Any]] = {}

    def busy(self) -> bool:
        return bool(self.jobs)

    def session(self) -> orbitkv.Session:
        return self.w.link.get()

    def lost(self, why: str) -> None:
        """The connection failed: everything in flight fails; publishes'
        slots belong to the old regions and are not reused."""
        self.w.link.drop(why)
        with self.w._lock:
            self.w._connected = False
        self.abandon(why)

    def abandon(self, why: str) -> None:
        for kind, job in list(self.jobs.values()):
            if kind == "publish":
                self.w._publish_done(job, None, free_slots=False)
            else:
                self.w._finish_load(job.spec, None, why)
        self.jobs.clear()

    # starting work

    def start(self, item: Tuple[Any, ...]) -> None:
        kind = item[0]
        try:
            if kind == "connect":
                self.session()
            elif kind == "lost":
                if self.w.link.up:
                    self.lost(item[1])
                else:
                    self.abandon(item[1])
            elif kind == "load":
                self.start_load(item[1])
            elif kind == "publish":
                self.start_publish(item[1])
        except (Refused, orbitkv.Refused) as e:
            # Counted and logged (error level) by the link.
            reason = (e if isinstance(e, Refused) else self.w.link.refused(e)).reason
            if kind == "load":
                self.w._finish_load(item[1], None, f"refused_{reason}")
            elif kind == "publish":
                self.w.stats.fail(f"publish_refused_{reason}")
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

    def query(self, spec: LoadSpec) -> Tuple[List[int], List[bytes], int, int]:
        # The scheduler counted on `boundary`: select nothing beyond.
        return [g.id for g in self.w.spec.groups], spec.hashes, spec.origin, spec.boundary + 1

    def start_load(self, spec: LoadSpec) -> None:
        s = self.session()
        page = self.w.spec.page_tokens
        if spec.boundary % page or spec.origin % page or spec.boundary <= spec.origin:
            self.w._finish_load(spec, None, "misaligned")
            return
        mover = self.w.mover
        if isinstance(mover, AgentPageMover):
            self.start_agent_load(s, spec, mover)
            return
        ticket = s.start_lease(*self.query(spec))
        self.jobs[ticket] = ("load", _Load(spec=spec, deadline=time.monotonic() + self.w.settings.timeout_s))

    def start_agent_load(self, s: orbitkv.Session, spec: LoadSpec, mover: AgentPageMover) -> None:
        """One `load`: every page of this rank up to the boundary names its
        block's device page (the slot table's) or, with no block (vLLM's
        null block), is attested held; the runtime restores the ranges it
        selects and answers `restore_done` or `miss`."""
        page = self.w.spec.page_tokens
        rank = self.w.rank
        pages = min(spec.boundary // page, len(spec.hashes))
        job = _Load(spec=spec, deadline=time.monotonic() + self.w.settings.timeout_s, load=True)
        retained: List[Tuple[int, int, int]] = []
        per_group: Dict[int, List[Tuple[int, int]]] = {}
        for g in self.w.spec.groups:
            blocks = spec.block_ids[g.vllm_group]
            for idx in range(min(pages, len(blocks))):
                if blocks[idx] == NULL_BLOCK:
                    retained.append((rank, g.id, (idx + 1) * page))
                else:
                    per_group.setdefault(g.id, []).append((idx, blocks[idx]))
        targets: List[Tuple[int, int, int, int]] = []
        try:
            mover.blocks.check_blocks([b for ps in per_group.values() for _, b in ps])
            for gid, ps in per_group.items():
                dps = s.device_pages(mover.region(gid), [b for _, b in ps])
                for (idx, block), dp in zip(ps, dps):
                    targets.append((rank, gid, (idx + 1) * page, dp))
                    job.targets[(gid, (idx + 1) * page)] = block
        except (orbitkv.Refused, ValueError) as e:
            log.info("OrbitKV: load of %s: %s", spec.req_id, e)
            self.w._finish_load(spec, None, "restore_alloc")
            return
        ticket = s.start_load(
            *self.query(spec), ranks=[rank], targets=targets, retained=retained, handoff=spec.handoff
        )
        self.jobs[ticket] = ("load", job)

    def start_publish(self, job: _Publish) -> None:
        with self.w._lock:
            stale = job.generation != self.w._generation or not self.w._connected
        if stale:
            self.w._publish_done(job, None, free_slots=False)
            return
        s = self.session()
        mover = self.w.mover
        assert mover is not None
        if isinstance(mover, AgentPageMover):
            try:
                job.device_pages = s.device_pages(mover.region(job.gid), job.blocks)
            except (orbitkv.Refused, ValueError) as e:
                self.w.stats.fail("publish_alloc")
                log.info("OrbitKV: publish of %s skipped: %s", job.req_id, e)
                self.w._publish_done(job, None)
                return
        else:
            job.device_pages = [mover.source_page(job.gid, slot) for slot in job.slots]
        rank = self.w.rank
        ticket = s.start_save([(rank, job.gid, h, dp) for h, dp in zip(job.hashes, job.device_pages)])
        job.deadline = time.monotonic() + self.w.settings.timeout_s
        self.jobs[ticket] = ("publish", job)

    # answers

    def pump(self) -> None:
        if not self.busy():
            self.check_alive()
            return
        try:
            for ticket, outcome in self.session().poll(POLL_S):
                self.dispatch(ticket, outcome)
        except Refused as e:
            self.abandon(f"refused_{e.reason}")
        except Unavailable:
            self.abandon("unavailable")
        except LINK_ERRORS as e:
            # A copy past its deadline ends here too: the session gave the
            # connection up (its agent drained first).
            self.lost(f"{type(e).__name__}: {e}")
        self.expire()

    def check_alive(self) -> None:
        """While idle, notices a manager that went away (a closed socket),
        so the worker reconnects before the next save needs it."""
        if not self.w.link.up:
            return
        try:
            self.w.link.session.poll(0.0)
        except LINK_ERRORS as e:
            self.lost(f"{type(e).__name__}: {e}")

    def dispatch(self, ticket: int, outcome: Any) -> None:
        entry = self.jobs.get(ticket)
        if entry is None:
            return  # ended here already (its deadline passed)
        kind, job = entry
        if isinstance(outcome, orbitkv.Ready):
            if job.load:
                self.on_load_ready(job, outcome)
            else:
                self.on_ready(ticket, job, outcome)
            return
        del self.jobs[ticket]
        if kind == "publish":
            if isinstance(outcome, orbitkv.Saved):
                self.w._publish_done(job, outcome)
            else:
                self.w.stats.fail(f"publish_{outcome.args[0]}")
                # A refused publish had no effect: its slots are free again.
                self.w._publish_done(job, None)
        elif isinstance(outcome, orbitkv.Loaded):
            if outcome.hit and job.copied is None:
                self.w.stats.pages_loaded += job.pages
                self.w._finish_load(job.spec, job.selected or outcome.boundary, None)
            else:
                self.w._finish_load(job.spec, None, job.copied or f"miss_{outcome.miss}")
        else:
            self.on_refused(job, outcome)

    def on_refused(self, job: _Load, e: orbitkv.Refused) -> None:
        kind = e.args[0]
        if e.command == "release":
            # The leases were gone before the release: the copy may have
            # read reused pool slots.
            self.w._finish_load(job.spec, None, "lease_lost")
        elif kind == "load_invalid":
            # The runtime refused the load's plan once it was ready (its
            # pages did not cover the ranges): nothing was copied.
            log.error("OrbitKV: load of %s refused: %s", job.spec.req_id, e)
            self.w._finish_load(job.spec, None, f"load_{kind}")
        else:
            if kind == "stale_session":
                self.lost("stale session")
            self.w._finish_load(job.spec, None, f"query_{kind}")

    def on_load_ready(self, job: _Load, ready: orbitkv.Ready) -> None:
        """A load's pages are leased and its restore is under way: the
        engine thread learns how many pages of each group to wait for
        (layer-wise), those of this rank the runtime restores into a block."""
        per_group: Dict[int, int] = {}
        rank = self.w.rank
        for r, g, end in ready.leased:
            if r == rank and (g, end) in job.targets:
                per_group[g] = per_group.get(g, 0) + 1
        job.pages = sum(per_group.values())
        job.selected = ready.boundary
        job.restoring = True
        job.deadline = time.monotonic() + self.w.settings.timeout_s
        self.w._mark(job.spec, "copying", per_group)

    def on_ready(self, ticket: int, job: _Load, ready: orbitkv.Ready) -> None:
        """Staged copies: this rank's leased pages are copied from the pool
        into the request's blocks, then the lease is released; the release
        doubles as a fence (refused when a lease expired meanwhile)."""
        spec = job.spec
        page = self.w.spec.page_tokens
        mover = self.w.mover
        assert mover is not None
        per_group: Dict[int, List[Tuple[int, int, int, int]]] = {}
        gindex = self.w.spec.vllm_index
        job.selected = ready.boundary
        for r, g, end, offset, nbytes, checksum in ready.pool_pages:
            if r != self.w.rank:
                continue
            gi = gindex.get(g)
            idx = end // page - 1
            if gi is None or not 0 <= idx < len(spec.block_ids[gi]):
                job.copied = "lease_outside_load"
                break
            block = spec.block_ids[gi][idx]
            if block != NULL_BLOCK:
                per_group.setdefault(g, []).append((offset, nbytes, block, checksum))
        if job.copied is None:
            try:
                for gid, pages in per_group.items():
                    mover.restore(gid, pages)
                    job.pages += len(pages)
            except Exception as e:  # a bad copy is a failed load, never a crash
                log.exception("OrbitKV: copying the pages of %s failed", spec.req_id)
                job.copied = f"copy_{type(e).__name__}"
        self.session().release(ticket)

    def expire(self) -> None:
        now = time.monotonic()
        late = [(t, kind, job) for t, (kind, job) in self.jobs.items() if job.deadline < now]
        if not late:
            return
        # A load's copies may start in the tick its pages are ready, before
        # this thread has read its result: a late load may be copying too.
        if any((kind == "publish" and job.done is not None) or (kind == "load" and job.load) for _, kind, job in late):
            # The agent may still be copying engine blocks: the connection
            # goes (its agent waits for running copies), then everything in
            # flight fails.
            self.lost("an agent copy passed its deadline")
            return
        for ticket, kind, job in late:
            del self.jobs[ticket]
            if kind == "publish":
                # The runtime may still copy from these slots: never reuse them.
                self.w._publish_done(job, None, free_slots=False)
                continue
            self.w._finish_load(job.spec, None, "timeout")
            try:
                self.session().cancel(ticket)
            except (ManagerError, orbitkv.Refused, *LINK_ERRORS):
                pass
