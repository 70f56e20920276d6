"""Moving page bytes between vLLM's KV cache and OrbitKV, behind one small
interface (`PageMover`) so the connector logic does not depend on where
copies run.

`HostPageMover` (today): the worker owns a staging region per KV cache group
(manager-owned shared memory, `Client.region()`), with one device page per
slot allocated once. A save copies each layer's block into a staging slot
(`stage`), then the staging device page is published; a load copies leased
pages from the read-only shared pool into the engine's blocks (`restore`).
`AgentPageMover` (the default, KV caches in host or CUDA memory): the
engine's own KV blocks are an agent-owned region per KV cache group (slot =
block id); the manager never maps them, and the copies run in this
process's copy agent on the manager's instruction, straight between the
blocks and the shared pool (memcpy workers for host memory; the CUDA copy
engine, DMA from and to the pinned pool, for CUDA memory). `HostPageMover`
remains for ``copy_agent: false``.

A stored page is each layer's block bytes concatenated in the group's layer
order (`GroupPlan.layers`); a layer's block is its `[H, N, C]` bytes exactly
as the KV cache layout stores them.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .engine import EngineSpec
from .settings import ConfigError


def block_bytes_view(t: torch.Tensor, num_blocks: int, what: str) -> torch.Tensor:
    """A `uint8` view `(num_blocks, block_bytes)` of `t`'s blocks (dim 0),
    over the same memory. Fails (`ConfigError`) unless each block's bytes are
    one contiguous run."""
    if t.dim() < 1 or num_blocks < 1 or t.shape[0] % num_blocks:
        raise ConfigError(
            f"{what}: shape {tuple(t.shape)} does not have {num_blocks} blocks in dim 0"
        )
    es = t.element_size()
    ratio = t.shape[0] // num_blocks
    dims = sorted(
        ((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] != 1),
        key=lambda sd: sd[0],
    )
    expect = 1
    for stride, size in dims:
        if stride != expect:
            raise ConfigError(
                f"{what}: a block's elements are not contiguous "
                f"(shape {tuple(t.shape)}, strides {t.stride()})"
            )
        expect *= size
    kernel_bytes = expect * es
    stride0 = t.stride(0) * es
    if ratio > 1 and stride0 != kernel_bytes:
        raise ConfigError(f"{what}: kernel blocks of a block are not adjacent")
    block_stride = stride0 * ratio
    block_len = kernel_bytes * ratio
    if block_stride < block_len:
        raise ConfigError(f"{what}: blocks overlap (stride {block_stride} < {block_len})")
    offset = t.storage_offset() * es
    storage = t.untyped_storage()
    if offset + (num_blocks - 1) * block_stride + block_len > storage.nbytes():
        raise ConfigError(f"{what}: the blocks run past the tensor's storage")
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    base.set_(storage, offset, (num_blocks, block_len), (block_stride, 1))
    return base


def agent_device(device: torch.device) -> str:
    """How a copy agent names the memory of tensors on `device`: ``"cpu"``,
    or ``"cuda:N"`` with the device's index (the current device when the
    tensor's device has none). Other devices have no executor."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    raise ConfigError(
        f"copy agents copy host or CUDA memory; the KV cache is on {device} "
        "(set kv_connector_extra_config.copy_agent to false for staged copies)"
    )


class EngineBlocks:
    """The engine's KV memory as per-group, per-layer block views."""

    def __init__(self, spec: EngineSpec, kv_caches: Mapping[str, Any], num_blocks: int):
        self.spec = spec
        self.num_blocks = num_blocks
        self.layers: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
        """group id → [(offset in page, view (num_blocks, bytes))]"""
        self.view_layers: Dict[int, List[int]] = {}
        """group id → the layer (index in the group's layers) of each view"""
        self.layer_pos: Dict[str, Tuple[int, int]] = {}
        """layer name → (group id, index in the group's layers)"""
        for group in spec.groups:
            views: List[Tuple[int, torch.Tensor]] = []
            owners: List[int] = []
            offset = 0
            for li, layer in enumerate(group.layers):
                self.layer_pos[layer.name] = (group.id, li)
                value = kv_caches.get(layer.name)
                if value is None:
                    raise ConfigError(f"register_kv_caches: no KV cache for layer {layer.name}")
                tensors = list(value) if isinstance(value, (list, tuple)) else [value]
                got = 0
                for k, t in enumerate(tensors):
                    v = block_bytes_view(t, num_blocks, f"KV cache of {layer.name}[{k}]")
                    views.append((offset + got, v))
                    owners.append(li)
                    got += v.shape[1]
                if got != layer.segment_bytes:
                    raise ConfigError(
                        f"KV cache of {layer.name}: a block holds {got} bytes, the "
                        f"KV cache spec says {layer.segment_bytes}"
                    )
                offset += got
            self.layers[group.id] = views
            self.view_layers[group.id] = owners
        self.device = next(v.device for vs in self.layers.values() for _, v in vs)

    def check_blocks(self, blocks: Sequence[int]) -> None:
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} are outside 0..{self.num_blocks}")


class PageMover:
    """Where page bytes move. `stage` runs on the engine's thread (inside
    `wait_for_save`), `connect` and `restore` on the worker's I/O thread."""

    def connect(self, session: Any) -> None:
        """Registers this mover's regions on a new session (`orbitkv.Session`)."""
        raise NotImplementedError

    def disconnect(self) -> None:
        raise NotImplementedError

    def staging_slots(self, gid: int) -> int:
        raise NotImplementedError

    def stage(self, gid: int, slots: Sequence[int], blocks: Sequence[int]) -> None:
        raise NotImplementedError

    def source_page(self, gid: int, slot: int) -> int:
        raise NotImplementedError

    def restore(self, gid: int, pages: Sequence[Tuple[int, int, int, int]]) -> None:
        """Copies pool pages `(offset, bytes, block, checksum)` into engine
        blocks, verified."""
        raise NotImplementedError


class HostPageMover(PageMover):
    """Phase A mover: manager-owned staging regions, host copies (torch)."""

    def __init__(self, blocks: EngineBlocks, rank: int, staging_pages: int, timeout_s: float):
        self.blocks = blocks
        self.rank = rank
        self.staging_pages = staging_pages
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stage: Dict[int, torch.Tensor] = {}
        self._pages: Dict[int, List[int]] = {}
        self._client: Any = None

    def connect(self, session: Any) -> None:
        """Registers a staging region per group and a device page per slot
        (one round trip per region, the allocations pipelined)."""
        stage: Dict[int, torch.Tensor] = {}
        pages: Dict[int, List[int]] = {}
        client = session.client
        for group in self.blocks.spec.groups:
            region = session.register_region(self.rank, group.id, self.staging_pages)
            view = client.region(region)
            if len(view) != self.staging_pages * group.page_bytes:
                raise ConfigError(
                    f"group {group.id}: the manager's staging region is {len(view)} bytes, "
                    f"{self.staging_pages} of the engine's {group.page_bytes}-byte pages are "
                    f"{self.staging_pages * group.page_bytes}"
                )
            stage[group.id] = torch.frombuffer(view, dtype=torch.uint8).view(
                self.staging_pages, group.page_bytes
            )
            pages[group.id] = session.device_pages(region, list(range(self.staging_pages)))
        with self._lock:
            self._stage, self._pages, self._client = stage, pages, client

    def disconnect(self) -> None:
        with self._lock:
            self._stage, self._pages, self._client = {}, {}, None

    def staging_slots(self, gid: int) -> int:
        return self.staging_pages

    def stage(self, gid: int, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copies each block's layers into its staging slot. On a GPU the
        pages are gathered there (one kernel per layer) and moved in one
        copy; on the CPU each layer's block is copied straight into place
        (torch's index kernels run bytewise on the CPU)."""
        with self._lock:
            stage = self._stage.get(gid)
        if stage is None or not slots:
            return
        self.blocks.check_blocks(blocks)
        layers = self.blocks.layers[gid]
        if self.blocks.device.type == "cpu":
            for slot, block in zip(slots, blocks):
                row = stage[slot]
                for at, view in layers:
                    row[at : at + view.shape[1]].copy_(view[block])
            return
        bi = torch.tensor(list(blocks), dtype=torch.long, device=self.blocks.device)
        pages = torch.cat([view.index_select(0, bi) for _, view in layers], dim=1).to("cpu")
        for k, slot in enumerate(slots):
            stage[slot].copy_(pages[k])

    def source_page(self, gid: int, slot: int) -> int:
        with self._lock:
            return self._pages[gid][slot]

    def restore(self, gid: int, pages: Sequence[Tuple[int, int, int, int]]) -> None:
        """Copies leased pool pages `(offset, bytes, block, checksum)` into
        their blocks, each checked against its checksum first (a page
        whose pool bytes are not what was published raises
        `orbitkv.ConnectionError`: the load fails, vLLM recomputes). On a
        GPU the pages are gathered into one host buffer, moved in one copy
        and scattered there (one kernel per layer); on the CPU each layer's
        slice is copied straight from the pool."""
        with self._lock:
            client = self._client
        if client is None:
            raise ConnectionError("not connected")
        if not pages:
            return
        group = self.blocks.spec.group(gid)
        self.blocks.check_blocks([p[2] for p in pages])
        for offset, nbytes, _, _ in pages:
            if nbytes != group.page_bytes:
                raise ValueError(
                    f"lease of {nbytes} bytes at {offset}: the group's page is "
                    f"{group.page_bytes} bytes"
                )
        with warnings.catch_warnings():
            # Pool views are read-only; torch warns that writes would fail.
            warnings.simplefilter("ignore", UserWarning)
            src = [
                torch.frombuffer(client.page_at(o, n, c), dtype=torch.uint8) for o, n, _, c in pages
            ]
        layers = self.blocks.layers[gid]
        if self.blocks.device.type == "cpu":
            for page, (_, _, block, _) in zip(src, pages):
                for at, view in layers:
                    view[block].copy_(page[at : at + view.shape[1]])
            return
        data = torch.stack(src).to(self.blocks.device)
        bi = torch.tensor([p[2] for p in pages], dtype=torch.long, device=self.blocks.device)
        for at, view in layers:
            view.index_copy_(0, bi, data[:, at : at + view.shape[1]])


class AgentPageMover(PageMover):
    """The engine's KV blocks as agent-owned regions: one per KV cache
    group, slot `b` being block `b`, each page laid out as the group's
    per-layer block runs (`EngineBlocks.layers`, in page order). Loads
    restore into the blocks and saves publish from them, both run by the
    client's copy agent; nothing is staged."""

    direct = True

    def __init__(
        self, blocks: EngineBlocks, rank: int, timeout_s: float, layered: bool = False
    ):
        self.device = agent_device(blocks.device)
        self.blocks = blocks
        self.rank = rank
        self.timeout_s = timeout_s
        self.layered = layered
        """Attach each group with its views' layers: restores run and are
        counted layer by layer (`layer_counts`)."""
        self._lock = threading.Lock()
        self._regions: Dict[int, int] = {}
        self._agent: Dict[int, int] = {}
        self._client: Any = None

    def layout(self, gid: int) -> List[Tuple[int, int, int]]:
        """(data_ptr, stride, length) of each run of a page of group `gid`."""
        return [
            (view.data_ptr(), view.stride(0) * view.element_size(), view.shape[1])
            for _, view in self.blocks.layers[gid]
        ]

    def connect(self, session: Any) -> None:
        """Attaches every group's blocks to the session's agent and registers
        them as agent-owned regions (the agent keeps the views alive)."""
        regions: Dict[int, int] = {}
        agents: Dict[int, int] = {}
        client = session.client
        for group in self.blocks.spec.groups:
            views = [v for _, v in self.blocks.layers[group.id]]
            agent = client.attach_agent_memory(
                self.blocks.num_blocks,
                self.layout(group.id),
                views,
                device=self.device,
                layers=self.blocks.view_layers[group.id] if self.layered else None,
            )
            agents[group.id] = agent[0]
            if agent[1] != group.page_bytes:
                raise ConfigError(
                    f"group {group.id}: the blocks hold {agent[1]}-byte pages, the spec "
                    f"{group.page_bytes}"
                )
            regions[group.id] = session.register_region(
                self.rank, group.id, self.blocks.num_blocks, agent=agent
            )
        with self._lock:
            self._regions, self._agent, self._client = regions, agents, client

    def disconnect(self) -> None:
        with self._lock:
            self._regions, self._agent, self._client = {}, {}, None

    def layer_counts(self, gid: int) -> Optional[List[Tuple[int, int]]]:
        """Per layer of group `gid`: `(landed, failed)` pages restored since
        the current connection attached it; None when not connected."""
        with self._lock:
            client, agent = self._client, self._agent.get(gid)
        if client is None or agent is None:
            return None
        return [tuple(c) for c in client.agent_layer_counts(agent)]

    def region(self, gid: int) -> int:
        with self._lock:
            return self._regions[gid]

    def staging_slots(self, gid: int) -> int:
        return 0
