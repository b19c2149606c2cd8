"""The per-request JSONL row every benchmark writes, and the writer that flushes each row as soon as it is measured."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import msgspec


class RequestRow(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One HTTP request of a benchmark. `ttft_s` is None when no content arrived (then `error` says why).

    kind: "warmup" (first request after a deployment starts, not analysed), "warm" (replica A computes and stores),
    "measured" (the cross-replica request on replica B), "turn" (one turn of a session), "check" (validate service).
    """

    bench: str
    kind: str
    arm: str  # "OFF" | "ON"
    url: str
    started_at: float  # Unix time when the request was sent
    block: str = ""  # "OFF1", "ON1", "ON2", "OFF2"
    length_label: str = ""  # "1k", "32k", ...
    length: int = 0  # document / initial-context tokens
    prompt_tokens: int = 0  # as the server counted them (usage)
    completion_tokens: int = 0
    cached_tokens: int = 0
    local_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    replica: str = ""  # X-KVShare-Replica when a router served it, else the replica URL
    ttft_s: float | None = None
    latency_s: float | None = None
    session: str = ""
    turn: int = 0
    placement: str = ""
    index: int = 0  # position of the request in its block or session set
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None


class RowWriter:
    """Appends rows to a JSONL file, flushing each one so that a crash or Ctrl-C keeps every measured row."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("wb")  # one file per run: a rerun into the same folder starts afresh
        self.rows: list[RequestRow] = []

    def write(self, row: RequestRow) -> None:
        self._file.write(msgspec.json.encode(row) + b"\n")
        self._file.flush()
        self.rows.append(row)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_rows(path: Path) -> list[RequestRow]:
    decoder = msgspec.json.Decoder(RequestRow)
    return [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


def measured(rows: Iterable[RequestRow], kind: str) -> list[RequestRow]:
    """Rows of `kind` that succeeded."""
    return [row for row in rows if row.kind == kind and row.ok]
