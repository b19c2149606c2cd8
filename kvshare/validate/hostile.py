"""`kvshare validate hostile`: hostile HTTP clients against a running deployment (a replica, a router, or both), each
attack checked against what a well-defended server does; a table of attack, expected, observed, verdict.

Each attack is a small typed object (`Attack`: a name, the targets it applies to, what is expected, a function) in
`ATTACKS`; the pool's attacks and flood (`--pool`) live in `pool_attacks` / `pool_hostile` and add their rows to
the same table. Every attack is bounded in time (`patience_s` and
socket timeouts) and load (a few requests, at most `body_bytes` sent), so it can run against a live deployment. The
attacks that watch a timeout need the server's timeout below `patience_s` (kvshare's defaults: 10 s for headers, 30 s
for bodies and writes: use --patience 40, or start the servers with shorter timeouts); the unread-stream attack also
needs the model to generate, within that time, what fills the server's send buffer (~2k SSE chunks at 256 KiB).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import httpx

from kvshare.validate import raw_http

if TYPE_CHECKING:
    from kvshare.validate.pool_attacks import PoolTarget
    from kvshare.validate.pool_hostile import FloodPlan

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Probe:
    """One target of the attacks: a replica or a router base URL, and the bounds every attack keeps to."""

    kind: str  # "replica" | "router"
    base: str
    model: str  # the served model's id (from /v1/models), sent in every body
    max_model_len: int | None
    patience_s: float  # how long an attack waits for the server to act (time out, drop)
    body_bytes: int  # the most an oversized-body attack sends

    def body(self, **fields) -> dict:
        return {"model": self.model, "prompt": "hello there", "max_tokens": 4, **fields}

    def post(self, payload: dict | bytes, path: str = COMPLETIONS, **kwargs) -> httpx.Response:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return httpx.post(f"{self.base}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=kwargs.pop("timeout", 60.0), trust_env=False, **kwargs)


@dataclass(frozen=True)
class Verdict:
    observed: str
    handled: bool


@dataclass(frozen=True)
class Attack:
    name: str
    targets: frozenset[str]  # "replica" and/or "router"
    expected: str
    run: Callable[[Probe], Verdict]


@dataclass(frozen=True)
class Row:
    attack: str
    target: str
    expected: str
    observed: str
    handled: bool


BOTH = frozenset({"replica", "router"})
ROUTER = frozenset({"router"})


# ---------------------------------------------------------------- request content


def _error_json(response: httpx.Response) -> bool:
    try:
        return bool(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False


def _refused(response: httpx.Response, statuses: range = range(400, 500)) -> Verdict:
    shape = "JSON error" if _error_json(response) else f"not JSON: {response.text[:60]!r}"
    return Verdict(f"{response.status_code}, {shape}", response.status_code in statuses and _error_json(response))


def nan_temperature(probe: Probe) -> Verdict:
    raw = json.dumps(probe.body(temperature=float("nan"))).encode()  # json writes NaN, as a careless client would
    return _refused(probe.post(raw))


OUT_OF_RANGE = {"temperature": 5.0, "top_p": 0.0, "top_k": -3, "n": 0, "frequency_penalty": 9.0, "max_tokens": 0,
                "seed": 2**70, "stop": [f"s{i}" for i in range(1000)]}


def out_of_range_sampling(probe: Probe) -> Verdict:
    accepted = [f"{name}={str(value)[:12]}" for name, value in OUT_OF_RANGE.items()
                if not 400 <= probe.post(probe.body(**{name: value})).status_code < 500]
    if accepted:
        return Verdict(f"not refused: {', '.join(accepted)}", False)
    return Verdict(f"all {len(OUT_OF_RANGE)} refused 4xx", True)


def tiny_top_p(probe: Probe) -> Verdict:
    response = probe.post(probe.body(temperature=1.0, top_p=1e-300))
    return Verdict(f"{response.status_code}", response.status_code < 500)


def poison_among_innocents(probe: Probe) -> Verdict:
    """Four innocent streams run while poisoned requests arrive; every innocent stream must finish."""
    innocent = probe.body(max_tokens=24, temperature=0.0, stream=True, ignore_eos=True)
    poisons = [json.dumps(probe.body(temperature=float("nan"))).encode(),
               json.dumps(probe.body(temperature=1.0, top_p=1e-300)).encode()]
    with ThreadPoolExecutor(max_workers=6) as pool:
        streams = [pool.submit(_finish_reason, probe, innocent) for _ in range(4)]
        time.sleep(0.2)  # the streams are decoding when the poison arrives
        poisoned = [pool.submit(probe.post, raw) for raw in poisons]
        reasons = [f.result() for f in streams]
        statuses = [f.result().status_code for f in poisoned]
    finished = sum(r in ("length", "stop") for r in reasons)
    return Verdict(f"{finished}/4 innocent streams finished; poison answered {statuses}",
                   finished == 4 and all(s < 500 for s in statuses))


def _finish_reason(probe: Probe, body: dict) -> str:
    reason = "none"
    try:
        with httpx.stream("POST", f"{probe.base}{COMPLETIONS}", json=body, timeout=120, trust_env=False) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    reason = choices[0].get("finish_reason") or reason
    except httpx.HTTPError as error:
        return f"error: {type(error).__name__}"
    return reason


def lone_surrogate(probe: Probe) -> Verdict:
    raw = json.dumps(probe.body(prompt="ab\ud800cd")).encode()  # ensure_ascii writes the escape "\ud800"
    return _refused(probe.post(raw))


def deep_json(probe: Probe) -> Verdict:
    raw = b'{"model": "%s", "prompt": %s%s}' % (probe.model.encode(), b"[" * 100_000, b"]" * 100_000)
    return _refused(probe.post(raw))


def wrong_types(probe: Probe) -> Verdict:
    bodies = [probe.body(prompt=5), probe.body(max_tokens="5"), {"model": probe.model, "messages": "hi"}]
    paths = [COMPLETIONS, COMPLETIONS, "/v1/chat/completions"]
    verdicts = [_refused(probe.post(body, path)) for body, path in zip(bodies, paths)]
    return Verdict("; ".join(v.observed for v in verdicts), all(v.handled for v in verdicts))


# ---------------------------------------------------------------- sizes


def oversized_declared_body(probe: Probe) -> Verdict:
    """Declares 1 GiB, sends 1 MiB of it, and waits for the answer."""
    sock = raw_http.connect(probe.base)
    sock.sendall(raw_http.request_head("POST", COMPLETIONS, probe.base, content_length=1 << 30))
    sock.sendall(b" " * (1 << 20))
    ending = raw_http.wait_for_close(sock, probe.patience_s)
    return Verdict(f"{ending.status or 'no answer'} after 1 MiB of 1 GiB", ending.status == 413)


def oversized_chunked_body(probe: Probe) -> Verdict:
    """Uploads a chunked body of up to `body_bytes` at a steady pace; the server must answer 413 once its limit is
    passed, before the upload ends."""
    upload = raw_http.paced_chunked_upload(probe.base, COMPLETIONS, probe.body_bytes, probe.patience_s)
    return Verdict(f"{upload.status or 'no answer'} after sending {upload.sent >> 20} of {probe.body_bytes >> 20} MiB",
                   upload.status == 413 and upload.sent < probe.body_bytes)


def huge_headers(probe: Probe) -> Verdict:
    head = raw_http.request_head("GET", "/health", probe.base, headers={"X-Padding": "a" * (64 << 10)})
    ending = raw_http.send_then_wait(probe.base, head, probe.patience_s)
    return Verdict(f"{ending.status or 'no answer'}", ending.status in (400, 431))


# ---------------------------------------------------------------- time


def _closed(ending: raw_http.Ending, patience_s: float) -> Verdict:
    if ending.closed_after_s is None:
        return Verdict(f"still open after {patience_s:g} s", False)
    return Verdict(f"closed after {ending.closed_after_s:.1f} s ({ending.status or 'no answer'})", True)


def half_sent_headers(probe: Probe) -> Verdict:
    data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return _closed(raw_http.send_then_wait(probe.base, data, probe.patience_s), probe.patience_s)


def half_sent_body(probe: Probe) -> Verdict:
    data = raw_http.request_head("POST", COMPLETIONS, probe.base, content_length=1000) + b'{"prompt": [1, 2, '
    return _closed(raw_http.send_then_wait(probe.base, data, probe.patience_s), probe.patience_s)


def idle_connection(probe: Probe) -> Verdict:
    return _closed(raw_http.send_then_wait(probe.base, b"", probe.patience_s), probe.patience_s)


def unread_stream(probe: Probe) -> Verdict:
    """A long stream that is never read: the server must drop it (and a replica free the request)."""
    tokens = max(16, min((probe.max_model_len or 4096) - 32, 100_000))
    body = json.dumps(probe.body(max_tokens=tokens, temperature=0.0, stream=True, ignore_eos=True)).encode()
    stall = raw_http.stall_stream(probe.base, raw_http.post_json(COMPLETIONS, probe.base, body), probe.patience_s)
    if not stall.dropped:
        state = "finished (too short to fill the buffers)" if stall.finished else "still streaming"
        return Verdict(f"not dropped after {probe.patience_s:g} s: {state}", False)
    observed = f"dropped ({stall.received_bytes >> 10} KiB had arrived)"
    if probe.kind == "replica":
        held = _wait_engine_idle(probe)
        observed += "; engine requests " + ("n/a (no kvshare_engine_requests)" if held is None else f"at {held:g}")
        return Verdict(observed, held in (None, 0))
    return Verdict(observed, True)


def _wait_engine_idle(probe: Probe) -> int | None:
    deadline = time.monotonic() + probe.patience_s
    while True:
        held = _gauge(probe.base, "kvshare_engine_requests")
        if held in (None, 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def mid_body_disconnect(probe: Probe) -> Verdict:
    data = raw_http.request_head("POST", COMPLETIONS, probe.base, content_length=1000) + b'{"prompt": "ab'
    for _ in range(3):
        raw_http.send_then_leave(probe.base, data)
    health = httpx.get(f"{probe.base}/health", timeout=30, trust_env=False).status_code
    return Verdict(f"/health {health} after 3 clients left mid-body", health == 200)


# ---------------------------------------------------------------- the router's own


def duplicate_headers(probe: Probe) -> Verdict:
    response = probe.post(probe.body())
    names = [name.decode("latin-1").lower() for name, _ in response.headers.raw]
    repeated = sorted({n for n in names if names.count(n) > 1 and n != "set-cookie"})
    return Verdict(f"repeated: {', '.join(repeated)}" if repeated else "each header once", not repeated)


def admin_without_token(probe: Probe) -> Verdict:
    state = httpx.get(f"{probe.base}/admin/state", timeout=10, trust_env=False)
    policy = state.json().get("policy", "round-robin") if state.status_code == 200 else "round-robin"
    # The same policy as now: harmless even on a router that accepts it.
    response = httpx.post(f"{probe.base}/admin/policy", json={"policy": policy}, timeout=10, trust_env=False)
    return Verdict(f"{response.status_code}", response.status_code in (401, 403))


def no_retry_of_own_failure(probe: Probe) -> Verdict:
    """A request every replica refuses (max_tokens 0) is tried on one replica only (on a quiet router)."""
    before = _gauge(probe.base, "kvshare_router_requests_total")
    response = probe.post(probe.body(max_tokens=0))
    after = _gauge(probe.base, "kvshare_router_requests_total")
    if before is None or after is None:
        return Verdict(f"{response.status_code}; no kvshare_router_requests_total to count attempts", False)
    attempts = int(after - before)
    return Verdict(f"{response.status_code} after {attempts} replica attempt(s)",
                   400 <= response.status_code < 500 and attempts == 1)


def _gauge(base: str, name: str) -> float | None:
    """The sum of a metric's samples on base's /metrics (None if absent)."""
    text = httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")]
    return sum(values) if values else None


ATTACKS: tuple[Attack, ...] = (
    Attack("NaN temperature", BOTH, "400 JSON error", nan_temperature),
    Attack("out-of-range sampling", BOTH, "every value refused 4xx", out_of_range_sampling),
    Attack("top_p 1e-300, temperature 1", BOTH, "served (or 4xx), never 5xx", tiny_top_p),
    Attack("poison among innocent streams", BOTH, "4/4 innocent streams finish", poison_among_innocents),
    Attack("lone surrogate in JSON", BOTH, "400 JSON error", lone_surrogate),
    Attack("JSON nested 100k deep", BOTH, "400 JSON error", deep_json),
    Attack("wrong types", BOTH, "4xx JSON errors", wrong_types),
    Attack("body of 1 GiB declared", BOTH, "413 before the body is read", oversized_declared_body),
    Attack("chunked body past the limit", BOTH, "413 before the whole body is sent", oversized_chunked_body),
    Attack("64 KiB header", BOTH, "431 (or 400)", huge_headers),
    Attack("half-sent headers", BOTH, "closed within patience", half_sent_headers),
    Attack("half-sent body", BOTH, "closed within patience", half_sent_body),
    Attack("idle connection", BOTH, "closed within patience", idle_connection),
    Attack("stream never read", BOTH, "dropped; engine frees it", unread_stream),
    Attack("disconnect mid-body", BOTH, "keeps serving", mid_body_disconnect),
    Attack("duplicate headers", ROUTER, "each header once", duplicate_headers),
    Attack("/admin/policy without token", ROUTER, "401 or 403", admin_without_token),
    Attack("request's own 4xx", ROUTER, "not retried (1 attempt)", no_retry_of_own_failure),
)


# ---------------------------------------------------------------- running


def probe_for(kind: str, base: str, patience_s: float, body_bytes: int) -> Probe:
    """Reads the served model (id and max_model_len, when the server reports it) from /v1/models."""
    base = base.rstrip("/")
    models = httpx.get(f"{base}/v1/models", timeout=30, trust_env=False).json()["data"]
    first = models[0] if models else {}
    return Probe(kind, base, str(first.get("id", "")), first.get("max_model_len"), patience_s, body_bytes)


def run_attacks(probes: list[Probe], attacks: tuple[Attack, ...] = ATTACKS) -> list[Row]:
    rows = []
    for probe in probes:
        for attack in attacks:
            if probe.kind in attack.targets:
                rows.append(_run_one(attack, probe))
    return rows


def _run_one(attack: Attack, probe: Probe) -> Row:
    try:
        verdict = attack.run(probe)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as error:
        verdict = Verdict(f"attack could not complete: {type(error).__name__}: {error}"[:200], False)
    return Row(attack.name, probe.kind, attack.expected, verdict.observed, verdict.handled)


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hostile clients")
    for column in ("attack", "target", "expected", "observed", "verdict"):
        table.add_column(column)
    for row in rows:
        verdict = "[green]handled[/green]" if row.handled else "[red]NOT HANDLED[/red]"
        table.add_row(row.attack, row.target, row.expected, row.observed, verdict)
    Console(width=160).print(table)


def run_hostile(replica: str | None, router: str | None, pool: "PoolTarget | None", patience_s: float,
                body_bytes: int, flood: "FloodPlan | None" = None, json_path: str = "") -> int:
    """Runs every attack that applies to the given targets (and the pool flood), prints the table; 0 if all were
    handled, else 1."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    probes = [probe_for(kind, base, patience_s, body_bytes) for kind, base in (("replica", replica), ("router", router))
              if base]
    rows = run_attacks(probes)
    if pool is not None:
        from kvshare.validate.pool_hostile import pool_rows

        rows += pool_rows(pool, flood, json_path)
    print_table(rows)
    failed = [row for row in rows if not row.handled]
    print(f"{len(rows) - len(failed)} of {len(rows)} attacks handled")
    return 1 if failed else 0
