"""`kvshare serve` (and `kvshare route` in front of it) against clients that send too much, too slowly, or stop
reading: a body over the limit gets 413 without the replica buffering it; half-sent requests are answered 408 and
closed after --header-timeout / --body-timeout; a stream nobody reads is dropped after --write-timeout and the engine
frees its request and KV blocks at once; a client that leaves mid-body costs one log line."""

from __future__ import annotations

import json

import httpx
import pytest

from kvshare.router.local import router
from kvshare.validate import raw_http

from .conftest import kvshare_serve, running
from .http_watch import PeakRss, log_text, metric, new_log_lines, wait_until

MiB = 1 << 20
SHORT = ("--header-timeout", "1", "--body-timeout", "1", "--write-timeout", "1", "--send-buffer", "16KiB")
LONG_STREAM = 3500  # tokens: seconds of decoding on the tiny model, far more than fills the buffers


@pytest.fixture(scope="module")
def replica(tiny_model):
    """Default limits (the 16 MiB body limit, 10/30 s timeouts)."""
    with running(kvshare_serve(tiny_model, "none", "--max-model-len", "512")) as (server,):
        yield server


@pytest.fixture(scope="module")
def short(tiny_model):
    """A replica with 1 s timeouts and a 16 KiB send buffer, and a router in front of it with the same."""
    with running(kvshare_serve(tiny_model, "none", *SHORT)) as (server,):
        with running(router([server.url], "round-robin", *SHORT)) as (routed,):
            yield server, routed


def chunks(total: int):
    sent = 0
    while sent < total:
        sent += MiB
        yield b" " * MiB


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_without_the_replica_buffering_it(replica, declared):
    """Before, the replica read every byte (a 512 MiB body peaked it at 2.1 GB) and then failed to parse it."""
    headers = {"content-type": "application/json"} | ({"content-length": str(256 * MiB)} if declared else {})
    with PeakRss(replica.process.pid) as rss:
        response = httpx.post(f"{replica.url}/v1/completions", content=chunks(256 * MiB), headers=headers,
                              timeout=120, trust_env=False)
    assert response.status_code == 413, response.text[:200]
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "--max-body-size" in error["message"]
    assert rss.growth_mib < 100, f"replica grew by {rss.growth_mib:.0f} MiB"
    ok = httpx.post(f"{replica.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_client_leaving_mid_body_costs_one_log_line(replica):
    """Before, each such client logged a ~110-line traceback (ClientDisconnect through FastAPI and uvicorn)."""
    mark = len(log_text(replica))
    head = raw_http.request_head("POST", "/v1/completions", replica.url, content_length=1000)
    raw_http.send_then_leave(replica.url, head + b'{"prompt": "a')
    lines = new_log_lines(replica, mark)
    assert len(lines) == 1 and "middle of its request body" in lines[0], lines
    assert "Traceback" not in log_text(replica)


@pytest.mark.parametrize("sent", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\": [1, 2, ",
    b"",
], ids=["half-sent headers", "half-sent body", "nothing"])
def test_a_stalled_request_is_closed_after_its_timeout(short, sent):
    """Before, both servers held such connections for as long as the client liked (60 s and more)."""
    for server in short:
        ending = raw_http.send_then_wait(server.url, sent, patience_s=15)
        assert ending.closed_after_s is not None, f"{server.url} still held the connection after 15 s"
        assert ending.status == (408 if sent else 0)


def stream_request(base: str) -> bytes:
    body = {"prompt": [5, 6, 7], "max_tokens": LONG_STREAM, "ignore_eos": True, "temperature": 0.0, "stream": True}
    return raw_http.post_json("/v1/completions", base, json.dumps(body).encode())


@pytest.mark.parametrize("through_router", [False, True], ids=["direct", "through the router"])
def test_a_stream_nobody_reads_is_dropped_and_the_engine_frees_it_at_once(short, through_router):
    """The client asks for a long stream and never reads it. The server it talks to drops it after --write-timeout,
    the replica aborts the engine request (it logs so; a response stuck on a client that does not read never gets
    that far), and the engine gives back every KV block (kvshare_engine_requests, kvshare_kv_blocks_used)."""
    replica, routed = short
    target = routed.url if through_router else replica.url
    mark = len(log_text(replica))
    sock = raw_http.connect(target, receive_buffer=4096)
    try:
        sock.sendall(stream_request(target))
        wait_until(lambda: metric(replica.url, "kvshare_kv_blocks_used") > 0, what="the request to hold KV blocks")
        wait_until(lambda: "client gone); aborting" in log_text(replica)[mark:], timeout_s=30,
                   what="the replica to abort the request of the client that does not read")
        wait_until(lambda: metric(replica.url, "kvshare_engine_requests") == 0, what="the engine to let it go")
        assert metric(replica.url, "kvshare_kv_blocks_used") == 0
        ending = raw_http.wait_for_close(sock, patience_s=10, limit=64 * MiB)
    finally:
        sock.close()
    assert ending.closed_after_s is not None and b"data: [DONE]" not in ending.received
    assert "--write-timeout" in log_text(routed if through_router else replica)
