"""Registers every `kvshare bench` command (cross-replica, sessions, pool, transfer, router-overhead, l2) and
`kvshare demo`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvshare.router.cli import POLICY_NAMES


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
                       help="OFF blocks send nothing to replica A (without a pool it cannot help B); "
                            "saves time on GPUs")
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

    register_micro(cli)

    demo = cli.command("demo", "the mechanism at CPU scale in a few minutes: pool, two replicas, router, report")
    demo.add_argument("--preset", choices=("small", "small-hybrid"), default="small",
                      help="the generated model: dense (Llama-style) or hybrid (Qwen3.5-style: 3 of 4 layers Gated "
                           "DeltaNet, whose state the pool shares with each chunk)")
    demo.add_argument("--model-dir", type=Path,
                      help="model folder (default: .models/PRESET, generated with the preset when absent)")
    demo.add_argument("--out", type=Path, help="output folder (default: bench-results/demo-<time>)")
    demo.add_argument("--lengths", default="512,1k")
    demo.add_argument("--per-block", type=int, default=2)
    demo.add_argument("--contexts", default="1k")
    demo.add_argument("--threads", type=int, default=1, help="threads per replica (two replicas run at once)")
    demo.set_defaults(run=_demo)


def register_micro(cli) -> None:
    """The micro-benchmarks: the pool, the transfer layer, the router's overhead."""
    pool_bench = cli.command("pool", "pool vs memcpy vs Redis: store/retrieve GB/s, LOOKUP latency, start-up",
                             group="bench")
    pool_bench.add_argument("--chunks", type=int, default=1024,
                            help="1 MiB chunks to store and retrieve (default 1024)")
    pool_bench.add_argument("--repeats", type=int, default=5, help="timed passes per measurement; the best is reported")
    pool_bench.add_argument("--startup-size", default="4GiB", help="pool size whose start-up time is measured")
    pool_bench.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON")
    pool_bench.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    pool_bench.set_defaults(run=_pool)
    transfer_bench = cli.command("transfer", "store/load GB/s of a Qwen2.5-32B-shaped KV vs the copy ceiling",
                                 group="bench")
    transfer_bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    transfer_bench.add_argument("--tokens", type=int, default=32768)
    transfer_bench.add_argument("--reps", type=int, default=5)
    transfer_bench.add_argument("--layers", type=int, default=None, help="default 64 on CUDA, 8 on CPU (to fit in RAM)")
    transfer_bench.add_argument("--json", default=None, help="write the results here")
    transfer_bench.set_defaults(run=_transfer)
    overhead = cli.command("router-overhead", help="TTFT through the router vs direct, on loopback", group="bench")
    overhead.add_argument("--requests", type=int, default=200, help="requests per arm")
    overhead.add_argument("--first-token-delay-ms", type=float, default=20.0, help="stub replica's time to first token")
    overhead.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                          help="send N token ids as the prompt (a long-context request); 0 sends the text \"hello\"")
    overhead.add_argument("--echo-prompt", action="store_true",
                          help="ask for return_token_ids: the replica's first event carries every prompt id back")
    overhead.add_argument("--policy", choices=POLICY_NAMES, default="round-robin",
                          help="the router's placement policy (cache-aware reads and keys the whole prompt)")
    overhead.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    overhead.set_defaults(run=_router_overhead)
    l2 = cli.command("l2", "L2 tier on loopback Redis: the original and the striped promotion side by side (GB/s, "
                     "CPU per GB), write-behind, next to L1 and the plain Redis client", group="bench")
    l2.add_argument("--chunk-size", default="8MiB", help="bytes per chunk (default 8MiB)")
    l2.add_argument("--chunks", type=int, default=32, help="chunks per pass (default 32)")
    l2.add_argument("--repeats", type=int, default=3, help="timed passes per path, alternating (default 3)")
    l2.add_argument("--connections", type=int, default=4, help="the striped path's connections per node (default 4)")
    l2.add_argument("--cluster", action="store_true", help="also measure a loopback cluster")
    l2.add_argument("--masters", type=int, default=3, help="masters of that cluster (default 3)")
    l2.add_argument("--json", default="", metavar="PATH", help="write the results as JSON")
    l2.add_argument("--md", default="", metavar="PATH", help="write the results as a Markdown table")
    l2.set_defaults(run=_l2)
    decision = cli.command("l2-decision", "the connector's L2 decision on a mix of prompt lengths: replicas with the "
                           "decision on and off against recompute, L2 behind a throttled link", group="bench")
    decision.add_argument("--model-dir", type=Path, required=True, help="model folder of the replicas")
    decision.add_argument("--lengths", default="512,1k,2k,3k,4000", help="prompt lengths (default 512,1k,2k,3k,4000)")
    decision.add_argument("--reps", type=int, default=3, help="fresh documents per length (default 3)")
    decision.add_argument("--l2-rate", default="4MB", help="bytes per second of the link to L2 (default 4MB)")
    decision.add_argument("--promote-timeout", type=float, default=4.0,
                          help="the far pools' --l2-promote-timeout in seconds (default 4)")
    decision.add_argument("--threads", type=int, default=1, help="--threads of every replica (default 1)")
    decision.add_argument("--out", type=Path, required=True, help="output folder (l2-decision.md/.json/.png)")
    decision.set_defaults(run=_l2_decision)


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
    from kvshare.bench.runner import earlier_rows
    from kvshare.bench.workload import parse_lengths

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


def _demo(args: argparse.Namespace) -> int:
    from kvshare.bench import runner
    from kvshare.bench.client import BenchError
    from kvshare.bench.demo import DemoConfig, run_demo

    config = DemoConfig(model_dir=args.model_dir or Path(".models") / args.preset, preset=args.preset,
                        out_dir=args.out or runner.default_out("demo"), lengths=args.lengths,
                        per_block=args.per_block, contexts=args.contexts, threads=args.threads)
    try:
        return run_demo(config, _command()).exit_code
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _command() -> str:
    from kvshare.bench.report import command_line

    return command_line()


def _pool(args: argparse.Namespace) -> int:
    from kvshare.bench.pool import BenchConfig, run_bench

    config = BenchConfig(chunks=args.chunks, repeats=args.repeats, startup_size=args.startup_size,
                         redis=not args.no_redis, command=" ".join(["kvshare", *sys.argv[1:]]))
    return run_bench(config, json_path=args.json)


def _transfer(args) -> int:
    from kvshare.bench.transfer import BenchConfig, print_results, run

    config = BenchConfig(device=args.device, tokens=args.tokens, reps=args.reps, layers=args.layers)
    results = run(config)
    print_results(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**results, "command": sys.argv}, out, indent=2)
    return 0


def _l2(args: argparse.Namespace) -> int:
    from kvshare.bench.l2 import L2BenchConfig, run_bench
    from kvshare.units import parse_size

    config = L2BenchConfig(chunk_bytes=parse_size(args.chunk_size), chunks=args.chunks, repeats=args.repeats,
                           cluster=args.cluster, masters=args.masters, connections=args.connections,
                           command=" ".join(["kvshare", *sys.argv[1:]]))
    return run_bench(config, json_path=args.json, md_path=args.md)


def _l2_decision(args: argparse.Namespace) -> int:
    from kvshare.bench.l2_decision import DecisionBenchConfig, run_bench
    from kvshare.bench.workload import parse_lengths
    from kvshare.units import parse_size

    try:
        config = DecisionBenchConfig(args.model_dir, tuple(n for _, n in parse_lengths(args.lengths)), args.reps,
                                     float(parse_size(args.l2_rate)), args.out, " ".join(["kvshare", *sys.argv[1:]]),
                                     threads=args.threads, promote_timeout=args.promote_timeout)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_bench(config)


def _router_overhead(args: argparse.Namespace) -> int:
    from kvshare.bench.router_overhead import run_overhead_bench
    from kvshare.router.cli import quiet_http_client_logs

    quiet_http_client_logs()
    if args.prompt_tokens < 0 or args.requests < 1:
        raise SystemExit("kvshare bench router-overhead: --requests must be >= 1 and --prompt-tokens >= 0")
    return run_overhead_bench(args.requests, args.first_token_delay_ms, args.json, args.prompt_tokens, args.policy,
                              args.echo_prompt)
