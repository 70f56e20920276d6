"""Throughput of OrbitKVStorage against SGLang's own `file` backend
(HiCacheFile), on the same real host pool, in the same run.

Each backend stores N pages of 64 KiB from SGLang's MHATokenToKVPoolHost and
reads them back into other pages of the pool, in batches of 128 pages (the
controller's STORAGE_BATCH_SIZE), the way SGLang's cache controller drives
it: OrbitKV through the zero-copy interface (``batch_set_v1`` /
``batch_get_v1``, ``interface_v1: 1``); HiCacheFile, which has no v1 calls,
through the controller's generic path (``batch_set`` of
``get_data_page`` tensors; ``batch_get`` into dummy pages, then
``set_from_flat_data_page``). Every read is checked byte for byte after
its timing. Prints GB/s per direction and the ratio OrbitKV / HiCacheFile.

Run (release builds: the manager and the Python extension):

    V=$(scripts/venv.sh sglang)
    cargo build --release --bin orbitkv
    scripts/develop.sh $V release
    PATH=$V/bin:$PATH $V/bin/python bridge/bench/sglang_throughput.py \\
        --pages 2048 --repeat 3 [--file-dir /tmp/hicache-bench]

Not a test: numbers depend on the machine; the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bridge" / "tests"))

import torch  # noqa: E402

import serve_support as ss  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

BATCH = 128
# 16 tokens x 4 layers x (K, V) x 4 heads x 64 dims x fp16 = 64 KiB per page.
PAGE, LAYERS, HEADS, HEAD_DIM, DTYPE = 16, 4, 4, 64, torch.float16


def host_pool(pages: int) -> MHATokenToKVPoolHost:
    tokens = 2 * pages * PAGE + PAGE
    dev = MHATokenToKVPool(
        size=tokens,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
    )


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config=extra,
    )


def page_bytes(host, start: int) -> bytes:
    return host.get_data_page(start, flat=True).view(torch.uint8).numpy().tobytes()


class OrbitKV:
    name = "orbitkv (batch_*_v1)"

    def __init__(self, host, socket: str):
        extra = {
            "backend_name": "orbitkv",
            "module_path": "orbitkv.sglang",
            "class_name": "OrbitKVStorage",
            "interface_v1": 1,
            "socket": socket,
        }
        self.be = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        self.be.register_mem_pool_host(host)
        self.be.on_host_pools_registered()

    def set(self, host, keys, idx) -> bool:
        return all(self.be.batch_set_v1(keys, idx))

    def get(self, host, keys, idx) -> bool:
        return all(self.be.batch_get_v1(keys, idx))


class File:
    name = "HiCacheFile (generic page path)"

    def __init__(self, host, directory: str):
        self.be = HiCacheFile(config({"file_storage_path": directory}), directory)
        self.be.register_mem_pool_host(host)

    def set(self, host, keys, idx) -> bool:
        # CacheController._generic_page_set
        data = [host.get_data_page(idx[i * PAGE]) for i in range(len(keys))]
        return self.be.batch_set(keys, data)

    def get(self, host, keys, idx) -> bool:
        # CacheController._generic_page_get
        dummy = [host.get_dummy_flat_data_page() for _ in keys]
        pages = self.be.batch_get(keys, dummy)
        for i, p in enumerate(pages):
            if p is None:
                return False
            host.set_from_flat_data_page(idx[i * PAGE], p)
        return True


def run(backend, host, src, dst, pages: int, tag: str, expected) -> tuple[float, float]:
    keys = [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(pages)]
    nbytes = pages * (PAGE * LAYERS * 2 * HEADS * HEAD_DIM * DTYPE.itemsize)
    t = time.perf_counter()
    for b in range(0, pages, BATCH):
        k = keys[b : b + BATCH]
        if not backend.set(host, k, src[b * PAGE : (b + len(k)) * PAGE]):
            raise SystemExit(f"{backend.name}: a set failed")
    t_set = time.perf_counter() - t
    t = time.perf_counter()
    for b in range(0, pages, BATCH):
        k = keys[b : b + BATCH]
        if not backend.get(host, k, dst[b * PAGE : (b + len(k)) * PAGE]):
            raise SystemExit(f"{backend.name}: a get failed")
    t_get = time.perf_counter() - t
    got = [page_bytes(host, s) for s in dst[::PAGE].tolist()]
    if got != expected:
        raise SystemExit(f"{backend.name}: pages read back differ")
    return nbytes / t_set / 1e9, nbytes / t_get / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--file-dir", default=None, help="where HiCacheFile's fresh directory is made (default: /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.pages <= 0 or args.pages % BATCH:
        raise SystemExit(f"--pages must be a positive multiple of {BATCH}")

    model = Path(tempfile.mkdtemp(prefix="okv-bench-model-"))
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": LAYERS,
                "intermediate_size": 256,
                "vocab_size": 128,
                "head_dim": HEAD_DIM,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
            }
        )
    )
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    set_global_server_args_for_scheduler(ServerArgs(model_path=str(model), page_size=PAGE, device="cpu"))

    pages = args.pages
    host = host_pool(pages)
    src, dst = host.alloc(pages * PAGE), host.alloc(pages * PAGE)
    g = torch.Generator().manual_seed(1)
    for s in src[::PAGE].tolist():
        page = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * 2,), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(s, raw.view(DTYPE))
    expected = [page_bytes(host, s) for s in src[::PAGE].tolist()]
    total = pages * len(expected[0])

    # A fresh directory every run: HiCacheFile skips keys whose file exists,
    # so a directory a previous run filled would time no writes at all.
    base = args.file_dir or "/tmp"
    os.makedirs(base, exist_ok=True)
    file_dir = tempfile.mkdtemp(prefix="hicache-bench-", dir=base)
    dram = f"{max(256, 2 * total * (args.repeat + 1) >> 20)}MiB"
    manager = ss.Manager(ss.orbitkv_binary(os.environ.get("PROFILE", "release")), dram=dram).start()
    results = {}
    try:
        backends = [OrbitKV(host, manager.socket), File(host, file_dir)]
        for r in range(args.repeat + 1):  # the first round warms up
            for be in backends:
                zero = host.get_dummy_flat_data_page()
                for s in dst[::PAGE].tolist():  # so a read that did nothing shows
                    host.set_from_flat_data_page(s, zero)
                w, rd = run(be, host, src, dst, pages, f"{be.name}/{r}", expected)
                if r:
                    results.setdefault(be.name, []).append((w, rd))
    finally:
        manager.stop()
        shutil.rmtree(manager.dir, ignore_errors=True)
        shutil.rmtree(file_dir, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)

    def med(name, i):
        return statistics.median(x[i] for x in results[name])

    okv, f = OrbitKV.name, File.name
    summary = {
        "page_bytes": len(expected[0]),
        "pages": pages,
        "batch_pages": BATCH,
        "repeat": args.repeat,
        "file_dir": file_dir,
        "gb_per_s": {n: {"set": med(n, 0), "get": med(n, 1)} for n in results},
        "ratio_orbitkv_over_file": {"set": med(okv, 0) / med(f, 0), "get": med(okv, 1) / med(f, 1)},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{pages} pages of {len(expected[0]) >> 10} KiB ({total >> 20} MiB), batches of {BATCH}, "
          f"median of {args.repeat} runs after a warm-up; HiCacheFile in {file_dir}")
    print(f"{'backend':<34} {'set GB/s':>9} {'get GB/s':>9}")
    for n in results:
        print(f"{n:<34} {med(n, 0):>9.2f} {med(n, 1):>9.2f}")
    r = summary["ratio_orbitkv_over_file"]
    print(f"{'ratio orbitkv / HiCacheFile':<34} {r['set']:>9.2f} {r['get']:>9.2f}")


if __name__ == "__main__":
    main()
