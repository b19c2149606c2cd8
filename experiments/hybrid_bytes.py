"""Bytes a pool hit moves per prompt length: the Qwen3.5-27B hybrid shape (K/V of its 16 full-attention layers plus one
linear-attention state) against the dense qwen2.5-32b shape, with the PCIe transfer floor of each (docs/results).

    .venv/bin/python experiments/hybrid_bytes.py --out docs/results/hybrid-bytes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvshare.engine.make_model import PRESETS, hf_config
from kvshare.hf.config import ModelConfig
from kvshare.transfer.state import StateLayout

PCIE_GBPS = 55.2  # pinned host->device on the H200 host (FACTS.md)
LENGTHS = (32 * 1024, 128 * 1024, 256 * 1024)
KV_BYTES = {"bf16": 2, "fp8": 1}


def shape(preset: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(PRESETS[preset], 0, 1))


def rows() -> list[dict]:
    dense, hybrid = shape("qwen2.5-32b"), shape("qwen3.5-27b")
    state = StateLayout.of_model(hybrid, torch.float32, torch.bfloat16).nbytes  # fp32 recurrent, bf16 conv
    out = []
    for kv_dtype, itemsize in KV_BYTES.items():
        per_token = {name: len(m.attention_layers) * 2 * m.num_kv_heads * m.head_dim * itemsize
                     for name, m in (("dense", dense), ("hybrid", hybrid))}
        for n in LENGTHS:
            dense_bytes, hybrid_bytes = n * per_token["dense"], n * per_token["hybrid"] + state
            out.append({"tokens": n, "kv_dtype": kv_dtype, "dense_kv_bytes_per_token": per_token["dense"],
                        "hybrid_kv_bytes_per_token": per_token["hybrid"], "hybrid_state_bytes": state,
                        "dense_bytes": dense_bytes, "hybrid_bytes": hybrid_bytes,
                        "ratio": hybrid_bytes / dense_bytes,
                        "dense_floor_s": dense_bytes / PCIE_GBPS / 1e9,
                        "hybrid_floor_s": hybrid_bytes / PCIE_GBPS / 1e9})
    return out


def stored(chunk_sizes=(256, 784, 1024, 2048, 4096), tokens: int = 128 * 1024) -> list[dict]:
    """What the pool holds for one prompt of `tokens` (bf16 K/V): every chunk carries a state, so the chunk size
    trades the states' footprint against how finely a shared prefix can end."""
    hybrid = shape("qwen3.5-27b")
    state = StateLayout.of_model(hybrid, torch.float32, torch.bfloat16).nbytes
    kv = tokens * len(hybrid.attention_layers) * 2 * hybrid.num_kv_heads * hybrid.head_dim * 2
    return [{"chunk_tokens": c, "tokens": tokens, "kv_bytes": kv, "state_bytes": tokens // c * state,
             "total_bytes": kv + tokens // c * state} for c in chunk_sizes]


def table(data: list[dict]) -> str:
    lines = ["| tokens | KV dtype | dense 32B: bytes (floor) | hybrid 27B: K/V + state (floor) | hybrid / dense |",
             "| --- | --- | --- | --- | --- |"]
    for r in data:
        lines.append(f"| {r['tokens'] // 1024}k | {r['kv_dtype']} | {r['dense_bytes'] / 2**30:.2f} GiB "
                     f"({r['dense_floor_s']:.3f} s) | {(r['hybrid_bytes'] - r['hybrid_state_bytes']) / 2**30:.2f} GiB"
                     f" + {r['hybrid_state_bytes'] / 2**20:.1f} MiB ({r['hybrid_floor_s']:.3f} s) | {r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def stored_table(data: list[dict]) -> str:
    lines = ["| chunk tokens | K/V stored | states stored | pool bytes for one 128k prompt |",
             "| --- | --- | --- | --- |"]
    for r in data:
        lines.append(f"| {r['chunk_tokens']} | {r['kv_bytes'] / 2**30:.1f} GiB | {r['state_bytes'] / 2**30:.1f} GiB | "
                     f"{r['total_bytes'] / 2**30:.1f} GiB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data, footprint = rows(), stored()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"loads": data, "stored": footprint}, indent=1) + "\n")
    text = table(data) + "\n" + stored_table(footprint)
    (args.out / "table.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
