"""One timed request turned into one JSONL row: the step every benchmark driver repeats."""

from __future__ import annotations

import time

import httpx

from kvshare.bench.client import BenchError, StreamResult, completion_body, stream
from kvshare.bench.rows import RequestRow


def timed_row(http: httpx.Client, url: str, path: str, body: dict, fields: dict,
              headers: dict[str, str] | None = None) -> tuple[RequestRow, str]:
    """Send one request; return its row and the streamed text. A failure becomes the row's `error`, not an exception."""
    try:
        result = stream(http, url, path, body, headers)
    except BenchError as error:
        return RequestRow(**fields, url=url, started_at=time.time(), error=str(error)), ""
    error = "" if result.ttft_s is not None else f"{url}{path} streamed no content token"
    return RequestRow(**fields, url=url, **measurements(result), error=error), result.text


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
