"""A lookup's latency when the engine works between lookups, as a
scheduler step does (one lookup per waiting request, the engine's own work
in between). Not a test: it asserts nothing about time.

    V=~/.cache/orbitkv/venvs/vllm    # any venv with the extension
    scripts/develop.sh $V release && cargo build --release --bin orbitkv
    ORBITKV_BIN=$PWD/target/release/orbitkv $V/bin/python bridge/bench/lookup_gaps.py \
        [--serve "spin_for_streams_us = 0"] [--gaps 0,150,300,400,600,900]

For each gap: `--iterations` lookups of `--pages` pages (default 8; none published: each a
miss, a scheduler's common case) through one
`orbitkv.Session`, each after the caller busy-waits the gap (outside the
timed region); prints p50, p90, p99 and the mean per lookup. `--serve` lines go into the
manager's `[serve]` table (separate several with `;`): compare the
manager's default spin with `spin_for_streams_us = 0` (a fixed spin of
`spin_after_work_us` after every command) in the same session of the
machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bridge" / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="append", default=[], help="a [serve] line (repeatable; ';' separates)")
    ap.add_argument("--gaps", default="0,150,300,400,600,900", help="busy-wait gaps in us, comma separated")
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--pages", type=int, default=8, help="pages per lookup")
    args = ap.parse_args()

    import orbitkv
    import serve_support as ss

    lines = [l.strip() for s in args.serve for l in s.split(";") if l.strip()]
    config = ss.CONFIG.replace("[serve]\n", "[serve]\n" + "".join(l + "\n" for l in lines))
    binary = Path(os.environ.get("ORBITKV_BIN", ss.orbitkv_binary("release")))
    m = ss.Manager(binary, dram="256MiB", config=config)
    m.start()
    try:
        s = orbitkv.Session(m.socket, ss.instance(), name="lookup-gaps")
        n = args.pages
        hs = [(0x6A9 << 32 | i).to_bytes(8, "big") for i in range(n)]
        clock = time.perf_counter_ns
        print(f"manager [serve] {lines or 'defaults'}; load {os.getloadavg()[0]:.2f}")
        print(f"{n}-page lookups")
        print(f"{'gap us':>7} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'mean us':>8}")
        for gap in (int(g) for g in args.gaps.split(",")):
            xs = []
            for _ in range(args.iterations):
                until = clock() + gap * 1000
                while clock() < until:
                    pass
                t0 = clock()
                found = s.lookup([0], hs, 0, n * ss.PAGE + 1)
                xs.append((clock() - t0) / 1000)
                assert found.miss is not None  # nothing published: every lookup is a miss
            mean = sum(xs) / len(xs)
            xs.sort()
            print(
                f"{gap:7} {xs[len(xs) // 2]:8.1f} {xs[int(len(xs) * 0.9)]:8.1f} "
                f"{xs[int(len(xs) * 0.99)]:8.1f} {mean:8.1f}"
            )
        s.close()
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
