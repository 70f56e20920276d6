"""What a page handed across hosts costs: two managers (two hosts) sharing a
Redis deployment as their remote tier, as a cross-host P/D handoff uses
them (docs/pd.md). Not a test: it asserts nothing about time.

    eval "$(scripts/redis.sh start)"
    scripts/develop.sh .venv release
    ORBITKV_BIN=target/release/orbitkv .venv/bin/python bridge/bench/remote_handoff.py

Per round, with `--pages` pages of 4 KiB: manager A saves them (write-through
to the remote tier); B's lookups poll until it sees them all (its directory
refresh); B loads them (remote reads into its DRAM, then the copy into the
engine's memory); B loads them again, now from its DRAM: the same-run
baseline. Printed: the median of each step over `--rounds`, and the remote
load's ratio to the DRAM load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import serve_support as ss  # noqa: E402
import test_session as ts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--refresh-ms", type=int, default=20, help="[remote] refresh_interval_ms of both managers")
    a = ap.parse_args()
    urls = ss.redis_cluster("remote_handoff bench")
    if urls is None:
        sys.exit("ORBITKV_TEST_REDIS_CLUSTER is unset: eval \"$(scripts/redis.sh start)\" first")
    key = Path(tempfile.mkdtemp()) / "mac.key"
    config = ss.remote_config(urls, f"bench-{uuid.uuid4().hex[:8]}:", key).replace(
        "refresh_interval_ms = 20", f"refresh_interval_ms = {a.refresh_ms}"
    )
    binary = ss.orbitkv_binary()
    managers = [ss.Manager(binary, dram="64MiB", config=config) for _ in range(2)]
    for m in managers:
        m.start()
    try:
        ea, eb = ts.Engine(slots=4 * a.pages), ts.Engine(slots=4 * a.pages)
        sa, sb = ts.session(managers[0], ea), ts.session(managers[1], eb)
        sb.connect()
        steps = {"save on A": [], "visible on B": [], "load on B (remote)": [], "load on B (DRAM)": []}
        polls = []
        end = a.pages * ss.PAGE
        for r in range(a.rounds):
            hs = ts.hashes(a.pages, seed=1000 + r)
            t0 = time.monotonic()
            ea.save(sa, hs)
            t1 = time.monotonic()
            n = 0
            while sb.lookup([0], hs, 0, end + 1).selected != end:
                n += 1
            t2 = time.monotonic()
            assert eb.load(sb, hs, a.pages).hit
            t3 = time.monotonic()
            assert eb.load(sb, hs, 2 * a.pages).hit
            t4 = time.monotonic()
            for name, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                steps[name].append(dt * 1000)
            polls.append(n)
        print(f"{a.rounds} rounds of {a.pages} pages of {ss.PAGE_BYTES} B, refresh every {a.refresh_ms} ms")
        for name, v in steps.items():
            print(f"  {name:<20} p50 {statistics.median(v):7.2f} ms   max {max(v):7.2f} ms")
        remote, dram = statistics.median(steps["load on B (remote)"]), statistics.median(steps["load on B (DRAM)"])
        print(f"  remote load / DRAM load (p50): {remote / dram:.2f}x; lookups polled per round: {statistics.median(polls)}")
    finally:
        for m in managers:
            m.stop()


if __name__ == "__main__":
    main()
