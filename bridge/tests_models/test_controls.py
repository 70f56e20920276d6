"""Negative controls: state OrbitKV must not hand back, and the proof that
each would have mattered.

Each test makes the runtime see incomplete or foreign state (a checkpoint
or window page missing, a page corrupted on the SSD tier, another model's
weights, another dtype) and checks it answers with an earlier boundary or a
miss. Then it runs the model directly on the state a careless cache would
have restored and checks the logits differ from the live continuation by
more than MEASURABLE: the control can fail.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

import orbitkv
from conftest import (
    HYBRIDS,
    MEASURABLE,
    MODELS,
    PAGE,
    PROMPT_A,
    Live,
    cast_cache,
    continue_logits,
    max_delta,
    prompts,
    record,
    runtime_config,
    swap_recurrent,
    zero_recurrent,
)
from orbitkv.transformers import Store


def new_store(model, model_dir, rt) -> Store:
    return Store(model, model_dir, rt, page_tokens=PAGE, max_tokens=256)


@pytest.mark.parametrize("name", HYBRIDS)
def test_dropped_checkpoint_selects_an_earlier_boundary(saved, rt, name):
    model, model_dir = saved(name)
    store = new_store(model, model_dir, rt)
    a, b = prompts(seed=5)
    live = Live(store, a, publish=False)
    live.staged.discard(store.checkpoint.id, PROMPT_A)
    store.publish(live.staged)

    # Every other page is there; without the checkpoint at 96 the contract
    # allows 80 at most.
    r = store.restore(b)
    assert (r.miss, r.boundary) == (None, PROMPT_A - PAGE)
    ref80 = continue_logits(model, live.at(80), b, 80)
    assert max_delta(ref80, continue_logits(model, r.cache, b, 80)) == 0.0

    # What restoring at 96 anyway would have computed: attention through 96
    # with the recurrent state of 80 (the newest checkpoint), or with none.
    ref96 = continue_logits(model, live.at(PROMPT_A), b, PROMPT_A)
    stale = max_delta(ref96, continue_logits(model, swap_recurrent(live.at(PROMPT_A), live.at(80)), b, PROMPT_A))
    zeroed = max_delta(ref96, continue_logits(model, zero_recurrent(live.at(PROMPT_A)), b, PROMPT_A))
    assert stale > MEASURABLE and zeroed > MEASURABLE, (stale, zeroed)
    record("checkpoint dropped", name, boundary=r.boundary, stale_dlogit=f"{stale:.3g}", zeroed_dlogit=f"{zeroed:.3g}")
    store.close()


def test_dropped_window_page_selects_an_earlier_boundary(saved, rt):
    model, model_dir = saved("mistral")
    store = new_store(model, model_dir, rt)
    (window,) = store.windows
    assert window.id == 0 and store.prefix is None and window.past_tokens == 39
    a, b = prompts(seed=6)
    live = Live(store, a, publish=False)
    live.staged.discard(window.id, 64)
    store.publish(live.staged)

    # 39 past tokens round up to three pages: boundaries 64, 80 and 96 each
    # need the page [48, 64); 48 is the largest that does not.
    r = store.restore(b)
    assert (r.miss, r.boundary) == (None, 48)
    ref48 = continue_logits(model, live.at(48), b, 48)
    assert max_delta(ref48, continue_logits(model, r.cache, b, 48)) == 0.0

    # Restoring at 96 without that page: the window's tokens 57..63 (the
    # first seven of the 39 the layers keep) would be missing.
    wrong = live.at(PROMPT_A)
    for layer in wrong.layers:
        assert layer.keys.shape[2] == 39
        layer.keys = layer.keys.clone()
        layer.values = layer.values.clone()
        layer.keys[:, :, :7].zero_()
        layer.values[:, :, :7].zero_()
    ref96 = continue_logits(model, live.at(PROMPT_A), b, PROMPT_A)
    delta = max_delta(ref96, continue_logits(model, wrong, b, PROMPT_A))
    assert delta > MEASURABLE, delta
    record("window page dropped", "mistral", boundary=r.boundary, wrong_state_dlogit=f"{delta:.3g}")
    store.close()


def _victim(store: Store):
    """The page whose corruption the control injects, one the restore at 96
    needs: the checkpoint at 96, else the window page ending at 96, else
    the first prefix page."""
    if store.checkpoint is not None:
        return store.checkpoint, PROMPT_A
    if store.windows:
        return store.windows[0], PROMPT_A
    return store.prefix, PAGE


FLIPPED = 64  # elements


def _flipped_bytes(group):
    """The page bytes the test corrupts: bit 0x80 of byte 2 (the lowest
    exponent bit of a float32: the value doubles or halves) of each of the
    last FLIPPED elements of the page's first part. The last ones, because
    transformers keeps one conv input more than the kernel reads: the
    oldest conv column never changes an output."""
    part = group.slots[0].parts[0]
    size = part.dtype.itemsize
    end = part.offset + part.nbytes
    return [end - (i + 1) * size + 2 for i in range(FLIPPED)]


def _flip_in_cache(cache, group, page_end: int) -> None:
    """Flips, in a live cache, the bits the test flips on disk."""
    slot = group.slots[0]
    part = slot.parts[0]
    layer = cache.layers[slot.layer]
    if group.kind == "checkpoint":
        kind, idx = part.name.split(".")
        states = layer.conv_states if kind == "conv" else layer.recurrent_states
        elements = [states[int(idx)].view(-1)[-FLIPPED:]]
    else:
        # The page part is [heads, page tokens, head_dim]; its last elements
        # are the last tokens of the last head.
        tensor = getattr(layer, part.name)
        heads, tokens, dim = part.shape
        assert FLIPPED % dim == 0
        # The page's tokens at their indices among those the layer holds.
        last = tensor.shape[2] - (PROMPT_A - (page_end - 1))
        elements = [tensor[0, -1, last - i, :] for i in range(FLIPPED // dim)]
    for e in elements:
        raw = e.contiguous().view(torch.uint8).view(-1, e.element_size())
        raw[:, 2] ^= 0x80
        e.copy_(raw.view(-1).view(e.dtype).view(e.shape))


def _segment_offset(ssd_dir: Path, needle: bytes):
    for seg in sorted(ssd_dir.glob("seg-*.okv")):
        data = seg.read_bytes()
        at = data.find(needle)
        if at >= 0:
            return seg, at
    return None


@pytest.mark.parametrize("name", MODELS)
def test_page_corrupted_on_ssd_is_a_checksum_miss(saved, tmp_path, name):
    model, model_dir = saved(name)
    ssd = tmp_path / "ssd"
    # DRAM holds a few prompts' pages; older ones are demoted to the SSD.
    rt = orbitkv.Runtime(
        runtime_config(
            dram={"capacity_bytes": 512 << 10, "extent_bytes": 64 << 10, "first_touch": False},
            ssd={"dir": str(ssd), "capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
        )
    )
    store = new_store(model, model_dir, rt)
    a, b = prompts(seed=7)
    live = Live(store, a, publish=True)
    group, page_end = _victim(store)
    payload = bytes(store._regions[group.id][1][page_end // PAGE - 1].numpy())

    # Publish other prompts until the victim's record is written to the SSD.
    found = None
    for seed in range(100, 140):
        filler = torch.randint(0, 256, (1, PROMPT_A), generator=torch.Generator().manual_seed(seed))
        store.prefill(filler)
        # Demotions become visible (indexed) once written and synced.
        deadline = time.monotonic() + 10
        while True:
            assert rt.tick() == []
            m = rt.stats()["metrics"]["demotions"]
            if m.get("written", 0) + m.get("failed", 0) >= m.get("submitted", 0):
                break
            assert time.monotonic() < deadline, f"demotions never completed: {m}"
            time.sleep(0.001)
        failed = rt.stats()["metrics"]["demotions"].get("failed", 0)
        assert failed == 0, f"{failed} SSD writes failed (is {ssd} full?)"
        found = _segment_offset(ssd, payload[:512])
        if found:
            break
    assert found, f"the victim page never reached the SSD: {rt.stats()['metrics']}"
    seg, at = found
    with open(seg, "r+b") as f:
        for offset in _flipped_bytes(group):
            f.seek(at + offset)
            byte = f.read(1)[0]
            f.seek(at + offset)
            f.write(bytes([byte ^ 0x80]))

    r = store.restore(b)
    assert (r.miss, r.boundary, r.cache) == ("checksum", 0, None), (r, json.dumps(rt.stats()))
    assert rt.stats()["metrics"]["checksum_failures"] == 1
    # The corrupt record left the index: the next restore avoids it.
    again = store.restore(b)
    if group.kind == "prefix":
        assert again.miss is not None and again.boundary == 0, again
    else:
        assert again.miss is None and again.boundary < page_end, again
        ref = continue_logits(model, live.at(again.boundary), b, again.boundary)
        assert max_delta(ref, continue_logits(model, again.cache, b, again.boundary)) == 0.0

    # The corrupted bytes, had they been restored.
    wrong = live.at(PROMPT_A)
    _flip_in_cache(wrong, group, page_end)
    ref96 = continue_logits(model, live.at(PROMPT_A), b, PROMPT_A)
    delta = max_delta(ref96, continue_logits(model, wrong, b, PROMPT_A))
    assert delta > MEASURABLE, delta
    record("page corrupted on SSD", name, miss=r.miss, group=group.kind, wrong_state_dlogit=f"{delta:.3g}")
    store.close()
    rt.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_other_weights_or_dtype_never_hit(saved, rt, name):
    model, model_dir = saved(name)
    store = new_store(model, model_dir, rt)
    a, b = prompts(seed=8)
    live = Live(store, a, publish=True)
    assert store.restore(b).boundary == PROMPT_A  # the state is there
    ref = live.at(PROMPT_A)

    # Same architecture and config, other weights (another directory).
    other, other_dir = saved(name, seed=1)
    s_other = new_store(other, other_dir, rt)
    assert s_other.identity["identity"] != store.identity["identity"]
    r = s_other.restore(b)
    assert (r.miss, r.cache) == ("not_found", None)
    own = Live(s_other, a, publish=False).at(PROMPT_A)
    weights = max_delta(
        continue_logits(other, own, b, PROMPT_A), continue_logits(other, copy.deepcopy(ref), b, PROMPT_A)
    )
    assert weights > MEASURABLE, weights

    # The same weights in bfloat16 (the same directory).
    half = copy.deepcopy(model).to(torch.bfloat16)
    s_half = new_store(half, model_dir, rt)
    assert s_half.namespace != store.namespace
    r = s_half.restore(b)
    assert (r.miss, r.cache) == ("not_found", None)
    own = Live(s_half, a, publish=False).at(PROMPT_A)
    dtype = max_delta(
        continue_logits(half, own, b, PROMPT_A),
        continue_logits(half, cast_cache(ref, torch.bfloat16), b, PROMPT_A),
    )
    assert dtype > MEASURABLE, dtype
    record("other weights / dtype", name, miss="not_found", weights_dlogit=f"{weights:.3g}", dtype_dlogit=f"{dtype:.3g}")
    for s in (store, s_other, s_half):
        s.close()
