"""Pool hits of servers that do not report them per request (vLLM): the change of vLLM's external prefix-cache
counter on the replica's /metrics across one request.

kvshare serve reports its local and pool hits in each response (the `kvshare` object). vLLM reports only
`usage.prompt_tokens_details.cached_tokens` (with `--enable-prompt-tokens-details`), which adds its own prefix-cache
hits and the tokens its KV connector loaded. The connector's share is the delta of the Prometheus counter
`vllm:external_prefix_cache_hits_total` around the request.

Invariant: the delta belongs to the request only when nothing else runs on that replica meanwhile; the harness
sends one request at a time, and a benchmark must not share its replicas with other traffic. The counter is
recorded with the step that scheduled the prefill, which vLLM logs before it processes the next step's output, so
it is final once a stream of two or more tokens has ended.
"""

from __future__ import annotations

import httpx

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
SCRAPE_TIMEOUT_S = 10.0


def external_hits(http: httpx.Client, base_url: str) -> float | None:
    """vLLM's external (KV connector) prefix-cache hits so far, summed over label sets; None when the server does not
    export the counter (kvshare serve, a router, a server without /metrics), so callers fall back to what it reports."""
    try:
        response = http.get(f"{base_url}/metrics", timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = [_value(line) for line in response.text.splitlines() if _is_sample(line)]
    return sum(values) if values else None


def _is_sample(line: str) -> bool:
    return line.startswith(EXTERNAL_HITS + "{") or line.startswith(EXTERNAL_HITS + " ")


def _value(line: str) -> float:
    # A sample is `name{labels} value` (no timestamp from prometheus-client); label values never hold a space here.
    return float(line.rsplit(" ", 1)[1])
