"""`orbitkv.Session`, the engine side every adapter uses, against a real
`orbitkv serve`: exact bytes through save and load (a shared region and a
copy agent's memory), the slot table, batch lookups, typed misses, typed
refusals never reported as unavailability (and raised again while the
backoff waits), reconnection after a manager restart with the engine's
setup run again, and bad input refused before anything is sent."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

import orbitkv
import serve_support as ss
from serve_support import PAGE, PAGE_BYTES


@pytest.fixture(scope="session")
def orbitkv_bin():
    return ss.orbitkv_binary()


@pytest.fixture
def manager(orbitkv_bin):
    m = ss.Manager(orbitkv_bin)
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def hashes(n: int, seed: int = 0):
    return [(0x5E55 + (seed << 20) + i).to_bytes(8, "big") for i in range(n)]


def payload(i: int) -> np.ndarray:
    return ((np.arange(PAGE_BYTES, dtype=np.uint32) * 13 + i * 7 + 1) % 251).astype(np.uint8)


class Engine:
    """An engine's memory and setup: one region of `slots` pages, shared
    with the manager or attached to the session's copy agent."""

    def __init__(self, slots: int = 32, agent: bool = False):
        self.slots = slots
        self.agent = agent
        self.mem = np.zeros((slots, PAGE_BYTES), dtype=np.uint8)
        self.region = None
        self.setups = 0

    def on_connect(self, s: orbitkv.Session) -> None:
        self.setups += 1
        if self.agent:
            a = s.client.attach_agent_memory(self.slots, [(self.mem.ctypes.data, PAGE_BYTES, PAGE_BYTES)], self.mem)
            self.region = s.register_region(0, 0, self.slots, agent=a)
        else:
            self.region = s.register_region(0, 0, self.slots)

    def page(self, s: orbitkv.Session, slot: int) -> np.ndarray:
        s.connect()  # the region is registered on connecting
        if self.agent:
            return self.mem[slot]
        view = np.frombuffer(s.region_view(self.region), dtype=np.uint8)
        return view[slot * PAGE_BYTES : (slot + 1) * PAGE_BYTES]

    def save(self, s: orbitkv.Session, hs, first_slot: int = 0) -> orbitkv.Saved:
        slots = [first_slot + i for i in range(len(hs))]
        for i, slot in enumerate(slots):
            self.page(s, slot)[:] = payload(i)
        dps = s.device_pages(self.region, slots)
        return s.save([(0, 0, h, dp) for h, dp in zip(hs, dps)])

    def load(self, s: orbitkv.Session, hs, first_slot: int) -> orbitkv.Loaded:
        dps = s.device_pages(self.region, [first_slot + i for i in range(len(hs))])
        return s.load(
            [0],
            hs,
            0,
            len(hs) * PAGE + 1,
            ranks=[0],
            targets=[(0, 0, (i + 1) * PAGE, dp) for i, dp in enumerate(dps)],
        )


def session(manager, engine: Engine, **kw) -> orbitkv.Session:
    return orbitkv.Session(manager.socket, ss.instance(), name="test", on_connect=engine.on_connect, **kw)


@pytest.mark.parametrize("agent", [False, True], ids=["shared-region", "copy-agent"])
def test_save_then_load_is_byte_exact_through_the_slot_table(manager, agent):
    e = Engine(agent=agent)
    with session(manager, e) as s:
        hs = hashes(4)
        miss = s.lookup([0], hs, 0, 4 * PAGE + 1)
        assert miss.miss is orbitkv.MissReason.NOT_FOUND and not miss.hit
        assert str(miss.miss) == "not_found" and miss.miss == "not_found"

        saved = e.save(s, hs)
        assert (saved.inserted, saved.dropped, saved.stored) == (4, 0, 4)
        hit = s.lookup([0], hs, 0, 4 * PAGE + 1)
        assert hit.hit and hit.selected == 4 * PAGE and hit.miss is None, hit
        assert hit.candidates == [(0, 0, [PAGE * (i + 1) for i in range(4)])]

        for _ in range(2):
            for slot in range(8, 12):
                e.page(s, slot)[:] = 0
            got = e.load(s, hs, 8)
            assert got.hit and got.boundary == 4 * PAGE and got.pages == 4, got
            assert sorted(got.leased) == [(0, 0, PAGE * (i + 1)) for i in range(4)]
            for i in range(4):
                assert np.array_equal(e.page(s, 8 + i), payload(i)), i
            # Slots 0..4 (the save) and 8..12: one device page per slot, once.
            assert s.device_pages_held == 8
        assert s.device_pages(e.region, [9, 0]) == s.device_pages(e.region, [9, 0])

        # A longer prompt whose tail was never stored loads its prefix.
        longer = hs + hashes(2, seed=9)
        got = e.load(s, longer, 16)
        assert got.hit and got.boundary == 4 * PAGE, got
    assert not s.up


def test_a_batch_of_lookups_answers_as_single_ones(manager):
    e = Engine()
    with session(manager, e) as s:
        stored = hashes(4)
        e.save(s, stored)
        queries = []
        for i in range(100):
            h = [stored, stored[:3], stored[:2] + hashes(2, seed=100 + i), hashes(4, seed=200 + i)][i % 4]
            queries.append(([0], h, 0, len(h) * PAGE + 1))
        batch = s.lookup_many(queries)
        assert [b.selected for b in batch] == [[4 * PAGE, 3 * PAGE, 2 * PAGE, None][i % 4] for i in range(100)]
        for q, b in zip(queries, batch):
            one = s.lookup(*q)
            assert (one.selected, one.miss, one.candidates) == (b.selected, b.miss, b.candidates)
        assert {b.miss for b in batch} == {None, orbitkv.MissReason.NOT_FOUND}
        assert s.lookup_many([]) == []


def test_lookups_in_flight_wrap_the_response_mailbox_and_each_gets_its_own_answer(manager):
    """Responses travel in a 256-slot mailbox in the connection's area:
    up to 30 lookups in flight at once, each asking for a different
    prefix, over many laps of the mailbox, every answer reaches its own
    ticket, none goes to the socket, and nothing is left held."""
    e = Engine()
    with session(manager, e) as s:
        stored = hashes(4)
        e.save(s, stored)
        fallbacks = manager.metric("hot_fallbacks_total") or 0
        answers = 0
        for r in range(120):
            n = 1 + r % 30
            # Ticket i asks for i % 5 stored pages and then one unknown.
            asked = {}
            for i in range(n):
                k = i % 5
                h = stored[:k] + hashes(1, seed=1000 + r)
                asked[s.start_lookup([0], h, 0, len(h) * PAGE + 1)] = k
            deadline = time.monotonic() + 10
            while asked:
                assert time.monotonic() < deadline, f"{len(asked)} lookups unanswered"
                for ticket, k in list(asked.items()):
                    got = s.lookup_result(ticket)
                    if got is not None:
                        assert got.selected == (k * PAGE if k else None), (ticket, k, got)
                        del asked[ticket]
                        answers += 1
        assert answers == sum(1 + r % 30 for r in range(120)) > 2 * 256
        assert (manager.metric("hot_fallbacks_total") or 0) == fallbacks
        manager.wait_metric("leases", 0)


def test_warm_wakes_a_sleeping_manager_and_never_connects(manager):
    idle = orbitkv.Session(manager.socket, ss.instance(), name="never-connected")
    idle.warm()  # not connected: nothing, and no connection is made
    assert not idle.up
    with session(manager, Engine()) as s:
        s.lookup([0], hashes(2), 0, 2 * PAGE + 1)
        time.sleep(0.3)  # past the manager's spin: it sleeps
        before = manager.metric("hot_warmed_total")
        assert before is not None
        # A warm that finds the manager awake (its idle tick's round) does
        # nothing, by design: warm again until one finds it asleep.
        deadline = time.monotonic() + ss.T
        while True:
            s.warm()
            time.sleep(0.15)
            if manager.metric("hot_warmed_total") > before:
                break
            assert time.monotonic() < deadline, "no warm woke the manager"
        # The warmed manager answers as ever.
        assert s.lookup([0], hashes(2), 0, 2 * PAGE + 1).miss == orbitkv.MissReason.NOT_FOUND


def test_locate_says_what_a_load_would_restore_and_from_which_tier(manager):
    e = Engine()
    with session(manager, e) as s:
        stored = hashes(4)
        e.save(s, stored)
        one = s.locate(stored + hashes(2, seed=7))
        assert (one.tokens, one.by_tier, one.miss) == (4 * PAGE, {"dram": 4 * PAGE}, None), one
        # The prompt caps it as it caps a load; a prompt nobody stored misses.
        prompts = [(stored, 4 * PAGE), (stored[:2], None), (hashes(3, seed=9), None)] * 30
        batch = s.locate_many(prompts)
        assert [b.tokens for b in batch] == [3 * PAGE, 2 * PAGE, 0] * 30
        assert batch[2].miss == orbitkv.MissReason.NOT_FOUND and batch[2].by_tier == {}
        # The same answer as the load it predicts, and nothing held.
        assert s.lookup([0], stored, 0, 4 * PAGE).selected == batch[0].tokens
        assert s.locate_many([]) == []
        with pytest.raises(ValueError):
            s.locate([b""])
        manager.wait_metric("leases", 0)
        manager.wait_metric("operations", 0)


def test_a_refusal_is_typed_and_raised_again_while_the_backoff_waits(manager):
    e = Engine()
    with session(manager, e) as first:
        first.connect()
        other = ss.instance(identity="07" * 32)  # the same name, another computation
        s = orbitkv.Session(manager.socket, other, reconnect_interval=60.0)
        for attempt in range(2):
            with pytest.raises(orbitkv.Refused) as info:
                s.lookup([0], hashes(1), 0, PAGE + 1)
            err = info.value
            assert isinstance(err, orbitkv.Rejected) and not isinstance(err, ConnectionError)
            assert err.command == "register_instance"
            assert err.args[:2] == ("instance_conflict", "instance_conflict"), err.args
            assert "refused register_instance (instance_conflict)" in str(err)
        assert s.failures == 1, "the second call waited for the backoff"
        assert not s.up and "instance_conflict" in s.last_error


def test_no_manager_is_unavailable_then_a_restart_reconnects_with_the_setup_run_again(manager):
    with pytest.raises(orbitkv.Unavailable) as info:
        orbitkv.Session(str(manager.dir / "none.sock"), ss.instance()).connect()
    assert isinstance(info.value, ConnectionError)

    e = Engine()
    s = session(manager, e, reconnect_interval=0.05)
    try:
        hs = hashes(2)
        e.save(s, hs)
        assert (s.generation, e.setups, s.device_pages_held) == (1, 1, 2)
        old = s.handle
        manager.restart()
        with pytest.raises(orbitkv.Unavailable):
            s.lookup([0], hs, 0, 2 * PAGE + 1)
        assert not s.up
        time.sleep(0.06)
        got = s.lookup([0], hs, 0, 2 * PAGE + 1)
        assert got.miss is orbitkv.MissReason.NOT_FOUND, "DRAM did not survive the restart"
        assert (s.generation, e.setups, s.device_pages_held) == (2, 2, 0)
        assert s.handle["incarnation"] != old["incarnation"]
        assert e.save(s, hs).inserted == 2
        assert e.load(s, hs, 4).hit
    finally:
        s.close()


def test_a_certain_miss_is_answered_in_process_and_a_saved_page_never(manager):
    e = Engine(slots=4)
    with session(manager, e) as s:
        s.connect()
        never = hashes(3, seed=7)
        local = s.lookup_local([0], never, 0)
        assert local is not None and local.local and local.reason == "not_found"
        assert str(local.miss) == "not_found" and local.selected is None and not local.hit
        got = s.lookup([0], never, 0, 3 * PAGE + 1)
        assert got.local and got.reason == "not_found"
        # Saved, then asked at once: the manager answers (a hit).
        stored = hashes(2, seed=8)
        e.save(s, stored)
        assert s.lookup_local([0], stored, 0) is None
        hit = s.lookup([0], stored, 0, 2 * PAGE + 1)
        assert hit.selected == 2 * PAGE and not hit.local and hit.reason is None
        # Past a stored prefix, the first page asked for decides.
        assert s.lookup_local([0], stored + never, 2 * PAGE).local
        many = s.lookup_many([([0], stored, 0, 2 * PAGE + 1), ([0], never, 0, 3 * PAGE + 1)])
        assert [(l.selected, l.local) for l in many] == [(2 * PAGE, False), (None, True)]
        # `lookup_local` reads one hash, and says what is wrong with it.
        with pytest.raises(ValueError, match="hash 0 is not bytes"):
            s.lookup_local([0], ["ab", b"x" * 8], 0)
        assert s.lookup_local([0], [b"x" * 8, "never read"], 0).local


def test_a_long_lookup_stops_at_a_page_the_filter_proves_absent(manager):
    e = Engine(slots=4)
    with session(manager, e) as s:
        s.connect()
        stored = hashes(3, seed=9)
        e.save(s, stored)
        long = stored + hashes(100, seed=10)
        # Pages 1 and 2 are probed and may be held; page 4 is in no tier.
        n = s.pages_worth_asking([0], long, 0)
        assert n == 4
        prompt = len(long) * PAGE + 1
        full = s.lookup([0], long, 0, prompt)
        short = s.lookup([0], long[:n], 0, prompt)
        assert (full.selected, full.reason) == (short.selected, short.reason) == (3 * PAGE, None)
        # Nothing proven absent, or nothing the filter may judge: all of it.
        assert s.pages_worth_asking([0], stored, 0) == 3
        assert s.pages_worth_asking([], long, 0) == len(long), "not the instance's groups"
        assert s.pages_worth_asking([0], long, PAGE // 2) == len(long), "origin off a page"
        assert s.pages_worth_asking([0], [], 0) == 0
        # Only probed items are read, and a bad one is named.
        with pytest.raises(ValueError, match="hash 1 is not bytes"):
            s.pages_worth_asking([0], [stored[0], "x", stored[2]], 0)


def test_bad_input_is_refused_before_anything_is_sent(manager):
    e = Engine(slots=4)
    with session(manager, e) as s:
        s.connect()
        with pytest.raises(ValueError, match="hash 1 is not bytes"):
            s.lookup([0], [b"x" * 8, "ab"], 0, 3 * PAGE)
        with pytest.raises(ValueError, match="hash 1 is not bytes but <class 'bytearray'>"):
            s.lookup([0], [b"x" * 8, bytearray(8)], 0, 3 * PAGE)
        with pytest.raises(ValueError, match="hash 2 is not bytes"):
            s.lookup([0], (b"x" * 8, b"y" * 8, None), 0, 4 * PAGE)
        with pytest.raises(ValueError, match="hash 0"):
            s.lookup([0], [b"x" * 65], 0, PAGE + 1)
        with pytest.raises(ValueError, match="outside region"):
            s.device_pages(e.region, [4])
        with pytest.raises(ValueError, match="not one this session registered"):
            s.device_pages(e.region + 1000, [0])
        # A plan that names no page for what the manager selects.
        e.save(s, hashes(2))
        with pytest.raises(orbitkv.Refused) as info:
            s.load([0], hashes(2), 0, 2 * PAGE + 1, ranks=[0], targets=[])
        assert info.value.command == "load" and info.value.args[1] == "load_invalid"
        assert s.up, "a refusal leaves the session up"
        assert s.lookup([0], hashes(2), 0, 2 * PAGE + 1).selected == 2 * PAGE
    with pytest.raises(TypeError, match="orbitkv.Instance"):
        orbitkv.Session(manager.socket, ss.register_cmd())  # a command dict is not an instance
    with pytest.raises(ValueError, match="reconnect_interval"):
        orbitkv.Session(manager.socket, ss.instance(), reconnect_interval=0)


def test_an_instance_is_checked_where_it_is_made_naming_the_bad_part():
    good = ss.instance()
    assert good == ss.instance() and good != ss.instance(identity="07" * 32)
    assert (good.name, good.identity, good.page_tokens) == (ss.INSTANCE, ss.IDENTITY, PAGE)
    assert good.groups == ss.register_cmd()["groups"] and good.ranks == [{"tp": 0, "pp": 0}]
    assert good.layout["slots"][0]["segment_bytes"] == ss.PAGE_BYTES
    cmd = ss.register_cmd()

    def make(**change):
        parts = dict(
            name=ss.INSTANCE,
            identity=ss.IDENTITY,
            layout=cmd["layout"],
            page_tokens=PAGE,
            groups=cmd["groups"],
            ranks=cmd["ranks"],
        )
        parts.update(change)
        return orbitkv.Instance(**parts)

    for change, part in (
        ({"identity": "AB" * 32}, "identity"),  # upper case is not the contract's hex
        ({"identity": "ab"}, "identity"),
        ({"page_tokens": 0}, "page_tokens"),
        ({"name": ""}, "name"),
        ({"groups": []}, "groups"),
        ({"groups": [{"id": 0, "rule": "sometimes", "components": ["attention_kv"]}]}, "groups"),
        ({"ranks": []}, "ranks"),
        ({"ranks": [{"tp": -1, "pp": 0}]}, "ranks"),
        ({"layout": [1, 2]}, "layout"),
        ({"layout": {"slots": [{"layer": 0}], "pool_capacity_pages": 0}}, "layout"),
    ):
        with pytest.raises(ValueError, match=f'instance "[^"]*": {part}: '):
            make(**change)
    assert make() == good


def _round_trip(s: orbitkv.Session, e: Engine, seed: int) -> None:
    hs = hashes(3, seed=seed)
    assert e.save(s, hs).inserted == 3
    for slot in range(8, 11):
        e.page(s, slot)[:] = 0
    got = e.load(s, hs, 8)
    assert got.hit and got.boundary == 3 * PAGE, got
    for i in range(3):
        assert np.array_equal(e.page(s, 8 + i), payload(i)), i


@pytest.mark.parametrize("agent", [False, True], ids=["shared-region", "copy-agent"])
def test_a_session_on_an_embedded_runtime_ticks_it_while_it_waits(agent):
    rt = orbitkv.Runtime({"dram": {"capacity_bytes": 16 << 20, "extent_bytes": 64 << 10, "first_touch": False}})
    e = Engine(agent=agent)
    with orbitkv.Session(rt, ss.instance(), on_connect=e.on_connect) as s:
        assert s.client is rt
        _round_trip(s, e, seed=1)
        t = s.start_load([0], hashes(3, seed=1), 0, 3 * PAGE + 1, ranks=[0], targets=[])
        while True:
            done = [o for ticket, o in s.poll(1.0) if ticket == t]
            if done:
                break
        assert isinstance(done[0], orbitkv.Refused) and done[0].args[1] == "load_invalid", done
    assert rt.is_idle()
    with pytest.raises(ValueError, match="wall-clock"):
        orbitkv.Session(orbitkv.Runtime(simulated_clock=True), ss.instance())


def test_two_sessions_share_a_callers_connection(manager):
    c = orbitkv.Client(manager.socket, "shared")
    a, b = Engine(), Engine()
    sa = orbitkv.Session(c, ss.instance(), on_connect=a.on_connect)
    sb = orbitkv.Session(c, ss.instance(), on_connect=b.on_connect)
    # Interleaved: each claims its own answers from the one connection.
    sa.connect()
    ta = sa.start_save([(0, 0, hashes(1, seed=9)[0], sa.device_pages(a.region, [20])[0])])
    _round_trip(sb, b, seed=2)
    assert [type(o) for t, o in sa.poll(5.0) if t == ta] == [orbitkv.Saved]
    _round_trip(sa, a, seed=3)
    assert sa.handle["id"] != sb.handle["id"]
    sa.close()
    assert not c.closed, "a caller's connection is the caller's"
    _round_trip(sb, b, seed=4)
    sb.close()
    c.close()


def test_the_stubs_name_every_public_member_of_the_session_types():
    import ast
    import pathlib

    tree = ast.parse((pathlib.Path(orbitkv.__file__).parent / "_orbitkv.pyi").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def members(c: ast.ClassDef) -> set:
        out = set()
        for m in c.body:
            if isinstance(m, ast.FunctionDef):
                out.add(m.name)
            elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                out.add(m.target.id)
        return out

    for cls in (orbitkv.Session, orbitkv.Instance, orbitkv.Lookup, orbitkv.Loaded, orbitkv.Saved, orbitkv.Ready):
        public = {n for n in dir(cls) if not n.startswith("_")}
        missing = public - members(classes[cls.__name__])
        assert not missing, f"{cls.__name__}: {sorted(missing)} not in the stubs"
    stub_reasons = [
        m.value.value
        for m in classes["MissReason"].body
        if isinstance(m, ast.Assign) and isinstance(m.value, ast.Constant)
    ]
    assert stub_reasons == [r.value for r in orbitkv.MissReason]


def test_a_prefix_not_worth_loading_is_a_typed_miss_counted_on_metrics(orbitkv_bin):
    # Three pages at least: a two-page prefix costs more to load than to
    # recompute (as this manager is told).
    m = ss.Manager(orbitkv_bin, config=ss.CONFIG + f"[restore]\nmin_load_tokens = {3 * PAGE}\n")
    try:
        m.start()
        e = Engine()
        with session(m, e) as s:
            short, long = hashes(2, seed=1), hashes(4, seed=2)
            assert e.save(s, short).inserted == 2
            assert e.save(s, long, first_slot=4).inserted == 4
            found = s.lookup([0], short, 0, 2 * PAGE + 1)
            assert (found.selected, found.miss) == (None, orbitkv.MissReason.NOT_WORTH_LOADING)
            got = e.load(s, short, first_slot=16)
            assert not got.hit and got.miss is orbitkv.MissReason.NOT_WORTH_LOADING
            assert not e.page(s, 16).any() and not e.page(s, 17).any(), "nothing copied"
            assert s.lookup([0], long, 0, 4 * PAGE + 1).selected == 4 * PAGE
            got = e.load(s, long, first_slot=16)
            assert got.hit and got.pages == 4
            assert all((e.page(s, 16 + i) == payload(i)).all() for i in range(4))
        deadline = time.monotonic() + ss.T
        line = 'orbitkv_misses_total{reason="not_worth_loading"} 2'
        while line not in m.metrics_text():
            assert time.monotonic() < deadline, m.metrics_text()
            time.sleep(0.05)
        # The load's copies were measured: the device rate reaches /metrics
        # (what prefill_tokens_per_s is weighed against) at a refresh.
        def device_rate() -> int:
            rate = [
                l for l in m.metrics_text().splitlines()
                if l.startswith('orbitkv_load_rate_bytes_per_second{source="device"}')
            ]
            assert len(rate) == 1, rate
            return int(rate[0].split()[1])

        while device_rate() == 0:
            assert time.monotonic() < deadline, m.metrics_text()
            time.sleep(0.05)
        m.wait_metric("leases", 0)
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_hold_pins_promised_pages_until_the_load_naming_it_retired(manager):
    e = Engine()
    with session(manager, e) as s:
        hs = hashes(4, seed=3)
        e.save(s, hs[:2])
        # Two of the four promised pages are in DRAM already.
        promised, pinned, reserved = s.hold([0], hs, 0xABCD, 10_000)
        assert (promised, pinned, reserved) == (4, 2, 4 * PAGE_BYTES)
        manager.wait_metric("handoffs_standing", 1)
        manager.wait_metric("leases", 2)
        with pytest.raises(orbitkv.Refused) as info:
            s.hold([0], hs, 0xABCD, 10_000)
        assert info.value.args[:2] == ("invalid", "handoff_exists") and s.up
        with pytest.raises(orbitkv.Refused) as info:
            s.hold([0], hs, 1, 10_000_000)
        assert info.value.args[:2] == ("limit", "limit_max_handoff_deadline")
        # The other two land and are pinned as they do.
        for i, h in enumerate(hs[2:]):
            e.page(s, 20 + i)[:] = payload(2 + i)
        dps = s.device_pages(e.region, [20, 21])
        s.save([(0, 0, h, dp) for h, dp in zip(hs[2:], dps)])
        manager.wait_metric("handoff_pinned_pages", 4)
        # The load that names the handoff takes the pages: byte-exact, and
        # the pins are returned once it retired.
        dps = s.device_pages(e.region, [8, 9, 10, 11])
        got = s.load(
            [0], hs, 0, 4 * PAGE + 1, ranks=[0],
            targets=[(0, 0, (i + 1) * PAGE, dp) for i, dp in enumerate(dps)], handoff=0xABCD,
        )  # fmt: skip
        assert got.hit and got.boundary == 4 * PAGE
        for i in range(4):
            assert np.array_equal(e.page(s, 8 + i), payload(i)), i
        for name in ("handoffs_standing", "handoff_pinned_pages", "handoff_reserved_bytes", "leases"):
            manager.wait_metric(name, 0)
