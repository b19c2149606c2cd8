"""Each policy's promise, checked on the policy objects directly (no I/O: policies are pure placement logic)."""

from __future__ import annotations

import json

import pytest

from kvshare.router.config import RouterConfig
from kvshare.router.policies import POLICIES, make_policy
from kvshare.router.prefix import PrefixMemory, prompt_keys
from kvshare.router.replicas import Replica
from kvshare.router.request import MalformedBody, RequestInfo, parse_request

URLS = tuple(f"http://127.0.0.1:{9000 + i}" for i in range(4))


def fleet(n: int = 3) -> list[Replica]:
    return [Replica(i, URLS[i]) for i in range(n)]


def place(policy, request, replicas):
    chosen = policy.choose(request, [r for r in replicas if r.healthy])
    policy.placed(request, chosen)
    return chosen.index


def test_round_robin_cycles_and_skips_unhealthy():
    policy, replicas = make_policy("round-robin", RouterConfig(URLS[:3])), fleet()
    assert [place(policy, RequestInfo(), replicas) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    replicas[1].healthy = False
    assert [place(policy, RequestInfo(), replicas) for _ in range(4)] == [0, 2, 0, 2]


def test_alternate_moves_each_session_every_turn():
    policy, replicas = make_policy("alternate", RouterConfig(URLS[:2])), fleet(2)
    for session in ("s1", "s2", "s3"):
        turns = [place(policy, RequestInfo(session), replicas) for _ in range(6)]
        assert all(a != b for a, b in zip(turns, turns[1:])), turns


def test_fixed_keeps_sessions_and_moves_few_when_a_replica_joins():
    config = RouterConfig(URLS)
    policy = make_policy("fixed", config)
    sessions = [f"session-{i}" for i in range(400)]
    three, four = fleet(3), fleet(4)
    before = {s: place(policy, RequestInfo(s), three) for s in sessions}
    assert all(place(policy, RequestInfo(s), three) == before[s] for s in sessions)  # sticky
    assert set(before.values()) == {0, 1, 2}  # and spread
    after = {s: place(policy, RequestInfo(s), four) for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    assert all(after[s] == 3 for s in moved)  # rendezvous: sessions only move to the new replica
    assert 0 < len(moved) < len(sessions) / 2


def test_least_loaded_picks_fewest_in_flight():
    policy, replicas = make_policy("least-loaded", RouterConfig(URLS[:3])), fleet()
    replicas[0].in_flight, replicas[1].in_flight, replicas[2].in_flight = 3, 1, 2
    assert place(policy, RequestInfo(), replicas) == 1
    replicas[1].in_flight = 5
    assert place(policy, RequestInfo(), replicas) == 2


def test_cache_aware_follows_the_prefix_until_load_outweighs_it():
    config = RouterConfig(URLS[:2], prefix_chunk_tokens=4, load_weight=0.5)
    policy, replicas = make_policy("cache-aware", config), fleet(2)
    document = tuple(range(100, 132))  # 8 chunks
    first = place(policy, RequestInfo(None, document), replicas)
    turn = RequestInfo(None, document + (7, 8, 9, 10))  # same prefix, longer
    assert place(policy, turn, replicas) == first
    other = 1 - first
    replicas[first].in_flight = 3  # 1.5 load penalty > the whole prompt cached elsewhere is worth (1.0)
    assert place(policy, turn, replicas) == other


def test_cache_aware_uses_text_bytes_when_no_token_ids():
    config = RouterConfig(URLS[:3], prefix_chunk_bytes=16)
    policy, replicas = make_policy("cache-aware", config), fleet()
    text = ("The quick brown fox jumps over the lazy dog. " * 8).encode()
    home = place(policy, RequestInfo(None, None, text), replicas)
    for _ in range(3):
        assert place(policy, RequestInfo(None, None, text + b" And then?"), replicas) == home


def test_prefix_memory_is_bounded_lru():
    memory = PrefixMemory(capacity=4)
    keys = prompt_keys(RequestInfo(None, tuple(range(24))), chunk_tokens=4, chunk_bytes=16)
    memory.remember(keys)
    assert len(memory) == 4
    assert memory.matched_chunks(keys) == 6  # the deepest key survived and stands for the whole prefix
    assert memory.matched_chunks(keys[:2]) == 0  # its early parents were evicted


def test_parse_request_session_and_prompt_forms():
    completions = "/v1/completions"
    assert parse_request(completions, [("x-session-id", "h")], b'{"user": "u", "prompt": "hi"}') == RequestInfo(
        "h", None, b"hi")
    assert parse_request(completions, [], b'{"user": "u", "prompt": [1, 2, 3]}') == RequestInfo("u", (1, 2, 3), b"")
    assert parse_request(completions, [], b'{"prompt": [[5, 6], [7]]}').prompt_ids == (5, 6)
    chat = parse_request("/v1/chat/completions", [], b'{"messages": [{"role": "user", "content": "hello"}]}')
    assert chat.prompt_text == b"user\nhello\n\n"
    assert parse_request("/v1/embeddings", [], b"not json{") == RequestInfo()  # other paths: placed without a prompt


def _placement_oracle(payload: dict) -> RequestInfo:
    """What placement reads from a completions body, written plainly (the router decodes id prompts a faster way)."""
    user = payload.get("user") if isinstance(payload.get("user"), str) and payload.get("user") else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
        return RequestInfo(user, tuple(prompt), b"")
    return RequestInfo(user, None, prompt.encode() if isinstance(prompt, str) else b"")


@pytest.mark.parametrize("body", [
    b'{"prompt": [3, 1, 4, 1, 5], "user": "u", "max_tokens": 4, "stream": true}',
    b'{"prompt": [], "user": ""}',
    b'{"prompt": [0, 100000000000000000000000]}',
    b'{"prompt": [1, true, 2]}', b'{"prompt": [1, -2]}', b'{"prompt": [1, 2.0]}', b'{"prompt": [1, "2"]}',
    b'{"prompt": [[9, 8], [7]], "user": 5}', b'{"prompt": ["ab", "cd"]}', b'{"prompt": "text", "user": "u"}',
    b'{"prompt": null}', b'{"user": "u"}', b'{"prompt": [1, 2], "prompt": [3]}', b'{"prompt": {"ids": [1]}}',
    b'{"prompt": [1, 2], "user": {"deep": [[[[1]]]]}}',
])
def test_every_completions_body_places_as_its_plain_reading(body):
    expected = _placement_oracle(json.loads(body))
    assert parse_request("/v1/completions", [], body) == expected
    # a policy that ignores the prompt gets the same session and no prompt
    assert parse_request("/v1/completions", [], body, read_prompt=False) == RequestInfo(expected.session_id)


def test_chat_messages_win_over_an_id_prompt_and_the_header_over_user():
    body = b'{"prompt": [1, 2, 3], "user": "u", "messages": [{"role": "user", "content": "hi"}]}'
    assert parse_request("/v1/chat/completions", [], body) == RequestInfo("u", None, b"user\nhi\n\n")
    assert parse_request("/v1/completions", [], b'{"prompt": [1, 2], "messages": null}') == RequestInfo()
    assert parse_request("/v1/completions", [("x-session-id", "h")], b'{"prompt": [7], "user": "u"}') == RequestInfo(
        "h", (7,), b"")


@pytest.mark.parametrize("body, says", [
    (b"not json{", "not valid JSON"),
    (b'{"prompt": "ab\\ud800cd"}', "not valid JSON"),  # a lone surrogate: no replica could encode it
    (b'{"prompt": "ab\xed\xa0\x80cd"}', "not valid JSON"),  # the same as UTF-8 bytes
    (b'{"prompt": [1, 2], "suffix": "ab\\ud800cd"}', "not valid JSON"),  # beside an id prompt, in a field placement
    (b'{"prompt": [1, 2], "suffix": "ab\xed\xa0\x80cd"}', "not valid JSON"),  # does not read
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "must be a JSON object"),
])
@pytest.mark.parametrize("read_prompt", [True, False])
def test_generation_requests_with_unreadable_bodies_are_malformed(body, says, read_prompt):
    with pytest.raises(MalformedBody, match=says):
        parse_request("/v1/completions", [], body, read_prompt=read_prompt)


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("random", RouterConfig(URLS[:1]))
    assert set(POLICIES) == {"round-robin", "alternate", "fixed", "least-loaded", "cache-aware"}
