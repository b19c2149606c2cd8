"""The KV cache's storage dtype (`kvshare serve --kv-cache-dtype`): the model's dtype, or fp8 e4m3 with per-tensor
scales, as vLLM does it.

fp8: each layer has one K scale and one V scale (floats, from the checkpoint's `model.layers.N.self_attn.k_scale` /
`v_scale` tensors, 1.0 where it has none, as in vLLM). Writing K stores `fp8(clamp(k / k_scale, +-448))` (saturating:
e4m3fn has no infinity); reading stores' bytes gives `fp8.to(compute dtype) * k_scale`; V likewise. Attention always
reads K/V through the cache (a prefill reads back what it just wrote), so a cache-OFF prefill, a local prefix hit and
a pool hit all attend to the same quantized values: the pool moves the fp8 bytes unchanged.

An fp8 cache is indexed through a uint8 view of itself (same shape), so its writes and gathers use only byte
indexing kernels, which every device has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # flag -> dtype
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class KVScales:
    """One layer's per-tensor scales (real value = stored value x scale). Unused when the cache is in the model's
    dtype."""

    k: float = 1.0
    v: float = 1.0


UNIT = KVScales()


def kv_cache_dtype(flag: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for a --kv-cache-dtype value ("auto": the model's)."""
    if flag not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {flag!r} unknown: use one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[flag] or model_dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x (any shape, compute dtype) as the cache stores it."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    scaled = x.float() if scale == 1.0 else x.float() / scale  # x.float() may be x itself: never clamp in place
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values x back in the compute dtype (exact for scale 1.0: every e4m3 value is a bf16 and fp32 value)."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)

