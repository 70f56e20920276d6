"""The manager's KV event stream (`[events]`) against a real `orbitkv serve`
and a real pyzmq subscriber: what two engines store and what evictions
remove reach the subscriber in order, with each topic's sequence numbers
without gaps; every page advertised is restorable and every
page not advertised is not; a missed batch comes back from the replay
socket; a restarted manager starts each topic again, at higher numbers,
with AllBlocksCleared; pages demoted to the SSD are advertised as
`STORAGE`, and a restarted manager lists what its SSD scan found;
bad settings stop the start naming the setting."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

import orbitkv
import serve_support as ss
from orbitkv import events as kv
from serve_support import PAGE, PAGE_BYTES


@pytest.fixture(scope="session")
def orbitkv_bin():
    return ss.orbitkv_binary()


def with_events(binary, dram: str = "128KiB", extra: str = "") -> ss.Manager:
    m = ss.Manager(binary, dram=dram)
    m.pub = f"ipc://{m.dir}/events"
    m.rep = f"ipc://{m.dir}/replay"
    m.config.write_text(ss.CONFIG + f'[events]\npublish = "{m.pub}"\nreplay = "{m.rep}"\n{extra}')
    return m


@pytest.fixture
def manager(orbitkv_bin):
    with ss.running(with_events(orbitkv_bin)) as m:
        yield m


def hashes(n: int, seed: int):
    return [(0xE7E0 + (seed << 20) + i).to_bytes(8, "big") for i in range(n)]


class Engine:
    """One engine: a region of `slots` pages shared with the manager."""

    def __init__(self, slots: int = 32):
        self.slots = slots
        self.region = None

    def on_connect(self, s: orbitkv.Session) -> None:
        self.region = s.register_region(0, 0, self.slots)

    def save(self, s: orbitkv.Session, hs) -> orbitkv.Saved:
        s.connect()
        view = np.frombuffer(s.region_view(self.region), dtype=np.uint8)
        for i in range(len(hs)):
            view[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] = (i * 7 + 3) % 251
        dps = s.device_pages(self.region, list(range(len(hs))))
        return s.save([(0, 0, h, dp) for h, dp in zip(hs, dps)])


def session(m, e: Engine, name: str) -> orbitkv.Session:
    return orbitkv.Session(m.socket, ss.instance(), name=name, on_connect=e.on_connect, reconnect_interval=0.05)


def stored(s: orbitkv.Session, h: bytes) -> bool:
    """Whether the manager would restore the page `h` (a one-page prefix)."""
    return s.lookup([0], [h], 0, PAGE + 1).selected == PAGE


def subscribe(m, **kw) -> kv.Subscriber:
    sub = kv.Subscriber(m.pub, m.rep, **kw)
    time.sleep(0.3)  # the subscription reaches the PUB socket (ZMQ's slow joiner)
    return sub


def test_stores_and_evictions_of_two_engines_reach_a_subscriber_in_order(manager):
    with subscribe(manager) as sub:
        a, b = Engine(), Engine()
        with session(manager, a, "a") as sa, session(manager, b, "b") as sb:
            first, second = hashes(24, seed=1), hashes(24, seed=2)
            assert a.save(sa, first).inserted == 24
            # 32 pages of DRAM: the second engine's pages evict the first's.
            assert b.save(sb, second).inserted == 24
            topic = sa.namespaces[0]
            sub.wait_until(lambda s: (0, second[-1]) in s.held.get(topic, ()))
            sub.poll(0.3)
            assert list(sub.held) == [topic], "one topic: the instance's one namespace"
            seqs = [seq for t, seq, _ in sub.log if t == topic]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gaps"
            # From the manager's start time (ms << 20): a restart jumps ahead.
            assert abs((seqs[0] >> 20) / 1000 - time.time()) < 600, seqs[0]
            assert sub.replayed == 0 and sub.unfilled == 0
            first_events = sub.log[0][2].events
            assert isinstance(first_events[0], kv.AllBlocksCleared), "a topic starts by clearing"

            evs = [ev for _, _, batch in sub.log for ev in batch.events]
            stores = [ev for ev in evs if isinstance(ev, kv.BlockStored)]
            removes = [ev for ev in evs if isinstance(ev, kv.BlockRemoved)]
            assert [ev.block_hashes[0] for ev in stores] == first + second
            for ev in stores:
                assert (ev.block_size, ev.medium, ev.group_idx) == (PAGE, "CPU", 0)
                assert (ev.kv_cache_spec_kind, ev.locality) == ("full_attention", "LOCAL")
                assert ev.token_ids == [] and ev.parent_block_hash is None
            # The least recently used went, oldest first, each once.
            gone = [ev.block_hashes[0] for ev in removes]
            assert gone == first[: len(gone)] and len(gone) >= 16, gone
            assert all(ev.medium == "CPU" for ev in removes)

            # Honest: advertised exactly when restorable.
            held = {h for _, h in sub.held[topic]}
            for h in first + second:
                assert stored(sa, h) == (h in held), h
            assert held == set(first[len(gone) :] + second)

            # The counters agree with what was received.
            text = manager.metrics_text()
            n_batches = len([1 for t, _, _ in sub.log if t == topic])
            assert f"orbitkv_kv_events_batches_total {n_batches}" in text, text
            assert f'orbitkv_kv_events_events_total{{kind="BlockStored"}} {len(stores)}' in text
            assert f'orbitkv_kv_events_events_total{{kind="BlockRemoved"}} {len(removes)}' in text


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket(manager):
    e = Engine()
    with session(manager, e, "a") as s:
        early = hashes(4, seed=3)
        # Two batches before anyone subscribed.
        assert e.save(s, early[:2]).inserted == 2
        assert e.save(s, early).inserted == 2
        topic = s.namespaces[0]
        with subscribe(manager, topics=[topic]) as sub:
            # What the stream sent before: the whole topic, from 0.
            replayed = sub.replay(topic, 0)
            base = replayed[0][1]
            assert [seq for _, seq, _ in replayed] == [base, base + 1]
            assert {t for t, _, _ in replayed} == {topic}
            got = [ev for _, _, p in replayed for ev in kv.decode(p).events]
            assert [ev.block_hashes[0] for ev in got if isinstance(ev, kv.BlockStored)] == early
            # vLLM's request form (no topic) replays every topic.
            assert sub.replay(None, 0) == replayed
            assert sub.replay(topic, base + 2) == []
            assert sub.replay(topic, base + 1) == replayed[1:]
            # Pretend the subscriber saw only the first batch: the next live
            # batch shows the gap, which the replay fills before it applies.
            sub._apply(topic, base, replayed[0][2])
            later = hashes(2, seed=4)
            assert e.save(s, later).inserted == 2
            sub.wait_until(lambda x: (0, later[-1]) in x.held.get(topic, ()))
            assert sub.replayed == 1 and sub.unfilled == 0
            assert {h for _, h in sub.held[topic]} == set(early + later)
            seqs = [seq for _, seq, _ in sub.log]
            assert seqs == list(range(base, base + len(seqs)))


def test_a_restarted_manager_starts_each_topic_again_above_with_a_clear(manager):
    e = Engine()
    with subscribe(manager) as sub:
        with session(manager, e, "a") as s:
            assert e.save(s, hashes(3, seed=5)).inserted == 3
            topic = s.namespaces[0]
            sub.wait_until(lambda x: len(x.held.get(topic, ())) == 3)
            manager.restart()
            # The new manager's DRAM is empty: its first batch on the topic
            # clears, then advertises only what it holds. The subscription
            # may come back after that batch: the next one shows the
            # subscriber a jump, and the replay gives it what it missed.
            fresh = hashes(2, seed=6)
            with pytest.raises(orbitkv.Unavailable):
                e.save(s, fresh)  # the old connection is gone
            time.sleep(0.06)
            assert e.save(s, fresh).inserted == 2
            # ZMQ reconnects the subscription in its own time: the engine
            # goes on storing, and the first batch that reaches the
            # subscriber shows it the jump.
            saved = list(fresh)
            deadline = time.monotonic() + ss.T
            while {h for _, h in sub.held.get(topic, ())} != set(saved):
                assert time.monotonic() < deadline, (sub.held, sub.log)
                more = hashes(1, seed=10 + len(saved))
                assert e.save(s, more).inserted == 1
                saved += more
                sub.poll(0.2)
            # Two runs of numbers, each opened by AllBlocksCleared; the
            # second starts above the first.
            seqs = [seq for _, seq, _ in sub.log]
            jumps = [i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1] + 1]
            assert len(jumps) == 1 and seqs[jumps[0]] > seqs[jumps[0] - 1], seqs
            for i in (0, jumps[0]):
                assert isinstance(sub.log[i][2].events[0], kv.AllBlocksCleared)
            assert sub.unfilled == 0


def test_demotions_to_the_ssd_and_a_restarts_scan_are_advertised_as_storage(orbitkv_bin):
    m = with_events(orbitkv_bin)
    ssd = m.dir / "ssd"
    ssd.mkdir()
    m.config.write_text(
        m.config.read_text() + f'[ssd]\ndir = "{ssd}"\ncapacity_bytes = 4194304\nsegment_bytes = 262144\n'
    )
    with ss.running(m), subscribe(m) as sub:
        a, b = Engine(), Engine()
        with session(m, a, "a") as sa, session(m, b, "b") as sb:
            first, second = hashes(24, seed=11), hashes(24, seed=12)
            assert a.save(sa, first).inserted == 24
            # 32 pages of DRAM: the second engine's pages push the first's
            # down to the SSD.
            assert b.save(sb, second).inserted == 24
            topic = sa.namespaces[0]
            sub.wait_until(lambda s: "STORAGE" in s.media.get(topic, {}).get((0, first[0]), ()))
            sub.poll(0.3)
            media = sub.media[topic]
            demoted = [h for h in first if "STORAGE" in media.get((0, h), ())]
            assert demoted == first[: len(demoted)] and len(demoted) >= 16, demoted
            for h in demoted:
                assert media[(0, h)] == {"STORAGE"}, "left DRAM, on the SSD"
            for h in second:
                assert media[(0, h)] == {"CPU"}
            evs = [ev for _, _, batch in sub.log for ev in batch.events]
            on_ssd = [ev for ev in evs if isinstance(ev, kv.BlockStored) and ev.medium == "STORAGE"]
            assert all(ev.locality == "LOCAL" and ev.block_size == PAGE for ev in on_ssd)
            # Honest: what is advertised anywhere is what a load would find.
            held = {h for _, h in sub.held[topic]}
            for h in first + second:
                assert stored(sa, h) == (h in held), h
            # The router's answer agrees: the demoted prefix reads from the SSD.
            where = sa.locate(first[: len(demoted)])
            assert where.tokens == len(demoted) * PAGE and where.by_tier == {"ssd": len(demoted) * PAGE}, where

        # A restart: DRAM starts empty, the SSD's scan finds the demoted
        # pages, and the new manager advertises them after its clear.
        m.restart()
        c = Engine()
        with session(m, c, "c") as sc:
            saved = []
            deadline = time.monotonic() + ss.T
            # Until the subscriber saw the new manager's clear and scan (the
            # old manager's DRAM pages stay advertised until then).
            while {h for _, h in sub.held.get(topic, ())} != set(demoted) | set(saved) or not saved:
                assert time.monotonic() < deadline, (sub.held, list(sub.log)[-3:])
                more = hashes(1, seed=30 + len(saved))
                assert c.save(sc, more).inserted == 1
                saved += more
                sub.poll(0.2)
            sub.poll(0.3)
            media = sub.media[topic]
            assert all(media[(0, h)] == {"STORAGE"} for h in demoted)
            assert {h for _, h in sub.held[topic]} == set(demoted) | set(saved)
            for h in first + second + saved:
                assert stored(sc, h) == (h in set(demoted) | set(saved)), h
            assert sub.unfilled == 0


@pytest.mark.parametrize(
    "events, named",
    [
        ('publish = "udp://127.0.0.1:1"', "publish"),
        ('publish = "ipc:///nonexistent-dir/x/events"', "publish"),
        ('publish = "tcp://127.0.0.1:0"\nmax_events_per_batch = 0', "max_events_per_batch"),
        ('publish = "tcp://127.0.0.1:0"\nreplay = "tcp://nonsense"', "replay"),
        ('publish = "tcp://127.0.0.1:0"\nbatches = 3', "batches"),
        ('publish = "tcp://0.0.0.0:5557"', "public"),
    ],
)
def test_a_bad_events_setting_stops_the_start_naming_it(orbitkv_bin, tmp_path, events, named):
    cfg = tmp_path / "c.toml"
    cfg.write_text(ss.CONFIG + "[events]\n" + events + "\n")
    p = subprocess.run(
        [str(orbitkv_bin), "serve", "--socket", str(tmp_path / "s"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=ss.T,
    )
    assert p.returncode != 0
    assert named in p.stderr and "events" in p.stderr, p.stderr


@pytest.mark.parametrize("tiers", ["dram", "dram+ssd"])
def test_over_a_randomized_run_every_advertised_page_is_restorable_or_withdrawn(orbitkv_bin, tiers):
    # Three engines storing random prompts into 32 pages of DRAM: eviction
    # all along (with an SSD of about 32 records below it: demotions, and
    # the SSD's own evictions). After each round, every page the subscriber
    # holds is looked up; one that misses must be withdrawn by an event
    # received afterwards (it was evicted after its BlockStored: a race),
    # never stay advertised.
    import random

    m = with_events(orbitkv_bin)
    if tiers == "dram+ssd":
        ssd = m.dir / "ssd"
        ssd.mkdir()
        m.config.write_text(
            m.config.read_text() + f'[ssd]\ndir = "{ssd}"\ncapacity_bytes = 262144\nsegment_bytes = 65536\n'
        )
    rng = random.Random(27)
    engines = [Engine() for _ in range(3)]
    with ss.running(m) as manager, subscribe(manager) as sub:
        sessions = [session(manager, e, f"e{i}") for i, e in enumerate(engines)]
        try:
            topic = None
            races = 0
            for round_ in range(30):
                i = rng.randrange(3)
                hs = hashes(rng.randint(1, 12), seed=rng.randrange(40))
                engines[i].save(sessions[i], hs)
                topic = sessions[i].namespaces[0]
                sub.poll(0.05)
                missing = {h for _, h in sub.held.get(topic, ()) if not stored(sessions[0], h)}
                if missing:
                    races += 1
                    sub.wait_until(lambda x: not (missing & {h for _, h in x.held.get(topic, ())}))
            # Settled: what is advertised is exactly what is restorable.
            sub.poll(0.3)
            held = {h for _, h in sub.held[topic]}
            every = {h for seed in range(40) for h in hashes(12, seed)}
            assert held == {h for h in every if stored(sessions[0], h)}
            assert sub.unfilled == 0
            media = {x for where in sub.media[topic].values() for x in where}
            assert media == ({"CPU", "STORAGE"} if tiers == "dram+ssd" else {"CPU"}), media
            print(f"{tiers}: rounds 30, races {races}, pages advertised {len(held)}")
        finally:
            for s in sessions:
                s.close()


def test_a_subscriber_skips_what_is_not_a_batch_and_never_raises(tmp_path):
    import msgspec
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    addr = f"ipc://{tmp_path}/pub"
    pub.bind(addr)
    good = msgspec.msgpack.encode(
        kv.KVEventBatch(ts=1.0, events=[kv.BlockStored([b"h"], None, [], 16, None, "CPU", None, group_idx=0)])
    )
    try:
        # A replay socket that never answers: gaps stay unfilled, no error.
        with kv.Subscriber(addr, f"ipc://{tmp_path}/silent", timeout=0.1) as sub:
            time.sleep(0.3)
            pub.send_multipart([b"t", (5).to_bytes(8, "big")])  # two frames
            pub.send_multipart([b"t", b"\x00", good])  # a short seq
            pub.send_multipart([b"t", (5).to_bytes(8, "big"), b"\xc1garbage"])
            pub.send_multipart([b"u", (7).to_bytes(8, "big"), good])
            sub.wait_until(lambda x: x.held.get("u") == {(0, b"h")})
            assert sub.malformed == 3 and sub.held.get("t", set()) == set()
    finally:
        pub.close(0)
