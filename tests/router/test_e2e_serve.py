"""End to end: the router in front of two real `kvshare serve` replicas of a tiny generated model (pool off)."""

from __future__ import annotations

import sys

import httpx
import pytest

from .helpers import REPLICA_HEADER, set_policy, sse_events
from .servers import ServerProcess, free_port, router

pytestmark = pytest.mark.slow


def kvshare_serve(model_dir) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "kvshare.cli", "serve", "--model", str(model_dir), "--port", str(port),
            "--pool", "none", "--threads", "1"]
    return ServerProcess(argv, port)


@pytest.fixture(scope="module")
def deployment(tiny_model):
    started = []
    try:
        replicas = [kvshare_serve(tiny_model).start(ready_timeout_s=120) for _ in range(2)]
        started += replicas
        routed = router([r.url for r in replicas], "alternate").start()
        started.append(routed)
        model_id = httpx.get(f"{replicas[0].url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield routed.url, [r.url for r in replicas], model_id
    finally:
        for process in reversed(started):
            process.stop()


def stream(url: str, model: str, session: str, prompt: str, max_tokens: int = 8) -> tuple[str, list[dict]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"x-session-id": session},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        return response.headers.get(REPLICA_HEADER, ""), sse_events(response.iter_lines())


def last(events: list[dict], field: str) -> dict:
    """The last event carrying `field` (the replica puts `kvshare` on the finish chunk, `usage` on the last one)."""
    return next(e[field] for e in reversed(events) if e.get(field))


def text_of(events: list[dict]) -> str:
    return "".join(choice.get("text", "") for e in events for choice in e.get("choices", []))


def test_alternate_session_crosses_replicas_and_streams_match_direct(deployment):
    base, replicas, model = deployment
    set_policy(base, "alternate")
    prompt = "The shared pool lets a session move between replicas. " * 4
    served = []
    for _ in range(2):
        replica, events = stream(base, model, "e2e-alt", prompt)
        served.append(replica)
        direct_replica, direct_events = stream(replica, model, "direct", prompt)
        assert text_of(events) == text_of(direct_events)  # greedy: the relayed stream is the replica's stream
        assert last(events, "usage")["prompt_tokens_details"]["cached_tokens"] >= 0
        assert set(last(events, "kvshare")) == {"local_hit_tokens", "pool_hit_tokens"}
    assert sorted(served) == sorted(replicas)


def test_fixed_session_returns_to_its_replica_and_hits_its_local_cache(deployment):
    base, replicas, model = deployment
    set_policy(base, "fixed")
    prompt = "A long document that the session asks about twice, so the second turn should hit. " * 6
    first, _ = stream(base, model, "e2e-fixed", prompt)
    second, events = stream(base, model, "e2e-fixed", prompt + " And a follow-up question?")
    assert first == second
    assert last(events, "kvshare")["local_hit_tokens"] > 0


def test_models_aggregate_the_replicas(deployment):
    base, _, model = deployment
    assert [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]] == [model]


def test_replica_4xx_passes_through_untouched(deployment):
    base, replicas, _ = deployment
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}
    direct = httpx.post(f"{replicas[0]}/v1/completions", json=body, timeout=30)
    routed = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert routed.status_code == direct.status_code == 404
    assert routed.content == direct.content
