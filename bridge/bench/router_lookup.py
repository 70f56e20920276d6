"""What a router's question costs: `POST /lookup` (HTTP, JSON) against
`Session.locate` (the engine side's socket) and `Session.lookup` (the hot
path a scheduler uses), in one run against one manager. Not a test: it
asserts nothing about time.

    scripts/python-tests.sh                    # creates .venv
    scripts/develop.sh .venv release
    ORBITKV_BIN=target/release/orbitkv .venv/bin/python bridge/bench/router_lookup.py

A manager holds 64 stored prompts of 32 pages; each call asks about one of
them (32 hashes, a prefix of 24 stored pages then 8 absent). Printed per
path: calls per second and p50/p99 latency, and the ratio of each p50 to
`Session.lookup`'s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import orbitkv  # noqa: E402
import serve_support as ss  # noqa: E402
from serve_support import PAGE, PAGE_BYTES  # noqa: E402

PROMPTS = 64
PAGES = 32
STORED = 24


def hashes(prompt: int):
    return [(0xC000 + (prompt << 24) + i).to_bytes(8, "big") for i in range(PAGES)]


def timed(fn, seconds: float):
    lat = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t)
        i += 1
    a = np.array(lat) * 1e6
    return len(lat) / seconds, float(np.percentile(a, 50)), float(np.percentile(a, 99))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    # The endpoint's rate bound (1000/s by default) out of the way.
    config = ss.CONFIG.replace("[serve]\n", "[serve]\nlookup_per_second = 10000000\n", 1)
    m = ss.Manager(ss.orbitkv_binary("release"), dram="256MiB", config=config)
    with ss.running(m):
        region = {}

        def on_connect(s):
            region["r"] = s.register_region(0, 0, STORED)

        with orbitkv.Session(m.socket, ss.instance(), name="bench", on_connect=on_connect) as s:
            s.connect()
            view = np.frombuffer(s.region_view(region["r"]), dtype=np.uint8)
            view[:] = 7
            dps = s.device_pages(region["r"], list(range(STORED)))
            for p in range(PROMPTS):
                hs = hashes(p)[:STORED]
                s.save([(0, 0, h, dp) for h, dp in zip(hs, dps)])
            bodies = [
                json.dumps({"instance": ss.INSTANCE, "hashes": [h.hex() for h in hashes(p)]}).encode()
                for p in range(PROMPTS)
            ]
            conn = http.client.HTTPConnection("127.0.0.1", m.port, timeout=10)

            def post(i):
                conn.request("POST", "/lookup", body=bodies[i % PROMPTS])
                r = conn.getresponse()
                body = r.read()
                assert r.status == 200, body
                got = json.loads(body)["restorable"]["tokens"]
                assert got == STORED * PAGE, got

            def locate(i):
                got = s.locate(hashes(i % PROMPTS)).tokens
                assert got == STORED * PAGE, got

            def lookup(i):
                hs = hashes(i % PROMPTS)
                got = s.lookup([0], hs, 0, PAGES * PAGE + 1).selected
                assert got == STORED * PAGE, got

            rows = []
            for name, fn in [("Session.lookup", lookup), ("Session.locate", locate), ("POST /lookup", post)]:
                fn(0)
                rows.append((name, *timed(fn, args.seconds)))
            base = rows[0][2]
            print(f"{'path':16} {'calls/s':>9} {'p50 us':>8} {'p99 us':>8} {'p50 / lookup':>13}")
            for name, rate, p50, p99 in rows:
                print(f"{name:16} {rate:9.0f} {p50:8.1f} {p99:8.1f} {p50 / base:13.2f}")
            conn.close()
    _ = PAGE_BYTES


if __name__ == "__main__":
    main()
