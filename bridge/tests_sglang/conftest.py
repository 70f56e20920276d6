"""Fixtures for the `orbitkv.sglang` tests: the real SGLang 0.5.23 classes
on CPU (host pools, the dynamic backend factory, the cache controllers and
the UnifiedRadixCache tree) against a real `orbitkv serve`.

Run by scripts/sglang-tests.sh in the sglang venv (scripts/venv.sh sglang),
in one pytest process: importing SGLang takes ~20 s.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # serve_support

import serve_support as ss  # noqa: E402

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

PAGE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
TEST_LIMIT_S = 180

EXTRA = {
    "backend_name": "orbitkv",
    "module_path": "orbitkv.sglang",
    "class_name": "OrbitKVStorage",
    "interface_v1": 1,
}

# Controllers read the parallel topology from SGLang's process-wide context,
# which a launcher would publish.
get_parallel().override_permanently(
    tp_rank=0,
    tp_size=1,
    pp_rank=0,
    pp_size=1,
    attn_dcp_size=1,
    attn_dcp_rank=0,
    attn_cp_rank=0,
    attn_cp_size=1,
    attn_tp_rank=0,
    attn_tp_size=1,
    enable_dp_attention=False,
    attn_dp_rank=0,
    attn_dp_size=1,
    dcp_size=1,
    dcp_rank=0,
    dcp_enabled=False,
)


@pytest.fixture(autouse=True)
def time_limit():
    def expired(signum, frame):
        raise TimeoutError(f"test ran past {TEST_LIMIT_S}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("ORBITKV_MODEL_FINGERPRINT", raising=False)
    monkeypatch.delenv("ORBITKV_CACHE_SCOPE", raising=False)
    monkeypatch.delenv("ORBITKV_SOCKET", raising=False)


def make_model(path: Path, weights: bytes = bytes(range(256)) * 16) -> Path:
    """A tiny local Llama directory (config, tokenizer, weights): what the
    identity hashes. SGLang parses its config.json."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 128,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (path / "model.safetensors").write_bytes(weights)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def publish_server_args(model_path: Path, **kw) -> ServerArgs:
    """Publishes SGLang's server args for this process, as the scheduler
    does; the backend reads the model identity from them."""
    args = dict(model_path=str(model_path), page_size=PAGE, device="cpu")
    args.update(kw)
    sa = ServerArgs(**args)
    set_global_server_args_for_scheduler(sa)
    return sa


@pytest.fixture(autouse=True)
def server_args(model_dir):
    return publish_server_args(model_dir)


@pytest.fixture(scope="session")
def orbitkv_bin():
    return ss.orbitkv_binary()


@pytest.fixture
def manager(orbitkv_bin):
    m = ss.Manager(orbitkv_bin, dram="64MiB")
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


# Pools and backends -----------------------------------------------------------


def device_pool(size: int = 256, dtype=torch.float32, layers: int = LAYERS) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=dtype,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def host_pool(layout: str, size: int = 256, dtype=torch.float32, layers: int = LAYERS) -> MHATokenToKVPoolHost:
    """The real host pool on CPU (no pinned memory), `size` tokens."""
    dev = device_pool(size, dtype, layers)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=layers,
    )


def mla_host_pool(layout: str, size: int = 256):
    """The real MLA host pool on CPU: one latent row (16 + 8 rope) per token
    and layer."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.float32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def storage_config(
    socket: str,
    *,
    layout: str = "page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    **extra,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout.startswith("page_first"),
        model_name="tiny-llama",
        extra_config={**EXTRA, "socket": socket, "timeout_s": 5.0, **extra},
    )


def backend(host, socket: str, *, register: bool = True, **kw):
    """OrbitKVStorage built by SGLang's dynamic factory, its host pool
    registered as the controller registers it."""
    layout = getattr(host, "layout", "page_first")
    be = StorageBackendFactory.create_backend("dynamic", storage_config(socket, layout=layout, **kw), host)
    be.register_mem_pool_host(host)
    if register:
        be.on_host_pools_registered()
    return be


def fill(host, starts: List[int], seed: int) -> List[bytes]:
    """Writes distinct random bytes into the pages at `starts` through the
    pool's own API; returns each page's flat bytes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in starts:
        page = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(s, raw.view(page.dtype))
        out.append(page_bytes(host, s))
    return out


def page_bytes(host, start: int) -> bytes:
    """A page's bytes in SGLang's flat format (what the backend stores)."""
    return host.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def starts_of(indices: torch.Tensor) -> List[int]:
    return indices[::PAGE].tolist()


def keys_for(tag: str, n: int) -> List[str]:
    """SGLang-shaped page keys: 64 lowercase hex digits."""
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def quiet(manager) -> Dict[str, int]:
    """Waits until the manager holds no lease, operation or reserved byte
    (released asynchronously); returns its metrics. /metrics refreshes
    every 100 ms, so the first look waits for a fresh snapshot."""
    time.sleep(0.3)
    manager.wait_metric("leases", 0)
    manager.wait_metric("operations", 0)
    manager.wait_metric("bytes_reserved", 0)
    return manager.metrics()


def find_leaks(manager) -> Optional[str]:
    m = manager.metrics()
    bad = {k: m.get(k) for k in ("leases", "operations", "bytes_reserved") if m.get(k)}
    return f"manager still holds {bad}" if bad else None
