"""`orbitkv.sglang.OrbitKVStorage` called directly, as SGLang's controller
calls it, on the real host pools against a real `orbitkv serve`: exact
bytes in every host layout, prefix results, identity isolation (TP rank,
model, settings, page format), the legacy path, bad input, a manager that
is down or restarts, and concurrent threads."""

from __future__ import annotations

import inspect
import json
import shutil
import threading
import time

import orbitkv
import pytest
import torch

import serve_support as ss
from orbitkv.sglang import OrbitKVConfig, OrbitKVStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

from conftest import (
    EXTRA,
    LAYOUTS,
    PAGE,
    backend,
    fill,
    host_pool,
    keys_for,
    make_model,
    mla_host_pool,
    page_bytes,
    publish_server_args,
    quiet,
    starts_of,
    storage_config,
)


def test_factory_builds_the_backend(manager):
    assert issubclass(OrbitKVStorage, HiCacheStorage)
    assert not inspect.isabstract(OrbitKVStorage)
    host = host_pool("page_first")
    be = backend(host, manager.socket)
    assert type(be) is OrbitKVStorage and isinstance(be, HiCacheStorage)
    assert be.mem_pool_host is host
    stats = be.get_stats()
    assert stats["instance"].startswith("sglang/") and len(stats["namespace"]) == 64
    assert stats["connections"] == 1  # connected at registration

    # SGLang's own parser accepts the documented config string.
    text = json.dumps({**EXTRA, "socket": manager.socket, "prefetch_threshold": 4})
    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(text)
    assert threshold == 4 and extra["class_name"] == "OrbitKVStorage"
    assert OrbitKVConfig.from_extra(extra).socket == manager.socket


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sockett": "/x"}, "unknown extra-config keys"),
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive"),
        ({"max_connections": True}, "max_connections must be a positive"),
        ({"staging_pages": -1}, "staging_pages must be a positive"),
        ({"socket": ""}, "socket must be a path"),
        ({"model_dir": "/nonexistent/model"}, "not a directory"),
        ({"swa_window_tokens": "64"}, "swa_window_tokens must be a positive"),
    ],
)
def test_bad_extra_config_is_refused_at_construction(extra, message):
    with pytest.raises(ValueError, match=message):
        extra = {"socket": "/tmp/none.sock", **extra}
        OrbitKVStorage(storage_config(extra.pop("socket"), **extra), {})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_exact_bytes_and_partial_misses(manager, layout):
    host = host_pool(layout)
    be = backend(host, manager.socket)
    keys = keys_for(f"rt-{layout}", 5)
    src = host.alloc(5 * PAGE)
    expected = fill(host, starts_of(src), seed=1)

    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys[:4], src[: 4 * PAGE]) == [True] * 4
    assert be.batch_exists(keys) == 4
    assert be.batch_exists(keys[:2]) == 2
    assert be.batch_exists(keys[4:] + keys[:4]) == 0  # a prefix, from the first key
    assert be.exists(keys[0]) and not be.exists(keys[4])

    # All four back, byte for byte, into other pages of the pool.
    dst = host.alloc(5 * PAGE)
    before = [page_bytes(host, s) for s in starts_of(dst)]
    assert be.batch_get_v1(keys[:4], dst[: 4 * PAGE]) == [True] * 4
    assert [page_bytes(host, s) for s in starts_of(dst)[:4]] == expected[:4]

    # A missing key in the middle: the result stops there (a prefix, never a
    # hole) and the pages after it are not written.
    mixed = [keys[0], keys[1], keys[4], keys[2]]
    dst2 = host.alloc(4 * PAGE)
    before = [page_bytes(host, s) for s in starts_of(dst2)]
    assert be.batch_exists(mixed) == 2
    assert be.batch_get_v1(mixed, dst2) == [True, True, False, False]
    after = [page_bytes(host, s) for s in starts_of(dst2)]
    assert after[:2] == expected[:2] and after[2:] == before[2:]

    # Writing the same pages again is fine (the manager keeps one copy).
    assert be.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
    stats = be.get_stats()
    assert stats["pages_stored"] == 6 and stats["pages_loaded"] == 6
    assert "error" not in stats["misses"]
    m = quiet(manager)
    assert m["pages"] == 4


def test_a_prefix_never_stored_misses_without_asking_the_manager(manager):
    # The manager's presence filter: SGLang's existence checks of pages no
    # tier holds are answered in this process, and the manager counts them.
    host = host_pool("layer_first")
    be = backend(host, manager.socket)
    keys = keys_for("fresh", 4)
    before = manager.metric("presence_misses_total") or 0
    assert be.batch_exists(keys) == 0 and not be.exists(keys[0])
    manager.wait_metric("presence_misses_total", before + 2)
    assert be.get_stats()["misses"].get("not_found", 0) >= 2
    # Stored, then asked at once: the manager answers, and finds them.
    src = host.alloc(4 * PAGE)
    fill(host, starts_of(src), seed=5)
    assert be.batch_set_v1(keys, src) == [True] * 4
    assert be.batch_exists(keys) == 4
    assert manager.metric("presence_misses_total") == before + 2


def test_a_long_existence_check_sends_only_the_keys_before_one_in_no_tier(manager, monkeypatch):
    # A long key list whose first pages are stored: the backend asks the
    # presence filter for a page in no tier and looks up only the keys
    # before it; the answer is the same stored prefix.
    import orbitkv.sglang as osg

    host = host_pool("layer_first")
    be = backend(host, manager.socket)
    keys = keys_for("long", 200)
    src = host.alloc(3 * PAGE)
    fill(host, starts_of(src), seed=6)
    assert be.batch_set_v1(keys[:3], src) == [True] * 3
    sent: list = []
    real = osg._Conn._query

    def record(self, hashes):
        sent.append(len(hashes))
        return real(self, hashes)

    monkeypatch.setattr(osg._Conn, "_query", record)
    assert be.batch_exists(keys) == 3
    # Pages 1 and 2 are probed and held; page 4 is in no tier.
    assert sent == [4], sent
    assert be.batch_exists(keys[:64]) == 3
    assert sent == [4, 64], "64 keys or fewer are sent whole"


def test_layer_first_and_page_first_direct_share_pages_page_first_does_not(manager):
    """Both layer-major layouts store the same flat bytes and seal the same
    namespace; page_first orders tokens before layers, so it must miss."""
    producer = host_pool("layer_first")
    be = backend(producer, manager.socket)
    keys = keys_for("share", 3)
    src = producer.alloc(3 * PAGE)
    expected = fill(producer, starts_of(src), seed=2)
    assert be.batch_set_v1(keys, src) == [True] * 3

    direct = host_pool("page_first_direct")
    be2 = backend(direct, manager.socket)
    assert be2.get_stats()["namespace"] == be.get_stats()["namespace"]
    dst = direct.alloc(3 * PAGE)
    assert be2.batch_get_v1(keys, dst) == [True] * 3
    assert [page_bytes(direct, s) for s in starts_of(dst)] == expected
    # The same tokens really sit elsewhere in memory in this layout.
    assert direct.kv_buffer.shape != producer.kv_buffer.shape

    token_major = host_pool("page_first")
    be3 = backend(token_major, manager.socket)
    assert be3.get_stats()["namespace"] != be.get_stats()["namespace"]
    assert be3.batch_exists(keys) == 0
    dst3 = token_major.alloc(3 * PAGE)
    assert be3.batch_get_v1(keys, dst3) == [False] * 3
    quiet(manager)


def test_tp_rank_isolation(manager):
    """Rank 1 of TP 2 never reads rank 0's pages (its heads differ), nor
    does a TP 1 engine; only the same rank of the same TP size hits."""
    h0, h1 = host_pool("page_first"), host_pool("page_first")
    r0 = backend(h0, manager.socket, tp_rank=0, tp_size=2)
    r1 = backend(h1, manager.socket, tp_rank=1, tp_size=2)
    keys = keys_for("tp", 3)
    s0 = h0.alloc(3 * PAGE)
    e0 = fill(h0, starts_of(s0), seed=3)
    assert r0.batch_set_v1(keys, s0) == [True] * 3

    dst = h1.alloc(3 * PAGE)
    before = [page_bytes(h1, s) for s in starts_of(dst)]
    assert r1.batch_exists(keys) == 0
    assert r1.batch_get_v1(keys, dst) == [False] * 3
    assert [page_bytes(h1, s) for s in starts_of(dst)] == before
    assert r1.get_stats()["namespace"] != r0.get_stats()["namespace"]

    single = backend(host_pool("page_first"), manager.socket, tp_rank=0, tp_size=1)
    assert single.batch_exists(keys) == 0

    # Rank 1 writes its own pages under the same keys; each rank reads its own.
    s1 = h1.alloc(3 * PAGE)
    e1 = fill(h1, starts_of(s1), seed=4)
    assert r1.batch_set_v1(keys, s1) == [True] * 3
    for be, host, exp in ((r0, h0, e0), (r1, h1, e1)):
        d = host.alloc(3 * PAGE)
        assert be.batch_get_v1(keys, d) == [True] * 3
        assert [page_bytes(host, s) for s in starts_of(d)] == exp
    assert e0 != e1
    quiet(manager)


def test_mla_pages_are_shared_by_every_tp_rank(manager):
    """MLA's latent pages are the same on every rank (SGLang has one
    writer): rank 1 reads rank 0's, byte for byte. An MHA engine with the
    same keys does not."""
    h0, h1 = mla_host_pool("page_first"), mla_host_pool("page_first")
    r0 = backend(h0, manager.socket, tp_rank=0, tp_size=2, mla=True)
    r1 = backend(h1, manager.socket, tp_rank=1, tp_size=2, mla=True)
    assert r0.get_stats()["namespace"] == r1.get_stats()["namespace"]
    keys = keys_for("mla", 3)
    src = h0.alloc(3 * PAGE)
    exp = fill(h0, starts_of(src), seed=9)
    assert r0.batch_set_v1(keys, src) == [True] * 3
    dst = h1.alloc(3 * PAGE)
    assert r1.batch_exists(keys) == 3
    assert r1.batch_get_v1(keys, dst) == [True] * 3
    assert [page_bytes(h1, s) for s in starts_of(dst)] == exp
    # The layer-major MLA layout has its own bytes, hence its own namespace.
    lf = backend(mla_host_pool("layer_first"), manager.socket, tp_rank=1, tp_size=2, mla=True)
    assert lf.batch_exists(keys) == 0
    mha = backend(host_pool("page_first"), manager.socket, tp_rank=0, tp_size=2)
    assert mha.batch_exists(keys) == 0
    quiet(manager)


def _stored(manager, host_layout="page_first"):
    """A producer's three pages under fixed keys; returns (keys, bytes)."""
    host = host_pool(host_layout)
    be = backend(host, manager.socket)
    keys = keys_for("model", 3)
    src = host.alloc(3 * PAGE)
    exp = fill(host, starts_of(src), seed=5)
    assert be.batch_set_v1(keys, src) == [True] * 3
    return keys, exp


@pytest.mark.parametrize(
    "change",
    ["weights", "config", "dtype", "kv_cache_dtype", "attention_backend", "cache_scope", "kv_pool_dtype"],
)
def test_a_different_model_config_never_hits(manager, model_dir, tmp_path, monkeypatch, change):
    keys, _ = _stored(manager)
    # Control: the same configuration in a fresh backend hits.
    same = backend(host_pool("page_first"), manager.socket)
    assert same.batch_exists(keys) == 3

    dtype = torch.float32
    if change == "weights":
        publish_server_args(make_model(tmp_path / "m", weights=bytes(range(255, -1, -1)) * 16))
    elif change == "config":
        other = make_model(tmp_path / "m")
        cfg = json.loads((other / "config.json").read_text())
        cfg["rope_theta"] = 1234.0
        (other / "config.json").write_text(json.dumps(cfg))
        publish_server_args(other)
    elif change == "dtype":
        publish_server_args(model_dir, dtype="bfloat16")
    elif change == "kv_cache_dtype":
        publish_server_args(model_dir, kv_cache_dtype="fp8_e4m3")
    elif change == "attention_backend":
        publish_server_args(model_dir, attention_backend="torch_native")
    elif change == "cache_scope":
        monkeypatch.setenv("ORBITKV_CACHE_SCOPE", "tenant-b")
    elif change == "kv_pool_dtype":
        dtype = torch.bfloat16
    host = host_pool("page_first", dtype=dtype)
    other = backend(host, manager.socket)
    assert other.get_stats()["namespace"] != same.get_stats()["namespace"]
    assert other.batch_exists(keys) == 0
    dst = host.alloc(3 * PAGE)
    before = [page_bytes(host, s) for s in starts_of(dst)]
    assert other.batch_get_v1(keys, dst) == [False] * 3
    assert [page_bytes(host, s) for s in starts_of(dst)] == before
    quiet(manager)


def test_an_unpinned_hub_model_fails_closed(manager):
    """A model that is neither a local directory nor a pinned hub commit has
    no identity: SGLang's attach fails rather than share pages."""
    publish_server_args("dummy")  # what SGLang's unit fixtures use
    with pytest.raises(ValueError, match="identity cannot be established"):
        backend(host_pool("page_first"), manager.socket)


def test_the_operators_fingerprint_stands_for_a_pin_as_in_every_adapter(manager, monkeypatch):
    """With ORBITKV_MODEL_FINGERPRINT an unpinned hub id is accepted as the
    one model-source rule says (`orbitkv.model_source`); its config.json
    must still come from the local hub cache, never a download."""
    monkeypatch.setenv("ORBITKV_MODEL_FINGERPRINT", "ab" * 32)
    publish_server_args("dummy")
    with pytest.raises(ValueError, match="no config.json in the local hub cache"):
        backend(host_pool("page_first"), manager.socket)


def test_legacy_and_v1_paths_store_the_same_bytes(manager):
    """Legacy calls (interface_v1 off) take SGLang's flat page tensors; a
    page stored either way reads back either way, byte for byte."""
    host = host_pool("page_first")
    be = backend(host, manager.socket)
    keys = keys_for("legacy", 4)
    src = host.alloc(4 * PAGE)
    exp = fill(host, starts_of(src), seed=6)
    values = [host.get_data_page(s) for s in starts_of(src)]
    assert be.batch_set(keys[:2], values[:2]) is True
    assert be.set(keys[2], values[2]) is True
    assert be.batch_set_v1(keys[3:], src[3 * PAGE :]) == [True]
    assert [be.exists(k) for k in keys] == [True] * 4

    dst = host.alloc(4 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 4
    assert [page_bytes(host, s) for s in starts_of(dst)] == exp

    targets = [host.get_dummy_flat_data_page() for _ in range(5)]
    got = be.batch_get(keys + keys_for("absent", 1), targets)
    assert [g is t for g, t in zip(got[:4], targets)] == [True] * 4 and got[4] is None
    assert [t.view(torch.uint8).numpy().tobytes() for t in targets[:4]] == exp
    one = be.get(keys[1])
    assert one is not None and one.view(torch.uint8).numpy().tobytes() == exp[1]
    assert be.get(keys_for("absent", 1)[0]) is None
    # A value of the wrong size is refused, not stored truncated.
    assert be.set(keys_for("short", 1)[0], torch.zeros(3)) is False
    assert be.get_stats()["misses"]["bad_input"] == 1
    quiet(manager)


def test_bad_input_is_a_miss_never_an_exception(manager):
    host = host_pool("page_first")
    be = backend(host, manager.socket, max_keys=64)
    keys = keys_for("bad", 2)
    src = host.alloc(2 * PAGE)
    fill(host, starts_of(src), seed=7)
    assert be.batch_set_v1(keys, src) == [True, True]

    assert be.batch_get_v1(keys, src[:PAGE]) == [False, False]  # too few indices
    assert be.batch_get_v1(keys, [0, 4]) == [False, False]  # not a tensor
    assert be.batch_get_v1(keys, torch.tensor([10_000 + i for i in range(2 * PAGE)])) == [False, False]
    assert be.batch_get_v1(keys, src + 1) == [True, True]  # any start, in this layout
    assert be.batch_set_v1([1, 2], src) == [False, False]  # keys not strings
    assert be.batch_exists(keys_for("many", 65)) == 0  # over max_keys
    assert be.batch_get_v1([], src[:0]) == [] and be.batch_exists([]) == 0
    misses = be.get_stats()["misses"]
    assert misses["bad_input"] == 8 and misses["too_many_keys"] == 65
    assert "error" not in misses

    # page_first_direct addresses whole pages: a start inside a page is refused.
    direct = host_pool("page_first_direct")
    bd = backend(direct, manager.socket)
    d_idx = direct.alloc(2 * PAGE)
    assert bd.batch_set_v1(keys, d_idx + 1) == [False, False]
    assert bd.batch_get_v1(keys, d_idx + 1) == [False, False]
    assert bd.get_stats()["misses"] == {"unaligned_host_index": 4}

    # Short keys (not SGLang's 64-hex) work, under a digest of their own.
    assert be.batch_set_v1(["a", "b"], src) == [True, True]
    assert be.batch_exists(["a", "b", "c"]) == 2
    # Before the pool set is known, calls miss.
    early = backend(host_pool("page_first"), manager.socket, register=False)
    assert early.batch_exists(keys) == 0
    assert early.batch_get_v1(keys, src) == [False, False]
    assert early.get_stats()["misses"] == {"not_registered": 4}
    quiet(manager)


def test_unsupported_pools_are_refused_at_startup(manager):
    host = host_pool("page_first")
    be = OrbitKVStorage(storage_config(manager.socket), {})
    be.register_mem_pool_host(host)
    be.register_mem_host_pool_v2(host_pool("page_first"), "mamba")
    with pytest.raises(ValueError, match="pools \\['mamba'\\] are not supported"):
        be.on_host_pools_registered()

    be = OrbitKVStorage(storage_config(manager.socket), {})
    be.register_mem_pool_host(host)
    be.register_mem_host_pool_v2(host_pool("page_first"), "swa")
    with pytest.raises(ValueError, match="set swa_window_tokens"):
        be.on_host_pools_registered()


def test_manager_down_then_up_then_restarted(manager):
    """No manager: misses at once (no exception, no hang). Once it is up,
    the backend connects; a restart loses the connection (a miss), then the
    next call reconnects with a new session."""
    host = host_pool("page_first")
    manager.stop()
    be = backend(host, manager.socket, reconnect_interval_s=0.2)
    keys = keys_for("restart", 3)
    src = host.alloc(3 * PAGE)
    exp = fill(host, starts_of(src), seed=8)
    t = time.monotonic()
    assert be.batch_set_v1(keys, src) == [False] * 3
    assert be.batch_exists(keys) == 0
    assert time.monotonic() - t < 2
    assert be.get_stats()["misses"]["manager_down"] == 6

    manager.start()
    time.sleep(0.3)
    assert be.batch_set_v1(keys, src) == [True] * 3
    first = be.get_stats()["connects"]

    manager.restart()  # a new incarnation: the old connection is dead
    results = [be.batch_exists(keys) for _ in range(3)]
    assert results[0] == 0  # the call that found the connection gone
    assert results[-1] == 0  # DRAM did not survive the restart: a miss, not an error
    assert be.get_stats()["connects"] > first
    assert be.batch_set_v1(keys, src) == [True] * 3
    dst = host.alloc(3 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 3
    # The connection that lost its manager reconnected in place: no other was opened.
    assert be.get_stats()["connections"] == 1
    assert [page_bytes(host, s) for s in starts_of(dst)] == exp
    assert "error" not in be.get_stats()["misses"]
    quiet(manager)


def test_a_publish_the_manager_drops_reports_only_what_it_holds(orbitkv_bin):
    """A publish larger than the manager's whole DRAM is dropped: the set
    reports the pages the manager holds afterwards (none), as a prefix."""
    small = ss.Manager(orbitkv_bin, dram="64KiB")
    try:
        small.start()
        host = host_pool("page_first", size=1024)
        be = backend(host, small.socket)  # 1 KiB pages, 128 per publish
        keys = keys_for("drop", 100)
        src = host.alloc(100 * PAGE)
        fill(host, starts_of(src), seed=12)
        assert be.batch_set_v1(keys, src) == [False] * 100
        assert be.get_stats()["misses"] == {"publish_dropped": 100}
        assert be.batch_set_v1(keys[:8], src[: 8 * PAGE]) == [True] * 8
        assert be.batch_exists(keys) == 8
        quiet(small)
    finally:
        small.stop()
        shutil.rmtree(small.dir, ignore_errors=True)


def test_concurrent_threads_exact_bytes(manager):
    """SGLang's backup, prefetch and prefetch-I/O threads call at once:
    every thread's pages come back exact, connections stay bounded."""
    host = host_pool("page_first", size=2048)
    be = backend(host, manager.socket, max_connections=3)
    errors = []

    # The host pool's allocator belongs to the scheduler thread; the I/O
    # threads only get indices.
    plans = []
    for t in range(6):
        rounds = []
        for r in range(6):
            src, dst = host.alloc(4 * PAGE), host.alloc(4 * PAGE)
            rounds.append((keys_for(f"thread-{t}-{r}", 4), src, dst, fill(host, starts_of(src), seed=100 * t + r)))
        plans.append(rounds)

    def worker(t: int) -> None:
        try:
            for keys, src, dst, exp in plans[t]:
                assert be.batch_set_v1(keys, src) == [True] * 4
                assert be.batch_exists(keys) == 4
                assert be.batch_get_v1(keys, dst) == [True] * 4
                assert [page_bytes(host, s) for s in starts_of(dst)] == exp
        except BaseException as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert all(not th.is_alive() for th in threads)
    stats = be.get_stats()
    assert stats["connections"] <= 3 and stats["pages_loaded"] == 6 * 6 * 4
    assert stats["misses"] == {}
    quiet(manager)


SMALL_EXTENT = (
    "[serve]\nidle_tick_us = 100\n"
    "[dram]\nfirst_touch = false\nslot_align_bytes = 512\nextent_bytes = 512\n"
)


def test_refused_registration_fails_the_attach(orbitkv_bin):
    """A manager whose DRAM extent is smaller than a page refuses the
    instance: the attach fails with the setting to change (SGLang does not
    start without its cache), not a warning about an absent manager."""
    m = ss.Manager(orbitkv_bin, dram="64MiB", config=SMALL_EXTENT)
    try:
        m.start()
        with pytest.raises(ValueError, match=r"refused register_instance \(page_exceeds_extent\).*dram.extent_bytes"):
            backend(host_pool("page_first"), m.socket)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_session_quota_fails_the_attach(orbitkv_bin):
    """The manager allows one session per process and this process holds
    it: the backend's open_session is refused before it is queued, and the
    attach fails naming the limit (it used to surface as QueueFull, "inbox
    full")."""
    config = ss.CONFIG.replace("[serve]\n", "[serve]\nmax_sessions_per_process = 1\n")
    m = ss.Manager(orbitkv_bin, dram="64MiB", config=config)
    try:
        m.start()
        holder = orbitkv.Client(m.socket, "holder")
        ss.register(holder)
        ss.open_session(holder)
        with pytest.raises(
            ValueError, match=r"refused open_session \(limit_max_sessions_per_process\)"
        ):
            backend(host_pool("page_first"), m.socket)
        holder.close()
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_refusal_after_a_restart_is_not_manager_down(manager, orbitkv_bin, caplog):
    """Attached to a manager that serves it, then refused by the one
    started in its place: every call misses as refused (counted by kind,
    logged at error level), never as "manager_down", also while the
    backend waits out its reconnect interval."""
    import logging

    caplog.set_level(logging.WARNING, logger="orbitkv")
    host = host_pool("page_first")
    be = backend(host, manager.socket, reconnect_interval_s=0.2)
    keys = keys_for("refused", 2)
    src = host.alloc(2 * PAGE)
    fill(host, starts_of(src), seed=3)
    assert be.batch_set_v1(keys, src) == [True] * 2
    manager.stop()
    small = ss.Manager(orbitkv_bin, dram="64MiB", config=SMALL_EXTENT)
    small.socket = manager.socket
    try:
        small.start()
        for _ in range(6):
            be.batch_exists(keys)
            time.sleep(0.05)
        stats = be.get_stats()
        assert stats["refusals"].get("page_exceeds_extent", 0) >= 2, stats
        refused = stats["misses"].get("refused_page_exceeds_extent", 0)
        # The first call may find the old connection gone (connection_lost);
        # none after it is "down".
        assert refused >= 2 and "manager_down" not in stats["misses"], stats
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and "dram.extent_bytes" in errors[0].getMessage(), caplog.text
    finally:
        be.close()
        small.stop()
        shutil.rmtree(small.dir, ignore_errors=True)
