"""Tiny random-weight transformers models built from configs (no hub), and
the live references the parity tests compare OrbitKV restores against.

Every model keeps fp32 weights with ``initializer_range=0.2``, so a missing,
stale or zeroed piece of state moves the logits measurably; every forward
passes explicit ``position_ids``.
"""

from __future__ import annotations

import copy
import signal
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import orbitkv
from orbitkv.transformers import Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PAGE = 16
VOCAB = 256
PROMPT_A = 96  # published: six whole pages
PROMPT_B = 120  # shares A's 96 tokens, then 24 of its own
#: The smallest |Δlogit| a wrong state must produce for a control to count.
MEASURABLE = 1e-3

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=1024,
)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)

#: name -> config. Mistral's window (40: 39 past tokens, three pages) is
#: shorter than every prompt; the hybrids mix attention with Gated DeltaNet
#: (Qwen3Next), parallel Mamba2 (FalconH1), Mamba2 layers (Bamba) and
#: Mamba2 + shared-attention hybrid layers (Zamba2).
CONFIGS: Dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **_COMMON),
    "mistral": lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=40, **_COMMON),
    "qwen3next": lambda: transformers.Qwen3NextConfig(
        num_hidden_layers=4,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_COMMON,
    ),
    "falconh1": lambda: transformers.FalconH1Config(num_hidden_layers=2, mamba_d_ssm=128, **_MAMBA, **_COMMON),
    "bamba": lambda: transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[1, 3], **_MAMBA, **_COMMON),
    "zamba2": lambda: transformers.Zamba2Config(
        num_hidden_layers=4,
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        n_mamba_heads=4,
        mamba_d_state=16,
        chunk_size=16,
        **_COMMON,
    ),
}
MODELS = list(CONFIGS)
HYBRIDS = ["qwen3next", "falconh1", "bamba", "zamba2"]

#: Seconds one test may run (the whole suite takes about two minutes on two
#: cores).
TEST_LIMIT_S = 300


@pytest.fixture(autouse=True)
def time_limit():
    """Fails a test that runs past TEST_LIMIT_S, so teardown still runs."""

    def expired(signum, frame):
        raise TimeoutError(f"test ran past {TEST_LIMIT_S}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


#: (test, model) -> {"boundary": int, "max_abs_dlogit": float, ...}; printed
#: at the end of the session.
RESULTS: Dict[Tuple[str, str], Dict] = {}


def record(test: str, model: str, **values) -> None:
    RESULTS[(test, model)] = values


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("orbitkv model parity")
    for (test, model), values in sorted(RESULTS.items()):
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        tr.write_line(f"{test:<34} {model:<10} {shown}")


def build(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """(name, seed) -> (model, model_dir); each built and saved once."""
    cache: Dict[Tuple[str, int], Tuple[transformers.PreTrainedModel, Path]] = {}

    def get(name: str, seed: int = 0):
        if (name, seed) not in cache:
            model = build(name, seed)
            d = tmp_path_factory.mktemp(f"{name}-{seed}")
            model.save_pretrained(d)
            cache[(name, seed)] = (model, d)
        return cache[(name, seed)]

    return get


def runtime_config(**overrides) -> Dict:
    config = {
        "dram": {"capacity_bytes": 32 << 20, "extent_bytes": 1 << 20, "first_touch": False},
        "check_invariants": True,
    }
    config.update(overrides)
    return config


@pytest.fixture
def rt():
    r = orbitkv.Runtime(runtime_config())
    yield r
    r.check_invariants()


def prompts(seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prompt A (published) and prompt B (A plus its own tail)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, VOCAB, (1, PROMPT_A), generator=g)
    b = torch.cat([a, torch.randint(0, VOCAB, (1, PROMPT_B - PROMPT_A), generator=g)], dim=1)
    return a, b


class Live:
    """The live caches of one prefill of prompt A, as the store runs it,
    captured after every forward pass (deep copies of transformers' own
    cache objects: nothing here goes through OrbitKV's bytes)."""

    def __init__(self, store: Store, ids: torch.Tensor, *, publish: bool):
        self.after: Dict[int, DynamicCache] = {}
        self.logits, self.staged = store.prefill(
            ids, publish=publish, on_chunk=lambda end, cache: self.after.__setitem__(end, copy.deepcopy(cache))
        )

    def at(self, boundary: int) -> DynamicCache:
        """The live state after `boundary` tokens: the pass that ended
        there, or (a one-pass prefill of a full-attention model) the final
        cache cropped to it."""
        if boundary in self.after:
            return copy.deepcopy(self.after[boundary])
        last = max(self.after)
        assert boundary < last, (boundary, sorted(self.after))
        cache = copy.deepcopy(self.after[last])
        cache.crop(boundary - last)
        assert cache.get_seq_length() == boundary
        return cache


def continue_logits(model, cache: DynamicCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of every token of ``ids[:, start:]`` continuing ``cache``."""
    pos = torch.arange(start, ids.shape[1])[None]
    with torch.no_grad():
        return model(input_ids=ids[:, start:], position_ids=pos, cache=cache, use_cache=True).logits


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, with any non-finite difference counted as infinite."""
    d = (a.double() - b.double()).abs()
    d[~torch.isfinite(d)] = float("inf")
    return d.max().item()


def zero_recurrent(cache: DynamicCache) -> DynamicCache:
    """The cache with every conv and recurrent state zeroed (state that was
    never restored)."""
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            for t in states.values():
                if t is not None:
                    t.zero_()
    return cache


def swap_recurrent(cache: DynamicCache, donor: DynamicCache) -> DynamicCache:
    """``cache`` with the conv and recurrent states of ``donor`` (a
    checkpoint of another boundary)."""
    cache = copy.deepcopy(cache)
    for layer, other in zip(cache.layers, donor.layers):
        for name in ("conv_states", "recurrent_states"):
            mine, theirs = getattr(layer, name, {}), getattr(other, name, {})
            for i, t in mine.items():
                if t is not None:
                    t.copy_(theirs[i])
    return cache


def cast_cache(cache: DynamicCache, dtype: torch.dtype) -> DynamicCache:
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                setattr(layer, name, t.to(dtype))
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, {})
            for i, t in list(states.items()):
                if t is not None:
                    states[i] = t.to(dtype)
    return cache
