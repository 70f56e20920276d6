"""The scheduler role: asks the manager which prefix it can restore, tells
the workers what to load and what to save.

Lookups are metadata only: a `lookup` selects the boundary (the largest
legal one on every rank, below the last prompt token) and ends with its
answer, one round trip with nothing to release; the workers take the
leases themselves when they load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import orbitkv

from .engine import EngineSpec
from .link import LINK_ERRORS, ManagerLink, Refused, Unavailable
from .metadata import NULL_BLOCK, LoadSpec, OrbitKVMetadata, SaveItem, SaveSpec
from .settings import ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

#: `_lookup`'s answer while a lookup sent without waiting is unanswered.
_NOT_YET = object()


@dataclass
class _Request:
    request: Any
    origin: int = 0
    """Tokens the engine held when the connector was last asked."""
    saved_pages: int = -1
    """Pages below this index are saved, loaded, or held locally; -1 until
    the request is first scheduled."""
    saves_sent: bool = False
    """Some save of this request went to the workers: its blocks are freed
    only once the workers report the saves done."""
    loading: Set[int] = field(default_factory=set)
    """Blocks of the load in flight (to recognise a block-level failure)."""
    load_pages: List[int] = field(default_factory=list)
    """The full-attention group's block of each page of the load in flight
    (page index → block), to find the first page a failure lost."""
    load_failed: bool = False
    """A load of this request failed, on some rank: it is not offered
    another one (the retry could fail the same way, forever)."""
    offers: int = 0
    """Loads offered to vLLM for this request (at most one after a
    failure: the failed one)."""
    pending: Optional["_Pending"] = None
    """``lookup_wait: false``: the lookup sent for this request whose
    answer has not been collected yet."""


@dataclass
class _Pending:
    ticket: int
    origin: int
    pages: int
    generation: int
    deadline: float


@dataclass
class SchedulerStats:
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    misses_by_reason: Dict[str, int] = field(default_factory=dict)
    unavailable: int = 0
    refusals_by_reason: Dict[str, int] = field(default_factory=dict)
    """Lookups the manager refused (not unavailability): the manager's
    reason, e.g. ``unknown_rank``, ``contract``, ``instance_conflict``."""
    pages_saved: int = 0
    load_failures: int = 0

    def miss(self, reason: str) -> None:
        # Copied, not updated in place: a report may be reading the old one.
        self.misses_by_reason = {
            **self.misses_by_reason,
            reason: self.misses_by_reason.get(reason, 0) + 1,
        }

    def refused(self, reason: str) -> None:
        self.refusals_by_reason = {
            **self.refusals_by_reason,
            reason: self.refusals_by_reason.get(reason, 0) + 1,
        }
        self.miss("refused")


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, spec: EngineSpec):
        self.settings = settings
        self.spec = spec
        self.link = ManagerLink(settings, spec, "vllm-scheduler", spin_us=settings.lookup_spin_us)
        self.requests: Dict[str, _Request] = {}
        self.pending_loads: List[LoadSpec] = []
        self.kv_cache_manager: Any = None
        self.stats = SchedulerStats()
        self._group_ids = [g.id for g in spec.groups]
        #: vLLM's indices of the recurrent (Mamba, align mode) groups: their
        #: pages are the exact state blocks vLLM hands off, never read from
        #: the block table by position (align mode reuses and nulls its
        #: interior).
        self._recurrent = {g.vllm_group for g in spec.groups if g.kind == "mamba"}
        #: `ConnectorEvents` when vLLM's KV events and the manager's are on.
        self.events: Any = None
        self._events_logged = float("-inf")
        # A refusal stops the engine here, naming the setting; a manager
        # that is not up yet only delays the first connection.
        self.link.connect_at_startup()

    # vLLM hooks -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[int, bool]:
        rid = request.request_id
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = _Request(request)
        state.origin = num_computed_tokens
        if not self.settings.load:
            return 0, False
        if state.load_failed:
            self.stats.miss("load_failed_before")
            return 0, False
        page = self.spec.page_tokens
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // page)
        if usable * page <= num_computed_tokens or num_computed_tokens % page:
            return 0, False
        selected = self._lookup(state, num_computed_tokens, usable)
        if selected is _NOT_YET:
            return None, False  # vLLM skips the request and asks again later
        if selected is None or selected <= num_computed_tokens:
            return 0, False
        self.stats.hits += 1
        self.stats.hit_tokens += selected - num_computed_tokens
        state.offers += 1
        # Layer-wise loads are synchronous: the request computes in this
        # step, each layer after its own copies landed.
        return selected - num_computed_tokens, self.settings.load_mode == "async"

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        state = self.requests.get(rid)
        origin = state.origin if state is not None else 0
        boundary = origin + num_external_tokens
        page = self.spec.page_tokens
        pages = boundary // page
        per_group = []
        for group_blocks in blocks.blocks:
            ids = [NULL_BLOCK if b.is_null else b.block_id for b in list(group_blocks)[:pages]]
            ids += [NULL_BLOCK] * (pages - len(ids))
            per_group.append(ids)
        if state is not None:
            state.loading = {b for ids in per_group for b in ids if b != NULL_BLOCK}
            state.load_pages = per_group[self.spec.groups[0].vllm_group]
        self.pending_loads.append(
            LoadSpec(
                req_id=rid,
                origin=origin,
                boundary=boundary,
                hashes=[bytes(h) for h in request.block_hashes[:pages]],
                block_ids=tuple(per_group),
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> OrbitKVMetadata:
        meta = OrbitKVMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if self.settings.save:
            handed = self._state_handoffs(scheduler_output)
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                save = self._plan_save(rid, n, handed.get(rid))
                if save is not None:
                    meta.saves.append(save)
        return meta

    def update_connector_output(self, output: Any) -> None:
        """Marks failed loads. vLLM's output aggregator forwards each rank's
        invalid blocks at once but reports a load finished (or failed) only
        once every rank has, so a block-level failure on one rank may arrive
        steps before the request's finished report, or with it: either way
        the load failed, and the request is never offered another one."""
        failed = set(getattr(output, "failed_recving", None) or ())
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        if invalid:
            for state in self.requests.values():
                if state.loading & invalid:
                    self._load_failed(state, invalid)
        for rid in failed:
            state = self.requests.get(rid)
            if state is not None:
                self._load_failed(state, set(state.loading))
        for rid in set(getattr(output, "finished_recving", None) or ()) | failed:
            state = self.requests.get(rid)
            if state is not None:
                state.loading = set()
                state.load_pages = []

    def _load_failed(self, state: _Request, lost: Set[int]) -> None:
        if not state.load_failed:
            state.load_failed = True
            self.stats.load_failures += 1
        # vLLM recomputes from the first lost page: those pages are saved
        # again as they are recomputed. (A layer-wise load computed the
        # step after its boundary before the failure was known; the worker
        # dropped that step's saves of this request.)
        first = next((i for i, b in enumerate(state.load_pages) if b in lost), None)
        if first is None:
            first = state.origin // self.spec.page_tokens
        if state.saved_pages >= 0:
            state.saved_pages = min(state.saved_pages, first)

    def request_finished(self, request: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        state = self.requests.pop(request.request_id, None)
        if state is not None and state.pending is not None:
            self.link.session.forget_lookup(state.pending.ticket)
        return bool(state is not None and state.saves_sent), None

    def take_events(self) -> List[Any]:
        if self.events is None:
            return []
        try:
            return self.events.take()
        except Exception:  # never into vLLM's scheduler step
            now = time.monotonic()
            if now - self._events_logged > 10.0:
                self._events_logged = now
                log.exception("OrbitKV: KV events from the manager failed; none this step")
            return []

    def namespaces(self) -> Optional[List[str]]:
        """The instance's namespaces (one per rank) once connected."""
        s = self.link.session
        return list(s.namespaces) if s.up else None

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()
        self.link.close()

    # internals ------------------------------------------------------------

    def _lookup(self, state: _Request, origin: int, pages: int) -> Any:
        """The selected boundary, None (a miss, whatever the reason), or
        `_NOT_YET` (``lookup_wait: false``, the answer has not come)."""
        try:
            session = self.link.get()
        except Refused as e:
            self.stats.refused(e.reason)
            return None
        except Unavailable:
            self.stats.unavailable += 1
            self.stats.miss("unavailable")
            return None
        request = state.request
        query = (self._group_ids, request.block_hashes[:pages], origin, request.num_tokens)
        try:
            if self.settings.lookup_wait:
                self._count(origin, pages)
                found = session.lookup(*query, timeout=self.settings.query_timeout_s)
            else:
                found = self._collect(session, state, query)
                if found is None:
                    return _NOT_YET
        except orbitkv.Refused as e:
            kind = str(e.args[0])
            if kind == "stale_session":
                self.link.drop("stale session")
            self.stats.miss(kind)
            return None
        except TimeoutError:
            # A lookup holds nothing: a late answer is dropped.
            self.stats.miss("timeout")
            return None
        except LINK_ERRORS as e:
            self.link.drop(f"{type(e).__name__}: {e}")
            self.stats.miss("unavailable")
            return None
        if found.miss is not None:
            self.stats.miss(str(found.miss))
            return None
        return found.selected

    def _count(self, origin: int, pages: int) -> None:
        self.stats.queries += 1
        self.stats.queried_tokens += pages * self.spec.page_tokens - origin

    def _collect(self, session: orbitkv.Session, state: _Request, query: Tuple[Any, ...]) -> Any:
        """``lookup_wait: false``: the request's lookup is sent once and its
        answer collected without waiting; `None` until it has come.
        `TimeoutError` past ``query_timeout_s``."""
        _, _, origin, _ = query
        pages = len(query[1])
        p = state.pending
        if p is not None and (p.origin, p.pages, p.generation) != (origin, pages, self.link.generation):
            session.forget_lookup(p.ticket)  # asked of another session, or for other tokens
            p = state.pending = None
        if p is None:
            self._count(origin, pages)
            p = state.pending = _Pending(
                session.start_lookup(*query),
                origin,
                pages,
                self.link.generation,
                time.monotonic() + self.settings.query_timeout_s,
            )
        try:
            found = session.lookup_result(p.ticket)
        except BaseException:
            state.pending = None
            raise
        if found is not None:
            state.pending = None
        elif time.monotonic() > p.deadline:
            session.forget_lookup(p.ticket)
            state.pending = None
            raise TimeoutError(f"no answer to the lookup within {self.settings.query_timeout_s}s")
        return found

    def _state_handoffs(self, scheduler_output: Any) -> Dict[str, Dict[Tuple[int, int], int]]:
        """This step's recurrent state blocks, `{req: {(vLLM group,
        boundary tokens): block id}}`: vLLM's align mode hands each state
        it keeps at a page boundary to the connector
        (`kv_connector_block_state.boundary_state_offloads`), written by
        this step's forward, which the worker's save reads right after."""
        if not self._recurrent:
            return {}
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(state, "boundary_state_offloads", None) or {}
        page = self.spec.page_tokens
        out: Dict[str, Dict[Tuple[int, int], int]] = {}
        for rid, entries in offloads.items():
            for group, block, boundary in entries:
                # The null block, or a state between page boundaries, is
                # never a page.
                if group in self._recurrent and block != NULL_BLOCK and boundary % page == 0:
                    out.setdefault(rid, {})[(group, boundary)] = block
        return out

    def _plan_save(
        self, rid: str, scheduled: int, handed: Optional[Dict[Tuple[int, int], int]] = None
    ) -> Optional[SaveSpec]:
        state = self.requests.get(rid)
        if state is None:
            return None
        request = state.request
        page = self.spec.page_tokens
        if state.saved_pages < 0:
            # Pages the request starts with came from the local prefix cache
            # or from OrbitKV: already published by whoever computed them.
            state.saved_pages = request.num_computed_tokens // page
        done = min((request.num_computed_tokens + scheduled) // page, len(request.block_hashes))
        if done <= state.saved_pages or self.kv_cache_manager is None:
            return None
        saved = state.saved_pages
        # Column by column (one list per group), then a tuple per page: the
        # scheduler's thread runs this for every scheduled request, every
        # step, so no Python loop runs per page and group.
        columns = []
        for vg, group_blocks in enumerate(self.kv_cache_manager.get_blocks(rid).blocks):
            if vg in self._recurrent:
                got = handed or {}
                columns.append([got.get((vg, (p + 1) * page), NULL_BLOCK) for p in range(saved, done)])
                continue
            column = [NULL_BLOCK if b.is_null else b.block_id for b in group_blocks[saved:done]]
            column += [NULL_BLOCK] * (done - saved - len(column))
            columns.append(column)
        nowhere = (NULL_BLOCK,) * len(columns)
        hashes = request.block_hashes
        items = [
            SaveItem(p, bytes(hashes[p]), ids)
            for p, ids in zip(range(saved, done), zip(*columns))
            if ids != nowhere
        ]
        state.saved_pages = done
        if self.events is not None:
            tokens = request.all_token_ids
            for it in items:
                p = it.page
                parent = bytes(hashes[p - 1]) if p > 0 else None
                self.events.record_save(it.hash, tuple(tokens[p * page : (p + 1) * page]), parent)
        if not items:
            return None
        state.saves_sent = True
        self.stats.pages_saved += len(items)
        return SaveSpec(req_id=rid, items=items)
