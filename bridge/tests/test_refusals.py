"""`orbitkv.refusals`: the one rule that tells an operator what to change
to end a manager's refusal, in the engine's own words, and the rate-limited
report every adapter keeps while a refusal lasts. The refusals here are the
manager's own: a real `orbitkv serve` refuses a registration and a quota."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest

import orbitkv
import serve_support as ss
from orbitkv.refusals import Names, RefusalLog, explain, message

NAMES = Names(ranks="--tp", instance="--instance", page_size="--page", groups="the pools")


SMALL_EXTENT = "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nslot_align_bytes = 512\nextent_bytes = 512\n"


def refusal(config: str):
    """The refusal a manager with `config` gives a session of the test
    instance, as `orbitkv.Session.connect` raises it."""
    m = ss.Manager(ss.orbitkv_binary(), dram="64MiB", config=config).start()
    try:
        with orbitkv.Session(m.socket, ss.instance(), name="t") as s:
            with pytest.raises(orbitkv.Refused) as err:
                s.connect()
            return err.value
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


def test_a_page_larger_than_an_extent_names_the_managers_setting_and_the_engines():
    e = refusal(SMALL_EXTENT)
    assert e.command == "register_instance" and e.args[1] == "page_exceeds_extent"
    text = message(e, NAMES)
    assert text.startswith("the OrbitKV manager refused register_instance (page_exceeds_extent): ")
    assert f"is {ss.PAGE_BYTES} bytes, more than one DRAM extent of the manager (512 bytes)" in text
    assert text.endswith("raise the manager's dram.extent_bytes, or use a smaller --page")


def test_a_session_quota_names_the_serve_setting():
    config = ss.CONFIG.replace("[serve]\n", "[serve]\nmax_sessions_per_process = 1\n")
    m = ss.Manager(ss.orbitkv_binary(), dram="64MiB", config=config).start()
    try:
        with orbitkv.Client(m.socket, "holder") as holder:
            ss.register(holder)
            ss.open_session(holder)
            with orbitkv.Session(m.socket, ss.instance(), name="t") as s:
                with pytest.raises(orbitkv.Refused) as err:
                    s.connect()
        text = message(err.value, NAMES)
        assert "(limit_max_sessions_per_process)" in text, text
        assert "the manager's limit max_sessions_per_process (1) is reached: raise [serve] " in text, text
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


@pytest.mark.parametrize(
    "reason, detail, says",
    [
        ("unknown_rank", {"rank": 3}, "rank 3 is not one of the ranks the instance registers (--tp)"),
        ("unknown_rank", {"rank": 2}, "rank 2 is outside 0..2 (--tp)"),
        ("contract", {"reason": "no group"}, "the pools do not form a recovery contract: no group"),
        ("slot_group", {"group": 9}, "the storage layout (--page and the pools) was refused"),
        ("instance_conflict", "llama", "--instance 'llama' is registered in the manager with another identity"),
        ("limit_max_publish_pages", {"limit": 8}, "the manager's limit max_publish_pages (8) is reached"),
        ("something_new", {"x": 1}, "the manager refused it (something_new: {'x': 1})"),
    ],
)
def test_every_reason_says_what_to_change(reason, detail, says):
    names = dataclasses.replace(NAMES, rank_count=2) if detail == {"rank": 2} else NAMES
    assert says in explain(reason, detail, names)


def test_a_limit_that_is_not_a_client_quota_does_not_blame_serve():
    assert "[serve]" not in explain("limit_max_publish_pages", {"limit": 8}, NAMES)
    assert "[serve] max_sessions_per_uid" in explain("limit_max_sessions_per_uid", {"limit": 2}, NAMES)


def test_the_log_counts_every_refusal_and_logs_once_per_interval(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("orbitkv.refusals.time.monotonic", lambda: now[0])
    log = RefusalLog(logging.getLogger("t.refusals"), "engine: ", interval_s=10.0)
    with caplog.at_level(logging.ERROR, logger="t.refusals"):
        log.record("contract", "first")
        log.record("contract", "second")
        log.record("limit_x", "third")
        now[0] += 10.0
        log.record("contract", "fourth")
        log.record("contract", "at startup", log=False)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "engine: first; lookups miss and saves are dropped until this is fixed",
        "engine: fourth; lookups miss and saves are dropped until this is fixed (2 more refusals since the last report)",
    ]
    assert log.counts == {"contract": 4, "limit_x": 1}
    assert log.last == "at startup"
