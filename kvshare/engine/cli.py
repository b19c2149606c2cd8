"""`kvshare make-model`: a generated model folder (config, random weights, tokenizer)."""

from __future__ import annotations

import argparse


def register(cli) -> None:
    make = cli.command("make-model", "write a generated model folder (config, random weights, tokenizer)")
    # As kvshare.engine.make_model.PRESETS (not imported here: it needs torch); "-hybrid" and qwen3.5-27b are
    # Qwen3.5-style hybrids (3 of 4 layers Gated DeltaNet); the 32b and 27b shapes are config only (dummy weights).
    make.add_argument("--preset", required=True,
                      choices=("tiny", "small", "qwen2.5-32b", "tiny-hybrid", "small-hybrid", "qwen3.5-27b"))
    make.add_argument("--out", required=True, help="folder to write")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    from kvshare.engine.make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} model to {out}")
    return 0
