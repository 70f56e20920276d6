"""Per-request scheduler overhead of `OrbitKVConnector`, against the same
scheduler loop without a connector, measured in one run. Not a test: it
asserts nothing about time.

    scripts/venv.sh vllm                       # the vLLM 0.33 venv
    V=~/.cache/orbitkv/venvs/vllm
    scripts/develop.sh $V release
    cargo build --release --bin orbitkv
    $V/bin/python bridge/bench/vllm_scheduler_overhead.py [--requests 400]

What runs: the real vLLM `Scheduler` (no model, no workers: a stand-in
model runner answers every step, reporting loads and saves done one step
after they were planned), against a real `orbitkv serve` (the release
manager unless `ORBITKV_BIN` says otherwise). Three loops over the same
requests (512-token prompts, one output token):

  baseline  no connector;
  miss      the connector, nothing stored: every request is a lookup that
            misses, then its 32 pages are planned for saving;
  hit       the connector, every prefix stored (published beforehand): a
            lookup that selects 496 tokens, a load planned, one page saved.
            With `--load-mode async` (the default) the request then waits
            in WAITING_FOR_REMOTE_KVS and vLLM schedules it again once the
            load is reported; with `--load-mode layerwise` the load runs in
            the step that schedules the request.

then `null`, the same requests' kind of loop with a connector that does
nothing (`null_connector.py`: every lookup finds no tokens): the floor of
any connector, what vLLM's scheduler spends on having one at all. And,
unless `--no-offloading`, the same two loops with vLLM's own
`OffloadingConnector` (its CPU spec; the scheduler side is what runs here)
in place of OrbitKV's: `off_miss` on new prompts, and `off_hit` on prompts
the same scheduler ran once before (its loads are asynchronous). vLLM's
prefix cache is reset between the two passes, so that hits come from the
connector. The stand-in runner reports its load and store jobs completed
one step after they were planned, as its worker would.

`--forward-us N` sleeps N us after each step, as a model's forward pass
takes (the manager goes to sleep meanwhile); `--lookup-batch` sets the
connector's `lookup_batch`.

For each loop it prints the wall time per request of `schedule()` +
`update_from_output()`, the ratio to the baseline, and the part spent in
`get_num_new_matched_tokens` and `build_connector_meta` (timed around the
calls, per request); then, per round, OrbitKV's added time per request
over the `OffloadingConnector`'s (the engine-side issue asks for at most
half).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bridge" / "tests"))
sys.path.insert(0, str(ROOT / "bridge" / "tests-vllm"))

PROMPT = 512
BLOCK = 16


def prompts(n: int, seed: int) -> List[List[int]]:
    """`n` random prompts; different seeds share no page."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)]


def percentile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


class Timed:
    """Records the time of every call of one method of an object, and the
    sum of the integers it returned first (`get_num_new_matched_tokens`'s
    tokens)."""

    def __init__(self, obj: Any, name: str):
        self.times: List[float] = []
        self.tokens = 0
        real = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                r = real(*a, **k)
            finally:
                self.times.append(time.perf_counter() - t)
            if isinstance(r, tuple) and r and isinstance(r[0], int):
                self.tokens += r[0]
            return r

        setattr(obj, name, wrapper)


def loop(
    sched, hasher, reqs: List[List[int]], tag: str, async_loads: bool = True, forward_s: float = 0.0
) -> float:
    """Runs every request to completion; returns wall seconds. The stand-in
    runner samples one token per finished prefill and reports each planned
    load / delayed free done on the next step (`async_loads`; synchronous
    loads finish inside the step that plans them, and vLLM expects no
    report of them). For vLLM's `OffloadingConnector` it reports, as its
    worker would, every load and store job of a step completed on the next
    step, and each request with a load job as finished receiving."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    for i, p in enumerate(reqs):
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        sched.add_request(
            Request(
                request_id=f"{tag}-{i}",
                prompt_token_ids=p,
                sampling_params=sp,
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    recving: set = set()
    sending: set = set()
    jobs: Dict[int, int] = {}
    t0 = time.perf_counter()
    # `jobs`: the offloading connector plans the stores of a finished
    # request's last pages in the step after it finished.
    while sched.requests or jobs:
        so = sched.schedule()
        meta = so.kv_connector_metadata
        offloading = isinstance(meta, OffloadingConnectorMetadata)
        null = type(meta).__name__ == "NullMetadata"
        if offloading:
            loads = {j.req_id for j in meta.load_jobs.values() if not j.sync}
        else:
            loads = {l.req_id for l in getattr(meta, "loads", [])}
        ids = list(so.num_scheduled_tokens)
        kvo = None
        if sched.connector is not None:
            kvo = KVConnectorOutput(
                finished_recving=recving or None,
                finished_sending=sending or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=jobs) if jobs else None,
            )
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[
                [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
                for r in ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kvo,
        )
        engine_out = sched.update_from_output(so, out)
        if forward_s:
            time.sleep(forward_s)  # the model's step, which the manager sleeps through
        recving = loads if async_loads or offloading else set()
        if null:
            pass  # it delays no free: nothing to report
        elif offloading:
            # Its request_finished never delays a free: nothing to report.
            jobs = {j: 1 for j in (*meta.load_jobs, *meta.store_jobs)}
        else:
            sending = {
                o.request_id
                for outs in engine_out.values()
                for o in outs.outputs
                if o.finish_reason is not None
            }
    return time.perf_counter() - t0


#: The connector hooks vLLM's scheduler calls (`--breakdown` times each).
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)


def timed_loop(
    scheduler,
    hasher,
    reqs: List[List[int]],
    name: str,
    connector: Optional[str],
    no_gc: bool,
    warm_seed: int,
    async_loads: bool = True,
    manager: Any = None,
    stored: Optional[List[List[int]]] = None,
    forward_s: float = 0.0,
    breakdown: bool = False,
) -> Dict[str, Any]:
    """One timed loop over `reqs` on a new scheduler (with a new connector
    of kind `connector`: "orbitkv" or "offloading"), after a short warm-up
    loop. `stored`: prompts run through the same scheduler first, so that
    an in-process connector (vLLM's offloading) holds their pages; vLLM's
    own prefix cache is reset after them, so that hits come from the
    connector."""
    from vllm.utils.gc_utils import freeze_gc_heap

    sched = scheduler(connector)
    if stored is not None:
        loop(sched, hasher, stored, f"s{name}{warm_seed}", async_loads)
        if not sched.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache did not reset")
    # Warm the process (and, with the connector, the connection).
    loop(sched, hasher, prompts(8, seed=warm_seed), f"w{name}{warm_seed}", async_loads)
    lookup = meta = None
    hooks: Dict[str, Timed] = {}
    if connector:
        lookup = Timed(sched.connector, "get_num_new_matched_tokens")
        meta = Timed(sched.connector, "build_connector_meta")
        if breakdown:
            hooks = {
                name: Timed(sched.connector, name)
                for name in SCHEDULER_HOOKS
                if callable(getattr(sched.connector, name, None))
            }
    # The manager's own view of the timed loop's lookups: how many found it
    # asleep (a `Wake` each) and how many it answered between ticks.
    counted = ("hot_wakes_total", "answered_between_ticks_total")
    ours = connector == "orbitkv"
    before = {c: manager.metric(c) or 0 for c in counted} if ours and manager else None
    if no_gc:
        gc.collect()
        gc.disable()
    else:
        # As vLLM's EngineCore does once it is up: the startup heap is
        # frozen, so collections scan only what serving made.
        freeze_gc_heap()
    try:
        seconds = loop(sched, hasher, reqs, f"{name}{warm_seed}", async_loads, forward_s)
    finally:
        gc.enable()
        gc.unfreeze()
    row: Dict[str, Any] = {"us_per_request": seconds / len(reqs) * 1e6}
    if connector:
        row["lookup_us_per_request"] = sum(lookup.times) / len(reqs) * 1e6
        row["lookups_per_request"] = len(lookup.times) / len(reqs)
        row["lookup_p50_us"] = percentile(lookup.times, 0.5) * 1e6
        row["lookup_p99_us"] = percentile(lookup.times, 0.99) * 1e6
        row["meta_us_per_request"] = sum(meta.times) / len(reqs) * 1e6
        if hooks:
            row["hooks_us_per_request"] = {
                name: sum(t.times) / len(reqs) * 1e6 for name, t in hooks.items() if t.times
            }
        if ours:
            st = sched.connector.scheduler.stats
            row["hit_tokens"] = st.hit_tokens
            row["pages_planned"] = st.pages_saved
        else:
            row["hit_tokens"] = lookup.tokens
        if before is not None:
            time.sleep(0.25)  # the manager refreshes its metrics every 100 ms
            for c in counted:
                row[c] = ((manager.metric(c) or 0) - before[c]) / len(reqs)
        sched.connector.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three loops, alternating")
    ap.add_argument(
        "--no-lookup-wait",
        action="store_true",
        help="the connector's lookup_wait: false (lookups sent without waiting, "
        "collected when vLLM asks again)",
    )
    ap.add_argument(
        "--load-mode",
        default="async",
        choices=["async", "layerwise"],
        help="the connector's load_mode: async (a hit waits in WAITING_FOR_REMOTE_KVS "
        "and is scheduled again once loaded) or layerwise (loads run inside the "
        "step that schedules them)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--forward-us",
        type=int,
        default=0,
        help="sleep this long after each step, as a model's forward pass would take "
        "(the manager goes to sleep meanwhile; ratios then shrink towards 1, compare "
        "the per-request hook times)",
    )
    ap.add_argument(
        "--lookup-batch",
        type=int,
        help="the connector's lookup_batch (default: the connector's own, 8)",
    )
    ap.add_argument(
        "--no-offloading",
        action="store_true",
        help="skip the two loops with vLLM's own OffloadingConnector (CPU spec), "
        "run otherwise as the peer the added cost is compared with",
    )
    ap.add_argument(
        "--no-gc",
        action="store_true",
        help="disable Python's cyclic garbage collector in the timed loops "
        "(its pauses land on whichever request triggers them)",
    )
    ap.add_argument(
        "--spin-after-work-us",
        type=int,
        help="the manager's spin_after_work_us (default: the manager's own, 100): "
        "how long it polls without sleeping after a command, so a lookup "
        "arriving within it pays no wake-up",
    )
    ap.add_argument(
        "--spin-for-streams-us",
        type=int,
        help="the manager's spin_for_streams_us (default: the manager's own): the "
        "longest it spins after a command that came within that time of the last",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time every scheduler-side hook of each connector and print "
        "where its time per request goes (the timing wrappers add their own cost)",
    )
    args = ap.parse_args()

    import orbitkv
    import serve_support as ss

    os.environ.setdefault("ORBITKV_BIN", str(ss.orbitkv_binary("release")))
    import harness
    import torch  # noqa: F401
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = ss.CONFIG
    if args.spin_after_work_us is not None:
        config = config.replace("[serve]\n", f"[serve]\nspin_after_work_us = {args.spin_after_work_us}\n")
    if args.spin_for_streams_us is not None:
        config = config.replace("[serve]\n", f"[serve]\nspin_for_streams_us = {args.spin_for_streams_us}\n")
    manager = ss.Manager(Path(os.environ["ORBITKV_BIN"]), dram="1GiB", config=config)
    tmp = Path(manager.dir)
    model = harness.make_model(tmp / "model")
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    results: Dict[str, Any] = {
        "requests": args.requests,
        "prompt_tokens": PROMPT,
        "debug_extension": orbitkv._orbitkv._debug_build,
        "manager": os.environ["ORBITKV_BIN"],
        "spin_after_work_us": args.spin_after_work_us,
        "lookup_wait": not args.no_lookup_wait,
        "load_mode": args.load_mode,
        "gc": not args.no_gc,
    }
    try:
        manager.start()
        # Publish every page of the "hit" prompts through a real engine
        # (the harness's scheduler + worker) first.
        hit_prompts = prompts(args.requests, seed=1)
        with harness.engine(
            model, manager.socket, num_blocks=4096, max_batched=8192, extra={"staging_pages": 1024}
        ) as e:
            # A few at a time, so that no save is dropped for want of
            # staging slots.
            for i, p in enumerate(hit_prompts):
                e.add(f"warm-{i}", p, max_tokens=1)
                if i % 8 == 7:
                    e.run(limit_s=600)
            e.run(limit_s=600)
        manager.wait_metric("operations", 0)

        def scheduler(connector: Optional[str]) -> Scheduler:
            vc, kcc, _ = harness.build_config(
                model,
                manager.socket,
                num_blocks=4096,
                max_batched=8192,
                extra={
                    "lookup_wait": not args.no_lookup_wait,
                    "load_mode": args.load_mode,
                    **({} if args.lookup_batch is None else {"lookup_batch": args.lookup_batch}),
                },
            )
            if connector is None:
                vc.kv_transfer_config = None
            elif connector == "null":
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                vc.kv_transfer_config = KVTransferConfig(
                    kv_connector="NullConnector",
                    kv_connector_module_path="null_connector",
                    kv_role="kv_both",
                )
            elif connector == "offloading":
                # vLLM's native CPU offloading, room for every page of the
                # stored prompts (its scheduler side keeps only bookkeeping).
                page = kcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes
                layers = len(kcc.kv_cache_groups[0].layer_names)
                vc.kv_transfer_config = KVTransferConfig(
                    kv_connector="OffloadingConnector",
                    kv_role="kv_both",
                    kv_connector_extra_config={
                        "cpu_bytes_to_use": 2 * args.requests * (PROMPT // BLOCK) * page * layers
                    },
                )
            vc.cache_config.num_gpu_blocks = kcc.num_blocks
            return Scheduler(
                vllm_config=vc,
                kv_cache_config=kcc,
                log_stats=False,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=BLOCK,
            )

        rounds: List[Dict[str, Any]] = []
        for r in range(args.rounds):
            # The loops alternate, round after round: a burst of load on
            # this shared machine lands on every loop alike, and the
            # median round is reported.
            rows: Dict[str, Any] = {}
            loops = [
                ("baseline", None, prompts(args.requests, seed=2 + 10 * r), None),
                ("miss", "orbitkv", prompts(args.requests, seed=3 + 10 * r), None),
                ("hit", "orbitkv", hit_prompts, None),
                ("null", "null", prompts(args.requests, seed=6 + 10 * r), None),
            ]
            if not args.no_offloading:
                off_hit = prompts(args.requests, seed=5 + 10 * r)
                loops += [
                    ("off_miss", "offloading", prompts(args.requests, seed=4 + 10 * r), None),
                    ("off_hit", "offloading", off_hit, off_hit),
                ]
            for k, (name, connector, reqs, stored) in enumerate(loops):
                rows[name] = timed_loop(
                    scheduler,
                    hasher,
                    reqs,
                    name,
                    connector,
                    args.no_gc,
                    1000 + 3 * r + k,
                    async_loads=args.load_mode == "async",
                    manager=manager,
                    stored=stored,
                    forward_s=args.forward_us / 1e6,
                    breakdown=args.breakdown,
                )
            base = rows["baseline"]["us_per_request"]
            for name, row in rows.items():
                if name == "baseline":
                    continue
                row["ratio_to_baseline"] = row["us_per_request"] / base
                row["added_us_per_request"] = row["us_per_request"] - base
                row["connector_us_per_request"] = row["lookup_us_per_request"] + row["meta_us_per_request"]
            for name in ("miss", "hit") if "off_miss" in rows else ():
                # OrbitKV's added cost over the offloading connector's.
                off = rows[f"off_{name}"]["added_us_per_request"]
                rows[name]["added_vs_offloading"] = rows[name]["added_us_per_request"] / off if off > 0 else None
            rounds.append(rows)
        results["rounds"] = rounds
        for name in rounds[0]:
            if name == "baseline":
                continue
            ratios = sorted(rw[name]["ratio_to_baseline"] for rw in rounds)
            results[f"{name}_median_ratio"] = ratios[len(ratios) // 2]
    finally:
        manager.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    if results["debug_extension"]:
        print("WARNING: the orbitkv extension is a debug build; build it with --release")
    spin = args.spin_after_work_us
    print(
        f"{args.requests} requests of {PROMPT} tokens, 16-token pages, manager {results['manager']}"
        f" (spin_after_work_us {'default' if spin is None else spin}), load {os.getloadavg()[0]:.2f},"
        f" garbage collector {'off' if args.no_gc else 'on (startup heap frozen, as vLLM does)'} in the timed loops,"
        f" lookup_wait {not args.no_lookup_wait}, load_mode {args.load_mode},"
        f" lookup_batch {'default' if args.lookup_batch is None else args.lookup_batch},"
        f" forward {args.forward_us} us per step"
    )
    print(
        f"{'round':5} {'loop':9} {'us/req':>8} {'ratio':>6} {'lookup us/req':>13} {'p50':>7} {'p99':>7} "
        f"{'lookups/req':>11} {'meta us/req':>11} {'hit tokens':>10} {'wakes/req':>9} {'between/req':>11}"
    )
    for i, rows in enumerate(results["rounds"]):
        for name, r in rows.items():
            print(
                f"{i:5} {name:9} {r['us_per_request']:8.1f} {r.get('ratio_to_baseline', 1.0):6.2f} "
                f"{r.get('lookup_us_per_request', 0):13.1f} {r.get('lookup_p50_us', 0):7.1f} "
                f"{r.get('lookup_p99_us', 0):7.1f} {r.get('lookups_per_request', 0):11.2f} "
                f"{r.get('meta_us_per_request', 0):11.1f} {r.get('hit_tokens', 0):10d} "
                f"{r.get('hot_wakes_total', 0):9.2f} {r.get('answered_between_ticks_total', 0):11.2f}"
            )
    if args.breakdown:
        print("scheduler hooks, us/req (median over rounds; each wrapper adds its own cost):")
        for name in results["rounds"][0]:
            per = [rw[name].get("hooks_us_per_request", {}) for rw in results["rounds"]]
            hooks = sorted({h for p in per for h in p})
            if not hooks:
                continue
            med = {h: sorted(p.get(h, 0.0) for p in per)[len(per) // 2] for h in hooks}
            print(f"  {name:9} " + ", ".join(f"{h} {med[h]:.1f}" for h in hooks))
    print(
        f"median ratio over {len(results['rounds'])} rounds: miss {results['miss_median_ratio']:.2f}x, "
        f"hit {results['hit_median_ratio']:.2f}x; a connector that does nothing (null): "
        f"{results['null_median_ratio']:.2f}x"
    )
    # What OrbitKV adds beyond the floor any connector pays in vLLM.
    beyond = {
        name: sorted(rw[name]["added_us_per_request"] - rw["null"]["added_us_per_request"] for rw in results["rounds"])
        for name in ("miss", "hit")
    }
    print(
        "OrbitKV's added us/req beyond the null connector's, per round (sorted): "
        + ", ".join(f"{name} " + " ".join(f"{a:.1f}" for a in beyond[name]) for name in beyond)
    )
    if "off_miss_median_ratio" in results:
        added = {
            name: [rw[name]["added_vs_offloading"] for rw in results["rounds"]] for name in ("miss", "hit")
        }
        print(
            f"vLLM's OffloadingConnector (CPU, async loads) in the same rounds: miss "
            f"{results['off_miss_median_ratio']:.2f}x, hit {results['off_hit_median_ratio']:.2f}x; "
            "OrbitKV's added us/req over its added us/req, per round: "
            + ", ".join(
                f"{name} " + " ".join("n/a" if a is None else f"{a:.2f}" for a in added[name])
                for name in added
            )
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
