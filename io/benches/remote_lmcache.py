"""LMCache's Redis backend (lmcache 0.5.6 `RedisConnector`) on the same server
and with the same page sizes, operation counts and concurrency as
`io/benches/remote.rs`, which runs this script and puts the numbers beside
its own. Prints one JSON document.

The connector is driven as LMCache drives it: a `LocalCPUBackend` (CPU
memory objects) and an asyncio loop on its own thread; `put` stores the
chunk and its metadata (two SETs), `get` reads the metadata, allocates a
memory object and reads the bytes into it (two GETs). A chunk is one page:
KV shape (1 layer, K/V, 256 tokens, H heads, 64) in bfloat16, H chosen so
the chunk is exactly `--page-bytes`.
"""

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--latency-ops", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    logging.disable(logging.WARNING)
    unit = 2 * 256 * 64 * 2  # K/V x tokens x head_size x bf16
    if a.page_bytes % unit:
        sys.exit(f"page bytes must be a multiple of {unit}")
    heads = a.page_bytes // unit
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=max(1.0, 4 * a.concurrency * a.page_bytes / 2**30),
        remote_url=a.url,
    )
    meta = LMCacheMetadata(
        model_name="orbitkv-bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(1, 2, 256, heads, 64),
        chunk_size=256,
    )
    backend = LocalCPUBackend(cfg, meta)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    conn = RedisConnector(a.url, loop, backend)
    assert conn.full_chunk_size_bytes == a.page_bytes, conn.full_chunk_size_bytes

    sources = []
    for i in range(a.concurrency):
        m = backend.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
        view = m.byte_array if isinstance(m.byte_array, memoryview) else memoryview(m.byte_array)
        view.cast("B")[:] = os.urandom(a.page_bytes)
        sources.append(m)
    tag = time.time_ns()

    def key(kind: str, i: int) -> CacheEngineKey:
        h = hash((tag, kind, i)) & ((1 << 62) - 1)
        return CacheEngineKey("orbitkv-bench", 1, 0, h, torch.bfloat16)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def release(obj):
        if obj is not None:
            obj.ref_count_down()

    def windowed(n: int, start_op) -> float:
        """n operations, `concurrency` in flight; ops/s."""
        t0 = time.perf_counter()
        inflight = []
        i = 0
        while i < n or inflight:
            while i < n and len(inflight) < a.concurrency:
                inflight.append(start_op(i))
                i += 1
            fut = inflight.pop(0)
            release(fut.result())
        return n / (time.perf_counter() - t0)

    def pct(v, p):
        v = sorted(v)
        return v[min(len(v) - 1, round((len(v) - 1) * p))]

    def qd1(n: int, op) -> dict:
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            release(run(op(i)).result())
            lat.append((time.perf_counter() - t0) * 1e6)
        return {"p50_us": pct(lat, 0.5), "p99_us": pct(lat, 0.99)}

    w_tput = windowed(
        a.pages,
        lambda i: run(conn.put(key("t", i), sources[i % a.concurrency])),
    )
    w = qd1(a.latency_ops, lambda i: conn.put(key("l", i), sources[i % a.concurrency]))
    r_tput = windowed(a.pages, lambda i: run(conn.get(key("t", i))))
    r = qd1(a.latency_ops, lambda i: conn.get(key("t", i % a.pages)))
    # Every read found its chunk.
    got = run(conn.get(key("t", 0))).result()
    assert got is not None and bytes(got.byte_array) == bytes(sources[0].byte_array)
    release(got)
    # Leave the server as found (LMCache sets no expiry).
    import redis as redis_py

    client = redis_py.Redis.from_url(a.url)
    names = []
    for kind, n in (("t", a.pages), ("l", a.latency_ops)):
        for i in range(n):
            s = key(kind, i).to_string()
            names += [s + "kv_bytes", s + "metadata"]
    for j in range(0, len(names), 512):
        client.delete(*names[j : j + 512])
    print(
        json.dumps(
            {
                "write": {"ops_per_s": w_tput, **w},
                "read": {"ops_per_s": r_tput, **r},
                "lmcache": __import__("lmcache").__version__,
            }
        )
    )
    sys.stdout.flush()
    os._exit(0)  # the connector's loop threads do not stop on their own


if __name__ == "__main__":
    main()
