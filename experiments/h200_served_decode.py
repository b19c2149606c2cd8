"""Issue 19, item 3: decode time per token of a served replica, measured through the HTTP stream, side by side in
one run: CUDA graphs + the paged kernel (the default), the paged kernel eager (--enforce-eager), and the gathered
path eager (--attention-backend torch, what the replica did before). One replica at a time on one GPU (the 32B
model fits once), each started as a user would start it:

    PYTHONPATH=/tmp/site:. python3 experiments/h200_served_decode.py --out $OUT --contexts 256,32768

For each arm and context: `--prompts` fresh random prompts (token ids), each streamed with max_tokens=--tokens and
ignore_eos; ms per token = the gaps between streamed tokens after the first (median and p90 over every gap of the
arm's prompts); TTFT too. Writes served_decode.json (every gap) and prints a table. CPU smoke run of the plumbing:
    python experiments/h200_served_decode.py --preset tiny --device cpu --dtype float32 --contexts 64 --tokens 8 \
        --arms eager-torch --out /tmp/sd
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvshare.processes import ManagedProcess, NotReady, free_port, kvshare_argv, wait_http_ready

ARMS = {  # name -> extra `kvshare serve` flags
    "graphs": [],
    "eager-triton": ["--enforce-eager"],
    "eager-torch": ["--enforce-eager", "--attention-backend", "torch"],
}


def start_server(args, arm: str, out: Path, deadline: float) -> tuple[ManagedProcess, str, float]:
    """`kvshare serve` for the arm, as a user starts it; (process, url, seconds until /health answered 200)."""
    port = free_port()
    argv = kvshare_argv("serve", "--model", args.model, "--load-format", "dummy", "--device", args.device,
                        "--dtype", args.dtype, "--port", str(port), "--max-model-len", str(args.max_model_len),
                        "--max-num-seqs", str(args.max_num_seqs), *ARMS[arm])
    started = time.perf_counter()
    proc = ManagedProcess(f"serve-{arm}", argv, out / f"server-{arm}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, max(1.0, deadline - time.time()))
    except NotReady:
        proc.stop()
        raise
    return proc, url, time.perf_counter() - started


def stream(client, model: str, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """(TTFT, gaps between streamed tokens in ms) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    stamps, started = [], time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    gaps = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - started, gaps


def run_arm(args, arm: str, out: Path, deadline: float) -> list[dict]:
    import httpx

    proc, url, ready = start_server(args, arm, out, deadline)
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            rng = random.Random(7)

            def stream_one(n):
                return stream(client, model, [rng.randrange(3, args.vocab) for _ in range(n)], args.tokens)

            stream_one(128)  # warm-up: first request of the replica
            for context in args.contexts:
                for i in range(args.prompts):
                    if time.time() > deadline:
                        return rows
                    ttft, gaps = stream_one(context)
                    rows.append(dict(arm=arm, context=context, prompt=i, ready_s=ready, ttft_s=ttft, gaps_ms=gaps))
                    print(f"  {arm} ctx {context} prompt {i}: ttft {ttft:.3f} s, "
                          f"{statistics.median(gaps):.1f} ms/token", flush=True)
    finally:
        proc.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-32b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="256,32768")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "out/served_decode"))
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    deadline = time.time() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvshare.engine.make_model import PRESETS, make_model

    args.model = str(make_model(args.preset, Path(tempfile.mkdtemp()) / args.preset))
    args.vocab = PRESETS[args.preset].vocab_size
    rows = []
    for arm in args.arms.split(","):
        rows += run_arm(args, arm, out, deadline)
        (out / "served_decode.json").write_text(json.dumps(dict(argv=sys.argv, rows=rows), indent=1))
    print(f"{'arm':<14}{'context':>9}{'ms/token p50':>14}{'p90':>8}{'TTFT s':>9}{'ready s':>9}")
    for arm in args.arms.split(","):
        for context in args.contexts:
            mine = [r for r in rows if r["arm"] == arm and r["context"] == context]
            if not mine:
                continue
            gaps = sorted(g for r in mine for g in r["gaps_ms"])
            p90 = gaps[int(0.9 * (len(gaps) - 1))]
            print(f"{arm:<14}{context:>9}{statistics.median(gaps):>14.1f}{p90:>8.1f}"
                  f"{statistics.median(r['ttft_s'] for r in mine):>9.3f}{mine[0]['ready_s']:>9.1f}")


if __name__ == "__main__":
    main()
