"""The embedded runtime's copy agent: engine memory (numpy arrays here, as
KV tensors would be) registered as agent-owned regions; the runtime never
maps it, the in-process agent copies on its instruction."""

from __future__ import annotations

import ctypes.util

import numpy as np
import pytest

import orbitkv
from conftest import DENSE, IDENTITY_A, PAGE, PAGE_BYTES, Engine, native_hash

K_RUN, K_STRIDE = 1024, 2048

# Where a CUDA driver is installed, a host pointer offered as CUDA memory is
# refused by the CUDA engine's allocation check instead (ValueError).
HAS_LIBCUDA = ctypes.util.find_library("cuda") is not None
CUDA_REFUSAL = (orbitkv.CudaUnavailable, ValueError) if HAS_LIBCUDA else orbitkv.CudaUnavailable
CUDA_REASON = "cuda" if HAS_LIBCUDA else "libcuda"
V_RUN = PAGE_BYTES - K_RUN
SLOTS = 8


class KvMemory:
    """A page split in two runs: K (1 KiB every 2 KiB) and V (3 KiB back to back)."""

    def __init__(self):
        self.k = np.full(K_STRIDE * SLOTS, 0xEE, dtype=np.uint8)
        self.v = np.full(V_RUN * SLOTS, 0xEE, dtype=np.uint8)

    def chunks(self):
        return [
            (self.k.ctypes.data, K_STRIDE, K_RUN),
            (self.v.ctypes.data, V_RUN, V_RUN),
        ]

    def write(self, slot: int, page: bytes):
        a = np.frombuffer(page, dtype=np.uint8)
        self.k[slot * K_STRIDE : slot * K_STRIDE + K_RUN] = a[:K_RUN]
        self.v[slot * V_RUN : (slot + 1) * V_RUN] = a[K_RUN:]

    def read(self, slot: int) -> bytes:
        k = self.k[slot * K_STRIDE : slot * K_STRIDE + K_RUN]
        v = self.v[slot * V_RUN : (slot + 1) * V_RUN]
        return k.tobytes() + v.tobytes()


def payload(seed: int, i: int) -> bytes:
    return np.random.default_rng([seed, i, 9]).integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()


def agent_region(eng: Engine, s, mem: KvMemory):
    region, page_bytes = eng.rt.attach_agent_memory(SLOTS, mem.chunks(), mem)
    assert page_bytes == PAGE_BYTES
    e = eng.call(
        {
            "command": "register_device_region",
            "session": s,
            "rank": 0,
            "group": 0,
            "slots": SLOTS,
            "agent": {"region": region, "page_bytes": page_bytes},
        }
    )
    assert e["event"] == "region_registered", e
    assert e["engine_region"] == region
    return e["region"], region


def test_publish_and_restore_run_in_the_agent_exact_bytes(any_rt):
    rt = any_rt
    eng = Engine(rt)
    eng.register("m", IDENTITY_A, DENSE)
    s = eng.open("m")
    mem = KvMemory()
    region, agent_id = agent_region(eng, s, mem)
    pages = [eng.alloc(s, region, slot) for slot in range(SLOTS)]
    n = 3
    for i in range(n):
        mem.write(i, payload(5, i))
    rt.submit(
        {
            "command": "publish",
            "session": s,
            "request": 1,
            "pages": [
                {"rank": 0, "group": 0, "hash": native_hash(5, 0, i), "device_page": pages[i]}
                for i in range(n)
            ],
        }
    )
    done = eng.until("publish", lambda e: e["event"] == "publish_done")
    assert (done["inserted"], done["dropped"]) == (n, 0), done
    assert not any(e["event"] == "agent_copy" for e in eng.events), "copy events are the agent's"

    rt.submit(
        {
            "command": "query",
            "session": s,
            "request": 2,
            "groups": [{"group": 0, "hashes": [native_hash(5, 0, i) for i in range(n)]}],
            "origin": 0,
            "prompt_len": n * PAGE + 1,
            "prepare": True,
        }
    )
    q = eng.until("query", lambda e: e["event"] == "query_result")
    ready = eng.until("ready", lambda e: e["event"] in ("ready", "miss"))
    assert ready["event"] == "ready", ready
    targets = [
        {"pos": {"rank": 0, "group": 0, "page_end": (i + 1) * PAGE}, "device_page": pages[4 + i]}
        for i in range(n)
    ]
    rt.submit(
        {"command": "restore", "session": s, "operation": q["operation"], "targets": targets, "retained": []}
    )
    done = eng.until("restore", lambda e: e["event"] in ("restore_done", "miss"))
    assert done["event"] == "restore_done", done
    for i in range(n):
        assert mem.read(4 + i) == payload(5, i), i
    assert mem.read(3) == bytes([0xEE]) * PAGE_BYTES
    stats = rt.stats()
    assert (stats["operations"], stats["leases"], stats["transfers"], stats["bytes_reserved"]) == (0, 0, 0, 0)
    assert stats["metrics"]["agent_copies"] == 2
    rt.check_invariants()

    # Once its session is closed, the memory can be let go.
    rt.submit({"command": "close_session", "session": s})
    eng.until("closed", lambda e: e["event"] == "session_closed")
    assert rt.detach_agent_memory(agent_id) is True
    assert rt.detach_agent_memory(agent_id) is False


def test_agent_memory_errors(sim_rt):
    eng = Engine(sim_rt)
    eng.register("m", IDENTITY_A, DENSE)
    s = eng.open("m")
    buf = np.zeros(PAGE_BYTES * 4, dtype=np.uint8)
    chunk = [(buf.ctypes.data, PAGE_BYTES, PAGE_BYTES)]
    # CUDA memory needs the CUDA copy engine: without a driver a typed
    # refusal naming the reason, never a host memcpy on the pointer.
    with pytest.raises(CUDA_REFUSAL, match=CUDA_REASON):
        sim_rt.attach_agent_memory(4, chunk, buf, device="cuda:0")
    for bad in ("gpu", "cuda", "cuda:-1", "cuda:x", "CPU"):
        with pytest.raises(ValueError, match="cuda:N"):
            sim_rt.attach_agent_memory(4, chunk, buf, device=bad)
    with pytest.raises(ValueError, match="stride"):
        sim_rt.attach_agent_memory(4, [(buf.ctypes.data, 16, PAGE_BYTES)], buf)
    with pytest.raises(ValueError, match="chunk"):
        sim_rt.attach_agent_memory(4, [], buf)
    # Pages laid out at another size than the group's: refused by the runtime.
    region, page_bytes = sim_rt.attach_agent_memory(8, [(buf.ctypes.data, PAGE_BYTES // 2, PAGE_BYTES // 2)], buf)
    e = eng.call(
        {
            "command": "register_device_region",
            "session": s,
            "rank": 0,
            "group": 0,
            "slots": 8,
            "agent": {"region": region, "page_bytes": page_bytes},
        }
    )
    assert e["event"] == "rejected" and e["error"]["error"] == "invalid", e
    # A report for a copy that was never sent.
    e = eng.call({"command": "copy_done", "copy": 77})
    assert e["event"] == "rejected" and e["error"] == {"error": "unknown_copy", "detail": 77}, e
    assert sim_rt.detach_agent_memory(region) is True
