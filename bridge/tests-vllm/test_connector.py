"""`OrbitKVConnector` with the real vLLM 0.33 classes on CPU against a real
`orbitkv serve` (see harness.py for what is real and what stands in)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import orbitkv.vllm as ov
import pytest
import serve_support as ss
from harness import HEAD, HEADS, LAYERS, Engine, engine, value
from orbitkv.vllm.stats import Reporter
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.request import RequestStatus

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
        assert e.connector.spec.description == e.workers[0].spec.description


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_round_trip(model, manager, async_scheduling):
    with engine(model, manager.socket, async_scheduling=async_scheduling) as e:
        # 70 prompt tokens, 16-token pages: B (72 tokens) may load 4 pages.
        hit = produce_then_consume(e, PROMPT)
        assert hit == 64, e.stats
        w = e.workers[0].worker.stats
        assert w.pages_loaded == 4 and w.loads_failed == 0, w
        assert w.pages_published >= 4, w
        # The same counters reach vLLM's stats pipeline, as deltas (vLLM
        # took them every step; a fresh reporter sees them all).
        sched = Reporter().delta(e.stats)
        assert sched.data["hit_tokens"] == 64, sched
        assert sched.data["misses_by_reason.not_found"] == 1, sched
        work = Reporter().delta(w)
        assert work.data["pages_loaded"] == 4, work
        assert e.workers[0].get_kv_connector_stats() is None  # nothing new
        logging = KVConnectorLogging(e.vc.kv_transfer_config)
        logging.observe(work.aggregate(sched).data)
        total = logging.transfer_stats_accumulator.reduce()
        assert total["pages_loaded"] == 4 and total["hit_tokens"] == 64, total
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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_save_plans_name_the_blocks_vllm_holds(model, manager, async_scheduling):
    # Save plans read a new request's block ids from vLLM's NewRequestData
    # and a running one's from its blocks, vLLM's null block by its id.
    # Every plan must name exactly what vLLM's own blocks say at that step
    # (the null block as NULL_BLOCK), through chunked prefills, a sliding
    # window and local prefix-cache hits.
    with engine(
        model, manager.socket, sliding_window=32, max_batched=32, async_scheduling=async_scheduling
    ) as e:
        kv = e.connector.scheduler.kv_cache_manager
        null = kv.block_pool.null_block
        assert e.connector.scheduler._null_id == null.block_id
        real = e.connector.build_connector_meta
        checked = []

        def check(scheduler_output):
            meta = real(scheduler_output)
            for save in meta.saves:
                groups = kv.get_blocks(save.req_id).blocks
                for vg, column in enumerate(save.block_ids):
                    held = groups[vg][save.first : save.first + len(column)]
                    want = [ov.metadata.NULL_BLOCK if b.is_null else b.block_id for b in held]
                    want += [ov.metadata.NULL_BLOCK] * (len(column) - len(want))
                    assert column == want, (save.req_id, vg, column, want)
                    assert null.block_id not in column or null.block_id == ov.metadata.NULL_BLOCK
                checked.append(save.req_id)
            return meta

        e.connector.build_connector_meta = check
        prompt = [20 + (i % 300) for i in range(100)]
        e.add("A", prompt)  # 100 tokens in 32-token chunks
        e.run()
        e.add("B", prompt[:64] + [7] * 40)  # pages 0-3 from the local prefix cache
        e.run()
        e.connector.build_connector_meta = real
        assert {"A", "B"} <= set(checked), checked
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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_preemption(model, manager, async_scheduling):
    # 12 blocks of 16 tokens for two requests that grow to 100 tokens each:
    # one is preempted in decode. Its saves are fenced before its blocks
    # are reused, it resumes (loading its own saved pages), and every page it
    # saved, decode pages included, holds exactly what was computed.
    with engine(
        model, manager.socket, num_blocks=12, max_batched=32, async_scheduling=async_scheduling
    ) as e:
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


def test_finished_request_keeps_blocks_until_published(model, manager):
    # The manager is stopped while A's pages are being published: A finishes,
    # but vLLM keeps its blocks until the worker reports the saves answered.
    # Staged copies: saves are asynchronous there (the copy agent's wait in
    # wait_for_save is its own test).
    with engine(model, manager.socket, max_batched=16, extra={"copy_agent": False}) as e:
        e.add("A", PROMPT)
        e.step()  # the lookup (a miss) happens while the manager runs
        os.kill(manager.proc.pid, signal.SIGSTOP)
        try:
            e.run(until=lambda: "A" in e.finished)
            for _ in range(20):
                e.step()
            assert "A" in e.sched.requests, "blocks freed before the publishes landed"
            held = e.sched.kv_cache_manager.get_block_ids("A")[0]
            assert len(held) >= 4
        finally:
            os.kill(manager.proc.pid, signal.SIGCONT)
        e.run()
        assert "A" not in e.sched.requests
        assert e.workers[0].worker.stats.pages_published == 4
    no_leaks(manager)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_sliding_window_group(model, manager, async_scheduling):
    # HMA on: a full-attention group and a 32-token sliding-window group.
    # The window group stores every page; a load restores the full prefix
    # and only the window's pages (31 past tokens: 2 pages) of the other.
    with engine(model, manager.socket, sliding_window=32, async_scheduling=async_scheduling) as e:
        assert not e.vc.scheduler_config.disable_hybrid_kv_cache_manager
        assert len(e.kcc.kv_cache_groups) == 2
        groups = e.connector.spec.description.groups
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
            return real(save.without(lambda page, group: page == 2))

        w1._gather = drop_page_2
        hit = produce_then_consume(e, PROMPT)
        assert hit == 32, e.stats
        assert e.workers[0].worker.stats.pages_loaded == 2
        assert w1.stats.pages_loaded == 2
    no_leaks(manager)


def hit_then_fail(e: Engine, prompt, when_allocated):
    """Like produce_then_consume, but calls `when_allocated()` right after
    the scheduler counted B's tokens as external (before any worker load)."""
    e.add("A", prompt)
    e.run()
    assert e.sched.reset_prefix_cache()
    e.wipe()
    sched = e.connector.scheduler
    real = e.connector.update_state_after_alloc

    def hook(request, blocks, n):
        real(request, blocks, n)
        if n > 0:
            when_allocated()

    e.connector.update_state_after_alloc = hook
    before = e.stats.hit_tokens
    e.add("B", list(prompt) + [99, 98])
    e.run()
    e.connector.update_state_after_alloc = real
    return e.stats.hit_tokens - before


def test_killed_manager_recomputes_then_reconnects(model, manager):
    with engine(model, manager.socket, extra={"reconnect_interval_s": 0.05}) as e:
        w = e.workers[0].worker

        def kill():
            manager.proc.kill()
            manager.proc.wait(10)  # dead before any worker asks it

        promised = hit_then_fail(e, PROMPT, kill)
        # The scheduler counted 64 tokens; the load failed, vLLM recomputed
        # them (the oracle checked every position B attended to).
        assert promised == 64
        assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
        assert "B" in e.finished
        manager.start(idle=False)
        # The worker notices the closed socket and finds the new manager by
        # itself (the scheduler at its next lookup).
        deadline = time.monotonic() + 10
        while w.link.connects < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.link.connects == 2, w.link.last_error
        # A new manager: both roles reconnect with new sessions, save again
        # and hit again (A2 recomputes: B's blocks are dropped first).
        assert e.sched.reset_prefix_cache()
        e.add("A2", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        before = e.stats.hit_tokens
        e.add("B2", PROMPT + [99, 98])
        e.run()
        assert e.stats.hit_tokens - before == 64, e.stats
        assert w.link.connects == 2 and e.connector.scheduler.link.connects == 2
    no_leaks(manager)


def test_expired_leases_are_never_used(model, orbitkv_bin):
    # The manager expires a prepared operation after 300 ms; the worker's
    # copy takes longer. The release that ends the load is refused, so the
    # load counts as failed and B recomputes, although the copy completed.
    m = ss.Manager(
        orbitkv_bin, dram="64MiB", config=ss.CONFIG + "[limits]\nprepare_deadline_us = 300000\n"
    )
    try:
        m.start()
        with engine(model, m.socket, extra={"copy_agent": False}) as e:
            w = e.workers[0].worker
            real = w.mover.restore

            def slow(gid, pages):
                time.sleep(0.6)
                return real(gid, pages)

            w.mover.restore = slow
            promised = produce_then_consume(e, PROMPT)
            assert promised == 64
            # The manager's miss usually arrives first; the refused release
            # is the backstop when it has not.
            assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
            assert set(w.stats.failures_by_reason) <= {"miss_deadline", "lease_lost"}, w.stats
        no_leaks(m)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_staged_load_verifies_every_pool_page(model, manager):
    # Staged copies read the manager's pool themselves: each page is
    # checked against its lease's checksum before it is copied. A page
    # whose bytes do not match (here: the checksum the worker is given is
    # off by one) fails the load, and vLLM recomputes.
    with engine(model, manager.socket, extra={"copy_agent": False}) as e:
        w = e.workers[0].worker
        real = w.mover.restore
        seen = []

        def tampered(gid, pages):
            seen.extend(pages)
            return real(gid, [(o, n, b, c ^ 1) for o, n, b, c in pages])

        w.mover.restore = tampered
        promised = produce_then_consume(e, PROMPT)
        assert promised == 64 and len(seen) == 4, seen
        assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
        assert w.stats.failures_by_reason == {"copy_ConnectionError": 1}, w.stats
        assert "B" in e.finished
        w.mover.restore = real
    no_leaks(manager)


@pytest.mark.parametrize("window", [None, 32], ids=["one_group", "hybrid"])
def test_copy_error_recomputes(model, manager, window):
    # A load whose copy fails half way (garbage in the first block) is
    # reported: by block with one group, by request with two. vLLM
    # recomputes and the garbage never reaches attention (the oracle).
    with engine(model, manager.socket, sliding_window=window, extra={"copy_agent": False}) as e:
        w = e.workers[0].worker

        def broken(gid, pages):
            block = pages[0][2]
            for _, view in w.mover.blocks.layers[gid]:
                view[block].fill_(0x5A)
            raise OSError("injected copy failure")

        w.mover.restore = broken
        promised = produce_then_consume(e, PROMPT)
        assert promised == 64
        assert w.stats.loads_failed == 1, w.stats
        assert "B" in e.finished
    no_leaks(manager)


@pytest.mark.parametrize("window", [None, 32], ids=["one_group", "hybrid"])
def test_agent_restore_refused_recomputes(model, manager, window):
    # The KV blocks are agent regions; the load's device pages are refused
    # (a region handle the manager does not know): nothing is copied, the
    # load fails and vLLM recomputes (the oracle checks every byte).
    from orbitkv.vllm.copy import AgentPageMover

    with engine(model, manager.socket, sliding_window=window) as e:
        w = e.workers[0].worker
        assert isinstance(w.mover, AgentPageMover)

        def refuse():
            w.mover.region = lambda gid: 0x7777_0000_0001

        promised = hit_then_fail(e, PROMPT, refuse)
        assert promised == 64
        assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
        # B's own saves are refused the same way (dropped, never stored).
        assert "restore_alloc" in w.stats.failures_by_reason, w.stats
        assert set(w.stats.failures_by_reason) <= {"restore_alloc", "publish_alloc"}, w.stats
        assert "B" in e.finished
    no_leaks(manager)


def test_corrupt_page_on_ssd_is_a_miss(model, orbitkv_bin, tmp_path):
    # A's pages are demoted to the SSD tier (a 256 KiB pool), then one is
    # corrupted on disk. The scheduler's lookup still finds them (metadata);
    # the worker's read fails its checksum, and B recomputes.
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    config = (
        f'[serve]\nidle_tick_us = 100\nssd = "{ssd}:256MiB"\n'
        "[dram]\nfirst_touch = false\nextent_bytes = 65536\n"
    )
    m = ss.Manager(orbitkv_bin, dram="256KiB", config=config)
    try:
        m.start()
        with engine(model, m.socket, extra={"staging_pages": 8}) as e:
            e.add("A", PROMPT)
            e.run()
            assert e.workers[0].worker.stats.pages_published == 4, e.workers[0].worker.stats
            for k in range(10):  # 40 more pages push A's 4 out of 32
                e.add(f"F{k}", [300 + k * 17 + i for i in range(70)])
                e.run()
            page = page_bytes(e, PROMPT, 1)
            # Demotions are written (and synced) in the background: wait
            # for the page to be on disk, then flip one byte of it.
            hits = 0
            deadline = time.monotonic() + 10
            while not hits and time.monotonic() < deadline:
                for seg in sorted(ssd.glob("seg-*.okv")):
                    data = bytearray(seg.read_bytes())
                    at = data.find(page)
                    if at >= 0:
                        data[at + len(page) // 2] ^= 0xFF
                        seg.write_bytes(bytes(data))
                        hits += 1
                time.sleep(0.05)
            assert hits == 1, (
                "page 1 of A should be on the SSD once",
                e.workers[0].worker.stats,
                [
                    line
                    for line in m.metrics_text().splitlines()
                    if "evictions" in line or "demotions" in line
                ],
            )
            assert e.sched.reset_prefix_cache()
            e.wipe()
            w = e.workers[0].worker
            e.add("B", PROMPT + [99, 98])
            e.run()
            assert w.stats.failures_by_reason == {"miss_checksum": 1}, w.stats
            m.wait_metric("checksum_failures_total", 1)
        no_leaks(m)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def page_bytes(e: Engine, tokens, page: int) -> bytes:
    """The bytes OrbitKV stores for page `page` of `tokens` (one group):
    each layer's block, [N, H, C] in the LBNHC layout, float32."""
    import struct

    out = b""
    for li in range(len(LAYERS)):
        for pos in range(page * e.bs, (page + 1) * e.bs):
            v = value(li, tokens[pos], pos)
            out += struct.pack("<f", v) * (HEADS * 2 * HEAD)
    return out


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_role_narrows_loads_and_saves(model, manager, role):
    # A producer saves but never loads; a consumer loads but never saves.
    with engine(model, manager.socket) as e:
        e.add("A", PROMPT)
        e.run()
    with engine(model, manager.socket, role=role) as e:
        assert e.connector.settings.load == (role == "kv_consumer")
        assert e.connector.settings.save == (role == "kv_producer")
        e.add("B", PROMPT + [99, 98])
        e.run()
        assert e.stats.hit_tokens == (64 if role == "kv_consumer" else 0), e.stats
        assert e.stats.queries == (1 if role == "kv_consumer" else 0), e.stats
        published = e.workers[0].worker.stats.pages_published
        assert published == (4 if role == "kv_producer" else 0)
    no_leaks(manager)


def test_abort_while_loading(model, manager):
    # B is aborted while its load runs: vLLM holds its blocks until the
    # worker reports the load finished, then frees them; nothing leaks.
    with engine(model, manager.socket) as e:
        e.add("A", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        e.add("B", PROMPT + [99, 98])
        e.step()  # B's lookup hits; its load is planned and started
        assert e.sched.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        e.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
        assert "B" in e.sched.requests  # blocks held while the load runs
        e.run()
        assert not e.sched.requests
        assert e.workers[0].worker.stats.loads == 1
    no_leaks(manager)


LAYERWISE = {"load_mode": "layerwise"}


def test_layerwise_loads_each_layer_before_its_compute(model, manager):
    # Synchronous loads: B computes in the step its load runs; right after
    # wait_for_layer_load(layer) returns, every position B reads from that
    # layer already holds exactly what A computed (the other layer may
    # still be copying).
    with engine(model, manager.socket, extra=LAYERWISE) as e:
        checked = {layer: 0 for layer in LAYERS}

        def at_layer(so, layer):
            li = LAYERS.index(layer)
            for rid, n in so.num_scheduled_tokens.items():
                req = e.sched.requests[rid]
                start = req.num_computed_tokens - n
                blocks = e.sched.kv_cache_manager.get_blocks(rid).blocks[0]
                for pos in range(start):
                    blk = blocks[pos // e.bs]
                    got = e.kv[0][layer][blk.block_id, :, pos % e.bs, :]
                    want = value(li, req.all_token_ids[pos], pos)
                    assert bool((got == want).all()), (rid, layer, pos, got.flatten()[:4])
                    if rid == "B":
                        checked[layer] += 1

        e.layer_hook = at_layer
        hit = produce_then_consume(e, PROMPT)
        assert hit == 64, e.stats
        w = e.workers[0].worker
        assert w.stats.pages_loaded == 4 and w.stats.loads_failed == 0, w.stats
        # B's 64 loaded positions, checked in each layer right after its wait
        # (in B's load step; later steps re-check them too).
        assert all(n >= 64 for n in checked.values()), checked
        # The agent counted each layer's pages.
        counts = w.mover.layer_counts(0)
        assert [landed for landed, _ in counts] == [4, 4] and [f for _, f in counts] == [0, 0]
        # Nothing was reported as an asynchronous receive.
        assert "B" in e.finished
    no_leaks(manager)


def test_layerwise_failed_load_marks_blocks_invalid_and_recomputes(model, manager):
    # B's restore is refused (its device pages name an unknown region):
    # the layer waits return, the blocks are reported through
    # get_block_ids_with_load_errors, and vLLM recomputes them (the oracle
    # checks every position B attended to after the step).
    from orbitkv.vllm.copy import AgentPageMover

    with engine(model, manager.socket, extra=LAYERWISE) as e:
        w = e.workers[0].worker
        assert isinstance(w.mover, AgentPageMover)
        errors = []
        real = e.workers[0].get_block_ids_with_load_errors

        def spy():
            got = real()
            errors.append(set(got))
            return got

        e.workers[0].get_block_ids_with_load_errors = spy

        def refuse():
            w.mover.region = lambda gid: 0x7777_0000_0001

        promised = hit_then_fail(e, PROMPT, refuse)
        assert promised == 64
        assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
        assert "restore_alloc" in w.stats.failures_by_reason, w.stats
        # The step reported B's 4 loaded blocks invalid.
        assert [len(x) for x in errors if x] == [4], errors
        assert "B" in e.finished
    no_leaks(manager)


def test_layerwise_killed_manager_recomputes(model, manager):
    with engine(model, manager.socket, extra={**LAYERWISE, "reconnect_interval_s": 0.05}) as e:
        w = e.workers[0].worker

        def kill():
            manager.proc.kill()
            manager.proc.wait(10)

        promised = hit_then_fail(e, PROMPT, kill)
        assert promised == 64
        assert w.stats.loads_failed == 1 and w.stats.pages_loaded == 0, w.stats
        assert "B" in e.finished


def _sent(link) -> dict:
    """The commands a link's connection sent so far, by kind."""
    return dict(link.session.client.commands_sent)


def _since(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_lookup_is_one_round_trip(model, manager):
    # The scheduler's lookup of a stored prefix is one `lookup` command and
    # its answer: nothing is parked in the manager, nothing is released.
    with engine(model, manager.socket) as e:
        e.add("A", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        sched = e.connector.scheduler
        before = _sent(sched.link)
        e.add("B", PROMPT + [99, 98])
        e.run()
        assert e.stats.hit_tokens == 64, e.stats
        assert _since(before, _sent(sched.link)) == {"lookup": 1}
    no_leaks(manager)


def test_a_long_prompt_sends_only_the_pages_before_one_in_no_tier(model, manager):
    # A long prompt whose first pages are stored: the scheduler asks the
    # presence filter for a page in no tier and looks up only the pages
    # before it. The hit is the same; a thousand hashes are not sent.
    with engine(model, manager.socket, num_blocks=160, max_batched=256) as e:
        e.add("A", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        sched = e.connector.scheduler
        sent: list = []
        real = sched._hashes

        def record(session, request, pages, origin):
            got = real(session, request, pages, origin)
            sent.append((pages, len(got)))
            return got

        sched._hashes = record
        long = PROMPT + [3000 + i for i in range(1100)]
        e.add("B", long)
        e.run()
        assert e.stats.hit_tokens == 64, e.stats
        pages = (len(long) - 1) // 16
        # Pages 1 and 2 are probed and held; page 4 is B's own, in no tier.
        assert sent == [(pages, 4)], sent
        assert "B" in e.finished
    no_leaks(manager)


@pytest.mark.parametrize("max_age_us", [1_000_000, 1], ids=["fresh", "expired"])
def test_requests_that_arrived_together_are_looked_up_in_one_round_trip(model, manager, max_age_us):
    # vLLM tells the connector of each request it adds (`on_new_request`).
    # When it first asks about one, the scheduler looks up the requests
    # that arrived with it in the same round trip (`lookup_batch`), and
    # answers vLLM's later asks from there while the answers are fresh;
    # an answer past `lookup_batch_max_age_us` is looked up again.
    extra = {"lookup_batch_max_age_us": max_age_us}
    stored = [[1000 * k + i for i in range(70)] for k in (1, 2, 3)]
    # A token budget that schedules the four in one step.
    with engine(model, manager.socket, max_batched=1024, extra=extra) as e:
        for k, p in enumerate(stored):
            e.add(f"A{k}", p)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        sched = e.connector.scheduler
        batches: list = []
        real = sched._lookup_with_others

        def record(session, query):
            batches.append(len(sched._arrived))
            return real(session, query)

        sched._lookup_with_others = record
        before = _sent(sched.link)
        hits, asked = e.stats.hit_tokens, e.stats.queries
        # Three extend a stored prompt each (no two share a page, so none
        # finds another's blocks in vLLM's own cache), one is new.
        e.add("B", stored[0] + [99, 98])
        e.add("C", stored[1] + [97])
        e.add("D", [500 + i for i in range(70)])
        e.add("E", stored[2] + [96, 95, 94])
        e.run()
        assert batches[0] == 3, batches  # B asked; C, D and E taken along
        assert e.stats.hit_tokens - hits == 3 * 64, e.stats
        # vLLM asks again about a request it could not schedule yet: that
        # ask is a lookup of its own.
        # D, a new prompt, is a certain miss each time it is looked up: the
        # presence filter answers it in this process, and nothing is sent.
        asks = e.stats.queries - asked
        lookups = _since(before, _sent(sched.link))["lookup"]
        if max_age_us > 1:
            # Each ask answered by one lookup: B's carried C's, D's, E's.
            assert (len(batches), lookups) == (1, asks - 1), (batches, lookups, asks)
        else:
            # Past the age, C, D and E were looked up again, alone.
            assert lookups == asks + 3 - 2, (batches, lookups, asks)
        assert set("BCDE") <= set(e.finished)
        assert not sched._arrived
    no_leaks(manager)


def test_a_lookup_sent_without_waiting_hits_when_vllm_asks_again(model, manager):
    # lookup_wait: false: the scheduler sends the lookup and tells vLLM
    # "not yet" (None), so the real scheduler skips the request; at a later
    # step the answer is collected without waiting and the hit offered.
    # One lookup per request all the same.
    with engine(model, manager.socket, extra={"lookup_wait": False}) as e:
        e.add("A", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        sched = e.connector.scheduler
        answers: list = []
        real = e.connector.get_num_new_matched_tokens

        def record(request, n):
            if answers:
                answers.append(real(request, n))
                return answers[-1]
            # The first ask: the manager is held still, so the answer
            # cannot be back yet however fast it would be (it could be
            # already, on a quiet machine, which made this test flaky).
            os.kill(manager.proc.pid, signal.SIGSTOP)
            try:
                answers.append(real(request, n))
            finally:
                os.kill(manager.proc.pid, signal.SIGCONT)
            return answers[-1]

        e.connector.get_num_new_matched_tokens = record
        before = _sent(sched.link)
        e.add("B", PROMPT + [99, 98])
        e.run()
        e.connector.get_num_new_matched_tokens = real
        assert answers[0] == (None, False), answers
        assert answers[-1] == (64, True), answers
        assert e.stats.hit_tokens == 64, e.stats
        assert _since(before, _sent(sched.link)) == {"lookup": 1}
        assert "B" in e.finished
    no_leaks(manager)


def test_a_hit_is_two_round_trips_on_known_blocks(model, manager):
    # A hit through the scheduler and the worker is two commands, each
    # answered by one manager round: the scheduler's `lookup` and the
    # worker's `load` (query, prepare and restore in one), plus an
    # allocation only for a block the worker never used, and no frees.
    # Counted by the connections themselves (`Client.commands_sent`).
    # 12 blocks: later loads land in blocks earlier steps used.
    with engine(model, manager.socket, num_blocks=12) as e:
        w = e.workers[0].worker
        sched = e.connector.scheduler
        e.add("A", PROMPT)
        e.run()
        reused = 0
        for rid in ("B", "C", "D", "E", "F"):
            assert e.sched.reset_prefix_cache()
            e.wipe()
            loads: list = []
            real_alloc = e.connector.update_state_after_alloc

            def record(request, blocks, n, loads=loads, real_alloc=real_alloc):
                real_alloc(request, blocks, n)
                if n > 0:
                    loads.extend(b.block_id for b in blocks.blocks[0][: n // e.bs])

            e.connector.update_state_after_alloc = record
            before = e.stats.hit_tokens
            sent = (_sent(sched.link), _sent(w.link))
            held = w.link.session.device_pages_held
            e.add(rid, PROMPT + [99, 98])
            e.run()
            e.connector.update_state_after_alloc = real_alloc
            assert e.stats.hit_tokens - before == 64, e.stats
            assert len(loads) == 4, loads
            # 72 tokens: no page completes past the loaded 64, so nothing
            # is published; only blocks never used before are allocated
            # (each allocation is a new entry of the slot table).
            s_sent, w_sent = _since(sent[0], _sent(sched.link)), _since(sent[1], _sent(w.link))
            allocs = w_sent.pop("device_page_alloc", 0)
            assert (s_sent, w_sent) == ({"lookup": 1}, {"load": 1}), (s_sent, w_sent)
            assert allocs == w.link.session.device_pages_held - held, (allocs, loads)
            reused += allocs < len(loads)
        assert reused >= 1, "some load should have reused a block"
        assert w.link.session.device_pages_held <= e.kcc.num_blocks
    no_leaks(manager)
