"""`kvshare validate service`: greedy answers through the service with the pool OFF and ON must be equal (I6).

Each prompt is sent cross-replica as in the benchmark (replica A first, then the same document with another question
to replica B), so the ON answer on B is computed from KV loaded from the pool, and compared with the OFF answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from kvshare.bench.client import BenchError, completion_body, model_info, new_http_client
from kvshare.bench.deploy import Deployment
from kvshare.bench.measure import timed_row
from kvshare.bench.rows import RowWriter
from kvshare.bench.workload import Codec, document_ids


@dataclass(frozen=True)
class ServiceConfig:
    prompts: int = 4
    length: int = 600  # document tokens: two full 256-token chunks plus a partial one
    max_tokens: int = 24
    seed: int = 0


@dataclass(frozen=True)
class ServiceCheck:
    index: int
    equal: bool
    pool_hit_tokens: int  # of the ON answer: > 0 means the pool really served it
    off_text: str
    on_text: str


@dataclass(frozen=True)
class ServiceVerdict:
    checks: list[ServiceCheck]
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(c.equal for c in self.checks) and self.pool_exercised

    @property
    def pool_exercised(self) -> bool:
        return any(c.pool_hit_tokens > 0 for c in self.checks)


def validate_service(make_deployment: Callable[[], Deployment], codec: Codec, config: ServiceConfig,
                     out_dir: Path) -> ServiceVerdict:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    answers: dict[str, list[tuple[str, int]]] = {"OFF": [], "ON": []}
    error, deployment = "", None
    try:
        with RowWriter(out_dir / "requests.jsonl") as writer, new_http_client() as http:
            deployment = make_deployment()
            for arm in ("OFF", "ON"):
                answers[arm] = _answers(http, deployment, arm, codec, config, writer)
    except BenchError as failure:
        error = str(failure)
    finally:
        if deployment is not None:
            deployment.close()
    checks = [ServiceCheck(i, off[0] == on[0], on[1], off[0], on[0])
              for i, (off, on) in enumerate(zip(answers["OFF"], answers["ON"]))]
    verdict = ServiceVerdict(checks, error)
    (out_dir / "service.json").write_bytes(msgspec.json.format(msgspec.json.encode(verdict)) + b"\n")
    return verdict


def _answers(http, deployment: Deployment, arm: str, codec: Codec, config: ServiceConfig, writer: RowWriter):
    endpoints = deployment.activate(arm)
    if len(endpoints.replicas) < 2:
        raise BenchError("validate service needs two replica URLs per arm (--off A,B --on A,B)")
    model = model_info(http, endpoints.replicas[0]).name
    answers = []
    for i in range(config.prompts):
        document = document_ids(codec, config.length, config.seed, i)
        for kind, url, q in (("warm", endpoints.replicas[0], 1), ("check", endpoints.replicas[1], 2)):
            prompt = document + document_ids(codec, 16, config.seed, i, q)
            row, text = timed_row(http, url, "/v1/completions", completion_body(model, prompt, config.max_tokens),
                                  dict(bench="service", kind=kind, arm=arm, index=i, length=config.length))
            writer.write(row)
            if row.error:
                raise BenchError(row.error)
        answers.append((text, row.pool_hit_tokens))
    return answers


def print_verdict(verdict: ServiceVerdict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="validate service: greedy answers, cache OFF vs ON (cross-replica)")
    for column in ("prompt", "equal", "ON pool hit tokens", "OFF answer (start)"):
        table.add_column(column)
    for c in verdict.checks:
        table.add_row(str(c.index), "yes" if c.equal else "[red]NO[/]", str(c.pool_hit_tokens), repr(c.off_text[:40]))
    console = Console()
    console.print(table)
    if verdict.error:
        console.print(f"[bold red]error:[/] {verdict.error}")
    elif not verdict.pool_exercised:
        console.print("[bold red]the ON arm loaded nothing from the pool: the check did not exercise the pool[/]")
    console.print("[bold green]PASS[/]" if verdict.passed else "[bold red]FAIL[/]")
