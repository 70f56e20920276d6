"""LMCache 0.5.6's multi-process server as a peer of `orbitkv serve`, for
`lmcache_peer.py`: a per-node process with a shared DRAM pool, which vLLM's
`LMCacheMPConnector` talks to over ZMQ. It runs on CPU.

`MpServer` starts the server the way vLLM's auto-start launcher does
(`python -m lmcache.v1.multiprocess.http_server`), registers a paged KV
cache as a vLLM worker would, and times one round of saves and retrieves
with the same `round(src, dst, page_bytes, batch, rnd)` shape as the other
peers:

- the KV cache is one layer `(K/V, blocks, 256 tokens, H heads, 64)` bf16,
  one block per LMCache chunk, H chosen so a chunk is exactly one page;
  block 0 is left unused (the server's null block, as in vLLM);
- save: `STORE` requests of `batch` chunks (at most `window` in flight),
  timed until the last one is committed to the pool (a lookup sees it);
  the server copies from the registered KV cache into its pool;
- retrieve: per request a scheduler-side `LOOKUP` (takes the read locks,
  as vLLM's connector does before a load) and a worker-side `RETRIEVE`
  into zeroed destination blocks, timed to the last reply; OrbitKV's
  `load` also includes its lookup;
- every byte read back is compared after its timing.

Two transfer modes exist on CPU (`mode`): `lmcache_driven` (the server's
default: the client's KV cache moves into shared memory at registration
and the server copies) and `engine_driven` (the pool is shared memory and
the client copies into and out of slots the server hands out).

Found while building it (LMCache 0.5.6): a request key needs
`num_kv_readers=1` or the server never replies; a retrieve needs a lookup
with the same request id first; a store's reply comes before its commit.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np

CHUNK_TOKENS = 256
HEAD_SIZE = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MpServer:
    """One LMCache MP server and one registered KV cache, made once and
    cleared between rounds (the pool's memory stays faulted in)."""

    def __init__(
        self,
        total: int,
        page_bytes: int,
        batch: int,
        mode: str = "lmcache_driven",
        workers: int = 1,
        window: int = 4,
        log: str = "/tmp/orbitkv-lmcache-mp.log",
        startup_s: float = 180.0,
    ):
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import (
            EngineDrivenTransferContext,
            LMCacheDrivenTransferContext,
        )
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        per_head = 2 * CHUNK_TOKENS * HEAD_SIZE * 2  # K/V x tokens x head x bf16
        if page_bytes % per_head:
            sys.exit(f"--page-bytes must be a multiple of {per_head} for LMCache's chunk shape")
        self.pages = total // page_bytes
        self.page_bytes = page_bytes
        self.per_request = max(1, min(batch, self.pages))
        self.window = window
        port = _free_port()
        pool_gb = round((total * 1.25 + (256 << 20)) / 2**30, 3)
        self.shm_before = set(glob.glob("/dev/shm/*"))
        self.shm_pool = f"orbitkv_peer_lmcache_{os.getpid()}"
        cmd = [
            sys.executable, "-m", "lmcache.v1.multiprocess.http_server",
            "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(_free_port()),
            "--chunk-size", str(CHUNK_TOKENS),
            "--max-workers", str(workers),
            "--l1-size-gb", str(pool_gb),
            "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", mode,
            "--disable-observability",
            "--prometheus-port", str(_free_port()),
        ]  # fmt: skip
        if mode == "engine_driven":
            cmd += ["--shm-name", self.shm_pool]
        #: The server's command line, for the report.
        self.command = " ".join(cmd[1:])
        self.log = open(log, "w")
        self.server = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.zmq = zmq.Context()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=self.zmq)
        self.ctx = None
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if self.server.poll() is not None:
                    raise RuntimeError(f"the LMCache server exited ({self.server.returncode}); see {log}")
                try:
                    chunk = self.client.get_chunk_size().result(timeout=2.0)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the LMCache server did not answer in {startup_s:.0f} s; see {log}")
                    time.sleep(0.5)
            if int(chunk) != CHUNK_TOKENS:
                raise RuntimeError(f"the LMCache server chunks {chunk} tokens, not {CHUNK_TOKENS}")
            heads = page_bytes // per_head
            # Source blocks 1..=pages, destination blocks pages+1..=2*pages.
            layer = torch.zeros((2, 2 * self.pages + 1, CHUNK_TOKENS, heads, HEAD_SIZE), dtype=torch.bfloat16)
            self.kv = {"model.layers.0.self_attn": layer}
            context = LMCacheDrivenTransferContext if mode == "lmcache_driven" else EngineDrivenTransferContext
            self.ctx = context(4242, self.client)
            self.ctx.register(
                self.kv,
                "orbitkv-peer",
                1,
                1,
                60.0,
                layout_hints={"kv_layout": "NHD"},
                engine_group_infos=[EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=CHUNK_TOKENS)],
                engine_type=EngineType.VLLM,
            )
            # Registration may move the tensor's storage into shared memory.
            self.layer = self.kv["model.layers.0.self_attn"]
        except BaseException:
            self.close()
            raise

    def _blocks(self, first: int) -> np.ndarray:
        """The pages `first..` as they lie in blocks: `(K/V, pages, page/2)`."""
        import torch

        return self.layer[:, first : first + self.pages].view(torch.uint8).view(2, self.pages, -1)

    def round(self, src: np.ndarray, dst: np.ndarray, page_bytes: int, batch: int, rnd: int) -> dict:
        import torch
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        assert page_bytes == self.page_bytes and src.size == self.pages * page_bytes
        # Page i's bytes are its K half then its V half, as the engine's
        # block holds them.
        pages = torch.from_numpy(src).view(self.pages, 2, -1).permute(1, 0, 2)
        self._blocks(1).copy_(pages)
        self._blocks(1 + self.pages).zero_()
        per = self.per_request
        requests = (self.pages + per - 1) // per
        tag = uuid.uuid4().hex[:8]

        def key(r: int, worker, request: str = "") -> IPCCacheServerKey:
            n = min(per, self.pages - r * per)
            base = (rnd * self.pages + r * per) * CHUNK_TOKENS
            return IPCCacheServerKey(
                model_name="orbitkv-peer",
                world_size=1,
                worker_id=worker,
                token_ids=tuple(range(base + 1, base + 1 + n * CHUNK_TOKENS)),
                start=0,
                end=n * CHUNK_TOKENS,
                request_id=request or f"peer-{tag}-{r}",
                num_kv_readers=1,
            )

        def blocks(r: int, first: int) -> list:
            n = min(per, self.pages - r * per)
            return [list(range(first + r * per, first + r * per + n))]

        def run(op: str) -> None:
            pending: list = []
            for r in range(requests):
                k = key(r, 0)
                event = self.ctx.create_recorded_event()
                if op == "store":
                    f = self.ctx.submit_store(k.request_id, k, self.kv, blocks(r, 1), event, 1)
                else:
                    self.lookup(key(r, None))
                    f = self.ctx.submit_retrieve(
                        k.request_id, k, self.kv, blocks(r, 1 + self.pages), event, 1, skip_first_n_tokens=0
                    )
                pending.append(f)
                while len(pending) >= self.window:
                    if not pending.pop(0).result(timeout=120):
                        sys.exit(f"LMCache MP server: a {op} failed")
            for f in pending:
                if not f.result(timeout=120):
                    sys.exit(f"LMCache MP server: a {op} failed")

        t0 = time.perf_counter()
        run("store")
        # A store's reply precedes its commit to the pool; commits are in
        # order, so the save ends when a lookup sees the last request whole.
        probe = key(requests - 1, None, f"peer-{tag}-commit")
        want = min(per, self.pages - (requests - 1) * per)
        while True:
            seen = self.lookup(probe)
            self.client.free_lookup_locks(probe, 1).result(timeout=30)
            if seen >= want:
                break
            if time.perf_counter() - t0 > 300:
                sys.exit("LMCache MP server: the last store never became visible")
            time.sleep(0.0005)
        save = time.perf_counter() - t0
        self.client.end_session(probe.request_id).result(timeout=30)

        t0 = time.perf_counter()
        run("retrieve")
        retrieve = time.perf_counter() - t0
        for r in range(requests):
            self.client.end_session(key(r, 0).request_id).result(timeout=30)
        back = self._blocks(1 + self.pages).permute(1, 0, 2).reshape(-1)
        dst[:] = back.numpy()
        exact = bool(np.array_equal(src, dst))
        self.client.clear(True).result(timeout=60)
        return {"save_s": save, "retrieve_s": retrieve, "exact": exact}

    def lookup(self, key) -> int:
        """Chunks found for `key` (a scheduler-side lookup, which takes the
        read locks a retrieve needs)."""
        self.client.lookup(key, 1).result(timeout=60)
        for _ in range(60_000):
            hits = self.client.query_prefetch_status(key.request_id).result(timeout=60)
            if hits is not None:
                return int(hits)
            time.sleep(0.0005)
        sys.exit("LMCache MP server: a lookup never resolved")

    def close(self) -> None:
        if self.ctx is not None:
            try:
                f = self.ctx.unregister()
                if f is not None:
                    f.result(timeout=10)
                self.ctx.close()
            except Exception as e:  # the server is stopped below either way
                print(f"[lmcache_mp] unregister: {e!r}", file=sys.stderr)
            self.ctx = None
        self.client.close()
        self.zmq.term()
        # SIGINT runs the server's own shutdown; then SIGTERM, SIGKILL.
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.server.poll() is not None:
                break
            try:
                os.killpg(self.server.pid, sig)
                self.server.wait(timeout=wait)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                pass
        self.log.close()
        self.kv = self.layer = None
        import gc

        gc.collect()
        for path in set(glob.glob("/dev/shm/*")) - self.shm_before:
            name = os.path.basename(path)
            if name.startswith("lmcache") or self.shm_pool in name:
                try:
                    os.unlink(path)
                except OSError:
                    pass
