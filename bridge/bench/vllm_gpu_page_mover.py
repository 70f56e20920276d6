"""Device check of the vLLM connector's data path on a GPU (needs CUDA and
torch, not vLLM): `HostPageMover` with KV tensors in GPU memory, against a
real `orbitkv serve`. Not a test (CI has no GPU); run it where a GPU is:

    python bridge/bench/vllm_gpu_page_mover.py [--device cuda] [--pages 64]

It builds per-layer KV tensors shaped as vLLM 0.33 allocates them
([blocks, heads, tokens, 2*head_size], LBNHC strides; 32 layers, 8 KV heads
of 128, 16-token blocks, bf16: 2 MiB pages), fills `pages` blocks with
random bytes, stages them (GPU -> staging shared memory) and publishes
them, then queries, prepares and restores them into other blocks (pool ->
GPU), and checks every restored byte on the GPU. It prints the staging
and restore throughput next to a plain GPU<->host copy of the same bytes
measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bridge" / "tests"))

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16


def kv_tensors(num_blocks: int, device: str, dtype):
    """One backing allocation, per-layer [B, H, N, 2*D] views with LBNHC
    strides (physical [L, B, N, H, C]), as vLLM's allocator lays them out."""
    import torch

    raw = torch.empty(LAYERS * num_blocks * BLOCK * HEADS * 2 * HEAD, dtype=dtype, device=device)
    per_layer = num_blocks * BLOCK * HEADS * 2 * HEAD
    views = {}
    for layer in range(LAYERS):
        views[f"model.layers.{layer}.self_attn.attn"] = torch.as_strided(
            raw,
            (num_blocks, HEADS, BLOCK, 2 * HEAD),
            (BLOCK * HEADS * 2 * HEAD, 2 * HEAD, HEADS * 2 * HEAD, 1),
            layer * per_layer,
        )
    return raw, views


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", type=int, default=64)
    args = ap.parse_args()

    import orbitkv
    import serve_support as ss
    import torch
    from orbitkv.vllm.copy import EngineBlocks, HostPageMover
    from orbitkv.vllm.engine import EngineSpec, GroupPlan, LayerPlan

    dev = args.device
    n = args.pages
    num_blocks = 2 * n + 1
    dtype = torch.bfloat16
    raw, kv = kv_tensors(num_blocks, dev, dtype)
    seg = BLOCK * HEADS * 2 * HEAD * 2
    layers = tuple(LayerPlan(name, i, seg) for i, name in enumerate(kv))
    group = GroupPlan(0, 0, "full", "prefix", ("attention_kv",), layers)
    slots = [
        {
            "layer": lp.index,
            "group": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "segment_bytes": seg,
            "padded_page_bytes": seg,
            "page_tokens": BLOCK,
            "dtype": "torch.bfloat16",
            "layout": "LBNHC",
            "strides": [2 * HEAD * 2, HEADS * 2 * HEAD * 2, 1],
            "device_addr": 0,
        }
        for lp in layers
    ]
    register = {
        "command": "register_instance",
        "instance": "gpu-check",
        "identity": "7e" * 32,
        "layout": {"slots": slots, "pool_capacity_pages": 0},
        "page_tokens": BLOCK,
        "groups": [group.group_spec()],
        "ranks": [{"tp": 0, "pp": 0}],
    }
    spec = EngineSpec("7e" * 32, "gpu-check", BLOCK, (group,), 1, "LBNHC", register, [])
    blocks = EngineBlocks(spec, kv, num_blocks)
    page_bytes = group.page_bytes
    print(
        f"device {dev} ({torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}), "
        f"{n} pages of {page_bytes >> 20} MiB ({LAYERS} layers)"
    )

    # Known bytes in blocks 1..n (block 0 is vLLM's null block).
    g = torch.Generator(device=dev).manual_seed(7)
    raw.view(torch.int16).copy_(
        torch.randint(-32768, 32767, raw.shape, generator=g, device=dev, dtype=torch.int16)
    )
    src = list(range(1, n + 1))
    dst = list(range(n + 1, 2 * n + 1))

    binary = Path(os.environ.get("ORBITKV_BIN") or ss.orbitkv_binary("release"))
    dram = f"{max(256, (n * page_bytes * 2) >> 20)}MiB"
    config = "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nextent_bytes = 8388608\n"
    m = ss.Manager(binary, dram=dram, config=config)
    try:
        m.start()
        c = orbitkv.Client(m.socket, "gpu-check")
        assert c.call(register, 10)["event"] == "instance_registered"
        session = c.call({"command": "open_session", "instance": "gpu-check"}, 10)["session"]
        mover = HostPageMover(blocks, 0, n, 30.0)
        mover.connect(c, session)

        # The first pass touches the staging memory; the second is timed.
        stage_s = 0.0
        for _ in range(2):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            mover.stage(0, list(range(n)), src)
            stage_s = time.perf_counter() - t

        hashes = [f"{0xC0DE0000 + i:016x}" for i in range(n)]
        pages = [
            {"rank": 0, "group": 0, "hash": h, "device_page": mover.source_page(0, i)}
            for i, h in enumerate(hashes)
        ]
        done = c.call({"command": "publish", "session": session, "request": 1, "pages": pages}, 60)
        assert done["event"] == "publish_done" and done["inserted"] == n, done
        q = c.call(
            {
                "command": "query",
                "session": session,
                "request": 2,
                "groups": [{"group": 0, "hashes": hashes}],
                "origin": 0,
                "prompt_len": n * BLOCK + 1,
                "prepare": True,
            },
            60,
        )
        assert q["selected"] == n * BLOCK, q
        ready = c.wait_event(60, kind="ready", operation=q["operation"])
        leases = sorted(ready["leases"], key=lambda x: x["pos"]["page_end"])
        work = [
            (le["offset"], le["bytes"], dst[le["pos"]["page_end"] // BLOCK - 1]) for le in leases
        ]
        restore_s = 0.0
        for _ in range(2):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            mover.restore(0, work)
            if dev == "cuda":
                torch.cuda.synchronize()
            restore_s = time.perf_counter() - t
        c.submit({"command": "release", "session": session, "operation": q["operation"]})
        assert c.wait_event(30, kind="released", operation=q["operation"]) is not None

        bad = 0
        for t_ in kv.values():
            a = t_[src].contiguous().view(torch.uint8)
            b = t_[dst].contiguous().view(torch.uint8)
            bad += int((a != b).sum().item())
        print(f"restored bytes differing from the staged ones: {bad}")

        # Baseline in the same run: the same bytes, one contiguous copy each way.
        flat = torch.zeros(n * page_bytes, dtype=torch.uint8, device=dev)
        host = torch.zeros(n * page_bytes, dtype=torch.uint8)
        d2h_s = h2d_s = 0.0
        for _ in range(2):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            host.copy_(flat)
            d2h_s = time.perf_counter() - t
            t = time.perf_counter()
            flat.copy_(host)
            if dev == "cuda":
                torch.cuda.synchronize()
            h2d_s = time.perf_counter() - t
        gib = n * page_bytes / (1 << 30)
        print(
            f"stage   (GPU blocks -> staging): {gib / stage_s:6.2f} GiB/s   "
            f"baseline one D2H copy: {gib / d2h_s:6.2f} GiB/s   ratio {d2h_s / stage_s:.2f}"
        )
        print(
            f"restore (pool -> GPU blocks):    {gib / restore_s:6.2f} GiB/s   "
            f"baseline one H2D copy: {gib / h2d_s:6.2f} GiB/s   ratio {h2d_s / restore_s:.2f}"
        )
        c.close()
        if bad:
            sys.exit(1)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
