"""Tiny random-weight Llama directories made locally (config, safetensors
weights, a word-level tokenizer): no hub access. Different seeds are
different weights, hence different computation identities."""

from __future__ import annotations

from pathlib import Path


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer: `tok<i>` is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    while len(vocab) < vocab_size:
        vocab[f"tok{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)


def make_llama(
    path: Path, seed: int, *, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    save_tokenizer(path, cfg.vocab_size)
    return path


def make_hybrid(path: Path, family: str, seed: int = 0, *, window: int = 32) -> Path:
    """A tiny random model whose config has sliding-window layers, as the
    real families lay them out (`config.layer_types`):

    - ``gemma2``: alternating, sliding first (vLLM's group 0 is sliding);
    - ``gpt_oss``: the same alternation, in gpt-oss's config;
    - ``qwen2``: full attention below ``max_window_layers``, sliding above;
    - ``gemma3``: five sliding layers to one full (vLLM makes six groups);
    - ``qwen3_next``: three recurrent (gated delta net) layers to one full
      attention layer (vLLM makes Mamba groups beside the attention one).

    Every layer has 2 KV heads of 16 dims, as `make_llama(..., kv_heads=2,
    head_dim=16)`."""
    import torch
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=window,
    )
    if family == "gemma2":
        cfg = tf.Gemma2Config(num_hidden_layers=4, head_dim=16, **common)
        cls = tf.Gemma2ForCausalLM
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(
            num_hidden_layers=4, head_dim=16, num_local_experts=2, num_experts_per_tok=1, **common
        )
        cls = tf.GptOssForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(
            num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, **common
        )
        cls = tf.Qwen2ForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=6, head_dim=16, **common)
        cls = tf.Gemma3ForCausalLM
    elif family in ("qwen3_next", "qwen3_next_cpu"):
        # Three gated-delta-net (recurrent) layers to one full-attention
        # layer, as Qwen3-Next lays them out; tiny linear-attention heads
        # (``qwen3_next_cpu``: the head sizes vLLM's CPU kernels take, 64
        # for attention and 128 for the delta net).
        del common["sliding_window"]
        cpu = family == "qwen3_next_cpu"
        cfg = tf.Qwen3NextConfig(
            num_hidden_layers=4,
            head_dim=64 if cpu else 16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128 if cpu else 8,
            linear_value_head_dim=128 if cpu else 8,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **common,
        )
        cls = tf.Qwen3NextForCausalLM
    elif family == "granite4":
        # Granite 4 (GraniteMoeHybrid): Mamba2 layers and one attention
        # layer (`layer_types`).
        del common["sliding_window"]
        cfg = tf.GraniteMoeHybridConfig(
            num_hidden_layers=4,
            layer_types=["mamba", "mamba", "mamba", "attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=4,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=16,
            **common,
        )
        cls = tf.GraniteMoeHybridForCausalLM
    else:
        raise ValueError(family)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cls(cfg).save_pretrained(path)
    save_tokenizer(path, cfg.vocab_size)
    return path
