"""What vLLM 0.26's frontend spends on a long prompt's first output token: its `FastIncrementalDetokenizer` primes
the tokenizers library's `DecodeStream` with every prompt id, and the stream's first `step` decodes that whole
prefix (later steps do not). Timed here alone, for the runner's own prompts (experiments/vllm_cross_replica.py:
seed 0, the same random ids) with a model folder's tokenizer, ids drawn below each `--vocab`. Run it with the
interpreter of a vLLM venv (its tokenizers release is the one vLLM uses).

    .venv-vllm-0.26/bin/python experiments/vllm_first_token_decode.py --tokenizer models/q32tok/tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import tokenizers
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def first_step_ms(tokenizer: Tokenizer, ids: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        stream = DecodeStream(ids=ids, skip_special_tokens=True)  # as vLLM 0.26 builds it (sampling's default)
        started = time.perf_counter()
        stream.step(tokenizer, 5)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--vocab", default="1024,32000", help="comma-separated upper bounds of the prompt ids")
    parser.add_argument("--reps", type=int, default=4, help="prompts per bound (the runner's reps 0..N-1)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rep in range(args.reps):
            rng = random.Random(f"0-{args.length}-{rep}")  # vllm_cross_replica.cell_prompt with --seed 0
            ids = [rng.randrange(3, vocab) for _ in range(args.length)]
            rows.append({"vocab": vocab, "rep": rep, "first_step_ms": round(first_step_ms(tokenizer, ids,
                                                                                          args.repeats), 1)})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"tokenizers": tokenizers.__version__, "length": args.length, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
