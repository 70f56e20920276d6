"""`orbitkv.pd_proxy` against stand-in engine servers: what each engine is
asked, what the client gets back (streamed or whole), and the proxy's
bounds. (The proxy in front of real vLLM engines: bridge/tests-vllm-cpu.)"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from orbitkv import pd_proxy

PARAMS = {pd_proxy.HANDOFF_KEY: {"id": "00000000000000aa", "tokens": 32}}


class FakeEngine(ThreadingHTTPServer):
    """Records every request; `answer(body)` makes the reply."""

    daemon_threads = True

    def __init__(self, answer, stream: bool = False):
        self.seen = []
        self.answer = answer
        self.stream = stream
        self.gate = threading.Event()
        self.gate.set()
        super().__init__(("127.0.0.1", 0), _Fake)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n))
        self.server.seen.append((self.path, body))
        self.server.gate.wait(10)
        if self.server.stream and body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        data = json.dumps(self.server.answer(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        data = b'{"data": [{"id": "tiny"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(server):
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return server


@pytest.fixture
def engines():
    pre = serve(FakeEngine(lambda b: {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))
    dec = serve(FakeEngine(lambda b: {"choices": [{"text": "decoded"}], "echo": b}, stream=True))
    yield pre, dec
    for s in (pre, dec):
        s.shutdown()
        s.server_close()


def proxy(pre, dec, **kw):
    p = pd_proxy.Proxy(("127.0.0.1", 0), [pre.url], [dec.url], **kw)
    serve(p)
    return p, f"http://127.0.0.1:{p.server_address[1]}"


def post(url, body, raw=None):
    req = urllib.request.Request(
        url, data=raw if raw is not None else json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read()


def test_a_completion_is_prefilled_with_one_token_then_decoded_with_the_handoff(engines):
    pre, dec = engines
    p, url = proxy(pre, dec)
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
        status, data = post(url + "/v1/completions", body)
        assert status == 200
        answer = json.loads(data)
        assert answer["choices"][0]["text"] == "decoded"
        # The prefill engine saw the prompt with one token, unstreamed,
        # asked to hand its KV over.
        path, sent = pre.seen[0]
        assert path == "/v1/completions"
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kv_transfer_params"] == {"do_remote_decode": True}
        assert sent["prompt"] == [1, 2, 3]
        # The decode engine saw the original request plus the handoff.
        _, got = dec.seen[0]
        assert got == {**body, "kv_transfer_params": PARAMS}
        assert p.stats.snapshot()["handed_off"] == 1
    finally:
        p.shutdown()
        p.server_close()


def test_a_streamed_chat_is_relayed_as_it_comes(engines):
    pre, dec = engines
    p, url = proxy(pre, dec)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_completion_tokens": 5, "stream_options": {"include_usage": True}}
        status, data = post(url + "/v1/chat/completions", body)
        assert status == 200
        assert data == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
        _, sent = pre.seen[0]
        assert sent["max_completion_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
        _, got = dec.seen[0]
        assert got["stream"] is True and got["kv_transfer_params"] == PARAMS
    finally:
        p.shutdown()
        p.server_close()


def test_other_paths_go_to_a_decode_engine(engines):
    pre, dec = engines
    p, url = proxy(pre, dec)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        assert not pre.seen
    finally:
        p.shutdown()
        p.server_close()


def test_no_handoff_from_the_prefill_engine_decodes_without_one():
    pre = serve(FakeEngine(lambda b: {"choices": [{"text": "x"}]}))
    dec = serve(FakeEngine(lambda b: {"choices": [{"text": "decoded"}]}))
    p, url = proxy(pre, dec)
    try:
        status, _ = post(url + "/v1/completions", {"prompt": "a", "kv_transfer_params": {"x": 1}})
        assert status == 200
        _, got = dec.seen[0]
        assert "kv_transfer_params" not in got
        assert p.stats.snapshot()["without_handoff"] == 1
    finally:
        for s in (p, pre, dec):
            s.shutdown()
            s.server_close()


def test_bounds_and_upstream_failures_are_typed_http_errors(engines):
    pre, dec = engines
    p, url = proxy(pre, dec, max_inflight=1, max_body_bytes=64)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url + "/v1/completions", {"prompt": "x" * 100})
        assert e.value.code == 413
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url + "/v1/completions", None, raw=b"not json")
        assert e.value.code == 400
        # One request in flight (held at the prefill engine): the next is 503.
        pre.gate.clear()
        first = threading.Thread(target=lambda: post(url + "/v1/completions", {"prompt": "a"}))
        first.start()
        for _ in range(200):
            if pre.seen:
                break
            threading.Event().wait(0.01)
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url + "/v1/completions", {"prompt": "b"})
        assert e.value.code == 503
        pre.gate.set()
        first.join(10)
    finally:
        p.shutdown()
        p.server_close()
    # A prefill engine that is down: 502, naming it.
    pre.shutdown()
    pre.server_close()
    p, url = proxy(pre, dec)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url + "/v1/completions", {"prompt": "a"})
        assert e.value.code == 502
        assert b"prefill engine" in e.value.read()
    finally:
        p.shutdown()
        p.server_close()


def test_a_proxy_needs_engines_of_both_kinds():
    with pytest.raises(ValueError):
        pd_proxy.Proxy(("127.0.0.1", 0), [], ["http://127.0.0.1:1"])
    with pytest.raises(ValueError):
        pd_proxy.Proxy(("127.0.0.1", 0), ["https://x"], ["http://127.0.0.1:1"])
