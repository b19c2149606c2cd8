"""Model weights: safetensors shards from a Hugging Face folder, or seeded dummy weights; and the model identity.

Dummy weights: each tensor is drawn from its own generator seeded with xxh3(seed, tensor name), directly on the
target device and dtype, so every replica (and every process) built with the same seed on the same kind of device
holds identical weights without reading a checkpoint. Norm weights are ones; a hybrid model's decay parameters
(A_log, dt_bias) fixed values that give its state a long memory; everything else N(0, 0.02).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from kvshare.engine.hybrid import HybridCausalLM
from kvshare.engine.kv_quant import KVScales
from kvshare.engine.model import CausalLM
from kvshare.hf.config import ModelConfig
from kvshare.identity import TensorDigests, generator_identity, model_fingerprint

DUMMY_STD = 0.02


def shard_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: use --load-format dummy for random weights")
    return files


def build_model(config: ModelConfig) -> CausalLM | HybridCausalLM:
    """The module of config's architecture (call under torch.device("meta"); the loader assigns the weights)."""
    return CausalLM(config) if config.linear is None else HybridCausalLM(config)


def dummy_tensor(name: str, shape: torch.Size, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    if name.endswith("dt_bias"):
        return torch.zeros(shape, device=device, dtype=dtype)
    if name.endswith("A_log"):  # a hybrid model's decay rates, spread so that some heads remember thousands of tokens
        return torch.linspace(1e-3, 0.5, shape[0], device=device).log().to(dtype)
    generator = torch.Generator(device=device)
    generator.manual_seed(xxhash.xxh3_64_intdigest(f"{seed}/{name}".encode()) & (2**63 - 1))
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, DUMMY_STD, generator=generator)


def dummy_state_dict(config: ModelConfig, seed: int, device, dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights for every parameter of the model (names as in Hugging Face checkpoints)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in build_model(config).named_parameters()}
    return {name: dummy_tensor(name, shape, seed, torch.device(device), dtype) for name, shape in shapes.items()}


def read_safetensors(model_dir: Path, names: set[str], device, dtype,
                     digests: TensorDigests | None = None) -> dict[str, torch.Tensor]:
    """The tensors named `names` from the folder's shards, cast to dtype on device; other tensors are skipped.

    Each tensor is read on the host first; with `digests`, its raw bytes are handed to the hashing threads there,
    before the cast or the move, so the identity is of the checkpoint's own bytes and costs no second read."""
    state = {}
    for path in shard_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in names:
                    host = f.get_tensor(name)
                    if digests is not None:
                        digests.add(name, host)
                    state[name] = host.to(device).to(dtype)
    return state


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM | HybridCausalLM
    fingerprint: str  # the model identity (kvshare.identity): replicas share KV only when fingerprints match


def load_model(model_dir: str | Path, load_format: str, device, dtype, seed: int = 0,
               model_id: str = "") -> LoadedModel:
    """Build the model of `model_dir`'s config.json with real ("auto") or dummy weights, in eval mode, and its
    identity: config.json + (auto: every loaded tensor's name, dtype, shape and bytes; dummy: the seed, dtype and
    generator, see dummy_weights_identity) + `model_id` (added, never instead)."""
    model_dir, device = Path(model_dir), torch.device(device)
    config_bytes = (model_dir / "config.json").read_bytes()
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = build_model(config)
    names = {name for name, _ in model.named_parameters()}
    if load_format == "dummy":
        state = dummy_state_dict(config, seed, device, dtype)
        weights = dummy_weights_identity(seed, dtype, device)
    else:
        with TensorDigests() as digests:
            state = read_safetensors(model_dir, names, device, dtype, digests)
            # fp32 on the host (never rounded to the model's dtype); hashed like every tensor read, so replicas with
            # other scales (other fp8 bytes for the same KV) have other identities.
            scales = read_safetensors(model_dir, set(kv_scale_names(config.attention_layers)), "cpu",
                                      torch.float32, digests)
            weights = digests.hexdigest()
    missing = sorted(names - state.keys())
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}: "
                         "is config.json the checkpoint's own?")
    model.load_state_dict(state, assign=True, strict=True)
    del state  # the fusion below frees each layer's three projections as it goes
    if load_format != "dummy":
        set_kv_scales(model, scales)
    if config.linear is None:
        for layer in model.model.layers:
            layer.self_attn.fuse_qkv()
    return LoadedModel(model.eval().requires_grad_(False), model_fingerprint(config_bytes, weights, model_id))


def kv_scale_names(layers) -> list[str]:
    """The checkpoint tensors that hold an fp8 KV cache's per-tensor scales (as llm-compressor writes them), for the
    full-attention layers `layers`."""
    return [f"model.layers.{i}.self_attn.{which}_scale" for i in layers for which in ("k", "v")]


def set_kv_scales(model: CausalLM | HybridCausalLM, scales: dict[str, torch.Tensor]) -> None:
    """Each attention layer's KVScales from the checkpoint's scalars; 1.0 where it has none (vLLM's default)."""
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer, "self_attn"):  # a linear-attention layer: no K/V
            continue
        k, v = (scales.get(f"model.layers.{i}.self_attn.{which}_scale") for which in ("k", "v"))
        layer.self_attn.kv_scales = KVScales(1.0 if k is None else float(k.reshape(-1)[0]),
                                             1.0 if v is None else float(v.reshape(-1)[0]))


def dummy_weights_identity(seed: int, dtype: torch.dtype, device: torch.device) -> str:
    """Dummy weights are drawn on the target device: the same seed gives other numbers on another kind of generator
    (CPU vs CUDA, and more: kvshare.identity.generator_identity), so the identity names it beside seed and dtype."""
    return f"dummy:seed={seed}/{str(dtype).removeprefix('torch.')}/{generator_identity(torch.device(device))}"
