"""Output parity: a continuation from state OrbitKV restored equals, bit for
bit, the continuation from the live state at the same boundary, on real
transformers model code (Llama, Mistral with a window shorter than the
prompt, and four hybrids).

The live reference is transformers' own cache object captured after the
prefill pass that ended at the boundary (or cropped to it); chunked and
one-shot prefill differ in the last bits, so each restore is compared with
the live state of the same computation.
"""

from __future__ import annotations

import pytest
import torch

import orbitkv
from conftest import (
    MODELS,
    PAGE,
    PROMPT_A,
    PROMPT_B,
    Live,
    continue_logits,
    max_delta,
    prompts,
    record,
)
from orbitkv.transformers import Store


def store_for(saved, name, backend, **kw) -> Store:
    model, model_dir = saved(name)
    return Store(model, model_dir, backend, page_tokens=PAGE, max_tokens=256, **kw)


def expected_pages(store: Store, boundary: int) -> int:
    """Pages a restore at `boundary` reads: the whole prefix, each window's
    rounded trailing pages, one checkpoint."""
    n = 0
    for g in store.groups:
        if g.kind == "prefix":
            n += boundary // PAGE
        elif g.kind == "window":
            n += min(boundary // PAGE, -(-g.past_tokens // PAGE))
        else:
            n += 1
    return n


def check_quiet(rt: orbitkv.Runtime) -> None:
    st = rt.stats()
    assert (st["operations"], st["leases"], st["transfers"], st["bytes_reserved"]) == (0, 0, 0, 0), st
    rt.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_restore_equals_the_live_continuation(saved, rt, name):
    store = store_for(saved, name, rt)
    model = store.model
    a, b = prompts()
    live = Live(store, a, publish=True)
    # Every page of every group was new.
    per_group = {"prefix": 6, "window": 6, "checkpoint": 6}
    assert live.staged.inserted == sum(per_group[g.kind] for g in store.groups)

    # B shares A's 96 tokens: the longest legal prefix is all of them.
    r = store.restore(b)
    assert r.miss is None, r
    assert r.boundary == PROMPT_A
    assert r.pages == expected_pages(store, PROMPT_A)
    ref = continue_logits(model, live.at(PROMPT_A), b, PROMPT_A)
    got = continue_logits(model, r.cache, b, PROMPT_A)
    delta = max_delta(ref, got)
    assert delta == 0.0, delta
    assert torch.equal(ref, got)

    # A itself: the prompt limit is 95, so the boundary is 80, and the last
    # page is computed again.
    r80 = store.restore(a)
    assert (r80.miss, r80.boundary) == (None, PROMPT_A - PAGE)
    ref80 = continue_logits(model, live.at(80), a, 80)
    delta80 = max_delta(ref80, continue_logits(model, r80.cache, a, 80))
    assert delta80 == 0.0
    record("restore == live", name, boundary=r.boundary, max_abs_dlogit=delta, prompt=PROMPT_B)
    record("restore == live (limit len-1)", name, boundary=r80.boundary, max_abs_dlogit=delta80, prompt=PROMPT_A)
    store.close()
    check_quiet(rt)
    m = rt.stats()["metrics"]
    assert (m["hits"], m["restores"]) == (2, 2)


@pytest.mark.parametrize("name", ["llama", "mistral", "zamba2"])
def test_generate_restores_the_prefix_and_computes_the_rest(saved, rt, name):
    store = store_for(saved, name, rt)
    a, b = prompts(seed=2)
    live = Live(store, a, publish=True)
    gen = store.generate(b, max_new_tokens=4)
    assert (gen.miss, gen.boundary, gen.computed_tokens) == (None, PROMPT_A, PROMPT_B - PROMPT_A)
    # The same tokens from the live state: prefill the rest, decode greedily.
    cache = live.at(PROMPT_A)
    logits, _ = store.prefill(b, cache, PROMPT_A, publish=False)
    want, pos = [int(logits[0, -1].argmax())], PROMPT_B
    while len(want) < 4:
        logits = store.forward(torch.tensor([[want[-1]]]), cache, pos)
        pos += 1
        want.append(int(logits[0, -1].argmax()))
    assert gen.new_tokens == want
    assert gen.tokens == b[0].tolist() + want
    # generate published B's own pages: B now restores at its last page.
    again = store.generate(b, max_new_tokens=1)
    assert (again.boundary, again.computed_tokens) == (112, 8)
    assert again.new_tokens == want[:1]
    # Nothing stored for an unrelated prompt: everything is computed.
    other = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(9))
    cold = store.generate(other, max_new_tokens=1)
    assert (cold.miss, cold.boundary, cold.computed_tokens) == ("not_found", 0, 40)
    store.close()
    check_quiet(rt)


@pytest.mark.parametrize("name", ["llama", "bamba"])
def test_one_shot_cache_saved_after_the_fact(saved, rt, name):
    """`save` stores what a cache computed elsewhere holds: for a hybrid
    only the checkpoint at its own (page-aligned) end, so only that
    boundary is legal."""
    store = store_for(saved, name, rt)
    model = store.model
    a, b = prompts(seed=3)
    cache = store.new_cache()
    continue_logits(model, cache, a, 0)
    inserted = store.save(a, cache)
    hybrid = store.checkpoint is not None
    assert inserted == (7 if hybrid else 6)
    r = store.restore(b)
    assert (r.miss, r.boundary) == (None, PROMPT_A)
    ref = continue_logits(model, cache, b, PROMPT_A)
    assert max_delta(ref, continue_logits(model, r.cache, b, PROMPT_A)) == 0.0
    r80 = store.restore(a)
    if hybrid:
        # A's query hashes its pages up to 80 (the limit is 95); no
        # checkpoint there, so no boundary in the span is complete.
        assert (r80.miss, r80.boundary, r80.cache) == ("incomplete_group", 0, None)
    else:
        assert (r80.miss, r80.boundary) == (None, 80)
    store.close()
    check_quiet(rt)


@pytest.mark.parametrize("name", ["llama", "zamba2"])
def test_restore_through_a_manager_client(saved, tmp_path, name):
    """The same parity through `orbitkv serve`: device regions are the
    client's shared memory, pages the manager's pool."""
    import serve_support as ss

    manager = ss.Manager(ss.orbitkv_binary(), dram="64MiB").start()
    try:
        with orbitkv.Client(manager.socket, "transformers") as client:
            store = store_for(saved, name, client)
            a, b = prompts(seed=4)
            live = Live(store, a, publish=True)
            r = store.restore(b)
            assert (r.miss, r.boundary) == (None, PROMPT_A)
            ref = continue_logits(store.model, live.at(PROMPT_A), b, PROMPT_A)
            delta = max_delta(ref, continue_logits(store.model, r.cache, b, PROMPT_A))
            assert delta == 0.0
            record("restore == live (Client)", name, boundary=r.boundary, max_abs_dlogit=delta)
            store.close()
        manager.wait_metric("leases", 0)
    finally:
        manager.stop()


def test_a_refused_registration_is_a_typed_error(saved):
    """A manager that refuses the cache's registration (a page larger than
    its DRAM extent) raises `OrbitKVError` with the manager's reason: a
    refusal, never reported as a lost connection."""
    import serve_support as ss
    from orbitkv.transformers import OrbitKVError

    config = ss.CONFIG.replace("extent_bytes = 65536", "extent_bytes = 4096")
    manager = ss.Manager(ss.orbitkv_binary(), dram="64MiB", config=config).start()
    try:
        with orbitkv.Client(manager.socket, "transformers") as client:
            with pytest.raises(OrbitKVError) as err:
                store_for(saved, "llama", client)
            assert err.value.kind == "invalid", err.value
            assert err.value.detail["kind"] == "page_exceeds_extent", err.value
            # It says what to change.
            assert "raise the manager's dram.extent_bytes, or use a smaller page_tokens" in str(err.value)
            assert not isinstance(err.value, orbitkv.ConnectionError)
    finally:
        manager.stop()


def test_a_session_quota_is_a_typed_error(saved):
    """The manager allows one session per process and this process holds
    it: the store's open_session is refused before it is queued, and
    raises `OrbitKVError` with the limit (not `QueueFull`)."""
    import serve_support as ss
    from orbitkv.transformers import OrbitKVError

    config = ss.CONFIG.replace("[serve]\n", "[serve]\nmax_sessions_per_process = 1\n")
    manager = ss.Manager(ss.orbitkv_binary(), dram="64MiB", config=config).start()
    try:
        with orbitkv.Client(manager.socket, "holder") as holder:
            ss.register(holder)
            ss.open_session(holder)
            with orbitkv.Client(manager.socket, "transformers") as client:
                with pytest.raises(OrbitKVError) as err:
                    store_for(saved, "llama", client)
                assert err.value.kind == "limit", err.value
                assert err.value.detail["name"] == "max_sessions_per_process", err.value
                assert "raise [serve] max_sessions_per_process" in str(err.value), err.value
    finally:
        manager.stop()
