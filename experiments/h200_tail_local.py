"""Issue 19, item 2: what a short tail after a long cached prefix costs without any pool, on one H200 (32B dummy
engine, the paged kernel and fused kernels on): prefill a document, then ask the same document plus `--question`
new tokens (a local prefix hit: the same tail a pool hit computes), timed, then once more under torch's profiler.

    PYTHONPATH=/tmp/site:.:experiments python3 experiments/h200_tail_local.py --length 131072 --out $OUT/local.json

(dry run on a CPU: --preset tiny --device cpu --dtype float32 --length 512)

Prints the hit's TTFT (median of --reps), the profiled request's wall time, the summed GPU time of its kernels and
the kernels that take most of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from h200_cross_replica import document, first_token


def main() -> None:
    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.make_model import make_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--question", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--preset", default="qwen2.5-32b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model = make_model(args.preset, Path(tempfile.mkdtemp()) / "m")
    engine = Engine(EngineConfig(model=str(model), load_format="dummy", device=args.device, dtype=args.dtype,
                                 max_model_len=args.length + 4096, kv_cache_dtype=args.kv_cache_dtype))
    vocab = engine.model_config.vocab_size
    doc = document(args.length, 1, vocab)
    cold, _ = first_token(engine, "cold", doc + document(args.question, 2, vocab))
    hits = [first_token(engine, f"hit{i}", doc + document(args.question, 10 + i, vocab))[0] for i in range(args.reps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        profiled, _ = first_token(engine, "profiled", doc + document(args.question, 99, vocab))
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    top = [dict(name=e.key[:90], ms=e.self_device_time_total / 1e3, calls=e.count) for e in kernels[:14]]
    result = dict(length=args.length, question=args.question, kv=args.kv_cache_dtype, cold_ttft_s=cold,
                  hit_ttft_s=hits, hit_median_s=statistics.median(hits), profiled_wall_s=profiled,
                  profiled_gpu_ms=gpu_ms, top_kernels=top)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"cold {cold:.2f} s; local hit TTFT {statistics.median(hits):.3f} s {[round(h, 3) for h in hits]}; "
          f"profiled {profiled:.3f} s wall, {gpu_ms:.1f} ms of GPU kernels")
    for row in top:
        print(f"  {row['ms']:8.2f} ms {row['calls']:6d}x  {row['name']}")
    engine.shutdown()


if __name__ == "__main__":
    main()
