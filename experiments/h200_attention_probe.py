"""Where cache-OFF prefill loses to the roofline (issue 8: 1.42-1.50x, target 1.3x): one decoder layer of the
qwen2.5-32b shape timed as the engine runs it (attention vs the token-wise rest), and whole-sequence causal attention
timed per SDPA backend and layout, so the next change is chosen by measurement. One device call of about a minute:

    PYTHONPATH=. python3 experiments/h200_attention_probe.py --lengths 32768,131072 --out $OUT

Parts (--parts, default all): `attention` (backends x layouts), `layers` (attention vs rest in one layer), `prefix`
(a long prompt after a 16-token prefix-cache hit: the engine's square form vs the lower-right mask it used before),
`rest` (the token-wise parts with separate vs fused q/k/v and gate/up weights). Prints a table per part and writes
attention_probe.json. `--preset tiny --device cpu` is a smoke run of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from h200_prefill import layer_flops  # experiments/ is on sys.path when this script runs
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvshare.engine import attention, model
from kvshare.engine.make_model import make_model
from kvshare.engine.model import DecoderLayer, Rotary
from kvshare.hf.config import ModelConfig

MATMUL_PEAK, ATTENTION_PEAK = 719e12, 602e12  # measured on the H200 (../shared/FACTS.md)
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def timed(fn, device: torch.device, repeat: int = 3) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_flops(c: ModelConfig, length: int) -> float:
    return layer_flops(c, length)[1]


def layer_matmul_flops(c: ModelConfig, length: int) -> float:
    return layer_flops(c, length)[0]


def attention_variants(c: ModelConfig, length: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Whole-sequence causal attention three ways, each under each backend (None where the backend refuses)."""
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(length, c.num_heads, c.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(length, c.num_kv_heads, c.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    per_kv = c.num_heads // c.num_kv_heads
    heads_first = q.transpose(0, 1).contiguous()[None]  # (1, H, L, D)
    k_first, v_first = (t.transpose(0, 1).contiguous()[None] for t in (k, v))

    def engine_today():  # attention.prefill_attention's OFF path, on a private copy of q
        out = q.clone()
        total = length
        group = max(1, min(c.num_kv_heads, attention.GROUP_KV_BUDGET // (2 * total * per_kv * c.head_dim * 2)))
        for g0 in range(0, c.num_kv_heads, group):
            g1 = min(c.num_kv_heads, g0 + group)
            qg = out[:, g0 * per_kv : g1 * per_kv].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qg, attention._expand(k[:, g0:g1], per_kv),
                                               attention._expand(v[:, g0:g1], per_kv), is_causal=True)
            out[:, g0 * per_kv : g1 * per_kv] = o[0].transpose(0, 1)

    variants = {
        "engine today (per group, q strided, K/V expanded)": engine_today,
        "all heads, contiguous, enable_gqa": lambda: F.scaled_dot_product_attention(
            heads_first, k_first, v_first, is_causal=True, enable_gqa=True),
        "all heads, contiguous, K/V expanded": lambda: F.scaled_dot_product_attention(
            heads_first, k_first.repeat_interleave(per_kv, 1), v_first.repeat_interleave(per_kv, 1), is_causal=True),
    }
    rows = []
    for name, fn in variants.items():
        for backend, choice in BACKENDS.items():
            if device.type != "cuda" and choice is not None:
                continue
            try:
                with sdpa_kernel([choice]) if choice is not None else nullcontext():
                    seconds = timed(fn, device)
            except RuntimeError as error:  # the backend refuses this layout
                rows.append(dict(length=length, variant=name, backend=backend, seconds=None, error=str(error)[:200]))
                continue
            rows.append(dict(length=length, variant=name, backend=backend, seconds=seconds,
                             tflops=attention_flops(c, length) / seconds / 1e12))
    return rows


def layer_breakdown(c: ModelConfig, length: int, device: torch.device, dtype: torch.dtype, chunk: int) -> dict:
    """One engine decoder layer's prefill over `length` tokens: total, attention (as the engine calls it), rest."""
    with torch.device(device):
        layer = DecoderLayer(c).to(dtype)
    for name, p in layer.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
    block = 16
    cache = torch.zeros((length + block - 1) // block, 2, block, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
    table = torch.arange(cache.shape[0], device=device)
    cos, sin = Rotary(c, device, dtype).tables(torch.arange(length, device=device))
    h = torch.randn(length, c.hidden_size, device=device, dtype=dtype) * 0.02
    spent = []
    original = model.prefill_attention

    def timed_attention(*args, **kwargs):
        sync(device)
        start = time.perf_counter()
        original(*args, **kwargs)
        sync(device)
        spent.append(time.perf_counter() - start)

    model.prefill_attention = timed_attention
    try:
        with torch.inference_mode():
            total = timed(lambda: layer.prefill(h.clone(), cache, table, 0, cos, sin, chunk), device)
    finally:
        model.prefill_attention = original
    attn = sorted(spent[1:])[len(spent[1:]) // 2]
    rest = total - attn
    return dict(length=length, layer_s=total, attention_s=attn, rest_s=rest,
                attention_tflops=attention_flops(c, length) / attn / 1e12,
                rest_tflops=layer_matmul_flops(c, length) / rest / 1e12,
                layer_x_roofline=total / (attention_flops(c, length) / ATTENTION_PEAK
                                          + layer_matmul_flops(c, length) / MATMUL_PEAK))


def prefix_hit_variants(c: ModelConfig, length: int, device: torch.device, dtype: torch.dtype,
                        start: int = 16) -> list[dict]:
    """Attention of a (length - start)-token prompt after `start` cached tokens, the two ways the engine could run
    it."""
    block, t = 16, length - start
    gen = torch.Generator(device).manual_seed(0)
    cache = torch.randn((length + block - 1) // block, 2, block, c.num_kv_heads, c.head_dim, device=device,
                        dtype=dtype, generator=gen)
    table = torch.arange(cache.shape[0], device=device)
    q = torch.randn(t, c.num_heads, c.head_dim, device=device, dtype=dtype, generator=gen)
    scale = c.head_dim**-0.5

    def lower_right():  # the form prefill_attention used for any cached context before the square form
        # One group of all KV heads, as GROUP_KV_BUDGET allowed for unexpanded K/V up to 256k tokens.
        k, v = attention.gather_kv(cache, table, length, slice(0, c.num_kv_heads))
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=attention.causal_lower_right(t, length), scale=scale, enable_gqa=True)

    flops = layer_flops(c, t, start)[1]
    rows = []
    for name, fn in {"engine (square form)": lambda: attention.prefill_attention(q.clone(), cache, table, start, scale),
                     "lower-right mask (before)": lower_right}.items():
        seconds = timed(fn, device)
        rows.append(dict(length=length, start=start, variant=name, seconds=seconds, tflops=flops / seconds / 1e12,
                         model_seconds=seconds * c.num_layers))
    return rows


def rest_variants(c: ModelConfig, length: int, device: torch.device, dtype: torch.dtype, chunk: int) -> list[dict]:
    """The token-wise parts of one layer (norms, projections, rope, MLP) over `length` tokens in `chunk`-token
    pieces, with the engine's separate weights and with q/k/v and gate/up each fused into one matmul."""
    with torch.device(device):
        layer = DecoderLayer(c).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) if attn.q_proj.bias is not None else None
    gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    cos, sin = Rotary(c, device, dtype).tables(torch.arange(chunk, device=device))
    h = torch.randn(length, c.hidden_size, device=device, dtype=dtype) * 0.02
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def separate():
        for s in range(0, length, chunk):
            x = h[s : s + chunk]
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            x = x + attn.o_proj(q.view(len(x), -1))
            x + mlp(layer.post_attention_layernorm(x))

    def fused():
        for s in range(0, length, chunk):
            x = h[s : s + chunk]
            qkv = F.linear(layer.input_layernorm(x), qkv_w, qkv_b)
            q = model._rope(qkv[:, :nq].view(len(x), c.num_heads, c.head_dim), cos, sin)
            model._rope(qkv[:, nq : nq + nkv].view(len(x), c.num_kv_heads, c.head_dim), cos, sin)
            x = x + attn.o_proj(q.view(len(x), -1))
            gate, up = F.linear(layer.post_attention_layernorm(x), gate_up_w).chunk(2, dim=-1)
            x + mlp.down_proj(F.silu(gate) * up)

    flops = layer_matmul_flops(c, length)
    rows = []
    with torch.inference_mode():
        for name, fn in {"separate weights (engine)": separate, "fused qkv, fused gate/up": fused}.items():
            seconds = timed(fn, device)
            rows.append(dict(length=length, chunk=chunk, variant=name, seconds=seconds, tflops=flops / seconds / 1e12))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--preset", default="qwen2.5-32b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--parts", default="attention,layers,prefix,rest")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/attention_probe")))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    device, dtype = torch.device(args.device), torch.bfloat16
    config = ModelConfig.from_hf(json.loads((make_model(args.preset, Path(tempfile.mkdtemp()) / "m") / "config.json")
                                            .read_text()))
    lengths = [int(x) for x in args.lengths.split(",")]
    attention_rows = [row for n in lengths for row in attention_variants(config, n, device, dtype)] \
        if "attention" in parts else []
    layers = [layer_breakdown(config, n, device, dtype, args.prefill_chunk) for n in lengths] \
        if "layers" in parts else []
    prefix = [row for n in lengths for row in prefix_hit_variants(config, n, device, dtype)] \
        if "prefix" in parts else []
    rest = [row for n in lengths for row in rest_variants(config, n, device, dtype, args.prefill_chunk)] \
        if "rest" in parts else []
    print(f"{'tokens':>7} {'variant':<50} {'backend':>8} {'ms':>9} {'TFLOP/s':>8}")
    for r in attention_rows:
        ms = f"{r['seconds'] * 1e3:9.2f}" if r["seconds"] else "  refused"
        print(f"{r['length']:>7} {r['variant']:<50} {r['backend']:>8} {ms} {r.get('tflops', 0):8.0f}")
    print(f"\n{'tokens':>7} {'layer ms':>9} {'attn ms':>8} {'attn TF/s':>9} {'rest ms':>8} {'rest TF/s':>9} "
          f"{'x roofline':>10}")
    for r in layers:
        print(f"{r['length']:>7} {r['layer_s'] * 1e3:9.1f} {r['attention_s'] * 1e3:8.1f} {r['attention_tflops']:9.0f} "
              f"{r['rest_s'] * 1e3:8.1f} {r['rest_tflops']:9.0f} {r['layer_x_roofline']:10.2f}")
    print(f"\n{'tokens':>7} {'cached':>6} {'prefix-hit attention, one layer':<32} {'ms':>8} {'TFLOP/s':>8} "
          f"{'x layers s':>10}")
    for r in prefix:
        print(f"{r['length']:>7} {r['start']:>6} {r['variant']:<32} {r['seconds'] * 1e3:8.2f} {r['tflops']:8.0f} "
              f"{r['model_seconds']:10.2f}")
    print(f"\n{'tokens':>7} {'chunk':>6} {'token-wise rest, one layer':<32} {'ms':>8} {'TFLOP/s':>8}")
    for r in rest:
        print(f"{r['length']:>7} {r['chunk']:>6} {r['variant']:<32} {r['seconds'] * 1e3:8.2f} {r['tflops']:8.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (args.out / "attention_probe.json").write_text(json.dumps(
        dict(device=device_name, torch=torch.__version__, attention=attention_rows, layers=layers, prefix=prefix,
             rest=rest), indent=2))


if __name__ == "__main__":
    main()
