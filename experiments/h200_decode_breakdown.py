"""Issue 19, item 3: where a decode step's time goes, in process on one H200 (32B dummy engine, CUDA graphs on):

    PYTHONPATH=/tmp/site:. python3 experiments/h200_decode_breakdown.py --out $OUT/breakdown.json

For each context (a fresh prompt prefilled first): the batch-1 graph's replay alone (GPU time, CUDA events, 20
replays), ModelRunner.decode (inputs written + replay + logits copied, synchronised), and the engine's token gaps
(64 streamed tokens through the engine's callbacks, no HTTP). Then the matrix products of one layer alone at batch 1
(GPU time, 64 layers' worth): q, k, v, o, gate, up, down, and the fused q|k|v and gate|up a fused model would run,
with the bandwidth each reaches (bytes of its weight / time; k and v, 10 MB, stay in the 50 MB L2 across repeats,
so theirs reads high).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def events_ms(fn, repeats=20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    import torch

    from kvshare.engine.api import GenerationRequest, SamplingParams
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.make_model import make_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="256,32768")
    parser.add_argument("--preset", default="qwen2.5-32b")
    args = parser.parse_args()
    model = make_model(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    engine = Engine(EngineConfig(model=str(model), load_format="dummy", device="cuda", dtype="bfloat16",
                                 max_model_len=40960, max_num_seqs=8))
    runner, result = engine.runner, {"rows": [], "gemv": []}
    graphs = runner.graphs
    vocab = engine.model_config.vocab_size
    for i, context in enumerate(int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(i)).tolist()
        stamps = []
        request = GenerationRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=64, ignore_eos=True))
        started = time.perf_counter()
        done = []

        def on_event(event, stamps=stamps, done=done):
            if event.token_id is not None:
                stamps.append(time.perf_counter())
            if event.finished:
                done.append(event)

        engine.submit(request, on_event)
        while not done:
            time.sleep(0.001)
        gaps = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        seq_table = list(range(-(-context // 16) + 8))  # a table long enough; replay reads what _fill writes
        graphs._fill([(5, context + 1, seq_table)], 1)
        replay_ms = events_ms(graphs.graphs[1].replay)

        def runner_step(context=context, seq_table=seq_table, graphs=graphs):
            graphs.run([5], [context + 1], [seq_table])
            torch.cuda.synchronize()

        runner_ms = events_ms(runner_step)
        row = dict(context=context, ttft_s=stamps[0] - started, engine_gap_ms=statistics.median(gaps),
                   engine_gap_p90_ms=sorted(gaps)[int(0.9 * (len(gaps) - 1))], replay_ms=replay_ms,
                   runner_step_ms=runner_ms)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    layer = engine.runner.model.model.layers[0]
    x = torch.randn(1, engine.model_config.hidden_size, device="cuda", dtype=torch.bfloat16)
    attn, mlp = layer.self_attn, layer.mlp
    weights = {"q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight,
               "o": attn.o_proj.weight, "gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight,
               "down": mlp.down_proj.weight}
    weights["qkv fused"] = torch.cat([weights["q"], weights["k"], weights["v"]])
    weights["gate|up fused"] = torch.cat([weights["gate"], weights["up"]])
    total = 0.0
    for name, w in weights.items():
        inp = x if w.shape[1] == x.shape[1] else torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
        ms = events_ms(lambda w=w, inp=inp: torch.nn.functional.linear(inp, w), repeats=50)
        if "fused" not in name:
            total += ms
        row = dict(name=name, shape=list(w.shape), ms_64_layers=64 * ms, tb_s=w.numel() * 2 / ms / 1e9)
        result["gemv"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(dict(unfused_sum_ms_64_layers=64 * total)), flush=True)
    result["unfused_sum_ms_64_layers"] = 64 * total
    Path(args.out).write_text(json.dumps(result, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
