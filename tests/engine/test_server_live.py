"""The server in front of the real engine: a `kvshare serve` process on the tiny generated model, over loopback."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from kvshare.hf.tokenizer import Tokenizer
from kvshare.processes import free_port

MAX_MODEL_LEN = 256


@contextlib.contextmanager
def replica(model_dir, *extra: str):
    """A `kvshare serve` process, healthy on a free loopback port; stopped (then killed if need be) however the
    test ends."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            process.kill()
            pytest.fail(f"kvshare serve did not become healthy:\n{process.communicate(timeout=10)[0]}")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def url(tiny_model):
    with replica(tiny_model) as base:
        yield base


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model)


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "tiny", **body}, timeout=60)


def stream(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": "tiny", "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest. " * 2


@pytest.mark.parametrize("as_ids", [False, True])
def test_streamed_greedy_text_equals_the_whole_response(url, tokenizer, as_ids):
    prompt = tokenizer.encode(PROMPT) if as_ids else PROMPT
    whole = post(url, "/v1/completions", prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True).json()
    chunks = stream(url, "/v1/completions", prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == whole["choices"][0]["text"]
    assert len([t for t in texts if t]) > 1  # really incremental, not one buffered chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 24


def test_usage_counts_prompt_tokens_and_local_cache_hits(url, tokenizer):
    prompt = "A fresh document about usage accounting, long enough to fill several blocks of sixteen tokens. " * 3
    first = post(url, "/v1/completions", prompt=prompt, max_tokens=4).json()["usage"]
    n = len(tokenizer.encode(prompt))
    assert (first["prompt_tokens"], first["completion_tokens"], first["total_tokens"]) == (n, 4, n + 4)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    second = post(url, "/v1/completions", prompt=prompt, max_tokens=4).json()
    hits = second["usage"]["kvshare"]
    assert hits["pool_hit_tokens"] == 0 and hits["local_hit_tokens"] > 0  # the replica's own prefix cache
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == hits["local_hit_tokens"]
    assert second["kvshare"] == hits
    chunks = stream(url, "/v1/completions", prompt=prompt, max_tokens=4, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == n
    assert chunks[-2]["kvshare"]["local_hit_tokens"] > 0


def test_openai_client_streams_a_chat_completion(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    events = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].message.content
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(url, tokenizer):
    too_long = [5] * (MAX_MODEL_LEN + 10)
    cases = [
        (dict(prompt=too_long), 400, str(MAX_MODEL_LEN + 10)),
        (dict(prompt=[1, tokenizer.vocab_size]), 400, str(tokenizer.vocab_size)),
        (dict(prompt="hi", model="other-model"), 404, "other-model"),
        (dict(prompt="hi", max_tokens=0), 400, "max_tokens"),
        (dict(prompt=""), 400, "empty"),
        (dict(prompt="hi", temperature="hot"), 400, "temperature"),
    ]
    for body, status, says in cases:
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)
        assert response.status_code == status, (body, response.text)
        assert says in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    response = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert post(url, "/v1/completions", prompt="still fine", max_tokens=2).status_code == 200


def scrape(url: str) -> dict[str, float]:
    """/metrics as {series: value}."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_metrics_count_requests_and_ttft(url):

    requests = 'kvshare_requests_total{endpoint="/v1/chat/completions",status="200"}'
    ttft = 'kvshare_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"}'
    before = scrape(url)
    messages = [{"role": "user", "content": "count me"}]
    post(url, "/v1/chat/completions", messages=messages, max_tokens=2)
    stream(url, "/v1/chat/completions", messages=messages, max_tokens=2)
    after = scrape(url)
    assert after[requests] - before.get(requests, 0) == 2
    assert after[ttft] - before.get(ttft, 0) == 2
    assert after["kvshare_prompt_tokens_total"] > before.get("kvshare_prompt_tokens_total", 0)


@pytest.mark.slow  # a pool and two replica processes: ~30 s on 2 cores, mostly start-up
def test_pool_hits_reach_usage_and_metrics_across_replicas(tiny_model, tokenizer):
    """A prompt served by replica A is stored in the pool; replica B then reports pool hits in usage and pool loads
    on /metrics, and A's /metrics shows the stores."""
    from kvshare.pool.testing import start_pool

    prompt = tokenizer.encode("Shared context for two replicas, long enough for several full chunks. " * 6)[:100]
    with start_pool("64MiB") as (address, _), replica(tiny_model, "--pool", address, "--chunk-tokens", "32") as a, \
            replica(tiny_model, "--pool", address, "--chunk-tokens", "32") as b:
        first = post(a, "/v1/completions", prompt=prompt, max_tokens=2).json()
        assert first["usage"]["kvshare"]["pool_hit_tokens"] == 0
        deadline = time.monotonic() + 30  # stores complete after the response: wait for them, boundedly
        while time.monotonic() < deadline and scrape(a).get("kvshare_pool_stores_total", 0) < 3:
            time.sleep(0.1)
        stored = scrape(a)
        assert stored["kvshare_pool_stores_total"] >= 3 and stored["kvshare_pool_store_bytes_total"] > 0
        chunks = stream(b, "/v1/completions", prompt=prompt, max_tokens=2, stream_options={"include_usage": True})
        usage = chunks[-1]["usage"]
        assert usage["kvshare"]["pool_hit_tokens"] == 96  # 3 full chunks of 32 (at least one token is computed)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 96
        assert chunks[-2]["kvshare"] == usage["kvshare"]
        loaded = scrape(b)
        assert loaded["kvshare_pool_load_bytes_total"] > 0 and loaded["kvshare_pool_hit_tokens_total"] == 96
