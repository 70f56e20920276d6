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
