"""One timed request turned into one JSONL row: the step every benchmark driver repeats."""

from __future__ import annotations

import dataclasses
import time

import httpx

from kvshare.bench.client import BenchError, StreamResult, completion_body, stream
from kvshare.bench.rows import RequestRow
from kvshare.bench.server_metrics import external_hits


def timed_row(http: httpx.Client, url: str, path: str, body: dict, fields: dict,
              headers: dict[str, str] | None = None) -> tuple[RequestRow, str]:
    """Send one request; return its row and the streamed text. A failure becomes the row's `error`, not an exception.

    A vLLM replica reports no pool hits per request: they are read from its /metrics around the request (outside the
    timed window), and its remaining cached tokens are its own prefix-cache hits."""
    before = external_hits(http, url)  # None: the server reports its hits itself (kvshare serve) or not at all
    try:
        result = stream(http, url, path, body, headers)
    except BenchError as error:
        return RequestRow(**fields, url=url, started_at=time.time(), error=str(error)), ""
    after = external_hits(http, url) if before is not None else None
    if before is not None and after is not None:
        result = _with_external_hits(result, after - before)
    error = "" if result.ttft_s is not None else f"{url}{path} streamed no content token"
    return RequestRow(**fields, url=url, **measurements(result), error=error), result.text


def _with_external_hits(result: StreamResult, external: float) -> StreamResult:
    pool = max(0, int(external))
    return dataclasses.replace(result, pool_hit_tokens=pool, local_hit_tokens=max(0, result.cached_tokens - pool))


def measurements(result: StreamResult) -> dict:
    return dict(
        started_at=result.started_at, ttft_s=result.ttft_s, latency_s=result.latency_s, replica=result.replica,
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens, local_hit_tokens=result.local_hit_tokens,
        pool_hit_tokens=result.pool_hit_tokens,
    )


def warm_up(http: httpx.Client, urls: tuple[str, ...], prompt_ids: list[int], model: str, fields: dict,
            writer) -> None:
    """One short unmeasured request per URL after a deployment switch: the first request pays one-time costs
    (lazy initialisation, first allocations), which must not land in a measured row. Raises BenchError on failure."""
    for url in urls:
        row, _ = timed_row(http, url, "/v1/completions", completion_body(model, prompt_ids, 2),
                           dict(fields, kind="warmup"))
        writer.write(row)
        if row.error:
            raise BenchError(row.error)
