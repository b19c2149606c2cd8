"""What the connector reads from vLLM's configuration: the pool address and chunk size, the KV layout, the namespace
(and in it the model identity: docs/security.md, "Model identity")."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import vllm
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

from kvshare import identity
from kvshare.connector import ConnectorConfig
from kvshare.connector.config import from_extra_config
from kvshare.integrations.vllm import compat
from kvshare.integrations.vllm.hybrid import HybridGroups
from kvshare.keys import Namespace
from kvshare.transfer import KVLayout
from kvshare.transfer.state import StateLayout

log = logging.getLogger("vllm.kvshare")  # under vLLM's logger, so its handlers show our lines

# vLLM's resolved KVCacheLayout name (0.32's names: compat renames 0.26's) -> the kvshare.transfer kind that reads it
# (see the package docstring).
LAYOUT_KINDS = {"LBHNC": "vllm_lbhnc", "LBNHC": "vllm_lbnhc"}


# TESTS ONLY: the negative control of hybrid sharing (ConnectorConfig.unsafe_skip_state_load), which
# tests/integrations/test_vllm_hybrid.py must reach in a vLLM subprocess. Named so that nobody sets it by accident.
UNSAFE_SKIP_STATE_LOAD = "unsafe_skip_state_load_for_tests"


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """ConnectorConfig from `kv_connector_extra_config`: {"pool": address, "chunk_tokens", "timeout", ...}
    (kvshare.connector.config.from_extra_config lists the keys)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unsafe = extra.pop(UNSAFE_SKIP_STATE_LOAD, False) is True
    config = from_extra_config(extra)
    if unsafe:
        log.warning("kvshare: %s is set: hybrid hits load attention K/V WITHOUT their state (wrong answers; tests "
                    "only)", UNSAFE_SKIP_STATE_LOAD)
        config = dataclasses.replace(config, unsafe_skip_state_load=True)
    return config


def expected_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                    hybrid: HybridGroups | None = None) -> KVLayout:
    """The KVLayout both halves agree on before any tensor exists (num_blocks is not part of its identity): of the
    one KV cache group, or of a hybrid model's attention group (`hybrid`, from hybrid.hybrid_groups)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("KVShareConnector supports tensor_parallel_size 1 and pipeline_parallel_size 1 for now")
    groups = kv_cache_config.kv_cache_groups
    if hybrid is not None:
        groups = [groups[hybrid.attention]]
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if not isinstance(spec, AttentionSpec) or compat.head_size_v(spec) != spec.head_size:
        raise ValueError(
            f"KVShareConnector supports models with one KV cache group of plain attention; this model has "
            f"{len(groups)} group(s) ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)})"
        )
    layout_name = compat.resolved_layout_name(vllm_config, kv_cache_config, spec)
    if layout_name not in LAYOUT_KINDS:
        raise ValueError(
            f"KVShareConnector reads the KV cache layouts {sorted(LAYOUT_KINDS)}; vLLM resolved {layout_name}: "
            f"set VLLM_KV_CACHE_LAYOUT to one of those"
        )
    return KVLayout(
        num_layers=len(groups[0].layer_names), num_blocks=1, block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype, kind=LAYOUT_KINDS[layout_name],
    )


def namespace(vllm_config: VllmConfig, layout: KVLayout, chunk_tokens: int,
              state_layout: StateLayout | None = None) -> Namespace:
    """Replicas of the same model identity (config, weights' bytes, dtype, quantization, "model_id"), KV layout,
    state layout (a hybrid model's) and chunk size share; anything else never does."""
    layout_id = layout.layout_id() + ("" if state_layout is None else "|" + state_layout.layout_id())
    try:
        return Namespace.of_replica(model_identity(vllm_config), str(layout.dtype).removeprefix("torch."),
                                    layout_id, layout.block_size, chunk_tokens)
    except ValueError as error:
        raise ValueError(f"KVShareConnector {error}: set \"chunk_tokens\" in kv_connector_extra_config or vLLM's "
                         "--block-size") from None


def model_identity(vllm_config: VllmConfig) -> str:
    """kvshare.identity.model_fingerprint of the config as vLLM resolved it (overrides included), the weights
    (weights_identity), what vLLM computes them in (dtype, quantization) and the optional "model_id". The model's
    path or repository name is not part of it: the same bytes under two paths share, other bytes under one never do.
    Both connector halves run it; in one process the weight files are hashed once (identity.checkpoint_digest)."""
    model = vllm_config.model_config
    model_id = str((vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("model_id", ""))
    # The KV cache dtype too: fp8_e4m3 and fp8_e5m2 caches are both uint8 tensors to the layout, yet not the same KV.
    computed = (f"vllm/dtype={model.dtype}/quantization={model.quantization}/"
                f"kv_cache_dtype={vllm_config.cache_config.cache_dtype}")
    weights = weights_identity(vllm_config, model_id)
    return identity.model_fingerprint(model.hf_config.to_json_string().encode(), f"{weights}|{computed}", model_id)


def weights_identity(vllm_config: VllmConfig, model_id: str) -> str:
    """Dummy weights: vLLM draws them with a fixed seed (1234) on the worker's device, so what varies is vLLM's
    version (its parameter layout) and the generator. Otherwise the checkpoint's weight files, found as vLLM finds
    them: a local folder or file, or the Hugging Face cache snapshot of the repository and revision."""
    if vllm_config.load_config.load_format == "dummy":
        generator = identity.generator_identity(torch.device(current_platform.device_type))
        return f"vllm-dummy:vllm-{vllm.__version__}/{generator}"
    model = vllm_config.model_config
    location = identity.checkpoint_location(model.model, model.revision, vllm_config.load_config.download_dir)
    try:
        if location is None:
            raise FileNotFoundError(f"{model.model} is neither a local path nor in the Hugging Face cache")
        started = time.monotonic()
        digest = identity.checkpoint_digest(location)
    except FileNotFoundError as e:
        if not model_id:
            raise ValueError(
                f"KVShareConnector cannot identify the weights of {model.model} ({e}): replicas must not share KV "
                f"unless their weights match. Serve a local folder or a Hugging Face cache snapshot, or set "
                f"\"model_id\" in kv_connector_extra_config to a name of these exact weights (e.g. a commit hash)"
            ) from e
        log.warning("kvshare: weights of %s not found (%s); the model identity rests on model_id %r alone",
                    model.model, e, model_id)
        return "declared"
    log.info("kvshare: model identity of %s: %s (%.2f s)", location, digest[:24], time.monotonic() - started)
    return digest
