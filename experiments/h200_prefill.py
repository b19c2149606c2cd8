"""Prefill speed of the reference engine on one H200: qwen2.5-32b shape, dummy bf16 weights, one prefill each of
8k/32k/128k/256k tokens plus a local prefix-cache hit; TTFT vs the 790 TFLOP/s bf16 roofline. Writes JSON to $OUT.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=. python experiments/h200_prefill.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from kvshare.engine.api import GenerationRequest, SamplingParams, TokenEvent
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
from kvshare.engine.make_model import make_model
from kvshare.hf.config import ModelConfig

ROOFLINE = 790e12


def layer_flops(c: ModelConfig, tokens: int, context: int = 0) -> tuple[float, float]:
    """(projection + MLP, attention) matmul FLOPs of one layer prefilling `tokens` new tokens after `context` cached
    ones (causal attention counted half)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    dense = 2 * tokens * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    attention = 4 * c.num_heads * c.head_dim * (tokens * context + tokens * tokens / 2)
    return dense, attention


def prefill_flops(c: ModelConfig, tokens: int, context: int = 0) -> float:
    """Matmul FLOPs of the whole model prefilling `tokens` new tokens after `context` cached ones."""
    return c.num_layers * sum(layer_flops(c, tokens, context))


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, TokenEvent]:
    """Seconds from submit to the first token (sampling reads the logits back, so the device work is done)."""
    first, finished = [], []
    start = time.perf_counter()

    def on_event(event: TokenEvent) -> None:
        if event.token_id is not None and not first:
            first.append(time.perf_counter() - start)
        if event.finished:
            finished.append(event)

    engine.submit(GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=1, ignore_eos=True)), on_event)
    deadline = time.monotonic() + 1200
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
    if not finished or finished[0].finish_reason == "error":
        raise RuntimeError(f"request {rid} failed: {finished[0].error if finished else 'timeout'}")
    return first[0], finished[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="8192,32768,131072,261120")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--preset", default="qwen2.5-32b", help="make-model preset (tiny: a CPU smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=262144)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    model_dir = make_model(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    config = EngineConfig(model=str(model_dir), load_format="dummy", device=args.device, dtype="bfloat16",
                          max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk)
    t0 = time.perf_counter()
    engine = Engine(config)
    load_s = time.perf_counter() - t0
    mc = engine.model_config
    gen = torch.Generator().manual_seed(0)
    rows = []
    vocab = min(mc.vocab_size, 150000)
    ttft(engine, "warmup", torch.randint(0, vocab, (2048,), generator=gen).tolist())
    prompts = {}
    for length in (int(x) for x in args.lengths.split(",")):
        prompts[length] = torch.randint(0, vocab, (length,), generator=gen).tolist()
        seconds, event = ttft(engine, f"p{length}", prompts[length])
        rows.append(dict(run="cold", tokens=length, ttft_s=seconds, flops=prefill_flops(mc, length),
                         cached=event.usage.cached_tokens, peak_gib=peak_gib()))
        # Print as we go: a run cut off by the device's time limit still reports the lengths it finished.
        print(f"cold {length} tokens: TTFT {seconds:.3f} s, {rows[-1]['flops'] / seconds / 1e12:.0f} TFLOP/s, "
              f"peak {peak_gib():.1f} GiB", flush=True)
    last = max(prompts)
    seconds, event = ttft(engine, "hit", prompts[last])  # the same prompt again: a local prefix-cache hit
    hit = event.usage.local_hit_tokens
    rows.append(dict(run="local-hit", tokens=last, ttft_s=seconds, flops=prefill_flops(mc, last - hit, hit),
                     cached=hit, peak_gib=peak_gib()))
    for row in rows:
        row["tflops"] = row["flops"] / row["ttft_s"] / 1e12
        row["roofline_s"] = row["flops"] / ROOFLINE
        row["x_roofline"] = row["ttft_s"] / row["roofline_s"] if row["roofline_s"] else None
    result = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                  torch=torch.__version__, load_s=load_s, num_blocks=engine.num_blocks, block_size=engine.block_size,
                  prefill_chunk=args.prefill_chunk, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_prefill.json").write_text(json.dumps(result, indent=2))
    print(f"{result['device']}  torch {result['torch']}  load {load_s:.1f} s  KV blocks {engine.num_blocks}")
    print(f"{'run':>10} {'tokens':>8} {'cached':>8} {'TTFT s':>9} {'TFLOP/s':>8} {'roofline s':>11} {'x roof':>7} "
          f"{'peak GiB':>9}")
    for r in rows:
        print(f"{r['run']:>10} {r['tokens']:>8} {r['cached']:>8} {r['ttft_s']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['roofline_s']:>11.3f} {r['x_roofline']:>7.2f} {r['peak_gib']:>9.1f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
