"""The P/D handoff's parameters: what a prefill engine (``kv_producer``)
returns through ``kv_transfer_params`` when a request asked for a remote
decode (``do_remote_decode``), and what the decode engine (``kv_consumer``)
checks before it waits for those pages. docs/pd.md.

The params are plain JSON (they travel through the engines' HTTP APIs):

``{"orbitkv_handoff": {"id": "<16 hex>", "namespaces": ["<64 hex>", ...],
"page_tokens": 16, "tokens": 112, "hashes": ["<hex>", ...], "pin_ms": 30000,
"pinned": true}}``
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

KEY = "orbitkv_handoff"
#: The most pages one handoff names (the manager's `max_query_pages`).
MAX_PAGES = 1 << 16


class HandoffMismatch(ValueError):
    """The params cannot be used by this engine: ``reason`` is the miss
    reason counted for it (``handoff_malformed``, ``handoff_mismatch``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Handoff:
    id: int
    namespaces: List[str]
    page_tokens: int
    tokens: int
    hashes: List[bytes]
    pin_ms: int
    pinned: bool

    @property
    def pages(self) -> int:
        return self.tokens // self.page_tokens

    def params(self) -> Dict[str, Any]:
        return {
            KEY: {
                "id": f"{self.id:016x}",
                "namespaces": list(self.namespaces),
                "page_tokens": self.page_tokens,
                "tokens": self.tokens,
                "hashes": [h.hex() for h in self.hashes],
                "pin_ms": self.pin_ms,
                "pinned": self.pinned,
            }
        }


def new_id() -> int:
    """A handoff id: 64 random bits (the manager refuses a duplicate)."""
    return secrets.randbits(64)


def wants_remote_decode(request: Any) -> bool:
    """The request asked this (prefill) engine to hand its prompt to a
    decode engine (vLLM's P/D convention, set by the proxy)."""
    params = getattr(request, "kv_transfer_params", None)
    # (`collections.abc.Mapping`: `typing.Mapping`'s isinstance is a
    # microsecond of Python, on the scheduler's thread for every request.)
    return params is not None and isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def parse(request: Any) -> Optional[Handoff]:
    """The handoff a decode request carries, or None. Malformed params
    raise `HandoffMismatch` (``handoff_malformed``)."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None or not isinstance(params, Mapping) or KEY not in params:
        return None
    raw = params[KEY]

    def bad(why: str) -> HandoffMismatch:
        return HandoffMismatch("handoff_malformed", f"kv_transfer_params.{KEY}: {why}")

    if not isinstance(raw, Mapping):
        raise bad("not an object")
    try:
        hid = int(str(raw["id"]), 16)
        namespaces = [str(n) for n in raw["namespaces"]]
        page_tokens = int(raw["page_tokens"])
        tokens = int(raw["tokens"])
        hashes = [bytes.fromhex(str(h)) for h in raw["hashes"]]
        pin_ms = int(raw.get("pin_ms", 0))
        pinned = bool(raw.get("pinned", False))
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if not 0 <= hid < 1 << 64:
        raise bad("id is not 64 bits")
    if page_tokens <= 0 or tokens < 0 or tokens % page_tokens:
        raise bad(f"{tokens} tokens are not whole pages of {page_tokens}")
    if len(hashes) != tokens // page_tokens or len(hashes) > MAX_PAGES:
        raise bad(f"{len(hashes)} hashes for {tokens // page_tokens} pages (at most {MAX_PAGES})")
    if any(not 0 < len(h) <= 64 for h in hashes):
        raise bad("a hash is empty or longer than 64 bytes")
    return Handoff(hid, namespaces, page_tokens, tokens, hashes, pin_ms, pinned)


def check(handoff: Handoff, page_tokens: int, namespaces: Optional[Sequence[str]], hashes: Sequence[Any]) -> None:
    """Raises `HandoffMismatch` (``handoff_mismatch``) unless this engine
    computes the same pages as the producer: the same page size, the same
    namespaces (model, weights, dtype, layout: the identity), and the same
    block hashes for the prompt (vLLM's hash seed and algorithm)."""
    if handoff.page_tokens != page_tokens:
        raise HandoffMismatch(
            "handoff_mismatch",
            f"the prefill engine's pages are {handoff.page_tokens} tokens, this engine's {page_tokens} "
            "(block_size must be equal)",
        )
    if namespaces is not None and list(namespaces) != handoff.namespaces:
        raise HandoffMismatch(
            "handoff_mismatch",
            "the prefill engine's namespaces differ from this engine's: a different model, weights, "
            "dtype or parallel layout (orbitkv inspect / docs/pd.md)",
        )
    mine = [bytes(h) for h in hashes[: handoff.pages]]
    if len(mine) < handoff.pages or mine != handoff.hashes:
        raise HandoffMismatch(
            "handoff_mismatch",
            "the prompt's block hashes differ from the prefill engine's: another prompt, or another "
            "hash seed (PYTHONHASHSEED) or prefix_caching_hash_algo",
        )
