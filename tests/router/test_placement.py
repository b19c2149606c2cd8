"""Through a real router process in front of three real stub replicas: each policy places requests as it promises,
and the policy can be switched at run time."""

from __future__ import annotations

import threading

import httpx
import pytest

from .helpers import REPLICA_HEADER, served_by, set_policy, state, wait_until
from .servers import router


@pytest.fixture(scope="module")
def routed(replicas):
    server = router([r.url for r in replicas], "round-robin", "--prefix-chunk-tokens", "4").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def base(routed):
    """The shared router, with a fresh round-robin policy for each test."""
    assert set_policy(routed, "round-robin").status_code == 200
    return routed


def test_round_robin_visits_each_replica_in_turn(base, replicas):
    names = [served_by(base) for _ in range(6)]
    assert names[:3] == ["A", "B", "C"] and names[3:] == names[:3]


def test_router_header_names_the_replica_that_served(base, replicas):
    urls = {r.url: name for r, name in zip(replicas, "ABC")}
    for _ in range(3):
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert urls[response.headers[REPLICA_HEADER]] == response.json()["replica"]


@pytest.mark.parametrize("how", ["header", "user"])
def test_alternate_moves_a_session_to_another_replica_every_turn(base, how):
    assert set_policy(base, "alternate").status_code == 200
    for session in ("s-1", "s-2"):
        if how == "header":
            turns = [served_by(base, session) for _ in range(5)]
        else:
            turns = [served_by(base, user=session) for _ in range(5)]
        assert all(a != b for a, b in zip(turns, turns[1:])), turns


def test_fixed_keeps_each_session_on_one_replica(base):
    set_policy(base, "fixed")
    homes = {}
    for session in (f"user-{i}" for i in range(12)):
        turns = {served_by(base, user=session) for _ in range(3)}
        assert len(turns) == 1, (session, turns)
        homes[session] = turns.pop()
    assert len(set(homes.values())) >= 2  # sessions spread over replicas


def test_cache_aware_returns_a_prefix_to_its_replica(base):
    set_policy(base, "cache-aware")
    homes = set()
    for doc in range(3):
        document = list(range(1000 * doc, 1000 * doc + 16))  # 4 chunks of 4 tokens
        home = served_by(base, prompt=document)
        for turn in range(3):
            assert served_by(base, prompt=document + [7] * (turn + 1)) == home
        homes.add(home)
    assert len(homes) >= 2  # unrelated prompts (no prefix anywhere) take round-robin turns


def test_least_loaded_avoids_the_busy_replica(base, replicas):
    set_policy(base, "least-loaded")
    held = {"prompt": "x", "max_tokens": 3, "stream": True, "stub": {"hold_after": 1}}
    opened = threading.Event()
    busy = {}

    def hold():
        with httpx.stream("POST", f"{base}/v1/completions", json=held, timeout=30) as response:
            busy["name"] = response.headers[REPLICA_HEADER]
            lines = response.iter_lines()
            next(lines)
            opened.set()
            busy["rest"] = list(lines)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(20)
        names = [served_by(base) for _ in range(4)]
        busy_name = {r.url: n for r, n in zip(replicas, "ABC")}[busy["name"]]
        assert busy_name not in names
        assert state(base)["replicas"][["A", "B", "C"].index(busy_name)]["in_flight"] == 1
    finally:
        for replica in replicas:
            httpx.post(f"{replica.url}/stub/release", timeout=10)
        holder.join(20)
    assert "data: [DONE]" in busy["rest"]
    wait_until(lambda: all(r["in_flight"] == 0 for r in state(base)["replicas"]), what="in-flight back to 0")


def test_policy_switch_at_run_time(base):
    assert state(base)["policy"] == "round-robin"
    assert len({served_by(base, "one-session") for _ in range(3)}) == 3
    response = set_policy(base, "fixed")
    assert response.status_code == 200 and response.json()["policy"] == "fixed"
    assert len({served_by(base, "one-session") for _ in range(3)}) == 1
    bad = set_policy(base, "random")
    assert bad.status_code == 400 and "cache-aware" in bad.json()["error"]["message"]
    assert state(base)["policy"] == "fixed"


def test_models_are_aggregated(base):
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["stub"]
