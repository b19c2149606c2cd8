"""A Hugging Face model folder's config.json as a frozen ModelConfig, and the dtype names kvshare serve runs: what the
engine, the harness and the tools read of a model without importing torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures this engine runs. The dense ones differ only in the flags ModelConfig carries (qkv bias, q/k norm,
# tying); the hybrid one (Qwen3.5's text model) also carries `linear` (kvshare.engine.hybrid).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM",)
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + HYBRID_ARCHITECTURES
LAYER_TYPES = ("full_attention", "linear_attention")
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
class LinearAttentionConfig:
    """A hybrid model's Gated DeltaNet layers (Qwen3.5: `linear_*` fields of config.json) and what its full-attention
    layers do differently from Llama's (gated output, partial rotary, zero-centred norms). `layer_types[i]` is
    "linear_attention" or "full_attention", as transformers reads it: the config's list, else every
    `full_attention_interval`-th layer full."""

    layer_types: tuple[str, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = True

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every head."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def state_bytes(self) -> int:
        """One sequence's recurrent state (fp32) and conv state (4 bytes a value at most) over every linear layer."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return len(self.linear_layers) * (recurrent + self.conv_dim * (self.conv_kernel - 1) * 4)

    @classmethod
    def from_hf(cls, hf: dict, num_layers: int, rope_hf: dict) -> LinearAttentionConfig:
        interval = hf.get("full_attention_interval", 4)
        types = tuple(hf.get("layer_types") or ("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                                for i in range(num_layers)))
        if len(types) != num_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {num_layers} entries of {' / '.join(LAYER_TYPES)}")
        value_heads, key_heads = hf["linear_num_value_heads"], hf["linear_num_key_heads"]
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads {value_heads} must be a multiple of linear_num_key_heads "
                             f"{key_heads}")
        return cls(
            layer_types=types,
            num_key_heads=key_heads,
            num_value_heads=value_heads,
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(rope_hf.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
            attn_output_gate=bool(hf.get("attn_output_gate", True)),
        )


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
    linear: LinearAttentionConfig | None = None  # a hybrid model's linear-attention layers (None: every layer full)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with per-token K/V (every layer of a dense model)."""
        if self.linear is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.linear.layer_types) if kind == "full_attention")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (Qwen3.5: a quarter; the rest pass through)."""
        factor = self.linear.partial_rotary_factor if self.linear else 1.0
        return int(self.head_dim * factor)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch == "Qwen3_5ForConditionalGeneration":
            raise ValueError("Qwen3_5ForConditionalGeneration (text + vision) is not supported: serve its text model "
                             "(architecture Qwen3_5ForCausalLM, the text_config fields at the top level)")
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
            qk_norm=arch in ("Qwen3ForCausalLM", *HYBRID_ARCHITECTURES),
            linear=LinearAttentionConfig.from_hf(hf, hf["num_hidden_layers"], rope_hf)
            if arch in HYBRID_ARCHITECTURES else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: pass --model a Hugging Face model folder, or create one with "
                                    "`kvshare make-model --preset tiny --out DIR`")
        return cls.from_hf(json.loads(path.read_text()))

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of every attention layer for one token, in `dtype` (a name of DTYPE_BYTES)."""
        return len(self.attention_layers) * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]
