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
from operator import attrgetter
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import orbitkv

from . import handoff as pd
from .engine import EngineSpec
from .link import LINK_ERRORS, ManagerLink, Refused, Unavailable
from .metadata import NULL_BLOCK, LoadSpec, OrbitKVMetadata, SaveSpec
from .settings import ConnectorSettings

log = logging.getLogger("orbitkv.vllm")

#: `_lookup`'s answer while a lookup sent without waiting is unanswered.
_NOT_YET = object()

_BLOCK_ID = attrgetter("block_id")

_BOUND_FROM_PAGES = 64
"""A lookup of more pages than this first asks the presence filter for a
page it proves absent, and sends only the pages before it (a long prompt
with a short stored prefix); shorter ones are sent whole."""


class _Request:
    """One request the scheduler was asked about. Made for every request
    on the scheduler's thread: its fields default to the class's values
    (a request that misses stores a few), and it has no container of its
    own until it loads."""

    request: Any
    origin: int = 0
    """Tokens the engine held when the connector was last asked."""
    saved_pages: int = -1
    """Pages below this index are saved, loaded, or held locally; -1 until
    the request is first scheduled."""
    saves_sent: bool = False
    """Some save of this request went to the workers: its blocks are freed
    only once the workers report the saves done."""
    load_blocks: Sequence[Sequence[int]] = ()
    """Per vLLM group, the blocks of the load in flight (`NULL_BLOCK` where
    a group has none): a block-level failure is recognised by them."""
    load_pages: Sequence[int] = ()
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
    handoff: Optional[pd.Handoff] = None
    """P/D, the decode engine: the prefill engine's handoff this request
    waits for (until ``handoff_until``), then loads naming it."""
    handoff_until: float = 0.0
    handoff_since: float = 0.0
    handoff_seen: bool = False
    """The request's params were read (once)."""
    load_handoff: Optional[int] = None
    """The handoff id its load takes (the manager's pins return then)."""
    batched: Optional[Tuple[int, int, float, Any]] = None
    """``lookup_batch``: an answer looked up along with another request's,
    ``(pages, link generation, when, Lookup)``, from token 0; used once."""

    def __init__(self, request: Any) -> None:
        self.request = request


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
    handoffs_promised: int = 0
    """P/D, the prefill engine: requests handed to a decode engine."""
    handoffs_taken: int = 0
    """P/D, the decode engine: handoffs whose pages all landed in time."""
    handoff_wait_ms: int = 0
    """Their total wait, from the request's first lookup to the pages'
    arrival."""

    def miss(self, reason: str) -> None:
        # A new reason is added to a copy: a report iterating the old dict
        # never sees it change size. A known one is counted in place.
        m = self.misses_by_reason
        if reason in m:
            m[reason] += 1
        else:
            self.misses_by_reason = {**m, reason: 1}

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
        # Read for every request on vLLM's scheduler thread: plain
        # attributes, not a chain of lookups each time.
        self._load = settings.load
        self._wait = settings.lookup_wait
        self._page = spec.page_tokens
        self._null_id: Optional[int] = None
        #: vLLM's indices of the recurrent (Mamba, align mode) groups: their
        #: pages are the exact state blocks vLLM hands off, never read from
        #: the block table by position (align mode reuses and nulls its
        #: interior).
        self._recurrent = {g.vllm_group for g in spec.groups if g.kind == "mamba"}
        #: `ConnectorEvents` when vLLM's KV events and the manager's are on.
        self.events: Any = None
        self._events_logged = float("-inf")
        self._logged: Dict[str, float] = {}
        #: A lookup went to the manager since vLLM last collected events
        #: (the end of its step): more are likely in the next step.
        self._looked = False
        #: Requests vLLM added and has not asked about yet, oldest first:
        #: a lookup takes some of them along (`lookup_batch`).
        self._arrived: Dict[str, Any] = {}
        self._batch = settings.lookup_batch if settings.lookup_wait and settings.load else 1
        self._batch_age = settings.lookup_batch_max_age_us / 1e6
        # A refusal stops the engine here, naming the setting; a manager
        # that is not up yet only delays the first connection.
        self.link.connect_at_startup()

    # vLLM hooks -----------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv_cache_manager = kv_cache_manager
        # Save plans read blocks by id: vLLM's one null block (where a
        # group has no block) is the only one with its id.
        self._null_id = kv_cache_manager.block_pool.null_block.block_id

    def on_new_request(self, request: Any) -> None:
        # A P/D handoff is waited for, never looked up in a batch.
        if self._batch > 1 and not getattr(request, "kv_transfer_params", None):
            self._arrived[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[int, bool]:
        rid = request.request_id
        if self._arrived:
            self._arrived.pop(rid, None)
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = _Request(request)
        state.origin = num_computed_tokens
        if not self._load:
            return 0, False
        if state.load_failed:
            self.stats.miss("load_failed_before")
            return 0, False
        page = self._page
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // page)
        if usable * page <= num_computed_tokens or num_computed_tokens % page:
            return 0, False
        if not state.handoff_seen:
            state.handoff_seen = True
            if getattr(request, "kv_transfer_params", None) is not None:
                self._read_handoff(state)
        if state.handoff is not None:
            selected = self._await_handoff(state, num_computed_tokens, usable)
            if selected is _NOT_YET:
                return None, False  # the prefill engine's pages are on their way
        else:
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
        null_id = self._null_id
        # On vLLM's scheduler thread for every load: ids read at C speed,
        # vLLM's one null block (bound in `bind_kv_cache_manager`) replaced
        # only where it occurs; the set of blocks a failure is checked
        # against is made only when vLLM reports one.
        for group_blocks in blocks.blocks:
            if null_id is None:
                ids = [NULL_BLOCK if b.is_null else b.block_id for b in group_blocks[:pages]]
            else:
                ids = list(map(_BLOCK_ID, group_blocks[:pages]))
                if null_id in ids:
                    ids = [NULL_BLOCK if b == null_id else b for b in ids]
            if len(ids) < pages:
                ids += [NULL_BLOCK] * (pages - len(ids))
            per_group.append(ids)
        if state is not None:
            state.load_blocks = per_group
            state.load_pages = per_group[self.spec.groups[0].vllm_group]
        self.pending_loads.append(
            LoadSpec(
                req_id=rid,
                origin=origin,
                boundary=boundary,
                # vLLM's block hashes are bytes already; the slice is a copy.
                hashes=request.block_hashes[:pages],
                block_ids=tuple(per_group),
                handoff=state.load_handoff if state is not None else None,
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> OrbitKVMetadata:
        meta = OrbitKVMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if self.settings.save:
            handed = self._state_handoffs(scheduler_output)
            # A request scheduled for the first time (or resumed) comes
            # with all its block ids: read from there, not from its blocks.
            new = {r.req_id: r.block_ids for r in scheduler_output.scheduled_new_reqs}
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                save = self._plan_save(rid, n, handed.get(rid), new.get(rid))
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
                if any(not invalid.isdisjoint(g) for g in state.load_blocks):
                    self._load_failed(state, invalid)
        for rid in failed:
            state = self.requests.get(rid)
            if state is not None:
                self._load_failed(state, set().union(*state.load_blocks) - {NULL_BLOCK})
        for rid in set(getattr(output, "finished_recving", None) or ()) | failed:
            state = self.requests.get(rid)
            if state is not None:
                state.load_blocks = ()
                state.load_pages = ()

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

    def request_finished(
        self, request: Any, block_ids: Any = None
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's `request_finished` and `request_finished_all_groups`
        (which passes the request's `block_ids`; they are not needed).
        Returns whether vLLM must keep the blocks until the workers report
        the saves done, and a P/D handoff's params."""
        rid = request.request_id
        if self._arrived:
            self._arrived.pop(rid, None)
        state = self.requests.pop(rid, None)
        if state is None:
            return False, None
        if state.pending is not None:
            self.link.session.forget_lookup(state.pending.ticket)
        params = None
        # A P/D prefill request hands its pages over, unless it was aborted
        # (its client went away).
        if (
            getattr(request, "kv_transfer_params", None) is not None
            and self.settings.save
            and pd.wants_remote_decode(request)
            and getattr(getattr(request, "status", None), "name", "") != "FINISHED_ABORTED"
        ):
            params = self._promise(state)
        return state.saves_sent, params

    def take_events(self) -> List[Any]:
        # vLLM collects events every step, at the end of
        # `update_from_output`, just before it schedules the next step. A
        # step that looked prefixes up likely has more waiting requests to
        # look up: the manager, asleep through the model's forward pass, is
        # woken now instead of by the first of those lookups.
        if self._looked:
            self._looked = False
            self.link.warm()
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

    # P/D handoff ------------------------------------------------------------

    def _promise(self, state: _Request) -> Optional[Dict[str, Any]]:
        """The prefill engine's side: the pages this request saved (or
        found stored) are promised to a decode engine, and the manager pins
        them as they land (``handoff_pin_ms``). The params go back through
        ``kv_transfer_params``; None when nothing can be promised (the
        decode engine then computes the prompt itself)."""
        request = state.request
        page = self.spec.page_tokens
        if self._recurrent:
            self.stats.miss("handoff_unsupported")
            self._log_once(
                "handoff_unsupported",
                "OrbitKV: request %s asked for a remote decode; P/D handoffs of hybrid recurrent "
                "models are not supported (docs/pd.md): the decode engine computes the prompt",
                request.request_id,
            )
            return None
        pages = min(max(state.saved_pages, 0), len(request.block_hashes))
        if pages == 0:
            self.stats.miss("handoff_nothing_saved")
            return None
        hashes = [bytes(h) for h in request.block_hashes[:pages]]
        hid = pd.new_id()
        pinned = False
        try:
            session = self.link.get()
            session.hold(self._group_ids, hashes, hid, self.settings.handoff_pin_ms)
            pinned = True
        except Refused as e:
            self.stats.refused(e.reason)
            return None
        except Unavailable:
            self.stats.unavailable += 1
            return None  # its saves were dropped too: nothing will land
        except orbitkv.Refused as e:
            # A bound of the manager's ([budget] handoff_bytes,
            # limits.max_handoffs): the pages land all the same, unpinned.
            reason = str(e.args[1]) if len(e.args) > 1 else str(e.args[0])
            self.stats.refused(reason)
            self._log_once(
                "hold",
                "OrbitKV: the manager refused to pin request %s's pages for its decode engine "
                "(%s); they are handed over unpinned",
                state.request.request_id,
                e,
            )
        except LINK_ERRORS as e:
            self.link.drop(f"{type(e).__name__}: {e}")
            return None
        self.stats.handoffs_promised += 1
        namespaces = self.namespaces() or []
        return pd.Handoff(hid, namespaces, page, pages * page, hashes, self.settings.handoff_pin_ms, pinned).params()

    def _read_handoff(self, state: _Request) -> None:
        """The decode engine's side: the request's handoff, checked against
        this engine (page size, namespaces, the prompt's hashes); a
        mismatch is a miss with its reason, logged, and the request goes on
        as any other (an ordinary lookup)."""
        try:
            h = pd.parse(state.request)
            if h is None:
                return
            if self._recurrent:
                raise pd.HandoffMismatch(
                    "handoff_unsupported", "P/D handoffs of hybrid recurrent models are not supported"
                )
            try:
                self.link.get()  # the namespaces to check against, once connected
            except (Refused, Unavailable):
                pass
            namespaces = self.namespaces() if self.link.session.up else None
            pd.check(h, self.spec.page_tokens, namespaces, state.request.block_hashes)
        except pd.HandoffMismatch as e:
            self.stats.miss(e.reason)
            self._log_once(e.reason, "OrbitKV: request %s: its P/D handoff is not usable here: %s", state.request.request_id, e)
            return
        now = time.monotonic()
        wait = self.settings.handoff_wait_s
        if h.pin_ms > 0:
            wait = min(wait, h.pin_ms / 1000.0)
        state.handoff = h
        state.handoff_since = now
        state.handoff_until = now + wait

    def _await_handoff(self, state: _Request, origin: int, usable: int) -> Any:
        """`_NOT_YET` while the promised pages have not all landed and the
        wait is not over; then the boundary to load (the load takes the
        handoff), or None: the wait ended with nothing to load
        (``handoff_timeout``)."""
        h = state.handoff
        assert h is not None
        page = self.spec.page_tokens
        want = min(h.pages, usable) * page
        got = self._lookup(state, origin, usable, quiet=True)
        if got is _NOT_YET:
            got = None if time.monotonic() >= state.handoff_until else _NOT_YET
            if got is _NOT_YET:
                return _NOT_YET
        if got is not None and got >= want:
            self._count(origin, usable)
            self.stats.handoffs_taken += 1
            self.stats.handoff_wait_ms += int((time.monotonic() - state.handoff_since) * 1000)
            state.load_handoff = h.id
            state.handoff = None
            return got
        if time.monotonic() < state.handoff_until:
            return _NOT_YET
        self._count(origin, usable)
        self.stats.miss("handoff_timeout")
        self._log_once(
            "handoff_timeout",
            "OrbitKV: request %s waited %.1fs for its prefill engine's pages (%d of %d tokens "
            "arrived); it computes the rest itself (handoff_wait_s)",
            state.request.request_id,
            time.monotonic() - state.handoff_since,
            got or 0,
            want,
        )
        state.load_handoff = h.id  # what did land is loaded; the pins return with it
        state.handoff = None
        return got

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        """Logs `msg` at most once a minute per `key` (a misconfigured
        P/D pair would say it for every request)."""
        now = time.monotonic()
        last = self._logged.get(key, float("-inf"))
        if now - last >= 60.0:
            self._logged[key] = now
            log.error(msg, *args)

    # internals ------------------------------------------------------------

    def _lookup(self, state: _Request, origin: int, pages: int, quiet: bool = False) -> Any:
        """The selected boundary, None (a miss, whatever the reason), or
        `_NOT_YET` (``lookup_wait: false``, the answer has not come).
        `quiet`: a P/D wait's repeated look, counted in no statistic."""
        stats = SchedulerStats() if quiet else self.stats
        session = self.link.session
        if not session.up:
            try:
                session = self.link.get()
            except Refused as e:
                stats.refused(e.reason)
                return None
            except Unavailable:
                stats.unavailable += 1
                stats.miss("unavailable")
                return None
        request = state.request
        try:
            wait = self._wait
            if wait and not quiet:
                stats.queries += 1
                stats.queried_tokens += pages * self._page - origin
            found = self._batched(state, origin, pages) if state.batched is not None else None
            if found is None and state.pending is None:
                # A certain miss is answered here: no round trip, and no
                # batch gathered for it.
                found = session.lookup_local(self._group_ids, request.block_hashes, origin)
                if found is not None and not wait and not quiet:
                    self._count(origin, pages)
            if found is None:
                hashes = self._hashes(session, request, pages, origin)
                query = (self._group_ids, hashes, origin, request.num_tokens)
                if not wait:
                    self._looked = True
                    found = self._collect(session, state, query, pages, quiet)
                    if found is None:
                        return _NOT_YET
                elif self._batch > 1 and self._arrived and not quiet:
                    found = self._lookup_with_others(session, query)
                else:
                    found = session.lookup(*query, timeout=self.settings.query_timeout_s)
        except orbitkv.Refused as e:
            kind = str(e.args[0])
            if kind == "stale_session":
                self.link.drop("stale session")
            stats.miss(kind)
            return None
        except TimeoutError:
            # A lookup holds nothing: a late answer is dropped.
            stats.miss("timeout")
            return None
        except LINK_ERRORS as e:
            self.link.drop(f"{type(e).__name__}: {e}")
            stats.miss("unavailable")
            return None
        if not found.local:
            self._looked = True
        reason = found.reason
        if reason is not None:
            m = stats.misses_by_reason
            if reason in m:
                m[reason] += 1
            else:
                stats.miss(reason)
            return None
        return found.selected

    def _batched(self, state: _Request, origin: int, pages: int) -> Any:
        """The answer looked up along with another request's, if it is for
        these tokens, of this connection and fresh enough; it is used once."""
        b = state.batched
        if b is None:
            return None
        state.batched = None
        if origin != 0 or b[0] != pages or b[1] != self.link.generation:
            return None
        if time.monotonic() - b[2] > self._batch_age:
            return None
        return b[3]

    def _lookup_with_others(self, session: orbitkv.Session, query: Tuple[Any, ...]) -> Any:
        """`query`'s answer, looked up in one round trip with the requests
        that arrived since and were not asked about yet (up to
        ``lookup_batch`` in all); theirs are kept for when vLLM asks."""
        queries = [query]
        others = []
        page = self.spec.page_tokens
        while self._arrived and len(queries) < self._batch:
            rid = next(iter(self._arrived))
            request = self._arrived.pop(rid)
            pages = min(len(request.block_hashes), (request.num_tokens - 1) // page)
            if pages <= 0:
                continue
            hashes = self._hashes(session, request, pages, 0)
            queries.append((self._group_ids, hashes, 0, request.num_tokens))
            others.append((request, pages))
        found = session.lookup_many(queries, timeout=self.settings.query_timeout_s)
        now = time.monotonic()
        generation = self.link.generation
        for (request, pages), answer in zip(others, found[1:]):
            state = self.requests.get(request.request_id)
            if state is None:
                state = self.requests[request.request_id] = _Request(request)
            state.batched = (pages, generation, now, answer)
        return found[0]

    def _hashes(self, session: orbitkv.Session, request: Any, pages: int, origin: int) -> Any:
        """The page hashes a lookup of `pages` pages sends: a long one stops
        at a page the presence filter proves absent (the answer is the
        same; see `Session.pages_worth_asking`)."""
        if pages - origin // self.spec.page_tokens > _BOUND_FROM_PAGES:
            bound = session.pages_worth_asking(self._group_ids, request.block_hashes, origin)
            pages = min(pages, bound)
        return request.block_hashes[:pages]

    def _count(self, origin: int, pages: int) -> None:
        self.stats.queries += 1
        self.stats.queried_tokens += pages * self.spec.page_tokens - origin

    def _collect(
        self,
        session: orbitkv.Session,
        state: _Request,
        query: Tuple[Any, ...],
        pages: int,
        quiet: bool = False,
    ) -> Any:
        """``lookup_wait: false``: the request's lookup of `pages` pages
        (`query` may send fewer, see `_hashes`) is sent once and its answer
        collected without waiting; `None` until it has come.
        `TimeoutError` past ``query_timeout_s``."""
        _, _, origin, _ = query
        p = state.pending
        if p is not None and (p.origin, p.pages, p.generation) != (origin, pages, self.link.generation):
            session.forget_lookup(p.ticket)  # asked of another session, or for other tokens
            p = state.pending = None
        if p is None:
            if not quiet:
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
        self,
        rid: str,
        scheduled: int,
        handed: Optional[Dict[Tuple[int, int], int]] = None,
        block_ids: Optional[Sequence[List[int]]] = None,
    ) -> Optional[SaveSpec]:
        """The pages `rid` completes in this step, to save. `block_ids`:
        its block ids per group, as vLLM sent them with a new request;
        else they are read from its blocks."""
        state = self.requests.get(rid)
        if state is None:
            return None
        request = state.request
        page = self._page
        saved = state.saved_pages
        computed = request.num_computed_tokens
        if saved < 0:
            # Pages the request starts with came from the local prefix cache
            # or from OrbitKV: already published by whoever computed them.
            saved = state.saved_pages = computed // page
        hashes = request.block_hashes
        done = min((computed + scheduled) // page, len(hashes))
        if done <= saved or self.kv_cache_manager is None:
            return None
        # Column by column (one list per group): the scheduler's thread runs
        # this for every scheduled request, every step, so nothing is built
        # per page and group.
        n = done - saved
        null_id = self._null_id
        full = False
        columns = []
        groups = block_ids if block_ids is not None else self.kv_cache_manager.get_blocks(rid).blocks
        for vg, group in enumerate(groups):
            if vg in self._recurrent:
                got = handed or {}
                columns.append([got.get((vg, (p + 1) * page), NULL_BLOCK) for p in range(saved, done)])
                continue
            column = group[saved:done]
            if block_ids is None:
                column = list(map(_BLOCK_ID, column))
            if null_id in column:
                column = [NULL_BLOCK if b == null_id else b for b in column]
            if len(column) < n:
                column += [NULL_BLOCK] * (n - len(column))
            elif not full and NULL_BLOCK not in column:
                full = True
            columns.append(column)
        save = SaveSpec(rid, saved, hashes[saved:done], tuple(columns))
        # Usually some group (full attention) has a block for every page.
        save.pages = n if full else sum(1 for _ in save.items())
        state.saved_pages = done
        if self.events is not None:
            tokens = request.all_token_ids
            hashes = request.block_hashes
            for p, h, _ in save.items():
                parent = bytes(hashes[p - 1]) if p > 0 else None
                self.events.record_save(bytes(h), tuple(tokens[p * page : (p + 1) * page]), parent)
        if not save.pages:
            return None
        state.saves_sent = True
        self.stats.pages_saved += save.pages
        return save
