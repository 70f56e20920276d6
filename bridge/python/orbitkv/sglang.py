"""SGLang HiCache L3 storage backend: :class:`OrbitKVStorage`.

SGLang builds it through its dynamic backend factory::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "orbitkv",
        "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
        "interface_v1": 1, "socket": "/run/orbitkv.sock"}'

and calls it from its cache controller's threads (backup, prefetch query,
prefetch I/O) concurrently. Every page goes to an ``orbitkv serve`` manager
under a ``StateKey`` whose namespace seals this engine's computation identity
(model artifacts, configuration, dtype, KV dtype, page size, parallel rank,
host page format) with its storage layout, so pages of another model, another
configuration or another tensor-parallel rank can never be read back.

What it guarantees (``docs/sglang.md`` has the user's view):

- Per-key results are a prefix: ``[True] * k + [False] * (n - k)``, never a
  hole. A page is reported only once its bytes are in the host pool (gets)
  or in the manager's pool (sets).
- ``batch_exists`` / ``batch_exists_v2`` answer from the manager's discovery
  (metadata only: no payload read, no byte reservation) and count only the
  boundaries the compiled recovery contract calls legal for every registered
  pool (KV prefix, SWA window).
- No call raises into SGLang's threads: a failure (manager down or
  restarted, timeout, refusal, bad input) is a miss with a reason, counted
  in :meth:`OrbitKVStorage.get_stats` and logged (rate-limited). A broken
  connection is dropped; the next call reconnects (a new session) once
  ``reconnect_interval_s`` has passed.
- A refusal is not unavailability: a manager that refuses this engine's
  registration (an instance name taken by another computation, a page
  larger than its extent, a limit) fails the attach at startup with the
  setting to change; refused later (a restarted manager), calls miss with
  ``refused_<kind>`` (``get_stats()["refusals"]`` counts them by kind) and
  the refusal is logged at error level every 10 s while it lasts, never as
  "manager down".
- Blocking work (manager round trips, page copies) runs without the GIL.

Every byte moves through this process's copy agent, on the manager's
instruction: each SGLang host pool (KV and every side pool) is registered
per connection as an agent-owned region of its storage group, so a set
publishes pages straight from the host pool and a get restores them
straight into it (checksum-verified), with no copy on OrbitKV's side. Where
the agent cannot address SGLang's memory (the legacy calls' free-standing
page tensors, host indices that are not page-aligned, a host pool whose
pages are not views of one CPU buffer) a page goes through a bounce slot:
a bridge-owned buffer that is itself an agent region (:class:`_Bounce`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import orbitkv
from orbitkv.refusals import Names, RefusalLog, message

logger = logging.getLogger(__name__)

__all__ = ["OrbitKVStorage", "OrbitKVConfig", "KEY_VERSION"]

#: Version of the SGLang page-key mapping (``_native``); part of the identity.
KEY_VERSION = 1

#: The extra-config keys SGLang itself reads (passed through, not ours).
_SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)

_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class OrbitKVConfig:
    """Our keys of SGLang's ``--hicache-storage-backend-extra-config``
    (``docs/sglang.md`` lists them). Every bound is here."""

    socket: str = field(default_factory=orbitkv.default_socket)
    #: Bound on each wait for the manager (a reply, ``ready``). Longer than
    #: the manager's own deadlines (5 s to prepare, 5 s for a publish to
    #: find DRAM), which answer first with a miss; past it the manager is
    #: taken as stuck and the connection is closed.
    timeout_s: float = 10.0
    #: Pages of one publish, and bounce slots per connection and pool (the
    #: legacy calls, unaligned host indices). SGLang moves at most 128
    #: pages per call.
    staging_pages: int = 128
    #: Cap on one bounce buffer's bytes (fewer slots for large pages).
    staging_bytes: int = 256 << 20
    #: Connections to the manager; one is used by one call at a time.
    max_connections: int = 4
    #: How long a call waits for a free connection before it misses.
    connection_wait_s: float = 5.0
    #: After a failed connect, calls miss at once for this long.
    reconnect_interval_s: float = 1.0
    #: Keys in one call; longer calls are refused (a miss).
    max_keys: int = 1 << 16
    #: Sliding-window tokens SGLang keeps for an SWA pool
    #: (``swa_retain_window``); required when an SWA pool is registered.
    swa_window_tokens: Optional[int] = None
    #: A local directory whose content identifies the model, instead of
    #: SGLang's ``model_path``.
    model_dir: Optional[str] = None
    #: Client name in the manager's logs.
    client_name: str = "sglang"

    @classmethod
    def from_extra(cls, extra: Optional[dict]) -> "OrbitKVConfig":
        """Parses and validates the extra config; unknown keys that are not
        SGLang's are an error (a typo must not silently use a default)."""
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if k not in known and k not in _SGLANG_KEYS)
        if unknown:
            raise ValueError(
                f"orbitkv: unknown extra-config keys {unknown}; known: {sorted(known)}"
            )
        args: Dict[str, Any] = {}
        for name in known:
            if name not in extra or extra[name] is None:
                continue
            args[name] = extra[name]
        c = cls(**args)
        c._validate()
        return c

    def _validate(self) -> None:
        def positive(name: str, value: Any, kind: type) -> None:
            ok = isinstance(value, kind) and not isinstance(value, bool)
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and math.isfinite(value)
            if not ok or value <= 0:
                raise ValueError(f"orbitkv: {name} must be a positive {kind.__name__}, got {value!r}")

        if not isinstance(self.socket, str) or not self.socket:
            raise ValueError(f"orbitkv: socket must be a path, got {self.socket!r}")
        for name in ("timeout_s", "connection_wait_s", "reconnect_interval_s"):
            positive(name, getattr(self, name), float)
        for name in ("staging_pages", "staging_bytes", "max_connections", "max_keys"):
            positive(name, getattr(self, name), int)
        if self.swa_window_tokens is not None:
            positive("swa_window_tokens", self.swa_window_tokens, int)
        if self.model_dir is not None and not os.path.isdir(self.model_dir):
            raise ValueError(f"orbitkv: model_dir {self.model_dir!r} is not a directory")
        if not isinstance(self.client_name, str):
            raise ValueError("orbitkv: client_name must be a string")


# ---------------------------------------------------------------------------
# Keys


def _native(key: str) -> bytes:
    """The engine-native hash of one SGLang page key.

    SGLang's page keys are 64 lowercase hex digits: SHA-256 chained over the
    page's tokens and its predecessor (``get_storage_hash_str``), so the key
    names the whole prefix. Those go through as their 32 bytes. Any other
    string (tests, other callers) becomes a 33-byte digest with a leading
    0xff: a different length, so it can never equal a 32-byte key. Either
    way the manager seals it with the namespace and the group."""
    if isinstance(key, str) and len(key) == 64 and _HEX64.fullmatch(key):
        return bytes.fromhex(key)
    if not isinstance(key, str):
        raise _BadInput(f"page key {key!r} is not a string")
    return b"\xff" + hashlib.sha256(b"orbitkv/sglang-key/1\x00" + key.encode("utf-8")).digest()


# ---------------------------------------------------------------------------
# Failures: every one becomes a miss with a reason.


class _Miss(Exception):
    """A call that cannot hit; ``reason`` goes to the stats."""

    reason = "error"

    def __init__(self, message: str = "", reason: Optional[str] = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class _BadInput(_Miss):
    reason = "bad_input"


class _Down(_Miss):
    reason = "manager_down"


class _Refused(_Miss):
    """The manager answered a registration (or session, or region) with a
    typed refusal: not unavailability. ``reason`` is ``refused_<kind>``
    (``refused_instance_conflict``, ``refused_page_exceeds_extent``, ...);
    the message names what to change."""

    def __init__(self, refused: orbitkv.Refused):
        self.kind = str(refused.args[1])
        super().__init__(message(refused, _NAMES), reason=f"refused_{self.kind}")


_NAMES = Names(
    ranks="--tp-size",
    instance="the extra-config 'instance'",
    page_size="--page-size",
    groups="the host pools",
)
"""How SGLang names what a refusal points at (`orbitkv.refusals`)."""


class _Broken(_Miss):
    """The connection can no longer be trusted (timeout, lost reply): it is
    closed, which makes the manager return its leases and reservations."""

    reason = "connection_lost"


class _Unsupported(ValueError):
    """A pool set, layout or configuration OrbitKV refuses at startup."""


# ---------------------------------------------------------------------------
# Pools and their byte format


@dataclass
class _Pool:
    """One registered SGLang host pool = one OrbitKV storage group."""

    name: str
    group: int
    host: Any
    page_tokens: int
    page_bytes: int
    page_format: str
    page_dims: List[int]
    dtype: torch.dtype
    rule: Any
    components: List[str]

    def describe(self) -> Dict[str, Any]:
        return {
            "pool": self.name,
            "group": self.group,
            "class": type(self.host).__name__,
            "dtype": str(self.dtype),
            "page_format": self.page_format,
            "page_dims": self.page_dims,
            "page_bytes": self.page_bytes,
            "layers": [int(getattr(self.host, "start_layer", 0)), int(self.host.layer_num)],
        }


def _page_format(host: Any) -> Tuple[str, List[int]]:
    """The byte order of SGLang's flat page (``get_data_page(flat=True)``)
    for the host pools whose format we know, with its dimensions. Pages of
    ``layer_first`` and ``page_first_direct`` pools are the same bytes;
    ``page_first`` puts tokens before layers. Anything else is refused."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    layout = getattr(host, "layout", None)
    cls = type(host)
    if cls is MHATokenToKVPoolHost:
        if host.v_head_dim != host.head_dim:
            raise _Unsupported("orbitkv: MHA host pools with v_head_dim != head_dim are not supported")
        if getattr(host, "head_group_num", 1) != 1:
            raise _Unsupported("orbitkv: MHA host pools with head groups are not supported")
        lf = [2, host.layer_num, host.page_size, host.head_num, host.head_dim]
        pf = [2, host.page_size, host.layer_num, host.head_num, host.head_dim]
        if layout in ("layer_first", "page_first_direct"):
            return "mha:kv,layer,token,head,dim", lf
        if layout == "page_first":
            return "mha:kv,token,layer,head,dim", pf
    elif cls is MLATokenToKVPoolHost:
        if getattr(host, "dcp_size", 1) != 1:
            raise _Unsupported("orbitkv: MLA host pools with decode context parallelism are not supported")
        lf = [host.layer_num, host.page_size, 1, host.kv_cache_dim]
        pf = [host.page_size, host.layer_num, 1, host.kv_cache_dim]
        if layout in ("layer_first", "page_first_direct"):
            return "mla:layer,token,one,latent", lf
        if layout == "page_first":
            return "mla:token,layer,one,latent", pf
    else:
        raise _Unsupported(
            f"orbitkv: host pool class {cls.__module__}.{cls.__name__} is not supported "
            "(MHATokenToKVPoolHost and MLATokenToKVPoolHost are)"
        )
    raise _Unsupported(
        f"orbitkv: host layout {layout!r} is not supported "
        "(layer_first, page_first and page_first_direct are)"
    )


def _describe_pool(name: str, group: int, host: Any, rule: Any, components: List[str]) -> _Pool:
    fmt, dims = _page_format(host)
    dtype = host.dtype
    page_bytes = math.prod(dims) * dtype.itemsize
    probe = host.get_data_page(0, flat=True)
    if probe.numel() * probe.element_size() != page_bytes or probe.dtype != dtype:
        raise _Unsupported(
            f"orbitkv: pool {name!r}: a page is {probe.numel() * probe.element_size()} bytes of "
            f"{probe.dtype}, expected {page_bytes} bytes of {dtype} ({fmt} {dims})"
        )
    return _Pool(
        name=name,
        group=group,
        host=host,
        page_tokens=int(host.page_size),
        page_bytes=page_bytes,
        page_format=fmt,
        page_dims=[int(d) for d in dims],
        dtype=dtype,
        rule=rule,
        components=components,
    )


# ---------------------------------------------------------------------------
# Moving bytes: every copy is the copy agent's


class _Bounce:
    """Torch copies between SGLang tensors and a bounce slot (one row of a
    bridge-owned CPU buffer that is itself an agent region). Used only where
    the agent cannot copy straight from or into the host pool: the legacy
    calls (SGLang hands over free-standing page tensors), host indices that
    are not page-aligned, and host pools whose pages are not views of one
    CPU buffer. The agent still moves every byte between the bounce slot and
    the manager (restores checksum-verified), so no path reads the shared
    pool directly or writes a region the manager maps."""

    @staticmethod
    def host_to_slot(pool: _Pool, index: int, dst: torch.Tensor) -> None:
        page = pool.host.get_data_page(index, flat=False)
        dst.view(pool.dtype).view(page.shape).copy_(page)

    @staticmethod
    def check_value(pool: _Pool, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise _BadInput(f"a page value is a {type(value).__name__}, not a tensor")
        size = value.numel() * value.element_size()
        if size != pool.page_bytes:
            raise _BadInput(f"a page value is {size} bytes, the pool's pages {pool.page_bytes}")

    @staticmethod
    def value_to_slot(pool: _Pool, value: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(value.detach().contiguous().view(-1).view(torch.uint8))

    @staticmethod
    def slot_to_host(pool: _Pool, index: int, src: torch.Tensor) -> None:
        pool.host.set_from_flat_data_page(index, src.view(pool.dtype))

    @staticmethod
    def check_target(pool: _Pool, target: Any) -> None:
        if (
            not isinstance(target, torch.Tensor)
            or not target.is_contiguous()
            or target.numel() * target.element_size() != pool.page_bytes
        ):
            raise _BadInput(
                f"a target must be a contiguous tensor of {pool.page_bytes} bytes, got "
                f"{type(target).__name__} {tuple(getattr(target, 'shape', ()))}"
            )

    @staticmethod
    def slot_to_value(src: torch.Tensor, target: torch.Tensor) -> None:
        target.view(-1).view(torch.uint8).copy_(src)


@dataclass
class _BounceRegion:
    """A connection's bounce buffer for one pool: ``slots`` pages of
    ``page_bytes`` in one CPU tensor, registered as an agent region."""

    region: int
    buffer: torch.Tensor  # [slots, page_bytes] uint8
    slots: int


def _agent_layout(pool: _Pool) -> Optional[Tuple[int, List[Tuple[int, int, int]]]]:
    """The host pool as a copy agent's region: ``(slots, chunks)``, slot
    ``s`` being the page that starts at host index ``s * page_size``, and
    each chunk a ``(data_ptr, stride, length)`` run whose concatenation is
    exactly the flat page (``get_data_page(flat=True)``). Derived from the
    page views' own strides, so it holds for every host layout whose pages
    are views; ``None`` (bounce copies then) when it cannot be described:
    not a CPU tensor, or pages that are not views of one buffer."""
    host = pool.host
    p = pool.page_tokens
    slots = int(host.size) // p
    if slots < 2:
        return None
    v0 = host.get_data_page(0, flat=False)
    v1 = host.get_data_page(p, flat=False)
    vl = host.get_data_page((slots - 1) * p, flat=False)
    if v0.device.type != "cpu" or v0.shape != v1.shape or v0.stride() != v1.stride():
        return None
    es = v0.element_size()
    stride = (v1.data_ptr() - v0.data_ptr())
    if stride <= 0 or vl.data_ptr() - v0.data_ptr() != (slots - 1) * stride:
        return None
    # The innermost dims that are contiguous make one run; the others are
    # enumerated, in row-major order (the flat page's order).
    shape, strides = list(v0.shape), list(v0.stride())
    inner, expect = len(shape), 1
    while inner > 0 and (shape[inner - 1] == 1 or strides[inner - 1] == expect):
        expect *= shape[inner - 1]
        inner -= 1
    run = expect * es
    outer = shape[:inner]
    if math.prod(outer) > 4096:
        return None  # too fragmented to be worth a copy per run
    chunks: List[Tuple[int, int, int]] = []
    for idx in _indices(outer):
        off = sum(i * st for i, st in zip(idx, strides[:inner])) * es
        chunks.append((v0.data_ptr() + off, stride, run))
    if sum(c[2] for c in chunks) != pool.page_bytes or run > stride:
        return None
    return slots, chunks


def _indices(shape: List[int]) -> Iterator[Tuple[int, ...]]:
    """Every index of ``shape`` in row-major order."""
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i,) + rest


@dataclass
class _AgentRegion:
    """The host pool registered on one connection as an agent-owned
    region: the manager's handle and the page size."""

    region: int
    page_tokens: int


# ---------------------------------------------------------------------------
# The registration: identity, layout, contract


@dataclass
class _Registration:
    instance: str
    identity: str
    namespace: str
    page_tokens: int
    rank: Dict[str, int]
    pools: Dict[str, _Pool]  # by SGLang pool name
    description: orbitkv.Instance

    def groups(self) -> List[int]:
        return sorted(p.group for p in self.pools.values())

    def by_group(self, group: int) -> _Pool:
        for p in self.pools.values():
            if p.group == group:
                return p
        raise KeyError(group)


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
    except Exception as e:  # the launcher publishes them; without, no identity
        raise _Unsupported(
            "orbitkv: SGLang's server args are not published in this process, so the model "
            f"identity cannot be established ({type(e).__name__}: {e})"
        ) from e
    if sa is None:
        raise _Unsupported("orbitkv: SGLang's server args are not published in this process")
    return sa


def _model_source(sa: Any, cfg: OrbitKVConfig) -> Tuple[str, Optional[str]]:
    """(model directory holding config.json, pinned hub commit or None), by
    the one rule (`orbitkv.model_source`); `model_dir` in the storage
    config wins over SGLang's model path."""
    path = getattr(sa, "model_path", None)
    if cfg.model_dir is None and not isinstance(path, str):
        raise _Unsupported(f"orbitkv: SGLang's model_path is {path!r}: the model's identity needs it")
    try:
        return orbitkv.model_source(str(path), getattr(sa, "revision", None), model_dir=cfg.model_dir)
    except orbitkv.IdentityError as e:
        raise _Unsupported(f"orbitkv: the model identity cannot be established: {e}") from e


def _settings(sa: Any, sc: HiCacheStorageConfig, storage_rank: int) -> Dict[str, Any]:
    """Computation settings: everything in SGLang's arguments that changes
    the bytes of a KV page. ``None`` means "not set" for these knobs and is
    written as the string "none" (the identity refuses nulls)."""

    def arg(name: str) -> Any:
        v = getattr(sa, name, None)
        return "none" if v is None else v

    return {
        "dtype": arg("dtype"),
        "kv_cache_dtype": arg("kv_cache_dtype"),
        "quantization": arg("quantization"),
        "quantization_param_path": arg("quantization_param_path"),
        "attention_backend": arg("attention_backend"),
        "prefill_attention_backend": arg("prefill_attention_backend"),
        "decode_attention_backend": arg("decode_attention_backend"),
        "weight_version": arg("weight_version"),
        "load_format": arg("load_format"),
        "model_impl": arg("model_impl"),
        "tp_size": int(sc.tp_size),
        "pp_size": int(sc.pp_size),
        "pp_rank": int(sc.pp_rank),
        "attn_cp_size": int(sc.attn_cp_size),
        "attn_cp_rank": int(sc.attn_cp_rank),
        "is_mla_model": bool(sc.is_mla_model),
        "should_split_heads": bool(sc.should_split_heads),
        "tp_lcm_size": "none" if sc.tp_lcm_size is None else int(sc.tp_lcm_size),
        "storage_rank": int(storage_rank),
        "key_version": KEY_VERSION,
    }


def _layout_slots(pool: _Pool, rank: Dict[str, int]) -> List[Dict[str, Any]]:
    """One slot per layer of the pool (its share of the page bytes)."""
    layers = int(pool.host.layer_num)
    if layers <= 0 or pool.page_bytes % layers:
        raise _Unsupported(f"orbitkv: pool {pool.name!r}: {pool.page_bytes} page bytes over {layers} layers")
    per_layer = pool.page_bytes // layers
    start = int(getattr(pool.host, "start_layer", 0) or 0)
    strides = []
    acc = 1
    for d in reversed(pool.page_dims):
        strides.append(acc)
        acc *= d
    strides.reverse()
    return [
        {
            "layer": start + i,
            "group": pool.group,
            "tp_rank": rank["tp"],
            "pp_rank": rank["pp"],
            "segment_bytes": per_layer,
            "padded_page_bytes": per_layer,
            "page_tokens": pool.page_tokens,
            "dtype": str(pool.dtype).removeprefix("torch."),
            "layout": pool.page_format,
            "strides": strides,
            "device_addr": 0,
        }
        for i in range(layers)
    ]


def _build_registration(
    sc: HiCacheStorageConfig, cfg: OrbitKVConfig, hosts: Dict[str, Any]
) -> _Registration:
    """Declares the pools as groups under their rules, computes the identity
    and seals it with the layout. Refuses (raises) what we cannot serve."""
    if sc.dcp_size != 1:
        raise _Unsupported("orbitkv: decode context parallelism (dcp_size > 1) is not supported")
    kv = hosts.get(str(PoolName.KV))
    if kv is None:
        raise _Unsupported("orbitkv: no KV host pool was registered")
    unknown = sorted(n for n in hosts if n not in (str(PoolName.KV), str(PoolName.SWA)))
    if unknown:
        raise _Unsupported(
            f"orbitkv: pools {unknown} are not supported (KV and SWA are; recurrent, indexer, "
            "draft and other auxiliary state are refused rather than stored as attention KV)"
        )
    pools = {
        str(PoolName.KV): _describe_pool(
            str(PoolName.KV), 0, kv, "prefix", ["mla_kv" if sc.is_mla_model else "attention_kv"]
        )
    }
    if str(PoolName.SWA) in hosts:
        if cfg.swa_window_tokens is None:
            raise _Unsupported(
                "orbitkv: an SWA pool is registered: set swa_window_tokens in the extra config "
                "to SGLang's sliding window (swa_retain_window, in tokens)"
            )
        pools[str(PoolName.SWA)] = _describe_pool(
            str(PoolName.SWA),
            1,
            hosts[str(PoolName.SWA)],
            {"window": int(cfg.swa_window_tokens)},
            ["sliding_window_kv"],
        )
    page_tokens = pools[str(PoolName.KV)].page_tokens
    for p in pools.values():
        if p.page_tokens != page_tokens:
            raise _Unsupported(f"orbitkv: pool {p.name!r} has {p.page_tokens}-token pages, KV {page_tokens}")

    # MLA pages are the same on every TP rank (one writer, every rank reads);
    # MHA pages hold this rank's heads.
    storage_rank = 0 if sc.is_mla_model else int(sc.tp_rank)
    rank = {"tp": storage_rank, "pp": int(sc.pp_rank)}
    sa = _server_args()
    if getattr(sa, "lora_paths", None) or getattr(sa, "enable_lora", False):
        adapters = ["lora"]
    else:
        adapters = []
    model_dir, revision = _model_source(sa, cfg)
    try:
        overrides = json.loads(getattr(sa, "json_model_override_args", None) or "{}")
    except ValueError as e:
        raise _Unsupported(f"orbitkv: json_model_override_args is not JSON: {e}") from e
    import sglang

    slots = [s for p in pools.values() for s in _layout_slots(p, rank)]
    groups = [
        {"id": p.group, "rule": p.rule, "components": p.components}
        for p in sorted(pools.values(), key=lambda p: p.group)
    ]
    layout = {"slots": slots, "pool_capacity_pages": 0}
    representation = {
        "format": "sglang-hicache-flat-page/1",
        "page_tokens": page_tokens,
        "pools": [p.describe() for p in sorted(pools.values(), key=lambda p: p.group)],
    }
    try:
        ident = orbitkv.compute_identity(
            model_dir,
            engine="sglang",
            engine_version=str(sglang.__version__),
            settings=_settings(sa, sc, storage_rank),
            representation=representation,
            config_overrides=overrides if isinstance(overrides, dict) else {"value": overrides},
            hub_revision=revision,
            active_adapters=adapters,
            layout=layout,
            groups=groups,
        )
    except orbitkv.IdentityError as e:
        raise _Unsupported(f"orbitkv: the model identity cannot be established: {e}") from e
    identity = ident["identity"]
    # Named after the sealed namespace, not the identity alone: two engines
    # of one model whose layouts differ (another SWA window, another page
    # format) are different instances, never a conflict that leaves one of
    # them without a cache.
    instance = f"sglang/{ident['namespace'][:16]}/tp{storage_rank}/pp{sc.pp_rank}"
    try:
        description = orbitkv.Instance(
            name=instance,
            identity=identity,
            layout=layout,
            page_tokens=page_tokens,
            groups=groups,
            ranks=[rank],
        )
    except ValueError as e:
        raise _Unsupported(f"orbitkv: {e}") from e
    return _Registration(
        instance=instance,
        identity=identity,
        namespace=ident["namespace"],
        page_tokens=page_tokens,
        rank=rank,
        pools=pools,
        description=description,
    )


# ---------------------------------------------------------------------------
# One connection


#: Commands that set a connection up: a refusal of one of them refuses the
#: whole engine (`_Refused`), not one call.
_SETUP_COMMANDS = ("register_instance", "open_session", "register_device_region")


_BOUND_FROM_PAGES = 64
"""Existence checks of more keys than this send only the keys before one
the presence filter proves absent."""


class _Conn:
    """A connection with its own session (:class:`orbitkv.Session`), copy
    agent and agent regions. The session reconnects by itself after a
    failure, at most once per ``reconnect_interval_s``, and raises the last
    failure again in between (a refusal stays a refusal). Used by one call
    at a time (the pool hands it out)."""

    def __init__(self, reg: _Registration, cfg: OrbitKVConfig):
        self.reg = reg
        self.cfg = cfg
        #: Per group: the host pool as an agent region of this connection
        #: (None: it cannot be described; bounce copies then).
        self.agent: Dict[int, Optional[_AgentRegion]] = {}
        #: Per group: this connection's bounce buffer (made when needed).
        self.bounces: Dict[int, _BounceRegion] = {}
        self.incarnation: Optional[int] = None
        self.session = orbitkv.Session(
            cfg.socket,
            reg.description,
            name=cfg.client_name,
            timeout=cfg.timeout_s,
            reconnect_interval=cfg.reconnect_interval_s,
            on_connect=self._connected,
        )

    def _connected(self, session: orbitkv.Session) -> None:
        """Runs on every (re)connection: a new connection holds none of
        the last one's agent regions."""
        if session.namespaces != [self.reg.namespace]:
            raise _Unsupported(
                f"orbitkv: the manager sealed namespace {session.namespaces}, we "
                f"computed {self.reg.namespace}"
            )
        self.agent, self.bounces = {}, {}
        self.incarnation = session.client.incarnation

    def ready(self) -> bool:
        """Connects unless connected; True when it connected now. Raises
        `_Refused`, `_Down` (the manager does not answer, or did not a
        moment ago) or a namespace mismatch."""
        if self.session.up:
            return False
        try:
            self.session.connect()
        except orbitkv.Refused as e:
            raise _Refused(e) from e
        except _Unsupported as e:
            raise _Miss(str(e), reason="namespace_mismatch") from e
        except (orbitkv.ConnectionError, TimeoutError, OSError) as e:
            raise _Down(f"cannot connect to {self.cfg.socket}: {e}") from e
        return True

    def close(self) -> None:
        self.session.close()

    # -- discovery -------------------------------------------------------

    def _query(self, hashes: List[bytes]) -> Tuple[List[int], List[bytes], int, int]:
        # Every group is asked about the same pages: the contract decides
        # which of them each group's rule needs at each boundary. One token
        # past the last page: the engine's clamp then allows every page of
        # the call as a boundary.
        return self.reg.groups(), hashes, 0, len(hashes) * self.reg.page_tokens + 1

    def query(self, hashes: List[bytes]) -> orbitkv.Lookup:
        """Metadata-only discovery: it holds nothing. A long key list stops
        at a page the presence filter proves is in no tier: the boundaries
        and group 0's leading pages found are the same (see
        `Session.pages_worth_asking`)."""
        if len(hashes) > _BOUND_FROM_PAGES:
            hashes = hashes[: self.session.pages_worth_asking(self.reg.groups(), hashes, 0)]
        return self.session.lookup(*self._query(hashes))

    # -- agent regions -----------------------------------------------------

    def _register_agent(self, pool: _Pool, slots: int, chunks: List[Tuple[int, int, int]], owner: Any) -> int:
        """Attaches memory to this connection's copy agent and registers it
        with the manager as an agent-owned region of the pool's group; the
        manager never maps it. Returns the manager's region handle."""
        # Host memory (`_agent_layout` takes CPU pools only, the bounce
        # buffer is a CPU tensor); SGLang's own kernels move pages between
        # the host pool and the GPU.
        agent = self.session.client.attach_agent_memory(slots, chunks, owner, device="cpu")
        if agent[1] != pool.page_bytes:
            raise _Broken(f"agent region pages are {agent[1]} bytes, the pool's {pool.page_bytes}")
        return self.session.register_region(0, pool.group, slots, agent=agent)

    def agent_region(self, pool: _Pool) -> Optional[_AgentRegion]:
        """The host pool itself as an agent region of this connection
        (registered once): the copy agent copies pages straight between it
        and the manager. None when its pages cannot be described."""
        if pool.group in self.agent:
            return self.agent[pool.group]
        layout = _agent_layout(pool)
        if layout is None:
            self.agent[pool.group] = None
            return None
        slots, chunks = layout
        a = _AgentRegion(self._register_agent(pool, slots, chunks, pool.host), pool.page_tokens)
        self.agent[pool.group] = a
        return a

    def bounce_for(self, pool: _Pool) -> _BounceRegion:
        """This connection's bounce buffer for the pool (made and registered
        once): ``staging_pages`` pages, capped by ``staging_bytes``."""
        b = self.bounces.get(pool.group)
        if b is not None:
            return b
        slots = max(1, min(self.cfg.staging_pages, self.cfg.staging_bytes // pool.page_bytes))
        buffer = torch.zeros((slots, pool.page_bytes), dtype=torch.uint8)
        chunks = [(buffer.data_ptr(), pool.page_bytes, pool.page_bytes)]
        b = _BounceRegion(self._register_agent(pool, slots, chunks, buffer), buffer, slots)
        self.bounces[pool.group] = b
        return b

    # -- the two moves -----------------------------------------------------

    def restore_slots(
        self, pool: _Pool, region: int, hashes: List[bytes], slot_of: Callable[[int], int]
    ) -> Tuple[Optional[str], List[int]]:
        """One ``load``: the manager selects the largest legal boundary of
        ``hashes`` (every registered group under its rule), leases its
        pages and has the agent restore the pool's pages into ``region``
        (page i into slot ``slot_of(i)``), all in one round trip. The other
        groups' pages of that boundary are loaded by their own SGLang calls
        (KV first, then each side pool), so the load names them
        ``retained``: the manager checks that the two sets cover every
        required page, holds every lease until the copy landed, and then
        returns them all. Returns (miss reason, indices restored)."""
        n = len(hashes)
        page = self.reg.page_tokens
        pages = self.session.device_pages(region, [slot_of(i) for i in range(n)])
        try:
            got = self.session.load(
                *self._query(hashes),
                ranks=[0],
                targets=[(0, pool.group, (i + 1) * page, dp) for i, dp in enumerate(pages)],
                retained=[
                    (0, g, (i + 1) * page) for g in self.reg.groups() if g != pool.group for i in range(n)
                ],
            )
        except orbitkv.Refused as e:
            # The plan did not cover the selected ranges (a bug of ours):
            # nothing was copied.
            raise _Miss(f"the manager refused the load: {e}", reason="load_refused") from e
        if not got.hit:
            return str(got.miss), []
        index = sorted(end // page - 1 for _, g, end in got.leased if g == pool.group)
        return (None, index) if index else ("incomplete_group", [])

    def publish_slots(self, pool: _Pool, region: int, hashes: List[bytes], slots: Sequence[int]) -> int:
        """Publishes page i from ``region``'s slot ``slots[i]``: the agent
        copies it into this connection's staging area, the manager into its
        pool (checksummed in the same pass). Returns how many leading pages
        the manager holds."""
        pages = self.session.device_pages(region, list(slots))
        done = self.session.save([(0, pool.group, h, dp) for h, dp in zip(hashes, pages)])
        if done.dropped == 0 and done.stored == len(hashes):
            return len(hashes)
        # Some pages did not make it (no DRAM within the publish deadline):
        # report only the leading run the manager now holds.
        return _prefix_pages(self.query(hashes), pool.group, self.reg.page_tokens, len(hashes))


def _prefix_pages(found: orbitkv.Lookup, group: int, page_tokens: int, n: int) -> int:
    """Leading pages of ``group`` present, from discovery's candidates."""
    pages = {e // page_tokens for _, g, ends in found.candidates if g == group for e in ends}
    k = 0
    while k < n and (k + 1) in pages:
        k += 1
    return k


def _prefix_mask(done: Sequence[bool]) -> List[bool]:
    """Cuts a per-key result at its first failure: never a hole."""
    out = []
    ok = True
    for d in done:
        ok = ok and bool(d)
        out.append(ok)
    return out


# ---------------------------------------------------------------------------
# Connections


class _Connections:
    """At most ``max_connections`` connections, made when calls need them;
    a call borrows one for its duration. A connection that fails gives its
    session up (with every idle one to the same manager incarnation); its
    session reconnects on a later call, at most once per
    ``reconnect_interval_s`` (`_Conn.ready`)."""

    def __init__(self, cfg: OrbitKVConfig, stats: "_Stats"):
        self.cfg = cfg
        self.stats = stats
        self.reg: Optional[_Registration] = None
        self._cv = threading.Condition()
        self._all: List[_Conn] = []
        self._idle: List[_Conn] = []
        self._closed = False

    @contextlib.contextmanager
    def borrow(self) -> Iterator[_Conn]:
        conn = self._acquire()
        try:
            yield conn
        except orbitkv.Refused as e:
            # The manager answered: the connection itself is fine.
            self._release(conn)
            if e.command in _SETUP_COMMANDS:
                raise _Refused(e) from e
            raise _Miss(str(e), reason=f"refused_{e.args[1]}") from e
        except (orbitkv.ConnectionError, _Broken, TimeoutError) as e:
            self._lost(conn, e)
            reason = "timeout" if isinstance(e, TimeoutError) else getattr(e, "reason", "connection_lost")
            raise _Broken(str(e), reason=reason) from e
        except _Miss:
            # A refusal or a miss: the connection itself is fine.
            self._release(conn)
            raise
        except BaseException as e:
            # Anything else leaves the connection's state unknown.
            self._lost(conn, e)
            raise
        else:
            self._release(conn)

    def _acquire(self) -> _Conn:
        if self.reg is None:
            raise _Miss("no host pool registered", reason="not_registered")
        deadline = time.monotonic() + self.cfg.connection_wait_s
        with self._cv:
            while True:
                if self._closed:
                    raise _Down("the backend is closed", reason="closed")
                if self._idle:
                    conn = self._idle.pop()
                    break
                if len(self._all) < self.cfg.max_connections:
                    conn = _Conn(self.reg, self.cfg)  # connects in `ready`
                    self._all.append(conn)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Miss("every connection is busy", reason="busy")
                self._cv.wait(left)
        # Connect outside the lock (it blocks without the GIL).
        try:
            if conn.ready():
                self.stats.add("connects")
        except BaseException:
            self._release(conn)
            raise
        return conn

    def _release(self, conn: _Conn) -> None:
        with self._cv:
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)
            self._cv.notify()

    def _lost(self, conn: _Conn, why: BaseException) -> None:
        """Gives the session up; when the manager went away, every idle
        session to that incarnation too (they are dead as well)."""
        conn.session.drop(f"{type(why).__name__}: {why}")
        stale: List[_Conn] = []
        with self._cv:
            if isinstance(why, orbitkv.ConnectionError) and conn.incarnation is not None:
                # Taken out of the idle list while they are dropped: no
                # other call can borrow one meanwhile.
                stale = [c for c in self._idle if c.session.up and c.incarnation == conn.incarnation]
                self._idle = [c for c in self._idle if c not in stale]
        for c in stale:
            c.session.drop("its manager went away")
        self.stats.add("connections_dropped", 1 + len(stale))
        for c in (*stale, conn):
            self._release(c)

    def open_count(self) -> int:
        """Connections up now."""
        with self._cv:
            return sum(1 for c in self._all if c.session.up)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cv.notify_all()
        for c in idle:
            c.close()


# ---------------------------------------------------------------------------
# Stats and rate-limited logging


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Dict[str, int] = {}
        self.misses: Dict[str, int] = {}
        self.refusals = RefusalLog(logger, "orbitkv: ")
        self._logged: Dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def miss(self, reason: str, pages: int, message: str = "") -> None:
        with self._lock:
            self.misses[reason] = self.misses.get(reason, 0) + pages
            last = self._logged.get(reason, 0.0)
            now = time.monotonic()
            log = now - last > 10.0
            if log:
                self._logged[reason] = now
        if log and message:
            logger.warning("orbitkv: miss (%s): %s", reason, message)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {**self.counters, "misses": dict(self.misses), "refusals": dict(self.refusals.counts)}


# ---------------------------------------------------------------------------
# The backend


class OrbitKVStorage(HiCacheStorage):
    """SGLang HiCache L3 storage on an OrbitKV manager (``orbitkv serve``).

    Built by SGLang's dynamic factory as ``OrbitKVStorage(storage_config,
    {})``; our settings come from ``storage_config.extra_config``
    (:class:`OrbitKVConfig`). Registration with the manager happens once the
    host pools are known (:meth:`on_host_pools_registered`); it raises for
    what OrbitKV refuses (unknown pools and layouts, an identity that cannot
    be established), which fails SGLang's attach. Every I/O call afterwards
    returns misses instead of raising.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.config = OrbitKVConfig.from_extra(storage_config.extra_config)
        self.stats = _Stats()
        self._conns = _Connections(self.config, self.stats)
        self._hosts: Dict[str, Any] = {}
        self._reg_lock = threading.Lock()
        self.mem_pool_host = None

    # -- registration ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._hosts.setdefault(str(PoolName.KV), mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if self._conns.reg is not None and name not in self._conns.reg.pools:
            # A sidecar arriving after the contract was compiled would change
            # the namespace; its calls miss.
            logger.warning("orbitkv: pool %r registered after startup is not served", name)
            return
        self._hosts[name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Compiles the registration (identity, layout, groups). Raises for
        what OrbitKV refuses: SGLang then fails the attach."""
        self._register()
        # Connect now so a misconfigured socket shows at startup; a manager
        # that is not up yet only means misses until it is. One that
        # refuses this engine fails the attach, naming the setting.
        try:
            with self._conns.borrow():
                pass
        except _Refused as e:
            raise _Unsupported(str(e)) from e
        except _Miss as e:
            logger.warning("orbitkv: not connected to the manager yet (%s): %s", e.reason, e)

    def _register(self) -> _Registration:
        with self._reg_lock:
            if self._conns.reg is None:
                reg = _build_registration(self.storage_config, self.config, dict(self._hosts))
                self._conns.reg = reg
                logger.info(
                    "orbitkv: instance %s namespace %s pools %s socket %s",
                    reg.instance,
                    reg.namespace,
                    {n: p.page_bytes for n, p in reg.pools.items()},
                    self.config.socket,
                )
            return self._conns.reg

    def _registration(self) -> _Registration:
        """The registration. Before :meth:`on_host_pools_registered` the
        pool set is not known (a hybrid controller registers its side pools
        after starting its threads), so every call misses."""
        reg = self._conns.reg
        if reg is None:
            raise _Miss("on_host_pools_registered() has not run", reason="not_registered")
        return reg

    # -- the guard every entry point runs in ---------------------------------

    def _guard(self, what: str, pages: int, fallback: Any, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except _Refused as e:
            self.stats.refusals.record(e.kind, str(e))
            self.stats.miss(e.reason, pages)
        except _Miss as e:
            self.stats.miss(e.reason, pages, f"{what}: {e}")
        except Exception as e:  # never into SGLang's threads
            self.stats.miss("error", pages)
            logger.exception("orbitkv: %s failed: %s", what, e)
        return fallback

    def _check_keys(self, keys: Sequence[str]) -> List[bytes]:
        if not isinstance(keys, (list, tuple)):
            raise _BadInput(f"keys must be a list, got {type(keys).__name__}")
        if len(keys) > self.config.max_keys:
            raise _BadInput(f"{len(keys)} keys in one call, max_keys is {self.config.max_keys}", reason="too_many_keys")
        return [_native(k) for k in keys]

    @staticmethod
    def _page_starts(pool: _Pool, host_indices: Any, n: int) -> List[int]:
        """The first host slot of each of the n pages, checked: each page's
        indices must be ``page_size`` consecutive slots inside the pool
        (SGLang's host allocator hands out whole pages). A page that is not
        contiguous is refused (``noncontiguous_host_indices``): its bytes
        are not one page of the pool. A start that is not a page boundary
        works in ``layer_first`` and ``page_first`` (through a bounce slot)
        and is refused in ``page_first_direct`` (``unaligned_host_index``),
        which addresses whole pages (an unaligned start names another)."""
        if not isinstance(host_indices, torch.Tensor):
            raise _BadInput(f"host_indices must be a tensor, got {type(host_indices).__name__}")
        p = pool.page_tokens
        if host_indices.numel() != n * p:
            raise _BadInput(f"{host_indices.numel()} host indices for {n} pages of {p} tokens")
        if n == 0:
            return []
        if host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
            raise _BadInput(f"host_indices must be integers, got {host_indices.dtype}")
        pages = host_indices.detach().reshape(n, p).to("cpu", torch.int64)
        first = pages[:, :1]
        if not torch.equal(pages, first + torch.arange(p, dtype=torch.int64)):
            bad = int(((pages != first + torch.arange(p)).any(dim=1)).nonzero()[0, 0])
            raise _BadInput(
                f"page {bad}'s host indices {pages[bad].tolist()} are not {p} consecutive slots",
                reason="noncontiguous_host_indices",
            )
        starts = first.reshape(-1).tolist()
        size = int(pool.host.size)
        direct = getattr(pool.host, "layout", None) == "page_first_direct"
        for s in starts:
            if not (0 <= s and s + p <= size):
                raise _BadInput(f"host index {s} is not a page inside the {size}-token pool")
            if direct and s % p:
                raise _BadInput(
                    f"host index {s} is not a page start of a page_first_direct pool",
                    reason="unaligned_host_index",
                )
        return starts

    # -- existence -----------------------------------------------------------

    def _hit_pages(self, keys: Sequence[str]) -> Tuple[int, List[int], Optional[orbitkv.Lookup]]:
        """(largest legal boundary in pages, every legal one, the lookup)."""
        reg = self._registration()
        hashes = self._check_keys(keys)
        if not hashes:
            return 0, [], None
        with self._conns.borrow() as conn:
            found = conn.query(hashes)
        self.stats.add("queries")
        if found.miss is not None:
            self.stats.miss(str(found.miss), len(hashes))
            return 0, [], found
        page = reg.page_tokens
        legal = sorted({b // page for b in found.common if 0 < b <= len(hashes) * page})
        return (legal[-1] if legal else 0), legal, found

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._guard("batch_exists", len(keys or []), 0, lambda: self._hit_pages(keys)[0])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        def run() -> PoolTransferResult:
            reg = self._registration()
            for t in pool_transfers or []:
                self._check_side_transfer(reg, t)
            best, legal, found = self._hit_pages(keys)
            if best == 0 or found is None:
                return PoolTransferResult(0, {}, [])
            hits: Dict[str, int] = {}
            kv = _prefix_pages(found, 0, reg.page_tokens, len(keys))
            if kv:
                hits[PoolName.KV] = kv
            for t in pool_transfers or []:
                hits[t.name] = best
            self.stats.add("pages_found", best)
            return PoolTransferResult(best, hits, legal)

        return self._guard("batch_exists_v2", len(keys or []), PoolTransferResult(0, {}, []), run)

    def _check_side_transfer(self, reg: _Registration, t: PoolTransfer) -> _Pool:
        name = str(t.name)
        pool = reg.pools.get(name)
        if pool is None or pool.group == 0:
            raise _Miss(f"pool {name!r} is not registered as a side pool", reason="unknown_pool")
        if t.hit_policy != PoolHitPolicy.TRAILING_PAGES:
            raise _Miss(f"pool {name!r} asks for {t.hit_policy}, its rule is a window", reason="unknown_pool")
        if t.indices_from_pool is not None:
            raise _Miss(f"pool {name!r} derives its indices from {t.indices_from_pool}", reason="unknown_pool")
        trailing = max(1, len(t.keys) if t.keys else 1)
        window_pages = -(-int(self.config.swa_window_tokens or 0) // reg.page_tokens)
        if trailing > window_pages:
            # SGLang would restore more trailing pages than our rule
            # guarantees at a boundary: nothing we could claim is safe.
            raise _Miss(
                f"pool {name!r} needs {trailing} trailing pages, swa_window_tokens covers "
                f"{window_pages}: set it to SGLang's swa_retain_window",
                reason="window_mismatch",
            )
        return pool

    # -- moving pages (every copy run by this process's copy agent) -------------

    @staticmethod
    def _aligned(pool: _Pool, starts: Optional[List[int]]) -> bool:
        """Whether every page starts a host-pool page (an agent region's
        slot is a whole page: anything else goes through a bounce slot)."""
        return starts is not None and all(s % pool.page_tokens == 0 for s in starts)

    def _count(self, what: str, pool: _Pool, path: str, n: int, got: int, miss: Optional[str]) -> None:
        self.stats.add(f"pages_{what}", got)
        self.stats.add(f"bytes_{what}", got * pool.page_bytes)
        self.stats.add(path, got)
        if got < n:
            if what == "stored":
                self.stats.miss(miss or "publish_dropped", n - got, "the manager dropped pages of a publish")
            else:
                self.stats.miss(miss or ("incomplete_group" if got else "not_found"), n - got)

    def _get(
        self,
        pool: _Pool,
        keys: Sequence[str],
        starts: Optional[List[int]] = None,
        targets: Optional[List[torch.Tensor]] = None,
    ) -> List[bool]:
        """Restores ``keys`` (pages of ``pool``'s group) into the host pool
        at ``starts``, or into the legacy ``targets``. The copy agent copies
        straight from the manager's pool into the host pool when the host
        indices are page-aligned and the host pool is an agent region; else
        into a bounce slot, which is then copied out. Per-key result: a
        prefix."""
        self._registration()
        hashes = self._check_keys(keys)
        n = len(hashes)
        if n == 0:
            return []
        done = [False] * n
        miss: Optional[str] = None
        with self._conns.borrow() as conn:
            region = conn.agent_region(pool) if self._aligned(pool, starts) else None
            if region is not None:
                assert starts is not None
                path = "agent_direct_pages"
                miss, got = conn.restore_slots(
                    pool, region.region, hashes, lambda i: starts[i] // pool.page_tokens
                )
                for i in got:
                    done[i] = True
            else:
                path = "agent_bounce_pages"
                bounce = conn.bounce_for(pool)
                for c0 in range(0, n, bounce.slots):
                    chunk = hashes[c0 : c0 + bounce.slots]
                    miss, got = conn.restore_slots(pool, bounce.region, chunk, lambda i: i)
                    for i in sorted(got):
                        row = bounce.buffer[i]
                        if starts is not None:
                            _Bounce.slot_to_host(pool, starts[c0 + i], row)
                        else:
                            assert targets is not None
                            _Bounce.slot_to_value(row, targets[c0 + i])
                        done[c0 + i] = True
                    if miss is not None or len(got) < len(chunk):
                        break
        out = _prefix_mask(done)
        self._count("loaded", pool, path, n, sum(out), miss)
        return out

    def _set(
        self,
        pool: _Pool,
        keys: Sequence[str],
        starts: Optional[List[int]] = None,
        values: Optional[List[Any]] = None,
    ) -> List[bool]:
        """Publishes ``keys`` from the host pool at ``starts``, or from the
        legacy ``values``: the copy agent copies straight from the host pool
        (page-aligned indices, a describable pool) or from a bounce slot
        into the connection's staging area; the manager then copies them
        into its pool. Per-key result: a prefix."""
        self._registration()
        hashes = self._check_keys(keys)
        n = len(hashes)
        if n == 0:
            return []
        if values is not None:
            for v in values:
                _Bounce.check_value(pool, v)
        stored = 0
        with self._conns.borrow() as conn:
            region = conn.agent_region(pool) if self._aligned(pool, starts) else None
            if region is not None:
                assert starts is not None
                path = "agent_direct_pages"
                step = self.config.staging_pages
                for c0 in range(0, n, step):
                    chunk = hashes[c0 : c0 + step]
                    slots = [s // pool.page_tokens for s in starts[c0 : c0 + step]]
                    got = conn.publish_slots(pool, region.region, chunk, slots)
                    stored += got
                    if got < len(chunk):
                        break
            else:
                path = "agent_bounce_pages"
                bounce = conn.bounce_for(pool)
                for c0 in range(0, n, bounce.slots):
                    chunk = hashes[c0 : c0 + bounce.slots]
                    for k in range(len(chunk)):
                        row = bounce.buffer[k]
                        if starts is not None:
                            _Bounce.host_to_slot(pool, starts[c0 + k], row)
                        else:
                            assert values is not None
                            _Bounce.value_to_slot(pool, values[c0 + k], row)
                    got = conn.publish_slots(pool, bounce.region, chunk, range(len(chunk)))
                    stored += got
                    if got < len(chunk):
                        break
        self._count("stored", pool, path, n, stored, None)
        return [True] * stored + [False] * (n - stored)

    def _kv(self) -> _Pool:
        return self._registration().pools[str(PoolName.KV)]

    # -- v1: host pool <-> OrbitKV --------------------------------------------

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        n = len(keys or [])

        def run() -> List[bool]:
            pool = self._kv()
            return self._get(pool, keys, starts=self._page_starts(pool, host_indices, n))

        return self._guard("batch_get_v1", n, [False] * n, run)

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        n = len(keys or [])

        def run() -> List[bool]:
            pool = self._kv()
            return self._set(pool, keys, starts=self._page_starts(pool, host_indices, n))

        return self._guard("batch_set_v1", n, [False] * n, run)

    # -- v2: one transfer per pool ---------------------------------------------

    def _transfer_pool(self, t: PoolTransfer) -> _Pool:
        reg = self._registration()
        name = str(t.name)
        if name == str(PoolName.KV):
            if t.indices_from_pool is not None:
                raise _Miss("a KV transfer with derived indices", reason="unknown_pool")
            return reg.pools[name]
        return self._check_side_transfer(reg, t)

    def _v2(self, transfers: List[PoolTransfer], write: bool) -> Dict[Any, List[bool]]:
        out: Dict[Any, List[bool]] = {}
        for t in transfers or []:
            keys = list(t.keys or [])
            n = len(keys)

            def run(t: PoolTransfer = t, keys: List[str] = keys, n: int = n) -> List[bool]:
                pool = self._transfer_pool(t)
                starts = self._page_starts(pool, t.host_indices, n)
                if write:
                    return self._set(pool, keys, starts=starts)
                return self._get(pool, keys, starts=starts)

            what = "batch_set_v2" if write else "batch_get_v2"
            out[t.name] = self._guard(f"{what}[{t.name}]", n, [False] * n, run)
        return out

    def batch_get_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> Dict[Any, List[bool]]:
        return self._v2(transfers, write=False)

    def batch_set_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> Dict[Any, List[bool]]:
        return self._v2(transfers, write=True)

    # -- legacy: flat page tensors ----------------------------------------------

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        n = len(keys or [])

        def run() -> bool:
            pool = self._kv()
            vals = list(values or [])
            if len(vals) != n:
                raise _BadInput(f"{len(vals)} values for {n} keys")
            return all(self._set(pool, keys, values=vals))

        return self._guard("batch_set", n, False, run)

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[Optional[torch.Tensor]]:
        n = len(keys or [])

        def run() -> List[Optional[torch.Tensor]]:
            pool = self._kv()
            targets = list(target_locations or [])
            if len(targets) != n:
                raise _BadInput(f"{len(targets)} target tensors for {n} keys")
            for t in targets:
                _Bounce.check_target(pool, t)
            ok = self._get(pool, keys, targets=targets)
            return [t if good else None for t, good in zip(targets, ok)]

        return self._guard("batch_get", n, [None] * n, run)

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        if target_location is None:
            # A fresh page in the pool's flat format.
            try:
                target_location = self._kv().host.get_dummy_flat_data_page()
            except _Refused as e:
                self.stats.refusals.record(e.kind, str(e))
                self.stats.miss(e.reason, 1)
                return None
            except _Miss as e:
                self.stats.miss(e.reason, 1, f"get: {e}")
                return None
        return self.batch_get([key], [target_location])[0]

    # -- the rest -------------------------------------------------------------

    def clear(self) -> None:
        """Does nothing: the manager's pages are shared with other engines
        and age out by its own eviction."""
        logger.info("orbitkv: clear() leaves the shared store as it is")

    def get_stats(self) -> Dict[str, Any]:
        s = self.stats.snapshot()
        s["connections"] = self._conns.open_count()
        reg = self._conns.reg
        if reg is not None:
            s["instance"] = reg.instance
            s["namespace"] = reg.namespace
        return s

    def close(self) -> None:
        self._conns.close()

    def __del__(self) -> None:
        try:
            self._conns.close()
        except Exception:
            pass
