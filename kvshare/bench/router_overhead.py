"""`kvshare bench router-overhead`: time to first token through the router vs straight to the replica, on loopback.

One stub replica (fixed time to first token) and one router in front of it run as separate processes. Requests go
in pairs, one direct and one routed, the order alternating pair by pair (ABBA), so drift on a shared machine hits
both arms alike; each arm uses its own keep-alive connection. TTFT is measured at the client: request sent to the
first SSE `data:` line received. The overhead is the median of the per-pair differences (routed - direct).
The prompt is the text "hello", or with --prompt-tokens N a list of N token ids (a long-context request: the router
reads and keys every id before it forwards the body); with --echo-prompt the request asks for `return_token_ids`, and
the stub's first event carries every prompt id back, as vLLM's does.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from kvshare.router.local import router, stub_replica

BUDGET_MS = 5.0  # issue 5: routed TTFT within 5 ms of direct on loopback
WARMUP = 20


@dataclass(frozen=True)
class Spread:
    median_ms: float
    p10_ms: float
    p90_ms: float
    iqr_ms: float
    min_ms: float
    max_ms: float

    @staticmethod
    def of(values_ms: list[float]) -> "Spread":
        v = np.asarray(values_ms)
        p10, p25, p50, p75, p90 = np.percentile(v, [10, 25, 50, 75, 90])
        return Spread(*(round(float(x), 3) for x in (p50, p10, p90, p75 - p25, v.min(), v.max())))


def request_body(prompt_tokens: int, echo_prompt: bool = False) -> bytes:
    """The completions request both arms send: "hello", or `prompt_tokens` ids (fixed, so every request is alike)."""
    prompt = [(7919 * i) % 150_000 for i in range(prompt_tokens)] if prompt_tokens else "hello"
    echo = {"return_token_ids": True} if echo_prompt else {}
    return json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True, **echo}).encode()


def ttft_ms(client: httpx.Client, url: str, body: bytes) -> float:
    started = time.perf_counter()
    headers = {"content-type": "application/json"}
    with client.stream("POST", f"{url}/v1/completions", content=body, headers=headers) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        elapsed = (time.perf_counter() - started) * 1000
        for _ in lines:  # drain, so the connection is reused for the next request
            pass
    return elapsed


def measure(direct_url: str, routed_url: str, requests: int, body: bytes) -> dict:
    with httpx.Client(timeout=60) as direct, httpx.Client(timeout=60) as routed:
        for _ in range(WARMUP):
            ttft_ms(direct, direct_url, body), ttft_ms(routed, routed_url, body)
        direct_ms, routed_ms = [], []
        for i in range(requests):
            if i % 2 == 0:
                direct_ms.append(ttft_ms(direct, direct_url, body))
                routed_ms.append(ttft_ms(routed, routed_url, body))
            else:
                routed_ms.append(ttft_ms(routed, routed_url, body))
                direct_ms.append(ttft_ms(direct, direct_url, body))
    overhead = [r - d for r, d in zip(routed_ms, direct_ms)]
    return {
        "direct": asdict(Spread.of(direct_ms)),
        "routed": asdict(Spread.of(routed_ms)),
        "overhead": asdict(Spread.of(overhead)),
        "within_budget": bool(np.median(overhead) < BUDGET_MS),
        "samples_ms": {"direct": [round(x, 3) for x in direct_ms], "routed": [round(x, 3) for x in routed_ms]},
    }


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def table(result: dict) -> str:
    rows = ["| arm | median ms | p10 | p90 | IQR | min | max |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm in ("direct", "routed", "overhead"):
        s = result[arm]
        rows.append(f"| {arm} | {s['median_ms']:.2f} | {s['p10_ms']:.2f} | {s['p90_ms']:.2f} | {s['iqr_ms']:.2f} "
                    f"| {s['min_ms']:.2f} | {s['max_ms']:.2f} |")
    return "\n".join(rows)


def run_overhead_bench(requests: int, first_token_delay_ms: float, json_path: str | None,
                       prompt_tokens: int = 0, policy: str = "round-robin", echo_prompt: bool = False) -> int:
    load_before = round(os.getloadavg()[0], 2)
    body = request_body(prompt_tokens, echo_prompt)
    with stub_replica("bench", first_token_delay_ms) as replica, router([replica.url], policy) as routed:
        result = measure(replica.url, routed.url, requests, body)
    report = {
        "command": "kvshare bench router-overhead "
                   + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "router-overhead"] else []),
        "machine": {**machine(), "load_avg_1m_before": load_before},
        "setup": {"requests_per_arm": requests, "warmup_per_arm": WARMUP,
                  "stub_first_token_delay_ms": first_token_delay_ms, "budget_ms": BUDGET_MS,
                  "prompt_tokens": prompt_tokens, "request_body_bytes": len(body), "policy": policy,
                  "echo_prompt": echo_prompt,
                  "method": __doc__.split("\n\n", 1)[1].strip()},
        **result,
    }
    verdict = "within" if result["within_budget"] else "OVER"
    summary = f"median overhead {result['overhead']['median_ms']:.2f} ms: {verdict} the {BUDGET_MS:g} ms budget"
    print(table(result) + "\n\n" + summary)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        Path(json_path).with_suffix(".md").write_text(markdown(report, summary))
    return 0 if result["within_budget"] else 1


def markdown(report: dict, summary: str) -> str:
    m = report["machine"]
    return (
        "# Router overhead: TTFT through `kvshare route` vs direct (loopback)\n\n"
        f"Command: `{report['command']}`\n\n"
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, {m['system']}, "
        f"1-minute load average {m['load_avg_1m_before']} before and {m['load_avg_1m']} after the run "
        "(a shared machine: other jobs compete for the same cores).\n\n"
        f"{report['setup']['method']}\n\n"
        f"{report['setup']['requests_per_arm']} requests per arm after {report['setup']['warmup_per_arm']} warm-up; "
        f"the stub replica sends its first token {report['setup']['stub_first_token_delay_ms']:g} ms after the "
        f"request. The prompt: {_prompt_words(report['setup'])}; the router's policy: "
        f"{report['setup'].get('policy', 'round-robin')}. `overhead` is the per-pair difference routed - direct.\n\n"
        f"{table(report)}\n\n**{summary}.**\n"
    )


def _prompt_words(setup: dict) -> str:
    tokens = setup.get("prompt_tokens", 0)
    if not tokens:
        return '"hello"'
    echo = ", echoed in the first event (return_token_ids)" if setup.get("echo_prompt") else ""
    return f"{tokens:,} token ids ({setup['request_body_bytes']:,}-byte body){echo}"
