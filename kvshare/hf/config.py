"""A Hugging Face model folder's config.json as a frozen ModelConfig, and the dtype names kvshare serve runs: what the
engine, the harness and the tools read of a model without importing torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures this engine runs; they differ only in the flags ModelConfig carries (qkv bias, q/k norm, tying).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes kvshare serve runs, by name


def default_dtype(device: str) -> str:
    """`kvshare serve`'s dtype when none is given: bfloat16 on CUDA, float32 on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is "default" or "llama3" (Llama 3.1 frequency scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only Llama-family model. head_dim may differ from hidden_size // num_heads (Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported: use one of {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        # transformers 5 moved rope settings into rope_parameters; older configs use rope_theta + rope_scaling.
        rope_hf = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope_hf.get("rope_type", rope_hf.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"rope type {kind!r} is not supported: use a model with default or llama3 RoPE")
        rope = RopeConfig(
            theta=float(rope_hf.get("rope_theta", hf.get("rope_theta", 10000.0))),
            kind=kind,
            factor=float(rope_hf.get("factor", 1.0)),
            low_freq_factor=float(rope_hf.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_hf.get("high_freq_factor", 4.0)),
            original_max_position=int(rope_hf.get("original_max_position_embeddings", 8192)),
        )
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: pass --model a Hugging Face model folder, or create one with "
                                    "`kvshare make-model --preset tiny --out DIR`")
        return cls.from_hf(json.loads(path.read_text()))

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of every layer for one token, in `dtype` (a name of DTYPE_BYTES)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]
