"""`orbitkv.Client` against a real `orbitkv serve` subprocess: exact bytes
across client processes through shared memory, a manager restart, clients
killed mid-restore, malformed frames and a foreign uid, many concurrent
clients. Every wait is bounded; no manager or worker outlives its test.

The manager binary is `ORBITKV_BIN`, or target/debug/orbitkv (built with
`cargo build --bin orbitkv` if missing; scripts/python-tests.sh builds it).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import orbitkv
import serve_support as ss
from serve_support import PAGE, PAGE_BYTES, T

TEST_LIMIT_S = 120


@pytest.fixture(autouse=True)
def time_limit():
    """Fails a test that runs past TEST_LIMIT_S (waits in the client check
    for signals between 100 ms slices), so teardown still runs."""

    def expired(signum, frame):
        raise TimeoutError(f"test ran past {TEST_LIMIT_S}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


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
        m.stop()  # SIGTERM, then SIGKILL
        shutil.rmtree(m.dir, ignore_errors=True)


@pytest.fixture
def workers():
    """Worker processes a test starts; killed at teardown if still alive."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(T)
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                f.close()


def start(workers, *args) -> subprocess.Popen:
    p = ss.spawn(*args)
    workers.append(p)
    return p


def finish(p: subprocess.Popen, timeout: float = 30):
    """Waits for a worker; returns (exit status, stdout lines, stderr)."""
    out, err = p.communicate(timeout=timeout)
    text = (getattr(p, "_okv_buf", b"") + out).decode()
    return p.returncode, text.splitlines(), err.decode(errors="replace")


def ok_line(p: subprocess.Popen, timeout: float = 30) -> dict:
    rc, lines, err = finish(p, timeout)
    assert rc == 0 and lines and lines[-1].startswith("OK "), (rc, lines, err[-3000:])
    return json.loads(lines[-1][3:])


def stale_session_rejected(event: dict) -> bool:
    return event["event"] == "rejected" and event["error"]["error"] == "stale_session"


# ---------------------------------------------------------------------------


def test_client_api(manager):
    with pytest.raises(orbitkv.ConnectionError):
        orbitkv.Client(str(manager.dir / "nothing.sock"))
    assert issubclass(orbitkv.ConnectionError, ConnectionError)

    c = orbitkv.Client(manager.socket, "api")
    assert c.incarnation > 0 and c.pool_bytes == 16 << 20
    assert c.socket == manager.socket and c.name == "api" and not c.closed
    assert "incarnation" in repr(c)
    assert 0 < c.ping() < T

    with pytest.raises(ValueError, match="invalid command"):
        c.submit({"command": "teleport"})
    with pytest.raises(ValueError, match="expected a dict"):
        c.call([("command", "open_session")])
    with pytest.raises(ValueError, match="timeout"):
        c.wait_event(-1)
    assert c.wait_event(0.05) is None

    ss.register(c)
    r = c.call({"command": "open_session", "instance": "nope"})
    assert r["event"] == "rejected" and r["error"]["error"] == "unknown_instance", r

    s = ss.open_session(c)
    region = ss.open_region(c, s, slots=8)
    # Region views: writable, shared with every other view of the region.
    v1, v2 = c.region(region), c.region(region)
    assert len(v1) == 8 * PAGE_BYTES and not v1.readonly
    assert type(v1.obj) is orbitkv.SharedBuffer
    v1[:5] = b"hello"
    assert bytes(v2[:5]) == b"hello"
    a = np.frombuffer(v2, dtype=np.uint8)
    a[5:8] = [1, 2, 3]
    assert bytes(v1[5:8]) == b"\x01\x02\x03"
    with pytest.raises(ValueError, match="not a device region"):
        c.region(12345)
    with pytest.raises(TypeError):
        orbitkv.SharedBuffer()

    # Pages: read-only views of the pool, bounds-checked.
    pub = ss.publish(c, 2, seed=5)
    ready = ss.query_ready(c, s, 2, seed=5)
    assert ss.check_pages(c, ready, seed=5) == 2
    page = c.page(ready["leases"][0])
    with pytest.raises(TypeError):
        page[0] = 0
    assert not np.frombuffer(page, dtype=np.uint8).flags.writeable
    bad = dict(ready["leases"][0], offset=c.pool_bytes - 10)
    with pytest.raises(ValueError, match="outside"):
        c.page(bad)
    with pytest.raises(ValueError, match="invalid lease"):
        c.page({"offset": 0})
    # Bytes that do not match the lease's checksum are never handed out.
    forged = dict(ready["leases"][0], checksum=ready["leases"][0]["checksum"] ^ 1)
    with pytest.raises(orbitkv.ConnectionError, match="checksum"):
        c.page(forged)
    whole = c.pool()
    assert len(whole) == c.pool_bytes
    first = ready["leases"][0]
    assert bytes(whole[first["offset"] : first["offset"] + first["bytes"]]) == bytes(c.page(first))

    # A close is answered once the session is gone, naming its command.
    ss.release(c, s, ready["operation"])
    closed = c.call({"command": "close_session", "session": pub["session"]})
    assert closed["event"] == "session_closed", closed
    assert closed["session"] == pub["session"]
    assert isinstance(closed["command"], int)
    # wait_event filters by operation; poll_events drains the rest.
    qr = c.call(ss.query_cmd(s, 3, prepare=True, seed=5))
    other = c.call(ss.query_cmd(s, 3, prepare=True, seed=5))
    e = c.wait_event(T, operation=other["operation"])
    assert e["event"] == "ready" and e["operation"] == other["operation"]
    deadline = time.monotonic() + T
    rest = []
    while not rest and time.monotonic() < deadline:
        rest = [e for e in c.poll_events() if e["event"] == "ready"]
    assert [e["operation"] for e in rest] == [qr["operation"]]
    assert c.poll_events() == []
    for op in (qr["operation"], other["operation"]):
        ss.release(c, s, op)

    # Views outlive the client; the closed client refuses calls.
    c.close()
    c.close()
    assert c.closed
    assert bytes(v1[:5]) == b"hello" and bytes(page) == ss.payload(0, 5)
    v1[:5] = b"world"
    for call in (c.ping, c.poll_events, lambda: c.region(region)):
        with pytest.raises(orbitkv.ConnectionError, match="closed"):
            call()
    del c
    assert bytes(v2[:5]) == b"world"
    # A slice or array keeps the mapping alive without its parent view.
    part, arr = v2[1:5], np.frombuffer(page, dtype=np.uint8)
    del v1, v2, a, page
    gc.collect()
    assert bytes(part) == b"orld" and arr.tobytes() == ss.payload(0, 5)
    manager.wait_metric("sessions", 0)
    manager.wait_metric("leases", 0)

    with orbitkv.Client(manager.socket) as c2:
        assert c2.ping() < T
    assert c2.closed


def test_typed_lookup(manager):
    # `Client.lookup`: hashes as bytes, typed answers, nothing to release.
    c = orbitkv.Client(manager.socket, "lookup")
    ss.register(c)
    s = ss.open_session(c)
    as_bytes = [bytes.fromhex(h) for h in ss.hashes(3, seed=7)]
    assert c.lookup(s, 1, [0], as_bytes, 0, 3 * PAGE) == (None, "not_found")
    ss.publish(c, 2, seed=7)
    # Two pages stored, a three-page prompt: the boundary below its last
    # token is page 2's end; a subclass of bytes (vLLM's BlockHash) works.
    class BlockHash(bytes):
        pass

    hit = c.lookup(s, 2, [0], [BlockHash(h) for h in as_bytes], 0, 3 * PAGE)
    assert hit == (2 * PAGE, None)
    # Past what the engine holds (origin) nothing more is stored.
    assert c.lookup(s, 3, [0], as_bytes, 2 * PAGE, 3 * PAGE) == (None, "not_found")
    # The same answer as a `query` without prepare, which must be released.
    q = c.call(ss.query_cmd(s, 3, prepare=False, seed=7))
    assert q["selected"] == 2 * PAGE, q
    ss.release(c, s, q["operation"])
    # Bad input: typed errors, nothing sent.
    with pytest.raises(ValueError, match="hash 1 is not bytes"):
        c.lookup(s, 4, [0], [as_bytes[0], "00ff"], 0, 3 * PAGE)
    with pytest.raises(ValueError, match="hash 0"):
        c.lookup(s, 4, [0], [b""], 0, 3 * PAGE)
    with pytest.raises(ValueError, match="hash 0"):
        c.lookup(s, 4, [0], [bytes(65)], 0, 3 * PAGE)
    with pytest.raises(ValueError, match="invalid session"):
        c.lookup({"id": 1}, 4, [0], as_bytes, 0, 3 * PAGE)
    # Refusals are typed: a group the instance does not have, a session of
    # another incarnation.
    with pytest.raises(orbitkv.Rejected) as e:
        c.lookup(s, 5, [9], as_bytes, 0, 3 * PAGE)
    assert e.value.args[0] == "invalid", e.value.args
    stale = dict(s, incarnation=s["incarnation"] + 1)
    with pytest.raises(orbitkv.Rejected) as e:
        c.lookup(stale, 6, [0], as_bytes, 0, 3 * PAGE)
    assert e.value.args[:2] == ("stale_session", "stale_session"), e.value.args
    # A reply nobody waited for (as after a lookup that timed out) is
    # dropped by the next lookup.
    late = dict(ss.query_cmd(s, 3, prepare=False, seed=7), command="lookup")
    del late["prepare"]
    c.submit(late)
    assert c.lookup(s, 8, [0], as_bytes, 0, 3 * PAGE) == (2 * PAGE, None)
    assert c.poll_events() == []
    manager.wait_metric("operations", 0)
    manager.wait_metric("leases", 0)
    c.close()


class Interrupted(Exception):
    pass


def test_waits_release_the_gil_and_take_signals(manager):
    c = orbitkv.Client(manager.socket, "waiter")
    got = []
    t0 = time.monotonic()
    waiter = threading.Thread(target=lambda: got.append(c.wait_event(0.8, kind="nothing")))
    waiter.start()
    time.sleep(0.01)
    # This thread ran while the other one waited (no GIL held in the wait).
    assert time.monotonic() - t0 < 0.5
    waiter.join(T)
    assert got == [None]

    def interrupt(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            c.wait_event(5.0)
        assert time.monotonic() - t0 < 1.0
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert c.ping() < T  # still usable after the interruption


def test_round_trip_across_processes(manager, workers):
    """Process A writes pages into its device region and publishes them;
    process B queries, reads the leased pages zero-copy from the pool,
    restores them into its own region and checks every byte."""
    a = start(workers, "publish", manager.socket, 4, 3)
    line = ss.read_line(a)
    assert line.startswith("PUBLISHED "), (line, a.stderr.read1().decode())
    assert json.loads(line.split(" ", 1)[1])["inserted"] == 4

    b = start(workers, "restore", manager.socket, 4, 3)
    result = ok_line(b)
    assert result["pages"] == 4 and len(set(result["leases"])) == 4

    # The pages stay queryable after B is gone; A leaves cleanly.
    assert finish(a)[0] == 0  # closes its stdin
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)
    manager.wait_metric("connections", 0)


def test_manager_restart(manager):
    old = orbitkv.Client(manager.socket, "old")
    ss.register(old)
    session = ss.open_session(old)
    incarnation = old.incarnation

    manager.restart()
    with pytest.raises(orbitkv.ConnectionError):
        old.ping()
    with pytest.raises(ConnectionError):  # the builtin, too
        old.call({"command": "open_session", "instance": ss.INSTANCE})

    new = orbitkv.Client(manager.socket, "new")
    assert new.incarnation != incarnation
    r = new.call(ss.query_cmd(session, 2, prepare=False))
    assert stale_session_rejected(r), r
    ss.register(new)
    fresh = ss.open_session(new)
    r = new.call(ss.query_cmd(fresh, 2, prepare=False))
    # DRAM did not survive the restart (no SSD tier).
    assert r["event"] == "query_result" and r["miss"] is not None, r
    ss.publish(new, 2)
    ready = ss.query_ready(new, fresh, 2)
    assert ss.check_pages(new, ready) == 2
    ss.release(new, fresh, ready["operation"])


@pytest.mark.parametrize("stage", ["query", "ready", "restore"])
def test_killed_client_returns_leases(manager, workers, stage):
    """SIGKILL a client after submitting a query with prepare, while holding
    leases after Ready, or after submitting a restore: its session closes and
    every lease and reserved byte returns."""
    pub = orbitkv.Client(manager.socket, "publisher")
    ss.publish(pub, 4)
    doomed = start(workers, "doomed", manager.socket, 4, stage)
    assert ss.read_line(doomed) == f"STAGE {stage}"
    if stage == "ready":
        manager.wait_metric("leases", 4)
        manager.wait_metric("bytes_reserved", 4 * PAGE_BYTES)
    manager.wait_metric("connections", 2)
    doomed.send_signal(signal.SIGKILL)
    assert doomed.wait(T) == -signal.SIGKILL
    manager.wait_metric("connections", 1)
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)
    manager.wait_metric("operations", 0)
    manager.wait_metric("sessions", 1)  # the publisher's
    # The pages are intact and still served.
    s = ss.open_session(pub)
    ready = ss.query_ready(pub, s, 4)
    assert ss.check_pages(pub, ready) == 4
    ss.release(pub, s, ready["operation"])


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(T)
    s.connect(path)
    return s


def raw_hello(s: socket.socket) -> None:
    s.sendall(ss.frame(ss.KIND["hello"], b'{"protocol": %d, "client": "raw"}' % ss.PROTOCOL))
    kind, body = ss.read_frame(s)  # the pool's descriptor is dropped by recv
    assert kind == ss.KIND["welcome"], body


MALFORMED = [
    # (name, greet first, bytes, what the Error frame says)
    ("garbage", False, b"GARBAGE-NOT-A-FRAME!", "magic"),
    ("huge length", False, ss.frame(ss.KIND["submit"], b"", length=0xFFFFFFFF), "exceeds"),
    ("bad version", False, b"OKVP" + bytes([9, 0, 3, 0]) + bytes(8), "version"),
    ("unknown kind", True, ss.frame(99, b""), "unknown frame kind"),
    ("submit before hello", False, ss.frame(ss.KIND["submit"], b"{}"), "Hello"),
    ("invalid json", True, ss.frame(ss.KIND["submit"], b'{"tag": 1, "command": {'), "Submit"),
    (
        "unknown command",
        True,
        ss.frame(ss.KIND["submit"], b'{"tag": 1, "command": {"command": "teleport"}}'),
        "Submit",
    ),
    ("server frame", True, ss.frame(ss.KIND["welcome"], b"{}"), "not a client frame"),
]


def test_malformed_frames_refused(manager):
    good = orbitkv.Client(manager.socket, "good")
    ss.register(good)
    for name, greet, data, says in MALFORMED:
        with raw_connect(manager.socket) as s:
            if greet:
                raw_hello(s)
            s.sendall(data)
            got = ss.read_frame(s)
            assert got is not None, f"{name}: closed without an Error frame"
            kind, body = got
            assert kind == ss.KIND["error"], (name, kind, body)
            assert says in json.loads(body)["error"], (name, body)
            assert ss.read_frame(s) is None, f"{name}: connection left open"
        # The other client is unaffected.
        assert good.ping() < T
        assert good.call({"command": "open_session", "instance": ss.INSTANCE})["event"] == (
            "session_opened"
        ), name
    manager.wait_metric("connections", 1)


NOBODY_CLIENT = r"""
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(sys.argv[1])
def exact(n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            return None
        b += c
    return b
h = exact(16)
kind, n = struct.unpack("<HI", h[6:12])
body = exact(n).decode()
print(json.dumps({"uid": __import__("os").getuid(), "kind": kind, "body": body,
                  "closed": exact(1) is None}))
"""


def python_for(uid: int):
    """An interpreter that user `uid` may run (the venv's may sit in a
    directory only its owner can enter)."""
    for cand in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3"):
        if not cand or not os.path.exists(cand):
            continue
        try:
            r = subprocess.run(
                [cand, "-I", "-c", "pass"],
                user=uid,
                group=uid,
                extra_groups=[],
                capture_output=True,
                timeout=T,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            return cand
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
def test_other_uid_refused(manager):
    nobody = 65534
    python = python_for(nobody)
    if python is None:
        pytest.skip("no Python interpreter the nobody user may run")
    good = orbitkv.Client(manager.socket, "good")
    # Let another user reach the socket; only SO_PEERCRED keeps it out.
    os.chmod(manager.dir, 0o711)
    os.chmod(manager.socket, 0o666)
    r = subprocess.run(
        [python, "-I", "-c", NOBODY_CLIENT, manager.socket],
        user=nobody,
        group=nobody,
        extra_groups=[],
        capture_output=True,
        timeout=T,
    )
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    assert got["uid"] == nobody
    assert got["kind"] == ss.KIND["error"], got
    assert f"uid {nobody}" in json.loads(got["body"])["error"], got
    assert got["closed"], got
    assert good.ping() < T
    ss.register(good)
    assert ss.open_session(good)
    manager.wait_metric("connections", 1)


def test_many_concurrent_clients(manager, workers):
    """8 client processes, each looping for a few seconds over open session
    / query / prepare / release and query / restore; no errors, and nothing
    stays leased or reserved."""
    seconds = 4
    pub = orbitkv.Client(manager.socket, "publisher")
    ss.publish(pub, 4)
    procs = [start(workers, "loop", manager.socket, 4, seconds, k) for k in range(8)]
    pings = []
    while any(p.poll() is None for p in procs):
        pings.append(pub.ping())
        time.sleep(0.1)
    results = [ok_line(p) for p in procs]
    for r in results:
        assert r["releases"] >= 1 and r["restores"] >= 1, results
        assert r["pages_checked"] == 4 * r["releases"], r
    assert max(pings) < T
    manager.wait_metric("connections", 1)
    manager.wait_metric("leases", 0)
    manager.wait_metric("bytes_reserved", 0)
    manager.wait_metric("operations", 0)
    manager.wait_metric("sessions", 1)
    print(
        "iterations per process:",
        [r["releases"] for r in results],
        f"max ping {max(pings) * 1e3:.2f} ms",
    )


def test_the_spin_budget_is_bounded_and_waits_still_answer(manager):
    c = orbitkv.Client(manager.socket, "spin")
    try:
        with pytest.raises(ValueError, match="at most 10000"):
            c.set_spin_us(10_001)
        # Spinning long or not at all, a round trip still completes.
        for us in (0, 300, 10_000):
            c.set_spin_us(us)
            assert c.ping() > 0
    finally:
        c.close()


def test_default_socket_is_the_managers_rule(monkeypatch, tmp_path):
    # ORBITKV_SOCKET first (`orbitkv serve --socket` reads it too), then
    # the manager's own default: one rule for the manager and every adapter.
    monkeypatch.setenv("ORBITKV_SOCKET", str(tmp_path / "named.sock"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert orbitkv.default_socket() == str(tmp_path / "named.sock")
    monkeypatch.setenv("ORBITKV_SOCKET", "")
    assert orbitkv.default_socket() == str(tmp_path / "orbitkv.sock")
    monkeypatch.delenv("ORBITKV_SOCKET")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert orbitkv.default_socket() == f"/tmp/orbitkv-{os.getuid()}/orbitkv.sock"
