"""A vLLM connector that does nothing: every lookup finds no tokens, nothing
is loaded or saved, no free is delayed. `vllm_scheduler_overhead.py` runs
it as the floor of any connector: what vLLM's scheduler spends on having
a KV connector at all (its hooks called, its metadata carried, its output
handled), which no connector's own work can go below."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NullMetadata(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[list, ...]) -> Tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
