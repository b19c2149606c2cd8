"""`kvshare make-model`: a generated model folder (config, random weights, tokenizer)."""

from __future__ import annotations

import argparse


def register(cli) -> None:
    make = cli.command("make-model", "write a generated model folder (config, random weights, tokenizer)")
    make.add_argument("--preset", choices=("tiny", "small", "qwen2.5-32b"), required=True)
    make.add_argument("--out", required=True, help="folder to write")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    from kvshare.engine.make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} model to {out}")
    return 0
