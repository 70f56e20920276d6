"""OrbitKV's vLLM connector (docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector",
"kv_connector_module_path": "orbitkv.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config":
{"socket": "/run/orbitkv.sock"}}'``.
"""

from .connector import OrbitKVConnector
from .engine import EngineSpec, GroupPlan, resolve_engine
from .metadata import LoadSpec, OrbitKVMetadata, SaveItem, SaveSpec
from .settings import ConfigError, ConnectorSettings

__all__ = [
    "ConfigError",
    "ConnectorSettings",
    "EngineSpec",
    "GroupPlan",
    "LoadSpec",
    "OrbitKVConnector",
    "OrbitKVMetadata",
    "SaveItem",
    "SaveSpec",
    "resolve_engine",
]
