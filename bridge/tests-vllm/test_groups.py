"""Real model configs through vLLM's own KV cache grouping
(`get_kv_cache_groups`): whatever order vLLM gives its groups (a model
whose first layer is sliding has the sliding group first), the
full-attention group is storage group 0 and each sliding-window group has
its own, and a prefix stored by one request is loaded by the next, byte
for byte (the harness's oracle checks every block after every step), with
nothing written into vLLM's null block."""

from __future__ import annotations

import orbitkv.vllm as ov
import pytest
from harness import engine
from test_connector import no_leaks, produce_then_consume
from tiny_models import make_hybrid

# family -> (vLLM's kinds in its group order, sliding groups)
FAMILIES = {
    "gemma2": (["SlidingWindowSpec", "FullAttentionSpec"], 1),
    "gpt_oss": (["SlidingWindowSpec", "FullAttentionSpec"], 1),
    "qwen2": (["FullAttentionSpec", "SlidingWindowSpec"], 1),
    "gemma3": (["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"], 5),
}

PROMPT = [10 + (i * 7) % 400 for i in range(140)]


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_hybrid(root / family, family)
        return made[family]

    return get


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_grouping_maps_full_attention_to_group_zero(
    hybrid, manager, family, async_scheduling
):
    kinds, sliding = FAMILIES[family]
    with engine(hybrid(family), manager.socket, num_blocks=256, async_scheduling=async_scheduling) as e:
        got = [type(g.kv_cache_spec).__name__ for g in e.kcc.kv_cache_groups]
        assert got == kinds, got
        spec = e.connector.spec
        full = kinds.index("FullAttentionSpec")
        assert [g.id for g in spec.groups] == list(range(len(kinds)))
        assert spec.groups[0].kind == "full" and spec.groups[0].vllm_group == full
        assert sorted(g.vllm_group for g in spec.groups) == list(range(len(kinds)))
        reg = spec.description
        assert [g["rule"] for g in reg.groups] == ["prefix"] + [{"window": 31}] * sliding
        # Every slot names the storage group of its layer's vLLM group.
        by_layer = {
            name: g.id for g in spec.groups for name in (lp.name for lp in g.layers)
        }
        for vg in e.kcc.kv_cache_groups:
            ids = {by_layer[name] for name in vg.layer_names}
            assert len(ids) == 1, (vg.layer_names, ids)
        # The worker derives the same mapping on its own.
        assert e.workers[0].spec.description == reg

        # B (142 tokens) loads 128 (8 pages below its last token): every
        # full-attention page, and in each sliding group only the 2 pages
        # of its window (31 past tokens); the rest are vLLM's null block.
        hit = produce_then_consume(e, PROMPT, tail=(99, 98), expect_hit=128)
        assert hit == 128
        w = e.workers[0].worker.stats
        assert w.pages_loaded == 8 + 2 * sliding and w.loads_failed == 0, w
        e.check_null_block()
    no_leaks(manager)


def test_storage_group_ids():
    from orbitkv.vllm.engine import storage_group_ids

    sw = "sliding_window"
    assert storage_group_ids([(sw, 31), ("full", 0)]) == [1, 0]
    assert storage_group_ids([("full", 0), (sw, 31)]) == [0, 1]
    assert storage_group_ids([(sw, 31)] * 5 + [("full", 0)]) == [1, 2, 3, 4, 5, 0]
    # Windows in order of size, then vLLM's order: not the layers' order.
    assert storage_group_ids([(sw, 63), (sw, 31), ("full", 0), (sw, 31)]) == [3, 1, 0, 2]
    # No full attention: the first window group leads.
    assert storage_group_ids([(sw, 31)]) == [0]
    with pytest.raises(ov.ConfigError, match="full-attention layers into 2 KV cache groups"):
        storage_group_ids([("full", 0), (sw, 31), ("full", 0)])


def test_the_mapping_is_part_of_the_identity(hybrid):
    # A group's vLLM index and storage id are in the representation the
    # identity covers: the same layers mapped differently never share a
    # namespace.
    from harness import build_config

    vc, kcc, _ = build_config(hybrid("gemma2"), "/nonexistent.sock")
    settings = ov.ConnectorSettings.from_extra_config({"socket": "/nonexistent.sock"})
    spec = ov.resolve_engine(vc, kcc, settings)
    assert [(g.id, g.vllm_group, g.kind) for g in spec.groups] == [
        (0, 1, "full"),
        (1, 0, "sliding_window"),
    ]
    swapped = type(kcc)(
        num_blocks=kcc.num_blocks,
        kv_cache_tensors=kcc.kv_cache_tensors,
        kv_cache_groups=list(reversed(kcc.kv_cache_groups)),
    )
    other = ov.resolve_engine(vc, swapped, settings)
    assert [(g.id, g.vllm_group) for g in other.groups] == [(0, 0), (1, 1)]
    assert other.identity != spec.identity
