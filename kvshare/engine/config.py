"""The engine's configuration: a frozen dataclass with one field per `kvshare serve` flag (the model's own config:
kvshare.hf.config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.engine import paged_attention
from kvshare.engine.kv_quant import kv_cache_dtype
from kvshare.hf.config import DTYPE_BYTES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # as DTYPE_BYTES
ATTENTION_BACKENDS = ("auto", "triton", "torch")  # triton: the paged kernel (kvshare.engine.paged_attention)
LINEAR_BACKENDS = ("auto", "fla", "torch")  # a hybrid model's gated delta rule: fla's kernels (CUDA) or torch

@dataclass(frozen=True)
class EngineConfig:
    """Everything `kvshare serve` configures in the engine; one field per CLI flag."""

    model: str
    load_format: str = "auto"  # "auto" (safetensors in the folder) | "dummy" (seeded random weights)
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None  # KV cache size in blocks; else from kv_cache_memory; else a default
    kv_cache_memory: int | None = None  # bytes
    max_model_len: int | None = None  # default: the model's max_position
    prefill_chunk: int = 8192  # tokens per chunk of the token-wise work (projections, MLP) during prefill
    max_num_seqs: int = 64  # requests decoded together in one step
    seed: int = 0  # dummy weights' seed
    served_model_name: str | None = None
    model_id: str = ""  # added to the model identity (e.g. a repository revision), never instead of the weights' hash
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3 with per-tensor scales
    attention_backend: str = "auto"  # "auto": the paged kernel on CUDA with Triton, else "torch" (gather + SDPA)
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    linear_attention_backend: str = "auto"  # hybrid models: "auto" = fla's kernels on CUDA when installed, else torch

    def __post_init__(self):
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load format {self.load_format!r} unknown: use auto or dummy")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} unknown: use one of {', '.join(DTYPE_BYTES)}")
        if self.block_size <= 0 or self.prefill_chunk <= 0:
            raise ValueError("block_size and prefill_chunk must be positive")
        kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)  # raises, naming the accepted values
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {self.attention_backend!r} unknown: use one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend == "triton" and not paged_attention.available(torch.device(self.device)):
            raise ValueError("--attention-backend triton needs a CUDA device and Triton (torch's CUDA builds ship "
                             "it), or TRITON_INTERPRET=1 on a CPU: use auto or torch")

        if self.linear_attention_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear attention backend {self.linear_attention_backend!r} unknown: use one of "
                             f"{', '.join(LINEAR_BACKENDS)}")
        if self.linear_attention_backend == "fla":
            from kvshare.engine import fla_rule

            if not fla_rule.available(torch.device(self.device)):
                raise ValueError("--linear-attention-backend fla needs a CUDA device and the fla-core package "
                                 "(pip install fla-core): use auto or torch")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (kvshare.engine.kv_quant)."""
        return kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
