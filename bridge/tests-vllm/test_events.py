"""KV events with the real vLLM 0.33 classes. The manager's stream read as
vLLM reads its own: the batches a connector's saves cause decode with
vLLM's own `KVEventBatch`, and their block hashes are vLLM's block hashes
of the request. And the connector's `take_events` through vLLM's own
scheduler and ZMQ publisher (`--kv-events-config`): pages this engine can
load from OrbitKV appear as `BlockStored` (medium CPU) with their token
ids and parent hashes, and leave as `BlockRemoved` when the manager drops
them; a half-configured pair is said at startup."""

from __future__ import annotations

import logging
import subprocess
import time

import msgspec
import pytest
import serve_support as ss
import zmq
from harness import engine
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

PROMPT = [10 + i for i in range(70)]


@pytest.fixture
def manager(orbitkv_bin):
    m = ss.Manager(orbitkv_bin, dram="64MiB")
    m.pub = f"ipc://{m.dir}/events"
    m.rep = f"ipc://{m.dir}/replay"
    m.config.write_text(ss.CONFIG + f'[events]\npublish = "{m.pub}"\nreplay = "{m.rep}"\n')
    with ss.running(m):
        yield m


def test_saved_pages_are_advertised_in_vllms_own_format_with_vllms_hashes(model, manager):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(manager.pub)
    time.sleep(0.3)  # the subscription reaches the PUB socket
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        with engine(model, manager.socket) as e:
            e.add("A", PROMPT)
            want = [bytes(h) for h in e.sched.requests["A"].block_hashes][: len(PROMPT) // 16]
            e.run()
            stored, topics, seqs = [], set(), []
            deadline = time.monotonic() + ss.T
            while len(stored) < len(want):
                assert time.monotonic() < deadline, (stored, want)
                if not sub.poll(100):
                    continue
                topic, seq, payload = sub.recv_multipart()
                batch = decoder.decode(payload)  # vLLM's class: a shape error raises
                topics.add(topic.decode())
                seqs.append(int.from_bytes(seq, "big"))
                if not stored:
                    assert isinstance(batch.events[0], AllBlocksCleared)
                stored += [ev for ev in batch.events if isinstance(ev, BlockStored)]
            assert [ev.block_hashes[0] for ev in stored] == want
            assert all(ev.block_size == 16 and ev.medium == "CPU" for ev in stored)
            assert all(ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention" for ev in stored)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert len(topics) == 1 and all(len(t) == 64 for t in topics)
    finally:
        sub.close(0)


def subscriber(endpoint: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def test_pages_loadable_from_orbitkv_go_out_through_vllms_own_publisher(model, manager):
    vllm_pub = f"ipc://{manager.dir}/vllm-events"
    kve = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_pub)
    sub = subscriber(vllm_pub)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    got = []

    def drain():
        while sub.poll(0):
            _, _, payload = sub.recv_multipart()
            got.extend(ev for ev in decoder.decode(payload).events if getattr(ev, "medium", None) == "CPU")

    def cpu(kind):
        return [ev for ev in got if isinstance(ev, kind)]

    try:
        extra = {"events": manager.pub, "events_replay": manager.rep}
        with engine(model, manager.socket, extra=extra, kv_events=kve) as e:
            time.sleep(0.3)  # our subscription reaches vLLM's publisher
            e.add("A", PROMPT)
            want = [bytes(h) for h in e.sched.requests["A"].block_hashes][: len(PROMPT) // 16]
            e.run()
            # Each scheduler step takes the connector's events; steps go on
            # (nothing scheduled) until the manager's batches came through.
            e.run(until=lambda: drain() or len(cpu(BlockStored)) >= len(want))
            stored = cpu(BlockStored)
            # As vLLM's own GPU events carry them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
            want = [maybe_convert_block_hash(h) for h in want]
            assert [ev.block_hashes[0] for ev in stored] == want
            for i, ev in enumerate(stored):
                assert ev.token_ids == PROMPT[16 * i : 16 * (i + 1)], i
                assert ev.parent_block_hash == (want[i - 1] if i else None)
                assert (ev.block_size, ev.group_idx, ev.kv_cache_spec_kind) == (16, 0, "full_attention")
                assert ev.locality == "LOCAL"
            assert not cpu(BlockRemoved)
            # The manager drops them: withdrawn through the same path.
            p = subprocess.run(
                [str(ss.orbitkv_binary()), "clear", "--socket", manager.socket, "--instance", e.connector.spec.instance],
                capture_output=True,
                text=True,
                timeout=ss.T,
            )
            assert p.returncode == 0, p.stderr
            e.run(until=lambda: drain() or len(cpu(BlockRemoved)) >= len(want))
            assert sorted(ev.block_hashes[0] for ev in cpu(BlockRemoved)) == sorted(want)
            assert len(cpu(BlockStored)) == len(want), "nothing advertised twice"
    finally:
        sub.close(0)


def test_pages_demoted_to_the_ssd_are_advertised_as_storage_and_come_back_on_a_load(model, orbitkv_bin):
    # 8 KiB pages (2 layers, K and V, 2 heads of 16 float32, 16 tokens):
    # 32 of them in 256 KiB of DRAM, an SSD below.
    m = ss.Manager(orbitkv_bin, dram="256KiB")
    m.pub = f"ipc://{m.dir}/events"
    m.rep = f"ipc://{m.dir}/replay"
    ssd = m.dir / "ssd"
    ssd.mkdir()
    m.config.write_text(
        ss.CONFIG
        + f'[events]\npublish = "{m.pub}"\nreplay = "{m.rep}"\n'
        + f'[ssd]\ndir = "{ssd}"\ncapacity_bytes = 8388608\nsegment_bytes = 262144\n'
    )
    vllm_pub = f"ipc://{m.dir}/vllm-events"
    kve = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_pub)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    got = []
    with ss.running(m):
        sub = subscriber(vllm_pub)

        def drain():
            while sub.poll(0):
                _, _, payload = sub.recv_multipart()
                got.extend(
                    ev for ev in decoder.decode(payload).events if getattr(ev, "medium", None) in ("CPU", "STORAGE")
                )

        def of(h):
            """(kind, medium) of the events of hash `h`, in order."""
            return [(type(ev).__name__, ev.medium) for ev in got if ev.block_hashes == [h]]

        try:
            extra = {"events": m.pub, "events_replay": m.rep}
            with engine(model, m.socket, extra=extra, kv_events=kve) as e:
                time.sleep(0.3)  # our subscription reaches vLLM's publisher
                e.add("A", PROMPT)
                a = [maybe_convert_block_hash(bytes(h)) for h in e.sched.requests["A"].block_hashes][:4]
                e.run()
                # Twenty other prompts (80 pages) push A's pages out of DRAM
                # onto the SSD, and out of vLLM's own prefix cache.
                for i in range(20):
                    e.add(f"P{i}", [1000 * (i + 1) + j for j in range(70)])
                    e.run()
                e.run(until=lambda: drain() or all(("BlockStored", "STORAGE") in of(h) for h in a))
                for h in a:
                    assert of(h) == [("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")], of(h)
                stored = [ev for ev in got if isinstance(ev, BlockStored) and ev.block_hashes == [a[0]]]
                assert stored[1].token_ids == PROMPT[:16] and stored[1].locality == "LOCAL"
                # A load of A reads them from the SSD back into DRAM: CPU again.
                assert e.sched.reset_prefix_cache()
                e.wipe()
                before = e.stats.hit_tokens
                e.add("A2", PROMPT + [99, 98])
                e.run()
                assert e.stats.hit_tokens - before == 64, e.stats
                e.run(until=lambda: drain() or all(of(h)[-1] == ("BlockStored", "CPU") for h in a))
                for h in a:
                    assert of(h)[3:] == [("BlockStored", "CPU")], of(h)
                    assert ("BlockRemoved", "STORAGE") not in of(h), "still on the SSD"
        finally:
            sub.close(0)


def test_half_configured_events_are_said_at_startup(model, manager, caplog):
    kve = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with caplog.at_level(logging.WARNING, logger="orbitkv.vllm"):
        with engine(model, manager.socket, kv_events=kve) as e:
            assert e.connector.take_events() == []
    assert any("kv_connector_extra_config.events" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orbitkv.vllm"):
        with engine(model, manager.socket, extra={"events": manager.pub}):
            pass
    assert any("vLLM's KV events are off" in r.getMessage() for r in caplog.records), caplog.text
