"""Helpers shared by the bridge tests: an engine-side driver for
`orbitkv.Runtime`, mirroring world/tests/common/mod.rs."""

from __future__ import annotations

import time
from typing import Callable, Dict, List

import pytest

import orbitkv

PAGE = 64
PAGE_BYTES = 4096
TICK_US = 10
IDENTITY_A = "aa" * 32

DENSE = [{"id": 0, "rule": "prefix", "components": ["attention_kv"]}]
HYBRID = [
    {"id": 0, "rule": "prefix", "components": ["attention_kv"]},
    {"id": 1, "rule": {"window": 100}, "components": ["sliding_window_kv"]},
    {
        "id": 2,
        "rule": "checkpoint",
        "components": ["recurrent_checkpoint", "convolution_state"],
    },
]


def small_config(**overrides) -> Dict:
    """A 16 MiB pool that is not first-touched, invariants checked each tick."""
    config = {
        "dram": {
            "capacity_bytes": 16 << 20,
            "extent_bytes": 64 << 10,
            "first_touch": False,
        },
        "check_invariants": True,
    }
    config.update(overrides)
    return config


def register_cmd(name: str, identity: str, groups: List[Dict], ranks: int) -> Dict:
    """RegisterInstance as world/tests/common `register_cmd` builds it: one
    layer per group, 4 KiB pages of 64 tokens, on every tp rank."""
    slots = [
        {
            "layer": layer,
            "group": g["id"],
            "tp_rank": tp,
            "pp_rank": 0,
            "segment_bytes": PAGE_BYTES,
            "padded_page_bytes": PAGE_BYTES,
            "page_tokens": PAGE,
            "dtype": "bfloat16",
            "layout": "NHD",
            "strides": [64, 1],
            "device_addr": 0,
        }
        for tp in range(ranks)
        for layer, g in enumerate(groups)
    ]
    return {
        "command": "register_instance",
        "instance": name,
        "identity": identity,
        "layout": {"slots": slots, "pool_capacity_pages": 0},
        "page_tokens": PAGE,
        "groups": groups,
        "ranks": [{"tp": tp, "pp": 0} for tp in range(ranks)],
    }


def native_hash(seed: int, group: int, i: int) -> str:
    """An engine chained hash: 8 bytes as hex, distinct per seed/group/page."""
    return f"{seed:06x}{group:02x}{i:08x}"


class Engine:
    """Plays the engine side: submits, ticks, waits for answers. On a
    simulated clock it advances time; on a wall clock it sleeps briefly."""

    def __init__(self, rt: orbitkv.Runtime):
        self.rt = rt
        self.events: List[Dict] = []
        self.pending: List[Dict] = []

    def tick(self) -> List[Dict]:
        if self.rt.simulated_clock:
            self.rt.submit({"command": "advance_clock", "us": TICK_US})
        else:
            time.sleep(0.0005)
        ev = self.rt.tick()
        self.events.extend(ev)
        self.pending.extend(ev)
        return ev

    def until(self, what: str, pred: Callable[[Dict], bool], ticks: int = 20_000) -> Dict:
        """The first not yet consumed event matching `pred` (bounded)."""
        deadline = time.monotonic() + 30
        for _ in range(ticks):
            for i, e in enumerate(self.pending):
                if pred(e):
                    del self.pending[i]
                    return e
            if time.monotonic() > deadline:
                break
            self.tick()
        raise AssertionError(f"no event for {what}; last events: {self.events[-5:]}")

    def call(self, command: Dict) -> Dict:
        """Submits and returns the event that answers this command's id."""
        cid = self.rt.submit(command)
        ev = self.rt.tick()
        self.events.extend(ev)
        self.pending.extend(ev)
        return self.until(
            command["command"], lambda e: e.get("command") == cid and "event" in e
        )

    # Engine steps -----------------------------------------------------

    def register(self, name: str, identity: str, groups: List[Dict], ranks: int = 1):
        e = self.call(register_cmd(name, identity, groups, ranks))
        assert e["event"] == "instance_registered", e
        return e["namespaces"]

    def open(self, name: str) -> Dict:
        e = self.call({"command": "open_session", "instance": name})
        assert e["event"] == "session_opened", e
        return e["session"]

    def region(self, session: Dict, rank: int, group: int, slots: int):
        e = self.call(
            {
                "command": "register_device_region",
                "session": session,
                "rank": rank,
                "group": group,
                "slots": slots,
            }
        )
        assert e["event"] == "region_registered", e
        assert e["page_bytes"] == PAGE_BYTES
        return e["region"], e["engine_region"]

    def alloc(self, session: Dict, region: int, slot: int) -> int:
        e = self.call(
            {"command": "device_page_alloc", "session": session, "region": region, "slot": slot}
        )
        assert e["event"] == "device_page_allocated", e
        return e["device_page"]


@pytest.fixture
def sim_rt() -> orbitkv.Runtime:
    return orbitkv.Runtime(small_config(), simulated_clock=True)


@pytest.fixture(params=[True, False], ids=["simulated", "host"])
def any_rt(request) -> orbitkv.Runtime:
    """Both backends: the simulated copy engine on a simulated clock, and the
    host copy engine (worker threads) on wall time."""
    return orbitkv.Runtime(small_config(), simulated_clock=request.param)
