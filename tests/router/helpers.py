"""Small client helpers for router tests: completions, SSE reading, admin calls, metrics parsing, bounded polling."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPLICA_HEADER = "x-kvshare-replica"
ADMIN_TOKEN = "router-tests-admin-token"  # routers started through tests/router/servers.py accept it


def complete(base: str, session: str | None = None, **body) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    return httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, headers=headers,
                      timeout=30)


def served_by(base: str, session: str | None = None, **body) -> str:
    """The replica name the stub reports; also checks the router's header names the same replica."""
    response = complete(base, session, **body)
    assert response.status_code == 200, response.text
    return response.json()["replica"]


def sse_events(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def set_policy(base: str, name: str, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{base}/admin/policy", json={"policy": name}, headers=headers, timeout=10)


def state(base: str) -> dict:
    return httpx.get(f"{base}/admin/state", timeout=10).json()


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
