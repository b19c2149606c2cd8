"""`kvshare advise`: from measured rates, per prompt length, whether a pool hit, an L2 hit or a recompute is fastest;
the break-even lengths; the expected gain of a router policy on a session mix. Imports nothing heavy (the handler
does): `kvshare --help` loads this module."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(cli) -> None:
    p = cli.command("advise", "load or recompute: per prompt length the fastest of a pool hit, an L2 hit and a "
                    "recompute, from measured rates; break-even lengths; a router policy's gain on a session mix")
    src = p.add_argument_group("inputs (each measured; see docs/results/advise.md)")
    src.add_argument("--inputs", type=Path, metavar="JSON", help="start from a saved inputs file (advise-inputs.json "
                     "of an earlier run); the flags below override its values")
    src.add_argument("--replica", metavar="URL", help="calibrate prefill against this replica (fresh random prompts, "
                     "one output token) and read its pool load rate from /metrics")
    src.add_argument("--calibrate-lengths", default="256,1k,2k,4k", help="prompt lengths of the calibration "
                     "(default 256,1k,2k,4k)")
    src.add_argument("--calibrate-repeats", type=int, default=3, help="prompts per length; the median counts "
                     "(default 3)")
    src.add_argument("--prefill", metavar="N:SECONDS,...", help="measured prefill times by prompt length instead of "
                     "a calibration, e.g. 8k:1.031,32k:4.932")
    src.add_argument("--model-dir", type=Path, help="model folder: KV bytes per token from its config.json")
    src.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token (overrides --model-dir)")
    src.add_argument("--load-gb-s", type=float, help="pool -> engine load rate, GB/s")
    src.add_argument("--pool", metavar="ADDRESS", help="read the L2 promote rate and the hit rates from this pool's "
                     "STATS")
    src.add_argument("--l2-bench", type=Path, metavar="JSON", help="read the L2 promote rate from a `kvshare bench "
                     "l2` result (its striped path, standalone)")
    src.add_argument("--l2-gb-s", type=float, help="L2 -> pool promote rate, GB/s")
    src.add_argument("--pool-fixed-ms", type=float, help="a pool hit's fixed cost in ms (default 0)")
    src.add_argument("--l2-fixed-ms", type=float, help="an L2 promotion's fixed cost in ms (default 0)")
    src.add_argument("--chunk-tokens", type=int, help="pool chunk size in tokens (default 256)")
    out = p.add_argument_group("what to report")
    out.add_argument("--lengths", default="256,512,1k,2k,4k,8k,16k,32k,64k,128k,256k",
                     help="prompt lengths of the table (default 256 ... 256k)")
    out.add_argument("--max-tokens", default="1m", help="longest prompt the break-even search considers (default 1m)")
    out.add_argument("--sessions", default="", metavar="CONTEXT:TURNS:USER:ANSWER[:WEIGHT],...",
                     help="a session mix for the placement question, e.g. 32k:6:256:32:3,128k:6:256:32:1")
    out.add_argument("--policies", default="alternate,fixed", help="router policies to compare (default both)")
    out.add_argument("--replicas", type=int, default=2, help="replicas the router spreads sessions over (default 2)")
    out.add_argument("--decode-ms-per-token", type=float, default=0.0,
                     help="decode time per answer token, so session gains count the whole session (default 0: TTFTs)")
    out.add_argument("--out", type=Path, help="write advise.md, advise.json, advise-inputs.json and advise.png here")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from kvshare.advise.assemble import AdviseError, gather_inputs, parse_sessions
    from kvshare.advise.report import build, markdown, plot
    from kvshare.bench.workload import parse_lengths

    try:
        inputs = gather_inputs(args)
        sessions = parse_sessions(args.sessions)
        lengths = [n for _, n in parse_lengths(args.lengths)]
        max_tokens = parse_lengths(args.max_tokens)[0][1]
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if any(p not in ("alternate", "fixed") for p in policies):
            raise AdviseError(f"--policies takes alternate and/or fixed, got {args.policies!r}")
        report = build(inputs, lengths, max_tokens, sessions, policies, args.replicas,
                       args.decode_ms_per_token / 1e3, " ".join(["kvshare", *sys.argv[1:]]))
    except (AdviseError, ValueError, OSError) as error:
        print(f"kvshare advise: {error}", file=sys.stderr)
        return 2
    text = markdown(report, "advise.png" if args.out else "")
    print(text)
    if args.out:
        import msgspec

        from kvshare.advise.calibrate import save_inputs

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "advise.md").write_text(text)
        (args.out / "advise.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        save_inputs(inputs, args.out / "advise-inputs.json")
        plot(report, args.out / "advise.png")
    return 0
