"""What an engine is, as OrbitKV sees it: the computation identity, the
storage groups compiled from vLLM's KV cache groups, and the storage layout
of every rank. Both roles (the scheduler and each worker) derive the same
`EngineSpec` from the same `VllmConfig` and `KVCacheConfig`, independently:
nothing passes between the roles except the connector metadata.

Everything that could make two engines' bytes differ for the same block
hashes goes into the identity; a setting the connector cannot represent is
a `ConfigError` that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import orbitkv

from .settings import ConfigError, ConnectorSettings

# Layouts whose per-layer block is one contiguous run of bytes (L and B are
# the outermost physical dimensions): a page of a layer is then one copy.
BLOCK_COMPACT_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
COLLISION_RESISTANT_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class LayerPlan:
    name: str
    index: int
    """Position in the engine's layer order (all groups, in group order)."""
    segment_bytes: int
    """Bytes of one block of this layer: its slice of a stored page."""


@dataclass(frozen=True)
class GroupPlan:
    id: int
    """The storage group id (`storage_group_ids`): 0 for full attention."""
    vllm_group: int
    """vLLM's KV cache group index: where this group's block ids are in
    vLLM's per-group block lists (`KVCacheBlocks.blocks`, `LoadSpec`)."""
    kind: str
    """``full``, ``sliding_window`` or ``mamba``."""
    rule: Any
    """The contract rule: ``"prefix"``, ``{"window": past_tokens}`` or
    ``"checkpoint"``."""
    components: Tuple[str, ...]
    layers: Tuple[LayerPlan, ...]
    """In page order: a stored page is the concatenation of each layer's
    block bytes, in this order."""

    @property
    def page_bytes(self) -> int:
        return sum(layer.segment_bytes for layer in self.layers)

    def group_spec(self) -> Dict[str, Any]:
        return {"id": self.id, "rule": self.rule, "components": list(self.components)}


KIND_ORDER = {"full": 0, "sliding_window": 1, "mamba": 2}


def storage_group_ids(kinds: Sequence[Tuple[str, int]]) -> List[int]:
    """The storage group id of each vLLM KV cache group, given each group's
    ``(kind, window)`` in vLLM's order (window 0 for non-window groups).

    The spec's rule: the full-attention group is storage group 0; each
    sliding-window (or recurrent) group gets its own id after it, ordered by
    kind, then window, then vLLM's index. vLLM orders its groups by their
    first layer, so a model whose first layer is sliding (Gemma 2/3,
    gpt-oss) has the sliding group first there; the ids here do not depend
    on that. Without a full-attention group, ids start at 0 all the same
    (the contract then leads with a window or checkpoint group). Several
    full-attention groups (vLLM splits full attention only when it has more
    layers than another kind) would need a page that spans several block
    tables: refused."""
    full = [i for i, (kind, _) in enumerate(kinds) if kind == "full"]
    if len(full) > 1:
        raise ConfigError(
            f"vLLM split the full-attention layers into {len(full)} KV cache groups "
            f"({full}); OrbitKV stores full attention as one group (storage group 0) "
            "and cannot yet build its pages from several block tables"
        )
    order = sorted(range(len(kinds)), key=lambda i: (KIND_ORDER[kinds[i][0]], kinds[i][1], i))
    ids = [0] * len(kinds)
    for sid, i in enumerate(order):
        ids[i] = sid
    return ids


@dataclass(frozen=True)
class EngineSpec:
    identity: str
    """The computation identity (64 hex)."""
    instance: str
    page_tokens: int
    groups: Tuple[GroupPlan, ...]
    tp_size: int
    kv_layout: str
    description: orbitkv.Instance
    """The instance every rank registers: what both roles send."""
    identity_inputs: List[Dict[str, Any]]

    @property
    def single_prefix_group(self) -> bool:
        """One full-attention group: a partial load keeps its loaded prefix
        (block-level errors); otherwise a load is all or nothing."""
        return len(self.groups) == 1 and self.groups[0].kind == "full"

    @property
    def vllm_index(self) -> Dict[int, int]:
        """Storage group id → vLLM's KV cache group index."""
        return {g.id: g.vllm_group for g in self.groups}

    def group(self, gid: int) -> GroupPlan:
        for g in self.groups:
            if g.id == gid:
                return g
        raise KeyError(gid)


def _plain(v: Any) -> Any:
    """A spec field as an identity value: numbers, booleans and text as
    they are, anything else (None included) by its text."""
    if isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _type_name(spec: Any) -> str:
    return type(spec).__name__


#: `MambaSpec`'s fields in vLLM 0.32/0.33: each is in the identity, or
#: refused when it would change the bytes (speculative blocks, modes).
_MAMBA_SPEC_FIELDS = frozenset(
    {
        "block_size",
        "shapes",
        "dtypes",
        "page_size_padded",
        "mamba_type",
        "mamba_cache_mode",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "prefill_checkpoint_alignment",
        "num_heads",
        "tokens_per_state",
        "tp_replicated",
        "dcp_sharded",
        "block_stride_alignment",
        "is_draft",
    }
)


def _conv_state_layout() -> str:
    """vLLM's convolution-state layout (``SD`` or ``DS``, from
    VLLM_SSM_CONV_STATE_LAYOUT): the same shape can hold either when the
    two sides are equal, so it is part of the identity; a vLLM that does
    not say is refused."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError as e:
        raise ConfigError(
            "this vLLM does not say its Mamba convolution-state layout "
            "(mamba_utils.get_conv_state_layout): recurrent state cannot be keyed safely"
        ) from e
    return str(get_conv_state_layout())


def _compile_group(gid: int, spec: Any, names: Sequence[str]):
    """(kind, rule, components) for one vLLM group spec; unknown specs fail."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind is SlidingWindowSpec:
        past = orbitkv.vllm_window_past_tokens(int(spec.sliding_window))
        return "sliding_window", {"window": past}, ("sliding_window_kv",)
    if kind is FullAttentionSpec:
        if getattr(spec, "non_causal", False):
            raise ConfigError(
                f"KV cache group {gid} attends non-causally (FullAttentionSpec.non_causal): "
                "a page then depends on later tokens and cannot be keyed by its prefix"
            )
        return "full", "prefix", ("attention_kv",)
    if kind is MLAAttentionSpec:
        return "full", "prefix", ("mla_kv",)
    if kind is MambaSpec:
        # A checkpoint group: the page at a boundary is the recurrent state
        # (every state component of every layer, all required) after
        # exactly that many tokens. Only vLLM's align mode keeps such
        # states, one block per page boundary it reached ("slot p holds the
        # state after (p + 1) * block_size tokens"); in any other mode a
        # block holds a state of whatever position the request is at.
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise ConfigError(
                f"KV cache group {gid} is a Mamba group with mamba_cache_mode={mode!r}: "
                "OrbitKV restores recurrent state only at page boundaries, which vLLM keeps "
                'with mamba_cache_mode="align" (set --mamba-cache-mode align, or enable '
                "prefix caching, which selects it)"
            )
        if int(getattr(spec, "num_speculative_blocks", 0)):
            raise ConfigError(
                f"KV cache group {gid} is a Mamba group with speculative state blocks "
                "(num_speculative_blocks): not supported by the OrbitKV connector"
            )
        # A field this connector does not know may change what a state's
        # bytes mean: refused rather than stored under an identity that
        # does not cover it.
        unknown = sorted(
            f.name for f in dataclasses.fields(spec) if f.name not in _MAMBA_SPEC_FIELDS
        )
        if unknown:
            raise ConfigError(
                f"KV cache group {gid} is a Mamba group whose spec has fields the OrbitKV "
                f"connector does not know ({', '.join(unknown)}): the stored state could "
                "mean something else; not supported with this vLLM version"
            )
        return "mamba", "checkpoint", ("recurrent_checkpoint", "convolution_state")
    raise ConfigError(
        f"KV cache group {gid} ({', '.join(names[:3])}{'...' if len(names) > 3 else ''}) "
        f"has a {_type_name(spec)}, which OrbitKV has no recovery rule for; "
        "supported: FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, MambaSpec"
    )


def _group_representation(plan: GroupPlan, spec: Any) -> Dict[str, Any]:
    rep: Dict[str, Any] = {
        "id": plan.id,
        "vllm_group": plan.vllm_group,
        "kind": plan.kind,
        "spec": _type_name(spec),
        "block_size": int(spec.block_size),
        "layers": [layer.name for layer in plan.layers],
        "segment_bytes": plan.layers[0].segment_bytes if plan.layers else 0,
    }
    if plan.kind == "mamba":
        rep["shapes"] = [list(s) for s in spec.shapes]
        rep["dtypes"] = [str(d) for d in spec.dtypes]
        rep["mamba_type"] = str(getattr(spec, "mamba_type", ""))
        rep["mamba_cache_mode"] = str(getattr(spec, "mamba_cache_mode", "none"))
        rep["page_size_padded"] = int(getattr(spec, "page_size_padded", None) or 0)
        # Every other field of the spec as it is (`_MAMBA_SPEC_FIELDS`).
        rep["mamba_spec"] = {
            f.name: _plain(getattr(spec, f.name))
            for f in dataclasses.fields(spec)
            if f.name not in ("block_size", "shapes", "dtypes", "mamba_type", "mamba_cache_mode")
        }
    else:
        rep["num_kv_heads"] = int(spec.num_kv_heads)
        rep["head_size"] = int(spec.head_size)
        rep["head_size_v"] = int(getattr(spec, "head_size_v", spec.head_size))
        rep["dtype"] = str(spec.dtype)
        rep["kv_quant_mode"] = str(getattr(spec, "kv_quant_mode", "none"))
        window = getattr(spec, "sliding_window", None)
        if window is not None:
            rep["sliding_window"] = int(window)
        chunk = getattr(spec, "attention_chunk_size", None)
        if chunk is not None:
            rep["attention_chunk_size"] = int(chunk)
    return rep


def _block_strides(layout: str, spec: Any) -> List[int]:
    """Byte strides of [H, N, C] inside one block, in the layout's physical
    order (so the layout name and the strides describe the page exactly)."""
    shape = {
        "H": int(getattr(spec, "num_heads", 1)),
        "N": int(getattr(spec, "num_states", spec.block_size)),
        "C": int(getattr(spec, "state_content_size_bytes", spec.real_page_size_bytes)),
    }
    strides: Dict[str, int] = {}
    step = 1
    for dim in reversed([d for d in layout if d in "HNC"]):
        strides[dim] = step
        step *= shape[dim]
    return [strides["H"], strides["N"], strides["C"]]


def _layer_index_order(groups: Sequence[Any]) -> Dict[str, int]:
    order: Dict[str, int] = {}
    for g in groups:
        for name in g.layer_names:
            if name in order:
                raise ConfigError(f"layer {name} appears in two KV cache groups")
            order[name] = len(order)
    return order


def _model_source(model_config: Any) -> Tuple[str, Optional[str]]:
    """(local directory holding config.json, pinned hub commit or None), by
    the one rule (`orbitkv.model_source`)."""
    try:
        return orbitkv.model_source(str(model_config.model), getattr(model_config, "revision", None))
    except orbitkv.IdentityError as e:
        raise ConfigError(str(e)) from e


def _check_supported(vllm_config: Any) -> None:
    """Settings that change the computation in ways a block hash does not
    capture, or that the connector does not implement: refused by name."""
    kvt = vllm_config.kv_transfer_config
    if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
        raise ConfigError(
            "kv_transfer_config.kv_load_failure_policy is "
            f'{kvt.kv_load_failure_policy!r}: OrbitKV needs "recompute" (a cache miss '
            "discovered during a load must recompute, not fail the request); add "
            '"kv_load_failure_policy": "recompute" to --kv-transfer-config'
        )
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ConfigError(
            "LoRA is enabled (lora_config): adapters change the computation per request, "
            "so cached state cannot be keyed safely; run without --enable-lora"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError(
            "speculative decoding is enabled (speculative_config): draft-model state "
            "is not supported by the OrbitKV connector"
        )
    pc = vllm_config.parallel_config
    for name in (
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        if int(getattr(pc, name, 1)) != 1:
            raise ConfigError(
                f"parallel_config.{name} = {getattr(pc, name)}: only tensor parallelism "
                "is supported by the OrbitKV connector"
            )
    cc = vllm_config.cache_config
    algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
    if algo not in COLLISION_RESISTANT_HASHES:
        raise ConfigError(
            f"cache_config.prefix_caching_hash_algo = {algo!r} is not collision "
            "resistant: two prompts could share a block hash and one would load the "
            f"other's KV; use one of {', '.join(COLLISION_RESISTANT_HASHES)}"
        )
    if getattr(cc, "calculate_kv_scales", False):
        raise ConfigError(
            "cache_config.calculate_kv_scales is on: KV scales computed at runtime "
            "differ between engines, so stored KV would be read with other scales"
        )
    mc = vllm_config.model_config
    if getattr(mc, "is_encoder_decoder", False):
        raise ConfigError("encoder-decoder models are not supported by the OrbitKV connector")
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        raise ConfigError(
            "model_config.hf_overrides is a function: its effect on the configuration "
            "cannot be part of the identity; pass a dict"
        )


def resolve_layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if name is None:
        raise ConfigError(
            "the KV cache layout is not resolved (cache_config.kv_cache_layout); "
            "the engine core resolves it before the connector starts"
        )
    name = str(getattr(name, "name", name))
    if name not in BLOCK_COMPACT_LAYOUTS:
        raise ConfigError(
            f"KV cache layout {name} keeps a block's bytes apart (heads outside "
            f"blocks); supported: {', '.join(BLOCK_COMPACT_LAYOUTS)} "
            "(set VLLM_KV_CACHE_LAYOUT)"
        )
    return name


def resolve_engine(
    vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings
) -> EngineSpec:
    """The engine's `EngineSpec`: reads config.json and (unless
    ORBITKV_MODEL_FINGERPRINT or a hub commit is given) hashes the model
    directory. Raises `ConfigError` or `orbitkv.IdentityError`."""
    import vllm

    _check_supported(vllm_config)
    layout = resolve_layout_name(vllm_config, kv_cache_config)
    cc = vllm_config.cache_config
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or cc.block_size
    groups_cfg = list(kv_cache_config.kv_cache_groups)
    if not groups_cfg:
        raise ConfigError("the KV cache config has no groups")
    order = _layer_index_order(groups_cfg)
    compiled = []
    for gid, g in enumerate(groups_cfg):
        spec = g.kv_cache_spec
        if not getattr(g, "enable_kv_transfer", True):
            raise ConfigError(
                f"KV cache group {gid} is not transferable (enable_kv_transfer=False)"
            )
        if getattr(g, "is_eagle_group", False) or getattr(spec, "is_draft", False):
            raise ConfigError(f"KV cache group {gid} holds draft-model layers")
        if int(spec.block_size) != int(hash_block):
            raise ConfigError(
                f"KV cache group {gid} has block_size {spec.block_size} but block hashes "
                f"cover {hash_block} tokens; every group must use the hash block size"
            )
        if not g.layer_names:
            raise ConfigError(f"KV cache group {gid} has no layers")
        compiled.append(_compile_group(gid, spec, list(g.layer_names)))
    ids = storage_group_ids(
        [(kind, rule["window"] if isinstance(rule, dict) else 0) for kind, rule, _ in compiled]
    )
    plans: List[GroupPlan] = []
    reps: List[Dict[str, Any]] = []
    slot_shapes: List[Tuple[GroupPlan, Any]] = []
    for gid in sorted(range(len(groups_cfg)), key=lambda i: ids[i]):
        g = groups_cfg[gid]
        spec = g.kv_cache_spec
        kind, rule, components = compiled[gid]
        segment = int(spec.real_page_size_bytes)
        layers = tuple(
            sorted(
                (LayerPlan(name, order[name], segment) for name in g.layer_names),
                key=lambda lp: lp.index,
            )
        )
        plan = GroupPlan(ids[gid], gid, kind, rule, components, layers)
        plans.append(plan)
        reps.append(_group_representation(plan, spec))
        slot_shapes.append((plan, spec))

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    mc = vllm_config.model_config
    algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
    cache_dtype = str(cc.cache_dtype)
    settings_map = {
        "dtype": str(mc.dtype),
        "quantization": str(mc.quantization or "none"),
        "kv_cache_dtype": cache_dtype,
        "block_size": int(hash_block),
        "kv_cache_layout": layout,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": 1,
        "prefix_caching_hash_algo": algo,
    }
    if any(p.kind == "mamba" for p in plans):
        # What the recurrent state's bytes are made of (the shapes and
        # dtypes are in each group's representation too).
        settings_map["mamba_cache_dtype"] = str(getattr(cc, "mamba_cache_dtype", "auto"))
        settings_map["mamba_ssm_cache_dtype"] = str(getattr(cc, "mamba_ssm_cache_dtype", "auto"))
        settings_map["mamba_cache_mode"] = str(getattr(cc, "mamba_cache_mode", "none"))
        settings_map["mamba_conv_state_layout"] = _conv_state_layout()
    representation = {
        "kv_cache_layout": layout,
        "block_size": int(hash_block),
        "kv_cache_dtype": cache_dtype,
        "groups": reps,
    }
    overrides = getattr(mc, "hf_overrides", None) or {}
    model_dir, hub_revision = _model_source(mc)
    resolved = orbitkv.compute_identity(
        model_dir,
        engine="vllm",
        engine_version=str(vllm.__version__),
        settings=settings_map,
        representation=representation,
        config_overrides=dict(overrides),
        hub_revision=hub_revision,
    )
    identity = resolved["identity"]
    instance = settings.instance or f"vllm-{identity[:16]}"

    slots = []
    for rank in range(tp):
        for plan, spec in slot_shapes:
            dtype = str(getattr(spec, "dtype", "mamba"))
            strides = _block_strides(layout, spec) if plan.kind != "mamba" else [1]
            for layer in plan.layers:
                slots.append(
                    {
                        "layer": layer.index,
                        "group": plan.id,
                        "tp_rank": rank,
                        "pp_rank": 0,
                        "segment_bytes": layer.segment_bytes,
                        "padded_page_bytes": layer.segment_bytes,
                        "page_tokens": int(hash_block),
                        "dtype": dtype,
                        "layout": layout if plan.kind != "mamba" else "state",
                        "strides": strides,
                        "device_addr": 0,
                    }
                )
    description = orbitkv.Instance(
        name=instance,
        identity=identity,
        layout={"slots": slots, "pool_capacity_pages": 0},
        page_tokens=int(hash_block),
        groups=[p.group_spec() for p in plans],
        ranks=[{"tp": r, "pp": 0} for r in range(tp)],
    )
    return EngineSpec(
        identity=identity,
        instance=instance,
        page_tokens=int(hash_block),
        groups=tuple(plans),
        tp_size=tp,
        kv_layout=layout,
        description=description,
        identity_inputs=resolved.get("inputs", []),
    )
