"""Cross-replica TTFT in an OFF-ON-ON-OFF block design: replica A computes a fresh document (and, ON, stores it in
the pool); the measured request sends the same document with a new question to replica B.

Invariants:
- Every measured request uses a document no earlier request has sent (seeded by a run-unique stream id), so B can
  only have it from the pool, never from its own prefix cache.
- The prompt is token ids (`/v1/completions`), so its length is exact: document (the input length) + question.
- Rows are written as they are measured; on an error the run stops and the caller still reports what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import httpx

from kvshare.bench import stats
from kvshare.bench.client import BenchError, completion_body, model_info, new_http_client
from kvshare.bench.deploy import Deployment
from kvshare.bench.measure import timed_row, warm_up
from kvshare.bench.rows import RequestRow, RowWriter, measured
from kvshare.bench.workload import BLOCKS, Codec, PlannedRequest, block_schedule, document_ids

WARMUP_STREAM = 1 << 30  # stream ids of warm-up prompts, far from the measured requests' ids


@dataclass(frozen=True)
class CrossReplicaConfig:
    lengths: tuple[tuple[str, int], ...]
    per_block: int = 4
    question_tokens: int = 32
    max_tokens: int = 8
    seed: int = 0
    off_warm: bool = True  # False: skip A's request in OFF blocks (without a pool it cannot reach B)
    # Which of the four blocks this run measures. A design too long for one sitting (255k on a GPU host whose calls
    # end after 10 minutes) runs as OFF1,ON1 and then ON2,OFF2 with the same seed: the schedule, and so every
    # document, is the same in both runs, and the second run's report takes the first run's rows (--rows).
    blocks: tuple[str, ...] = tuple(name for name, _ in BLOCKS)

    def __post_init__(self):
        unknown = [b for b in self.blocks if b not in dict(BLOCKS)]
        if unknown or not self.blocks:
            raise ValueError(f"unknown block(s) {', '.join(unknown) or '(none given)'}: choose from "
                             f"{', '.join(dict(BLOCKS))}")

    @property
    def total_requests(self) -> int:
        """HTTP requests this run sends (warm + measured), for the progress bar."""
        arms = [arm for name, arm in BLOCKS if name in self.blocks]
        return (len(arms) + sum(map(self.warms, arms))) * len(self.lengths) * self.per_block

    def warms(self, arm: str) -> bool:
        """Whether replica A serves the document before B in this arm (always when ON: that is what B loads)."""
        return arm == "ON" or self.off_warm


@dataclass(frozen=True)
class LengthResult:
    """One input length: OFF vs ON over all blocks, each block's median and the paired block comparison."""

    label: str
    tokens: int
    comparison: stats.Comparison
    block_medians: dict[str, float]
    block_counts: dict[str, int]
    pairs: list[stats.BlockPair]
    on_pool_hit_tokens: float  # median pool hits of measured ON requests: the mechanism at work
    off_cached_tokens: float  # median cached tokens of measured OFF requests (should be 0: fresh documents)


@dataclass(frozen=True)
class CrossReplicaSummary:
    lengths: list[LengthResult] = field(default_factory=list)
    measured_requests: int = 0


def run_cross_replica(
    deployment: Deployment, codec: Codec, config: CrossReplicaConfig, writer: RowWriter,
    on_row: Callable[[RequestRow], None] = lambda row: None,
) -> None:
    """Run the four blocks. Raises BenchError (after writing the failed request's row) when a request fails."""
    with new_http_client() as http:
        run = _Run(http, codec, config, writer, on_row)
        for block in block_schedule(list(config.lengths), config.per_block, config.seed):
            if block[0].block not in config.blocks:
                continue
            endpoints = deployment.activate(block[0].arm)
            if len(endpoints.replicas) < 2:
                raise BenchError("cross-replica needs two replica URLs per arm (--off A,B --on A,B), not a router")
            info = model_info(http, endpoints.replicas[0])
            _check_lengths(config, info.max_model_len)
            run.warm_up(endpoints.replicas, info.name, block[0])
            for planned in block:
                run.pair(endpoints.replicas, info.name, planned, deployment.settle)


@dataclass
class _Run:
    http: httpx.Client
    codec: Codec
    config: CrossReplicaConfig
    writer: RowWriter
    on_row: Callable[[RequestRow], None]

    def pair(self, replicas: tuple[str, ...], model: str, planned: PlannedRequest, settle: Callable[[], None]) -> None:
        """Warm request on replica A (computes; stores when ON), then the measured one on replica B. In OFF blocks
        A's request can be skipped (off_warm=False): with no pool it reaches nothing B reads, so it only costs time
        (two minutes a request at 256k on an H200)."""
        c = self.config
        document = document_ids(self.codec, planned.length, c.seed, planned.stream)
        warm_q, measured_q = (document_ids(self.codec, c.question_tokens, c.seed, planned.stream, i) for i in (1, 2))
        if c.warms(planned.arm):
            self.send(replicas[0], model, document + warm_q, c.max_tokens, "warm", planned)
            settle()  # A's stores are committed after its last byte: B must find the whole document (untimed)
        self.send(replicas[-1], model, document + measured_q, c.max_tokens, "measured", planned)

    def warm_up(self, replicas: tuple[str, ...], model: str, first: PlannedRequest) -> None:
        prompt = document_ids(self.codec, 64, self.config.seed, WARMUP_STREAM + first.stream)
        warm_up(self.http, replicas, prompt, model, dict(bench="cross-replica", arm=first.arm, block=first.block),
                self.writer)

    def send(self, url: str, model: str, prompt_ids: list[int], max_tokens: int, kind: str,
             planned: PlannedRequest) -> None:
        row, _ = timed_row(
            self.http, url, "/v1/completions", completion_body(model, prompt_ids, max_tokens),
            dict(bench="cross-replica", kind=kind, arm=planned.arm, block=planned.block,
                 length_label=planned.length_label, length=planned.length, index=planned.index),
        )
        self.writer.write(row)
        self.on_row(row)
        if row.error:
            raise BenchError(row.error)


def _check_lengths(config: CrossReplicaConfig, max_model_len: int | None) -> None:
    if max_model_len is None:
        return
    for label, tokens in config.lengths:
        needed = tokens + config.question_tokens + config.max_tokens
        if needed > max_model_len:
            raise BenchError(
                f"length {label} needs {needed} tokens (document {tokens} + question {config.question_tokens} + "
                f"answer {config.max_tokens}) but the model's limit is {max_model_len}: use shorter --lengths or "
                "serve with a larger --max-model-len"
            )


def summarize(rows: list[RequestRow], lengths: tuple[tuple[str, int], ...], seed: int = 0) -> CrossReplicaSummary:
    results = []
    done = measured(rows, "measured")
    for label, tokens in lengths:
        of_length = [r for r in done if r.length_label == label]
        by_block = {b: [r.ttft_s for r in of_length if r.block == b] for b, _ in BLOCKS}
        off = [r.ttft_s for r in of_length if r.arm == "OFF"]
        on = [r.ttft_s for r in of_length if r.arm == "ON"]
        results.append(LengthResult(
            label=label, tokens=tokens, comparison=stats.compare(off, on, seed),
            block_medians={b: stats.median(v) for b, v in by_block.items()},
            block_counts={b: len(v) for b, v in by_block.items()},
            pairs=stats.block_pairs(by_block),
            on_pool_hit_tokens=stats.median([r.pool_hit_tokens for r in of_length if r.arm == "ON"]),
            off_cached_tokens=stats.median([r.cached_tokens for r in of_length if r.arm == "OFF"]),
        ))
    return CrossReplicaSummary(lengths=results, measured_requests=len(done))
