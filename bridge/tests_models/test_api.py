"""What the adapter refuses, and the shape of what it registers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import orbitkv
from conftest import PAGE, _COMMON, prompts, runtime_config
from orbitkv.transformers import Store, UnsupportedModel, page_hashes


def saved_model(tmp_path, config, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    return model


def test_groups_layout_and_identity(saved, rt):
    model, model_dir = saved("zamba2")
    store = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)
    # Hybrid layers 1 and 3 carry attention and Mamba state; 0 and 2 Mamba only.
    assert [(g.id, g.rule, [s.layer for s in g.slots]) for g in store.groups] == [
        (0, "prefix", [1, 3]),
        (1, "checkpoint", [0, 1, 2, 3]),
    ]
    assert store.groups[1].components == ["recurrent_checkpoint", "convolution_state"]
    for g in store.groups:
        assert g.page_bytes % 64 == 0
        assert g.page_bytes == sum(s.padded_bytes for s in g.slots)
    inputs = {i["name"]: i for i in store.identity["inputs"]}
    assert inputs["engine"]["value"] == "transformers"
    assert inputs["engine_release"]["value"] == transformers.__version__
    assert inputs["model_artifacts"]["source"] == "directory"
    # The same model and directory give the same identity and namespace.
    again = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)
    assert (again.identity["identity"], again.namespace) == (store.identity["identity"], store.namespace)
    # Another page size is another namespace, never the same bytes.
    other = Store(model, model_dir, rt, page_tokens=2 * PAGE, max_tokens=256)
    assert other.namespace != store.namespace
    for s in (store, again, other):
        s.close()


def test_page_hashes_chain_the_whole_prefix():
    a, b = prompts()
    ha, hb = page_hashes(a[0], PAGE), page_hashes(b[0], PAGE)
    assert len(ha) == 6 and len(hb) == 7 and hb[:6] == ha
    changed = a.clone()
    changed[0, 3] += 1
    hc = page_hashes(changed[0], PAGE)
    # A change in page 0 changes every later page's hash.
    assert all(x != y for x, y in zip(ha, hc))
    assert page_hashes(a[0, :PAGE - 1], PAGE) == []


def test_refusals(tmp_path, rt):
    jamba = transformers.JambaConfig(
        num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, **_COMMON,
    )
    model = saved_model(tmp_path / "jamba", jamba)
    with pytest.raises(UnsupportedModel, match="jamba: .*recurrent state"):
        Store(model, tmp_path / "jamba", rt, page_tokens=PAGE)

    narrow = transformers.MistralConfig(num_hidden_layers=1, sliding_window=8, **_COMMON)
    model = saved_model(tmp_path / "narrow", narrow)
    with pytest.raises(UnsupportedModel, match="keeps 7 past tokens, fewer than a page"):
        Store(model, tmp_path / "narrow", rt, page_tokens=PAGE)

    llama = transformers.LlamaConfig(num_hidden_layers=1, **_COMMON)
    model = saved_model(tmp_path / "llama", llama)
    eps = model.config.rms_norm_eps
    model.config.rms_norm_eps = 1e-3
    with pytest.raises(orbitkv.IdentityError, match="rms_norm_eps"):
        Store(model, tmp_path / "llama", rt, page_tokens=PAGE)
    model.config.rms_norm_eps = eps

    with pytest.raises(orbitkv.IdentityError):
        Store(model, tmp_path / "nowhere", rt, page_tokens=PAGE)
    with pytest.raises(ValueError, match="wall-clock Runtime"):
        Store(model, tmp_path / "llama", orbitkv.Runtime(runtime_config(), simulated_clock=True), page_tokens=PAGE)
    with pytest.raises(TypeError, match="orbitkv.Runtime or orbitkv.Client"):
        Store(model, tmp_path / "llama", object(), page_tokens=PAGE)
    with pytest.raises(ValueError, match="page_tokens"):
        Store(model, tmp_path / "llama", rt, page_tokens=0)

    store = Store(model, tmp_path / "llama", rt, page_tokens=PAGE, max_tokens=128)
    with pytest.raises(ValueError, match="one sequence"):
        store.restore(torch.zeros((2, 40), dtype=torch.long))
    # Shorter than a page plus one token: nothing to look up.
    assert store.restore(torch.zeros((1, PAGE), dtype=torch.long)).miss == "prompt_too_short"
    store.close()


def test_prompt_longer_than_max_tokens_stores_and_restores_a_prefix(saved, rt):
    model, model_dir = saved("bamba")
    store = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=64)
    a, b = prompts(seed=11)
    _, staged = store.prefill(a)
    # Four pages per group fit the regions; the rest is computed, not stored.
    assert staged.inserted == 8
    r = store.restore(b)
    assert (r.miss, r.boundary) == (None, 64)
    store.close()


def test_close_returns_everything(saved, rt):
    model, model_dir = saved("llama")
    store = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)
    a, _ = prompts()
    store.prefill(a)
    store.close()
    store.close()
    st = rt.stats()
    assert (st["sessions"], st["device_pages"], st["leases"], st["bytes_reserved"]) == (0, 0, 0, 0), json.dumps(st)


def test_stores_share_a_runtime_across_threads(saved, rt):
    """Two models' stores on one runtime, each driven from its own thread:
    whichever ticks hands the other its events."""
    import threading

    from conftest import Live, continue_logits, max_delta

    errors = []

    def work(name, seed):
        try:
            model, model_dir = saved(name)
            store = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)
            a, b = prompts(seed=seed)
            for _ in range(2):
                live = Live(store, a, publish=True)
                r = store.restore(b)
                assert (r.miss, r.boundary) == (None, 96), r
                ref = continue_logits(model, live.at(96), b, 96)
                assert max_delta(ref, continue_logits(model, r.cache, b, 96)) == 0.0
            store.close()
        except BaseException as e:  # reported below
            errors.append((name, repr(e)))

    # Build both first: saving models is not thread-safe in the fixture.
    saved("llama")
    saved("bamba")
    threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("llama", 21), ("bamba", 22))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    st = rt.stats()
    assert (st["sessions"], st["operations"], st["leases"], st["device_pages"]) == (0, 0, 0, 0)


def test_a_closed_store_refuses_work(saved, rt):
    model, model_dir = saved("llama")
    store = Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)
    store.close()
    a, _ = prompts()
    with pytest.raises(RuntimeError, match="the store is closed"):
        store.restore(a)
