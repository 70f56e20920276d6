"""What the scheduler tells the workers each step (`OrbitKVMetadata`): the
loads to run and the pages to save. Plain picklable data: vLLM sends it to
worker processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

NULL_BLOCK = -1
"""A page with no engine block in a group (a sliding-window block outside
the window): nothing is copied for it."""


@dataclass
class LoadSpec:
    """Load the pages for tokens [origin, boundary) of a request."""

    req_id: str
    origin: int
    """Tokens the engine already holds (page-aligned)."""
    boundary: int
    """Tokens the scheduler counted on (page-aligned)."""
    hashes: List[bytes]
    """vLLM's block hashes of pages [0, boundary / page_tokens)."""
    block_ids: Tuple[List[int], ...]
    """Per KV cache group, the engine block of each page index (or
    `NULL_BLOCK`), for pages [0, boundary / page_tokens)."""
    handoff: Optional[int] = None
    """P/D: the prefill engine's handoff this load takes."""


@dataclass
class SaveSpec:
    """Pages [first, first + len(hashes)) of a request to save, as columns:
    the scheduler builds one for every scheduled request, every step, and
    an object per page cost it about 0.5 us a page."""

    req_id: str
    first: int
    """Page index of `hashes[0]`: tokens [first * page_tokens, ...)."""
    hashes: List[bytes]
    block_ids: Tuple[List[int], ...]
    """Per KV cache group (vLLM's order), the engine block of each page
    (or `NULL_BLOCK` where a group has none: that group's page is not
    saved)."""
    pages: int = 0
    """Pages with a block in some group (what the save moves)."""

    def items(self) -> Iterator[Tuple[int, bytes, Tuple[int, ...]]]:
        """`(page, hash, block per group)` of every page with a block in
        some group."""
        nowhere = (NULL_BLOCK,) * len(self.block_ids)
        for i, ids in enumerate(zip(*self.block_ids)):
            if ids != nowhere:
                yield self.first + i, self.hashes[i], ids

    def without(self, drop: Callable[[int, int], bool]) -> "SaveSpec":
        """A copy whose block of (page, group) is `NULL_BLOCK` where
        `drop(page, group)` (fault injection in tests)."""
        columns = tuple(
            [NULL_BLOCK if drop(self.first + i, vg) else b for i, b in enumerate(col)]
            for vg, col in enumerate(self.block_ids)
        )
        spec = SaveSpec(self.req_id, self.first, self.hashes, columns)
        spec.pages = sum(1 for _ in spec.items())
        return spec


@dataclass
class OrbitKVMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
