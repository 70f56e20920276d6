"""Support for the `orbitkv serve` tests (test_serve.py) and the benchmark:
a managed manager subprocess, engine-side steps on an `orbitkv.Client`, and
the worker processes the tests start.

Run as a script, it is a worker process:

    python serve_support.py MODE SOCKET [ARGS...]

Workers print one line per milestone (``STAGE ...``, ``PUBLISHED ...``,
``OK ...``) and exit 0 when everything they checked held; any failure
prints ``ERROR ...`` (and a traceback on stderr) and exits 1.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import orbitkv

PAGE = 16
PAGE_BYTES = 4096
IDENTITY = "09" * 32
INSTANCE = "llama"
T = 10.0  # seconds: the bound on every single wait
CONFIG = "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nextent_bytes = 65536\n"
ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = orbitkv._orbitkv._protocol_version  # the manager protocol of this build


# Commands ---------------------------------------------------------------


def register_cmd(instance: str = INSTANCE) -> Dict:
    slot = {
        "layer": 0,
        "group": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "segment_bytes": PAGE_BYTES,
        "padded_page_bytes": PAGE_BYTES,
        "page_tokens": PAGE,
        "dtype": "bf16",
        "layout": "NHD",
        "strides": [1],
        "device_addr": 0,
    }
    return {
        "command": "register_instance",
        "instance": instance,
        "identity": IDENTITY,
        "layout": {"slots": [slot], "pool_capacity_pages": 0},
        "page_tokens": PAGE,
        "groups": [{"id": 0, "rule": "prefix", "components": ["attention_kv"]}],
        "ranks": [{"tp": 0, "pp": 0}],
    }


def instance(name: str = INSTANCE, identity: str = IDENTITY, page_bytes: int = PAGE_BYTES) -> orbitkv.Instance:
    """The instance `register_cmd` registers, for an `orbitkv.Session`."""
    cmd = register_cmd(name)
    for slot in cmd["layout"]["slots"]:
        slot["segment_bytes"] = slot["padded_page_bytes"] = page_bytes
    return orbitkv.Instance(
        name=name,
        identity=identity,
        layout=cmd["layout"],
        page_tokens=cmd["page_tokens"],
        groups=cmd["groups"],
        ranks=cmd["ranks"],
    )


def hashes(n: int, seed: int = 0) -> List[str]:
    """Chained hashes of an n-page prompt (8 bytes as hex)."""
    return [f"{0xABC0 + (seed << 20) + i:016x}" for i in range(n)]


def query_cmd(session: Dict, pages: int, *, prepare: bool, seed: int = 0, request: int = 1) -> Dict:
    """A query for a prompt one page longer than what was published."""
    return {
        "command": "query",
        "session": session,
        "request": request,
        "groups": [{"group": 0, "hashes": hashes(pages, seed)}],
        "origin": 0,
        "prompt_len": pages * PAGE,
        "prepare": prepare,
    }


@functools.lru_cache(maxsize=None)
def payload(i: int, seed: int = 0) -> bytes:
    """The bytes page i of a prompt holds."""
    return bytes(((b * 31 + i * 7 + seed * 13 + 1) & 0xFF) for b in range(PAGE_BYTES))


# Engine steps on a Client ---------------------------------------------------


class Failed(AssertionError):
    pass


def expect(event: Optional[Dict], kind: str, what: str = "") -> Dict:
    if event is None:
        raise Failed(f"{what or kind}: no event within {T}s")
    if event.get("event") != kind:
        raise Failed(f"{what or kind}: expected {kind}, got {event}")
    return event


def register(c: orbitkv.Client) -> None:
    expect(c.call(register_cmd(), T), "instance_registered")


def open_session(c: orbitkv.Client) -> Dict:
    return expect(c.call({"command": "open_session", "instance": INSTANCE}, T), "session_opened")[
        "session"
    ]


def open_region(c: orbitkv.Client, session: Dict, slots: int = 32) -> int:
    e = expect(
        c.call(
            {
                "command": "register_device_region",
                "session": session,
                "rank": 0,
                "group": 0,
                "slots": slots,
            },
            T,
        ),
        "region_registered",
    )
    assert e["page_bytes"] == PAGE_BYTES, e
    return e["region"]


def alloc(c: orbitkv.Client, session: Dict, region: int, slot: int) -> int:
    return expect(
        c.call(
            {"command": "device_page_alloc", "session": session, "region": region, "slot": slot},
            T,
        ),
        "device_page_allocated",
    )["device_page"]


def publish(c: orbitkv.Client, n: int, seed: int = 0) -> Dict:
    """Registers, opens a session and a region, writes n pages into the
    region's shared memory and publishes them. Returns what it opened."""
    register(c)
    s = open_session(c)
    region = open_region(c, s)
    view = c.region(region)
    pages = []
    for i in range(n):
        dp = alloc(c, s, region, i)
        view[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] = payload(i, seed)
        pages.append({"rank": 0, "group": 0, "hash": hashes(n, seed)[i], "device_page": dp})
    done = expect(
        c.call({"command": "publish", "session": s, "request": 1, "pages": pages}, T),
        "publish_done",
    )
    if done["inserted"] + done["duplicates"] != n:
        raise Failed(f"publish: {done}")
    return {"session": s, "region": region, "publish": done}


def query_ready(c: orbitkv.Client, session: Dict, n: int, seed: int = 0) -> Dict:
    """Queries (with prepare) for n published pages + 1 and waits for Ready."""
    qr = expect(c.call(query_cmd(session, n + 1, prepare=True, seed=seed), T), "query_result")
    if qr["miss"] is not None or qr["selected"] != n * PAGE:
        raise Failed(f"query: {qr}")
    return expect(c.wait_event(T, operation=qr["operation"], kind="ready"), "ready")


def check_pages(c: orbitkv.Client, ready: Dict, seed: int = 0) -> int:
    """Reads every leased page zero-copy from the shared pool; returns how
    many it checked."""
    leases = ready["leases"]
    views = [c.page(lease) for lease in leases]
    for lease, v in zip(leases, views):
        if not v.readonly or type(v.obj) is not orbitkv.SharedBuffer:
            raise Failed(f"page view is not a read-only SharedBuffer view: {v!r} {v.obj!r}")
        i = lease["pos"]["page_end"] // PAGE - 1
        if v != payload(i, seed):
            raise Failed(f"leased page {i} holds other bytes")
    return len(views)


def restore(c: orbitkv.Client, session: Dict, region: int, ready: Dict, first_slot: int) -> List[int]:
    """Restores every leased page into slots first_slot.. of `region`; waits
    for restore_done; returns the device pages (still allocated)."""
    targets, dps = [], []
    for k, lease in enumerate(ready["leases"]):
        dp = alloc(c, session, region, first_slot + k)
        dps.append(dp)
        targets.append({"pos": lease["pos"], "device_page": dp})
    c.submit(
        {
            "command": "restore",
            "session": session,
            "operation": ready["operation"],
            "targets": targets,
            "retained": [],
        }
    )
    done = c.wait_event(T, operation=ready["operation"])
    expect(done, "restore_done", "restore")
    if done["pages"] != len(targets):
        raise Failed(f"restore: {done}")
    return dps


def check_region(c: orbitkv.Client, region: int, ready: Dict, first_slot: int, seed: int = 0) -> None:
    view = c.region(region)
    for k, lease in enumerate(ready["leases"]):
        i = lease["pos"]["page_end"] // PAGE - 1
        at = (first_slot + k) * PAGE_BYTES
        if view[at : at + PAGE_BYTES] != payload(i, seed):
            raise Failed(f"restored page {i} (slot {first_slot + k}) holds other bytes")


def release(c: orbitkv.Client, session: Dict, operation: int) -> None:
    c.submit({"command": "release", "session": session, "operation": operation})
    expect(c.wait_event(T, kind="released", operation=operation), "released")


# Raw frames -------------------------------------------------------------

KIND = {
    "hello": 1,
    "welcome": 2,
    "submit": 3,
    "accepted": 4,
    "events": 5,
    "error": 6,
    "ping": 7,
    "pong": 8,
}


def frame(kind: int, payload: bytes, length: Optional[int] = None) -> bytes:
    n = len(payload) if length is None else length
    return b"OKVP" + struct.pack("<HHII", PROTOCOL, kind, n, 0) + payload


def recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(sock: socket.socket):
    """(kind, payload) of the next frame, or None when the peer closed."""
    h = recv_exact(sock, 16)
    if h is None:
        return None
    assert h[:4] == b"OKVP", h
    _version, kind, n, _reserved = struct.unpack("<HHII", h[4:])
    body = recv_exact(sock, n)
    assert body is not None, "truncated frame"
    return kind, body


# The manager ------------------------------------------------------------


def orbitkv_binary(profile: str = "debug") -> Path:
    """`ORBITKV_BIN`, or target/<profile>/orbitkv (built if missing)."""
    env = os.environ.get("ORBITKV_BIN")
    if env:
        return Path(env)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    path = target / profile / "orbitkv"
    if not path.exists():
        cmd = ["cargo", "build", "--bin", "orbitkv"]
        if profile == "release":
            cmd.append("--release")
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=1800)
    return path


def redis_cluster(test: str) -> Optional[str]:
    """The Redis Cluster of the test run (`ORBITKV_TEST_REDIS_CLUSTER`,
    comma-separated seed URLs; scripts/redis.sh), or None when unset
    (a skip, unless `ORBITKV_REQUIRE_REDIS` says it must be there)."""
    urls = os.environ.get("ORBITKV_TEST_REDIS_CLUSTER", "")
    if not urls:
        assert not os.environ.get("ORBITKV_REQUIRE_REDIS"), f"{test}: Redis is required here but unset"
    return urls or None


def remote_config(urls: str, prefix: str, key_file: Path, extra: str = "") -> str:
    """`CONFIG` with a remote tier on `urls` under `prefix`; managers given
    the same `key_file` share records, as one deployment's do."""
    if not key_file.exists():
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
    seeds = ", ".join(f'"{u}"' for u in urls.split(","))
    return (
        CONFIG
        + f'[remote]\nurls = [{seeds}]\nkey_prefix = "{prefix}"\nmac_key_file = "{key_file}"\n'
        + "refresh_interval_ms = 20\n"
        + extra
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Manager:
    """An `orbitkv serve` subprocess on a socket in its own directory, with
    metrics on a free port. `stop` (SIGTERM, then SIGKILL) is idempotent."""

    def __init__(self, binary: Path, dram: str = "16MiB", config: str = CONFIG):
        self.binary = binary
        self.dram = dram
        self.dir = Path(tempfile.mkdtemp(prefix="okv-"))
        self.socket = str(self.dir / "s.sock")
        self.config = self.dir / "c.toml"
        self.config.write_text(config)
        self.log = self.dir / "manager.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self._port_retries = 0

    def start(self, idle: bool = True) -> "Manager":
        """Starts the manager and waits until it serves. `idle=False`: clients
        may connect at once (a restart under live engines), so only wait
        for the metrics endpoint, not for zero connections."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.port = free_port()
        logged = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.binary),
                    "serve",
                    "--socket",
                    self.socket,
                    "--dram",
                    self.dram,
                    "--config",
                    str(self.config),
                    "--metrics-addr",
                    f"127.0.0.1:{self.port}",
                ],
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + T
        while True:
            if self.proc.poll() is not None:
                # The free port was taken in between (another test's
                # manager): start again on another one.
                since = self.log.read_bytes()[logged:].decode(errors="replace")
                if "Address already in use" in since and self._port_retries < 4:
                    self._port_retries += 1
                    return self.start(idle)
                raise RuntimeError(f"manager exited ({self.proc.returncode}): {self.log_text()}")
            try:
                orbitkv.Client(self.socket, "probe").close()
                break
            except orbitkv.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"manager did not come up: {self.log_text()}")
                time.sleep(0.02)
        # The metrics endpoint answers once the first snapshot is taken.
        if idle:
            self.wait_metric("connections", 0)
        else:
            deadline = time.monotonic() + T
            while self.metric("connections") is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"manager metrics did not come up: {self.log_text()}")
                time.sleep(0.05)
        return self

    def stop(self, timeout: float = T) -> Optional[int]:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(T)
        return p.returncode

    def restart(self) -> "Manager":
        status = self.stop()
        assert status == 0, f"manager exited with {status}: {self.log_text()}"
        return self.start()

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=T) as r:
            return r.read().decode()

    def metrics(self) -> Dict[str, int]:
        text = self.metrics_text()
        out = {}
        for line in text.splitlines():
            if line.startswith("orbitkv_") and "{" not in line:
                name, value = line.split()
                out[name[len("orbitkv_") :]] = int(float(value))
        return out

    def metric(self, name: str) -> Optional[int]:
        try:
            return self.metrics().get(name)
        except OSError:
            return None

    def wait_metric(self, name: str, value: int, timeout: float = T) -> None:
        """Waits until /metrics (refreshed every 100 ms) shows `value`."""
        deadline = time.monotonic() + timeout
        while (now := self.metric(name)) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"orbitkv_{name} never reached {value} (now {now})")
            time.sleep(0.05)


@contextlib.contextmanager
def running(m: Manager):
    """Starts `m`; stops it and removes its directory at the end."""
    try:
        m.start()
        yield m
    finally:
        m.stop()
        shutil.rmtree(m.dir, ignore_errors=True)


# Worker processes -----------------------------------------------------------


def spawn(mode: str, *args) -> subprocess.Popen:
    """Starts a worker process (this file as a script)."""
    return subprocess.Popen(
        [sys.executable, __file__, mode, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def read_line(proc: subprocess.Popen, timeout: float = T) -> str:
    """The worker's next stdout line (bounded); '' at EOF."""
    fd = proc.stdout.fileno()
    buf = getattr(proc, "_okv_buf", b"")
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"worker said nothing within {timeout}s (so far {buf!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                proc._okv_buf = b""
                return buf.decode()
            buf += chunk
    line, _, rest = buf.partition(b"\n")
    proc._okv_buf = rest
    return line.decode()


def say(*parts) -> None:
    print(*parts, flush=True)


def worker_publish(sock: str, n: str, seed: str) -> None:
    """Process A: publishes n pages from its device region, then stays
    connected until its stdin closes."""
    c = orbitkv.Client(sock, "worker-publish")
    opened = publish(c, int(n), int(seed))
    say("PUBLISHED", json.dumps(opened["publish"]))
    sys.stdin.read()
    c.close()


def worker_restore(sock: str, n: str, seed: str) -> None:
    """Process B: queries, reads the leased pages zero-copy from the pool,
    restores them into its own region and checks every byte."""
    import numpy as np

    n, seed = int(n), int(seed)
    c = orbitkv.Client(sock, "worker-restore")
    register(c)
    s = open_session(c)
    region = open_region(c, s)
    before = c.region(region)  # taken before the restore: it must see it
    ready = query_ready(c, s, n, seed)
    checked = check_pages(c, ready, seed)
    # Zero copy: each page view is a window of one mapping of the pool, at
    # the lease's offset (addresses, not contents, prove it).
    views = [c.page(lease) for lease in ready["leases"]]
    addrs = [np.frombuffer(v, dtype=np.uint8).__array_interface__["data"][0] for v in views]
    for lease, addr in zip(ready["leases"], addrs):
        if addr - addrs[0] != lease["offset"] - ready["leases"][0]["offset"]:
            raise Failed("page views are not windows of the shared pool")
    if np.frombuffer(views[0], dtype=np.uint8).flags.writeable:
        raise Failed("a page view is writable")
    restore(c, s, region, ready, first_slot=10)
    check_region(c, region, ready, first_slot=10, seed=seed)
    first = ready["leases"][0]["pos"]["page_end"] // PAGE - 1
    if before[10 * PAGE_BYTES : 11 * PAGE_BYTES] != payload(first, seed):
        raise Failed("a region view taken before the restore does not show it")
    say("OK", json.dumps({"pages": checked, "leases": [lease["offset"] for lease in ready["leases"]]}))


def worker_doomed(sock: str, n: str, stage: str) -> None:
    """Gets to `stage` and waits to be killed: `query` (query with prepare
    submitted), `ready` (holding leases), `restore` (restore submitted)."""
    n = int(n)
    c = orbitkv.Client(sock, "worker-doomed")
    register(c)
    s = open_session(c)
    region = open_region(c, s)
    if stage == "query":
        c.submit(query_cmd(s, n + 1, prepare=True))
    else:
        ready = query_ready(c, s, n)
        if stage == "restore":
            targets = [
                {"pos": lease["pos"], "device_page": alloc(c, s, region, k)}
                for k, lease in enumerate(ready["leases"])
            ]
            c.submit(
                {
                    "command": "restore",
                    "session": s,
                    "operation": ready["operation"],
                    "targets": targets,
                    "retained": [],
                }
            )
    say("STAGE", stage)
    time.sleep(3600)


def worker_loop(sock: str, n: str, seconds: str, seed: str) -> None:
    """Loops for `seconds`: a short-lived session that queries without
    prepare, prepares, reads the leased pages and releases; then a restore
    on the long-lived session. Every event is checked."""
    n, seconds, seed = int(n), float(seconds), int(seed)
    c = orbitkv.Client(sock, f"worker-loop-{seed}")
    register(c)
    s = open_session(c)
    region = open_region(c, s, slots=n)
    stats = {"releases": 0, "restores": 0, "pages_checked": 0}
    deadline = time.monotonic() + seconds
    while True:  # at least once, however slow the setup was
        # open session / query / prepare / release
        s2 = open_session(c)
        qr = expect(c.call(query_cmd(s2, n + 1, prepare=False), T), "query_result")
        if qr["miss"] is not None or qr["selected"] != n * PAGE:
            raise Failed(f"query: {qr}")
        c.submit({"command": "prepare", "session": s2, "operation": qr["operation"]})
        ready = expect(c.wait_event(T, kind="ready", operation=qr["operation"]), "ready")
        stats["pages_checked"] += check_pages(c, ready)
        release(c, s2, qr["operation"])
        c.submit({"command": "close_session", "session": s2})
        expect(c.wait_event(T, kind="session_closed"), "session_closed")
        stats["releases"] += 1
        # query with prepare / restore / free the device pages
        ready = query_ready(c, s, n)
        dps = restore(c, s, region, ready, first_slot=0)
        check_region(c, region, ready, first_slot=0)
        for dp in dps:
            c.submit({"command": "device_page_free", "session": s, "device_page": dp})
        for _ in dps:
            expect(c.wait_event(T, kind="device_page_freed"), "device_page_freed")
        stats["restores"] += 1
        if time.monotonic() >= deadline:
            break
    leftover = [e for e in c.poll_events() if e["event"] != "loading"]
    if leftover:
        raise Failed(f"unexpected events: {leftover[:5]}")
    c.close()
    say("OK", json.dumps(stats))


def worker_main(argv: Sequence[str]) -> int:
    modes = {
        "publish": worker_publish,
        "restore": worker_restore,
        "doomed": worker_doomed,
        "loop": worker_loop,
    }
    try:
        modes[argv[0]](*argv[1:])
    except BaseException as e:  # reported to the test, which fails on it
        import traceback

        traceback.print_exc()
        say("ERROR", f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
