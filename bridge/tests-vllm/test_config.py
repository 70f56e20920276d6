"""What the connector refuses at startup (fail closed, naming the setting),
and what changes the computation identity. No manager is needed: these
fail before any connection."""

from __future__ import annotations

import shutil
from unittest.mock import MagicMock

import orbitkv
import orbitkv.vllm as ov
import pytest
import torch
from harness import LAYERS, build_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

SOCKET = "/nonexistent/orbitkv.sock"


def spec_of(model, **kw):
    vc, kcc, _ = build_config(model, SOCKET, **kw)
    settings = ov.ConnectorSettings.from_extra_config(
        vc.kv_transfer_config.kv_connector_extra_config
    )
    return ov.resolve_engine(vc, kcc, settings)


def refused(model, match, mutate=None, **kw):
    vc, kcc, _ = build_config(model, SOCKET, **kw)
    if mutate is not None:
        kcc = mutate(vc, kcc) or kcc
    with pytest.raises((ov.ConfigError, orbitkv.IdentityError), match=match):
        ov.OrbitKVConnector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_unknown_extra_config_key_is_named(model):
    refused(model, "unknown kv_connector_extra_config key.*'sockett'", extra={"sockett": "/x"})
    refused(model, "staging_pages must be a int", extra={"staging_pages": "many"})
    refused(model, "timeout_s must be > 0", extra={"timeout_s": 0})
    refused(model, "lookup_spin_us must be in 0..=10000, got 10001", extra={"lookup_spin_us": 10001})
    refused(model, "lookup_spin_us must be in 0..=10000, got -1", extra={"lookup_spin_us": -1})
    refused(model, "lookup_batch must be in 1..=32, got 0", extra={"lookup_batch": 0})
    refused(model, "lookup_batch must be in 1..=32, got 33", extra={"lookup_batch": 33})
    refused(
        model,
        "lookup_batch_max_age_us must be in 1..=1000000, got 0",
        extra={"lookup_batch_max_age_us": 0},
    )


def test_load_mode_is_checked(model):
    refused(model, "load_mode must be one of 'async', 'layerwise', got 'eager'", extra={"load_mode": "eager"})
    refused(model, "load_mode 'layerwise' needs copy_agent", extra={"load_mode": "layerwise", "copy_agent": False})
    refused(model, "load_mode 'layerwise' needs a single KV cache group", extra={"load_mode": "layerwise"}, sliding_window=32)


def test_failure_policy_must_recompute(model):
    refused(model, "kv_load_failure_policy", failure_policy="fail")


def test_non_collision_resistant_hash_is_refused(model):
    refused(model, "prefix_caching_hash_algo = 'xxhash'", hash_algo="xxhash")


def test_layout_that_splits_blocks_is_refused(model):
    def lhbnc(vc, kcc):
        kcc.kv_cache_layout = "LHBNC"

    refused(model, "KV cache layout LHBNC", mutate=lhbnc)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("lora_config", MagicMock(), "LoRA is enabled"),
        ("speculative_config", MagicMock(), "speculative decoding"),
    ],
)
def test_unsupported_features_are_named(model, field, value, match):
    def set_field(vc, kcc):
        object.__setattr__(vc, field, value)

    refused(model, match, mutate=set_field)


def test_pipeline_parallel_is_refused(model):
    def pp2(vc, kcc):
        vc.parallel_config.pipeline_parallel_size = 2

    refused(model, "pipeline_parallel_size = 2", mutate=pp2)


def test_unpinned_hub_model_is_refused(model, monkeypatch):
    monkeypatch.delenv("ORBITKV_MODEL_FINGERPRINT", raising=False)

    def hub(vc, kcc):
        vc.model_config.model = "some-org/some-model"
        vc.model_config.revision = "main"

    refused(model, "hub id without a pinned commit", mutate=hub)


def test_adapter_directory_fails_closed(model, tmp_path):
    lora = tmp_path / "lora"
    shutil.copytree(model, lora)
    (lora / "adapter_config.json").write_text("{}")
    refused(lora, "adapter")


def _groups_with(spec):
    def swap(vc, kcc):
        return KVCacheConfig(
            num_blocks=kcc.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )

    return swap


def test_unknown_group_kinds_are_refused(model):
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, attention_chunk_size=64
    )
    refused(
        model,
        "ChunkedLocalAttentionSpec, which OrbitKV has no recovery rule",
        mutate=_groups_with(chunked),
    )
    # A Mamba group outside align mode keeps no state at page boundaries;
    # speculative state slots are not supported. (Align mode is accepted:
    # test_recurrent.py.)
    for mode in ("none", "all"):
        mamba = MambaSpec(
            block_size=16, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode=mode
        )
        refused(model, f"mamba_cache_mode={mode!r}", mutate=_groups_with(mamba))
    spec_mamba = MambaSpec(
        block_size=16,
        shapes=((4, 4),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=2,
    )
    refused(model, "speculative state blocks", mutate=_groups_with(spec_mamba))


def test_identity_inputs(models, monkeypatch):
    monkeypatch.delenv("ORBITKV_CACHE_SCOPE", raising=False)
    a = spec_of(models["a"])
    assert spec_of(models["a"]).identity == a.identity  # deterministic
    assert spec_of(models["b"]).identity != a.identity  # weights
    assert spec_of(models["a"], block_size=32).identity != a.identity
    assert spec_of(models["a"], tp=2).identity != a.identity
    assert spec_of(models["a"], hash_algo="sha256_cbor").identity != a.identity
    assert spec_of(models["a"], layout="LBHNC").identity != a.identity
    assert spec_of(models["a"], sliding_window=32).identity != a.identity
    monkeypatch.setenv("ORBITKV_CACHE_SCOPE", "tenant-7")
    assert spec_of(models["a"]).identity != a.identity
    # The instance name follows the identity: other computations never
    # share (or conflict over) an instance.
    assert a.instance == f"vllm-{a.identity[:16]}"


def test_groups_and_layout(model):
    spec = spec_of(model, sliding_window=32, tp=2)
    reg = spec.description
    assert [g["rule"] for g in reg.groups] == ["prefix", {"window": 31}]
    assert [g["components"] for g in reg.groups] == [["attention_kv"], ["sliding_window_kv"]]
    assert reg.ranks == [{"tp": 0, "pp": 0}, {"tp": 1, "pp": 0}]
    # One slot per (layer, rank); a block of one layer is H*N*C bytes.
    assert len(reg.layout["slots"]) == 4
    slot = reg.layout["slots"][0]
    assert slot["segment_bytes"] == 2 * 16 * 2 * 16 * 4
    assert slot["layout"] == "LBNHC" and slot["page_tokens"] == 16
    # [H, N, C] byte strides in LBNHC: N outer, then H, then C.
    assert slot["strides"] == [128, 256, 1]
