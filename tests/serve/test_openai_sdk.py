"""The openai SDK against `kvshare route` in front of two `kvshare serve` replicas sharing a pool: completions (one
prompt and a batch), chat, streaming both, logprobs, models.list and models.retrieve, vLLM's /tokenize through the
router; a session's second turn on the other replica loads its prefix from the pool."""

from __future__ import annotations

import time

import httpx
import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.testing import start_pool
from kvshare.router.local import router

from .conftest import MODEL, kvshare_serve

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # a pool, two replicas and a router: ~30 s on 2 cores, mostly start-up

DOCUMENT = "A shared pool lets the next turn of a session run on another replica without prefilling again. " * 3


@pytest.fixture(scope="module")
def deployment(tiny_model):
    started = []
    with start_pool("64MiB") as (pool, _):
        try:
            for _ in range(2):
                started.append(kvshare_serve(tiny_model, "--pool", pool, "--chunk-tokens", "32")
                               .start(ready_timeout_s=180))
            started.append(router([r.url for r in started], "alternate").start())
            yield started[-1].url, pool
        finally:
            for process in reversed(started):
                process.stop()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=f"{deployment[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_one_prompt_and_a_batch(client):
    one = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=2)
    assert one.choices[0].finish_reason in ("length", "stop") and one.usage.completion_tokens <= 5
    assert len(one.choices[0].logprobs.tokens) == one.usage.completion_tokens
    batch = client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], max_tokens=5,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    usage = None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in batch.choices]
    assert usage.completion_tokens == batch.usage.completion_tokens


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Answer <briefly> & \"exactly\"."},
                {"role": "user", "content": "Name three colours — naïvely."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    events = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == whole.choices[0].message.content


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_unsupported_parameters_are_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_tokenize_through_the_router(deployment):
    base, _ = deployment
    tokens = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": DOCUMENT}, timeout=60).json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=60).json()["prompt"]
    assert text == DOCUMENT


def test_a_sessions_next_turn_on_the_other_replica_hits_the_pool(client, deployment):
    _, pool = deployment
    first = client.completions.create(model=MODEL, prompt=DOCUMENT, max_tokens=2, user="session-1")
    with PoolClient.connect(pool, map_arena=False) as probe:  # stores commit after the answer: wait, boundedly
        deadline = time.monotonic() + 60
        while probe.stats().chunks < first.usage.prompt_tokens // 32 and time.monotonic() < deadline:
            time.sleep(0.1)
    second = client.completions.create(model=MODEL, prompt=DOCUMENT, max_tokens=2, user="session-1")
    assert first.model_extra["kvshare"]["pool_hit_tokens"] == 0
    assert second.model_extra["kvshare"]["pool_hit_tokens"] >= 32  # alternate: the other replica, from the pool
    assert second.usage.prompt_tokens_details.cached_tokens == second.model_extra["kvshare"]["pool_hit_tokens"]
