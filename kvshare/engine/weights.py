"""Model weights: safetensors shards from a Hugging Face folder, or seeded dummy weights; and the model fingerprint.

Dummy weights: each tensor is drawn from its own generator seeded with xxh3(seed, tensor name), directly on the
target device and dtype, so every replica (and every process) built with the same seed holds identical weights
without reading a checkpoint. Norm weights are ones; everything else N(0, 0.02).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from kvshare.engine.config import ModelConfig
from kvshare.engine.model import CausalLM
from kvshare.keys import fingerprint

DUMMY_STD = 0.02


def shard_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: use --load-format dummy for random weights")
    return files


def dummy_tensor(name: str, shape: torch.Size, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    generator = torch.Generator(device=device)
    generator.manual_seed(xxhash.xxh3_64_intdigest(f"{seed}/{name}".encode()) & (2**63 - 1))
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, DUMMY_STD, generator=generator)


def dummy_state_dict(config: ModelConfig, seed: int, device, dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights for every parameter of the model (names as in Hugging Face checkpoints)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    return {name: dummy_tensor(name, shape, seed, torch.device(device), dtype) for name, shape in shapes.items()}


def read_safetensors(model_dir: Path, names: set[str], device, dtype) -> dict[str, torch.Tensor]:
    """The tensors named `names` from the folder's shards, cast to dtype on device; other tensors are skipped."""
    state = {}
    for path in shard_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in names:
                    state[name] = f.get_tensor(name).to(dtype)
    return state


def load_model(model_dir: str | Path, load_format: str, device, dtype, seed: int = 0) -> CausalLM:
    """Build the model of `model_dir`'s config.json with real ("auto") or dummy weights, in eval mode."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    names = {name for name, _ in model.named_parameters()}
    if load_format == "dummy":
        state = dummy_state_dict(config, seed, device, dtype)
    else:
        state = read_safetensors(model_dir, names, device, dtype)
    missing = sorted(names - state.keys())
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}: "
                         "is config.json the checkpoint's own?")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets): what identifies it without hashing
    gigabytes of weights."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length)


def model_fingerprint(model_dir: str | Path, load_format: str, seed: int = 0) -> str:
    """xxh3 identity of the weights a replica runs: config.json + load format + (dummy: seed; else each shard's name,
    size and header). Replicas share KV only when fingerprints match."""
    model_dir = Path(model_dir)
    config_bytes = (model_dir / "config.json").read_bytes()
    json.loads(config_bytes)  # a clear error for a broken config before it becomes a fingerprint
    if load_format == "dummy":
        return fingerprint(config_bytes, "dummy", str(seed))
    parts: list[bytes | str] = [config_bytes, "auto"]
    for path in shard_files(model_dir):
        parts += [path.name, str(path.stat().st_size), safetensors_header(path)]
    return fingerprint(*parts)
