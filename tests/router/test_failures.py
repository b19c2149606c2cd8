"""Failover before the first byte, errors after it, health checks in and out of rotation, 503 with no replica,
4xx passed through untouched, SSE streams intact and unbuffered, and the metrics that count all of it."""

from __future__ import annotations

import json

import httpx
import pytest

from .helpers import REPLICA_HEADER, complete, metric, served_by, sse_events, state, wait_until
from .servers import free_port, stub_replica

FAST_HEALTH = ("--health-interval", "0.2", "--health-timeout", "0.5")


def test_dead_replica_is_skipped_before_the_first_byte(make_router, replicas):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    base = make_router([dead, replicas[0].url], "round-robin", "--health-interval", "60").url
    assert [served_by(base) for _ in range(4)] == ["A"] * 4
    assert state(base)["replicas"][0]["healthy"] is False


def test_replica_killed_mid_run_fails_over_and_counts_errors(make_router, launch):
    doomed, survivor = launch(stub_replica("D")), launch(stub_replica("S"))
    base = make_router([doomed.url, survivor.url], "round-robin", "--health-interval", "60").url
    assert sorted(served_by(base) for _ in range(2)) == ["D", "S"]
    doomed.stop()
    assert [served_by(base) for _ in range(4)] == ["S"] * 4  # the first of these retried D, then went to S
    assert metric(base, "kvshare_router_errors_total", replica=doomed.url, kind="connect") == 1
    assert metric(base, "kvshare_router_requests_total", replica=survivor.url) == 5


def test_upstream_5xx_is_retried_on_another_replica(make_router, replicas):
    base = make_router([r.url for r in replicas[:2]], "round-robin").url
    # Round-robin would send the first request to A; A answers 503, so it is retried on B.
    assert served_by(base, stub={"status": 503, "only": "A"}) == "B"
    assert metric(base, "kvshare_router_errors_total", replica=replicas[0].url, kind="status_5xx") == 1
    everywhere = complete(base, stub={"status": 500})  # every replica fails: the last answer passes through
    assert everywhere.status_code == 500 and "stub told to answer 500" in everywhere.text


def test_health_checks_take_a_replica_out_and_bring_it_back(make_router, launch):
    a, b = launch(stub_replica("A")), launch(stub_replica("B"))
    base = make_router([a.url, b.url], "round-robin", *FAST_HEALTH).url
    httpx.post(f"{b.url}/stub/health", json={"ok": False}, timeout=10)
    wait_until(lambda: not state(base)["replicas"][1]["healthy"], what="B out of rotation")
    assert [served_by(base) for _ in range(4)] == ["A"] * 4
    httpx.post(f"{b.url}/stub/health", json={"ok": True}, timeout=10)
    wait_until(lambda: state(base)["replicas"][1]["healthy"], what="B back in rotation")
    assert {served_by(base) for _ in range(4)} == {"A", "B"}


def test_no_healthy_replica_answers_503_with_a_clear_message(make_router):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    base = make_router(dead, "least-loaded", "--health-interval", "60").url
    response = complete(base)
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "no healthy replica" in message and dead[0] in message
    assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    assert metric(base, "kvshare_router_unplaced_total") == 1


@pytest.mark.parametrize("body", [b'{"max_tokens": 3}', b'{"prompt": "x", "max_tokens": -1}'])
def test_4xx_passes_through_untouched(make_router, replicas, body):
    base = make_router([replicas[0].url], "round-robin").url
    direct = httpx.post(f"{replicas[0].url}/v1/completions", content=body, timeout=10)
    routed = httpx.post(f"{base}/v1/completions", content=body, timeout=10)
    assert direct.status_code == routed.status_code == 400
    assert routed.content == direct.content
    assert routed.headers["content-type"] == direct.headers["content-type"]


def test_stream_arrives_whole_in_order_and_unbuffered(make_router, replicas):
    base = make_router([replicas[1].url], "round-robin").url
    body = {"prompt": "x", "max_tokens": 40, "stream": True, "stub": {"hold_after": 1}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[REPLICA_HEADER] == replicas[1].url
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        # The replica is holding the rest of the stream until released: the first event could only have come
        # through if the router relays chunk by chunk (a buffering proxy would block here until the timeout).
        assert json.loads(first[len("data: "):])["seq"] == 0
        httpx.post(f"{replicas[1].url}/stub/release", timeout=10)
        rest = list(lines)
    events = sse_events([first, *rest])
    assert [e["seq"] for e in events] == list(range(41))
    assert [e["choices"][0]["text"] for e in events[:40]] == [f"t{i} " for i in range(40)]
    assert {e["replica"] for e in events} == {"B"} and rest[-2:] == ["data: [DONE]", ""]


@pytest.mark.parametrize("policy", ["round-robin", "cache-aware"])
def test_a_long_id_prompt_and_its_echo_pass_byte_for_byte(make_router, replicas, policy):
    """131,072 ids up (the router reads as much of them as the policy needs) and back in the first event (820 KB, as
    vLLM's return_token_ids sends them), whole and unchanged, behind the rest of the stream."""
    base = make_router([replicas[2].url], policy).url
    prompt = [(7919 * i) % 150_000 for i in range(131_072)]
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response.iter_lines())
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt
    assert [e["seq"] for e in events] == [0, 1, 2, 3] and events[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])


def test_error_after_the_first_byte_reaches_the_client(make_router, replicas):
    base = make_router([replicas[2].url], "round-robin", "--health-interval", "60").url
    body = {"prompt": "x", "max_tokens": 10, "stream": True, "stub": {"fail_after": 3}}
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                received.append(line)
    assert [e["seq"] for e in sse_events(received)] == [0, 1, 2]
    assert metric(base, "kvshare_router_errors_total", kind="stream") == 1


def test_metrics_count_requests_per_replica(make_router, replicas):
    base = make_router([r.url for r in replicas[:2]], "round-robin").url
    for _ in range(5):
        served_by(base)
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as r:
        list(r.iter_lines())
    assert metric(base, "kvshare_router_requests_total", replica=replicas[0].url) == 3
    assert metric(base, "kvshare_router_requests_total", replica=replicas[1].url) == 3
    wait_until(lambda: metric(base, "kvshare_router_request_seconds_count") == 6, what="6 latencies recorded")
    assert metric(base, "kvshare_router_first_byte_seconds_count", replica=replicas[0].url) == 3
    assert metric(base, "kvshare_router_replica_healthy", replica=replicas[1].url) == 1
