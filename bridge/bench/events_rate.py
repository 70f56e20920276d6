"""The KV event stream's cost and rate, with its baseline in the same run:
a manager with `[events]` off, then on. Not a test: it asserts nothing
about time.

    scripts/python-tests.sh                    # creates .venv
    scripts/develop.sh .venv release
    .venv/bin/python bridge/bench/events_rate.py [--seconds 5]

In each run, one process saves pages as fast as the manager takes them
(64 per save, fresh hashes, 4 MiB of DRAM: every save evicts as much as it
stores, so the stream carries a BlockStored and a BlockRemoved per page),
another subscribes to the stream and counts what it receives, and this
process times `Session.lookup` (a hit, the hot path) meanwhile. Printed:
pages saved per second, events per second received, and the lookup's
p50/p99, events on against off.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import orbitkv  # noqa: E402
import serve_support as ss  # noqa: E402
from serve_support import PAGE, PAGE_BYTES  # noqa: E402

BATCH = 64


def hashes(n: int, seed: int):
    return [(0xB000 + (seed << 24) + i).to_bytes(8, "big") for i in range(n)]


def session(sock: str, name: str, slots: int):
    box = {}

    def setup(s):
        box["region"] = s.register_region(0, 0, slots)

    s = orbitkv.Session(sock, ss.instance(), name=name, on_connect=setup)
    s.connect()
    return s, box["region"]


def saver(sock: str, seconds: float) -> None:
    s, region = session(sock, "saver", BATCH)
    view = np.frombuffer(s.region_view(region), dtype=np.uint8)
    view[:] = 7
    dps = s.device_pages(region, list(range(BATCH)))
    pages, seed, end = 0, 1, time.monotonic() + seconds
    while time.monotonic() < end:
        pages += s.save([(0, 0, h, dp) for h, dp in zip(hashes(BATCH, seed), dps)]).inserted
        seed += 1
    print(pages / seconds, flush=True)
    s.close()


def counter(publish: str, seconds: float) -> None:
    import zmq
    from orbitkv import events

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publish)
    print("ready", flush=True)
    n = batches = 0
    end = time.monotonic() + seconds + 0.5
    while time.monotonic() < end:
        if sub.poll(50):
            _, _, payload = sub.recv_multipart()
            n += len(events.decode(payload).events)
            batches += 1
    print(n / seconds, batches / seconds, flush=True)


def run(binary: Path, events: bool, seconds: float, iterations: int):
    m = ss.Manager(binary, dram="4MiB")
    pub = f"ipc://{m.dir}/events"
    if events:
        m.config.write_text(ss.CONFIG + f'[events]\npublish = "{pub}"\n')
    with ss.running(m):
        hit, region = session(m.socket, "lookups", 8)
        view = np.frombuffer(hit.region_view(region), dtype=np.uint8)
        view[:] = 1
        hs = hashes(4, 0)
        hit.save([(0, 0, h, dp) for h, dp in zip(hs, hit.device_pages(region, range(4)))])
        cnt = None
        if events:
            cnt = subprocess.Popen(
                [sys.executable, __file__, "--counter", pub, str(seconds)], stdout=subprocess.PIPE, text=True
            )
            assert cnt.stdout.readline().strip() == "ready"
            time.sleep(0.3)
        sav = subprocess.Popen(
            [sys.executable, __file__, "--saver", m.socket, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        lat = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(lat) < iterations:
            # The hit keeps its pages recent enough to survive: saved again
            # now and then (outside the timing).
            if len(lat) % 200 == 0:
                hit.save([(0, 0, h, dp) for h, dp in zip(hs, hit.device_pages(region, range(4)))])
            t = time.perf_counter_ns()
            got = hit.lookup([0], hs, 0, 4 * PAGE + 1)
            lat.append((time.perf_counter_ns() - t) / 1000)
            if not got.hit:
                lat.pop()
        pages_s = float(sav.stdout.readline())
        sav.wait()
        ev_s = batch_s = 0.0
        if cnt is not None:
            ev_s, batch_s = map(float, cnt.stdout.readline().split())
            cnt.wait()
        hit.close()
        lat.sort()
        p = lambda q: lat[int(q * (len(lat) - 1))] if lat else float("nan")  # noqa: E731
        return pages_s, ev_s, batch_s, p(0.5), p(0.99), len(lat)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--saver":
        saver(sys.argv[2], float(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--counter":
        counter(sys.argv[2], float(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", default="release", help="the manager binary's build profile")
    a = ap.parse_args()
    binary = ss.orbitkv_binary(a.profile)
    print(f"{PAGE_BYTES}-byte pages, {BATCH} per save, 4 MiB DRAM, {a.seconds}s per run")
    print("run        events  pages/s   events/s  batches/s  lookup p50 us  p99 us  lookups")
    for r in range(a.rounds):
        for on in (False, True):
            pages_s, ev_s, batch_s, p50, p99, n = run(binary, on, a.seconds, a.iterations)
            print(
                f"round {r}    {'on ' if on else 'off'}   {pages_s:8.0f}  {ev_s:9.0f}  {batch_s:9.0f}"
                f"  {p50:13.1f}  {p99:6.1f}  {n}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
