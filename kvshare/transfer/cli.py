"""`kvshare validate transfer` and `kvshare bench transfer`: argument parsing and printing only."""

from __future__ import annotations

import json
import sys


def register(cli) -> None:
    validate = cli.command("transfer", "byte-exact store/load through a real pool, with stream races", group="validate")
    validate.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    validate.add_argument("--trials", type=int, default=20, help="trials per ordering mode (>= 20 for the race test)")
    validate.add_argument("--pool", default=None, help="address of a running pool (default: start one)")
    validate.add_argument("--json", default=None, help="write the report here")
    validate.set_defaults(run=_validate)

    bench = cli.command("transfer", "store/load GB/s of a Qwen2.5-32B-shaped KV vs the copy ceiling", group="bench")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--tokens", type=int, default=32768)
    bench.add_argument("--reps", type=int, default=5)
    bench.add_argument("--layers", type=int, default=None, help="default 64 on CUDA, 8 on CPU (to fit in RAM)")
    bench.add_argument("--json", default=None, help="write the results here")
    bench.set_defaults(run=_bench)


def _validate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvshare.transfer.validate import ValidateConfig, run

    if args.device == "cuda" and args.trials < 20:
        print("note: the race test wants --trials >= 20", file=sys.stderr)
    report = run(ValidateConfig(device=args.device, trials=args.trials, pool=args.pool))
    table = Table(title=f"validate transfer ({report.device}, {report.layout})")
    for column in ("ordering", "trials", "store mismatches", "load mismatches", "checksum mismatches", "skip violations"):
        table.add_column(column, justify="right")
    for m in report.modes:
        table.add_row(m.ordering, str(m.trials), str(m.store_mismatches), str(m.load_mismatches),
                      str(m.checksum_mismatches), str(m.skip_violations))
    console = Console()
    console.print(table)
    for note in report.notes:
        console.print(note)
    if report.device == "cuda":
        console.print("expected: 0 mismatches with ordering=stream; mismatches detected with ordering=none (the "
                      "negative control proves the race test can fail)")
    console.print("[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**report.to_dict(), "command": sys.argv}, out, indent=2)
    return 0 if report.passed else 1


def _bench(args) -> int:
    from kvshare.transfer.bench import BenchConfig, print_results, run

    config = BenchConfig(device=args.device, tokens=args.tokens, reps=args.reps, layers=args.layers)
    results = run(config)
    print_results(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**results, "command": sys.argv}, out, indent=2)
    return 0
