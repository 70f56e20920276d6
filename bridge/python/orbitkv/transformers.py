"""OrbitKV for Hugging Face transformers models (``docs/transformers.md``).

:class:`Store` saves a transformers ``DynamicCache`` into OrbitKV page by
page and restores the longest prefix the recovery contract allows, through
the embedded :class:`orbitkv.Runtime` or a :class:`orbitkv.Client` of
``orbitkv serve``. The runtime, not this module, decides what is legal:
this module only maps cache layers to groups and bytes to pages.

- Full-attention layers form the prefix group (keys and values of every
  page), sliding-window layers one window group per window size (the
  ``sliding_window - 1`` past tokens transformers keeps), and the
  convolution and recurrent states of linear-attention / SSM layers the
  checkpoint group: the state after each page boundary (or every
  ``checkpoint_interval`` pages).
- The identity is that of the engine adapters: the content of the model
  directory (weights, configuration, tokenizer), the transformers and
  torch releases, dtype and attention implementation, and this page
  format, sealed with the storage layout into the namespace.

Batch size 1, CPU or any device torch copies from, models whose cache
layers are ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
``LinearAttentionLayer`` or the two hybrid layer classes.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import transformers
from transformers import DynamicCache
from transformers import cache_utils as cu

import orbitkv
from orbitkv.refusals import Names, explain

__all__ = [
    "PAGE_FORMAT",
    "Generation",
    "OrbitKVError",
    "Restored",
    "Staged",
    "Store",
    "UnsupportedModel",
    "page_hashes",
]

#: Version of the page byte format below; part of every identity.
PAGE_FORMAT = "orbitkv.transformers/1"
#: Every slot of a page starts at a multiple of this many bytes, so each can
#: be viewed as its dtype without a copy.
_ALIGN = 64

#: Model types whose transformers 5.24 code ignores the recurrent state when
#: it continues a cache with more than one token: their chunked state is not
#: the model's state, so nothing of theirs may be stored.
_REFUSED_MODEL_TYPES = {
    "jamba": "transformers' Jamba drops the recurrent state in multi-token forwards with a "
    "cache (mamba_selective_scan gets no initial state), so a chunked prefill diverges",
}


class OrbitKVError(RuntimeError):
    """The runtime refused a command (``kind`` and ``detail`` are the
    event's ``error``), or an operation failed in a way a miss does not
    describe (``transfer_overdue``)."""

    def __init__(self, kind: str, detail: Any = None, command: Optional[str] = None, advice: str = ""):
        self.kind = kind
        self.detail = detail
        self.command = command
        text = f"{command or 'operation'}: {kind}" + (f" ({detail})" if detail is not None else "")
        super().__init__(f"{text}: {advice}" if advice else text)

    @classmethod
    def of(cls, e: "orbitkv.Refused") -> "OrbitKVError":
        """The manager's refusal, with what to change (`orbitkv.refusals`)."""
        error = e.args[3] if len(e.args) > 3 and e.args[3] else {"error": e.args[0]}
        detail = error.get("detail")
        advice = explain(str(e.args[1]), detail, _NAMES)
        return cls(error.get("error", e.args[0]), detail, getattr(e, "command", None), advice)


_NAMES = Names(
    ranks="this module stores one rank",
    instance="the instance",
    page_size="page_tokens",
    groups="the model's cache layers",
)
"""How this module names what a refusal points at."""


class UnsupportedModel(ValueError):
    """The model's cache holds state this module cannot store completely
    (OrbitKV fails closed rather than restore part of a state)."""


def _check_backend(backend: Any) -> None:
    """Raises unless ``backend`` can carry a store."""
    if isinstance(backend, orbitkv.Runtime):
        if backend.simulated_clock:
            raise ValueError(
                "orbitkv.transformers needs a wall-clock Runtime (simulated_clock=False): "
                "it reads and writes device regions through Runtime.device_view"
            )
    elif not isinstance(backend, orbitkv.Client):
        raise TypeError(f"backend must be an orbitkv.Runtime or orbitkv.Client, not {type(backend).__name__}")


# ---------------------------------------------------------------------------
# Layout: which layer state goes to which group, at which byte offset.
# ---------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class _Part:
    """One tensor of a slot: a layer's keys or values (``[heads, P,
    head_dim]`` per page) or one conv / recurrent state (its whole shape)."""

    name: str  # "keys", "values", "conv.<i>", "recurrent.<i>"
    shape: Tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the page

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class _Slot:
    layer: int
    parts: Tuple[_Part, ...]
    segment_bytes: int
    padded_bytes: int


@dataclass
class _Group:
    id: int
    rule: Any  # "prefix", {"window": past_tokens}, "checkpoint"
    components: List[str]
    slots: List[_Slot] = field(default_factory=list)
    page_bytes: int = 0

    @property
    def kind(self) -> str:
        return self.rule if isinstance(self.rule, str) else "window"

    @property
    def past_tokens(self) -> int:
        assert isinstance(self.rule, dict), self.rule
        return self.rule["window"]


_KV_CLASSES = {
    cu.DynamicLayer: ("full", False),
    cu.DynamicSlidingWindowLayer: ("sliding", False),
    cu.LinearAttentionLayer: (None, True),
    cu.LinearAttentionAndFullAttentionLayer: ("full", True),
    cu.LinearAttentionAndSlidingWindowAttentionLayer: ("sliding", True),
}


def _new_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def _probe_layout(model, config, page_tokens: int) -> List[_Group]:
    """Runs the model on one token with a throwaway cache and reads every
    layer's state shapes; returns the groups (ids assigned, slots laid out)."""
    cache = _new_cache(config)
    device = model.device
    with torch.no_grad():
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            position_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    prefix: List[Tuple[int, list]] = []
    windows: Dict[int, List[Tuple[int, list]]] = {}
    recurrent: List[Tuple[int, list]] = []
    for index, layer in enumerate(cache.layers):
        cls = type(layer)
        if cls is cu.DummyLayer:
            continue
        if cls not in _KV_CLASSES:
            raise UnsupportedModel(
                f"layer {index}: cache layer {cls.__name__} is not supported (it may hold state "
                f"beyond keys, values, conv and recurrent states)"
            )
        attention, linear = _KV_CLASSES[cls]
        if attention is not None:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != 1:
                raise UnsupportedModel(f"layer {index}: no [1, heads, tokens, head_dim] keys after a forward")
            _, heads, _, head_dim = keys.shape
            kv = [
                ("keys", (heads, page_tokens, head_dim), keys.dtype),
                ("values", (values.shape[1], page_tokens, values.shape[3]), values.dtype),
            ]
            if attention == "full":
                prefix.append((index, kv))
            else:
                past = layer.sliding_window - 1
                if past < page_tokens:
                    raise UnsupportedModel(
                        f"layer {index}: a sliding window of {layer.sliding_window} keeps {past} past "
                        f"tokens, fewer than a page ({page_tokens}); use page_tokens <= {past}"
                    )
                windows.setdefault(past, []).append((index, kv))
        if linear:
            parts = []
            for i in range(layer.number_of_states):
                if layer.is_conv_states_initialized[i]:
                    t = layer.conv_states[i]
                    parts.append((f"conv.{i}", tuple(t.shape), t.dtype))
                if layer.is_recurrent_states_initialized[i]:
                    t = layer.recurrent_states[i]
                    parts.append((f"recurrent.{i}", tuple(t.shape), t.dtype))
            if not parts:
                raise UnsupportedModel(f"layer {index}: a linear-attention layer kept no state after a forward")
            recurrent.append((index, parts))

    specs: List[Tuple[Any, List[str], List[Tuple[int, list]]]] = []
    if prefix:
        specs.append(("prefix", ["attention_kv"], prefix))
    for past in sorted(windows):
        specs.append(({"window": past}, ["sliding_window_kv"], windows[past]))
    if recurrent:
        kinds = {p[0].split(".")[0] for _, parts in recurrent for p in parts}
        components = (["recurrent_checkpoint"] if "recurrent" in kinds else []) + (
            ["convolution_state"] if "conv" in kinds else []
        )
        specs.append(("checkpoint", components, recurrent))
    if not specs:
        raise UnsupportedModel("the model's cache holds no state")
    groups = []
    for gid, (rule, components, layers) in enumerate(specs):
        g = _Group(id=gid, rule=rule, components=components)
        offset = 0
        for index, parts in layers:
            laid = []
            start = offset
            for name, shape, dtype in parts:
                part = _Part(name, tuple(int(d) for d in shape), dtype, offset)
                laid.append(part)
                offset = _round_up(offset + part.nbytes, _ALIGN)
            segment = sum(p.nbytes for p in laid)
            g.slots.append(_Slot(index, tuple(laid), segment, offset - start))
        g.page_bytes = offset
        groups.append(g)
    return groups


def _storage_layout(groups: List[_Group], page_tokens: int) -> dict:
    slots = []
    for g in groups:
        for s in g.slots:
            slots.append(
                {
                    "layer": s.layer,
                    "group": g.id,
                    "tp_rank": 0,
                    "pp_rank": 0,
                    "segment_bytes": s.segment_bytes,
                    "padded_page_bytes": s.padded_bytes,
                    "page_tokens": page_tokens,
                    "dtype": ",".join(_dtype_name(p.dtype) for p in s.parts),
                    # Each part's name and shape, in page order: the bytes'
                    # meaning, sealed into the namespace.
                    "layout": "+".join(f"{p.name}[{'x'.join(map(str, p.shape))}]" for p in s.parts),
                    "strides": [],
                    "device_addr": 0,
                }
            )
    return {"slots": slots, "pool_capacity_pages": 0}


def page_hashes(token_ids: Sequence[int], page_tokens: int) -> List[bytes]:
    """The chained hash of every whole page of ``token_ids``: page ``k``'s
    hash names tokens ``[0, (k + 1) * page_tokens)``. 32-byte SHA-256."""
    out = []
    prev = hashlib.sha256(PAGE_FORMAT.encode()).digest()
    ids = torch.as_tensor(list(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids)
    ids = ids.reshape(-1).to(torch.int64).cpu()
    for k in range(ids.numel() // page_tokens):
        h = hashlib.sha256(prev)
        h.update(ids[k * page_tokens : (k + 1) * page_tokens].numpy().tobytes())
        prev = h.digest()
        out.append(prev)
    return out


def _tokens(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one sequence (shape [T] or [1, T]), got {tuple(ids.shape)}")
    return ids.to(torch.long)


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class Restored:
    """What :meth:`Store.restore` found.

    ``cache`` holds the model's state after ``boundary`` tokens (``None`` on
    a miss, with ``boundary`` 0); ``miss`` is the runtime's reason
    (``not_found``, ``no_legal_boundary``, ``checksum``, ...) or
    ``prompt_too_short`` when the prompt has no whole page before its last
    token."""

    cache: Optional[DynamicCache]
    boundary: int
    miss: Optional[str]
    pages: int = 0
    bytes: int = 0
    pages_from_tiers: int = 0
    seconds: Dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    """The result of :meth:`Store.generate`: the prompt and the generated
    token ids, the restored boundary (0 on a miss), the miss reason, the
    prompt tokens computed, and the pages published."""

    tokens: List[int]
    new_tokens: List[int]
    boundary: int
    miss: Optional[str]
    computed_tokens: int
    published: int
    first_token_s: float


class Staged:
    """Pages computed by :meth:`Store.prefill` and waiting in the store's
    device regions, to be published by :meth:`Store.publish`. Prefix pages
    are read from ``cache`` at publish time; window and checkpoint pages
    were copied when their boundary passed (the cache no longer holds
    them)."""

    def __init__(self, hashes: List[bytes], cache: DynamicCache, pages: Dict[Tuple[int, int], bool], page_tokens: int):
        self.page_tokens = page_tokens
        self.hashes = hashes
        self.cache = cache
        #: (group, page index) of every staged page.
        self.pages = pages
        #: Pages the runtime inserted when this was published (``None``
        #: before).
        self.inserted: Optional[int] = None

    def discard(self, group: int, page_end: int) -> None:
        """Drops one staged page (the page of ``group`` ending at token
        ``page_end``) so it is not published."""
        key = (group, page_end // self.page_tokens - 1)
        if key not in self.pages:
            raise KeyError(f"no staged page of group {group} ends at {page_end}")
        del self.pages[key]

    def __len__(self) -> int:
        return len(self.pages)


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------


class Store:
    """Saves and restores one transformers model's cache through OrbitKV.

    :param model: a causal LM (``AutoModelForCausalLM``), in eval mode.
    :param model_dir: the directory the model was loaded from (its weights
        and ``config.json`` are hashed into the identity). The model's
        configuration must equal that ``config.json``.
    :param backend: an :class:`orbitkv.Runtime` (wall clock) or a connected
        :class:`orbitkv.Client`.
    :param page_tokens: tokens per page.
    :param max_tokens: the longest prefix stored or restored; sizes the
        device regions (``ceil(max_tokens / page_tokens)`` pages per group;
        memory files, so untouched pages cost nothing).
    :param checkpoint_interval: with a checkpoint group, a checkpoint every
        this many pages (restorable boundaries are its multiples).
    :param timeout_s: the longest wait for any one runtime event.
    :raises UnsupportedModel: a cache layer this module cannot store
        completely, or a refused model type.
    :raises orbitkv.IdentityError: the identity cannot be established.
    """

    def __init__(
        self,
        model,
        model_dir: Union[str, Path],
        backend: Union[orbitkv.Runtime, orbitkv.Client],
        *,
        page_tokens: int = 64,
        max_tokens: int = 32768,
        checkpoint_interval: int = 1,
        timeout_s: float = 30.0,
    ):
        if page_tokens <= 0 or max_tokens < page_tokens or checkpoint_interval <= 0:
            raise ValueError("need page_tokens > 0, max_tokens >= page_tokens, checkpoint_interval > 0")
        self.model = model
        self.config = model.config
        model_type = getattr(self.config, "model_type", "")
        if model_type in _REFUSED_MODEL_TYPES:
            raise UnsupportedModel(f"{model_type}: {_REFUSED_MODEL_TYPES[model_type]}")
        self.model_dir = Path(model_dir)
        _check_backend(backend)
        self._check_config()
        self.page_tokens = page_tokens
        self.max_pages = max_tokens // page_tokens
        self.groups = _probe_layout(model, self.config, page_tokens)
        self.prefix = next((g for g in self.groups if g.kind == "prefix"), None)
        self.checkpoint = next((g for g in self.groups if g.kind == "checkpoint"), None)
        self.windows = [g for g in self.groups if g.kind == "window"]
        self.checkpoint_interval = checkpoint_interval if self.checkpoint else 1
        layout = _storage_layout(self.groups, page_tokens)
        contract_groups = [{"id": g.id, "rule": g.rule, "components": g.components} for g in self.groups]
        self.identity = orbitkv.compute_identity(
            str(self.model_dir),
            engine="transformers",
            engine_version=transformers.__version__,
            settings={
                "torch": torch.__version__,
                "dtype": _dtype_name(model.dtype),
                "attn_implementation": str(getattr(self.config, "_attn_implementation", None) or "default"),
                "model_class": type(model).__name__,
                "batch_size": 1,
            },
            representation={
                "format": PAGE_FORMAT,
                "page_tokens": page_tokens,
                "checkpoint_interval": self.checkpoint_interval,
                "groups": [
                    {"id": g.id, "rule": g.rule, "components": g.components, "layers": [s.layer for s in g.slots]}
                    for g in self.groups
                ],
            },
            layout=layout,
            groups=contract_groups,
        )
        self.namespace: str = self.identity["namespace"]
        self.instance = f"transformers/{self.namespace[:16]}"
        self.timeout_s = timeout_s
        #: Per group: its device region's handle and its pages as a
        #: ``[max_pages, page_bytes]`` tensor over the region's memory.
        self._regions: Dict[int, Tuple[int, torch.Tensor]] = {}
        # The session's slot table keeps each (group, slot)'s device page
        # until the session closes: no allocation rounds per call.
        self._session: Optional[orbitkv.Session] = orbitkv.Session(
            backend,
            orbitkv.Instance(
                name=self.instance,
                identity=self.identity["identity"],
                layout=layout,
                page_tokens=self.page_tokens,
                groups=contract_groups,
                ranks=[{"tp": 0, "pp": 0}],
            ),
            name="transformers",
            timeout=timeout_s,
            on_connect=self._setup,
        )
        try:
            self._call(self._session.connect)
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------

    def _check_config(self) -> None:
        """The in-memory configuration must be the one the identity hashes."""
        path = self.model_dir / "config.json"
        if not path.is_file():
            raise orbitkv.IdentityError(f"{path} does not exist: the identity needs the model directory")
        # Read locally only: this never resolves a name on a model hub.
        on_disk = type(self.config).from_json_file(str(path)).to_dict()
        live = self.config.to_dict()
        volatile = {"_name_or_path", "dtype", "torch_dtype", "transformers_version", "_attn_implementation_autoset"}
        differ = sorted(k for k in set(on_disk) | set(live) if k not in volatile and on_disk.get(k) != live.get(k))
        if differ:
            raise orbitkv.IdentityError(
                f"the model's configuration differs from {self.model_dir / 'config.json'} in {differ}: "
                "save the model (or pass the directory it was loaded from)"
            )

    def _s(self) -> orbitkv.Session:
        if self._session is None:
            raise RuntimeError("the store is closed")
        return self._session

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Runs a session verb; the manager's refusal is an `OrbitKVError`."""
        try:
            return fn(*args, **kw)
        except orbitkv.Refused as e:
            raise OrbitKVError.of(e) from e

    def _setup(self, session: orbitkv.Session) -> None:
        """Registers a device region per group on a new session."""
        if session.namespaces != [self.namespace]:
            raise OrbitKVError("namespace_mismatch", {"runtime": session.namespaces, "adapter": self.namespace})
        for g in self.groups:
            region = session.register_region(0, g.id, self.max_pages)
            view = session.region_view(region)
            if len(view) != self.max_pages * g.page_bytes:
                raise OrbitKVError(
                    "page_bytes_mismatch", {"runtime": len(view) // self.max_pages, "adapter": g.page_bytes}
                )
            pages = torch.frombuffer(view, dtype=torch.uint8).view(self.max_pages, g.page_bytes)
            self._regions[g.id] = (region, pages)

    def close(self) -> None:
        """Closes the session: the runtime returns its leases, reservations
        and device pages. Idempotent."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def new_cache(self) -> DynamicCache:
        """An empty cache of this model's layer types."""
        return _new_cache(self.config)

    # -- page bytes ---------------------------------------------------------

    def _part_view(self, g: _Group, part: _Part, first: int, count: int) -> torch.Tensor:
        """Pages ``[first, first + count)`` of one part, as ``[count, *shape]``
        of its dtype, over the group's region (no copy)."""
        region = self._regions[g.id][1]
        raw = region[first : first + count, part.offset : part.offset + part.nbytes]
        return raw.view(part.dtype).view(count, *part.shape)

    def _stage_kv_pages(self, g: _Group, cache: DynamicCache, first: int, count: int, token0: int) -> None:
        """Copies ``count`` pages of keys and values of every layer of group
        ``g`` into its region's slots ``first..``; page ``first`` starts at
        index ``token0`` of the layers' cached tokens."""
        p = self.page_tokens
        for s in g.slots:
            layer = cache.layers[s.layer]
            for part in s.parts:
                src = getattr(layer, part.name)[0, :, token0 : token0 + count * p, :]
                if src.shape[1] != count * p or token0 < 0:
                    raise OrbitKVError("short_cache", f"layer {s.layer} holds no {count} pages at token {token0}")
                if src.dtype != part.dtype:
                    # copy_ would convert silently; the namespace names the dtype.
                    raise UnsupportedModel(f"layer {s.layer}: {part.name} is {src.dtype}, registered {part.dtype}")
                heads, _, dim = part.shape
                dst = self._part_view(g, part, first, count)
                dst.copy_(src.reshape(heads, count, p, dim).transpose(0, 1))

    def _stage_checkpoint(self, cache: DynamicCache, page: int) -> None:
        g = self.checkpoint
        for s in g.slots:
            layer = cache.layers[s.layer]
            for part in s.parts:
                kind, idx = part.name.split(".")
                states = layer.conv_states if kind == "conv" else layer.recurrent_states
                t = states[int(idx)]
                if t is None or tuple(t.shape) != part.shape or t.dtype != part.dtype:
                    raise UnsupportedModel(f"layer {s.layer}: {part.name} changed shape or dtype")
                self._part_view(g, part, page, 1)[0].copy_(t)

    # -- save -----------------------------------------------------------------

    def chunk_ends(self, start: int, end: int) -> List[int]:
        """Where :meth:`prefill` ends its forward passes when computing
        tokens ``[start, end)``: every page boundary for a model with window
        groups (whole pages must be copied before they slide out), every
        checkpoint boundary for one with a checkpoint group, else ``[end]``."""
        if end <= start:
            return []
        if self.windows:
            step = self.page_tokens
        elif self.checkpoint:
            step = self.page_tokens * self.checkpoint_interval
        else:
            return [end]
        return list(range((start // step + 1) * step, end, step)) + [end]

    def forward(self, ids: torch.Tensor, cache: DynamicCache, start: int, logits_to_keep: int = 1):
        """One forward pass of tokens ``ids[0, start:]`` ... as the store runs it:
        explicit positions, the given cache. Returns the logits."""
        n = ids.shape[1]
        pos = torch.arange(start, start + n, device=self.model.device)[None]
        with torch.no_grad():
            out = self.model(
                input_ids=ids.to(self.model.device),
                position_ids=pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return out.logits

    def prefill(
        self,
        input_ids,
        cache: Optional[DynamicCache] = None,
        start: Optional[int] = None,
        *,
        publish: bool = True,
        on_chunk: Optional[Callable[[int, DynamicCache], None]] = None,
    ) -> Tuple[torch.Tensor, Staged]:
        """Computes the prompt from token ``start`` (default: the cache's
        length; 0 without a cache), in the passes :meth:`chunk_ends` gives,
        staging every whole page as it passes, and publishes the new pages
        unless ``publish=False``. ``on_chunk(end, cache)`` sees the live
        cache after each pass.

        :returns: the last token's logits (``[1, 1, vocab]``) and the staged
            pages (``Staged.inserted`` says how many were new).
        """
        ids = _tokens(input_ids)
        total = ids.shape[1]
        if cache is None:
            cache, start = self.new_cache(), 0
        elif start is None:
            start = cache.get_seq_length()
        if start % self.page_tokens:
            raise ValueError(f"the cache holds {start} tokens, not a whole number of pages")
        if total <= start:
            raise ValueError(f"nothing to compute: the prompt has {total} tokens, the cache {start}")
        hashes = page_hashes(ids[0], self.page_tokens)
        staged: Dict[Tuple[int, int], bool] = {}
        p = self.page_tokens
        logits = None
        at = start
        for end in self.chunk_ends(start, total):
            logits = self.forward(ids[:, at:end], cache, at)
            # Window pages leave the cache as it slides: copy each whole page
            # of this chunk now. Checkpoints: the state at this boundary.
            first, last = at // p, min(end // p, self.max_pages)
            for g in self.windows:
                if last > first:
                    # The layers hold the window's last tokens, ending at `end`.
                    held = cache.layers[g.slots[0].layer].keys.shape[2]
                    self._stage_kv_pages(g, cache, first, last - first, held - (end - first * p))
                    staged.update({(g.id, k): True for k in range(first, last)})
            if self.checkpoint and end % (p * self.checkpoint_interval) == 0 and end // p <= self.max_pages:
                self._stage_checkpoint(cache, end // p - 1)
                staged[(self.checkpoint.id, end // p - 1)] = True
            if on_chunk is not None:
                on_chunk(end, cache)
            at = end
        if self.prefix:
            for k in range(start // p, min(total // p, self.max_pages)):
                staged[(self.prefix.id, k)] = True
        result = Staged(hashes, cache, staged, p)
        if publish:
            self.publish(result)
        return logits, result

    def save(self, input_ids, cache: DynamicCache) -> int:
        """Publishes what an already computed cache holds for ``input_ids``:
        its whole prefix pages, the window pages it still holds whole, and
        its recurrent state as a checkpoint when its length is a page
        boundary. (A cache computed by :meth:`prefill` has a checkpoint at
        every boundary; prefer that for hybrid models.) Returns the pages
        inserted."""
        ids = _tokens(input_ids)
        p = self.page_tokens
        length = cache.get_seq_length()
        if ids.shape[1] < length:
            raise ValueError(f"the cache holds {length} tokens but input_ids only {ids.shape[1]}")
        pages = min(length // p, self.max_pages)
        staged: Dict[Tuple[int, int], bool] = {}
        if self.prefix:
            staged.update({(self.prefix.id, k): True for k in range(pages)})
        for g in self.windows:
            held = cache.layers[g.slots[0].layer].keys.shape[2]
            first = max(0, (length - held + p - 1) // p)
            if pages > first:
                self._stage_kv_pages(g, cache, first, pages - first, held - (length - first * p))
                staged.update({(g.id, k): True for k in range(first, pages)})
        if self.checkpoint and length % (p * self.checkpoint_interval) == 0 and 0 < length // p <= self.max_pages:
            self._stage_checkpoint(cache, length // p - 1)
            staged[(self.checkpoint.id, length // p - 1)] = True
        return self.publish(Staged(page_hashes(ids[0, :length], p), cache, staged, p))

    def publish(self, staged: Staged) -> int:
        """Publishes staged pages (prefix pages are copied from the staged
        cache first). Returns the pages the runtime inserted (pages it
        already had count as duplicates)."""
        if not staged.pages:
            return 0
        if self.prefix:
            ks = sorted(k for g, k in staged.pages if g == self.prefix.id)
            if ks:
                first, count = ks[0], ks[-1] - ks[0] + 1
                self._stage_kv_pages(self.prefix, staged.cache, first, count, first * self.page_tokens)
        inserted = 0
        keys = sorted(staged.pages)
        handles = self._device_pages(keys)
        limit = 4096  # the runtime's default max_publish_pages
        for i in range(0, len(keys), limit):
            batch = keys[i : i + limit]
            saved = self._call(self._s().save, [(0, g, staged.hashes[k], handles[(g, k)]) for g, k in batch])
            inserted += saved.inserted
        staged.inserted = inserted
        return inserted

    # -- device pages -------------------------------------------------------

    def _device_pages(self, keys: List[Tuple[int, int]]) -> Dict[Tuple[int, int], int]:
        """Device pages for slots ``(group, page index)`` of the regions,
        from the session's slot table. One store runs one operation at a
        time, so no two copies share a slot."""
        out: Dict[Tuple[int, int], int] = {}
        for g in sorted({g for g, _ in keys}):
            ks = [k for gg, k in keys if gg == g]
            pages = self._call(self._s().device_pages, self._regions[g][0], ks)
            out.update({(g, k): dp for k, dp in zip(ks, pages)})
        return out

    # -- restore ----------------------------------------------------------

    def restore(self, input_ids) -> Restored:
        """Restores the longest prefix of ``input_ids`` that the runtime's
        recovery contract allows (at most ``len - 1`` tokens: the last token
        is always computed, for its logits). Returns the cache at that
        boundary, or a miss with its reason."""
        t0 = time.perf_counter()
        ids = _tokens(input_ids)
        total = ids.shape[1]
        p = self.page_tokens
        pages = min((total - 1) // p, self.max_pages)
        if pages == 0:
            return Restored(None, 0, "prompt_too_short")
        hashes = page_hashes(ids[0, : pages * p], p)
        # One `load`: every slot of every group up to the hashed pages is a
        # destination; the runtime selects the boundary, leases its pages
        # and restores the ones the contract needs.
        handles = self._device_pages([(g.id, k) for g in self.groups for k in range(pages)])
        s = self._s()
        ticket = self._call(
            s.start_load,
            [g.id for g in self.groups],
            hashes,
            0,
            total,
            ranks=[0],
            targets=[(0, g, (k + 1) * p, dp) for (g, k), dp in handles.items()],
        )
        t_ready = None
        loaded = None
        deadline = time.monotonic() + self.timeout_s
        while loaded is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"orbitkv: no outcome of the load within {self.timeout_s} s")
            try:
                progress = s.poll(min(left, 0.05))
            except orbitkv.Unavailable as e:
                raise OrbitKVError("unavailable", str(e), "load") from e
            for t, outcome in progress:
                if t != ticket:
                    continue
                if isinstance(outcome, orbitkv.Ready):
                    t_ready = time.perf_counter()
                else:
                    loaded = outcome
        if isinstance(loaded, orbitkv.Refused):
            # Its plan refused once ready (a bug of ours: every slot was named).
            raise OrbitKVError.of(loaded)
        if not loaded.hit:
            return Restored(None, 0, str(loaded.miss))
        t_copied = time.perf_counter()
        keys = sorted((g, end // p - 1) for _, g, end in loaded.leased)
        cache = self._build_cache(loaded.boundary, keys)
        t_built = time.perf_counter()
        t_ready = t_ready or t_copied
        return Restored(
            cache,
            loaded.boundary,
            None,
            pages=loaded.pages,
            bytes=loaded.bytes,
            pages_from_tiers=loaded.pages_from_tiers,
            seconds={
                "query_ready": t_ready - t0,
                "restore_copy": t_copied - t_ready,
                "to_cache": t_built - t_copied,
            },
        )

    def _build_cache(self, boundary: int, keys: List[Tuple[int, int]]) -> DynamicCache:
        """A fresh cache holding the restored pages' state at ``boundary``."""
        p = self.page_tokens
        cache = self.new_cache()
        by_group: Dict[int, List[int]] = {}
        for g, k in keys:
            by_group.setdefault(g, []).append(k)
        for g in self.groups:
            ks = by_group.get(g.id, [])
            # The runtime leased exactly the contract's ranges: the page
            # ending at the boundary, and for attention a run up to it.
            last = boundary // p - 1
            if not ks or ks[-1] != last or ks != list(range(ks[0], last + 1)) or (g.kind == "checkpoint" and len(ks) != 1):
                raise OrbitKVError("unexpected_leases", {"group": g.id, "pages": ks, "boundary": boundary})
            if g.kind == "checkpoint":
                self._load_checkpoint(cache, last)
                continue
            keep = boundary if g.kind == "prefix" else min(boundary, g.past_tokens)
            for s in g.slots:
                kv = []
                for part in s.parts:
                    heads, _, dim = part.shape
                    src = self._part_view(g, part, ks[0], len(ks))  # [n, H, P, D]
                    t = torch.empty((1, heads, len(ks) * p, dim), dtype=part.dtype, device=self.model.device)
                    t[0].view(heads, len(ks), p, dim).copy_(src.transpose(0, 1))
                    kv.append(t[:, :, t.shape[2] - keep :, :] if keep < t.shape[2] else t)
                layer = cache.layers[s.layer]
                # The two-positional form initializes the attention part only
                # (hybrid layers dispatch on it).
                layer.lazy_initialization(kv[0], kv[1])
                layer.keys, layer.values = kv[0], kv[1]
                if g.kind == "window":
                    layer.cumulative_length = boundary
        return cache

    def _load_checkpoint(self, cache: DynamicCache, page: int) -> None:
        g = self.checkpoint
        for s in g.slots:
            layer = cache.layers[s.layer]
            for part in s.parts:
                kind, idx = part.name.split(".")
                i = int(idx)
                t = self._part_view(g, part, page, 1)[0].to(self.model.device)
                if kind == "conv":
                    layer.lazy_initialization(conv_states=t, state_idx=i, conv_kernel_size=part.shape[-1])
                    layer.conv_states[i].copy_(t)
                else:
                    layer.lazy_initialization(recurrent_states=t, state_idx=i)
                    layer.recurrent_states[i].copy_(t)
                layer.has_previous_state[i] = True

    # -- generate -----------------------------------------------------------

    def generate(self, input_ids, max_new_tokens: int, *, publish: bool = True) -> Generation:
        """Greedy generation that restores the longest legal prefix of the
        prompt from OrbitKV, computes only the rest (publishing its new
        pages), then decodes ``max_new_tokens`` tokens one at a time."""
        t0 = time.perf_counter()
        ids = _tokens(input_ids)
        restored = self.restore(ids)
        cache = restored.cache if restored.cache is not None else self.new_cache()
        logits, staged = self.prefill(ids, cache, restored.boundary, publish=False)
        nxt = int(logits[0, -1].argmax())
        first_token_s = time.perf_counter() - t0
        # Published after the first token, off its latency. Decoding does not
        # touch what was staged: prefix pages are the cache's first tokens,
        # window pages and checkpoints were copied as they passed.
        if publish:
            self.publish(staged)
        new = [nxt]
        pos = ids.shape[1]
        while len(new) < max_new_tokens:
            step = torch.tensor([[nxt]], dtype=torch.long)
            logits = self.forward(step, cache, pos)
            pos += 1
            nxt = int(logits[0, -1].argmax())
            new.append(nxt)
        return Generation(
            tokens=ids[0].tolist() + new[:max_new_tokens],
            new_tokens=new[:max_new_tokens],
            boundary=restored.boundary,
            miss=restored.miss,
            computed_tokens=ids.shape[1] - restored.boundary,
            published=staged.inserted or 0,
            first_token_s=first_token_s,
        )
