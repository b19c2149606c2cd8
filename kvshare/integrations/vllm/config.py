"""What the connector reads from vLLM's configuration: the pool address and chunk size, the KV layout, the namespace."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

from kvshare.connector import ConnectorConfig
from kvshare.keys import Namespace, fingerprint
from kvshare.transfer import KVLayout

# vLLM's resolved KVCacheLayout name -> the kvshare.transfer kind that reads it (see the package docstring).
LAYOUT_KINDS = {"LBHNC": "vllm_lbhnc", "LBNHC": "vllm_lbnhc"}
_EXTRA_KEYS = {"pool", "chunk_tokens", "timeout", "verify_checksums"}


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """ConnectorConfig from `kv_connector_extra_config`: {"pool": address, "chunk_tokens", "timeout", ...}."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - _EXTRA_KEYS
    if unknown or "pool" not in extra:
        raise ValueError(
            f"KVShareConnector: kv_connector_extra_config needs \"pool\" (the socket of `kvshare pool serve`) and "
            f"accepts {sorted(_EXTRA_KEYS)}; got {sorted(extra)}"
        )
    return ConnectorConfig(
        address=str(extra["pool"]),
        chunk_tokens=int(extra.get("chunk_tokens", 256)),
        timeout=float(extra.get("timeout", 5.0)),
        verify_checksums=bool(extra.get("verify_checksums", True)),
    )


def expected_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVLayout:
    """The KVLayout both halves agree on before any tensor exists (num_blocks is not part of its identity)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("KVShareConnector supports tensor_parallel_size 1 and pipeline_parallel_size 1 for now")
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if not isinstance(spec, AttentionSpec) or spec.head_size_v != spec.head_size:
        raise ValueError(
            f"KVShareConnector supports models with one KV cache group of plain attention; this model has "
            f"{len(groups)} group(s) ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)})"
        )
    layout_name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    if layout_name not in LAYOUT_KINDS:
        raise ValueError(
            f"KVShareConnector reads the KV cache layouts {sorted(LAYOUT_KINDS)}; vLLM resolved {layout_name}: "
            f"set VLLM_KV_CACHE_LAYOUT to one of those"
        )
    return KVLayout(
        num_layers=len(groups[0].layer_names), num_blocks=1, block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype, kind=LAYOUT_KINDS[layout_name],
    )


def namespace(vllm_config: VllmConfig, layout: KVLayout, chunk_tokens: int) -> Namespace:
    """Replicas of the same model folder/revision/config, dtype and KV layout share; anything else never does."""
    model = vllm_config.model_config
    if chunk_tokens % layout.block_size:
        raise ValueError(
            f"KVShareConnector chunk_tokens {chunk_tokens} must be a multiple of vLLM's block size "
            f"{layout.block_size}: set \"chunk_tokens\" in kv_connector_extra_config or --block-size"
        )
    model_id = fingerprint("vllm", model.model, model.revision or "", model.hf_config.to_json_string())
    return Namespace(
        model_fingerprint=model_id,
        dtype=str(layout.dtype).removeprefix("torch."),
        layout_id=layout.layout_id(),
        chunk_tokens=chunk_tokens,
    )
