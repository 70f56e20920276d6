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
