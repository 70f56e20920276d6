"""One engine run for the end-to-end test (a script: vLLM's engine spawns
processes, so it runs under `__main__` in its own interpreter).

    python run_engine.py MODEL SOCKET OUT.json [--no-connector]

Generates greedily for the prompts in PROMPTS and writes, per prompt, the
output tokens and `num_cached_tokens` (what the engine did not compute: in
a fresh engine, the tokens that came from OrbitKV).
"""

from __future__ import annotations

import json
import sys
import time

# Token-id prompts of 100, 150 and 70 tokens (32-token pages: 96, 128 and
# 64 tokens can come back; the last prompt token is always computed).
PROMPTS = [
    [10 + (i * 7) % 480 for i in range(100)],
    [11 + (i * 13) % 480 for i in range(150)],
    [12 + (i * 3) % 480 for i in range(70)],
]


def main(model: str, socket: str, out: str, connector: bool) -> None:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OrbitKVConnector",
            kv_connector_module_path="orbitkv.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket": socket},
        )
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )
    started = time.monotonic() - t0
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    results = []
    for prompt in PROMPTS:  # one at a time: no prompt hits another's pages
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        results.append(
            {
                "prompt_tokens": len(prompt),
                "tokens": list(o.outputs[0].token_ids),
                "num_cached_tokens": int(o.num_cached_tokens or 0),
            }
        )
    with open(out, "w") as f:
        json.dump({"startup_s": started, "total_s": time.monotonic() - t0, "results": results}, f)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], args[1], args[2], "--no-connector" not in sys.argv)
