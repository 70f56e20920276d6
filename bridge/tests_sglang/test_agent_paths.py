"""Which path each call's bytes take, on the real SGLang host pools against
a real `orbitkv serve`: every byte is moved by this process's copy agent.
v1 and v2 transfers (the KV pool and an SWA side pool, each its own agent
region and storage group) go straight between the host pool and the
manager; the legacy calls, and host indices that are not page-aligned, go
through a bounce slot (a bridge-owned agent region). Exact bytes for each
pool, boundaries only where both pools hold their pages, refused input,
and no lease or reserved byte left behind."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_storage_hash_str

from conftest import LAYOUTS, PAGE, backend, fill, host_pool, keys_for, page_bytes, quiet, starts_of

WINDOW_PAGES = 2


def swa_backend(manager, layout: str, **kw):
    kv, swa = host_pool(layout), host_pool(layout)
    be = backend(kv, manager.socket, register=False, swa_window_tokens=WINDOW_PAGES * PAGE, **kw)
    be.register_mem_host_pool_v2(kv, PoolName.KV)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    be.on_host_pools_registered()
    return be, kv, swa


def kv_transfer(keys, host_indices) -> PoolTransfer:
    return PoolTransfer(name=PoolName.KV, keys=keys, host_indices=host_indices)


def swa_transfer(keys, host_indices=None) -> PoolTransfer:
    return PoolTransfer(
        name=PoolName.SWA, keys=keys, host_indices=host_indices, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def indices(starts: List[int]) -> torch.Tensor:
    """Host indices of pages starting at `starts` (PAGE consecutive slots each)."""
    return torch.cat([torch.arange(s, s + PAGE, dtype=torch.int64) for s in starts])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v2_every_pool_through_the_agent(manager, layout):
    be, kv, swa = swa_backend(manager, layout)
    n = 6
    keys = get_storage_hash_str(list(range(n * PAGE)), None, page_size=PAGE)
    kv_src, swa_src = kv.alloc(n * PAGE), swa.alloc(n * PAGE)
    kv_exp = fill(kv, starts_of(kv_src), seed=51)
    swa_exp = fill(swa, starts_of(swa_src), seed=52)

    # KV for all six pages, SWA only for pages 2 and 3 (v2, one call).
    res = be.batch_set_v2([kv_transfer(keys, kv_src), swa_transfer(keys[2:4], swa_src[2 * PAGE : 4 * PAGE])])
    assert res == {PoolName.KV: [True] * n, PoolName.SWA: [True, True]}

    # Only boundary 4 has its window: a KV read of six pages gets four, a
    # prefix, and the pages past it are not written.
    kv_dst, swa_dst = kv.alloc(n * PAGE), swa.alloc(WINDOW_PAGES * PAGE)
    untouched = [page_bytes(kv, s) for s in starts_of(kv_dst)[4:]]
    got = be.batch_get_v2([kv_transfer(keys, kv_dst), swa_transfer(keys[2:4], swa_dst)])
    assert got == {PoolName.KV: [True] * 4 + [False] * 2, PoolName.SWA: [True, True]}
    assert [page_bytes(kv, s) for s in starts_of(kv_dst)[:4]] == kv_exp[:4]
    assert [page_bytes(kv, s) for s in starts_of(kv_dst)[4:]] == untouched
    assert [page_bytes(swa, s) for s in starts_of(swa_dst)] == swa_exp[2:4]

    # The window ending at page 6 arrives: all six KV pages, through v1 too.
    assert be.batch_set_v2([swa_transfer(keys[4:6], swa_src[4 * PAGE :])]) == {PoolName.SWA: [True, True]}
    kv_dst2, swa_dst2 = kv.alloc(n * PAGE), swa.alloc(WINDOW_PAGES * PAGE)
    assert be.batch_get_v1(keys, kv_dst2) == [True] * n
    assert [page_bytes(kv, s) for s in starts_of(kv_dst2)] == kv_exp
    got = be.batch_get_v2([swa_transfer(keys[4:6], swa_dst2)])
    assert got == {PoolName.SWA: [True, True]}
    assert [page_bytes(swa, s) for s in starts_of(swa_dst2)] == swa_exp[4:6]
    # A window never stored: nothing, and the destination is not written.
    swa_dst3 = swa.alloc(WINDOW_PAGES * PAGE)
    before = [page_bytes(swa, s) for s in starts_of(swa_dst3)]
    assert be.batch_get_v2([swa_transfer(keys[0:2], swa_dst3)]) == {PoolName.SWA: [False, False]}
    assert [page_bytes(swa, s) for s in starts_of(swa_dst3)] == before

    stats = be.get_stats()
    # Every page moved straight between a host pool and the manager.
    moved = (n + 2 + 2) + (4 + 2 + n + 2)
    assert stats["agent_direct_pages"] == moved
    assert "agent_bounce_pages" not in stats
    assert "error" not in stats["misses"]
    quiet(manager)


def test_legacy_calls_go_through_a_bounce_slot(manager):
    host = host_pool("layer_first")
    # Three bounce slots: seven pages take three rounds each way.
    be = backend(host, manager.socket, staging_pages=3)
    keys = keys_for("legacy-bounce", 7)
    src = host.alloc(7 * PAGE)
    exp = fill(host, starts_of(src), seed=61)
    values = [host.get_data_page(s) for s in starts_of(src)]
    assert be.batch_set(keys, values) is True
    assert be.batch_exists(keys) == 7

    targets = [host.get_dummy_flat_data_page() for _ in keys]
    got = be.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert [t.view(torch.uint8).numpy().tobytes() for t in targets] == exp
    # The same bytes as the v1 path stores and reads (one namespace).
    dst = host.alloc(7 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 7
    assert [page_bytes(host, s) for s in starts_of(dst)] == exp

    # A page missing in the second round: a prefix, later targets untouched.
    holed = keys[:4] + keys_for("absent", 1) + keys[5:]
    targets = [host.get_dummy_flat_data_page() for _ in holed]
    got = be.batch_get(holed, targets)
    assert [g is not None for g in got] == [True] * 4 + [False] * 3
    assert [t.view(torch.uint8).numpy().tobytes() for t in targets[:4]] == exp[:4]
    assert all(int(t.abs().sum()) == 0 for t in targets[4:])
    # A target of the wrong size is refused before anything moves.
    assert be.batch_get(keys[:1], [torch.zeros(3)]) == [None]

    stats = be.get_stats()
    assert stats["agent_bounce_pages"] == 7 + 7 + 4
    assert stats["agent_direct_pages"] == 7
    assert stats["misses"].get("bad_input") == 1
    assert "error" not in stats["misses"]
    quiet(manager)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_unaligned_host_indices_exact_bytes(manager, layout):
    """A page may start at any slot in these layouts (SGLang's own
    get_data_page slices from any index): such pages go through a bounce
    slot and round-trip exactly, between unaligned and aligned places."""
    host = host_pool(layout)
    be = backend(host, manager.socket)
    keys = keys_for(f"unaligned-{layout}", 2)
    base = starts_of(host.alloc(3 * PAGE))[0]
    src = [base + 1, base + 1 + PAGE]
    exp = fill(host, src, seed=71)
    assert be.batch_set_v1(keys, indices(src)) == [True, True]

    # Back into aligned pages (the agent straight into the host pool) ...
    dst = host.alloc(2 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True, True]
    assert [page_bytes(host, s) for s in starts_of(dst)] == exp
    # ... and into unaligned ones (a bounce slot), leaving the slots
    # around them as they were.
    base2 = starts_of(host.alloc(3 * PAGE))[0]
    edge = [page_bytes(host, base2)[:4], page_bytes(host, base2 + 2 * PAGE)[-4:]]
    before = host.get_data_page(base2, flat=False).clone()
    dst2 = [base2 + 3, base2 + 3 + PAGE]
    assert be.batch_get_v1(keys, indices(dst2)) == [True, True]
    assert [page_bytes(host, s) for s in dst2] == exp
    after = host.get_data_page(base2, flat=False)
    # Slots base2 .. base2+2 (before the first page) are untouched.
    if layout == "layer_first":
        assert torch.equal(after[:, :, :3], before[:, :, :3])
    else:
        assert torch.equal(after[:, :3], before[:, :3])
    assert edge[0] == page_bytes(host, base2)[:4]

    stats = be.get_stats()
    assert stats["agent_bounce_pages"] == 4 and stats["agent_direct_pages"] == 2
    assert stats["misses"] == {}
    quiet(manager)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_noncontiguous_host_indices_are_refused(manager, layout):
    host = host_pool(layout)
    be = backend(host, manager.socket)
    keys = keys_for(f"holes-{layout}", 2)
    src = host.alloc(2 * PAGE)
    fill(host, starts_of(src), seed=81)
    holed = src.clone()
    holed[PAGE + 1], holed[PAGE + 2] = src[PAGE + 2], src[PAGE + 1]  # page 1's slots out of order
    assert be.batch_set_v1(keys, holed) == [False, False]
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, src) == [True, True]
    dst = host.alloc(2 * PAGE)
    before = [page_bytes(host, s) for s in starts_of(dst)]
    bad = dst.clone()
    bad[1] = dst[0]  # page 0 names one slot twice
    assert be.batch_get_v1(keys, bad) == [False, False]
    assert [page_bytes(host, s) for s in starts_of(dst)] == before
    assert be.get_stats()["misses"] == {"noncontiguous_host_indices": 4, "not_found": 2}
    quiet(manager)


def test_a_pool_the_agent_cannot_address_goes_through_bounce_slots(manager, monkeypatch):
    """A host pool whose pages are not views of one CPU buffer cannot be an
    agent region: its v1 calls go through bounce slots, same bytes."""
    import orbitkv.sglang as okv

    monkeypatch.setattr(okv, "_agent_layout", lambda pool: None)
    host = host_pool("layer_first")
    be = backend(host, manager.socket, staging_pages=2)
    keys = keys_for("no-layout", 5)
    src = host.alloc(5 * PAGE)
    exp = fill(host, starts_of(src), seed=91)
    assert be.batch_set_v1(keys, src) == [True] * 5
    dst = host.alloc(5 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 5
    assert [page_bytes(host, s) for s in starts_of(dst)] == exp
    stats = be.get_stats()
    assert stats["agent_bounce_pages"] == 10 and "agent_direct_pages" not in stats
    quiet(manager)
