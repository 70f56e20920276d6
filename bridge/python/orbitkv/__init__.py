"""OrbitKV: keeps LLM serving engines' KV-cache state beyond GPU memory and
hands it back only when it is provably complete and from the same computation.

- :class:`Runtime`: the embedded runtime. Commands and events are the serde
  JSON shapes of ``orbitkv_components::api::Command`` / ``Event`` as dicts.
- Recovery contract (``docs/contract.md``): :func:`required_ranges`,
  :func:`restorable_boundaries`, :func:`common_boundaries`,
  :func:`select_boundary`, :func:`vllm_window_past_tokens`.
- Computation identity (``docs/identity.md``): :func:`compute_identity`.

The IPC client for a standalone manager (``orbitkv.Client``) is not part of
this package yet; it will live in ``orbitkv/client.py`` (or a native
``client`` module) and be exported here.
"""

from ._orbitkv import (
    ContractError,
    IdentityError,
    InvariantError,
    QueueFull,
    Runtime,
    __version__,
    common_boundaries,
    compute_identity,
    required_ranges,
    restorable_boundaries,
    select_boundary,
    vllm_window_past_tokens,
)

__all__ = [
    "ContractError",
    "IdentityError",
    "InvariantError",
    "QueueFull",
    "Runtime",
    "__version__",
    "common_boundaries",
    "compute_identity",
    "required_ranges",
    "restorable_boundaries",
    "select_boundary",
    "vllm_window_past_tokens",
]
