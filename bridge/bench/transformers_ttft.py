"""Time to first token of a transformers model with the prompt's prefix
restored from OrbitKV, against full recompute and against the floor, all
measured in one run. Not a test: it asserts nothing about time.

    scripts/bench-transformers.sh [--prompt 4096] [--repeats 5]

(builds the release extension into the overlay venv of
scripts/model-tests.sh, then runs this file with it).

The model is Llama-shaped with random weights (fp32, built from a config;
the shape is printed). A first request publishes the prompt's state
(untimed). Then each measured request sends the same prompt:

  restored  Store.restore (query, prepare, restore copy into the device
            region, pages into a DynamicCache) + the forward pass of the
            tokens after the restored boundary + argmax;
  floor     a raw copy of the same KV bytes into a cache's tensors (one
            memcpy per layer and K/V, from buffers already in memory) + the
            same suffix forward pass + argmax;
  full      the forward pass of the whole prompt + argmax.

The three alternate within each repeat; medians are reported, the ratio of
the best runs (least disturbed by other load), and the ratio from the parts'
medians (restore or memcpy, plus the suffix pass pooled over both paths). The goal is restored <=
1.2x floor. The machine may be shared: compare within a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

import orbitkv
from orbitkv.transformers import Store


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--page", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5, help="restored and floor measurements")
    ap.add_argument("--full-repeats", type=int, default=2, help="full-recompute measurements")
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if orbitkv._orbitkv._debug_build:
        print("WARNING: a debug build of the orbitkv extension; build it with --release")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.prompt),
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    params = sum(p.numel() for p in model.parameters())
    head_dim = args.hidden // args.heads
    kv_bytes_per_token = 2 * args.layers * args.kv_heads * head_dim * 4
    shape = {
        "model": "llama (random weights, fp32)",
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": head_dim,
        "intermediate": args.intermediate,
        "vocab": args.vocab,
        "params_millions": round(params / 1e6, 1),
        "prompt_tokens": args.prompt,
        "page_tokens": args.page,
        "kv_bytes_per_token": kv_bytes_per_token,
        "torch_threads": torch.get_num_threads(),
    }
    print("shape:", json.dumps(shape))

    # The weights are random, so the model directory holds the config only,
    # and the operator digest (what a deployment sets for large models)
    # names these weights: the seed and the shape.
    model_dir = tempfile.mkdtemp(prefix="okv-ttft-")
    model.config.save_pretrained(model_dir)
    os.environ["ORBITKV_MODEL_FINGERPRINT"] = hashlib.sha256(
        json.dumps({"seed": 0, **shape}, sort_keys=True).encode()
    ).hexdigest()

    pages = args.prompt // args.page
    rt = orbitkv.Runtime(
        {
            "dram": {"capacity_bytes": 2 * pages * args.page * kv_bytes_per_token + (64 << 20)},
            "check_invariants": False,
        }
    )
    store = Store(model, model_dir, rt, page_tokens=args.page, max_tokens=args.prompt)
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    t = time.perf_counter()
    _, staged = store.prefill(ids)
    print(f"published {staged.inserted} pages in {time.perf_counter() - t:.1f} s (prefill + publish, untimed)")

    boundary = (args.prompt - 1) // args.page * args.page
    suffix = ids[:, boundary:]
    # The floor's sources: the same bytes, already in memory, laid out as the
    # cache wants them.
    reference = store.new_cache()
    store.forward(ids[:, :boundary], reference, 0)
    sources = [(layer.keys.clone(), layer.values.clone()) for layer in reference.layers]
    floor_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in sources)
    del reference

    def restored():
        t0 = time.perf_counter()
        r = store.restore(ids)
        assert r.miss is None and r.boundary == boundary, (r.miss, r.boundary)
        t1 = time.perf_counter()
        logits = store.forward(suffix, r.cache, boundary)
        int(logits[0, -1].argmax())
        t2 = time.perf_counter()
        return t2 - t0, {"restore_s": t1 - t0, "suffix_s": t2 - t1, **r.seconds, "bytes": r.bytes}

    def floor():
        cache = store.new_cache()
        dst = [(torch.empty_like(k), torch.empty_like(v)) for k, v in sources]
        t0 = time.perf_counter()
        for layer, (k, v), (dk, dv) in zip(cache.layers, sources, dst):
            dk.copy_(k)
            dv.copy_(v)
            layer.lazy_initialization(dk, dv)
            layer.keys, layer.values = dk, dv
        t1 = time.perf_counter()
        logits = store.forward(suffix, cache, boundary)
        int(logits[0, -1].argmax())
        t2 = time.perf_counter()
        return t2 - t0, {"memcpy_s": t1 - t0, "suffix_s": t2 - t1}

    def full():
        t0 = time.perf_counter()
        logits = store.forward(ids, store.new_cache(), 0)
        int(logits[0, -1].argmax())
        return time.perf_counter() - t0, {}

    # Warm up each path once (allocator, kernels, pages of the regions).
    restored()
    floor()
    samples = {"restored": [], "floor": [], "full": []}
    details = {"restored": [], "floor": []}
    for i in range(args.repeats):
        for name, fn in (("restored", restored), ("floor", floor)):
            s, d = fn()
            samples[name].append(s)
            details[name].append(d)
        if i < args.full_repeats:
            samples["full"].append(full()[0])
        print(
            f"repeat {i + 1}/{args.repeats}: restored {samples['restored'][-1] * 1e3:.1f} ms, "
            f"floor {samples['floor'][-1] * 1e3:.1f} ms"
            + (f", full {samples['full'][-1]:.2f} s" if i < args.full_repeats else "")
        )

    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    restore_parts = {
        k: statistics.median(d[k] for d in details["restored"])
        for k in ("restore_s", "query_ready", "restore_copy", "to_cache")
    }
    # The suffix pass is the same work on both paths; on a loaded machine
    # its time swings the most. The ratio of medians of the parts puts the
    # same (pooled) suffix time under both.
    suffix_med = statistics.median([d["suffix_s"] for d in details["restored"] + details["floor"]])
    memcpy_med = statistics.median(d["memcpy_s"] for d in details["floor"])
    parts_ratio = (restore_parts["restore_s"] + suffix_med) / (memcpy_med + suffix_med)
    result = {
        "shape": shape,
        "restored_tokens": boundary,
        "computed_tokens": args.prompt - boundary,
        "kv_bytes_restored": details["restored"][0]["bytes"],
        "kv_bytes_floor_copy": floor_bytes,
        "ttft_s": med,
        "restored_breakdown_s": restore_parts,
        "floor_memcpy_s": memcpy_med,
        "ratios": {
            "restored_over_floor": med["restored"] / med["floor"],
            "restored_over_full": med["restored"] / med["full"],
            "floor_over_full": med["floor"] / med["full"],
            "restored_over_floor_best": best["restored"] / best["floor"],
            "restored_over_floor_parts": parts_ratio,
        },
        "suffix_s_median": suffix_med,
        "best_s": best,
        "samples_s": samples,
    }
    print()
    print(f"TTFT, {args.prompt}-token prompt, {boundary} tokens restored, {args.prompt - boundary} computed:")
    print(f"  full recompute  {med['full']:9.3f} s")
    print(f"  restored        {med['restored']:9.3f} s   "
          f"(restore {restore_parts['restore_s'] * 1e3:.1f} ms: query+prepare {restore_parts['query_ready'] * 1e3:.1f}, "
          f"copy {restore_parts['restore_copy'] * 1e3:.1f}, into cache {restore_parts['to_cache'] * 1e3:.1f})")
    print(f"  floor           {med['floor']:9.3f} s   (memcpy {result['floor_memcpy_s'] * 1e3:.1f} ms "
          f"of {floor_bytes / 2**20:.0f} MiB)")
    r = result["ratios"]
    print(f"  suffix pass     {suffix_med:9.3f} s   (median over both paths)")
    print(f"  restored / floor = {r['restored_over_floor']:.3f}   (goal <= 1.2; of the best runs: "
          f"{r['restored_over_floor_best']:.3f}; from the parts' medians: {r['restored_over_floor_parts']:.3f})")
    print(f"  restored / full  = {r['restored_over_full']:.4f}   floor / full = {r['floor_over_full']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    store.close()


if __name__ == "__main__":
    main()
