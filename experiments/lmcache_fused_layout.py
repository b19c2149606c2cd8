"""What LMCache 0.5.3 moves for vLLM 0.26's fused K/V page on CUDA (issue 32 item 4): why every LMCache hit on the
H200 changed the answer (docs/results/h200-vllm/gpu/session13), and which LMCache setting moves the right bytes.

vLLM 0.26's CUDA attention (flash_attn.py) hands a connector each layer as a view of logical shape
[blocks, kv heads, block tokens, 2 x head size] (K and V packed in the last axis) whose NHD strides put tokens
before heads. This script builds such layers on the CPU and runs LMCache's own Python code on them: its format
detection (`normalize_kv_and_discover_format`, with the CUDA branch of its vLLM detector), the layer geometry its
GPU connectors pass to the kernel, and the memory-object shapes its cache engine allocates (`LMCacheMetadata
.get_shapes`) for the default connector (V2) and for `use_gpu_connector_v3: true` (V3, before and after its layer
groups exist). LMCache's CUDA kernel cannot run here, so its addressing for this format is written out from the
0.5.3 sources (csrc/mem_kernels.cu: `multi_layer_kv_transfer_templated` runs one pass, grid z = 1, for a fused
format; `page_buffer_offset` puts token slot s at s x W elements of the layer, W = the memory object's last axis;
token t of a chunk is that object's [0, layer, t, :]). Each setting then stores a prompt from replica A's blocks and
loads it into other blocks, as replica B's would be, and the check compares B's K/V with A's, byte for byte.
What it does not model: V3 builds its layer groups at its first transfer, after the cache engine has allocated that
store's chunks in V2's shape; on a GPU that first store stopped vLLM's engine (docs/results/h200-vllm/lmcache-layout).

    .venv-vllm-0.26/bin/python experiments/lmcache_fused_layout.py --out docs/results/h200-vllm/lmcache-layout
(needs `pip install --no-deps lmcache==0.5.3 aiofile caio sortedcontainers aiofiles` in that venv; a few seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# The Qwen2.5-32B shape of the H200 runs, fewer layers and blocks (the addressing is per layer and per block).
LAYERS, HEADS, HEAD, BLOCK, CHUNK = 4, 8, 128, 16, 256


def vllm_layers(blocks: int, seed: int) -> list[torch.Tensor]:
    """vLLM 0.26's CUDA layers under NHD: storage [blocks, tokens, heads, 2 x head], the logical view permuted to
    [blocks, heads, tokens, 2 x head] (get_kv_cache_shape, then get_kv_cache_stride_order (0, 2, 1, 3))."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-2**15, 2**15, (blocks, BLOCK, HEADS, 2 * HEAD), generator=g, dtype=torch.int16)
            .view(torch.bfloat16).permute(0, 2, 1, 3) for _ in range(LAYERS)]


def lmcache_geometry(layers: list[torch.Tensor]) -> dict:
    """What LMCache's own code makes of the layers on CUDA: the format, the geometry its V2 connector passes to the
    kernel, and the chunk shapes its cache engine allocates under V2 and under V3."""
    import lmcache.v1.gpu_connector.kv_format.detectors.vllm as detector
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector import utils as gpu_utils
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager
    from lmcache.v1.metadata import LMCacheMetadata

    detector.torch_device_type = "cuda"  # the detector forces HND on a CPU device; this is the H200's branch
    hints = {"kv_layout": "NHD"}  # try_get_vllm_kv_cache_layout() under vLLM 0.26 on CUDA (its default layout)
    fmt, normalized = gpu_utils.normalize_kv_and_discover_format(layers, EngineType.VLLM, hints)
    # vllm/utils.py: kv_shape = (layers, 2, chunk, model's KV heads, model's head size)
    metadata = LMCacheMetadata(model_name="qwen2.5-32b-shape", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD), chunk_size=CHUNK)
    v2_shape = metadata.get_shapes(CHUNK)[0]
    per_layer, formats = gpu_utils.normalize_and_discover_per_layer_formats(layers, [], EngineType.VLLM, hints)
    metadata.kv_layer_groups_manager = KVLayerGroupsManager(per_layer, engine_kv_formats=formats)
    v3_shape = metadata.get_shapes(CHUNK)[0]
    return {"format": getattr(fmt, "name", str(fmt)), "normalized_shape": list(normalized[0].shape),
            "block_size": gpu_utils.get_block_size(normalized, fmt),
            "head_size": gpu_utils.get_head_size(normalized, fmt),
            "num_blocks": gpu_utils.get_num_blocks(normalized, fmt),
            "shapes": {"V2": list(v2_shape), "V3": list(v3_shape)}}


def transfer(layers: list[torch.Tensor], chunk: torch.Tensor, slots: torch.Tensor, to_page: bool) -> None:
    """LMCache's kernel for a fused format, one pass: token t of the chunk is chunk[0, layer, t, :] (width W), at
    slot s it is the layer's elements [s x W, (s + 1) x W)."""
    width = chunk.shape[3]
    for i, layer in enumerate(layers):
        flat = layer.permute(0, 2, 1, 3).reshape(-1)  # the storage's own order (a view: the permute undoes vLLM's)
        where = (slots[:, None] * width + torch.arange(width)).reshape(-1)
        if to_page:
            flat[where] = chunk[0, i].reshape(-1)
        else:
            chunk[0, i] = flat[where].view(len(slots), width)


def token_kv(layers: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Each token's K/V (all layers, all heads) read through vLLM's logical view: [tokens, layers, heads, 2 x head]."""
    return torch.stack([layer[slots // BLOCK, :, slots % BLOCK] for layer in layers], dim=1)


def check(shape: list[int], tokens: int, blocks: int) -> dict:
    """Replica A computed `tokens` tokens into blocks 0..; LMCache stores them chunk by chunk into memory objects of
    `shape`, and replica B loads them into a fresh cache where the prompt has other blocks (reversed, offset)."""
    a, b = vllm_layers(blocks, 1), vllm_layers(blocks, 2)
    used = tokens // BLOCK
    slots_a = torch.arange(tokens)
    b_blocks = torch.arange(blocks - 1, blocks - 1 - used, -1)  # B's blocks for the prompt, in prompt order
    slots_b = (b_blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    before_b = [layer.clone() for layer in b]
    for start in range(0, tokens, CHUNK):
        chunk = torch.zeros([shape[0], shape[1], CHUNK, shape[3]], dtype=torch.bfloat16)
        transfer(a, chunk, slots_a[start:start + CHUNK], to_page=False)
        transfer(b, chunk, slots_b[start:start + CHUNK], to_page=True)
    want, got = token_kv(a, slots_a).view(torch.int16), token_kv(b, slots_b).view(torch.int16)
    exact = (want == got).flatten(1).all(dim=1)
    others = torch.ones(blocks, dtype=torch.bool)
    others[b_blocks] = False  # blocks that hold other requests' K/V in B
    changed_elsewhere = sum(int((layer[others].view(torch.int16) != old[others].view(torch.int16)).sum())
                            for layer, old in zip(b, before_b))  # as bits: random bf16 holds NaNs
    token_bytes = LAYERS * HEADS * 2 * HEAD * 2
    moved = LAYERS * shape[3] * 2
    return {"tokens": tokens, "tokens_exact": int(exact.sum()), "bytes_moved_per_token": moved,
            "kv_bytes_per_token": token_bytes, "chunk_bytes_per_token": shape[0] * LAYERS * shape[3] * 2,
            "elements_changed_outside_the_prompt": changed_elsewhere}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens, a multiple of 256 (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=256, help="KV blocks of 16 tokens per replica (default: "
                   "%(default)s)")
    p.add_argument("--out", type=Path, help="folder for result.json (default: print only)")
    args = p.parse_args()
    if args.tokens % CHUNK or args.tokens // BLOCK * 2 > args.blocks:
        sys.exit(f"--tokens must be a multiple of {CHUNK} and fit half of --blocks x {BLOCK}")
    import lmcache

    geometry = lmcache_geometry(vllm_layers(args.blocks, 0))
    rows = {name: check(shape, args.tokens, args.blocks) for name, shape in geometry["shapes"].items()}
    version = getattr(lmcache, "__version__", "")
    print(f"LMCache {version} on vLLM 0.26's CUDA page: "
          f"format {geometry['format']}, block size {geometry['block_size']}, head size {geometry['head_size']}")
    print(f"{'setting':16} {'chunk shape':22} {'B tokens exact':>15} {'moved B/token':>14} {'K/V B/token':>12}"
          f" {'chunk B/token':>14} {'elements changed in other blocks':>33}")
    for name, row in rows.items():
        print(f"{name:16} {str(geometry['shapes'][name]):22} {row['tokens_exact']:>7} of {row['tokens']:<5}"
              f" {row['bytes_moved_per_token']:>14} {row['kv_bytes_per_token']:>12} {row['chunk_bytes_per_token']:>14}"
              f" {row['elements_changed_outside_the_prompt']:>33}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"lmcache": version, "torch": torch.__version__,
                  "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_size": HEAD, "block": BLOCK, "chunk": CHUNK},
                  "geometry": geometry, "rows": rows,
                  "command": "python experiments/lmcache_fused_layout.py " + " ".join(sys.argv[1:])}
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
