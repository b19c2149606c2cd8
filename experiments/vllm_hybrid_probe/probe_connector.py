"""Recording KV connector for vLLM 0.32: logs KV cache groups, registered tensors, per-group block ids and mamba
state contents to a JSONL file; moves no KV."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


def _log(path: str, event: str, **data: Any) -> None:
    rec = {"t": round(time.time(), 3), "pid": os.getpid(), "event": event, **data}
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def _describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "storage_ptr": t.untyped_storage().data_ptr(),
        "storage_nbytes": t.untyped_storage().nbytes(),
        "is_contiguous": t.is_contiguous(),
    }


def _describe_spec(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type(spec).__name__}
    for name in (
        "block_size", "page_size_bytes", "num_kv_heads", "head_size", "dtype",
        "shapes", "dtypes", "mamba_type", "mamba_cache_mode", "page_size_padded",
        "num_speculative_blocks", "sliding_window", "num_prefill_checkpoint_blocks",
    ):
        if hasattr(spec, name):
            try:
                out[name] = getattr(spec, name)
            except Exception as exc:  # property may raise for some specs
                out[name] = f"<{exc!r}>"
    return out


def _trace_mamba_split(path: str) -> None:
    """Log every call of the scheduler's align-mode chunk clipping (read-only wrapper)."""
    from vllm.v1.core.sched import scheduler as sched_mod

    cls = sched_mod.Scheduler
    orig = cls._mamba_block_aligned_split
    if getattr(orig, "_probe", False):
        return

    def wrapped(self, request, num_new_tokens, *args, **kwargs):
        out = orig(self, request, num_new_tokens, *args, **kwargs)
        _log(path, "mamba_block_aligned_split", req=request.request_id,
             num_computed_tokens=request.num_computed_tokens, num_new_tokens_in=num_new_tokens,
             extra_args=list(args), num_new_tokens_out=out,
             shared_prefix_boundary=getattr(request, "shared_prefix_boundary", None),
             hash_block_size=getattr(self, "hash_block_size", None),
             sched_cache_config_block_size=self.cache_config.block_size,
             sched_block_size=getattr(self, "block_size", None),
             connector_cache_config_block_size=(
                 self.connector._vllm_config.cache_config.block_size if self.connector else None),
             scheduler_and_connector_share_cache_config=(
                 self.connector._vllm_config.cache_config is self.cache_config if self.connector else None),
             mamba_partial_cache_hit=getattr(self, "mamba_partial_cache_hit", None))
        return out

    wrapped._probe = True
    cls._mamba_block_aligned_split = wrapped


def _trace_block_size_writes(path: str, cache_config: Any) -> None:
    """Log who assigns CacheConfig.block_size on this object after the connector exists (read-only wrapper)."""
    import traceback

    cls = type(cache_config)
    orig = cls.__setattr__
    if getattr(orig, "_probe", False):
        return
    target = id(cache_config)

    def setattr_logged(self, name, value):
        if name == "block_size" and id(self) == target:
            stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack()[-8:-1]]
            _log(path, "cache_config.block_size_write", old=getattr(self, "block_size", None),
                 new=value, stack=stack)
        orig(self, name, value)

    setattr_logged._probe = True
    cls.__setattr__ = setattr_logged


@dataclass
class ProbeMeta(KVConnectorMetadata):
    # req_id -> {"block_ids": per-group lists (full, accumulated), "computed": tokens done after this step}
    reqs: dict[str, dict[str, Any]] = field(default_factory=dict)


class _ProbeBase(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._path = self._kv_transfer_config.get_from_extra_config("log_path", "probe.jsonl")
        self._block_ids: dict[str, list[list[int]]] = {}
        self._kv_caches: dict[str, Any] = {}
        self._saved_layers: set[str] = set()
        cc = vllm_config.cache_config
        sc = vllm_config.scheduler_config
        if role == KVConnectorRole.SCHEDULER:
            _trace_mamba_split(self._path)
            _trace_block_size_writes(self._path, cc)
        groups = []
        if kv_cache_config is not None:
            for i, g in enumerate(kv_cache_config.kv_cache_groups):
                groups.append({"group": i, "layers": list(g.layer_names), "spec": _describe_spec(g.kv_cache_spec)})
        _log(
            self._path, "init", role=role.name, cls=type(self).__name__,
            num_blocks=getattr(kv_cache_config, "num_blocks", None),
            groups=groups,
            prefix_cacheable_group_ids=getattr(kv_cache_config, "prefix_cacheable_group_ids", None),
            kv_cache_tensors=[
                {k: getattr(t, k, None) for k in ("size", "layers", "layer_stride", "block_stride", "offset")}
                for t in getattr(kv_cache_config, "kv_cache_tensors", [])
            ],
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
            cache_hit_alignment_tokens=getattr(kv_cache_config, "cache_hit_alignment_tokens", None),
            transfer_group_ids=getattr(kv_cache_config, "transfer_group_ids", None),
            kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None),
            block_size=cc.block_size, mamba_block_size=cc.mamba_block_size,
            mamba_cache_mode=cc.mamba_cache_mode, mamba_page_size_padded=cc.mamba_page_size_padded,
            enable_prefix_caching=cc.enable_prefix_caching,
            disable_hybrid_kv_cache_manager=sc.disable_hybrid_kv_cache_manager,
        )

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = kv_caches
        desc = {}
        for name, v in kv_caches.items():
            if isinstance(v, torch.Tensor):
                desc[name] = {"type": "Tensor", **_describe_tensor(v)}
            elif isinstance(v, (list, tuple)):
                desc[name] = {"type": type(v).__name__, "items": [_describe_tensor(x) for x in v]}
            else:
                desc[name] = {"type": type(v).__name__}
        _log(self._path, "register_kv_caches", layers=desc)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if layer_name not in self._saved_layers:
            self._saved_layers.add(layer_name)
            kv_desc = (_describe_tensor(kv_layer) if isinstance(kv_layer, torch.Tensor)
                       else [_describe_tensor(x) for x in kv_layer] if isinstance(kv_layer, (list, tuple))
                       else type(kv_layer).__name__)
            _log(self._path, "save_kv_layer_first_call", layer=layer_name, kv_layer=kv_desc,
                 attn_metadata=type(attn_metadata).__name__)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMeta)
        for req_id, info in meta.reqs.items():
            # For each mamba layer: which blocks of the request's table hold a non-zero state.
            per_layer = {}
            for name, v in self._kv_caches.items():
                gid = info["layer_group"].get(name)
                if gid is None or not isinstance(v, torch.Tensor) or v.dtype != torch.int8:
                    continue  # mamba layers arrive as raw int8 page views [num_blocks, 1, 1, C]
                ids = info["block_ids"][gid]
                # checksum of each block's page (conv+ssm state bytes) in this request's table
                per_layer[name] = [
                    (i, b, int(v[b].to(torch.int64).abs().sum()) if b != 0 else None)
                    for i, b in enumerate(ids)
                ]
                break  # one mamba layer is enough
            _log(self._path, "after_step_state", req=req_id, computed=info["computed"],
                 block_ids=info["block_ids"], mamba_state_norms=per_layer)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # Layout probe only: with extra config "fake_external_tokens" N > 0 the connector claims the first N prompt
        # tokens as an external hit (it loads nothing, so outputs after such a hit are meaningless) to show which
        # blocks vLLM allocates per group for an external load.
        fake = int(self._kv_transfer_config.get_from_extra_config("fake_external_tokens", 0))
        n = fake - num_computed_tokens if (fake > num_computed_tokens and request.num_prompt_tokens > fake) else 0
        _log(self._path, "get_num_new_matched_tokens", req=request.request_id,
             num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=num_computed_tokens, returns=n)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        _log(self._path, "update_state_after_alloc", req=request.request_id,
             block_ids=blocks.get_block_ids(), num_external_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = ProbeMeta()
        layer_group = {}
        for gi, g in enumerate(self._kv_cache_config.kv_cache_groups):
            for ln in g.layer_names:
                layer_group[ln] = gi
        nst = scheduler_output.num_scheduled_tokens
        bs = getattr(scheduler_output, "kv_connector_block_state", None)
        if bs is not None and bs.boundary_state_offloads:
            _log(self._path, "boundary_state_offloads", offloads=bs.boundary_state_offloads)
        for r in scheduler_output.scheduled_new_reqs:
            self._block_ids[r.req_id] = [list(x) for x in r.block_ids]
            _log(self._path, "sched_new_req", req=r.req_id, block_ids=r.block_ids,
                 num_computed_tokens=r.num_computed_tokens, num_scheduled=nst.get(r.req_id))
            meta.reqs[r.req_id] = {"block_ids": self._block_ids[r.req_id],
                                   "computed": r.num_computed_tokens + nst.get(r.req_id, 0),
                                   "layer_group": layer_group}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new is not None:
                self._block_ids[req_id] = [list(x) for x in new]
            elif new is not None:
                for g, ids in enumerate(new):
                    self._block_ids[req_id][g].extend(ids)
            _log(self._path, "sched_cached_req", req=req_id, new_block_ids=new,
                 num_computed_tokens=cached.num_computed_tokens[i], num_scheduled=nst.get(req_id))
            meta.reqs[req_id] = {"block_ids": [list(x) for x in self._block_ids[req_id]],
                                 "computed": cached.num_computed_tokens[i] + nst.get(req_id, 0),
                                 "layer_group": layer_group}
        return meta

    def request_finished(self, request, block_ids):
        _log(self._path, "request_finished", req=request.request_id, block_ids=block_ids)
        return False, None


class ProbeConnector(_ProbeBase, SupportsHMA):
    """Declares SupportsHMA, so vLLM keeps the hybrid KV cache manager on."""

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        _log(self._path, "request_finished_all_groups", req=request.request_id,
             num_tokens=request.num_tokens, block_ids=block_ids)
        return False, None


class ProbeConnectorNoHMA(_ProbeBase):
    """Same probe without SupportsHMA."""


if __name__ == "__main__":
    print(__doc__)
