"""OrbitKV: keeps LLM serving engines' KV-cache state beyond GPU memory and
hands it back only when it is provably complete and from the same computation.

- :class:`Runtime`: the embedded runtime. Commands and events are the serde
  JSON shapes of ``orbitkv_components::api::Command`` / ``Event`` as dicts.
- Recovery contract (``docs/contract.md``): :func:`required_ranges`,
  :func:`restorable_boundaries`, :func:`common_boundaries`,
  :func:`select_boundary`, :func:`vllm_window_past_tokens`.
- Computation identity (``docs/identity.md``): :func:`compute_identity`, and
  :func:`model_source`, the one rule for where a model's config is and whether
  its hub revision is pinned.

- :class:`Client`: a connection to a standalone manager (``orbitkv serve``):
  the same commands and events over a Unix socket, with page bytes as
  zero-copy ``memoryview``s over the manager's shared pool
  (:meth:`Client.page`) and the client's device regions
  (:meth:`Client.region`). Failures of the connection raise
  :class:`ConnectionError` (a subclass of the builtin one).
- :class:`Session`: the engine side, the one way engines talk to a manager:
  register its :class:`Instance` (checked when made), open, reconnect (at
  most once per interval), a slot table of device pages, and typed verbs (:meth:`Session.lookup`,
  :meth:`Session.lookup_many`, :meth:`Session.load`, :meth:`Session.save`)
  returning :class:`Lookup`, :class:`Loaded`, :class:`Saved` with a
  :class:`MissReason`; failures are :class:`Refused` (the manager said no,
  with its reason) or :class:`Unavailable` (it did not answer).
- Copy agents (``attach_agent_memory``): engine memory on ``"cpu"`` or
  ``"cuda:N"``; CUDA memory where this process cannot use CUDA raises
  :class:`CudaUnavailable`.
"""

from ._orbitkv import (
    Client,
    ConnectionError,
    ContractError,
    CudaUnavailable,
    IdentityError,
    Instance,
    InvariantError,
    Loaded,
    Lookup,
    MissReason,
    QueueFull,
    Ready,
    Refused,
    Rejected,
    Runtime,
    Saved,
    Session,
    SharedBuffer,
    Unavailable,
    __version__,
    common_boundaries,
    compute_identity,
    default_socket,
    required_ranges,
    restorable_boundaries,
    select_boundary,
    vllm_window_past_tokens,
)
from ._model import model_source

__all__ = [
    "Client",
    "ConnectionError",
    "ContractError",
    "CudaUnavailable",
    "IdentityError",
    "Instance",
    "InvariantError",
    "Loaded",
    "Lookup",
    "MissReason",
    "QueueFull",
    "Ready",
    "Refused",
    "Rejected",
    "Runtime",
    "Saved",
    "Session",
    "SharedBuffer",
    "Unavailable",
    "__version__",
    "common_boundaries",
    "compute_identity",
    "default_socket",
    "model_source",
    "required_ranges",
    "restorable_boundaries",
    "select_boundary",
    "vllm_window_past_tokens",
]
