"""Where a served model's configuration is, and whether its hub revision
names the computation: the one rule every adapter applies.

The identity (``compute_identity``) needs a directory holding the model's
``config.json``. Its artifact input is, in this precedence: the operator's
``ORBITKV_MODEL_FINGERPRINT``, a hub revision pinned to a full 40-hex
commit, or the directory's content. So:

- a local directory (the engine's model path, or the adapter's explicit
  ``model_dir``) is used as it is: its content is hashed unless the
  operator's fingerprint replaces it;
- a hub id needs a pinned commit or the operator's fingerprint (a branch or
  tag can move, so it cannot name the computation), and its ``config.json``
  is read from the local hub cache only, never downloaded.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ._orbitkv import IdentityError

#: The operator's digest, which replaces the model's artifacts in the
#: identity (``components/src/identity.rs``).
FINGERPRINT_ENV = "ORBITKV_MODEL_FINGERPRINT"

_COMMIT = re.compile(r"[0-9a-fA-F]{40}")


def model_source(
    model: str,
    revision: Optional[str] = None,
    *,
    model_dir: Optional[str] = None,
    cache_dir: Optional[str] = None,
) -> Tuple[str, Optional[str]]:
    """``(directory holding config.json, pinned commit or None)`` for a model
    the engine names ``model`` (a local path or a hub id) at ``revision``.

    :param model_dir: the operator's explicit directory: wins over
        ``model``.
    :param cache_dir: the hub cache to look in (default: huggingface_hub's).
    :raises IdentityError: a hub id without a pinned commit or the
        operator's fingerprint, or one whose ``config.json`` is not in the
        local hub cache; the message says how to fix it.
    """
    if model_dir is not None:
        if not os.path.isdir(model_dir):
            raise IdentityError(f"model_dir {model_dir!r} is not a directory")
        return str(model_dir), None
    if os.path.isdir(model):
        return model, None
    pinned = revision is not None and _COMMIT.fullmatch(str(revision)) is not None
    if not pinned and not os.environ.get(FINGERPRINT_ENV):
        raise IdentityError(
            f"model {model!r} is a hub id without a pinned commit (revision {revision!r}): pass "
            "the revision as a full 40-hex commit, point the engine at a local directory, or "
            f"set {FINGERPRINT_ENV} (a branch or tag can move, so it cannot name the computation)"
        )
    commit = str(revision).lower() if pinned else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as e:
        raise IdentityError(
            f"model {model!r}: huggingface_hub is not installed, so its local snapshot cannot be "
            "found; point the engine at a local directory instead"
        ) from e
    try:
        found = try_to_load_from_cache(
            model, "config.json", cache_dir=cache_dir, revision=commit or revision or None
        )
    except Exception as e:  # an id the hub library refuses
        raise IdentityError(f"model {model!r}: cannot look in the hub cache: {e}") from e
    if not isinstance(found, str):
        at = commit or revision or "main"
        raise IdentityError(
            f"model {model!r}@{at}: no config.json in the local hub cache (OrbitKV never "
            "downloads; let the engine download it first, or point it at a local directory)"
        )
    return os.path.dirname(found), commit
