"""Registers `kvshare bench cross-replica`, `kvshare bench sessions`, `kvshare validate service` and `kvshare demo`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(cli) -> None:
    cross = cli.command("cross-replica", "cross-replica TTFT by input length, blocks OFF-ON-ON-OFF", group="bench")
    _deployment_flags(cross)
    cross.add_argument("--lengths", default="1k,2k,4k", help="document lengths in tokens, e.g. 8k,32k,128k,256k")
    cross.add_argument("--per-block", type=int, default=4, help="measured requests per length in each block")
    cross.add_argument("--question-tokens", type=int, default=32, help="tokens of the question after the document")
    cross.add_argument("--max-tokens", type=int, default=8, help="answer tokens per request")
    cross.add_argument("--blocks", default="OFF1,ON1,ON2,OFF2",
                       help="blocks to run now, e.g. OFF1,ON1 in one sitting and ON2,OFF2 (same --seed) in the next")
    cross.add_argument("--rows", type=Path, action="append", default=[], metavar="JSONL",
                       help="requests.jsonl of an earlier run of the other blocks: copied into this run's rows and "
                            "report (repeatable)")
    cross.add_argument("--skip-off-warm", action="store_true",
                       help="OFF blocks send nothing to replica A (without a pool it cannot help B); saves time on GPUs")
    cross.set_defaults(run=_cross_replica)

    sess = cli.command("sessions", "six-turn sessions: alternate vs fixed placement, pool OFF vs ON", group="bench")
    _deployment_flags(sess)
    sess.add_argument("--contexts", default="2k,4k", help="initial context lengths, e.g. 32k,128k on a GPU")
    sess.add_argument("--turns", type=int, default=6)
    sess.add_argument("--user-tokens", type=int, default=256, help="tokens of each later user message")
    sess.add_argument("--answer-tokens", type=int, default=32, help="tokens of each answer")
    sess.add_argument("--sessions", type=int, default=1, help="sessions per (arm, placement, context)")
    sess.add_argument("--placements", default="alternate,fixed")
    sess.set_defaults(run=_sessions)

    service = cli.command("service", "greedy answers with the pool OFF and ON (cross-replica) must be equal",
                          group="validate")
    _deployment_flags(service)
    service.add_argument("--prompts", type=int, default=4)
    service.add_argument("--length", type=int, default=600, help="document tokens of each prompt")
    service.add_argument("--max-tokens", type=int, default=24)
    service.set_defaults(run=_service)

    demo = cli.command("demo", "the mechanism at CPU scale in a few minutes: pool, two replicas, router, report")
    demo.add_argument("--model-dir", type=Path, default=Path(".models/small"),
                      help="model folder (generated with the small preset when absent)")
    demo.add_argument("--out", type=Path, help="output folder (default: bench-results/demo-<time>)")
    demo.add_argument("--lengths", default="512,1k")
    demo.add_argument("--per-block", type=int, default=2)
    demo.add_argument("--contexts", default="1k")
    demo.add_argument("--threads", type=int, default=1, help="threads per replica (two replicas run at once)")
    demo.set_defaults(run=_demo)


def _deployment_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("deployment (give --local, or --off and --on)")
    target.add_argument("--local", type=Path, metavar="MODEL_DIR",
                        help="start a pool and two `kvshare serve` replicas of this model here (and stop them after)")
    target.add_argument("--off", metavar="URLS", help="cache-OFF endpoints: replica A,B base URLs (or one router URL)")
    target.add_argument("--on", metavar="URLS", help="cache-ON endpoints: replica A,B base URLs (or one router URL)")
    target.add_argument("--router-token-file", type=Path, metavar="FILE",
                        help="the admin token of a router among --off/--on (its --admin-token-file): the sessions "
                             "benchmark switches its placement policy")
    target.add_argument("--tokenizer", type=Path, metavar="DIR",
                        help="model folder whose tokenizer builds the prompts (default: --local's)")
    target.add_argument("--threads", type=int, default=1, help="--threads of each local replica, same in both arms")
    target.add_argument("--pool-size", default="2GiB", help="local pool size (ON arm)")
    target.add_argument("--chunk-tokens", type=int, default=256, help="pool chunk size of local replicas")
    target.add_argument("--device", default="cpu", help="device of local replicas: cpu or cuda")
    target.add_argument("--max-model-len", type=int, help="--max-model-len of local replicas")
    target.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES of local replicas A,B, e.g. 0,1")
    target.add_argument("--load-format", default="", help="--load-format of local replicas (e.g. dummy)")
    target.add_argument("--no-verify-checksums", action="store_true",
                        help="local replicas skip hashing loaded chunks (say so when you report the figures)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the documents, orders and bootstrap")
    parser.add_argument("--out", type=Path, help="output folder (default: bench-results/<command>-<time>)")


def _cross_replica(args: argparse.Namespace) -> int:
    from kvshare.bench.cross_replica import CrossReplicaConfig
    from kvshare.bench.workload import parse_lengths

    from kvshare.bench.runner import earlier_rows

    def parts():
        cross = CrossReplicaConfig(
            lengths=tuple(parse_lengths(args.lengths)), per_block=args.per_block, question_tokens=args.question_tokens,
            max_tokens=args.max_tokens, seed=args.seed, off_warm=not args.skip_off_warm,
            blocks=tuple(b.strip() for b in args.blocks.split(",") if b.strip()))
        return dict(cross=cross, earlier_rows=earlier_rows(args.rows, cross))

    return _run_plan(args, "cross-replica", parts)


def _sessions(args: argparse.Namespace) -> int:
    from kvshare.bench.sessions import SessionsConfig
    from kvshare.bench.workload import parse_lengths

    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    return _run_plan(args, "sessions", lambda: dict(sessions=SessionsConfig(
        contexts=tuple(parse_lengths(args.contexts)), turns=args.turns, user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens, sessions=args.sessions, placements=placements, seed=args.seed)))


def _run_plan(args, name: str, parts) -> int:
    from kvshare.bench import runner
    from kvshare.bench.client import BenchError

    out = args.out or runner.default_out(name)
    try:
        plan = runner.Plan(title=f"kvshare bench {name}", out_dir=out, **parts())
        factory = runner.deployment_factory(args, out, plan.longest_prompt)
        codec = runner.load_codec(args)
    except (BenchError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return runner.run_plan(plan, factory, codec, _command()).exit_code


def _service(args: argparse.Namespace) -> int:
    from kvshare.bench import runner
    from kvshare.bench.client import BenchError
    from kvshare.bench.service import ServiceConfig, print_verdict, validate_service

    out = args.out or runner.default_out("validate-service")
    try:
        factory = runner.deployment_factory(args, out)
        codec = runner.load_codec(args)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    config = ServiceConfig(prompts=args.prompts, length=args.length, max_tokens=args.max_tokens, seed=args.seed)
    verdict = validate_service(factory, codec, config, out)
    print_verdict(verdict)
    return 0 if verdict.passed else 1


def _demo(args: argparse.Namespace) -> int:
    from kvshare.bench import runner
    from kvshare.bench.client import BenchError
    from kvshare.bench.demo import DemoConfig, run_demo

    config = DemoConfig(model_dir=args.model_dir, out_dir=args.out or runner.default_out("demo"), lengths=args.lengths,
                        per_block=args.per_block, contexts=args.contexts, threads=args.threads)
    try:
        return run_demo(config, _command()).exit_code
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _command() -> str:
    from kvshare.bench.report import command_line

    return command_line()
