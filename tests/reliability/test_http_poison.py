"""Poisoned sampling parameters against real `kvshare serve` replicas and a `kvshare route` in front of two of them: a
request that cannot be sampled is refused 400 (and never retried elsewhere), and the streams decoding beside it all
finish. Before issue 18, `"temperature": NaN` passed validation, failed the whole batch on the replica, and the
router carried it to the next replica, where it failed that batch too."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kvshare.router.local import router

from .conftest import kvshare_serve, running
from .http_watch import metric

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def deployment(tiny_model):
    replicas = [kvshare_serve(tiny_model, "none", "--max-model-len", "512") for _ in range(2)]
    with running(*replicas) as started:
        with running(router([r.url for r in started], "round-robin")) as (routed,):
            yield [r.url for r in started], routed.url


def post_raw(base: str, body: dict) -> httpx.Response:
    """json.dumps writes NaN and Infinity as bare words, as a careless client does; both servers must cope."""
    return httpx.post(f"{base}/v1/completions", content=json.dumps(body).encode(), timeout=120, trust_env=False,
                      headers={"content-type": "application/json"})


def innocent_stream(base: str, seed: int, results: list) -> None:
    body = {"prompt": [16 + seed, 40, 41, 42], "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    reason, usage = None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120, trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                reason = next((c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")), reason)
                usage = event.get("usage") or usage
                if "error" in event:
                    reason = "error: " + event["error"]["message"]
    results.append((reason, usage and usage["completion_tokens"]))


@pytest.mark.parametrize("poison", [{"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"temperature": 1.0, "top_p": float("nan")}])
def test_a_poisoned_request_is_refused_while_innocent_streams_all_finish(deployment, poison):
    replicas, _ = deployment
    base = replicas[0]
    results: list = []
    streams = [threading.Thread(target=innocent_stream, args=(base, i, results)) for i in range(6)]
    for thread in streams:
        thread.start()
    refused = post_raw(base, {"prompt": "hello", "max_tokens": 8, **poison})
    tiny_top_p = post_raw(base, {"prompt": "hello", "max_tokens": 8, "temperature": 1.0, "top_p": 1e-300})
    for thread in streams:
        thread.join(120)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] in poison
    assert tiny_top_p.status_code == 200, tiny_top_p.text  # in (0, 1]: valid, and sampled as the most likely token
    assert results == [("length", MAX_TOKENS)] * 6


OUT_OF_RANGE = [
    ({"temperature": 2.5}, "temperature must be a finite number in [0, 2]"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p must be a finite number in (0, 1]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k must be -1 or 0"),
    ({"n": 0}, "n must be at least 1"),
    ({"n": 3}, "n=3 is not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a finite number in [-2, 2]"),
    ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
    ({"seed": 2**64}, "seed must be a 64-bit signed integer"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": 10**30}, "maximum context length"),
    ({"stop": [f"s{i}" for i in range(17)]}, "at most 16 (--max-stop-strings)"),
    ({"stop": "x" * 257}, "at most 256 (--max-stop-chars)"),
]


@pytest.mark.parametrize("fields, says", OUT_OF_RANGE, ids=[next(iter(f)) + "=" + str(f[next(iter(f))])[:10]
                                                           for f, _ in OUT_OF_RANGE])
def test_sampling_values_out_of_range_get_400_naming_the_field(deployment, fields, says):
    replicas, _ = deployment
    response = post_raw(replicas[0], {"prompt": "hello", "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_accepted_sampling_values_are_served(deployment):
    replicas, _ = deployment
    for fields in ({"top_k": -1}, {"top_k": 0}, {"top_k": 5, "temperature": 0.7, "seed": -3}, {"presence_penalty": 0},
                   {"temperature": 2.0, "top_p": 1.0, "seed": 2**63 - 1}, {"stop": ["a"] * 16}):
        response = post_raw(replicas[0], {"prompt": "hello", "max_tokens": 4, **fields})
        assert response.status_code == 200, (fields, response.text)


def attempts(router_url: str) -> float:
    return metric(router_url, "kvshare_router_requests_total") or 0.0


@pytest.mark.parametrize("poison", [{"temperature": float("nan")}, {"temperature": 5.0}, {"max_tokens": 0}])
def test_the_router_does_not_retry_a_request_that_failed_on_its_own(deployment, poison):
    """Each of these is the request's own fault: 400 (from the router or the first replica), and no second replica
    is asked. (Before, NaN failed the first replica's batch with a 500, and the router retried it on the second.)"""
    _, base = deployment
    before = attempts(base)
    response = post_raw(base, {"prompt": "hello", "max_tokens": 4, **poison})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert attempts(base) - before <= 1
