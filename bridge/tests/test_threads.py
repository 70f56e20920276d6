"""Smoke test: the runtime may be driven from several Python threads (calls
are serialized inside), and its work runs without the GIL."""

from __future__ import annotations

import threading

import orbitkv
from conftest import DENSE, IDENTITY_A, Engine, small_config


def test_concurrent_calls_from_threads():
    rt = orbitkv.Runtime(small_config(), simulated_clock=True)
    Engine(rt).register("llama", IDENTITY_A, DENSE)
    errors = []

    def worker(k):
        try:
            for _ in range(200):
                rt.submit({"command": "open_session", "instance": "llama"})
                rt.tick()
                rt.stats()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rt.tick()
    assert rt.stats()["sessions"] == 800
    rt.check_invariants()
