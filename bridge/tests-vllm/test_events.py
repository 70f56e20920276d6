"""The manager's KV event stream read as vLLM reads its own: the batches a
connector's saves cause decode with vLLM 0.33's own `KVEventBatch`
(msgspec), and their block hashes are vLLM's own block hashes of the
request, so a router keyed by vLLM's hashes scores OrbitKV's pages with no
translation."""

from __future__ import annotations

import shutil
import time

import msgspec
import pytest
import serve_support as ss
import zmq
from harness import engine
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

PROMPT = [10 + i for i in range(70)]


@pytest.fixture
def manager(orbitkv_bin):
    m = ss.Manager(orbitkv_bin, dram="64MiB")
    m.pub = f"ipc://{m.dir}/events"
    m.config.write_text(ss.CONFIG + f'[events]\npublish = "{m.pub}"\n')
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


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
