"""OrbitKVStorage behind SGLang's real cache controllers and their threads
(backup → batch_set_v1, prefetch → batch_exists, prefetch I/O →
batch_get_v1, and the v2 calls with an SWA side pool), with SGLang's own
failure injection and a manager killed mid-prefetch."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Tuple

import torch

import orbitkv.sglang as okv
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str

from conftest import (
    EXTRA,
    LAYERS,
    PAGE,
    backend,
    device_pool,
    fill,
    host_pool,
    page_bytes,
    quiet,
    starts_of,
)

T = 30.0


def controller(host, socket: str, **extra) -> HiCacheController:
    dev = device_pool(host.size)
    alloc = PagedTokenToKVPoolAllocator(
        size=dev.size, page_size=PAGE, dtype=torch.float32, device="cpu", kvcache=dev, need_sort=False
    )
    cc = HiCacheController(
        alloc,
        host,
        PAGE,
        tp_group=None,
        load_cache_event=threading.Event(),
        io_backend="direct",
        write_policy="write_through",
        storage_backend="dynamic",
        model_name="tiny-llama",
        storage_backend_extra_config={**EXTRA, "socket": socket, "timeout_s": 5.0, **extra},
        prefetch_threshold=PAGE,
    )
    return cc


def orbit(cc) -> okv.OrbitKVStorage:
    be = cc.storage_backend
    if isinstance(be, HiCacheStorageFailureInjector):
        be = be._backend
    assert isinstance(be, okv.OrbitKVStorage)
    return be


def backup(cc, host, tokens: List[int], seed: int) -> Tuple[torch.Tensor, List[bytes], int]:
    """Fills host pages for `tokens` and writes them to L3 through the
    backup thread; returns (indices, page bytes, tokens written)."""
    idx = host.alloc(len(tokens))
    exp = fill(host, starts_of(idx), seed)
    cc.write_storage(idx, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    op = cc.ack_backup_queue.get(timeout=T)
    return idx, exp, op.completed_tokens


def prefetch(cc, host, tokens: List[int], rid: str) -> Tuple[int, int, torch.Tensor]:
    """One prefetch as the scheduler drives it: hit query on the prefetch
    thread, then the I/O thread fills host buffers. Returns (hit tokens,
    completed tokens, host indices)."""
    cc.prefetch(CacheRequestHandle(rid, 0), tokens)
    op = cc.prefetch_hit_queue.get(timeout=T)
    hit = op.storage_hit_count
    if hit == 0:
        return 0, 0, None
    idx = cc.alloc_prefetch_host_buffers(op, hit)
    op.host_indices = idx
    cc.prefetch_buffer.put(op)
    acks = drain_acks(cc, rid)
    completed = max([a.completed_tokens for a in acks if a.completed_tokens is not None], default=0)
    return hit, completed, idx


def drain_acks(cc, rid: str) -> list:
    """The prefetch acks the scheduler thread would read (rank-reduced by
    the sync thread), up to the request's completion ack."""
    deadline = time.monotonic() + T
    acks = []
    while not (acks and acks[-1].completed_req):
        left = deadline - time.monotonic()
        assert left > 0, f"prefetch {rid} did not complete: {acks}"
        ack = cc.ack_prefetch_queue.get(timeout=left)
        acks.append(ack)
    return acks


def test_controller_threads_backup_and_prefetch(manager):
    host = host_pool("page_first")
    cc = controller(host, manager.socket)
    be = orbit(cc)
    try:
        assert cc.page_set_func.__name__ == "_page_set_zero_copy"
        tokens = list(range(100, 100 + 5 * PAGE))
        _, exp, written = backup(cc, host, tokens, seed=11)
        assert written == len(tokens)
        hit, done, idx = prefetch(cc, host, tokens, "r1")
        assert hit == done == len(tokens)
        assert [page_bytes(host, s) for s in starts_of(idx)] == exp
        # A longer prompt with the same prefix hits the stored pages only.
        hit, done, idx = prefetch(cc, host, tokens + list(range(7, 7 + 2 * PAGE)), "r2")
        assert hit == done == len(tokens)
        assert [page_bytes(host, s) for s in starts_of(idx)] == exp
        # Another prompt misses.
        assert prefetch(cc, host, list(range(900, 900 + 3 * PAGE)), "r3")[0] == 0
        assert "error" not in be.get_stats()["misses"]
    finally:
        cc.detach_storage_backend()
    quiet(manager)


def test_random_failure_injection_never_yields_a_wrong_byte(manager, monkeypatch):
    """SGLang's injector fails 30% of the storage calls (before they reach
    us): backups stop early, queries and gets come back short. Whatever the
    controller counts as completed holds exactly the producer's bytes."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    host = host_pool("page_first", size=4096)
    cc = controller(host, manager.socket)
    assert isinstance(cc.storage_backend, HiCacheStorageFailureInjector)
    be = orbit(cc)
    checked = completed_pages = 0
    try:
        for r in range(30):
            tokens = list(range(1000 * r, 1000 * r + 6 * PAGE))
            _, exp, written = backup(cc, host, tokens, seed=200 + r)
            assert written % PAGE == 0
            hit, done, idx = prefetch(cc, host, tokens, f"f{r}")
            assert done <= hit
            # Every page the controller took as loaded is the producer's.
            pages = done // PAGE
            got = [page_bytes(host, s) for s in starts_of(idx)[:pages]] if pages else []
            assert got == exp[:pages]
            checked += 1
            completed_pages += pages
        assert all(t.is_alive() for t in (cc.prefetch_thread, cc.backup_thread))
    finally:
        cc.detach_storage_backend()
    assert checked == 30 and completed_pages > 0  # some got through
    stats = be.get_stats()
    assert "error" not in stats["misses"]
    quiet(manager)


def test_manager_killed_mid_prefetch(manager, monkeypatch):
    """The manager dies (SIGKILL) while the prefetch I/O thread loads
    pages: the call reports misses, nothing raises into SGLang, no thread
    is stuck; a restarted manager is reconnected to and serves."""
    host = host_pool("page_first", size=1024)
    cc = controller(host, manager.socket, reconnect_interval_s=0.1)
    be = orbit(cc)
    tokens = list(range(300, 300 + 4 * PAGE))
    kills = []
    # The host pool is an agent region: the load (leases, then the agent's
    # copy into the host pool) is about to be sent when the manager dies.
    real = okv._Conn.restore_slots

    def dying(conn, *args):
        if not kills:
            kills.append(threading.current_thread().name)
            manager.proc.kill()
            manager.proc.wait(10)
        return real(conn, *args)

    try:
        _, exp, written = backup(cc, host, tokens, seed=21)
        assert written == len(tokens)
        monkeypatch.setattr(okv._Conn, "restore_slots", dying)
        hit, done, idx = prefetch(cc, host, tokens, "k1")
        # Killed from SGLang's prefetch I/O thread, as it sent the load.
        assert len(kills) == 1 and kills[0] != threading.main_thread().name
        assert hit == len(tokens) and done == 0
        stats = be.get_stats()
        assert stats["misses"].get("connection_lost", 0) == 4
        # Without a manager: misses at once, threads alive.
        assert prefetch(cc, host, tokens, "k2")[0] == 0
        assert cc.prefetch_thread.is_alive() and cc.backup_thread.is_alive()

        manager.start()
        time.sleep(0.3)
        assert prefetch(cc, host, tokens, "k3")[0] == 0  # DRAM died with it
        _, exp, written = backup(cc, host, tokens, seed=22)
        assert written == len(tokens)
        hit, done, idx = prefetch(cc, host, tokens, "k4")
        assert hit == done == len(tokens)
        assert [page_bytes(host, s) for s in starts_of(idx)] == exp
        assert "error" not in be.get_stats()["misses"]
    finally:
        cc.detach_storage_backend()
    quiet(manager)


# v2: an SWA side pool -------------------------------------------------------

WINDOW_PAGES = 2


def swa_backend(manager):
    kv, swa = host_pool("page_first"), host_pool("page_first")
    be = backend(kv, manager.socket, register=False, swa_window_tokens=WINDOW_PAGES * PAGE)
    be.register_mem_host_pool_v2(kv, PoolName.KV)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    be.on_host_pools_registered()
    return be, kv, swa


def swa_transfer(keys, host_indices=None) -> PoolTransfer:
    return PoolTransfer(
        name=PoolName.SWA, keys=keys, host_indices=host_indices, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def test_v2_boundaries_only_where_both_pools_hold_their_pages(manager):
    be, kv, swa = swa_backend(manager)
    keys = [k for k in get_storage_hash_str(list(range(6 * PAGE)), None, page_size=PAGE)]
    kv_idx = kv.alloc(6 * PAGE)
    kv_exp = fill(kv, starts_of(kv_idx), seed=31)
    assert be.batch_set_v1(keys, kv_idx) == [True] * 6
    q = [swa_transfer(["__placeholder__"] * WINDOW_PAGES)]

    # KV alone is no legal boundary: the window rule needs SWA pages.
    r = be.batch_exists_v2(keys, q)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    assert be.batch_exists(keys) == 0

    # SWA pages 2 and 3 (a window ending at page boundary 4).
    s_idx = swa.alloc(2 * PAGE)
    s_exp = fill(swa, starts_of(s_idx), seed=32)
    res = be.batch_set_v2([swa_transfer(keys[2:4], s_idx)])
    assert res == {PoolName.SWA: [True, True]}
    r = be.batch_exists_v2(keys, q)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    assert r.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 4}

    # And pages 4, 5: the windows ending at 5 (pages 3, 4) and 6 (4, 5) are
    # complete too.
    s2 = swa.alloc(2 * PAGE)
    fill(swa, starts_of(s2), seed=33)
    assert be.batch_set_v2([swa_transfer(keys[4:6], s2)]) == {PoolName.SWA: [True, True]}
    r = be.batch_exists_v2(keys, q)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [4, 5, 6])
    # Within the first three pages no window is complete (SWA holds
    # nothing for pages 0 and 1).
    assert be.batch_exists_v2(keys[:3], q).restorable_prefix_pages == []
    # At the start of a sequence the window is capped by it: page 0's SWA
    # alone makes boundary 1 legal.
    s0 = swa.alloc(PAGE)
    fill(swa, starts_of(s0), seed=34)
    assert be.batch_set_v2([swa_transfer(keys[:1], s0)]) == {PoolName.SWA: [True]}
    assert be.batch_exists_v2(keys, q).restorable_prefix_pages == [1, 4, 5, 6]

    # Restoring at boundary 4: KV pages 0..3 and the window 2..3, exact.
    kv_dst = kv.alloc(4 * PAGE)
    assert be.batch_get_v1(keys[:4], kv_dst) == [True] * 4
    assert [page_bytes(kv, s) for s in starts_of(kv_dst)] == kv_exp[:4]
    s_dst = swa.alloc(2 * PAGE)
    got = be.batch_get_v2([swa_transfer(keys[2:4], s_dst)])
    assert got == {PoolName.SWA: [True, True]}
    assert [page_bytes(swa, s) for s in starts_of(s_dst)] == s_exp
    # A window that is not stored: no page, no hole.
    s_bad = swa.alloc(2 * PAGE)
    before = [page_bytes(swa, s) for s in starts_of(s_bad)]
    assert be.batch_get_v2([swa_transfer(keys[1:3], s_bad)]) == {PoolName.SWA: [False, False]}
    assert [page_bytes(swa, s) for s in starts_of(s_bad)] == before

    # SGLang asking for a longer trailing window than we were told fails closed.
    r = be.batch_exists_v2(keys, [swa_transfer(["__placeholder__"] * 3)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    # So does a side pool that was never registered.
    r = be.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 0
    misses = be.get_stats()["misses"]
    assert misses["window_mismatch"] == 6 and misses["unknown_pool"] == 6

    # The window is sealed into the namespace: an engine told another
    # window shares nothing with this one.
    kv2, swa2 = host_pool("page_first"), host_pool("page_first")
    other = backend(kv2, manager.socket, register=False, swa_window_tokens=(WINDOW_PAGES + 1) * PAGE)
    other.register_mem_host_pool_v2(kv2, PoolName.KV)
    other.register_mem_host_pool_v2(swa2, PoolName.SWA)
    other.on_host_pools_registered()
    assert other.get_stats()["namespace"] != be.get_stats()["namespace"]
    # Another instance, served (not refused as a conflict): it finds nothing
    # because it shares nothing.
    assert other.get_stats()["instance"] != be.get_stats()["instance"]
    assert other.get_stats()["connections"] == 1 and other.get_stats()["refusals"] == {}
    assert other.batch_exists_v2(keys, [swa_transfer(["__placeholder__"] * 3)]).kv_hit_pages == 0
    assert other.get_stats()["misses"].get("not_found", 0) >= 1, other.get_stats()
    assert "error" not in misses
    quiet(manager)


def test_hybrid_controller_v2_threads(manager):
    """The production HybridCacheController with a KV anchor and an SWA side
    pool: backup calls batch_set_v2 (SWA) and batch_set_v1 (KV); prefetch
    calls batch_exists_v2, batch_get_v1 and batch_get_v2; both pools' bytes
    come back exact."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup

    kv_dev, swa_dev = device_pool(256), device_pool(256)
    kv, swa = host_pool("page_first"), host_pool("page_first")
    group = HostPoolGroup(
        [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=kv,
                device_pool=kv_dev,
                layer_mapping={i: i for i in range(LAYERS)},
                transfer_layer_id_max=LAYERS,
                is_anchor=True,
            ),
            build_pool_entry(
                name=PoolName.SWA,
                host_pool=swa,
                device_pool=swa_dev,
                layer_mapping={i: i for i in range(LAYERS)},
                transfer_layer_id_max=LAYERS,
            ),
        ]
    )
    alloc = PagedTokenToKVPoolAllocator(
        size=256, page_size=PAGE, dtype=torch.float32, device="cpu", kvcache=kv_dev, need_sort=False
    )
    calls: Dict[str, List[str]] = {}
    cc = HybridCacheController(
        alloc,
        group,
        PAGE,
        tp_group=None,
        load_cache_event=threading.Event(),
        io_backend="direct",
        write_policy="write_through",
        storage_backend="dynamic",
        model_name="tiny-llama",
        storage_backend_extra_config={
            **EXTRA,
            "socket": manager.socket,
            "swa_window_tokens": WINDOW_PAGES * PAGE,
        },
        prefetch_threshold=PAGE,
        transfer_layer_id_max=LAYERS,
    )
    be = orbit(cc)
    for name in ("batch_set_v1", "batch_set_v2", "batch_exists_v2", "batch_get_v1", "batch_get_v2"):
        real = getattr(be, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.setdefault(_name, []).append(threading.current_thread().name)
            return _real(*a, **k)

        setattr(be, name, spy)
    try:
        tokens = list(range(500, 500 + 4 * PAGE))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        kv_idx = kv.alloc(len(tokens))
        kv_exp = fill(kv, starts_of(kv_idx), seed=41)
        swa_idx = swa.alloc(WINDOW_PAGES * PAGE)
        swa_exp = fill(swa, starts_of(swa_idx), seed=42)
        cc.write_storage(
            kv_idx,
            tokens,
            hash_value=hashes,
            extra_pools=[swa_transfer(hashes[-WINDOW_PAGES:], swa_idx)],
        )
        cc.ack_backup_queue.get(timeout=T)

        cc.prefetch(
            CacheRequestHandle("h1", 0), tokens, extra_pools=[swa_transfer(["__placeholder__"] * WINDOW_PAGES)]
        )
        op = cc.prefetch_hit_queue.get(timeout=T)
        assert op.storage_hit_count == len(tokens)
        idx, n = cc.allocate_storage_hit(op, op.storage_hit_count, allow_partial=False, min_tokens=PAGE, evict_host=lambda n: 0)
        op.host_indices = idx
        op.storage_hit_count = n
        (t,) = [t for t in op.pool_transfers if t.name == PoolName.SWA]
        if t.host_indices is None:  # the radix cache allocates SWA staging
            t.host_indices = swa.alloc(WINDOW_PAGES * PAGE)
        cc.prefetch_buffer.put(op)
        acks = drain_acks(cc, "h1")
        completed = max(a.completed_tokens for a in acks if a.completed_tokens is not None)
        pool_hits = [a.pool_hits for a in acks if a.pool_hits]
        assert completed == len(tokens)
        assert pool_hits and pool_hits[-1].get(PoolName.SWA) == WINDOW_PAGES, acks
        assert [page_bytes(kv, s) for s in starts_of(idx)] == kv_exp
        assert [page_bytes(swa, s) for s in starts_of(t.host_indices)] == swa_exp
    finally:
        cc.detach_storage_backend()
    assert set(calls) == {"batch_set_v1", "batch_set_v2", "batch_exists_v2", "batch_get_v1", "batch_get_v2"}, calls
    assert "error" not in be.get_stats()["misses"]
    quiet(manager)
