"""P/D handoff with the real vLLM 0.33 classes: a prefill engine
(`kv_producer`) and a decode engine (`kv_consumer`) in one process, each
with its own scheduler, worker and session, against one real `orbitkv
serve` (harness.py says what is real). The decode engine gets the prefill
engine's `kv_transfer_params`, as vLLM's OpenAI server and a P/D proxy pass
them."""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import time
import uuid
from typing import Optional

import pytest
import serve_support as ss
from harness import HEAD, HEADS, Engine
from orbitkv.vllm import handoff as pd
from orbitkv.vllm.worker import WorkerSide, _IoState

PROMPT = [10 + i for i in range(70)]  # 4 whole pages of 16 below the last token


def counter(manager, name: str, outcome: str, want: Optional[int] = None) -> int:
    """`orbitkv_<name>_total{outcome}`; with `want`, waits (bounded) until
    /metrics, refreshed every 100 ms, shows it."""
    deadline = time.monotonic() + 10
    while True:
        m = re.search(rf'^orbitkv_{name}_total\{{outcome="{outcome}"\}} (\d+)$', manager.metrics_text(), re.M)
        got = int(m.group(1)) if m else 0
        if want is None or got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def no_leaks(manager) -> None:
    for name in ("leases", "bytes_reserved", "operations", "handoffs_standing", "handoff_reserved_bytes"):
        manager.wait_metric(name, 0)


class Gate:
    """Holds a worker's publishes back (its I/O thread waits at the gate)
    until `open()`; `drop()` makes them vanish, as a producer killed before
    it sent them."""

    def __init__(self, monkeypatch, worker) -> None:
        self.opened = threading.Event()
        self.dropped = False
        self.waiting = 0
        real = _IoState.start_publish
        gate = self

        def start_publish(io, job):
            if io.w is worker:
                gate.waiting += 1
                gate.opened.wait(30)
                if gate.dropped:
                    return
            real(io, job)

        monkeypatch.setattr(_IoState, "start_publish", start_publish)

    def open(self) -> None:
        self.opened.set()

    def drop(self) -> None:
        self.dropped = True
        self.opened.set()


class Clock:
    """When the prefill engine's last publish was answered (its pages
    landed) and when the decode engine's load ended: the handoff's latency
    is the difference."""

    def __init__(self, monkeypatch) -> None:
        self.published = 0.0
        self.loaded = 0.0
        done, finish = WorkerSide._publish_done, WorkerSide._finish_load
        clock = self

        def publish_done(w, *a, **kw):
            clock.published = time.monotonic()
            return done(w, *a, **kw)

        def finish_load(w, *a, **kw):
            clock.loaded = time.monotonic()
            return finish(w, *a, **kw)

        monkeypatch.setattr(WorkerSide, "_publish_done", publish_done)
        monkeypatch.setattr(WorkerSide, "_finish_load", finish_load)

    def ms(self) -> float:
        return (self.loaded - self.published) * 1000


def prefill(p: Engine, rid: str, prompt) -> dict:
    """The proxy's first step: the prompt with max_tokens=1 and
    `do_remote_decode`; returns the params vLLM returned."""
    p.add(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run(until=lambda: rid in p.finished)
    params = p.transfer_params[rid]
    assert params is not None and pd.KEY in params, params
    return params


def both(p: Engine, d: Engine, until, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not until():
        assert time.monotonic() < deadline, (list(p.sched.requests), list(d.sched.requests))
        so_p = p.step() if p.sched.requests else None
        so_d = d.step()
        if not so_d.total_num_scheduled_tokens and (so_p is None or not so_p.total_num_scheduled_tokens):
            time.sleep(0.001)


#: A prefill engine whose saves land after its response: staged copies
#: (the copy agent's saves land within the step that computed them, before
#: vLLM answers, so on one host there is nothing to wait for), held back
#: by a `Gate`.
LATE = {"copy_agent": False}


@contextlib.contextmanager
def engines(model, socket, consumer: Optional[dict] = None, tp: int = 1, producer: Optional[dict] = None, **kw):
    extra = {"handoff_pin_ms": 20_000, **(producer or {})}
    p = Engine(model, socket, role="kv_producer", tp=tp, extra=extra, **kw)
    try:
        extra = {"handoff_wait_s": 20.0, **(consumer or {})}
        d = Engine(model, socket, role="kv_consumer", glue=False, tp=tp, extra=extra, **kw)
    except BaseException:
        p.close()
        raise
    try:
        yield p, d
    finally:
        d.close()
        p.close()


@pytest.fixture
def pair(model, manager):
    with engines(model, manager.socket) as e:
        yield e


@pytest.mark.parametrize(
    "consumer,tp",
    [({}, 1), ({"lookup_wait": False}, 1), ({}, 2)],
    ids=["lookup_wait", "lookup_sent_without_waiting", "tp2"],
)
def test_the_decode_engine_waits_for_the_promised_pages_then_loads_exactly_them(
    model, manager, monkeypatch, consumer, tp
):
    with engines(model, manager.socket, consumer, tp, producer=LATE) as (p, d):
        wait_then_load(p, d, manager, monkeypatch, tp)


def wait_then_load(p, d, manager, monkeypatch, tp):
    gate = Gate(monkeypatch, p.workers[0].worker)
    clock = Clock(monkeypatch)
    params = prefill(p, "P", PROMPT)
    h = params[pd.KEY]
    assert h["tokens"] == 64 and len(h["hashes"]) == 4 and h["pinned"], h
    assert h["namespaces"] == d.connector.scheduler.namespaces() or d.connector.scheduler.namespaces() is None
    assert gate.waiting >= 1  # the prefill's pages are still on their way
    # The decode request arrives first: it waits in vLLM's waiting queue,
    # holding no blocks, computing nothing.
    d.add("D", PROMPT, max_tokens=3, kv_transfer_params=params)
    for _ in range(50):
        d.step()
    assert d.computed.get("D", 0) == 0
    assert d.stats.handoffs_taken == 0 and d.stats.hits == 0
    assert "D" in [r.request_id for r in d.sched.waiting]
    # The pages land: the decode engine loads the four pages, computes only
    # the 6 tokens after them, and the oracle checks every byte it attends.
    gate.open()
    both(p, d, lambda: "D" in d.finished)
    s = d.stats
    assert (s.handoffs_taken, s.hits, s.hit_tokens) == (1, 1, 64), s
    assert d.computed["D"] == 70 - 64 + 2, d.computed  # the rest of the prompt, then 2 decode steps
    for rank in range(tp):
        w = d.workers[rank].worker.stats
        assert w.pages_loaded == 4 and w.loads_failed == 0, (rank, w)
    assert not s.misses_by_reason, s.misses_by_reason
    assert p.stats.handoffs_promised == 1
    print(f"\nhandoff on one host: last publish landed -> load done in {clock.ms():.1f} ms")
    # The promise ended when the load took the pages: nothing is left
    # pinned, leased or reserved.
    p.run()
    no_leaks(manager)
    assert counter(manager, "handoffs", "held", 1) == 1
    assert counter(manager, "handoffs", "taken", 1) == 1
    assert counter(manager, "handoffs", "expired", 0) == 0


def test_pages_already_stored_are_handed_over_at_once(pair, manager):
    p, d = pair
    params = prefill(p, "P", PROMPT)
    p.run()  # the saves landed before the decode request arrives
    d.add("D", PROMPT, max_tokens=2, kv_transfer_params=params)
    d.run()
    s = d.stats
    assert (s.handoffs_taken, s.hit_tokens) == (1, 64), s
    no_leaks(manager)
    assert counter(manager, "handoffs", "taken", 1) == 1


def test_a_producer_that_died_before_publishing_ends_in_a_timeout_and_a_recompute(model, manager, monkeypatch):
    p = Engine(model, manager.socket, role="kv_producer", extra={"handoff_pin_ms": 1500, **LATE})
    try:
        d = Engine(model, manager.socket, role="kv_consumer", glue=False, extra={"handoff_wait_s": 1.0})
        try:
            gate = Gate(monkeypatch, p.workers[0].worker)
            params = prefill(p, "P", PROMPT)
            # The producer dies with its publishes unsent.
            gate.drop()
            p.close()
            t0 = time.monotonic()
            d.add("D", PROMPT, max_tokens=2, kv_transfer_params=params)
            d.run(limit_s=30)
            waited = time.monotonic() - t0
            s = d.stats
            assert s.misses_by_reason.get("handoff_timeout") == 1, s
            assert (s.handoffs_taken, s.hit_tokens) == (0, 0), s
            assert d.computed["D"] == 70 + 1  # the whole prompt, recomputed
            assert 1.0 <= waited < 10.0, waited
            # The promise expires at its own deadline; nothing leaks.
            no_leaks(manager)
            assert counter(manager, "handoffs", "expired", 1) == 1
        finally:
            d.close()
    finally:
        if p.connector is not None:
            try:
                p.close()
            except Exception:
                pass


def test_a_handoff_from_another_prompt_or_hash_seed_is_refused_and_logged(pair, manager, caplog):
    p, d = pair
    params = prefill(p, "P", PROMPT)
    p.run()
    # The same params on another prompt: its block hashes differ.
    other = [11 + i for i in range(70)]
    d.add("D", other, max_tokens=2, kv_transfer_params=params)
    with caplog.at_level("ERROR", logger="orbitkv.vllm"):
        d.run()
    s = d.stats
    assert s.misses_by_reason.get("handoff_mismatch") == 1, s
    assert s.handoffs_taken == 0 and s.hit_tokens == 0
    assert any("block hashes differ" in r.getMessage() for r in caplog.records)
    # Malformed params: a miss with its reason, never an exception in vLLM.
    bad = {pd.KEY: {"id": "zz", "tokens": 16}}
    d.add("E", PROMPT, max_tokens=2, kv_transfer_params=bad)
    d.run()
    assert d.stats.misses_by_reason.get("handoff_malformed") == 1
    # Only the unused promise's pins are left.
    manager.wait_metric("handoffs_standing", 1)
    manager.wait_metric("handoff_pinned_pages", 4)
    manager.wait_metric("leases", 4)
    manager.wait_metric("bytes_reserved", 0)


def test_a_plain_request_to_the_producer_promises_nothing(pair, manager):
    p, _ = pair
    p.add("X", PROMPT, max_tokens=1)
    p.run()
    assert p.transfer_params["X"] is None
    assert p.stats.handoffs_promised == 0
    no_leaks(manager)


def test_across_hosts_the_decode_engine_reads_the_promised_pages_from_the_remote_tier(
    model, orbitkv_bin, tmp_path, monkeypatch
):
    """Two managers (two hosts) sharing the run's Redis Cluster: the prefill
    engine's pages are written through to it, and the decode engine, on
    the other manager, waits until its manager sees them there."""
    urls = ss.redis_cluster("pd across hosts")
    if urls is None:
        pytest.skip("ORBITKV_TEST_REDIS_CLUSTER is unset (scripts/redis.sh start)")
    prefix = f"pd-{uuid.uuid4().hex[:8]}:"
    config = ss.remote_config(urls, prefix, tmp_path / "mac.key")
    a = ss.Manager(orbitkv_bin, dram="64MiB", config=config)
    b = ss.Manager(orbitkv_bin, dram="64MiB", config=config)
    try:
        a.start()
        b.start()
        p = Engine(model, a.socket, role="kv_producer", extra={"handoff_pin_ms": 4000, **LATE})
        try:
            d = Engine(model, b.socket, role="kv_consumer", glue=False, extra={"handoff_wait_s": 20.0})
            try:
                gate = Gate(monkeypatch, p.workers[0].worker)
                clock = Clock(monkeypatch)
                params = prefill(p, "P", PROMPT)
                d.add("D", PROMPT, max_tokens=3, kv_transfer_params=params)
                for _ in range(30):
                    d.step()
                assert d.computed.get("D", 0) == 0 and d.stats.hits == 0
                gate.open()
                both(p, d, lambda: "D" in d.finished)
                s = d.stats
                assert (s.handoffs_taken, s.hit_tokens) == (1, 64), s
                assert d.computed["D"] == 70 - 64 + 2
                assert d.workers[0].worker.stats.pages_loaded == 4
                print(f"\nhandoff across hosts (remote tier): last publish landed -> load done in {clock.ms():.1f} ms")
                # Manager B read the four pages from the remote tier.
                want = 4 * 16 * 2 * HEADS * HEAD * 4 * 2  # 4 pages of 2 layers, K and V, float32
                deadline = time.monotonic() + 10  # /metrics is refreshed every 100 ms
                while True:
                    read = re.search(r'^orbitkv_tier_read_bytes_total\{tier="remote"\} (\d+)$', b.metrics_text(), re.M)
                    if (read and int(read.group(1)) >= want) or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                assert read and int(read.group(1)) >= want, read
                p.run()
                for name in ("leases", "bytes_reserved", "operations", "handoffs_standing"):
                    b.wait_metric(name, 0)
                # The promise pinned A's copies, which nobody takes there:
                # they stay pinned until its deadline (handoff_pin_ms).
                assert counter(a, "handoffs", "held", 1) == 1
                for name in ("leases", "bytes_reserved", "operations", "handoffs_standing"):
                    a.wait_metric(name, 0, timeout=15)
                assert counter(a, "handoffs", "expired", 1) == 1
            finally:
                d.close()
        finally:
            p.close()
    finally:
        for m in (a, b):
            m.stop()
            shutil.rmtree(m.dir, ignore_errors=True)


def test_a_refused_pin_is_logged_and_the_pages_are_handed_over_unpinned(model, orbitkv_bin, caplog):
    m = ss.Manager(orbitkv_bin, dram="64MiB", config=ss.CONFIG + "[budget]\nhandoff_bytes = 4096\n")
    try:
        m.start()
        with engines(model, m.socket) as (p, d):
            with caplog.at_level("ERROR", logger="orbitkv.vllm"):
                params = prefill(p, "P", PROMPT)
            h = params[pd.KEY]
            assert h["pinned"] is False and h["tokens"] == 64, h
            assert p.stats.refusals_by_reason == {"limit_handoff_bytes": 1}, p.stats
            assert any("refused to pin" in r.getMessage() for r in caplog.records)
            # Unpinned, but there: the decode engine takes them all the same.
            d.add("D", PROMPT, max_tokens=2, kv_transfer_params=params)
            both(p, d, lambda: "D" in d.finished)
            assert (d.stats.handoffs_taken, d.stats.hit_tokens) == (1, 64), d.stats
            p.run()
            line = 'orbitkv_refusals_total{command="hold",reason="limit_handoff_bytes"} 1'
            deadline = time.monotonic() + 10
            while line not in (text := m.metrics_text()):  # refreshed every 100 ms
                assert time.monotonic() < deadline, text
                time.sleep(0.05)
        no_leaks(m)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_gemma_style_model_hands_over_its_full_and_sliding_window_pages(tmp_path, manager, monkeypatch):
    """vLLM puts Gemma 2's sliding group first; the handoff promises every
    group's pages and the decode engine waits until the contract's
    boundary (full attention up to it, the window's pages before it) is
    restorable: it loads 128 of 140 tokens, 8 full-attention pages and the
    2 sliding pages of the window."""
    from tiny_models import make_hybrid

    model = make_hybrid(tmp_path / "gemma2", "gemma2")
    prompt = [10 + (i * 7) % 400 for i in range(140)]
    with engines(model, manager.socket, producer=LATE, num_blocks=256) as (p, d):
        gate = Gate(monkeypatch, p.workers[0].worker)
        params = prefill(p, "P", prompt)
        assert params[pd.KEY]["tokens"] == 128
        d.add("D", prompt, max_tokens=2, kv_transfer_params=params)
        for _ in range(30):
            d.step()
        assert d.computed.get("D", 0) == 0
        gate.open()
        both(p, d, lambda: "D" in d.finished)
        s = d.stats
        assert (s.handoffs_taken, s.hit_tokens) == (1, 128), s
        w = d.workers[0].worker.stats
        assert w.pages_loaded == 8 + 2 and w.loads_failed == 0, w
        p.run()
    no_leaks(manager)


def test_an_aborted_prefill_promises_nothing(pair, manager):
    from vllm.v1.request import RequestStatus

    p, _ = pair
    p.add("A", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.step()  # 64 of 70 prompt tokens computed (and saved)
    p.sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    p.run()
    assert p.stats.handoffs_promised == 0
    assert counter(manager, "handoffs", "held", 0) == 0
    no_leaks(manager)
