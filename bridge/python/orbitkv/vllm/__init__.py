"""OrbitKV's vLLM connector (docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector",
"kv_connector_module_path": "orbitkv.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config":
{"socket": "/run/orbitkv.sock"}}'``.

The names that need vLLM (the connector, its metadata) are imported on first
use, so the parts that do not (settings, the page mover) import without it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .settings import ConfigError, ConnectorSettings

_LAZY = {
    "OrbitKVConnector": ".connector",
    "EngineSpec": ".engine",
    "GroupPlan": ".engine",
    "resolve_engine": ".engine",
    "LoadSpec": ".metadata",
    "OrbitKVMetadata": ".metadata",
    "SaveSpec": ".metadata",
}

__all__ = ["ConfigError", "ConnectorSettings", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'orbitkv.vllm' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
