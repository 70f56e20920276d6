"""Fixtures of the vLLM connector suite: tiny local models, a real
`orbitkv serve` per test, and a bound on every test's run time."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import harness  # noqa: E402
import serve_support as ss  # noqa: E402

TEST_LIMIT_S = 300


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


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "a": harness.make_model(root / "tiny-a", seed=0),
        "b": harness.make_model(root / "tiny-b", seed=1),
    }


@pytest.fixture(scope="session")
def model(models):
    return models["a"]


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
