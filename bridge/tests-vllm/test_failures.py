"""Failed loads stay failed on every rank whatever the order in which vLLM's
output aggregator delivers them, a layer-wise load that failed republishes
what was recomputed, and a manager that refuses an engine says so: at
startup the engine does not start (the error names the setting); later,
every refusal is an error log, a counted reason and a line in
`orbitkv inspect`, never "unavailable"."""

from __future__ import annotations

import gc
import logging
import re
import shutil
import subprocess
import time
from unittest.mock import patch

import orbitkv
import orbitkv.vllm as ov
import pytest
import serve_support as ss
import torch
from harness import Engine, build_config, engine
from test_connector import PROMPT, hit_then_fail, no_leaks
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BOGUS_REGION = 0x7777_0000_0001


def count_offers(e: Engine):
    """Per request, how many times the scheduler offered vLLM a load."""
    sched = e.connector.scheduler
    real = e.connector.get_num_new_matched_tokens
    offers: dict = {}

    def counting(request, num_computed_tokens):
        n, is_async = real(request, num_computed_tokens)
        if n:
            offers[request.request_id] = offers.get(request.request_id, 0) + 1
        return n, is_async

    e.connector.get_num_new_matched_tokens = counting
    return offers


def reported(e: Engine, rank: int, what: str, rid: str = "B") -> bool:
    """Whether `rank` produced an output reporting `rid` finished
    (`what` = "finished") or invalid blocks (`what` = "invalid")."""
    for o in e.produced.get(rank, ()):
        if what == "finished" and rid in (o.finished_recving or ()):
            return True
        if what == "invalid" and o.invalid_block_ids:
            return True
    return False


def first_step(e: Engine, what: str, rid: str, blocks=None):
    """The first step whose aggregated output reported `rid` finished
    (`what` = "finished") or any invalid block (`what` = "invalid")."""
    for step, out in e.reports:
        if what == "finished" and rid in (out.finished_recving or ()):
            return step
        if what == "invalid" and out.invalid_block_ids:
            return step
    return None


# How the aggregator delivers rank 1's failure: steps before B's finished
# report (rank 0's report is held until rank 1's invalid blocks went
# through, and two steps more), or with it (rank 1's report is held until
# rank 0 reported B finished).
def hold_for(e: Engine, order: str) -> None:
    if order == "invalid_before_finished":
        seen: list = []

        def rank0_waits() -> bool:
            if first_step(e, "invalid", "B") is not None:
                seen.append(1)
            return len(seen) < 3

        e.hold[0] = rank0_waits
    else:
        e.hold[1] = lambda: not reported(e, 0, "finished")


ORDERS = ("invalid_before_finished", "invalid_with_finished")


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_tensor_parallel_failed_load_is_offered_once(model, manager, order):
    # TP=2: rank 1's restore is refused (its device pages name an unknown
    # region), rank 0's lands. vLLM forwards rank 1's invalid blocks at once
    # and reports B finished once both ranks have: whichever comes first,
    # B's load failed and it is never offered another one.
    with engine(model, manager.socket, tp=2) as e:
        offers = count_offers(e)
        w0, w1 = e.workers[0].worker, e.workers[1].worker

        def refuse_rank_1():
            # Right after the scheduler counted B's tokens: rank 1's load
            # will be refused, and the reports of B's load are ordered.
            w1.mover.region = lambda gid: BOGUS_REGION
            hold_for(e, order)

        promised = hit_then_fail(e, PROMPT, refuse_rank_1)
        assert promised == 64
        assert offers == {"B": 1}, offers
        assert w0.stats.pages_loaded == 4 and w0.stats.loads_failed == 0, w0.stats
        assert w1.stats.pages_loaded == 0 and w1.stats.loads_failed == 1, w1.stats
        assert e.stats.load_failures == 1, e.stats
        assert e.stats.misses_by_reason.get("load_failed_before") == 1, e.stats
        invalid, finished = first_step(e, "invalid", "B"), first_step(e, "finished", "B")
        assert invalid is not None and finished is not None, e.reports
        if order == "invalid_before_finished":
            assert invalid < finished, (invalid, finished)
        else:
            assert invalid == finished, (invalid, finished)
        assert reported(e, 0, "finished") and reported(e, 1, "invalid")
        assert "B" in e.finished
    no_leaks(manager)


@pytest.mark.parametrize("late", [0, 1], ids=["rank0_late", "rank1_late"])
def test_tensor_parallel_missing_page_loads_the_common_prefix(model, manager, late):
    # Rank 1 never stores page 2 of A: both ranks load exactly pages 0-1,
    # whichever rank reports first, and the load is offered once.
    with engine(model, manager.socket, tp=2) as e:
        offers = count_offers(e)
        w1 = e.workers[1].worker
        real = w1._gather

        def drop_page_2(save):
            return real(save.without(lambda page, group: page == 2))

        w1._gather = drop_page_2
        e.add("A", PROMPT)
        e.run()
        assert e.sched.reset_prefix_cache()
        e.wipe()
        e.hold[late] = lambda: not reported(e, 1 - late, "finished")
        e.add("B", PROMPT + [99, 98])
        e.run()
        assert e.stats.hit_tokens == 32, e.stats
        assert offers == {"B": 1}, offers
        assert e.workers[0].worker.stats.pages_loaded == 2
        assert w1.stats.pages_loaded == 2
    no_leaks(manager)


def demote_and_corrupt(e: Engine, m: ss.Manager, ssd, prompt, page: int) -> None:
    """Publishes `prompt`, pushes its pages to the SSD tier with other
    requests, then flips a byte of page `page` on disk."""
    from test_connector import page_bytes

    e.add("A", prompt)
    e.run()
    for k in range(10):  # 40 more pages push A's out of a 32-page pool
        e.add(f"F{k}", [300 + k * 17 + i for i in range(70)])
        e.run()
    want = page_bytes(e, prompt, page)
    hits = 0
    deadline = time.monotonic() + 10
    while not hits and time.monotonic() < deadline:
        for seg in sorted(ssd.glob("seg-*.okv")):
            data = bytearray(seg.read_bytes())
            at = data.find(want)
            if at >= 0:
                data[at + len(want) // 2] ^= 0xFF
                seg.write_bytes(bytes(data))
                hits += 1
        time.sleep(0.05)
    assert hits == 1, "the page should be on the SSD once"
    assert e.sched.reset_prefix_cache()
    e.wipe()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_recomputed_pages_are_published_after_a_failed_load(model, orbitkv_bin, tmp_path, mode):
    # A page of A is corrupted on the SSD: B's load fails (checksum) and B
    # recomputes. What B recomputed, and the pages it computed in its load
    # step (over a prefix that never landed: wrong in a real model, so the
    # worker drops those saves), are published as vLLM computes them again,
    # so C, the same prompt again, gets the whole prefix.
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    config = (
        f'[serve]\nidle_tick_us = 100\nssd = "{ssd}:256MiB"\n'
        "[dram]\nfirst_touch = false\nextent_bytes = 65536\n"
    )
    m = ss.Manager(orbitkv_bin, dram="256KiB", config=config)
    try:
        m.start()
        with engine(model, m.socket, extra={"load_mode": mode}) as e:
            w = e.workers[0].worker
            demote_and_corrupt(e, m, ssd, PROMPT, 1)
            # B: the 70 stored tokens and 40 more; the load step computes
            # 46 tokens past the 64 loaded (pages 4 and 5 complete in it).
            b = PROMPT + [400 + i for i in range(40)]
            e.add("B", b)
            e.run()
            assert w.stats.failures_by_reason.get("miss_checksum") == 1, w.stats
            if mode == "layerwise":
                assert w.stats.failures_by_reason.get("save_after_failed_load") == 1, w.stats
            m.wait_metric("checksum_failures_total", 1)
            assert e.sched.reset_prefix_cache()
            e.wipe()
            before = e.stats.hit_tokens
            e.add("C", b)
            e.run()
            # 110 tokens: every one of the 6 pages below the last token.
            assert e.stats.hit_tokens - before == 96, (e.stats, w.stats)
        no_leaks(m)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


# Refusals -------------------------------------------------------------------


def refusals_metric(m: ss.Manager, command: str, reason: str) -> int:
    pat = re.compile(
        r'^orbitkv_refusals_total\{(?=.*command="%s")(?=.*reason="%s").*\} (\d+)$'
        % (re.escape(command), re.escape(reason))
    )
    for line in m.metrics_text().splitlines():
        got = pat.match(line)
        if got:
            return int(got.group(1))
    return 0


def wait_refusals(m: ss.Manager, command: str, reason: str, at_least: int = 1) -> int:
    deadline = time.monotonic() + ss.T
    while (n := refusals_metric(m, command, reason)) < at_least:
        assert time.monotonic() < deadline, f"no {command}.{reason} refusal counted: {m.metrics_text()}"
        time.sleep(0.05)
    return n


def test_worker_with_an_impossible_rank_does_not_start(model, manager):
    # tp=1 but the worker believes it is rank 1: the manager refuses its
    # regions (unknown_rank), and the engine stops at startup naming the
    # setting, instead of running without a cache.
    vc, kcc, groups = build_config(model, manager.socket)
    with patch("orbitkv.vllm.connector._tp_rank", return_value=1):
        w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    with set_current_vllm_config(vc):
        kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBNHC, [16] * len(groups))
    try:
        with pytest.raises(ov.ConfigError) as err:
            w.register_kv_caches(kv)
        msg = str(err.value)
        assert "register_device_region" in msg and "unknown_rank" in msg, msg
        assert "rank 1 is outside 0..1 (parallel_config.tensor_parallel_size = 1)" in msg, msg
        assert "tensor_parallel_size" in msg, msg
    finally:
        w.shutdown()
    wait_refusals(manager, "register_device_region", "unknown_rank")


def test_contract_the_manager_refuses_stops_the_engine(model, manager, monkeypatch):
    # The manager refuses a sliding window without a past token (the client
    # check is bypassed to reach the manager's): the scheduler does not
    # start, and the error says the groups do not form a contract.
    monkeypatch.setattr(orbitkv, "vllm_window_past_tokens", lambda window: 0)
    with pytest.raises(ov.ConfigError) as err:
        Engine(model, manager.socket, sliding_window=32)
    msg = str(err.value)
    assert "register_instance" in msg and "(contract)" in msg, msg
    assert "kv_cache_groups" in msg and "at least one past token" in msg, msg
    wait_refusals(manager, "register_instance", "contract")


def test_instance_name_taken_by_another_model_stops_the_engine(models, manager):
    extra = {"instance": "shared-name"}
    with engine(models["a"], manager.socket, extra=extra):
        vc, kcc, _ = build_config(models["b"], manager.socket, extra=extra)
        with pytest.raises(ov.ConfigError, match="kv_connector_extra_config.instance 'shared-name'"):
            KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)
    wait_refusals(manager, "register_instance", "instance_conflict")


def test_a_session_quota_of_the_manager_stops_the_engine(model, orbitkv_bin):
    # The manager allows one session per process: the scheduler takes it,
    # and the worker's open_session is refused before it is queued. The
    # engine stops at startup naming the manager's setting, and the manager
    # counts the refusal. (It used to reach Python as QueueFull, "inbox
    # full", which no hook expected.)
    m = ss.Manager(
        orbitkv_bin,
        dram="64MiB",
        config="[serve]\nidle_tick_us = 100\nmax_sessions_per_process = 1\n"
        "[dram]\nfirst_touch = false\nextent_bytes = 65536\n",
    )
    m.start()
    try:
        with pytest.raises(ov.ConfigError) as err:
            with engine(model, m.socket):
                pass
        msg = str(err.value)
        assert "open_session" in msg and "limit_max_sessions_per_process" in msg, msg
        assert "raise [serve] max_sessions_per_process" in msg, msg
        wait_refusals(m, "open_session", "limit_max_sessions_per_process")
        # The traceback holds the half-built engine, whose scheduler still
        # has its connection (a real engine process exits here).
        del err
        gc.collect()
        m.wait_metric("sessions", 0)
    finally:
        m.stop()


def test_refusal_after_a_manager_restart_is_loud(model, manager, orbitkv_bin, caplog):
    # The engine starts against a manager that serves it; a manager started
    # in its place with an extent smaller than a page refuses the instance.
    # Every lookup is then a miss counted as refused (not unavailable), the
    # refusal is logged at error level with the setting to change, counted
    # by the manager by reason and shown by `orbitkv inspect`.
    caplog.set_level(logging.WARNING, logger="orbitkv.vllm")
    with engine(model, manager.socket, extra={"reconnect_interval_s": 0.05}) as e:
        e.add("A", PROMPT)
        e.run()
        manager.stop()
        small = ss.Manager(
            orbitkv_bin,
            dram="64MiB",
            config="[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nextent_bytes = 4096\n",
        )
        small.socket = manager.socket
        try:
            small.start(idle=False)
            deadline = time.monotonic() + ss.T
            k = 0
            while not e.stats.refusals_by_reason and time.monotonic() < deadline:
                assert e.sched.reset_prefix_cache()
                e.add(f"B{k}", PROMPT + [99, k])
                e.run()
                k += 1
                time.sleep(0.06)
            assert e.stats.refusals_by_reason.get("page_exceeds_extent", 0) >= 1, e.stats
            assert e.stats.misses_by_reason.get("refused", 0) >= 1, e.stats
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert errors, caplog.text
            assert "page_exceeds_extent" in errors[0].getMessage()
            assert "dram.extent_bytes" in errors[0].getMessage()
            # Never reported as unavailability.
            assert not any(
                "unavailable" in r.getMessage() and "page_exceeds_extent" in r.getMessage()
                for r in caplog.records
            ), caplog.text
            wait_refusals(small, "register_instance", "page_exceeds_extent")
            out = subprocess.run(
                [str(orbitkv_bin), "inspect", "--socket", small.socket],
                capture_output=True,
                text=True,
                timeout=ss.T,
            )
            assert out.returncode == 0, out.stderr
            assert "refused: register_instance.page_exceeds_extent" in out.stdout, out.stdout
        finally:
            small.stop()
            shutil.rmtree(small.dir, ignore_errors=True)


class _StubLink:
    """The worker's link, as `_IoState` uses it: records drops, and the
    session's cancels."""

    def __init__(self):
        self.drops: list = []
        self.cancelled: list = []
        self.up = True
        link = self

        class _Session:
            def cancel(self, ticket):
                link.cancelled.append(ticket)
                return True

        self.session = _Session()

    def drop(self, why):
        self.drops.append(why)
        self.up = False

    def get(self):
        return self.session


def _io_state():
    import threading
    from types import SimpleNamespace

    from orbitkv.vllm.worker import _IoState

    finished: list = []
    w = SimpleNamespace(
        link=_StubLink(),
        settings=SimpleNamespace(timeout_s=5.0),
        _lock=threading.Lock(),
        _connected=True,
        _finish_load=lambda spec, selected, failure: finished.append((spec.req_id, selected, failure)),
        _publish_done=lambda *a, **k: None,
    )
    return _IoState(w), w, finished


def test_a_late_load_drops_the_connection_and_never_just_cancels():
    # A `load`'s copies may start in the tick its pages are ready, before
    # the worker's I/O thread read its result: past the worker's deadline
    # the connection goes (its agent waits for running copies before vLLM
    # reuses the blocks), whether its pages were reported ready or not. A
    # late staged-copy lease (no agent writes the blocks) is only
    # cancelled.
    from orbitkv.vllm.metadata import LoadSpec
    from orbitkv.vllm.worker import _Load

    late = time.monotonic() - 1.0

    def spec(rid):
        return LoadSpec(req_id=rid, origin=0, boundary=64, hashes=[], block_ids=([],))

    # Before its pages were reported ready.
    io, w, finished = _io_state()
    io.jobs[7] = ("load", _Load(spec=spec("A"), deadline=late, load=True))
    io.expire()
    assert w.link.drops == ["an agent copy passed its deadline"], w.link.drops
    assert finished == [("A", None, "an agent copy passed its deadline")]
    assert w.link.cancelled == [] and not io.jobs

    # After: its copies are under way.
    io, w, finished = _io_state()
    io.jobs[7] = ("load", _Load(spec=spec("B"), deadline=late, load=True, restoring=True, selected=64))
    io.expire()
    assert w.link.drops == ["an agent copy passed its deadline"], w.link.drops
    assert finished == [("B", None, "an agent copy passed its deadline")]
    assert w.link.cancelled == [] and not io.jobs

    # A staged-copy lease past its deadline: cancelled, the connection kept.
    io, w, finished = _io_state()
    io.jobs[12] = ("load", _Load(spec=spec("C"), deadline=late))
    io.expire()
    assert w.link.drops == [] and w.link.cancelled == [12]
    assert finished == [("C", None, "timeout")]
