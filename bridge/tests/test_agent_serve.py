"""Copy agents over a real `orbitkv serve`: each client's engine memory
(numpy arrays standing in for KV tensors) is an agent-owned region the
manager never maps; the copies run in the client's agent, inside its
waits, on the manager's instruction."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import orbitkv
import serve_support as ss
from serve_support import PAGE, PAGE_BYTES, T, expect, hashes, payload

from test_agent import CUDA_REASON, CUDA_REFUSAL

K_RUN, K_STRIDE = 1024, 2048
V_RUN = PAGE_BYTES - K_RUN
SLOTS = 16


class KvMemory:
    """A page in two runs: K (1 KiB every 2 KiB) and V (3 KiB back to back)."""

    def __init__(self):
        self.k = np.zeros(K_STRIDE * SLOTS, dtype=np.uint8)
        self.v = np.zeros(V_RUN * SLOTS, dtype=np.uint8)

    def chunks(self):
        return [(self.k.ctypes.data, K_STRIDE, K_RUN), (self.v.ctypes.data, V_RUN, V_RUN)]

    def write(self, slot: int, page: bytes):
        a = np.frombuffer(page, dtype=np.uint8)
        self.k[slot * K_STRIDE : slot * K_STRIDE + K_RUN] = a[:K_RUN]
        self.v[slot * V_RUN : (slot + 1) * V_RUN] = a[K_RUN:]

    def read(self, slot: int) -> bytes:
        return (
            self.k[slot * K_STRIDE : slot * K_STRIDE + K_RUN].tobytes()
            + self.v[slot * V_RUN : (slot + 1) * V_RUN].tobytes()
        )


@pytest.fixture
def manager():
    m = ss.Manager(ss.orbitkv_binary())
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def agent_region(c: orbitkv.Client, session, mem: KvMemory):
    region, page_bytes = c.attach_agent_memory(SLOTS, mem.chunks(), mem)
    e = expect(
        c.call(
            {
                "command": "register_device_region",
                "session": session,
                "rank": 0,
                "group": 0,
                "slots": SLOTS,
                "agent": {"region": region, "page_bytes": page_bytes},
            },
            T,
        ),
        "region_registered",
    )
    assert e["agent"] is True and e["engine_region"] == region, e
    return e["region"], region


def alloc(c, s, region, slot):
    return expect(
        c.call({"command": "device_page_alloc", "session": s, "region": region, "slot": slot}, T),
        "device_page_allocated",
    )["device_page"]


def test_two_engines_share_pages_through_their_agents(manager):
    n = 5
    with orbitkv.Client(manager.socket, "a") as a, orbitkv.Client(manager.socket, "b") as b:
        ss.register(a)
        sa = ss.open_session(a)
        mem_a = KvMemory()
        region_a, _ = agent_region(a, sa, mem_a)
        pages = []
        for i in range(n):
            mem_a.write(i, payload(i, 3))
            dp = alloc(a, sa, region_a, i)
            pages.append({"rank": 0, "group": 0, "hash": hashes(n, 3)[i], "device_page": dp})
        done = expect(
            a.call({"command": "publish", "session": sa, "request": 1, "pages": pages}, T),
            "publish_done",
        )
        assert (done["inserted"], done["dropped"]) == (n, 0), done

        # Engine b restores a's pages straight into its own memory.
        ss.register(b)
        sb = ss.open_session(b)
        mem_b = KvMemory()
        region_b, agent_b = agent_region(b, sb, mem_b)
        ready = ss.query_ready(b, sb, n, seed=3)
        # The pool b's agent read from is what a published.
        ss.check_pages(b, ready, seed=3)
        targets = []
        for k, lease in enumerate(ready["leases"]):
            targets.append({"pos": lease["pos"], "device_page": alloc(b, sb, region_b, 8 + k)})
        b.submit(
            {"command": "restore", "session": sb, "operation": ready["operation"], "targets": targets, "retained": []}
        )
        done = expect(b.wait_event(T, operation=ready["operation"]), "restore_done")
        assert done["pages"] == n
        for k in range(n):
            assert mem_b.read(8 + k) == payload(k, 3), k
        assert mem_b.read(7) == bytes(PAGE_BYTES), "untargeted slots untouched"
        # The copy events were the agents', never the caller's.
        assert not [e for e in a.poll_events() + b.poll_events() if e["event"] == "agent_copy"]

        b.submit({"command": "close_session", "session": sb})
        expect(b.wait_event(T, kind="session_closed"), "session_closed")
        assert b.detach_agent_memory(agent_b) is True
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)


def test_agent_copy_threads_are_a_named_bound(manager, monkeypatch):
    # ORBITKV_AGENT_COPY_WORKERS sets the copy agent's threads (default:
    # one per CPU, at most 8); a bad value refuses the attach, naming it,
    # and attaches nothing.
    buf = np.zeros(PAGE_BYTES * 4, dtype=np.uint8)
    chunk = [(buf.ctypes.data, PAGE_BYTES, PAGE_BYTES)]
    for bad in ("0", "65", "two", ""):
        monkeypatch.setenv("ORBITKV_AGENT_COPY_WORKERS", bad)
        with orbitkv.Client(manager.socket, "w") as c:
            with pytest.raises(ValueError, match="ORBITKV_AGENT_COPY_WORKERS"):
                c.attach_agent_memory(4, chunk, buf)
            assert c.detach_agent_memory(1) is False
    # Three threads move exact bytes both ways, as the default does.
    monkeypatch.setenv("ORBITKV_AGENT_COPY_WORKERS", "3")
    test_two_engines_share_pages_through_their_agents(manager)


def test_agent_memory_refusals_over_the_socket(manager):
    with orbitkv.Client(manager.socket, "c") as c:
        ss.register(c)
        s = ss.open_session(c)
        buf = np.zeros(PAGE_BYTES * 4, dtype=np.uint8)
        chunk = [(buf.ctypes.data, PAGE_BYTES, PAGE_BYTES)]
        with pytest.raises(CUDA_REFUSAL, match=CUDA_REASON):
            c.attach_agent_memory(4, chunk, buf, device="cuda:0")
        with pytest.raises(ValueError, match="cuda:N"):
            c.attach_agent_memory(4, chunk, buf, device="tpu:0")
        region, page_bytes = c.attach_agent_memory(8, [(buf.ctypes.data, 2048, 2048)], buf)
        e = c.call(
            {
                "command": "register_device_region",
                "session": s,
                "rank": 0,
                "group": 0,
                "slots": 8,
                "agent": {"region": region, "page_bytes": page_bytes},
            },
            T,
        )
        assert e["event"] == "rejected" and e["error"]["error"] == "invalid", e
        e = c.call({"command": "copy_done", "copy": 5}, T)
        assert e["event"] == "rejected" and e["error"] == {"error": "unknown_copy", "detail": 5}, e


def test_layered_agent_region_counts_each_layer(manager):
    # K runs are layer 0, V runs layer 1: a restore lands layer by layer
    # and the agent counts each layer's pages; the bytes are exact.
    n = 3
    with orbitkv.Client(manager.socket, "pub") as a, orbitkv.Client(manager.socket, "eng") as b:
        ss.publish(a, n, 5)
        ss.register(b)
        sb = ss.open_session(b)
        mem = KvMemory()
        with pytest.raises(ValueError, match="one layer per chunk"):
            b.attach_agent_memory(SLOTS, mem.chunks(), mem, layers=[0])
        agent, page_bytes = b.attach_agent_memory(SLOTS, mem.chunks(), mem, layers=[0, 1])
        assert b.agent_layer_counts(agent) == [(0, 0), (0, 0)]
        with pytest.raises(ValueError, match="no agent region"):
            b.agent_layer_counts(agent + 7)
        e = expect(
            b.call(
                {
                    "command": "register_device_region",
                    "session": sb,
                    "rank": 0,
                    "group": 0,
                    "slots": SLOTS,
                    "agent": {"region": agent, "page_bytes": page_bytes},
                },
                T,
            ),
            "region_registered",
        )
        region = e["region"]
        ready = ss.query_ready(b, sb, n, seed=5)
        targets = [
            {"pos": lease["pos"], "device_page": alloc(b, sb, region, 4 + k)}
            for k, lease in enumerate(ready["leases"])
        ]
        b.submit(
            {"command": "restore", "session": sb, "operation": ready["operation"], "targets": targets, "retained": []}
        )
        expect(b.wait_event(T, operation=ready["operation"]), "restore_done")
        assert b.agent_layer_counts(agent) == [(n, 0), (n, 0)]
        for k in range(n):
            assert mem.read(4 + k) == payload(k, 5), k
        b.submit({"command": "close_session", "session": sb})
        expect(b.wait_event(T, kind="session_closed"), "session_closed")
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)
