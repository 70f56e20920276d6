"""What the scheduler tells the workers each step (`OrbitKVMetadata`): the
loads to run and the pages to save. Plain picklable data: vLLM sends it to
worker processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple

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


class SaveItem(NamedTuple):
    """One page to save (a tuple: the scheduler builds one per page of
    every scheduled request, every step)."""

    page: int
    """Page index: tokens [page * page_tokens, (page + 1) * page_tokens)."""
    hash: bytes
    block_ids: Tuple[int, ...]
    """The engine block of this page in each KV cache group (or
    `NULL_BLOCK` where a group has none: that group's page is not saved)."""


@dataclass
class SaveSpec:
    req_id: str
    items: List[SaveItem]


@dataclass
class OrbitKVMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
