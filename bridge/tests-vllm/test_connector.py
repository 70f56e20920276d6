"""`OrbitKVConnector` with the real vLLM 0.33 classes on CPU against a real
`orbitkv serve` (see harness.py for what is real and what stands in)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.config import KVTransferConfig

import orbitkv.vllm as ov
from harness import Engine, engine

PROMPT = [10 + i for i in range(70)]


def no_leaks(manager) -> None:
    """Nothing the connector took is still held in the manager."""
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)
    manager.wait_metric("operations", 0)


def produce_then_consume(e: Engine, prompt, tail=(99, 98), expect_hit=None):
    """Request A computes and saves; the local prefix cache is reset and the
    KV wiped; request B (same prefix) must load it from OrbitKV."""
    e.add("A", prompt)
    e.run()
    assert e.sched.reset_prefix_cache()
    e.wipe()
    before = e.stats.hit_tokens
    e.add("B", list(prompt) + list(tail))
    e.run()
    got = e.stats.hit_tokens - before
    if expect_hit is not None:
        assert got == expect_hit, (got, e.stats)
    return got


def test_factory_loads_both_roles(model, manager):
    kvt = KVTransferConfig(
        kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.vllm", kv_role="kv_both"
    )
    cls = KVConnectorFactory.get_connector_class(kvt)
    assert cls is ov.OrbitKVConnector
    assert issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA)
    assert supports_hma(cls)
    with engine(model, manager.socket) as e:
        assert isinstance(e.connector, ov.OrbitKVConnector)
        assert e.connector.role == KVConnectorRole.SCHEDULER
        assert isinstance(e.workers[0], ov.OrbitKVConnector)
        assert e.workers[0].role == KVConnectorRole.WORKER
        assert e.connector.spec.identity == e.workers[0].spec.identity
        assert e.connector.spec.register_command == e.workers[0].spec.register_command


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_round_trip(model, manager, async_scheduling):
    with engine(model, manager.socket, async_scheduling=async_scheduling) as e:
        # 70 prompt tokens, 16-token pages: B (72 tokens) may load 4 pages.
        hit = produce_then_consume(e, PROMPT)
        assert hit == 64, e.stats
        w = e.workers[0].worker.stats
        assert w.pages_loaded == 4 and w.loads_failed == 0, w
        assert w.pages_published >= 4, w
    no_leaks(manager)


def test_chunked_prefill(model, manager):
    # 16 tokens per step: A's 100-token prompt prefills over 7 steps, saving
    # each page the step it completes; B loads all 6 full pages below 101.
    with engine(model, manager.socket, max_batched=16) as e:
        prompt = [20 + (i % 300) for i in range(100)]
        hit = produce_then_consume(e, prompt, tail=(5,))
        assert hit == 96, e.stats
        assert e.workers[0].worker.stats.pages_loaded == 6
    no_leaks(manager)


def test_local_hit_loads_only_the_tail(model, manager):
    # B's first 2 pages are still in vLLM's prefix cache: OrbitKV loads from
    # there (the origin), never over blocks vLLM already holds.
    with engine(model, manager.socket) as e:
        e.add("A", PROMPT)
        e.run()
        e.add("B", PROMPT[:32] + [7] * 10)  # keeps pages 0-1 cached locally
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        e.add("C", PROMPT[:32])  # recomputed: pages 0-1 locally cached again
        e.run()
        before = e.stats.hit_tokens
        e.add("D", PROMPT + [99])
        e.run()
        assert e.stats.hit_tokens - before == 32, e.stats  # pages 2-3 from OrbitKV
    no_leaks(manager)


def test_preemption(model, manager):
    # 12 blocks of 16 tokens for two requests that grow to 100 tokens each:
    # one is preempted in decode. Its saves are fenced before its blocks
    # are reused, it resumes (loading its own saved pages), and every page it
    # saved, decode pages included, holds exactly what was computed.
    with engine(model, manager.socket, num_blocks=12, max_batched=32) as e:
        p1 = [30 + i for i in range(40)]
        p2 = [200 + i for i in range(40)]
        e.add("A", p1, max_tokens=60)
        e.add("B", p2, max_tokens=60)
        e.run()
        assert e.preemptions > 0, "the test needs a preemption"
        assert e.sched.reset_prefix_cache()
        e.wipe()
        before = e.stats.hit_tokens
        # The stand-in samples token 7: A's sequence is p1 + [7] * 60.
        e.add("C", p1 + [7] * 50 + [1])
        e.run()
        e.add("D", p2 + [7] * 50 + [1])
        e.run()
        assert e.stats.hit_tokens - before == 2 * 80, e.stats
    no_leaks(manager)


def test_sliding_window_group(model, manager):
    # HMA on: a full-attention group and a 32-token sliding-window group.
    # The window group stores every page; a load restores the full prefix
    # and only the window's pages (31 past tokens: 2 pages) of the other.
    with engine(model, manager.socket, sliding_window=32) as e:
        assert not e.vc.scheduler_config.disable_hybrid_kv_cache_manager
        assert len(e.kcc.kv_cache_groups) == 2
        groups = e.connector.spec.register_command["groups"]
        assert groups[1]["rule"] == {"window": 31}
        hit = produce_then_consume(e, PROMPT)
        assert hit == 64, e.stats
        # 4 full-attention pages + the 2 window pages before the boundary.
        assert e.workers[0].worker.stats.pages_loaded == 6
    no_leaks(manager)


def test_other_weights_never_hit(models, manager):
    with engine(models["a"], manager.socket) as e:
        e.add("A", PROMPT)
        e.run()
        ida = e.connector.spec.identity
    with engine(models["b"], manager.socket) as e:
        assert e.connector.spec.identity != ida
        e.add("B", PROMPT + [1, 2])
        e.run()
        assert e.stats.hit_tokens == 0, e.stats
        assert e.stats.misses_by_reason.get("not_found", 0) >= 1, e.stats
    no_leaks(manager)


def test_tensor_parallel_missing_page_takes_the_intersection(model, manager):
    # TP=2: rank 1 never stores page 2 of A, so only pages 0-1 are legal on
    # both ranks: B loads 32 tokens on each rank, computes the rest.
    with engine(model, manager.socket, tp=2) as e:
        w1 = e.workers[1].worker
        real = w1._gather

        def drop_page_2(save):
            return real(ov.SaveSpec(save.req_id, [it for it in save.items if it.page != 2]))

        w1._gather = drop_page_2
        hit = produce_then_consume(e, PROMPT)
        assert hit == 32, e.stats
        assert e.workers[0].worker.stats.pages_loaded == 2
        assert w1.stats.pages_loaded == 2
    no_leaks(manager)
