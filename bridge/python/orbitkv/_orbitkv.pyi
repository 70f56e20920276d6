"""Type stubs for OrbitKV's native module. Import :mod:`orbitkv` instead.

Structured arguments and results are plain JSON-like data (``dict`` with
``str`` keys, ``list``/``tuple``, ``str``, ``int``, ``float``, ``bool``,
``None``) in the serde JSON shape of the Rust types, the same shape the wire,
traces and ``orbitkv`` CLI use. Integers must fit in 64 bits.
"""

from __future__ import annotations

import builtins
import enum
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, final

_JSON = Any
_Command = Dict[str, _JSON]
"""A command, e.g. ``{"command": "open_session", "instance": "llama"}``.

``command`` is one of ``register_instance``, ``open_session``,
``close_session``, ``register_device_region``, ``device_page_alloc``,
``device_page_free``, ``query``, ``prepare``, ``restore``, ``publish``,
``release``, ``cancel``, ``advance_clock``; the other keys are that variant's
fields (``orbitkv_components::api::Command``). Digests and hashes are
lowercase hex strings; session handles are ``{"id", "epoch", "incarnation"}``.
"""
_Event = Dict[str, _JSON]
"""An event, e.g. ``{"event": "session_opened", "command": 1, "session": {...}}``.

``event`` is one of ``rejected`` (with ``error``: ``{"error": KIND,
"detail": ...}``; the command had no effect), ``instance_registered``,
``session_opened``, ``session_closed``, ``region_registered``,
``device_page_allocated``, ``device_page_freed``, ``query_result``,
``loading``, ``ready``, ``transfer_overdue``, ``miss``, ``restore_done``,
``publish_done``, ``released`` (``orbitkv_components::api::Event``).

Deadlines (``docs/serve.md``): when an operation's copy or read passes its
limit (``transfer_timeout_us``, ``agent_copy_deadline_us`` for a copy
agent), ``transfer_overdue`` arrives and, in the same tick, the operation's
final reply (``miss``, or ``publish_done`` counting the overdue pages
``dropped``). What the overdue copy may still touch stays held after that
reply: a device page freed meanwhile is reported by ``device_page_freed``
with ``deferred: true`` only when the copy ends or the connection closes,
and its memory must not be reused before.
"""
_Contract = Mapping[str, _JSON]
"""``{"namespace": HEX64, "page_tokens": int, "groups": [{"id": int, "rule":
"prefix" | {"window": PAST_TOKENS} | "checkpoint", "components": [str, ...]}]}``
(``docs/contract.md``)."""
_Bundle = Mapping[str, _JSON]
"""One rank's evidence: ``{"namespace": HEX64, "start": int, "end": int,
"groups": [{"group": int, "page_ends": [int, ...]}, ...]}``."""

__version__: str
_debug_build: bool
"""Whether this extension is a debug build (benchmarks warn about it)."""

__all__ = [
    "__version__",
    "Client",
    "ConnectionError",
    "SharedBuffer",
    "ContractError",
    "CudaUnavailable",
    "IdentityError",
    "InvariantError",
    "Loaded",
    "Lookup",
    "MissReason",
    "QueueFull",
    "Ready",
    "Refused",
    "Rejected",
    "Runtime",
    "Saved",
    "Session",
    "Unavailable",
    "required_ranges",
    "restorable_boundaries",
    "common_boundaries",
    "select_boundary",
    "vllm_window_past_tokens",
    "compute_identity",
]

class ContractError(ValueError):
    """A recovery contract, bundle, namespace or span was rejected; the
    message is the Rust error (``ContractError``) or serde's."""

class IdentityError(ValueError):
    """An identity input could not be established (OrbitKV fails closed):
    bad ``ORBITKV_MODEL_FINGERPRINT``, no weights or ``config.json``, a
    ``null`` or empty settings map, active adapters, a bad layout."""

class InvariantError(RuntimeError):
    """The runtime's state violates an invariant."""

    violations: List[str]
    """One line per violation."""

class CudaUnavailable(RuntimeError):
    """CUDA memory (``device="cuda:N"``) was offered to a copy agent and
    this process cannot use CUDA: no driver (``libcuda``), no such device,
    or the driver failed to initialise; the message says which. The memory
    is never copied with host memcpy instead."""

class QueueFull(Exception):
    """The runtime's inbox holds ``limits.max_inbox`` commands: call
    :meth:`Runtime.tick` to drain it, then submit again. From a
    :class:`Client`: the manager's inbox was full; submit again later."""

class Rejected(Exception):
    """The manager refused a command (it had no effect). ``args`` are the
    error's kind (``stale_session``, ``invalid``, ``limit``, ...), its
    reason label (what ``orbitkv_refusals_total{reason}`` counts: the kind,
    the malformation's kind for ``invalid``, ``limit_<name>`` for a limit),
    the manager's message, and the error as a ``rejected`` event carries
    it (``{"error": kind, "detail": ...}``). Raised by the typed verbs
    (:meth:`Client.lookup`), and by every call when the manager refuses to
    queue a command (a session or region quota of the connection, uid or
    process); :meth:`Client.call` returns a ``rejected`` event for what the
    runtime refuses."""

class ConnectionError(builtins.ConnectionError):
    """The connection to the manager failed: it could not be made, the
    manager refused it (another uid, too many connections, a protocol
    error: the message is the manager's ``Error`` frame), the manager went
    away (restart, crash), or the client is closed. The client cannot be
    used afterwards; connect a new one."""

class Refused(Rejected):
    """The manager answered and refused (raised by :class:`Session`): not
    unavailability; nothing was done. ``args`` are as for
    :class:`Rejected`: kind, reason label, message, the error as a dict."""

    command: str
    """The refused command (``register_instance``, ``load``, ...)."""

class Unavailable(ConnectionError):
    """The manager does not answer (down, restarting, too slow), or the
    session's connection could no longer be trusted and was given up
    (its copy agent drained first). The next call reconnects, at most once
    per ``reconnect_interval``."""

class MissReason(str, enum.Enum):
    """Why a lookup or load missed; ``str()`` is the value, the label
    metrics and logs use."""

    NOT_FOUND = "not_found"
    NAMESPACE = "namespace"
    INCOMPLETE_GROUP = "incomplete_group"
    NO_LEGAL_BOUNDARY = "no_legal_boundary"
    BUDGET = "budget"
    DEADLINE = "deadline"
    STALE_GENERATION = "stale_generation"
    STALE_SESSION = "stale_session"
    IO_ERROR = "io_error"
    CHECKSUM = "checksum"
    CANCELLED = "cancelled"
    EVICTED_DURING_READ = "evicted_during_read"
    REMOTE_MISSING = "remote_missing"
    REMOTE_CORRUPT = "remote_corrupt"
    REMOTE_UNAVAILABLE = "remote_unavailable"
    REMOTE_TIMEOUT = "remote_timeout"
    NOT_WORTH_LOADING = "not_worth_loading"

@final
class Lookup:
    """What a lookup found. Nothing is held."""

    selected: Optional[int]
    """Tokens a load would restore to; ``None`` on a miss."""
    miss: Optional[MissReason]
    candidates: List[Tuple[int, int, List[int]]]
    """``(rank, group, page_ends)`` the manager holds."""
    common: List[int]
    """Boundaries every group could resume at."""
    reason: Optional[str]
    """``str(miss)`` (the metrics label), without the enum's ``__str__``."""
    local: bool
    """Answered in this process from the manager's presence filter (a
    certain miss, ``not_found``), without a round trip."""
    @property
    def hit(self) -> bool: ...

@final
class Located:
    """What a load of a prompt would restore on this host now. Nothing is
    held: an eviction before the load can still make it less."""

    tokens: int
    """Tokens a load would restore to; 0 on a miss."""
    by_tier: Dict[str, int]
    """Those tokens by the tier each page position would be read from
    (``dram``, ``ssd``, ``remote``; the slowest of its pages)."""
    miss: Optional[MissReason]

@final
class Loaded:
    """A load's outcome: ``hit`` at ``boundary`` (every page named for it
    landed and was verified), or ``miss``."""

    boundary: int
    miss: Optional[MissReason]
    leased: List[Tuple[int, int, int]]
    """``(rank, group, page_end)`` of every page leased for the boundary,
    the ``retained`` ones included."""
    ranges: List[Tuple[int, int, int, int]]
    """``(rank, group, start, end)`` each group needed."""
    pages: int
    bytes: int
    pages_from_tiers: int
    """Pages read from a lower tier (SSD, remote) rather than DRAM."""
    @property
    def hit(self) -> bool: ...

@final
class Ready:
    """A started load's (or lease's) pages are leased (from
    :meth:`Session.poll`)."""

    boundary: int
    leased: List[Tuple[int, int, int]]
    """``(rank, group, page_end)``."""
    pool_pages: List[Tuple[int, int, int, int, int, int]]
    """``(rank, group, page_end, offset, bytes, checksum)``: each page in the
    manager's pool (:meth:`Client.pool`), for an engine that reads them
    itself (:meth:`Session.start_lease`)."""

@final
class Saved:
    inserted: int
    duplicates: int
    dropped: int
    @property
    def stored(self) -> int:
        """``inserted + duplicates``: pages the manager holds."""

@final
class Instance:
    """An engine instance as the manager registers it: its name, identity,
    layout (where its pages live on each rank), page size in tokens,
    attention groups and ranks. Checked when made, each part against the
    contract's types: a bad description fails where the engine builds it,
    naming the part. Equal when every part is equal."""

    def __new__(
        cls,
        *,
        name: str,
        identity: str,
        layout: Dict[str, _JSON],
        page_tokens: int,
        groups: List[Dict[str, _JSON]],
        ranks: List[Dict[str, int]],
    ) -> Instance:
        """:raises ValueError: a part is not what the contract expects (the
        message names the part), the identity is not 64 lowercase hex
        digits, or there are no groups or no ranks."""

    @property
    def name(self) -> str: ...
    @property
    def identity(self) -> str:
        """64 lowercase hex digits."""
    @property
    def page_tokens(self) -> int: ...
    @property
    def layout(self) -> Dict[str, _JSON]:
        """A new copy, as plain Python data."""
    @property
    def groups(self) -> List[Dict[str, _JSON]]:
        """A new copy, as plain Python data."""
    @property
    def ranks(self) -> List[Dict[str, int]]:
        """A new copy, as plain Python data."""

class Session:
    """The engine side: one engine process's session with a manager, the
    one way engines talk to OrbitKV (``engine/``, ``orbitkv_engine``).

    Nothing connects until :meth:`connect` or the first verb. A connection
    registers the instance, opens a session and runs ``on_connect(session)``
    (the engine attaches its memory and registers its regions). A verb
    that finds the manager gone raises :class:`Unavailable` and gives the
    connection up; after a failure, connecting is tried again at most once
    per ``reconnect_interval`` seconds, and calls in between raise the last
    failure again (a refusal stays :class:`Refused`).

    Hashes are ``bytes`` (1 to 64 each), in page order, the same for every
    group asked. Every verb runs without the GIL; calls are serialized.
    """

    def __new__(
        cls,
        backend: Union[str, os.PathLike[str], Client, Runtime],
        instance: Instance,
        *,
        name: str = "python",
        timeout: float = 10.0,
        reconnect_interval: float = 1.0,
        spin_us: Optional[int] = None,
        on_connect: Optional[Callable[[Session], None]] = None,
    ) -> Session:
        """:param backend: a manager's socket (the session's own connection,
            reconnected after a failure, closed with it), a :class:`Client`
            (shared, the caller's), or a wall-clock :class:`Runtime` (its
            waits tick it).
        :param instance: what the session registers.
        :param timeout: the longest wait for any one reply or outcome.
        :param spin_us: how long waits spin before they block (as
            :meth:`Client.set_spin_us`).
        :raises TypeError: ``instance`` is not an :class:`Instance`.
        :raises ValueError: a bad interval or timeout.
        """

    def connect(self) -> None:
        """Connects now if not connected.

        :raises Refused: the manager refused the instance or session.
        :raises Unavailable: the manager does not answer.
        """

    @property
    def up(self) -> bool: ...
    @property
    def generation(self) -> int:
        """Sessions opened so far."""
    @property
    def failures(self) -> int:
        """Failed connection attempts since the last success."""
    @property
    def last_error(self) -> Optional[str]: ...
    @property
    def client(self) -> Union[Client, Runtime]:
        """The connection (memory views, ``attach_agent_memory``),
        connecting first if needed."""
    @property
    def handle(self) -> Dict[str, int]: ...
    @property
    def namespaces(self) -> List[str]: ...
    @property
    def device_pages_held(self) -> int:
        """Device pages in the slot table."""

    def register_region(
        self, rank: int, group: int, slots: int, agent: Optional[Tuple[int, int]] = None
    ) -> int:
        """Registers a device region (``agent``: what
        ``client.attach_agent_memory`` returned); returns its handle. Call
        from ``on_connect``."""

    def device_pages(self, region: int, slots: Sequence[int]) -> List[int]:
        """Device pages of ``slots``: allocated once per slot (the missing
        ones in one round trip) and kept while the session lives.

        :raises ValueError: a region this session did not register, a slot
            outside it."""

    def lookup_local(
        self, groups: Sequence[int], hashes: Sequence[bytes], origin: int
    ) -> Optional[Lookup]:
        """The miss ``lookup`` would answer from the manager's presence
        filter without a round trip (``local`` set), or ``None`` when only
        the manager can answer. Never waits; reads only the hash the
        filter checks (``ValueError`` if it is not a hash)."""
        ...
    def pages_worth_asking(
        self, groups: Sequence[int], hashes: Sequence[bytes], origin: int
    ) -> int:
        """How many of `hashes` a lookup from `origin` needs to send: the
        index of a page the presence filter proves is in no tier (a lookup
        of ``hashes[:n]`` selects the same boundary, or misses for the same
        reason), else ``len(hashes)``. Probes at most
        ``log2(len(hashes))`` hashes; never waits (``ValueError`` if a
        probed item is not a hash)."""
        ...
    def lookup(
        self,
        groups: Sequence[int],
        hashes: Sequence[bytes],
        origin: int,
        prompt_len: int,
        timeout: Optional[float] = None,
    ) -> Lookup:
        """Where the manager would resume a prompt, past ``origin`` tokens
        of ``prompt_len``. One round trip; holds nothing. Past ``timeout``
        (default: the session's), ``TimeoutError``; the connection stays."""

    def start_lookup(
        self, groups: Sequence[int], hashes: Sequence[bytes], origin: int, prompt_len: int
    ) -> int:
        """Sends a lookup without waiting for anything; returns its ticket
        (at most 4096 in flight, else ``ValueError``)."""

    def lookup_result(self, ticket: int) -> Optional[Lookup]:
        """A started lookup's answer if it has arrived, else ``None``; never
        blocks. After an answer (or a failure) the ticket is done.

        :raises ValueError: no such lookup in flight.
        :raises Refused: the manager refused it.
        """

    def forget_lookup(self, ticket: int) -> None:
        """Gives a started lookup up; its answer is dropped when it comes."""

    def warm(self) -> None:
        """Wakes a sleeping manager without a request, when requests
        follow soon (a scheduler that looked prefixes up this step is about
        to plan the next), so the first does not pay its wake-up. Never
        blocks and never connects; nothing while not connected or while the
        manager is awake."""

    def lookup_many(
        self,
        queries: Sequence[Tuple[Sequence[int], Sequence[bytes], int, int]],
        timeout: Optional[float] = None,
    ) -> List[Lookup]:
        """Many lookups, ``(groups, hashes, origin, prompt_len)`` each, in one
        round trip per 64; every answer within ``timeout`` seconds of the
        call (default: the session's), else ``TimeoutError``."""

    def locate(self, hashes: Sequence[bytes], prompt_len: Optional[int] = None) -> Located:
        """What a load of a prompt would restore now, and from which tier
        (a router's question; ``POST /lookup`` answers the same): every rank
        and group of this session's instance, ``hashes`` the same for every
        group, capped below ``prompt_len`` when given. Holds nothing."""

    def locate_many(self, prompts: Sequence[Tuple[Sequence[bytes], Optional[int]]]) -> List[Located]:
        """Many ``locate``s, ``(hashes, prompt_len)`` each, in one round trip
        per 64."""

    def load(
        self,
        groups: Sequence[int],
        hashes: Sequence[bytes],
        origin: int,
        prompt_len: int,
        *,
        ranks: Sequence[int],
        targets: Sequence[Tuple[int, int, int, int]],
        retained: Sequence[Tuple[int, int, int]] = (),
        handoff: Optional[int] = None,
    ) -> Loaded:
        """One command: the manager selects the boundary, leases and reads
        its pages and copies them into ``targets`` (``(rank, group,
        page_end, device_page)`` for every page the engine could take);
        ``retained`` (``(rank, group, page_end)``) are pages the engine
        holds. Returns after the last event. ``handoff``: the P/D handoff
        (:meth:`hold`) this load takes; its pins return once it retired.

        :raises Refused: the plan does not cover the selected ranges
            (``load_invalid``) or names what is not this session's.
        :raises Unavailable: no outcome in time, or a copy passed its
            deadline (the connection is given up; its agent drains first).
        """

    def hold(self, groups: Sequence[int], hashes: Sequence[bytes], handoff: int, deadline_ms: int) -> Tuple[int, int, int]:
        """A P/D prefill engine's promise (docs/pd.md): the pages of
        ``hashes`` in ``groups``, on every rank, stay pinned in the
        manager's DRAM as they land, until a load passing
        ``handoff=handoff`` retired or ``deadline_ms`` passed. Returns
        ``(promised, pinned_now, bytes_reserved)``.

        :raises Refused: a bound (``limit_handoff_bytes``,
            ``limit_max_handoffs``, ``limit_max_handoff_deadline``), a
            duplicate id (``handoff_exists``), nothing promised
            (``empty_handoff``); nothing is pinned.
        """

    def save(self, pages: Sequence[Tuple[int, int, bytes, int]]) -> Saved:
        """Saves ``(rank, group, hash, device_page)`` pages."""

    def start_load(
        self,
        groups: Sequence[int],
        hashes: Sequence[bytes],
        origin: int,
        prompt_len: int,
        *,
        ranks: Sequence[int],
        targets: Sequence[Tuple[int, int, int, int]],
        retained: Sequence[Tuple[int, int, int]] = (),
        handoff: Optional[int] = None,
    ) -> int:
        """Starts a :meth:`load`; returns its ticket. :meth:`poll` reports
        its :class:`Ready`, then its :class:`Loaded` (or a :class:`Refused`)."""

    def start_lease(
        self, groups: Sequence[int], hashes: Sequence[bytes], origin: int, prompt_len: int
    ) -> int:
        """Starts a lease of the selected pages, for an engine that reads
        them from the pool itself: its :class:`Ready` names them
        (``pool_pages``); read them, then :meth:`release`."""

    def release(self, ticket: int) -> None:
        """Ends a lease whose pages were read."""

    def cancel(self, ticket: int) -> bool:
        """Cancels a started lease whose operation is known."""

    def start_save(self, pages: Sequence[Tuple[int, int, bytes, int]]) -> int:
        """Starts a :meth:`save`; :meth:`poll` reports its :class:`Saved`."""

    def poll(self, timeout: float = 0.0) -> List[Tuple[int, Union[Ready, Loaded, Saved, Refused]]]:
        """``(ticket, outcome)`` of started verbs, waiting up to ``timeout``
        seconds when nothing is known yet. A :class:`Refused` outcome is an
        exception instance, not raised.

        :raises Unavailable: the connection failed or a copy passed its
            deadline: every verb in flight is lost."""

    @property
    def in_flight(self) -> int:
        """Started verbs not yet ended."""

    def region_view(self, region: int) -> memoryview:
        """A writable view of a device region this session registered,
        whatever the backend."""

    def drop(self, why: Optional[str] = None) -> None:
        """Gives the connection up; the next call reconnects."""

    def close(self) -> None:
        """Closes the session and the connection (idempotent)."""

    def __enter__(self) -> Session: ...
    def __exit__(self, *args: object) -> bool: ...

@final
class Runtime:
    """The embedded OrbitKV runtime: commands in, events out, one
    :meth:`tick` at a time.

    Calls are serialized by an internal lock and run without the GIL, so a
    tick on one thread does not stall other Python threads.

    With ``"check_invariants": true`` in the config (the default in debug
    builds), every tick checks the invariants; a violation raises
    :class:`InvariantError` from :meth:`tick`. After that (or any other panic
    inside the runtime, raised as ``RuntimeError``) the runtime's state is
    not trusted and every later call raises ``RuntimeError``.
    """

    def __new__(
        cls,
        config: Union[Mapping[str, _JSON], str, None] = None,
        *,
        simulated_clock: bool = False,
    ) -> Runtime:
        """Builds a runtime.

        :param config: ``orbitkv_world::Config`` as a dict, or as JSON text;
            ``None`` is the default (1 GiB DRAM pool, first-touched). Unknown
            keys are errors. Example: ``{"dram": {"capacity_bytes": 16 << 20,
            "extent_bytes": 65536, "first_touch": False}}``.
        :param simulated_clock: ``False``: the host copy engine (worker
            threads), the configured SSD tier, wall time. ``True``: the
            deterministic simulated copy engine, no lower tiers, and time
            moves only by ``{"command": "advance_clock", "us": N}``; copies
            complete once enough simulated time has passed (10 us plus
            1 us per 10 kB).
        :raises ValueError: a bad config (serde's message or the validation
            error).
        :raises OSError: the SSD tier could not be opened.
        """

    @property
    def simulated_clock(self) -> bool:
        """Whether time moves only by ``advance_clock`` commands."""

    def submit(self, command: _Command) -> int:
        """Queues a command for the next tick.

        :returns: the command id; the events answering it carry it as
            ``"command"``.
        :raises ValueError: the dict is not a command (serde's message, e.g.
            ``missing field `instance```). A well-formed command the runtime
            refuses is answered by a ``rejected`` event instead.
        :raises QueueFull: the inbox is full.
        """

    def tick(self) -> List[_Event]:
        """Runs every stage once; returns the events it produced.

        :raises InvariantError: the per-tick invariant check failed.
        """

    def stats(self) -> Dict[str, _JSON]:
        """A snapshot: ``now_us``, ``instances``, ``sessions``,
        ``operations``, ``operations_by_state``, ``pages``, ``leases``,
        ``transfers``, ``device_pages``, ``bytes_reserved``,
        ``pool_bytes_used``, ``pool_capacity_bytes``, ``metrics`` (a dict of
        counters)."""

    def is_idle(self) -> bool:
        """Whether nothing is queued, in flight or leased."""

    def check_invariants(self) -> None:
        """Checks every runtime invariant.

        :raises InvariantError: listing the violations (also in
            ``.violations``).
        """

    def record(self, path: Union[str, os.PathLike[str]], tick_interval_us: int = 1000) -> None:
        """Records every command and tick from now on to ``path`` as a trace
        that ``orbitkv replay`` runs (``docs/trace-format.md``).
        ``tick_interval_us`` is the caller's idle tick interval, written for
        the replay's drain. The file is flushed by :meth:`stop_recording` or
        when the runtime is dropped.

        :raises OSError: the file could not be created or written.
        """

    def stop_recording(self) -> None:
        """Stops recording and flushes the trace.

        :raises OSError: the first write error while recording.
        """

    def device_write(self, region: int, offset: int, data: Union[bytes, bytearray]) -> None:
        """Writes "device" bytes directly into the copy engine's memory (the
        host and simulated engines keep device regions in host memory).

        :param region: the ``engine_region`` of a ``region_registered``
            event (not its ``region`` handle).
        :param offset: byte offset in the region; slot ``s`` of a region
            starts at ``s * page_bytes``.
        :raises ValueError: unknown region, or out of bounds.
        """

    def device_read(self, region: int, offset: int, length: int) -> bytes:
        """Reads ``length`` "device" bytes of a region (its
        ``engine_region``) at a byte offset.

        :raises ValueError: unknown region, or out of bounds.
        """

    def device_view(self, region: int) -> memoryview:
        """A writable, zero-copy view of a whole device region (its
        ``engine_region``), as an engine sees its GPU memory: slot ``s``
        starts at ``s * page_bytes``. Write pages there before publishing
        them, read them after ``restore_done``; ``torch.frombuffer`` and
        ``numpy.frombuffer`` wrap it without a copy. The view holds its own
        mapping, so it stays valid memory after the session closes or the
        runtime is dropped. Host copy engine only.

        :raises ValueError: a simulated clock (use :meth:`device_read` /
            :meth:`device_write`), or an unknown region.
        :raises OSError: the region could not be mapped.
        """

    def attach_agent_memory(
        self,
        slots: int,
        chunks: Sequence[Tuple[int, int, int]],
        owner: object,
        device: str = "cpu",
    ) -> Tuple[int, int]:
        """Attaches engine memory to the runtime's in-process copy agent as
        one region of ``slots`` page slots. A page is the ``chunks``' runs in
        order: each chunk is ``(data_ptr, stride, length)`` and slot ``s``'s
        run starts at ``data_ptr + s * stride`` (one chunk ``(ptr,
        page_bytes, page_bytes)`` for a contiguous buffer; one per layer's
        K and V block for a KV cache). Register the returned ``(region,
        page_bytes)`` with ``{"command": "register_device_region", ...,
        "agent": {"region": region, "page_bytes": page_bytes}}``.

        The runtime never maps this memory: restores and publishes of the
        region run in the agent, off the Python thread, on the runtime's
        instruction (``agent_copy`` events, which :meth:`tick` hands to the
        agent instead of returning them). ``owner`` (the tensor or array)
        is kept alive until :meth:`detach_agent_memory`; the memory must not
        move or be freed before that.

        ``device`` is ``"cpu"`` (host memory: memcpy worker threads) or
        ``"cuda:N"`` (``data_ptr`` a device pointer on CUDA device N, as
        ``str(tensor.device)`` gives it): the agent then copies with the
        CUDA copy engine (pinned pool, async copies on its own streams), and
        each chunk must lie inside one CUDA allocation on that device. The
        first memory attached decides the agent's executor; memory of the
        other kind is refused.

        :raises CudaUnavailable: ``"cuda:N"`` memory where this process
            cannot use CUDA (the reason is in the message).
        :raises ValueError: a bad device string, memory of the other kind,
            or a bad layout (empty, null, a stride shorter than its run,
            wrapping, outside its CUDA allocation).
        """

    def detach_agent_memory(self, region: int) -> bool:
        """Detaches an agent region once its session is closed and lets go
        of its owner; ``False`` if there is no such region.

        :raises RuntimeError: copies are still running (tick first).
        """

@final
class Client:
    """A connection to a standalone manager (``orbitkv serve``) over its
    Unix socket: the same commands and events as :class:`Runtime`, routed to
    this connection (replies to its commands, events of its operations,
    sessions and device pages). The manager ticks by itself.

    KV bytes never travel in messages: :meth:`page` and :meth:`region` are
    zero-copy ``memoryview`` s over shared memory (the manager's pool, the
    client's device regions), usable with ``numpy.frombuffer``. A view keeps
    its memory mapped for as long as it (or anything made from it) lives,
    even after :meth:`close`.

    Blocking calls release the GIL; waits check for signals every 100 ms, so
    Ctrl-C interrupts them. Calls from several threads are serialized.

    When the connection closes (:meth:`close`, garbage collection, process
    exit or crash), the manager closes this client's sessions: their leases
    and reserved bytes return once submitted I/O has drained.
    """

    def __new__(cls, socket: Union[str, os.PathLike[str]], name: str = "python") -> Client:
        """Connects and shakes hands (within 10 s), mapping the manager's
        shared pool.

        :param name: shows in the manager's logs.
        :raises ConnectionError: no manager at ``socket``, or it refused
            this client (e.g. ``uid 1000 may not use this manager``).
        :raises TimeoutError: no ``Welcome`` within 10 s.
        """

    @property
    def incarnation(self) -> int:
        """The manager's incarnation, from its ``Welcome``: it changes at
        every manager start, and session handles carry it, so handles of an
        earlier manager are answered with ``rejected`` / ``stale_session``."""

    @property
    def pool_bytes(self) -> int:
        """Bytes of the manager's shared pool (0 if it did not share it)."""

    @property
    def socket(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""

    def submit(self, command: _Command) -> int:
        """Sends a command and waits for the manager to queue it.

        :returns: the command id; replies carry it as ``"command"``.
        :raises ValueError: the dict is not a command (serde's message).
        :raises QueueFull: the manager's inbox was full (nothing queued).
        :raises Rejected: the manager refused to queue it (a quota).
        :raises ConnectionError: the connection failed.
        """

    def call(self, command: _Command, timeout: float = 10.0) -> _Event:
        """Submits a command and returns its reply event: ``rejected`` if
        the manager refused it (the command had no effect), otherwise
        ``instance_registered``, ``session_opened``, ``region_registered``
        (the region's shared memory is mapped by then), ``device_page_allocated``,
        ``device_page_freed`` (later, with the last pin, when a copy holds
        the page), ``session_closed`` (once the session's I/O drained),
        ``query_result`` or ``publish_done``. Commands without a reply of
        their own (``prepare``, ``restore``, ``release``, ``cancel``) are
        answered only if rejected: :meth:`submit` them and
        :meth:`wait_event` for what follows (``ready``, ``restore_done``,
        ``released``, ...). Other events that arrive meanwhile stay queued.

        :raises TimeoutError: no reply within ``timeout`` seconds.
        :raises ValueError: not a command, or a bad ``timeout``.
        :raises QueueFull: the manager's inbox was full.
        :raises Rejected: the manager refused to queue it (a quota).
        :raises ConnectionError: the connection failed.
        """

    def lookup(
        self,
        session: Dict[str, int],
        request: int,
        groups: Sequence[int],
        hashes: Sequence[bytes],
        origin: int,
        prompt_len: int,
        expect_namespaces: Optional[Sequence[str]] = None,
        timeout: float = 10.0,
    ) -> Tuple[Optional[int], Optional[str]]:
        """A lookup, typed: the boundary the manager would select for a
        request whose page hashes (``bytes``, in page order) are ``hashes``
        in every group of ``groups``, past ``origin`` tokens of a
        ``prompt_len``-token prompt. It holds nothing: nothing to release.
        The command is built from the bytes (no dict, no hex) and only the
        answer comes back; replies of earlier lookups that timed out are
        dropped.

        :returns: ``(selected, None)``, or ``(None, reason)`` for a miss
            (``MissReason``'s name, e.g. ``"not_found"``).
        :raises Rejected: the manager refused the lookup.
        :raises TimeoutError: no answer within ``timeout`` seconds.
        :raises ValueError: a hash that is not 1 to 64 bytes, a bad session
            or namespace.
        :raises QueueFull: the manager's inbox was full.
        :raises ConnectionError: the connection failed.
        """

    def wait_event(
        self, timeout: float, kind: Optional[str] = None, operation: Optional[int] = None
    ) -> Optional[_Event]:
        """The first queued or arriving event matching every filter given,
        removed from the queue; other events stay queued.

        :param kind: the event's ``"event"`` name, e.g. ``"ready"``.
        :param operation: the event's ``"operation"`` (``query_result``,
            ``loading``, ``ready``, ``transfer_overdue``, ``miss``,
            ``restore_done``, ``released``).
        :returns: the event, or ``None`` after ``timeout`` seconds.
        :raises ConnectionError: the connection failed.
        """

    def poll_events(self) -> List[_Event]:
        """Every queued and already arrived event, without blocking."""

    def set_spin_us(self, us: int) -> None:
        """How long this client's waits spin before they block, in
        microseconds (default 20; 0 blocks at once; at most 10000, else
        ``ValueError``). Spinning turns itself off for a while when it is
        preempted or when most replies outlast it."""

    @property
    def commands_sent(self) -> Dict[str, int]:
        """Commands this connection sent, by kind (``lookup``, ``load``,
        ...): what its users cost the manager, in round trips."""

    def ping(self) -> float:
        """Round trip of an empty frame through the manager's loop, in
        seconds.

        :raises ConnectionError: the connection failed (e.g. the manager
            restarted).
        """

    def page(self, lease: Mapping[str, _JSON]) -> memoryview:
        """A leased page's bytes: a read-only, zero-copy view of the
        manager's shared pool at the lease's ``offset`` (a lease dict of a
        ``ready`` event's ``leases``). The bytes are the page's while the
        lease is held; after ``release`` or ``restore_done`` the slot may be
        reused for another page (the view stays valid memory). The bytes
        are checked against the lease's ``checksum`` (XXH3-64, computed when
        the page was published) before the view is returned.

        :raises ValueError: not a lease, or outside the pool.
        :raises ConnectionError: the pool bytes do not match the checksum
            (the manager's memory is not what it published).
        """

    def page_at(self, offset: int, bytes: int, checksum: int) -> memoryview:
        """:meth:`page` for a page named by where it lies (a
        :class:`Ready`'s ``pool_pages``): checked against ``checksum``
        before the view is returned.

        :raises ValueError: outside the pool.
        :raises ConnectionError: the bytes do not match the checksum.
        """

    def pool(self) -> memoryview:
        """The whole shared pool: a read-only, zero-copy view, unverified.
        Read pages through :meth:`page` (which checks each against its
        lease) unless the caller verifies them itself.
        """

    def region(self, region: int) -> memoryview:
        """A device region this client registered (the ``region`` of its
        ``region_registered`` event): a writable, zero-copy view of its
        shared memory, as an engine sees GPU memory. Slot ``s`` starts at
        ``s * page_bytes``. Write pages there before publishing them; read
        them after ``restore_done``.

        :raises ValueError: not a region this client registered.
        """

    def attach_agent_memory(
        self,
        slots: int,
        chunks: Sequence[Tuple[int, int, int]],
        owner: object,
        device: str = "cpu",
    ) -> Tuple[int, int]:
        """Attaches engine memory to this connection's copy agent, laid out
        as for :meth:`Runtime.attach_agent_memory`; returns ``(region,
        page_bytes)`` for a ``register_device_region`` command's
        ``"agent"``. The manager never maps this memory: it sends each copy
        to this client's agent, which runs it on worker threads (off the
        Python thread) inside this client's waits and reports it; the
        ``agent_copy`` events never reach the caller. The agent maps the
        pool read-only and this connection's staging area (sent by the
        manager with the first agent region), the only memory it writes for
        the manager. ``owner`` is kept alive until
        :meth:`detach_agent_memory`.

        ``device``: ``"cpu"`` or ``"cuda:N"``, as for
        :meth:`Runtime.attach_agent_memory`. With CUDA memory the agent
        page-locks its window (pool read-only, staging writable) and
        unregisters it when the client closes.

        :raises CudaUnavailable: ``"cuda:N"`` memory where this process
            cannot use CUDA.
        :raises ValueError: a bad device string, memory of the other kind,
            or a bad layout.
        """

    def detach_agent_memory(self, region: int) -> bool:
        """Detaches an agent region once its session is closed and lets go
        of its owner; ``False`` if there is no such region.

        :raises RuntimeError: copies are still running.
        """

    def close(self) -> None:
        """Closes the connection (idempotent). Later calls raise
        :class:`ConnectionError`; views already handed out stay valid."""

    def __enter__(self) -> Client: ...
    def __exit__(self, *args: object) -> bool: ...
    def _ping_many(self, n: int) -> List[float]:
        """Benchmark helper: ``n`` pings timed inside Rust (seconds each)."""

@final
class SharedBuffer:
    """Shared memory of a :class:`Client` (the manager's pool or a device
    region) or a :class:`Runtime`'s device region, exported zero-copy
    through the buffer protocol: the ``obj`` of the views
    :meth:`Client.page`, :meth:`Client.region` and
    :meth:`Runtime.device_view` return. Not instantiable."""

def _uds_roundtrip(iterations: int, message_bytes: int = 16) -> List[float]:
    """Benchmark helper: round trips over a Unix socket pair between two
    Rust threads (blocking), seconds each."""

def default_socket() -> str:
    """The manager's socket when a configuration names none:
    ``ORBITKV_SOCKET`` if set, else where ``orbitkv serve`` listens by
    default (``$XDG_RUNTIME_DIR/orbitkv.sock``, else
    ``/tmp/orbitkv-<uid>/orbitkv.sock``): the manager's own rule."""

def required_ranges(
    contract: _Contract, start: int, end: int, namespace: Optional[str] = None
) -> List[Tuple[int, int, int]]:
    """``(group, start, end)`` each registered group needs to resume at
    boundary ``end`` from a valid origin ``start``, in group order. Ranges are
    absolute, half-open and page-aligned.

    :param namespace: the query's namespace (64 hex); defaults to the
        contract's own. A different one is an error.
    :raises ContractError: bad contract, namespace mismatch, misaligned or
        inverted span.
    """

def restorable_boundaries(contract: _Contract, bundle: _Bundle) -> List[int]:
    """Every legal boundary in ``(start, end]`` of one rank's evidence,
    ascending.

    :raises ContractError: bad contract or bundle.
    """

def common_boundaries(contract: _Contract, bundles: Sequence[_Bundle]) -> List[int]:
    """The boundaries legal on every rank (one bundle per rank, all for the
    same span); no bundles, no boundaries.

    :raises ContractError: bad contract or bundle, or ranks disagreeing on
        the span.
    """

def select_boundary(common: Sequence[int], prompt_len: int) -> Optional[int]:
    """The largest boundary in ``common`` at or below ``prompt_len - 1``
    (the engine computes the final prompt token itself), or ``None``."""

def vllm_window_past_tokens(window: int) -> int:
    """The past tokens a vLLM sliding window of ``window`` tokens keeps
    (``window - 1``): the value for ``{"window": ...}`` rules.

    :raises ContractError: ``window < 2``.
    """

def compute_identity(
    model_dir: Union[str, os.PathLike[str]],
    *,
    engine: str,
    engine_version: str,
    settings: Mapping[str, _JSON],
    representation: Mapping[str, _JSON],
    config_overrides: Optional[Mapping[str, _JSON]] = None,
    hub_revision: Optional[str] = None,
    active_adapters: Optional[Sequence[str]] = None,
    layout: Optional[Mapping[str, _JSON]] = None,
    groups: Optional[Sequence[Mapping[str, _JSON]]] = None,
) -> Dict[str, Any]:
    """The computation identity, as an adapter computes it at startup
    (``docs/identity.md``). Reads ``config.json`` and, unless
    ``ORBITKV_MODEL_FINGERPRINT`` or ``hub_revision`` is given, hashes the
    model directory's content (without the GIL). ``ORBITKV_MODEL_FINGERPRINT``
    and ``ORBITKV_CACHE_SCOPE`` are read from the process environment.

    :param settings: computation settings; non-empty, no ``None`` values.
        ``1`` and ``1.0`` are different values.
    :param representation: cache representation; non-empty, no ``None``.
    :param layout: a storage layout (``{"slots": [...],
        "pool_capacity_pages": int}``); given with ``groups``, the identity
        is sealed into a namespace.
    :param groups: the cache groups' shapes, as registration declares them
        (``[{"id": 0, "rule": "prefix", "components": ["attention_kv"]},
        ...]``): each group's rule (with its window) and component kinds are
        sealed, so instances that read a group differently never share
        pages. Required with ``layout``.
    :returns: ``{"identity": HEX64, "namespace": HEX64 or None, "inputs":
        [{"name": ..., ...}, ...], "bytes_hashed": int}``.
    :raises IdentityError: any input that cannot be established.
    """
