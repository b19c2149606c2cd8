"""`KVShareConnector`: vLLM's KVConnectorBase_V1 hooks, each forwarded to the scheduler half or the worker half.

It declares SupportsHMA, so vLLM keeps its hybrid KV cache manager on: a model of one KV cache group runs as before
(the plain path), a hybrid model with mamba groups in align mode shares its states too (kvshare.integrations.vllm
.hybrid), and a model of several attention groups (sliding windows) is refused at start-up with what to set."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvshare.connector import ConnectorCore
from kvshare.integrations.vllm import compat
from kvshare.integrations.vllm import config as cfg
from kvshare.integrations.vllm.hybrid import hybrid_groups
from kvshare.integrations.vllm.metadata import KVShareMetadata
from kvshare.integrations.vllm.scheduler import SchedulerSide
from kvshare.integrations.vllm.stats import Increments, KVSharePromMetrics, KVShareStats
from kvshare.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvshare")  # under vLLM's logger, so its handlers show our lines


def show_library_logs() -> None:
    """Send the kvshare library's own loggers ("kvshare.*": the transfer, the pool client) through vLLM's handlers at
    INFO, as the integration's "vllm.kvshare" lines are: without a handler, Python shows only their warnings, and a
    replica's log would not say, e.g., that its host checksum kernel is compiled. Once per process."""
    library = logging.getLogger("kvshare")
    if library.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        library.addHandler(handler)
    library.setLevel(logging.INFO)
    library.propagate = False  # the root logger's handlers (if any) would print each line twice


show_library_logs()


class KVShareConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares full KV chunks between vLLM replicas through a kvshare pool; any pool failure costs only recompute."""

    if compat.CACHE_HIT_SOURCE_HOST is not None:  # vLLM 0.32 labels external hits by tier; 0.26 has no label
        _cache_hit_source = compat.CACHE_HIT_SOURCE_HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = cfg.connector_config(vllm_config)
        hybrid = hybrid_groups(vllm_config, kv_cache_config, config.chunk_tokens)
        layout = cfg.expected_layout(vllm_config, kv_cache_config, hybrid)
        state_layout = hybrid.state_layout if hybrid is not None else None
        core = ConnectorCore(config, cfg.namespace(vllm_config, layout, config.chunk_tokens, state_layout),
                             layout.block_size, state_layout=state_layout)
        self.core = core
        self._increments = Increments(core.stats)  # this half's counters, reported to vLLM's metrics
        scheduler = role == KVConnectorRole.SCHEDULER
        if scheduler:  # the worker logs its own on attach: the two namespaces must be one (ConnectorCore._foreign)
            log.info("kvshare scheduler half: KV layout %s, namespace %s", layout.kind.name,
                     core.namespace().describe())
        self._scheduler = SchedulerSide(core, layout.block_size, hybrid) if scheduler else None
        self._block_tables = compat.new_block_tables() if scheduler else None  # vLLM 0.26 only (compat)
        self._worker = WorkerSide(core, layout, hybrid) if role == KVConnectorRole.WORKER else None
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning('kv_load_failure_policy is "%s": a failed pool load will fail its request; set '
                        '"kv_load_failure_policy":"recompute" in --kv-transfer-config to recompute instead',
                        self._kv_transfer_config.kv_load_failure_policy)

    @property
    def requires_kv_delivery(self) -> bool:  # read by vLLM 0.32 only (compat.ONLY_IN_0_32)
        return False  # a best-effort cache: a dropped store is a future miss, never a wrong answer

    # ---- scheduler side ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)  # synchronous, but a hybrid model's async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        blocks = compat.block_source(self, self._block_tables, scheduler_output)
        return self._scheduler.build(scheduler_output, blocks)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        self._scheduler.worker_reported(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request), None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request), None  # SupportsHMA's form of request_finished

    def _finished(self, request: Request) -> bool:
        if self._block_tables is not None:
            self._block_tables.forget(request.request_id)  # no step plans anything for it from now on
        return self._scheduler.finished(request)

    # ---- worker side ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole chunks are stored in wait_for_save, after the forward wrote every layer

    def wait_for_save(self):
        self._worker.save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids) or None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.KVConnectorTransferResults:
        """Stores settled (get_finished), and a hybrid model's asynchronous loads: ended, and which of them failed
        (vLLM recomputes those; a failed receive is reported as received too, so that the request leaves its wait).
        vLLM 0.32's worker calls it instead of get_finished; 0.26's never does (compat)."""
        received, failed = self._worker.take_received()
        return compat.KVConnectorTransferResults(finished_sending=self._worker.finished(finished_req_ids),
                                          finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid()

    def build_connector_worker_meta(self):
        return self._worker.take_loaded()

    def shutdown(self):
        self.core.close()

    # ---- metrics (kvshare.integrations.vllm.stats) ----------------------------------------------------------
    def get_kv_connector_stats(self) -> KVShareStats | None:
        return self._increments.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShareStats:
        return KVShareStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVSharePromMetrics:
        return KVSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _metadata(self) -> KVShareMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVShareMetadata), f"unexpected connector metadata {type(meta).__name__}"
        return meta
