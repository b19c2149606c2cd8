"""The router's request counter says what each replica answered: a `status` label beside `replica`."""

from __future__ import annotations

from .helpers import complete, metric


def test_requests_are_counted_by_replica_and_status(make_router, replicas):
    replica = replicas[0]
    base = make_router([replica.url], "round-robin").url
    assert [complete(base).status_code for _ in range(2)] == [200, 200]
    assert complete(base, max_tokens=-1).status_code == 400  # the replica's own 400, relayed as is
    assert complete(base, stub={"status": 503}).status_code == 503  # no other replica to retry on: relayed
    counted = {status: metric(base, "kvshare_router_requests_total", replica=replica.url, status=status)
               for status in ("200", "400", "503")}
    assert counted == {"200": 2, "400": 1, "503": 1}
    assert metric(base, "kvshare_router_requests_total") == 4  # nothing else counted
