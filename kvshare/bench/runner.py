"""Runs a benchmark plan end to end: deployment, progress bar, rows, and the report — also when the run fails.

Invariant: whatever happens (a request error, an unreachable endpoint, Ctrl-C, SIGTERM), the deployment is closed,
every measured row stays in requests.jsonl, and a (partial) report is written; the exit code is non-zero unless
the whole plan ran.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvshare.bench import cross_replica, report, sessions
from kvshare.bench.client import BenchError
from kvshare.bench.cross_replica import CrossReplicaConfig
from kvshare.bench.deploy import Deployment, EndpointDeployment, Endpoints, LocalConfig, LocalDeployment
from kvshare.bench.rows import RequestRow, RowWriter, read_rows
from kvshare.bench.sessions import SessionsConfig
from kvshare.bench.workload import Codec
from kvshare.processes import sigterm_as_interrupt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    title: str
    out_dir: Path
    cross: CrossReplicaConfig | None = None
    sessions: SessionsConfig | None = None
    earlier_rows: tuple[RequestRow, ...] = ()  # measured by an earlier run of other blocks; reported with this run's

    @property
    def total_requests(self) -> int:
        return sum(part.total_requests for part in (self.cross, self.sessions) if part)

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt the plan sends (documents + question + answer; sessions' last turn)."""
        c, s = self.cross, self.sessions
        cross = max(n for _, n in c.lengths) + c.question_tokens + c.max_tokens if c else 0
        sessions = max(n for _, n in s.contexts) + s.turns * (s.user_tokens + s.answer_tokens) if s else 0
        return max(cross, sessions)


@dataclass(frozen=True)
class Outcome:
    rows: list[RequestRow]
    cross: cross_replica.CrossReplicaSummary | None
    sessions: sessions.SessionsSummary | None
    info: report.RunInfo
    files: list[Path]

    @property
    def exit_code(self) -> int:
        return 1 if self.info.partial else 0


def run_plan(plan: Plan, make_deployment: Callable[[], Deployment], codec: Codec, command: str,
             quiet: bool = False) -> Outcome:
    """Run every part of `plan`, then write and print the report (partial when something failed)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the progress bar
    started, error, description = time.time(), "", "(not started)"
    writer = RowWriter(plan.out_dir / "requests.jsonl")
    for row in plan.earlier_rows:
        writer.write(row)
    deployment = None
    try:
        with sigterm_as_interrupt(), _progress(plan.total_requests, quiet) as progress:
            progress.note("starting the deployment")
            deployment = make_deployment()
            description = deployment.describe()
            progress.note(f"deployment ready: {description}")
            if plan.cross:
                cross_replica.run_cross_replica(deployment, codec, plan.cross, writer, progress.on_row)
            if plan.sessions:
                sessions.run_sessions(deployment, codec, plan.sessions, writer, progress.on_row)
    except BenchError as failure:
        error = str(failure)
    except KeyboardInterrupt:
        error = "interrupted (Ctrl-C or SIGTERM) before the plan finished"
    finally:
        if deployment is not None:
            deployment.close()
        writer.close()
    return _finish(plan, writer.rows, command, description, started, error, quiet)


def _finish(plan, rows, command, description, started, error, quiet) -> Outcome:
    cross = cross_replica.summarize(rows, plan.cross.lengths, plan.cross.seed) if plan.cross else None
    sess = sessions.summarize(rows, plan.sessions, plan.sessions.seed) if plan.sessions else None
    info = report.RunInfo(plan.title, command, report.machine_description(), description, started, time.time(),
                          error)
    files = report.write_report(plan.out_dir, info, rows, cross, sess)
    if not quiet:
        report.print_summary(info, cross, sess)
        print(f"rows: {plan.out_dir / 'requests.jsonl'}; report: {plan.out_dir / 'report.md'}")
    return Outcome(rows, cross, sess, info, files)


class _progress:
    """Progress over the plan's requests (warm-ups not counted): a rich bar on a terminal; elsewhere (a pipe, a log
    file, CI) one plain line per step and per request, since a bar is not drawn there and minutes of silence look
    like a hang."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet, self.bar, self.task, self.done = total, quiet, None, None, 0

    def __enter__(self) -> "_progress":
        from rich.console import Console

        if not self.quiet and Console().is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn())
            self.bar.start()
            self.task = self.bar.add_task("starting", total=self.total)
        return self

    def note(self, text: str) -> None:
        """A step outside the requests (starting the deployment...)."""
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        elif not self.quiet:
            print(text, flush=True)

    def on_row(self, row: RequestRow) -> None:
        self.done += 1
        what = f"{row.bench} {row.block or row.placement} {row.arm} {row.length_label}"
        ttft = f"TTFT {row.ttft_s:.3f}s" if row.ttft_s is not None else "error"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{what}: {row.kind} {ttft}")
        elif not self.quiet:
            print(f"[{self.done}/{self.total}] {what}: {row.kind} {ttft}", flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()


def deployment_factory(args: argparse.Namespace, out_dir: Path, longest_prompt: int = 0) -> Callable[[], Deployment]:
    """Validate the deployment flags now (clear errors before anything starts); build the deployment later.
    With `longest_prompt`, a local pool too small to share a prompt that long whole is refused too."""
    if args.local and (args.off or args.on):
        raise BenchError("give either --local MODEL_DIR or --off/--on URLs, not both")
    if args.local:
        if not args.local.is_dir():
            raise BenchError(f"model folder {args.local} not found: create one with `kvshare make-model --preset "
                             "small --out DIR`")
        config = LocalConfig(model_dir=args.local, log_dir=out_dir / "logs", threads=args.threads,
                             pool_size=args.pool_size, chunk_tokens=args.chunk_tokens, device=args.device,
                             max_model_len=args.max_model_len,
                             gpus=tuple(g.strip() for g in args.gpus.split(",") if g.strip()),
                             load_format=args.load_format, verify_checksums=not args.no_verify_checksums)
        config.check_pool_holds(longest_prompt)
        return lambda: LocalDeployment(config)
    if not (args.off and args.on):
        raise BenchError("no deployment: pass --local MODEL_DIR, or both --off URLS and --on URLS")
    off, on = parse_endpoints(args.off), parse_endpoints(args.on)
    token = args.router_token_file.read_text().strip() if args.router_token_file else None
    return lambda: EndpointDeployment(off, on, token)


def earlier_rows(paths: list[Path], cross: CrossReplicaConfig) -> tuple[RequestRow, ...]:
    """Rows of earlier runs to report with this one: they must be of other blocks and of this run's lengths (the
    same --seed and --per-block give the same documents; that is the caller's promise)."""
    rows = []
    for path in paths:
        try:
            rows += read_rows(path)
        except (OSError, ValueError) as error:
            raise BenchError(f"cannot read rows from {path}: {error}") from error
    again = sorted({r.block for r in rows if r.block in cross.blocks})
    if again:
        raise BenchError(f"--rows already hold block(s) {', '.join(again)}, which --blocks runs again: run only the "
                         "other blocks")
    foreign = sorted({r.length_label for r in rows if r.length_label and r.length_label not in dict(cross.lengths)})
    if foreign:
        raise BenchError(f"--rows hold lengths {', '.join(foreign)} that --lengths does not name")
    return tuple(rows)


def parse_endpoints(text: str) -> Endpoints:
    """"http://a:8000,http://b:8000" -> replicas A and B; a single URL is a router (it places requests)."""
    urls = tuple(url.strip().rstrip("/") for url in text.split(",") if url.strip())
    if not urls or not all(url.startswith(("http://", "https://")) for url in urls):
        raise BenchError(f"cannot read endpoints {text!r}: give base URLs such as http://127.0.0.1:8001,"
                         "http://127.0.0.1:8002")
    return Endpoints(replicas=(), router=urls[0]) if len(urls) == 1 else Endpoints(replicas=urls)


def load_codec(args: argparse.Namespace) -> Codec:
    folder = args.tokenizer or args.local
    if folder is None:
        raise BenchError("prompts are built with the model's tokenizer: pass --tokenizer MODEL_DIR")
    from kvshare.hf.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(folder)
    except (OSError, ValueError) as error:
        raise BenchError(f"cannot load a tokenizer from {folder}: {error}") from error


def default_out(name: str) -> Path:
    return Path("bench-results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
