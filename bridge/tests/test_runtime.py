"""The embedded runtime end to end: exact bytes, typed refusals, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

import orbitkv
from conftest import (
    DENSE,
    IDENTITY_A,
    PAGE,
    PAGE_BYTES,
    Engine,
    native_hash,
    register_cmd,
    small_config,
)


def payload(seed: int, i: int) -> bytes:
    return np.random.default_rng([seed, i]).integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()


def test_publish_query_restore_round_trip_exact_bytes(any_rt):
    eng = Engine(any_rt)
    rt = any_rt
    (ns,) = eng.register("llama", IDENTITY_A, DENSE)
    assert len(ns) == 64
    s = eng.open("llama")
    region, engine_region = eng.region(s, 0, 0, 16)

    # The engine computed 4 pages of prompt 7 into device slots 0..3.
    n = 4
    sources = []
    for i in range(n):
        dp = eng.alloc(s, region, i)
        rt.device_write(engine_region, i * PAGE_BYTES, payload(7, i))
        sources.append(dp)
    assert rt.device_read(engine_region, 0, PAGE_BYTES) == payload(7, 0)
    cid = rt.submit(
        {
            "command": "publish",
            "session": s,
            "request": 7,
            "pages": [
                {"rank": 0, "group": 0, "hash": native_hash(7, 0, i), "device_page": dp}
                for i, dp in enumerate(sources)
            ],
        }
    )
    done = eng.until("publish", lambda e: e["event"] == "publish_done")
    assert done == {
        "event": "publish_done",
        "command": cid,
        "request": 7,
        "inserted": n,
        "duplicates": 0,
        "dropped": 0,
    }
    for dp in sources:
        rt.submit({"command": "device_page_free", "session": s, "device_page": dp})
    for _ in sources:
        eng.until("free", lambda e: e["event"] == "device_page_freed")

    # A 5-page prompt: 4 pages are cached, the 5th must be computed.
    eng.rt.submit(
        {
            "command": "query",
            "session": s,
            "request": 8,
            "groups": [{"group": 0, "hashes": [native_hash(7, 0, i) for i in range(n + 1)]}],
            "origin": 0,
            "prompt_len": (n + 1) * PAGE,
            "prepare": True,
        }
    )
    result = eng.until("query", lambda e: e["event"] == "query_result")
    assert result["miss"] is None, result
    assert result["selected"] == n * PAGE
    assert result["common"][-1] == n * PAGE
    op = result["operation"]
    ready = eng.until("ready", lambda e: e["event"] in ("ready", "miss"))
    assert ready["event"] == "ready", ready
    assert ready["operation"] == op
    assert ready["boundary"] == n * PAGE
    assert len(ready["leases"]) == n
    assert ready["pages_from_dram"] == n

    # Restore into fresh slots 8..11 and check every byte.
    targets = []
    for i in range(n):
        dp = eng.alloc(s, region, 8 + i)
        targets.append(
            {"pos": {"rank": 0, "group": 0, "page_end": (i + 1) * PAGE}, "device_page": dp}
        )
    rt.submit(
        {"command": "restore", "session": s, "operation": op, "targets": targets, "retained": []}
    )
    done = eng.until("restore", lambda e: e["event"] in ("restore_done", "miss"))
    assert done == {
        "event": "restore_done",
        "operation": op,
        "pages": n,
        "bytes": n * PAGE_BYTES,
    }
    for i in range(n):
        assert rt.device_read(engine_region, (8 + i) * PAGE_BYTES, PAGE_BYTES) == payload(7, i), i

    rt.check_invariants()
    stats = rt.stats()
    assert (stats["operations"], stats["leases"], stats["transfers"], stats["bytes_reserved"]) == (
        0,
        0,
        0,
        0,
    ), stats
    assert stats["pages"] == n
    m = stats["metrics"]
    assert (m["hits"], m["hit_tokens"], m["bytes_restored"]) == (1, n * PAGE, n * PAGE_BYTES)
    assert rt.is_idle()


def test_refused_commands_are_typed_rejections(sim_rt):
    eng = Engine(sim_rt)
    e = eng.call({"command": "open_session", "instance": "nobody"})
    assert e["event"] == "rejected"
    assert e["error"] == {"error": "unknown_instance", "detail": "nobody"}

    eng.register("llama", IDENTITY_A, DENSE)
    s = eng.open("llama")
    e = eng.call({"command": "device_page_alloc", "session": s, "region": 12345, "slot": 0})
    assert e["event"] == "rejected"
    assert e["error"]["error"] == "unknown_region"

    e = eng.call({"command": "release", "session": s, "operation": 999})
    assert e["error"] == {"error": "unknown_operation", "detail": 999}

    stale = dict(s, incarnation=s["incarnation"] + 1)
    e = eng.call(
        {"command": "register_device_region", "session": stale, "rank": 0, "group": 0, "slots": 4}
    )
    assert e["error"] == {"error": "stale_session"}

    # Registering the same name with another identity conflicts.
    e = eng.call(register_cmd("llama", "bb" * 32, DENSE, 1))
    assert e["error"] == {"error": "instance_conflict", "detail": "llama"}
    assert sim_rt.stats()["metrics"]["commands_rejected"] == 5
    sim_rt.check_invariants()


def test_advance_clock_is_refused_on_wall_time():
    rt = orbitkv.Runtime(small_config())
    assert not rt.simulated_clock
    cid = rt.submit({"command": "advance_clock", "us": 10})
    (e,) = rt.tick()
    assert e == {"event": "rejected", "command": cid, "error": {"error": "wall_clock"}}


@pytest.mark.parametrize(
    "command, message",
    [
        ({"command": "open_session"}, "missing field `instance`"),
        ({"command": "teleport"}, "unknown variant `teleport`"),
        ({"instance": "x"}, "missing field `command`"),
        ({"command": "open_session", "instance": "x", "extra": 1}, "unknown field `extra`"),
        ({"command": "advance_clock", "us": "ten"}, "invalid type: string"),
        ({"command": "advance_clock", "us": -1}, "invalid value: integer `-1`"),
        ({"command": "advance_clock", "us": 1.5}, "invalid type: floating point"),
        ({"command": "advance_clock", "us": True}, "invalid type: boolean"),
        ({"command": "advance_clock", "us": 1 << 70}, "does not fit in 64 bits"),
        ({"command": "advance_clock", "us": float("nan")}, "not a finite number"),
        ({"command": "open_session", "instance": b"x"}, "bytes is not JSON data"),
        ({"command": "open_session", 1: "x"}, "dict keys must be str"),
        (["open_session", "x"], "expected a dict, got list"),
        ("open_session", "expected a dict, got str"),
        (
            dict(register_cmd("x", "AA" * 32, DENSE, 1)),
            "expected 64 lowercase hex digits",
        ),
    ],
)
def test_bad_dicts_raise_value_error(sim_rt, command, message):
    with pytest.raises(ValueError, match="invalid command") as info:
        sim_rt.submit(command)
    assert message in str(info.value)
    assert sim_rt.tick() == []


def test_self_referential_dict_is_a_value_error(sim_rt):
    d = {"command": "open_session"}
    d["instance"] = d
    with pytest.raises(ValueError, match="nests deeper"):
        sim_rt.submit(d)


def test_numpy_integers_are_accepted(sim_rt):
    cid = sim_rt.submit({"command": "advance_clock", "us": np.uint64(25)})
    assert sim_rt.tick() == []
    assert sim_rt.stats()["now_us"] == 25
    assert isinstance(cid, int)


def test_queue_full():
    rt = orbitkv.Runtime(small_config(limits={"max_inbox": 2}), simulated_clock=True)
    rt.submit({"command": "advance_clock", "us": 1})
    rt.submit({"command": "advance_clock", "us": 1})
    with pytest.raises(orbitkv.QueueFull, match="inbox is full"):
        rt.submit({"command": "advance_clock", "us": 1})
    rt.tick()
    assert rt.submit({"command": "advance_clock", "us": 1}) == 2


def test_config_as_json_text_and_bad_configs():
    rt = orbitkv.Runtime(json.dumps(small_config()), simulated_clock=True)
    assert rt.stats()["pool_capacity_bytes"] == 16 << 20
    with pytest.raises(ValueError, match="unknown field `dramm`"):
        orbitkv.Runtime({"dramm": {}})
    with pytest.raises(ValueError, match="speculative_percent"):
        orbitkv.Runtime(small_config(budget={"speculative_percent": 101}))
    with pytest.raises(ValueError, match="config"):
        orbitkv.Runtime("{not json")


def test_device_access_errors(sim_rt):
    eng = Engine(sim_rt)
    eng.register("llama", IDENTITY_A, DENSE)
    s = eng.open("llama")
    _, engine_region = eng.region(s, 0, 0, 2)
    sim_rt.device_write(engine_region, PAGE_BYTES, bytearray(b"\x01\x02"))
    assert sim_rt.device_read(engine_region, PAGE_BYTES, 3) == b"\x01\x02\x00"
    with pytest.raises(ValueError, match="outside"):
        sim_rt.device_read(engine_region, 2 * PAGE_BYTES - 1, 2)
    with pytest.raises(ValueError, match="outside"):
        sim_rt.device_write(engine_region, 2 * PAGE_BYTES, b"x")
    with pytest.raises(ValueError, match="unknown device region"):
        sim_rt.device_read(engine_region + 7, 0, 1)


def test_check_invariants_passes_and_error_type():
    assert issubclass(orbitkv.InvariantError, RuntimeError)
    assert issubclass(orbitkv.QueueFull, Exception)
    rt = orbitkv.Runtime(small_config(), simulated_clock=True)
    assert rt.check_invariants() is None


def test_record_writes_a_trace(sim_rt, tmp_path):
    path = tmp_path / "trace.jsonl"
    sim_rt.record(str(path), tick_interval_us=10)
    eng = Engine(sim_rt)
    eng.register("llama", IDENTITY_A, DENSE)
    eng.open("llama")
    sim_rt.stop_recording()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["orbitkv_trace"] == 1
    assert lines[0]["ticks"] == "explicit"
    assert len(lines) > 3
    with pytest.raises(OSError):
        sim_rt.record(str(tmp_path / "missing" / "dir" / "trace.jsonl"))


def test_events_are_plain_json_data(sim_rt):
    eng = Engine(sim_rt)
    eng.register("llama", IDENTITY_A, DENSE)
    for e in eng.events:
        assert json.loads(json.dumps(e)) == e


def test_ssd_tier_from_config(tmp_path):
    ssd = {"dir": str(tmp_path / "ssd"), "capacity_bytes": 4 << 20, "segment_bytes": 1 << 20}
    rt = orbitkv.Runtime(small_config(ssd=ssd))
    rt.tick()
    assert (tmp_path / "ssd").is_dir()
    rt.check_invariants()
    with pytest.raises(ValueError, match="simulated clock runs without lower tiers"):
        orbitkv.Runtime(small_config(ssd=ssd), simulated_clock=True)


def test_device_view_is_the_region_zero_copy():
    """Pages written through the view are what publish saves; a restore's
    bytes are visible through it; the view outlives the runtime."""
    rt = orbitkv.Runtime(small_config())
    eng = Engine(rt)
    eng.register("llama", IDENTITY_A, DENSE)
    s = eng.open("llama")
    _, engine_region = eng.region(s, 0, 0, 4)
    view = rt.device_view(engine_region)
    assert isinstance(view, memoryview) and not view.readonly
    assert len(view) == 4 * PAGE_BYTES
    region = np.frombuffer(view, dtype=np.uint8)
    region[PAGE_BYTES : 2 * PAGE_BYTES] = np.frombuffer(payload(3, 0), dtype=np.uint8)
    assert rt.device_read(engine_region, PAGE_BYTES, PAGE_BYTES) == payload(3, 0)
    rt.device_write(engine_region, 3 * PAGE_BYTES, b"\x07\x08")
    assert bytes(view[3 * PAGE_BYTES : 3 * PAGE_BYTES + 2]) == b"\x07\x08"
    # A second view maps the same memory.
    assert bytes(rt.device_view(engine_region)[PAGE_BYTES : 2 * PAGE_BYTES]) == payload(3, 0)
    del rt, eng
    assert bytes(view[PAGE_BYTES : PAGE_BYTES + 16]) == payload(3, 0)[:16]


def test_device_view_errors(sim_rt):
    eng = Engine(sim_rt)
    eng.register("llama", IDENTITY_A, DENSE)
    s = eng.open("llama")
    _, engine_region = eng.region(s, 0, 0, 2)
    with pytest.raises(ValueError, match="host copy engine"):
        sim_rt.device_view(engine_region)
    rt = orbitkv.Runtime(small_config())
    with pytest.raises(ValueError, match="unknown device region 5"):
        rt.device_view(5)
