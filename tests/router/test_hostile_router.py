"""The router against hostile clients, in front of stub replicas (real processes on loopback): it retries no request
whose failure is its own, answers unreadable bodies with 400 JSON itself, bounds bodies and headers without buffering
more than the limit, writes each header once, keeps /admin/policy behind its token, and times out clients that stall
or stop reading. Each test fails on the router before issue 18 (see the report of that change)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvshare.validate import raw_http
from tests.reliability.http_watch import PeakRss, log_text, new_log_lines

from .helpers import ADMIN_TOKEN, REPLICA_HEADER, complete, metric, set_policy, state, wait_until
from .servers import stub_replica

SHORT = ("--header-timeout", "1", "--body-timeout", "1", "--write-timeout", "1", "--send-buffer", "16KiB")
MiB = 1 << 20


def stub_requests(replica) -> int:
    return httpx.get(f"{replica.url}/stub/state", timeout=10).json()["requests"]


# ------------------------------------------------------------------------------------------------ retries


def test_a_request_caused_5xx_is_relayed_not_retried(make_router, launch):
    a, b = launch(stub_replica("A")), launch(stub_replica("B"))
    base = make_router([a.url, b.url], "round-robin").url
    response = complete(base, stub={"status": 500, "request_caused": True})
    assert response.status_code == 500 and response.headers["x-kvshare-error-cause"] == "request"
    assert (stub_requests(a), stub_requests(b)) == (1, 0)  # round-robin's first pick, and no one else
    assert metric(base, "kvshare_router_errors_total", replica=a.url, kind="request_5xx") == 1
    # the same 5xx without the mark is the replica's fault: retried on the other one
    assert complete(base, stub={"status": 500}).status_code == 500
    assert (stub_requests(a), stub_requests(b)) == (2, 1)


def test_a_4xx_is_relayed_not_retried(make_router, launch):
    a, b = launch(stub_replica("A")), launch(stub_replica("B"))
    base = make_router([a.url, b.url], "round-robin").url
    assert complete(base, max_tokens=-1).status_code == 400
    assert stub_requests(a) + stub_requests(b) == 1


# ------------------------------------------------------------------------------------------------ bodies


UNREADABLE = {
    "lone surrogate": b'{"prompt": "ab\\ud800cd", "max_tokens": 2}',
    "lone surrogate as UTF-8 bytes": b'{"prompt": "ab\xed\xa0\x80cd", "max_tokens": 2}',
    "invalid UTF-8": b'{"prompt": "ab\xff\xfe", "max_tokens": 2}',
    "nested 100k deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "not JSON": b"this is not json",
    "not an object": b"[1, 2, 3]",
    "NaN (not JSON)": b'{"prompt": "x", "temperature": NaN}',
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_bodies_get_400_json_from_the_router(make_router, launch, case, path):
    stub = launch(stub_replica("A"))
    base = make_router([stub.url], "round-robin").url
    response = httpx.post(f"{base}{path}", content=UNREADABLE[case], headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400, response.text[:200]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and len(error["message"]) > 20
    assert stub_requests(stub) == 0  # answered by the router: no replica saw it
    assert complete(base).status_code == 200


def chunks(total: int, size: int = MiB):
    sent = 0
    while sent < total:
        sent += size
        yield b" " * size


def post_big(base: str, total: int, declared: bool) -> httpx.Response:
    """A body of `total` bytes, declared up front (Content-Length) or chunked; the server may answer before the
    client is done (httpx then reads the answer after its failed write)."""
    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(total)
    return httpx.post(f"{base}/v1/completions", content=chunks(total), headers=headers, timeout=120)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_and_the_router_never_buffers_it(make_router, launch, declared):
    """256 MiB against the default 16 MiB limit. Before, the router buffered every byte (a 512 MiB body peaked it at
    2.8 GB) and forwarded it; now it answers 413 after at most the limit, and its memory hardly moves."""
    stub = launch(stub_replica("A"))
    routed = make_router([stub.url], "round-robin")
    with PeakRss(routed.process.pid) as rss:
        response = post_big(routed.url, 256 * MiB, declared)
    assert response.status_code == 413, response.text[:200]
    assert "--max-body-size" in response.json()["error"]["message"]
    assert rss.growth_mib < 100, f"router grew by {rss.growth_mib:.0f} MiB"
    assert stub_requests(stub) == 0
    assert complete(routed.url).status_code == 200


def test_a_body_under_the_limit_still_goes_through(make_router, launch):
    stub = launch(stub_replica("A"))
    base = make_router([stub.url], "round-robin", "--max-body-size", "2MiB").url
    body = json.dumps({"prompt": "x" * (MiB + 1000), "max_tokens": 2}).encode()
    assert httpx.post(f"{base}/v1/completions", content=body, timeout=30).status_code == 200
    big = json.dumps({"prompt": "x" * (2 * MiB), "max_tokens": 2}).encode()
    assert httpx.post(f"{base}/v1/completions", content=big, timeout=30).status_code == 413


def test_headers_over_the_limit_get_431(make_router, replicas):
    base = make_router([replicas[0].url], "round-robin").url
    response = httpx.get(f"{base}/health", headers={"x-padding": "a" * (32 << 10)}, timeout=30)
    assert response.status_code == 431 and "--max-header-size" in response.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ headers


def test_bytes_that_are_not_http_get_400_json(make_router, replicas):
    routed = make_router([replicas[0].url], "round-robin")
    ending = raw_http.send_then_wait(routed.url, b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n", patience_s=10)
    assert ending.status == 400 and ending.closed_after_s is not None
    assert json.loads(ending.received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http"


def test_each_header_once_and_hop_by_hop_headers_dropped(make_router, replicas):
    base = make_router([replicas[0].url], "round-robin").url
    whole = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as streamed:
        streamed.read()
    for response in (whole, streamed):
        names = [name.decode().lower() for name, _ in response.headers.raw]
        assert sorted(n for n in set(names) if names.count(n) > 1) == []
        assert {"date", "server", REPLICA_HEADER} <= set(names)
    echoed = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "stub": {"echo_headers": True}}, timeout=30,
                        headers={"connection": "keep-alive, x-hop", "x-hop": "1", "keep-alive": "timeout=5",
                                 "x-session-id": "s1", "te": "trailers"}).json()["headers"]
    received = {name for name, _ in echoed}
    assert not received & {"x-hop", "keep-alive", "te"}  # hop-by-hop, including what Connection names
    assert "x-session-id" in received


# ------------------------------------------------------------------------------------------------ admin


def test_policy_switch_needs_the_admin_token(make_router, replicas):
    base = make_router([replicas[0].url], "round-robin").url
    assert set_policy(base, "fixed", token=None).status_code == 401
    wrong = set_policy(base, "fixed", token="guess")
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert state(base)["policy"] == "round-robin"
    assert set_policy(base, "fixed", token=ADMIN_TOKEN).status_code == 200
    assert state(base)["policy"] == "fixed"


def test_without_a_token_file_policy_switches_are_refused_for_everyone(launch, replicas):
    from kvshare.router.local import router as plain_router

    base = launch(plain_router([replicas[0].url], "round-robin")).url
    refused = set_policy(base, "fixed", token=ADMIN_TOKEN)
    assert refused.status_code == 403 and "--admin-token-file" in refused.json()["error"]["message"]
    assert state(base)["policy"] == "round-robin"


# ------------------------------------------------------------------------------------------------ time


@pytest.mark.parametrize("sent", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",  # headers cut short
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\": [1, 2, ",  # half a body
], ids=["half-sent headers", "half-sent body"])
def test_a_half_sent_request_is_answered_408_and_closed(make_router, replicas, sent):
    routed = make_router([replicas[0].url], "round-robin", *SHORT)
    ending = raw_http.send_then_wait(routed.url, sent, patience_s=15)
    assert ending.closed_after_s is not None, "the router still held the connection after 15 s"
    assert ending.status == 408 and b"timeout" in ending.received
    assert complete(routed.url).status_code == 200


def test_an_idle_connection_is_closed(make_router, replicas):
    routed = make_router([replicas[0].url], "round-robin", *SHORT)
    assert raw_http.send_then_wait(routed.url, b"", patience_s=15).closed_after_s is not None


def test_a_client_that_stops_reading_a_stream_is_dropped(make_router, launch):
    """A stream of ~2 MB that the client never reads: the router drops it after --write-timeout and lets go of the
    replica (its in-flight count goes back to 0) while the client's socket is still open."""
    stub = launch(stub_replica("A"))
    routed = make_router([stub.url], "round-robin", *SHORT)
    body = json.dumps({"prompt": "x", "max_tokens": 200_000, "stream": True}).encode()
    sock = raw_http.connect(routed.url, receive_buffer=4096)
    try:
        sock.sendall(raw_http.post_json("/v1/completions", routed.url, body))
        wait_until(lambda: metric(routed.url, "kvshare_router_in_flight", replica=stub.url) == 1, what="streaming")
        wait_until(lambda: metric(routed.url, "kvshare_router_in_flight", replica=stub.url) == 0, timeout_s=30,
                   what="the router to drop the client that does not read")
        ending = raw_http.wait_for_close(sock, patience_s=10, limit=64 * MiB)
    finally:
        sock.close()
    assert ending.closed_after_s is not None and b"data: [DONE]" not in ending.received
    assert "--write-timeout" in log_text(routed)


def test_a_client_leaving_mid_body_costs_one_log_line(make_router, replicas):
    routed = make_router([replicas[0].url], "round-robin")
    mark = len(log_text(routed))
    raw_http.send_then_leave(routed.url, raw_http.request_head("POST", "/v1/completions", routed.url,
                                                               content_length=1000) + b'{"prompt": "a')
    lines = new_log_lines(routed, mark)
    assert len(lines) == 1 and "middle of its request body" in lines[0], lines
    assert complete(routed.url).status_code == 200


def test_connections_beyond_the_cap_get_503_at_once(make_router, replicas):
    routed = make_router([replicas[0].url], "round-robin", "--max-connections", "4")
    held = [raw_http.connect(routed.url) for _ in range(4)]
    try:
        wait_until(lambda: _refused_now(routed.url), timeout_s=10, what="a fifth connection refused")
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: complete(routed.url).status_code == 200, timeout_s=10, what="serving again")


def _refused_now(base: str) -> bool:
    ending = raw_http.send_then_wait(base, b"", patience_s=5)
    return ending.status == 503 and b"--max-connections" in ending.received


def test_socket_helpers_speak_plain_http(make_router, replicas):
    """The raw client used above gets a normal answer from a normal request (so its 408s are the router's doing)."""
    routed = make_router([replicas[0].url], "round-robin", *SHORT)
    request = raw_http.request_head("GET", "/health", routed.url, headers={"Connection": "close"})
    ending = raw_http.send_then_wait(routed.url, request, patience_s=10)
    assert ending.status == 200 and ending.closed_after_s is not None
