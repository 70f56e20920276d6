"""Save + retrieve of the same KV payloads through LMCache 0.5.6's CPU
backend and through OrbitKV, in one run, with a single-thread memcpy of the
same bytes as the floor. Prints one JSON document and a table.

The payload is the engine's KV memory: `--total` bytes in pages of
`--page-bytes` (random bytes, one host buffer per side). Both systems save
every page, then read every page back into a second buffer; every byte read
back is compared after its timing.

- LMCache: a `LocalCPUBackend` in this process, driven as LMCache's cache
  engine drives it for CPU offload: per chunk `allocate` a memory object,
  copy the chunk into it, `batched_submit_put_task`; on retrieve
  `batched_get_blocking`, then copy each object into the engine buffer. A
  chunk is `(1 layer, K/V, 256 tokens, H heads, 64)` bf16, H chosen so the
  chunk is exactly one page.
- OrbitKV: a real `orbitkv serve` (release build) and `orbitkv.Client`;
  the engine buffers are agent-owned regions (the manager never maps them;
  the client's copy agent copies on its instruction), as the vLLM and
  SGLang adapters use it. Save = `publish` in batches of `--batch` pages,
  up to `--inflight` (default 4) outstanding at once as an engine saving
  several requests has them, each checked at its `publish_done`; retrieve = one `load`
  (query, prepare and restore in one command) until `restore_done`. Checksums are always on: the publish copy
  computes each page's XXH3-64, the restore copy verifies it.

- LMCache's multi-process server (`--peers` includes `mp`; see
  `lmcache_mp.py`): its recommended deployment, a per-node process with a
  shared DRAM pool, the closest peer to `orbitkv serve`. Save = `STORE`
  requests of `--batch` chunks, timed until the pool has committed the
  last; retrieve = per request a `LOOKUP` and a `RETRIEVE`.

What is not equal, on purpose or not (printed with the results):
- OrbitKV crosses a process boundary (the manager) and LMCache does not.
- OrbitKV's save copies twice (engine memory -> the agent's staging area,
  then staging -> the shared pool, hashing in that pass: the pool is
  read-only to engines), and its restore verifies a checksum; LMCache's
  CPU backend keeps a reference to the memory object it was handed (one
  copy on save, one on retrieve) and verifies nothing.
- Device pages (the engine's block table) are allocated in OrbitKV before
  timing, as the adapters do once at startup; LMCache's allocations are
  timed, because they are per save.

Run (release builds of the manager and of the extension in the venv):

    V=$(scripts/venv.sh lmcache)
    cargo build --release --bin orbitkv
    scripts/develop.sh $V release
    $V/bin/python bridge/bench/lmcache_peer.py --total 2GiB --page-bytes 256KiB --repeat 2

Memory: the payload twice, plus about 1.25x of it for each system's pool
and, with the MP server, twice more for the KV cache it registers (2 GiB
pages need about 16 GiB).

Not a test: the figures depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bridge" / "tests"))

import numpy as np  # noqa: E402

import orbitkv  # noqa: E402
import serve_support as ss  # noqa: E402

PAGE_TOKENS = 16  # OrbitKV page tokens (the hashes are per page either way)


def size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "": 1}
    t = text.strip().upper()
    for u in ("KIB", "MIB", "GIB", ""):
        if t.endswith(u):
            return int(float(t[: len(t) - len(u)] if u else t) * units[u])
    raise argparse.ArgumentTypeError(f"not a size: {text}")


def progress(msg: str) -> None:
    print(f"[lmcache_peer] {msg}", file=sys.stderr, flush=True)


# LMCache -------------------------------------------------------------------


class Lmcache:
    """One `LocalCPUBackend`, made once: its memory is faulted in by the
    warm-up round and reused after `clear` between rounds, as a serving
    engine's would be."""

    def __init__(self, total: int, page_bytes: int):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        logging.disable(logging.WARNING)
        unit = 2 * 256 * 64 * 2  # K/V x tokens x head_size x bf16
        if page_bytes % unit:
            sys.exit(f"--page-bytes must be a multiple of {unit} for LMCache's chunk shape")
        self.shape = (1, 2, 256, page_bytes // unit, 64)
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=True,
            max_local_cpu_size=total * 1.25 / 2**30,
        )
        meta = LMCacheMetadata(
            model_name="orbitkv-peer",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=self.shape,
            chunk_size=256,
        )
        self.backend = LocalCPUBackend(cfg, meta)

    def round(self, src: np.ndarray, dst: np.ndarray, page_bytes: int, batch: int, rnd: int) -> dict:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        backend = self.backend
        pages = src.size // page_bytes
        shape = torch.Size(self.shape)
        src_t = torch.from_numpy(src).view(pages, page_bytes)
        dst_t = torch.from_numpy(dst).view(pages, page_bytes)
        keys = [CacheEngineKey("orbitkv-peer", 1, 0, (rnd << 40) + i, torch.bfloat16) for i in range(pages)]

        t0 = time.perf_counter()
        for at in range(0, pages, batch):
            idx = range(at, min(at + batch, pages))
            objs = []
            for i in idx:
                m = backend.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
                if m is None:
                    sys.exit("LMCache's CPU backend ran out of memory: raise max_local_cpu_size")
                m.tensor.view(torch.uint8).view(-1).copy_(src_t[i])
                objs.append(m)
            backend.batched_submit_put_task([keys[i] for i in idx], objs)
            for m in objs:
                m.ref_count_down()
        save = time.perf_counter() - t0

        t0 = time.perf_counter()
        for at in range(0, pages, batch):
            idx = list(range(at, min(at + batch, pages)))
            objs = backend.batched_get_blocking([keys[i] for i in idx])
            for i, m in zip(idx, objs):
                if m is None:
                    sys.exit(f"LMCache lost chunk {i}")
                dst_t[i].copy_(m.tensor.view(torch.uint8).view(-1))
                m.ref_count_down()
        retrieve = time.perf_counter() - t0
        ok = np.array_equal(src, dst)
        backend.clear()
        return {"save_s": save, "retrieve_s": retrieve, "exact": bool(ok)}

    def close(self) -> None:
        self.backend.close()


# OrbitKV -------------------------------------------------------------------


def hashes(pages: int, rnd: int) -> list:
    return [((rnd << 48) + 0x5EED0000 + i).to_bytes(8, "big") for i in range(pages)]


class OrbitKV:
    """The engine side, as every adapter has it: one `orbitkv.Session`
    for the process's life, both buffers registered once as agent regions
    (the agent copies straight between them and the manager). A session
    per round would be a new staging area per round, so a new copy-agent
    window over the pool: its first restore would fault in every pool page
    again (a minor fault per 16 pages), which an engine pays once."""

    def __init__(self, c, src: np.ndarray, dst: np.ndarray, page_bytes: int):
        self.pages = pages = src.size // page_bytes
        self.long_wait = max(ss.T, src.size / 2**30 * 30)
        regions: dict = {}

        def setup(s: orbitkv.Session) -> None:
            for name, mem in (("src", src), ("dst", dst)):
                agent = s.client.attach_agent_memory(pages, [(mem.ctypes.data, page_bytes, page_bytes)], mem)
                regions[name] = s.register_region(0, 0, pages, agent=agent)

        self.s = orbitkv.Session(
            c, ss.instance("peer", page_bytes=page_bytes), name="peer", timeout=self.long_wait, on_connect=setup
        )
        self.s.connect()
        self.dps_src = self.s.device_pages(regions["src"], list(range(pages)))
        self.dps_dst = self.s.device_pages(regions["dst"], list(range(pages)))

    def close(self) -> None:
        self.s.close()


def run_orbitkv(
    o: OrbitKV, src: np.ndarray, dst: np.ndarray, batch: int, rnd: int, inflight: int = 1
) -> dict:
    """One round through the engine side's session."""
    s, pages, long_wait = o.s, o.pages, o.long_wait
    dps_src, dps_dst = o.dps_src, o.dps_dst
    hs = hashes(pages, rnd)

    t0 = time.perf_counter()
    # Up to `inflight` saves outstanding (an engine saving several requests
    # at once has as many); each is checked when it ends.
    sizes: dict = {}

    def finish_some() -> None:
        for ticket, outcome in s.poll(long_wait):
            want = sizes.pop(ticket)
            if not isinstance(outcome, orbitkv.Saved) or outcome.inserted != want:
                sys.exit(f"OrbitKV save of {want} pages: {outcome!r}")

    for at in range(0, pages, batch):
        while len(sizes) >= inflight:
            finish_some()
        idx = range(at, min(at + batch, pages))
        sizes[s.start_save([(0, 0, hs[i], dps_src[i]) for i in idx])] = len(idx)
    while sizes:
        finish_some()
    save = time.perf_counter() - t0

    t0 = time.perf_counter()
    # One `load`: every page names its destination; the manager leases the
    # pages and has the agent restore them (verified in the copy's pass).
    got = s.load(
        [0],
        hs,
        0,
        pages * PAGE_TOKENS + 1,
        ranks=[0],
        targets=[(0, 0, (i + 1) * PAGE_TOKENS, dps_dst[i]) for i in range(pages)],
    )
    retrieve = time.perf_counter() - t0
    if not got.hit or got.boundary != pages * PAGE_TOKENS or got.pages != pages:
        sys.exit(f"OrbitKV load: {got!r}")
    ok = np.array_equal(src, dst)
    return {"save_s": save, "retrieve_s": retrieve, "exact": bool(ok)}


# ---------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=size, default=size("2GiB"))
    ap.add_argument("--page-bytes", type=size, default=size("256KiB"))
    ap.add_argument("--batch", type=int, default=256, help="pages per save/retrieve call")
    ap.add_argument("--inflight", type=int, default=4, help="OrbitKV publishes outstanding at once during save")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--profile", default="release", choices=["release", "debug"])
    ap.add_argument("--peers", default="inproc,mp", help="LMCache peers: inproc (CPU backend), mp (MP server)")
    ap.add_argument("--mp-mode", default="lmcache_driven", choices=["lmcache_driven", "engine_driven"])
    ap.add_argument("--mp-workers", type=int, default=1, help="the MP server's --max-workers")
    a = ap.parse_args()
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    if not peers or any(p not in ("inproc", "mp") for p in peers):
        sys.exit(f"--peers: expected a list of inproc, mp; got {a.peers!r}")
    if orbitkv._orbitkv._debug_build and a.profile == "release":
        progress("WARNING: the orbitkv extension is a debug build; figures will be low")
    pages = a.total // a.page_bytes
    total = pages * a.page_bytes
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)

    # Floor: one thread streaming the same bytes (buffers far beyond the LLC).
    floor = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        floor.append(time.perf_counter() - t0)
    memcpy_gbs = total / min(floor) / 1e9

    # DRAM extents hold whole pages: at least one page each (the tests'
    # 64 KiB extents would drop larger pages).
    extent = max(2 << 20, a.page_bytes)
    config = (
        "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = true\n"
        f"extent_bytes = {extent}\n[limits]\nmax_staging_bytes = {256 << 20}\n"
        # One recovery holds the whole payload reserved at once.
        f"[budget]\nquery_budget_bytes = {total}\n"
    )
    m = ss.Manager(ss.orbitkv_binary(a.profile), dram=f"{int(total * 1.25) >> 20}MiB", config=config)
    names = {"inproc": "lmcache", "mp": "lmcache_mp"}
    others = [names[p] for p in peers]
    runs: dict = {name: [] for name in others + ["orbitkv"]}
    systems: dict = {}
    try:
        m.start()
        with orbitkv.Client(m.socket, "peer-bench") as c:
            if "inproc" in peers:
                systems["lmcache"] = Lmcache(total, a.page_bytes)
            if "mp" in peers:
                from lmcache_mp import MpServer

                progress("starting LMCache's MP server")
                systems["lmcache_mp"] = MpServer(total, a.page_bytes, a.batch, a.mp_mode, a.mp_workers)
            systems["orbitkv"] = OrbitKV(c, src, dst, a.page_bytes)
            # Round 0 warms every system (faults in the pools, the
            # manager's staging and the copy agent's window); it is not
            # counted.
            for r in range(a.repeat + 1):
                for name in runs:
                    dst[:] = 0
                    what = "warm-up" if r == 0 else f"round {r}/{a.repeat}"
                    progress(f"{what}: {name}, {pages} pages of {a.page_bytes} bytes")
                    if name == "orbitkv":
                        res = run_orbitkv(systems["orbitkv"], src, dst, a.batch, r, a.inflight)
                    else:
                        res = systems[name].round(src, dst, a.page_bytes, a.batch, r)
                    if not res["exact"]:
                        sys.exit(f"{name}: the bytes read back differ from what was saved")
                    if r > 0:
                        runs[name].append(res)
            # Before its client closes.
            systems.pop("orbitkv").close()
    finally:
        for peer in systems.values():
            peer.close()
        m.stop()

    def gbs(name: str, key: str) -> float:
        return total / statistics.median(x[key] for x in runs[name]) / 1e9

    def both(name: str) -> float:
        return 2 * total / statistics.median(x["save_s"] + x["retrieve_s"] for x in runs[name]) / 1e9

    out: dict = {
        "total_bytes": total,
        "page_bytes": a.page_bytes,
        "pages": pages,
        "batch": a.batch,
        "repeat": a.repeat,
        "memcpy_gbs": memcpy_gbs,
        "runs": runs,
    }
    for name in runs:
        out[name] = {
            "save_gbs": gbs(name, "save_s"),
            "retrieve_gbs": gbs(name, "retrieve_s"),
            "save_retrieve_gbs": both(name),
        }
    unfair = [
        "OrbitKV's save copies twice (engine -> staging -> pool, hashing in the second pass)",
        "OrbitKV verifies a checksum on restore; LMCache verifies nothing",
        "OrbitKV's device pages are allocated before timing, as its adapters do at startup",
    ]
    if "lmcache" in runs:
        unfair += [
            "LMCache's CPU backend is in-process; OrbitKV goes through a manager process",
            f"OrbitKV keeps up to {a.inflight} publishes in flight; LMCache's in-process puts are synchronous copies",
        ]
    if "lmcache_mp" in runs:
        unfair += [
            f"LMCache's MP server runs {a.mp_workers} store/retrieve worker(s) ({a.mp_mode}), its copies are "
            "torch ops with torch's default threads (one per core); OrbitKV's manager copies with its default "
            "2 workers ([copy] workers) and the client's copy agent with 2",
            "LMCache's MP server keeps 4 requests in flight; OrbitKV keeps "
            f"{a.inflight} publishes in flight and restores in one load",
            "LMCache's retrieve includes a LOOKUP per request, as OrbitKV's load includes its query",
        ]
    out["unfair"] = unfair
    if "lmcache_mp" in systems:
        out["lmcache_mp_server"] = systems["lmcache_mp"].command
    rows = [f"{'':14} {'save GB/s':>10} {'retrieve':>10} {'both':>10}"]
    for name in runs:
        o = out[name]
        rows.append(f"{name:14} {o['save_gbs']:10.2f} {o['retrieve_gbs']:10.2f} {o['save_retrieve_gbs']:10.2f}")
    for name in others:
        ratio = {k: out["orbitkv"][f"{k}_gbs"] / out[name][f"{k}_gbs"] for k in ("save", "retrieve", "save_retrieve")}
        out[f"ratio_vs_{name}"] = ratio
        rows.append(
            f"{'vs ' + name:14} {ratio['save']:10.2f} {ratio['retrieve']:10.2f} {ratio['save_retrieve']:10.2f}"
        )
    print(json.dumps(out, indent=2))
    print(
        f"\n{total / 2**30:.2f} GiB in {a.page_bytes >> 10} KiB pages; memcpy floor {memcpy_gbs:.1f} GB/s\n"
        + "\n".join(rows),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
