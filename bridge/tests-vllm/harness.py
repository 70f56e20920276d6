"""Drives the real vLLM 0.33 classes on CPU around `OrbitKVConnector`: the
real `Scheduler` / `AsyncScheduler`, the worker connector built by vLLM's own
factory, the model runner's worker glue (`ActiveKVConnector`), KV cache
groups from vLLM's own `get_kv_cache_groups` over each layer's spec as the
model's config declares it (`layer_types`, `sliding_window`), KV tensors
from the model runner's allocator (`allocate_kv_cache`), and the workers'
outputs merged by vLLM's own `KVOutputAggregator`. Only the model's
forward is a stand-in: it writes a known value for every
(layer, token, position) it computes, and for a recurrent (Mamba) layer
the state after each prefix, where vLLM's align mode keeps it: it first
checks that the state it resumes from is the one of the tokens before,
as `preprocess_mamba` copies it, then writes the state at the step's end
into the request's running state block.

After every step the harness checks the engine's view of the truth: every
position a running request counts as computed holds exactly the value the
stand-in writes for it, in every block the request would attend to. A byte
loaded from OrbitKV that is not what the producer computed fails there.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence
from unittest.mock import MagicMock, patch

import torch
from tiny_models import make_llama
from vllm import SamplingParams
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.forward_context import set_forward_context
from vllm.platforms import current_platform
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import get_kv_connector
from vllm.v1.worker.utils import allocate_kv_cache

EOS = 2
HEADS = 2
HEAD = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def state(layer: int, tokens: Sequence[int], n: int) -> torch.Tensor:
    """What the stand-in's recurrent layer `layer` holds after `tokens`
    (float32, `n` values, exact): a digest of the whole prefix, so a state
    of another prefix or another length never passes for it."""
    digest = 0
    for i, t in enumerate(tokens):
        digest = (digest + (t + 1) * (i + 1)) % 499_979
    base = layer * 1_000_000 + (digest + len(tokens) * 7919) % 500_000
    return torch.arange(n, dtype=torch.float32) + float(base)


def state_view(t: torch.Tensor, block: int, nbytes: int) -> torch.Tensor:
    """One block's state bytes of a recurrent layer's cache (vLLM gives
    `[blocks, 1, 1, padded page]` int8) as float32."""
    return t[block].reshape(-1)[:nbytes].view(torch.float32)


def make_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama directory: what the identity reads."""
    return make_llama(path, seed, hidden=64, heads=4, kv_heads=HEADS, head_dim=HEAD)


def value(layer: int, token: int, pos: int) -> float:
    """What the stand-in forward writes (exact in float32)."""
    return float(layer * 1_000_000 + token * 1000 + pos)


def build_config(
    model: Path,
    socket: str,
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    max_batched: int = 64,
    async_scheduling: bool = False,
    sliding_window: Optional[int] = None,
    tp: int = 1,
    extra: Optional[Dict[str, Any]] = None,
    hash_algo: str = "sha256",
    failure_policy: str = "recompute",
    layout: str = "LBNHC",
    role: str = "kv_both",
    kv_events: Any = None,
):
    """(VllmConfig, KVCacheConfig, groups) of a CPU engine with the
    connector configured. The groups are vLLM's own (`get_kv_cache_groups`)
    over the layers' specs; `sliding_window` makes the second layer of a
    two-layer model a sliding-window layer."""
    mc = ModelConfig(model=str(model), dtype="float32", seed=0)
    sc = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cc.prefix_caching_hash_algo = hash_algo
    cc.kv_cache_layout = layout
    kvt = KVTransferConfig(
        kv_connector="OrbitKVConnector",
        kv_connector_module_path="orbitkv.vllm",
        kv_role=role,
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config={"socket": socket, "timeout_s": 5.0, **(extra or {})},
    )
    # vLLM's own HMA tests do this (test_hma_auto_config.py): CPU platforms
    # turn the hybrid allocator off otherwise (one group whatever the
    # platform says when every layer is alike).
    with patch.object(current_platform, "support_hybrid_kv_cache", lambda: True):
        vc = VllmConfig(
            scheduler_config=sc,
            model_config=mc,
            cache_config=cc,
            kv_transfer_config=kvt,
            device_config=DeviceConfig("cpu"),
            attention_config=AttentionConfig(),
            kv_events_config=kv_events,
        )
        specs = layer_specs(mc.hf_text_config, block_size, sliding_window, vc)
        groups = get_kv_cache_groups(vc, specs)
    vc.parallel_config.tensor_parallel_size = tp
    page = max(s.page_size_bytes for s in specs.values())
    kcc = get_kv_cache_config_from_groups(
        vc, groups, available_memory=page * num_blocks * len(specs)
    )
    return vc, kcc, groups


#: A recurrent layer in `layer_types`' answer.
MAMBA = "mamba"


def layer_types(hf_config: Any, sliding_window: Optional[int] = None) -> List[Any]:
    """Each layer's sliding window (None: full attention; `MAMBA`: a
    recurrent layer), as vLLM's model code reads the config: a layer is
    sliding when `layer_types` says ``sliding_attention``, with the
    config's `sliding_window`; ``linear_attention`` (Qwen3-Next's gated
    delta net) is recurrent."""
    n = int(hf_config.num_hidden_layers)
    if sliding_window is not None:
        return [None, sliding_window]
    kinds = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n)
    out: List[Any] = []
    for kind in kinds[:n]:
        if kind == "sliding_attention":
            out.append(int(hf_config.sliding_window))
        elif kind == "full_attention":
            out.append(None)
        elif kind in ("linear_attention", "mamba"):
            out.append(MAMBA)
        elif kind == "attention":  # Granite 4's name for full attention
            out.append(None)
        else:
            raise ValueError(f"layer type {kind!r} has no stand-in")
    return out


def mamba_spec(vc: Any, block_size: int) -> Any:
    """A recurrent layer's spec as vLLM's `MambaBase.get_kv_cache_spec`
    builds it: the state shapes and dtypes from the model class's own
    `get_mamba_state_shape_from_config` / `..._dtype_from_config`, the
    cache mode and padded page vLLM's config set."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    mc = vc.model_config
    cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)
    kinds = {
        "qwen3_next": MambaAttentionBackendEnum.GDN_ATTN,
        "granitemoehybrid": MambaAttentionBackendEnum.MAMBA2,
    }
    kind = kinds[mc.hf_config.model_type]
    cc = vc.cache_config
    # Mamba2 exports block-boundary states from inside a prefill
    # (`MambaMixer2.get_kv_cache_spec`): one reserved checkpoint block.
    mamba2 = kind == MambaAttentionBackendEnum.MAMBA2
    return MambaSpec(
        shapes=tuple(cls.get_mamba_state_shape_from_config(vc)),
        dtypes=tuple(cls.get_mamba_state_dtype_from_config(vc)),
        block_size=int(cc.mamba_block_size or block_size),
        page_size_padded=cc.mamba_page_size_padded,
        mamba_type=kind,
        mamba_cache_mode=cc.mamba_cache_mode,
        num_prefill_checkpoint_blocks=1 if mamba2 else 0,
        prefill_checkpoint_alignment=1 if mamba2 else None,
    )


def layer_specs(
    hf_config: Any, block_size: int, sliding_window: Optional[int] = None, vc: Any = None
):
    """Each layer's KV cache spec, as vLLM's `Attention` and `MambaBase`
    build it for this config (float32, the tiny models' 2 KV heads of 16
    dims)."""
    specs: Dict[str, Any] = {}
    for i, window in enumerate(layer_types(hf_config, sliding_window)):
        if window == MAMBA:
            specs[layer_name(i)] = mamba_spec(vc, block_size)
        elif window is None:
            specs[layer_name(i)] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
            )
        else:
            specs[layer_name(i)] = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=HEADS,
                head_size=HEAD,
                dtype=torch.float32,
                sliding_window=window,
            )
    return specs


class Engine:
    """One engine: a scheduler and `tp` workers sharing one process (as
    vLLM's own connector tests do); the roles still share nothing but the
    connector metadata."""

    def __init__(
        self,
        model: Path,
        socket: str,
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        max_batched: int = 64,
        async_scheduling: bool = False,
        sliding_window: Optional[int] = None,
        tp: int = 1,
        extra: Optional[Dict[str, Any]] = None,
        hash_algo: str = "sha256",
        failure_policy: str = "recompute",
        role: str = "kv_both",
        kv_events: Any = None,
        glue: bool = True,
    ):
        # vLLM's own HMA tests do this (test_hma_auto_config.py): CPU
        # platforms turn the hybrid allocator off otherwise. (One group
        # whatever the platform says when every layer is alike.)
        self._platform = patch.object(current_platform, "support_hybrid_kv_cache", lambda: True)
        self._platform.start()
        try:
            self._start(
                model,
                socket,
                block_size=block_size,
                num_blocks=num_blocks,
                max_batched=max_batched,
                async_scheduling=async_scheduling,
                sliding_window=sliding_window,
                tp=tp,
                extra=extra,
                hash_algo=hash_algo,
                failure_policy=failure_policy,
                role=role,
                kv_events=kv_events,
                glue=glue,
            )
        except BaseException:
            # A refused startup leaves nothing behind for the next test.
            if glue:
                ensure_kv_transfer_shutdown()
            self._platform.stop()
            raise

    def _start(
        self,
        model: Path,
        socket: str,
        *,
        block_size: int,
        num_blocks: int,
        max_batched: int,
        async_scheduling: bool,
        sliding_window: Optional[int],
        tp: int,
        extra: Optional[Dict[str, Any]],
        hash_algo: str,
        failure_policy: str,
        role: str,
        kv_events: Any,
        glue: bool,
    ) -> None:
        self.bs = block_size
        self.tp = tp
        self.vc, self.kcc, self.groups = build_config(
            model,
            socket,
            block_size=block_size,
            num_blocks=num_blocks,
            max_batched=max_batched,
            async_scheduling=async_scheduling,
            sliding_window=sliding_window,
            tp=tp,
            extra=extra,
            hash_algo=hash_algo,
            failure_policy=failure_policy,
            role=role,
            kv_events=kv_events,
        )
        self.layers = [name for g in self.groups for name in g.layer_names]
        self.layers.sort(key=lambda name: int(name.split(".")[2]))
        #: Recurrent groups (vLLM's index) -> their state bytes per block.
        self.mamba = {
            gi: int(g.kv_cache_spec.real_page_size_bytes)
            for gi, g in enumerate(self.groups)
            if isinstance(g.kv_cache_spec, MambaSpec)
        }
        self.vc.cache_config.num_gpu_blocks = self.kcc.num_blocks
        sched_cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = sched_cls(
            vllm_config=self.vc,
            kv_cache_config=self.kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=block_size,
        )
        tp_group = MagicMock()
        tp_group.broadcast_object.side_effect = lambda v, src=0: v
        # Worker 0 through vLLM's own path: the global agent and the glue.
        # (`glue=False`: a second engine in the process, whose worker 0 is
        # driven as the other ranks are: vLLM keeps one global agent.)
        if glue:
            with (
                patch("vllm.distributed.parallel_state.get_tp_group", return_value=tp_group),
                patch("orbitkv.vllm.connector._tp_rank", return_value=0),
            ):
                ensure_kv_transfer_initialized(self.vc, self.kcc)
        self.kv: List[Dict[str, torch.Tensor]] = []
        with set_current_vllm_config(self.vc):
            for _ in range(tp):
                self.kv.append(
                    allocate_kv_cache(
                        self.kcc,
                        torch.device("cpu"),
                        KVCacheLayout.LBNHC,
                        [block_size] * len(self.groups),
                    )
                )
        self.wipe()
        if glue:
            self.glue = get_kv_connector(self.vc, self.kv[0])
            self.workers = [get_kv_transfer_group()]
        else:
            self.glue = None
            self.workers = []
        for rank in range(len(self.workers), tp):
            with patch("orbitkv.vllm.connector._tp_rank", return_value=rank):
                w = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, self.kcc)
            w.register_kv_caches(self.kv[rank])
            self.workers.append(w)
        self.connector = self.sched.connector
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.forward_hook: Optional[Callable[[Any], None]] = None
        # load_mode "layerwise": the forward waits for each layer's load
        # before computing it, as attention layers do; `layer_hook(so,
        # layer)` runs right after each wait.
        self.layerwise = (extra or {}).get("load_mode") == "layerwise"
        self.layer_hook: Optional[Callable[[Any, str], None]] = None
        self.layer_waits: List[str] = []
        self.steps = 0
        self.preemptions = 0
        self.finished: List[str] = []
        self.aggregator = KVOutputAggregator(tp)
        #: rank -> a condition: while it holds, that rank's non-empty
        #: connector outputs are held back from the aggregator (a rank
        #: whose load finishes later than another's), then delivered.
        self.hold: Dict[int, Callable[[], bool]] = {}
        self._held: Dict[int, List[KVConnectorOutput]] = {}
        #: rank -> every non-empty connector output it produced, in order.
        self.produced: Dict[int, List[KVConnectorOutput]] = {}
        #: (step, aggregated output) of every step that reported anything.
        self.reports: List[tuple] = []
        #: request id -> the `kv_transfer_params` vLLM returned when it
        #: finished (P/D: the prefill engine's handoff).
        self.transfer_params: Dict[str, Any] = {}
        #: request id -> tokens the engine computed for it (scheduled
        #: tokens, summed over steps).
        self.computed: Dict[str, int] = {}

    # requests

    def add(
        self,
        rid: str,
        prompt: Sequence[int],
        max_tokens: int = 3,
        kv_transfer_params: Optional[Dict[str, Any]] = None,
    ) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if kv_transfer_params is not None:
            # How vLLM's OpenAI server hands them to the engine.
            sp.extra_args = {"kv_transfer_params": kv_transfer_params}
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.sched.add_request(req)
        return req

    # one engine step, as EngineCore + the model runner do it

    def _forward(self, so: Any, rank: int, only: Optional[str] = None) -> None:
        kv = self.kv[rank]
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            blocks = self.sched.kv_cache_manager.get_blocks(rid).blocks
            for gi, g in enumerate(self.groups):
                if gi in self.mamba:
                    self._recur(kv, rid, req, blocks[gi], g, self.mamba[gi], start, n, only)
                    continue
                for pos in range(start, min(start + n, len(req.all_token_ids))):
                    blk = blocks[gi][pos // self.bs]
                    assert not blk.is_null, f"{rid}: computing position {pos} into a null block"
                    for layer in g.layer_names:
                        if only is not None and layer != only:
                            continue
                        li = self.layers.index(layer)
                        kv[layer][blk.block_id, :, pos % self.bs, :] = value(
                            li, req.all_token_ids[pos], pos
                        )

    def _recur(self, kv, rid, req, blocks, g, nbytes: int, start: int, n: int, only) -> None:
        """A recurrent layer's step in align mode: the state after `start`
        tokens is where vLLM keeps it (block `(start - 1) // bs`, as
        `preprocess_mamba` reads it) and must be that prefix's; the state
        after the step goes into the running block `cdiv(end, bs) - 1`."""
        end = min(start + n, len(req.all_token_ids))
        if end <= start:
            return
        tokens = req.all_token_ids
        cur = blocks[(end + self.bs - 1) // self.bs - 1]
        assert not cur.is_null, f"{rid}: its running state block is the null block"
        for layer in g.layer_names:
            if only is not None and layer != only:
                continue
            li = self.layers.index(layer)
            t = kv[layer]
            if start > 0:
                prev = blocks[(start - 1) // self.bs]
                assert not prev.is_null, f"{rid}: resumes at {start} from the null block ({layer})"
                got = state_view(t, prev.block_id, nbytes)
                want = state(li, tokens[:start], nbytes // 4)
                if not bool((got == want).all()):
                    raise AssertionError(
                        f"{rid} {layer}: the state it resumes from at {start} tokens (block "
                        f"{prev.block_id}) is {got[:2].tolist()}, want {want[:2].tolist()}"
                    )
            state_view(t, cur.block_id, nbytes).copy_(state(li, tokens[:end], nbytes // 4))
            # A layer that exports a block-boundary state from inside its
            # prefill (Mamba2: `num_prefill_checkpoint_blocks`) writes it
            # into the block the scheduler reserved, as the model runner's
            # `compute_mamba_prefill_checkpoints` places it.
            ckpt = self._checkpoint(rid, g)
            if ckpt is not None and start < ckpt[0] < end:
                position, idx = ckpt
                blk = blocks[idx]
                assert not blk.is_null, f"{rid}: its checkpoint block is the null block"
                state_view(t, blk.block_id, nbytes).copy_(state(li, tokens[:position], nbytes // 4))

    def _checkpoint(self, rid: str, g: Any):
        """(position, block column) of the prefill checkpoint the scheduler
        reserved for `rid` in group `g` this step, if any."""
        gi = self.groups.index(g)
        mgr = self.sched.kv_cache_manager.coordinator.single_type_managers[gi]
        return getattr(mgr, "_checkpoints", {}).get(rid)

    def step(self) -> Any:
        so = self.sched.schedule()
        self.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] = self.computed.get(rid, 0) + n
        outputs = []
        if self.glue is not None:
            # Worker 0: the model runner's glue around the forward.
            self.glue.pre_forward(so)
            with set_forward_context(None, self.vc):
                if self.layerwise:
                    for layer in self.layers:
                        self.workers[0].wait_for_layer_load(layer)
                        self.layer_waits.append(layer)
                        if self.layer_hook is not None:
                            self.layer_hook(so, layer)
                        self._forward(so, 0, only=layer)
                else:
                    self._forward(so, 0)
                if self.forward_hook is not None:
                    self.forward_hook(so)
            self.glue.finish_forward()
            outputs.append(self.glue.post_forward(so.finished_req_ids))
        # Other ranks: the same calls, in the same order.
        for rank in range(1 if self.glue is not None else 0, self.tp):
            w = self.workers[rank]
            meta = so.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            self._forward(so, rank)
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
            )
            w.clear_connector_metadata()
            outputs.append(out)
        kvo = self._aggregate(outputs)
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            # A chunk that ends inside the prompt samples nothing.
            sampled_token_ids=[
                [7]
                if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens
                else []
                for r in ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kvo,
        )
        engine_out = self.sched.update_from_output(so, out)
        for outs in engine_out.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
                    self.transfer_params[o.request_id] = o.kv_transfer_params
        self.steps += 1
        self.check_running()
        return so

    def run(self, limit_s: float = 60.0, until: Optional[Callable[[], bool]] = None) -> None:
        """Steps until every request is done and every delayed free came
        back (or `until()` holds); fails after `limit_s` seconds. Steps that
        schedule nothing (requests waiting for a load) pause 1 ms."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if until is not None and until():
                return
            if until is None and not self.sched.requests:
                return
            so = self.step()
            if not so.total_num_scheduled_tokens:
                time.sleep(0.001)
        raise AssertionError(f"no progress in {limit_s}s: {list(self.sched.requests)}")

    # the oracle

    def check_running(self) -> None:
        """Every computed position of every running request holds exactly
        the stand-in's value, on every rank, in every non-null block."""
        for req in self.sched.running:
            blocks = self.sched.kv_cache_manager.get_blocks(req.request_id).blocks
            upto = min(req.num_computed_tokens, len(req.all_token_ids))
            for rank in range(self.tp):
                for gi, g in enumerate(self.groups):
                    if gi in self.mamba:
                        if upto == 0:
                            continue
                        blk = blocks[gi][(upto + self.bs - 1) // self.bs - 1]
                        for layer in g.layer_names:
                            li = self.layers.index(layer)
                            got = state_view(self.kv[rank][layer], blk.block_id, self.mamba[gi])
                            want = state(li, req.all_token_ids[:upto], self.mamba[gi] // 4)
                            if not bool((got == want).all()):
                                raise AssertionError(
                                    f"{req.request_id} rank {rank} {layer}: the state after "
                                    f"{upto} tokens (block {blk.block_id}) is {got[:2].tolist()}"
                                )
                        continue
                    for layer in g.layer_names:
                        li = self.layers.index(layer)
                        t = self.kv[rank][layer]
                        for pos in range(upto):
                            blk = blocks[gi][pos // self.bs]
                            if blk.is_null:
                                continue
                            got = t[blk.block_id, :, pos % self.bs, :]
                            want = value(li, req.all_token_ids[pos], pos)
                            if not bool((got == want).all()):
                                raise AssertionError(
                                    f"{req.request_id} rank {rank} {layer} position {pos} "
                                    f"(block {blk.block_id}) holds {got.flatten()[:4].tolist()}, "
                                    f"want {want}"
                                )

    def check_null_block(self) -> None:
        """No byte was ever written into vLLM's null block (block 0, the
        stand-in for pages a sliding window dropped, and for the states
        align mode does not keep)."""
        null = self.sched.kv_cache_manager.block_pool.null_block.block_id
        for rank in range(self.tp):
            for layer, t in self.kv[rank].items():
                got = t[null]
                want = self._wiped[rank][layer]
                assert bool((got == want).all()), f"rank {rank} {layer}: null block written"

    def _aggregate(self, outputs: List[Optional[KVConnectorOutput]]) -> KVConnectorOutput:
        """vLLM's `KVOutputAggregator` over the workers' outputs, after
        holding back the outputs of the ranks in `hold`."""
        now = []
        for rank, o in enumerate(outputs):
            o = o or KVConnectorOutput()
            if not o.is_empty():
                self.produced.setdefault(rank, []).append(o)
            held = self._held.setdefault(rank, [])
            when = self.hold.get(rank)
            if when is not None and when():
                if not o.is_empty():
                    held.append(o)
                o = KVConnectorOutput()
            else:
                for late in held:
                    o = _merge(late, o)
                held.clear()
            now.append(o)
        wrapped = [
            ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                sampled_token_ids=[],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=o,
            )
            for o in now
        ]
        out = self.aggregator.aggregate(wrapped, 0).kv_connector_output
        if out.finished_recving or out.invalid_block_ids or out.failed_recving:
            self.reports.append((self.steps, out))
        return out

    def wipe(self) -> None:
        """Forgets every KV byte (after reset_prefix_cache): what is not
        loaded or computed again reads as -1. (Layers of different groups
        share their memory in vLLM's hybrid allocation, each group in its
        own blocks, so the last fill is what every view of block 0 keeps:
        remembered for `check_null_block`.)"""
        for kv in self.kv:
            for t in kv.values():
                t.fill_(-1.0)
        self._wiped = [{name: t[0].clone() for name, t in kv.items()} for kv in self.kv]

    @property
    def stats(self):
        return self.connector.scheduler.stats

    def close(self) -> None:
        for w in self.workers[1 if self.glue is not None else 0 :]:
            w.shutdown()
        if self.glue is not None:
            ensure_kv_transfer_shutdown()
        self.connector.shutdown()
        self._platform.stop()


def _merge(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    """One rank's two outputs as one (a late one joining a later step)."""

    def union(x, y):
        return (set(x or ()) | set(y or ())) or None

    return KVConnectorOutput(
        finished_sending=union(a.finished_sending, b.finished_sending),
        finished_recving=union(a.finished_recving, b.finished_recving),
        invalid_block_ids=set(a.invalid_block_ids) | set(b.invalid_block_ids),
        failed_recving=set(a.failed_recving) | set(b.failed_recving),
    )


@contextlib.contextmanager
def engine(*args, **kwargs):
    e = Engine(*args, **kwargs)
    try:
        yield e
    finally:
        e.close()
