"""`OrbitKVConnector` whose scheduler saves no recurrent state (it drops
vLLM's state hand-offs; attention pages are saved as always): the
end-to-end test's engine that stores a hybrid model's attention prefix
without the state a restore needs. Loaded by vLLM's own factory from
`kv_connector_module_path` (this directory is on the engine's path)."""

from orbitkv.vllm import OrbitKVConnector


class WithheldStateConnector(OrbitKVConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.scheduler is not None:
            self.scheduler._state_handoffs = lambda scheduler_output: {}
