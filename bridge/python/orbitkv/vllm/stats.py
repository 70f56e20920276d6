"""The connector's counters in vLLM's stats pipeline (`KVConnectorStats`):
each role reports what changed since its last report; vLLM sums the
workers' and the scheduler's reports and logs them ("KV Transfer metrics:
...") every logging interval. Misses and failed loads are counted by
reason (`misses_by_reason.<reason>`, `failures_by_reason.<reason>`)."""

from __future__ import annotations

from typing import Any, Dict

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class Reporter:
    """Turns cumulative counters into the deltas vLLM expects per report.

    A stats dataclass is read as flat counters: its instance dict (no
    slots, no private attributes), a dict field as `name.key` counters.
    vLLM asks every step, on its scheduler thread: one pass over the
    fields, and a counter's name is built only when it changed
    (`dataclasses.asdict` deep-copies, and cost about 30 us a step)."""

    def __init__(self) -> None:
        self._last: Dict[Any, int] = {}

    def delta(self, stats: Any) -> "OrbitKVStats | None":
        last = self._last
        diff: Dict[str, int] = {}
        # A new miss reason replaces its dict field (`SchedulerStats.miss`):
        # the items are copied, so a report never sees one change size.
        for name, value in list(vars(stats).items()):
            if isinstance(value, dict):
                for key, n in list(value.items()):
                    k = (name, key)
                    n = int(n)
                    was = last.get(k, 0)
                    if n != was:
                        diff[f"{name}.{key}"] = n - was
                        last[k] = n
            else:
                n = int(value)
                was = last.get(name, 0)
                if n != was:
                    diff[name] = n - was
                    last[name] = n
        return OrbitKVStats(data=diff) if diff else None


class OrbitKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "OrbitKVStats":
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            merged[k] = merged.get(k, 0) + v
        return OrbitKVStats(data=merged)

    def reduce(self) -> Dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())
