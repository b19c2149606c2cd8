"""Server behaviour that needs a controllable engine: an in-test engine (a real EngineProtocol on its own thread that
echoes the prompt's bytes back) behind the real app, served by uvicorn on a loopback port."""

from __future__ import annotations

import json
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from kvshare.connector.contract import ConnectorStats
from kvshare.engine.api import GenerationRequest, TokenEvent, Usage
from kvshare.hf.detokenize import IncrementalText
from kvshare.processes import free_port
from kvshare.serve.app import create_app

EOS = 256
FAIL = ord("!")  # a prompt starting with "!" makes the engine report an error
FAIL_ALONE = ord("?")  # ... with "?", an error marked as the request's own (it failed alone; others went on)


class ByteTokenizer:
    """Byte-level tokenizer: one token per UTF-8 byte, so multi-byte characters span tokens (as in byte-level BPE)."""

    eos_token_ids = (EOS,)
    vocab_size = 257
    max_token_chars = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class EchoEngine:
    """Generates the prompt's tokens back, one per step, then EOS (or cycles the prompt with ignore_eos).

    One engine thread serves requests in order; `delay` seconds between tokens. Implements EngineProtocol honestly:
    events in order, always ending with a finished event (also after abort)."""

    model_name = "echo"
    eos_token_ids = (EOS,)

    def __init__(self, max_model_len: int = 64, delay: float = 0.0, hits: tuple[int, int] = (0, 0)) -> None:
        self.max_model_len, self.delay, self.hits = max_model_len, delay, hits
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.connector = None
        self._abort_flags: set[str] = set()
        self._lock = threading.Lock()  # guards _abort_flags/aborted: written by server threads, read by the engine
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(self, request, callback) -> None:
        self.submitted.append(request)
        self._queue.put((request, callback))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._abort_flags.add(request_id)
            self.aborted.append(request_id)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._generate(*item)

    def _generate(self, request: GenerationRequest, callback) -> None:
        prompt, sampling, rid = request.prompt_ids, request.sampling, request.request_id
        usage = lambda n: Usage(len(prompt), n, *self.hits)  # noqa: E731
        if prompt[0] in (FAIL, FAIL_ALONE):
            return callback(TokenEvent(rid, None, True, "error", usage(0), error="echo engine told to fail",
                                       request_caused=prompt[0] == FAIL_ALONE))
        for n in range(sampling.max_tokens):
            time.sleep(self.delay)
            with self._lock:
                if rid in self._abort_flags:
                    return callback(TokenEvent(rid, None, True, "abort", usage(n)))
            token = prompt[n % len(prompt)] if sampling.ignore_eos or n < len(prompt) else EOS
            if token == EOS or token in sampling.stop_token_ids:
                return callback(TokenEvent(rid, token, True, "stop", usage(n + 1)))
            last = n + 1 == sampling.max_tokens
            callback(TokenEvent(rid, token, last, "length" if last else None, usage(n + 1) if last else None))


@contextmanager
def serving(engine: EchoEngine):
    """The real app on uvicorn in a thread of this process (so the test can reach into the in-test engine)."""
    app = create_app(engine, ByteTokenizer(), "echo", is_alive=engine.is_alive,
                     connector_stats=lambda: engine.connector.stats if engine.connector else None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture
def engine():
    return EchoEngine(hits=(3, 5))


@pytest.fixture
def url(engine):
    with serving(engine) as base:
        yield base


def sse_events(response: httpx.Response) -> list:
    """Parsed `data:` payloads in order; the last must be [DONE]."""
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "echo", **body}, timeout=30)


def stream_completion(url: str, **body) -> list:
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "echo", "stream": True, **body},
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


# ------------------------------------------------------------------------------------------------ detokenization


def test_incremental_text_holds_back_partial_utf8_and_stop_prefixes():
    tok = ByteTokenizer()
    text = "naïve € x STOP y"
    inc = IncrementalText(tok.decode, stop=("STOP",))
    deltas = [inc.add(i) for i in tok.encode(text)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + inc.finish() == "naïve € x "
    assert inc.stopped
    # Without stop strings the deltas rebuild the whole text, and "S", "ST", "STO" were never sent early.
    inc = IncrementalText(tok.decode)
    assert "".join(inc.add(i) for i in tok.encode(text)) + inc.finish() == text


def test_incremental_text_flushes_a_truly_invalid_tail():
    inc = IncrementalText(ByteTokenizer().decode)
    assert inc.add(ord("a")) == "a"
    assert inc.add(0xE2) == ""  # first byte of a 3-byte character: held back
    assert inc.finish() == "\ufffd"  # the sequence never completed: now it is a real replacement character


# ------------------------------------------------------------------------------------------------ completions


@pytest.mark.parametrize("prompt", ["héllo wörld €", list("plain".encode())])
def test_stream_equals_non_stream_and_chunks_arrive_in_order(url, prompt):
    expected = prompt if isinstance(prompt, str) else bytes(prompt).decode()
    whole = complete(url, prompt=prompt, max_tokens=40).json()
    assert whole["choices"][0]["text"] == expected
    assert whole["choices"][0]["finish_reason"] == "stop"
    chunks = stream_completion(url, prompt=prompt, max_tokens=40)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == expected
    assert len([t for t in texts if t]) == len(expected)  # one chunk per character: flushed per event, in order
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["id"] == chunks[0]["id"] for c in chunks)


def test_sampling_fields_reach_the_engine(url, engine):
    complete(url, prompt="abc", max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop_token_ids=[1],
             ignore_eos=True, cache_salt="tenant-a", user="u1")
    request = engine.submitted[-1]
    assert request.prompt_ids == tuple(b"abc")
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop_token_ids, s.ignore_eos) == (5, 0.5, 0.9, 7, (1,),
                                                                                              True)
    assert request.cache_salt == "tenant-a"


def test_length_limit_and_stop_token(url):
    body = complete(url, prompt="abcdef", max_tokens=3).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("abc", "length")
    body = complete(url, prompt="abcdef", max_tokens=10, stop_token_ids=[ord("d")]).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("abc", "stop")


def test_stop_string_cuts_text_and_aborts_the_engine_request(url, engine):
    body = complete(url, prompt="hello world again", max_tokens=40, stop=["o w", "zz"]).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("hell", "stop")
    assert engine.submitted[-1].request_id in engine.aborted
    chunks = stream_completion(url, prompt="hello world again", max_tokens=40, stop="o w")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hell"


def test_usage_reports_cached_tokens_and_kvshare_hits(url):
    usage = complete(url, prompt="abcdefgh", max_tokens=4).json()["usage"]
    assert usage == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12,
                     "prompt_tokens_details": {"cached_tokens": 8},
                     "kvshare": {"local_hit_tokens": 3, "pool_hit_tokens": 5}}
    chunks = stream_completion(url, prompt="abcdefgh", max_tokens=4)
    assert chunks[-1]["kvshare"] == {"local_hit_tokens": 3, "pool_hit_tokens": 5}  # even without include_usage
    assert all("usage" not in c for c in chunks)
    chunks = stream_completion(url, prompt="abcdefgh", max_tokens=4, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_engine_error_is_reported_not_hung(url):
    response = complete(url, prompt="!boom", max_tokens=4)
    assert response.status_code == 500 and "echo engine told to fail" in response.json()["error"]["message"]
    assert "x-kvshare-error-cause" not in response.headers  # the replica may be at fault: a router may retry
    chunks = stream_completion(url, prompt="!boom", max_tokens=4)
    assert "echo engine told to fail" in chunks[-1]["error"]["message"]


def test_a_request_that_failed_alone_is_marked_so_a_router_does_not_retry_it(url):
    response = complete(url, prompt="?boom", max_tokens=4)
    assert response.status_code == 500 and response.headers["x-kvshare-error-cause"] == "request"
    assert response.json()["error"]["code"] == "request_failed"
    chunks = stream_completion(url, prompt="?boom", max_tokens=4)
    assert chunks[-1]["error"]["code"] == "request_failed"


# ------------------------------------------------------------------------------------------------ chat


def test_chat_stream_starts_with_role_then_content(url):
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()
    expected = "<user>hi<assistant>"
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": expected}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        chunks = sse_events(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["delta"] == {}


# ------------------------------------------------------------------------------------------------ errors


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: object  # dict -> JSON; bytes -> raw body
    status: int
    says: str


BAD = [
    Bad("too long", "/v1/completions", {"prompt": "x" * 70}, 400, "70"),
    Bad("prompt+max_tokens too long", "/v1/completions", {"prompt": "x" * 60, "max_tokens": 10}, 400, "64"),
    Bad("malformed json", "/v1/completions", b'{"prompt": "x",', 400, "JSON"),
    Bad("not an object", "/v1/completions", b"[1, 2]", 400, "object"),
    Bad("prompt wrong type", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    Bad("max_tokens wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    Bad("stream wrong type", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    Bad("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    Bad("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    Bad("empty prompt", "/v1/completions", {"prompt": ""}, 400, "empty"),
    Bad("empty id list", "/v1/completions", {"prompt": []}, 400, "empty"),
    Bad("id out of vocab", "/v1/completions", {"prompt": [1, 257]}, 400, "257"),
    Bad("negative id", "/v1/completions", {"prompt": [-1]}, 400, "-1"),
    Bad("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    Bad("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    Bad("n=2", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n=2"),
    Bad("unknown path", "/v1/embeddings", {"input": "x"}, 404, "/v1/embeddings"),
    Bad("chat no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    Bad("chat wrong content", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
        "messages"),
    Bad("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 80}]}, 400,
        "maximum context length"),
    Bad("chat unknown model", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                      "content": "a"}]}, 404, "nope"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(url):
    for bad in BAD:
        if isinstance(bad.body, bytes):
            response = httpx.post(f"{url}{bad.path}", content=bad.body, timeout=30,
                                  headers={"content-type": "application/json"})
        else:
            response = httpx.post(f"{url}{bad.path}", json=bad.body, timeout=30)
        assert response.status_code == bad.status, (bad.name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, bad.name
        assert error["type"] == "invalid_request_error"
        assert bad.says in error["message"], (bad.name, error["message"])
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert complete(url, prompt="ok", max_tokens=2).json()["choices"][0]["text"] == "ok"


# ------------------------------------------------------------------------------------------------ metrics, health


def metric(text: str, name: str) -> float:
    """The value of one exposition line, e.g. 'kvshare_requests_total{endpoint="/v1/completions",status="200"}'."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_requests_ttft_tokens_and_pool_stats(url, engine):
    engine.connector = type("Connector", (), {"stats": ConnectorStats(load_bytes=4096, load_seconds=0.5, errors=2)})
    complete(url, prompt="abcd", max_tokens=2)
    stream_completion(url, prompt="abcd", max_tokens=2)
    complete(url, prompt="x", model="nope")
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric(text, 'kvshare_requests_total{endpoint="/v1/completions",status="200"}') == 2
    assert metric(text, 'kvshare_requests_total{endpoint="/v1/completions",status="404"}') == 1
    assert metric(text, 'kvshare_time_to_first_token_seconds_count{endpoint="/v1/completions"}') == 2
    assert metric(text, 'kvshare_time_to_first_token_seconds_bucket{endpoint="/v1/completions",le="300.0"}') == 2
    assert metric(text, "kvshare_prompt_tokens_total") == 8
    assert metric(text, "kvshare_local_hit_tokens_total") == 6
    assert metric(text, "kvshare_pool_hit_tokens_total") == 10
    assert metric(text, "kvshare_pool_load_bytes_total") == 4096
    assert metric(text, "kvshare_pool_load_seconds_total") == 0.5
    assert metric(text, "kvshare_pool_errors_total") == 2
    assert metric(text, "kvshare_requests_running") == 0


def test_two_apps_in_one_process_have_separate_metrics():
    first, second = EchoEngine(), EchoEngine()
    try:
        a, b = create_app(first, ByteTokenizer(), "echo"), create_app(second, ByteTokenizer(), "echo")
        assert a.state.server.metrics.registry is not b.state.server.metrics.registry
    finally:
        first.shutdown()
        second.shutdown()


def test_health_follows_the_engine_loop(url, engine):
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    engine.shutdown()  # the engine thread ends
    response = httpx.get(f"{url}/health", timeout=30)
    assert response.status_code == 503 and "engine" in response.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ disconnect


def wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_mid_stream_aborts_the_request():
    engine = EchoEngine(max_model_len=100_000, delay=0.02)
    with serving(engine) as base:
        body = {"model": "echo", "prompt": "abc", "max_tokens": 50_000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert len(received) >= 2
        rid = engine.submitted[-1].request_id
        assert wait_for(lambda: rid in engine.aborted), "the engine request was not aborted after the client left"
        # and the server still serves (the engine moved on to the next request)
        engine.delay = 0.0
        assert complete(base, prompt="ok", max_tokens=2).json()["choices"][0]["text"] == "ok"


def test_client_disconnect_while_waiting_for_a_whole_response_aborts():
    engine = EchoEngine(max_model_len=100_000, delay=0.02)
    with serving(engine) as base:
        body = {"model": "echo", "prompt": "abc", "max_tokens": 50_000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        rid = engine.submitted[-1].request_id
        assert wait_for(lambda: rid in engine.aborted)


def test_prompt_ids_are_checked_against_the_vocabulary_read_once():
    """A real tokenizer computes its size by walking the vocabulary; read per prompt id, a 32k-id prompt spent two
    minutes in validation on the H200 host. The server reads it once per request."""

    class CountingTokenizer(ByteTokenizer):
        reads = 0

        @property
        def vocab_size(self):
            CountingTokenizer.reads += 1
            return 257

    engine = EchoEngine(max_model_len=1000)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, CountingTokenizer(), "echo"), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        base = f"http://127.0.0.1:{server.config.port}"
        before = CountingTokenizer.reads
        assert complete(base, prompt=[65] * 100, max_tokens=2).status_code == 200
        assert CountingTokenizer.reads - before <= 2
        assert complete(base, prompt=[65, 300], max_tokens=2).status_code == 400
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
