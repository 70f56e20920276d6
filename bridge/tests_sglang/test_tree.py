"""Two real UnifiedRadixCache trees share one OrbitKV manager: a producer
tree writes its prefix to L3 (SGLang's own write_backup_storage → backup
thread), a fresh consumer tree prefetches it (prefetch_from_storage →
batch_exists, then the I/O thread's gets) and matches it on the host with
identical bytes. SGLang's fixture kit (sglang.test.kits.unified_radix_cache)
builds the trees on CPU; three shims stand in for CUDA: the device is
"cpu", host pools are not pinned, and the device→host copy allocates host
pages without copying (they then get known bytes)."""

from __future__ import annotations

import json
import sys
import unittest
from array import array

import pytest
import torch

import sglang.test.kits.unified_radix_cache.fixtures as fx
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

from conftest import EXTRA, LAYOUTS, page_bytes, quiet

class _Tree(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    """The kit's mixins on a TestCase we drive by hand (one per test)."""

    __test__ = False

    cfg = CacheConfig(
        page_size=4,
        kv_size=128,
        num_layers=2,
        full_attention_layer_ids=(0, 1),
        head_num=2,
        head_dim=8,
        dtype=torch.float32,
    )

    def runTest(self):  # unittest needs one
        pass


@pytest.fixture
def kit(monkeypatch):
    monkeypatch.setattr(fx, "get_device", lambda *a, **k: "cpu")
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

    real = assembler.get_mha_host_pool_cls

    def unpinned(device_pool):
        cls = real(device_pool)

        def build(*args, **kwargs):
            kwargs["pin_memory"] = False
            return cls(*args, **kwargs)

        return build

    monkeypatch.setattr(assembler, "get_mha_host_pool_cls", unpinned)
    t = _Tree()
    yield t
    t.doCleanups()


def init_hicache(t: _Tree, cache, model_dir, socket: str, layout: str, v1: int) -> None:
    extra = {**EXTRA, "socket": socket, "interface_v1": v1, "prefetch_threshold": 1}
    sa = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        page_size=t.cfg.page_size,
        hicache_io_backend="direct",
        hicache_mem_layout=layout,
        hicache_write_policy="write_through",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_storage_prefetch_policy="wait_complete",
    )
    sa._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(sa)
    cache.init_hicache(sa, cache.cache_init_params)
    t.addCleanup(fx.drop_hicache_atexit_pin, cache)
    t.addCleanup(cache.release_host_resources)
    cache.write_through_threshold = 1 << 30
    cache.load_back_threshold = 0
    cc = cache.cache_controller
    cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
    t.addCleanup(cc.detach_storage_backend)


def simulate_backup(t: _Tree, cache, leaf) -> None:
    """The device→host copy of a real backup, without its CUDA kernels:
    host pages come from the host pool's own allocator (page-aligned, as
    in the engine; the kit's _simulate_backup reuses the device indices,
    which page_first_direct cannot address)."""
    host = cache.cache_controller.mem_pool_host
    for node in t._path_chain(cache, leaf):
        value = fx.node_device_value(cache, node, ComponentType.FULL)
        if value is not None and fx.node_host_value(cache, node, ComponentType.FULL) is None:
            idx = host.alloc(len(value))
            assert idx is not None
            cache.tree_core.set_component_host_value_raw(node, ComponentType.FULL, idx.to(value.dtype))
        cache.tree_core.update_duplicate_tracking(node)


def host_pages(t: _Tree, cache, leaf):
    host = cache.cache_controller.storage_host_pool
    out = []
    for n in t._path_chain(cache, leaf):
        hv = fx.node_host_value(cache, n, ComponentType.FULL)
        for i in range(0, len(hv), t.cfg.page_size):
            out.append(int(hv[i]))
    return host, out


@pytest.mark.parametrize("v1", [1, 0], ids=["v1", "legacy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_tree_prefetches_the_first_trees_prefix(kit, manager, model_dir, layout, v1):
    t = kit
    seq = t._make_seq(1, 3)  # three pages
    prod, pa, pr = fx.build_fixture(t.cfg)
    init_hicache(t, prod, model_dir, manager.socket, layout, v1)
    backend = prod.cache_controller.storage_backend
    assert type(backend).__name__ == "OrbitKVStorage"
    expected_fn = "_page_set_zero_copy" if v1 else "_generic_page_set"
    assert prod.cache_controller.page_set_func.__name__ == expected_fn

    t._insert(prod, pa, pr, seq)
    leaf = fx.match_prefix(prod, seq).last_device_node
    simulate_backup(t, prod, leaf)
    host, offsets = host_pages(t, prod, leaf)
    expected = []
    g = torch.Generator().manual_seed(7)
    for off in offsets:
        page = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(off, raw.view(page.dtype))
        expected.append(page_bytes(host, off))
    t._write_path_to_l3(prod, leaf)
    t._flush_l3_backups(prod)
    assert backend.get_stats()["pages_stored"] == 3

    cons, _, _ = fx.build_fixture(t.cfg)
    init_hicache(t, cons, model_dir, manager.socket, layout, v1)
    assert fx.match_prefix(cons, seq).host_hit_length == 0
    cons.prefetch_from_storage(CacheRequestHandle("r1", 0), cons.root_node_handle(), array("q", seq), None, None)
    t._run_prefetch_to_completion(cons, CacheRequestHandle("r1", 0))
    m = fx.match_prefix(cons, seq)
    chost, coffsets = host_pages(t, cons, m.last_host_node)
    # Bytes, not floats: random bytes hold NaNs, which torch.equal rejects.
    got = [page_bytes(chost, off) for off in coffsets]
    print(f"host_hit_length[{layout}, interface_v1={v1}] = {m.host_hit_length}")
    assert m.host_hit_length == len(seq) == 12
    assert got == expected and len(got) == 3
    cstats = cons.cache_controller.storage_backend.get_stats()
    assert cstats["pages_loaded"] == 3 and "error" not in cstats["misses"]
    quiet(manager)


SWA_CFG = CacheConfig(
    page_size=4,
    components=(ComponentType.FULL, ComponentType.SWA),
    sliding_window_size=8,  # two pages
    kv_size=128,
    num_layers=2,
    full_attention_layer_ids=(0,),  # layer 1 is sliding-window
    head_num=2,
    head_dim=8,
    dtype=torch.float32,
)


def pool_pages(cache, node_ids, component, pool_name, page_size):
    host = cache.cache_controller.mem_pool_host.entry_map[pool_name].host_pool
    offsets = []
    for n in node_ids:
        hv = fx.node_host_value(cache, n, component)
        if hv is not None:  # SWA keeps only the window's nodes on the host
            offsets += [int(hv[i]) for i in range(0, len(hv), page_size)]
    return host, offsets


def randomize(host, offsets, seed):
    g = torch.Generator().manual_seed(seed)
    for off in offsets:
        page = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(off, raw.view(page.dtype))
    return [page_bytes(host, off) for off in offsets]


def test_sliding_window_tree_needs_both_pools(kit, manager, model_dir, monkeypatch):
    """FULL + SWA trees (HybridCacheController, the v2 calls): the consumer
    gets the full prefix and the SWA window with identical bytes. When the
    producer's SWA write fails, KV pages alone are no legal boundary: the
    consumer gets nothing."""
    import sglang.srt.mem_cache.hicache_storage as hs

    t = kit
    t.cfg = SWA_CFG
    monkeypatch.setattr(sys.modules[__name__], "EXTRA", {**EXTRA, "swa_window_tokens": 8})
    ps = SWA_CFG.page_size

    def produce(seq, seed, fail_swa=False):
        prod, pa, pr = fx.build_fixture(SWA_CFG)
        init_hicache(t, prod, model_dir, manager.socket, "page_first", 1)
        be = prod.cache_controller.storage_backend
        if fail_swa:
            monkeypatch.setattr(
                be, "batch_set_v2", lambda transfers, extra_info=None: {x.name: [False] * len(x.keys or []) for x in transfers}
            )
        t._insert(prod, pa, pr, seq)
        leaf = fx.match_prefix(prod, seq).last_device_node
        t._simulate_backup(prod, leaf)
        chain = list(t._path_chain(prod, leaf))
        kv_host, kv_off = pool_pages(prod, chain, ComponentType.FULL, hs.PoolName.KV, ps)
        swa_host, swa_off = pool_pages(prod, chain, ComponentType.SWA, hs.PoolName.SWA, ps)
        kv_exp = randomize(kv_host, kv_off, seed)
        swa_exp = randomize(swa_host, swa_off, seed + 1)
        t._write_path_to_l3(prod, leaf)
        t._flush_l3_backups(prod)
        return be, kv_exp, swa_exp

    def consume(seq, rid):
        cons, _, _ = fx.build_fixture(SWA_CFG)
        init_hicache(t, cons, model_dir, manager.socket, "page_first", 1)
        cons.prefetch_from_storage(CacheRequestHandle(rid, 0), cons.root_node_handle(), array("q", seq), None, None)
        t._run_prefetch_to_completion(cons, CacheRequestHandle(rid, 0))
        m = fx.match_prefix(cons, seq)
        return cons, m

    seq = t._make_seq(1, 4)
    be, kv_exp, swa_exp = produce(seq, seed=50)
    assert be.get_stats()["pages_stored"] == 4 + len(swa_exp)
    cons, m = consume(seq, "w1")
    print(f"host_hit_length[FULL+SWA] = {m.host_hit_length}")
    assert m.host_hit_length == len(seq) == 16
    chain = list(t._path_chain(cons, m.last_host_node))
    kv_host, kv_off = pool_pages(cons, chain, ComponentType.FULL, hs.PoolName.KV, ps)
    assert [page_bytes(kv_host, o) for o in kv_off] == kv_exp
    swa_host, swa_off = pool_pages(cons, chain, ComponentType.SWA, hs.PoolName.SWA, ps)
    # The consumer holds the window (the last two pages), as the producer wrote them.
    assert len(swa_off) == 2 and [page_bytes(swa_host, o) for o in swa_off] == swa_exp[-2:]
    stats = cons.cache_controller.storage_backend.get_stats()
    assert stats["pages_loaded"] == 4 + 2 and "error" not in stats["misses"]

    other = t._make_seq(2, 4)
    be2, _, _ = produce(other, seed=60, fail_swa=True)
    assert be2.get_stats()["pages_stored"] == 4  # KV only
    cons2, m2 = consume(other, "w2")
    assert m2.host_hit_length == 0
    # The manager found the KV pages and refused the boundary (no window).
    print("no-window consumer:", cons2.cache_controller.storage_backend.get_stats()["misses"])
    assert cons2.cache_controller.storage_backend.get_stats()["misses"] == {"incomplete_group": 4}
    quiet(manager)
