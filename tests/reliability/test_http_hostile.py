"""Hostile HTTP input to `kvshare serve` and to `kvshare route` in front of it: malformed JSON, wrong types, invalid
token ids, prompts beyond max_model_len, multi-MB bodies, and slow clients. Each gets a clear OpenAI-style error
(or simply waits) while the server stays up and keeps answering others."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from kvshare.router.local import router

from .conftest import complete, kvshare_serve, running

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
VOCAB = 1024  # the tiny model's


@pytest.fixture(scope="module")
def servers(tiny_model):
    replica = kvshare_serve(tiny_model, "none", "--max-model-len", str(MAX_MODEL_LEN))
    with running(replica) as (replica,):
        with running(router([replica.url], "round-robin")) as (routed,):
            yield {"replica": replica.url, "router": routed.url}


TARGETS = ["replica", "router"]
BAD_BODIES = {
    "malformed json": (b'{"prompt": [1, 2', 400),
    "not an object": (b"[1, 2, 3]", None),
    "null": (b"null", None),
    "prompt of wrong type": (json.dumps({"prompt": 5}).encode(), None),
    "string among ids": (json.dumps({"prompt": [1, "a"]}).encode(), None),
    "max_tokens as string": (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), None),
    "negative token id": (json.dumps({"prompt": [5, -1]}).encode(), 400),
    "token id past the vocabulary": (json.dumps({"prompt": [5, VOCAB]}).encode(), 400),
    "huge token id": (json.dumps({"prompt": [10**30]}).encode(), None),
    "prompt beyond max_model_len": (json.dumps({"prompt": [7] * (MAX_MODEL_LEN + 1), "max_tokens": 1}).encode(), 400),
    "multi-MB text prompt": (json.dumps({"prompt": "hello world " * 400_000}).encode(), 400),
    "multi-MB id prompt": (json.dumps({"prompt": [9] * 1_000_000}).encode(), 400),
}


def wait_routable(base: str) -> None:
    """Until a small request goes through. A multi-MB text prompt holds a replica's event loop while it is tokenized
    (seconds; see the report), so the router may have taken the replica out of rotation for a moment."""
    for _ in range(120):
        body = {"prompt": [11, 12], "max_tokens": 1}
        if httpx.post(f"{base}/v1/completions", json=body, timeout=60, trust_env=False).status_code == 200:
            return
        time.sleep(0.5)
    raise AssertionError(f"{base} did not serve again within a minute")


def error_message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_request_gets_a_clear_error_and_the_server_stays_up(servers, target, case):
    body, status = BAD_BODIES[case]
    base = servers[target]
    wait_routable(base)
    response = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=120, trust_env=False)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status:
        assert response.status_code == status
    assert len(error_message(response)) > 10  # says what was wrong
    assert httpx.get(f"{servers['replica']}/health", timeout=30, trust_env=False).status_code == 200
    wait_routable(base)  # the router too serves again (by itself, if its health probe timed out meanwhile)


def test_error_messages_name_the_problem(servers):
    base = servers["replica"]
    post = lambda body: httpx.post(f"{base}/v1/completions", json=body, timeout=120, trust_env=False)  # noqa: E731
    too_long = {"prompt": [7] * (MAX_MODEL_LEN + 1), "max_tokens": 1}
    assert "maximum context length is 256" in error_message(post(too_long))
    assert str(VOCAB) in error_message(post({"prompt": [5, VOCAB]}))
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": "hi"}, timeout=60, trust_env=False)
    assert 400 <= chat.status_code < 500 and "messages" in error_message(chat)


def raw_connection(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


@pytest.mark.parametrize("target", TARGETS)
def test_slow_clients_do_not_block_others(servers, target):
    base = servers[target]
    wait_routable(base)
    stalled = []
    try:
        headers_only = raw_connection(base)  # sends part of the headers, then nothing
        headers_only.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        half_body = raw_connection(base)  # sends headers and half a body, then nothing
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"prompt\": [1, 2, ")
        non_reader = raw_connection(base)  # asks for a long stream and never reads it
        body = json.dumps({"prompt": [5] * 20, "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        non_reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        stalled += [headers_only, half_body, non_reader]
        for _ in range(3):  # meanwhile everyone else is served
            assert complete(base, [11, 12, 13, 14], max_tokens=4)["choices"][0]["finish_reason"] == "length"
    finally:
        for s in stalled:
            s.close()
    assert httpx.get(f"{base}/health", timeout=30, trust_env=False).status_code == 200
