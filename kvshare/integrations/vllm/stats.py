"""The connector's counters in vLLM's own metrics: each half (scheduler, worker) hands vLLM what its ConnectorStats
grew by since it last asked; vLLM sums the halves' reports and adds them to one Prometheus counter per field,
`kvshare_pool_<field>_total` (labels model_name and engine), the names a `kvshare serve` replica uses. So a vLLM
replica's /metrics shows its LOOKUPs, loads, stores, corrupt chunks and L2 decisions like a kvshare replica's.

Invariants: a report carries increments only (a counter never goes back), and each increment is reported once: the
half remembers what it last reported, under a lock (vLLM may ask from another thread than the one counting).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvshare.connector.contract import STAT_HELP, ConnectorStats


@dataclass
class KVShareStats(KVConnectorStats):
    """`data`: {field: increment} of ConnectorStats counters over one interval (plain numbers: vLLM sends it from
    the worker process to the engine's)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Increments:
    """What a ConnectorStats grew by since the last `take()`."""

    def __init__(self, stats: ConnectorStats):
        self._stats = stats
        self._reported = stats.values()
        self._lock = threading.Lock()

    def take(self) -> KVShareStats | None:
        with self._lock:
            now = self._stats.values()
            grown = {name: value - self._reported[name] for name, value in now.items() if value > self._reported[name]}
            self._reported = now
        return KVShareStats(data=grown) if grown else None


class KVSharePromMetrics(KVConnectorPromMetrics):
    """One counter per ConnectorStats field, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name in ConnectorStats().values():
            counter = self._counter_cls(name=f"kvshare_pool_{name}", documentation=STAT_HELP.get(name, name),
                                        labelnames=labelnames)
            self._counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
