"""`OrbitKVConnector`: the class vLLM loads from ``orbitkv.vllm``.

One class for both roles, as vLLM requires; each instance delegates to a
`SchedulerSide` or a `WorkerSide`. The roles share nothing but the
`OrbitKVMetadata` vLLM carries from the scheduler to the workers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from .engine import EngineSpec, resolve_engine
from .metadata import OrbitKVMetadata
from .scheduler import SchedulerSide
from .settings import ConfigError, ConnectorSettings
from .stats import OrbitKVStats, Reporter
from .worker import WorkerSide

try:  # 0.33 reports transfers through one snapshot; 0.32 has only get_finished.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("orbitkv.vllm")


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _events(vllm_config: Any, kv_cache_config: Any, settings: Any, spec: EngineSpec, sched: SchedulerSide):
    """The scheduler's KV events, when both vLLM's and the manager's are
    on; a half-configured pair is said at startup, never silently idle."""
    kve = getattr(vllm_config, "kv_events_config", None)
    on = kve is not None and bool(kve.enable_kv_cache_events)
    if not on:
        if settings.events:
            log.warning(
                "OrbitKV: kv_connector_extra_config.events is set but vLLM's KV events are off "
                "(--kv-events-config enable_kv_cache_events): OrbitKV's pages are not published"
            )
        return None
    if not settings.events:
        log.warning(
            "OrbitKV: vLLM publishes KV events but kv_connector_extra_config.events "
            "(ORBITKV_EVENTS_ADDR) is not set: routers will not see the prefixes this engine "
            "can load from OrbitKV (docs/events.md)"
        )
        return None
    from .events import ConnectorEvents, GroupInfo

    groups = {
        g.id: GroupInfo(g.vllm_group, kv_cache_config.kv_cache_groups[g.vllm_group].kv_cache_spec)
        for g in spec.groups
    }
    return ConnectorEvents(
        settings.events,
        settings.events_replay or None,
        groups,
        spec.page_tokens,
        sched.namespaces,
    )


class OrbitKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps vLLM's KV cache in OrbitKV and restores prefixes from it.

    ``--kv-transfer-config '{"kv_connector": "OrbitKVConnector",
    "kv_connector_module_path": "orbitkv.vllm", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"socket": "/run/orbitkv.sock"}}'``
    (docs/vllm.md lists every key).
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        extra = dict(kvt.kv_connector_extra_config or {})
        settings = ConnectorSettings.from_extra_config(extra)
        # kv_role narrows what the engine does: a producer only saves, a
        # consumer only loads, kv_both does both.
        self.settings = dataclasses.replace(
            settings,
            load=settings.load and bool(kvt.is_kv_consumer),
            save=settings.save and bool(kvt.is_kv_producer),
        )
        self.spec: EngineSpec = resolve_engine(vllm_config, kv_cache_config, self.settings)
        if self.settings.load_mode == "layerwise" and len(self.spec.groups) != 1:
            # vLLM takes block-level load errors (how a failed synchronous
            # load is reported) only with one KV cache group.
            raise ConfigError(
                "kv_connector_extra_config.load_mode 'layerwise' needs a single KV cache "
                f"group; this model has {len(self.spec.groups)} (use 'async')"
            )
        self.scheduler: Optional[SchedulerSide] = None
        self.worker: Optional[WorkerSide] = None
        self._reporter = Reporter()
        if role == KVConnectorRole.SCHEDULER:
            side = self.scheduler = SchedulerSide(self.settings, self.spec)
            side.events = _events(vllm_config, kv_cache_config, self.settings, self.spec, side)
            # vLLM's scheduler thread calls these for every request: they
            # are the side's own bound methods on this instance, no
            # forwarding frame in between (about 0.15 us a call).
            self.on_new_request = side.on_new_request  # type: ignore[method-assign]
            self.get_num_new_matched_tokens = side.get_num_new_matched_tokens  # type: ignore[method-assign]
            self.update_state_after_alloc = side.update_state_after_alloc  # type: ignore[method-assign]
            self.build_connector_meta = side.build_connector_meta  # type: ignore[method-assign]
            self.update_connector_output = side.update_connector_output  # type: ignore[method-assign]
            self.request_finished = side.request_finished  # type: ignore[method-assign]
            self.request_finished_all_groups = side.request_finished  # type: ignore[method-assign]
        else:
            self.worker = WorkerSide(
                self.settings, self.spec, _tp_rank(), int(kv_cache_config.num_blocks)
            )
        log.info(
            "OrbitKV connector (%s): instance %s, identity %s, %d group(s), %d-token pages",
            role.name.lower(),
            self.spec.instance,
            self.spec.identity,
            len(self.spec.groups),
            self.spec.page_tokens,
        )

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> OrbitKVStats:
        return OrbitKVStats(data=dict(data or {}))

    def get_kv_connector_stats(self) -> Optional[OrbitKVStats]:
        """What changed since the last report: the scheduler's lookups and
        misses by reason, or a worker's loads, failures by reason and pages
        moved."""
        side = self.scheduler or self.worker
        return self._reporter.delta(side.stats) if side is not None else None

    # A dropped save is a later miss, not a lost hand-off: preempted
    # requests need not be recomputed for the connector's sake.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- scheduler side ----------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: Any
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: Tuple[list, ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    # ---- worker side -------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, OrbitKVMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # load_mode "async": a request computes only after its load was
        # reported finished. "layerwise": waits for this layer's copies.
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Pages are staged once per step, in wait_for_save, from all layers;
        # preempted requests need no handling: nothing reads their blocks
        # after the step that wrote them.
        return

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.queue_saves()

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self.worker is not None
        sending, recving, _failed = self.worker.transfer_results(set(finished_req_ids))
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        assert self.worker is not None
        sending, recving, failed = self.worker.transfer_results(set(finished_req_ids))
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> Set[int]:
        if self.worker is None:
            return set()
        return self.worker.load_errors()

    def take_events(self) -> Iterable[Any]:
        if self.scheduler is None:
            return ()
        return self.scheduler.take_events()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
