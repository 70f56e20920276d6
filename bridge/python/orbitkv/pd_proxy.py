"""A small prefill/decode proxy over two sets of vLLM OpenAI-compatible
servers, for tests and for users without a router (docs/pd.md):

    python -m orbitkv.pd_proxy --prefill http://10.0.0.1:8100 \\
        --decode http://10.0.0.2:8200 --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a
prefill engine (``kv_role: kv_producer``) with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; that engine's answer
carries the OrbitKV handoff (``orbitkv_handoff``: the pages it promised),
which the proxy passes, with the original request, to a decode engine
(``kv_role: kv_consumer``). The decode engine's answer, streamed or not, is
the client's. Engines are picked round-robin. Everything is bounded: the
requests in flight (``--max-inflight``, past it ``503``), a request body
(``--max-body-bytes``, past it ``413``) and every upstream call
(``--timeout-s``). Other paths (``/v1/models``, ``/health``, ...) go to a
decode engine as they are.

Standard library only: it runs in any environment the engines run in.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("orbitkv.pd_proxy")

HANDOFF_KEY = "orbitkv_handoff"
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Upstream:
    """One engine's HTTP server."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{url!r}: an engine is an http://HOST:PORT URL")
        self.url = url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or 80

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


class Stats:
    """What the proxy did, for its log and ``GET /pd/stats``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.handed_off = 0
        self.without_handoff = 0
        self.prefill_failed = 0
        self.decode_failed = 0
        self.busy = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0

    def add(self, **kw: Any) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}


class Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        addr: Tuple[str, int],
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        max_inflight: int = 256,
        max_body_bytes: int = 16 << 20,
        timeout_s: float = 600.0,
    ):
        if not prefill or not decode:
            raise ValueError("a P/D proxy needs at least one prefill and one decode engine")
        self.prefill = [Upstream(u) for u in prefill]
        self.decode = [Upstream(u) for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self._pick = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_inflight)
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.stats = Stats()
        super().__init__(addr, _Handler)

    def pick(self) -> Tuple[Upstream, Upstream]:
        with self._pick:
            return self.prefill[next(self._next_prefill)], self.decode[next(self._next_decode)]


def prefill_body(body: Dict[str, Any]) -> Dict[str, Any]:
    """The prefill engine's request: the prompt, one token, no stream,
    asking it to hand the prompt's KV over."""
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {"do_remote_decode": True}
    return p


def decode_body(body: Dict[str, Any], params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    d = dict(body)
    if params:
        d["kv_transfer_params"] = params
    else:
        d.pop("kv_transfer_params", None)
    return d


class _Handler(BaseHTTPRequestHandler):
    server: Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the proxy logs its own lines
        log.debug("%s " + fmt, self.address_string(), *args)

    # plumbing ---------------------------------------------------------------

    def _reply(self, status: int, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        if getattr(self, "_started", False):
            # The answer was under way: all that is left is to end it.
            log.error("%s: %s (after the answer started; connection closed)", self.path, message)
            self.close_connection = True
            return
        self._reply(status, {"error": {"message": message, "type": "orbitkv_pd_proxy", "code": status}})

    def _body(self) -> Optional[bytes]:
        self._started = False
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._error(400, "bad Content-Length")
            return None
        if n > self.server.max_body_bytes:
            self._error(413, f"request body over {self.server.max_body_bytes} bytes")
            return None
        return self.rfile.read(n) if n else b""

    def _forward(self, up: Upstream, method: str, body: Optional[bytes]) -> None:
        """Sends this request to `up` as it is and relays the answer."""
        conn = up.connect(self.server.timeout_s)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            conn.request(method, self.path, body=body, headers=headers)
            self._relay(conn.getresponse())
        finally:
            conn.close()

    def _relay(self, r: http.client.HTTPResponse) -> None:
        """Relays an upstream answer, streaming it when it is chunked."""
        self._started = True
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in _HOP_HEADERS:
                self.send_header(k, v)
        length = r.getheader("Content-Length")
        if length is not None:
            self.send_header("Content-Length", length)
            self.end_headers()
            self.wfile.write(r.read())
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    # routes -----------------------------------------------------------------

    def do_GET(self) -> None:
        self._started = False
        if self.path == "/pd/stats":
            self._reply(200, self.server.stats.snapshot())
            return
        _, up = self.server.pick()
        try:
            self._forward(up, "GET", None)
        except OSError as e:
            self._error(502, f"decode engine {up.url}: {e}")

    def do_POST(self) -> None:
        raw = self._body()
        if raw is None:
            return
        if self.path.split("?")[0] not in GENERATE_PATHS:
            _, up = self.server.pick()
            try:
                self._forward(up, "POST", raw)
            except OSError as e:
                self._error(502, f"decode engine {up.url}: {e}")
            return
        if not self.server.slots.acquire(blocking=False):
            self.server.stats.add(busy=1)
            self._error(503, "the proxy has its max-inflight requests in flight; retry")
            return
        try:
            self._generate(raw)
        finally:
            self.server.slots.release()

    def _generate(self, raw: bytes) -> None:
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            self._error(400, f"the request is not JSON: {e}")
            return
        if not isinstance(body, dict):
            self._error(400, "the request is not a JSON object")
            return
        pre, dec = self.server.pick()
        stats = self.server.stats
        stats.add(requests=1)
        t0 = time.monotonic()
        params, why = self._prefill(pre, body)
        t1 = time.monotonic()
        if params is None:
            stats.add(prefill_failed=1)
            self._error(502, why)
            return
        handoff = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
        if handoff is None:
            # The prefill engine promised nothing (no OrbitKV producer, or a
            # refusal it logged): the decode engine computes the prompt.
            stats.add(without_handoff=1)
            log.warning(
                "prefill engine %s returned no %s: the decode engine computes the prompt itself "
                "(is it running OrbitKVConnector with kv_role kv_producer?)",
                pre.url,
                HANDOFF_KEY,
            )
        else:
            stats.add(handed_off=1)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["Content-Type"] = "application/json"
        data = json.dumps(decode_body(body, params if handoff is not None else None)).encode()
        conn = dec.connect(self.server.timeout_s)
        try:
            conn.request("POST", self.path, body=data, headers=headers)
            self._relay(conn.getresponse())
        except OSError as e:
            stats.add(decode_failed=1)
            self._error(502, f"decode engine {dec.url}: {e}")
            return
        finally:
            conn.close()
        stats.add(prefill_s=t1 - t0, decode_s=time.monotonic() - t1)
        log.info(
            "%s: prefill %s %.0f ms, decode %s %.0f ms%s",
            self.path,
            pre.url,
            (t1 - t0) * 1000,
            dec.url,
            (time.monotonic() - t1) * 1000,
            "" if handoff is not None else " (no handoff)",
        )

    def _prefill(self, up: Upstream, body: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
        """The prefill engine's `kv_transfer_params` ({} when it returned
        none), or None and why the prefill failed."""
        conn = up.connect(self.server.timeout_s)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            headers["Content-Type"] = "application/json"
            conn.request("POST", self.path, body=json.dumps(prefill_body(body)).encode(), headers=headers)
            r = conn.getresponse()
            data = r.read()
        except OSError as e:
            return None, f"prefill engine {up.url}: {e}"
        finally:
            conn.close()
        if r.status != 200:
            return None, f"prefill engine {up.url} answered {r.status}: {data[:500]!r}"
        try:
            answer = json.loads(data)
        except ValueError:
            return None, f"prefill engine {up.url} answered something that is not JSON"
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return (params if isinstance(params, dict) else {}), ""


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m orbitkv.pd_proxy",
        description="Prefill/decode proxy over vLLM OpenAI-compatible servers running OrbitKVConnector "
        "(docs/pd.md).",
    )
    ap.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill engine (repeatable)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode engine (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-inflight", type=int, default=256, help="requests in flight; past it 503")
    ap.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest request body; past it 413")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on each upstream call")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    for name in ("max_inflight", "max_body_bytes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.timeout_s > 0:
        ap.error("--timeout-s must be above 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = Proxy(
            (args.host, args.port),
            args.prefill,
            args.decode,
            max_inflight=args.max_inflight,
            max_body_bytes=args.max_body_bytes,
            timeout_s=args.timeout_s,
        )
    except ValueError as e:
        ap.error(str(e))
    log.info(
        "P/D proxy on http://%s:%d: prefill %s, decode %s",
        args.host,
        server.server_address[1],
        ", ".join(u.url for u in server.prefill),
        ", ".join(u.url for u in server.decode),
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
