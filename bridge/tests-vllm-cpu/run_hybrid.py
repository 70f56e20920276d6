"""One engine run of a tiny hybrid recurrent model (Qwen3-Next-style: gated
delta net and full attention) for the end-to-end test; a script, as
`run_engine.py`.

    python run_hybrid.py MODEL SOCKET OUT.json [--no-connector] [--withhold-state]

bfloat16 (vLLM's CPU gated-delta-net kernel needs it), prefix caching on,
so vLLM selects `mamba_cache_mode="align"` and raises the block size until
an attention page holds a recurrent state (384 tokens for this model).
`--withhold-state` runs `withheld.WithheldStateConnector`, which saves the
attention pages but no recurrent state. Writes, per prompt, the output
tokens and `num_cached_tokens`, and the engine's block size.
"""

from __future__ import annotations

import json
import sys
import time

# 800 and 500 tokens: with 384-token pages, 768 and 384 can come back.
PROMPTS = [
    [10 + (i * 7) % 480 for i in range(800)],
    [11 + (i * 13) % 480 for i in range(500)],
]


def main(model: str, socket: str, out: str, connector: bool, withhold: bool) -> None:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="WithheldStateConnector" if withhold else "OrbitKVConnector",
            kv_connector_module_path="withheld" if withhold else "orbitkv.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket": socket},
        )
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=2,
        seed=0,
        **kwargs,
    )
    started = time.monotonic() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    results = []
    for prompt in PROMPTS:
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        results.append(
            {
                "prompt_tokens": len(prompt),
                "tokens": list(o.outputs[0].token_ids),
                "num_cached_tokens": int(o.num_cached_tokens or 0),
            }
        )
    with open(out, "w") as f:
        json.dump(
            {
                "startup_s": started,
                "total_s": time.monotonic() - t0,
                "block_size": int(cc.block_size),
                "mamba_cache_mode": str(cc.mamba_cache_mode),
                "results": results,
            },
            f,
        )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], args[1], args[2], "--no-connector" not in sys.argv, "--withhold-state" in sys.argv)
