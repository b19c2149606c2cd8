"""The soak's requests and their check: bounded, seeded mixed requests through the router, each completed answer
compared with a cache-OFF reference replica.

Requests send token ids (so the text round trip cannot change the prompt) with greedy sampling, `ignore_eos` and a
fixed max_tokens: fp32 on CPU is deterministic, so the answer text must equal the reference's exactly (I6, I7).
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

VOCAB = range(16, 1000)  # ordinary tokens of the tiny model (its tokenizer reserves the first ids)
SESSION_TURNS = 4
MAX_PROMPT = 1500


@dataclass(frozen=True)
class Request:
    ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    session: str


@dataclass(frozen=True)
class Outcome:
    """One request: ok with text, or failed (connection cut, error status, stream without an end)."""

    request: Request
    started: float
    ended: float
    ok: bool
    text: str = ""
    pool_hit_tokens: int = 0
    error: str = ""


class Prompts:
    """Seeded prompts: a few shared prefixes (cross-replica hits) plus per-worker sessions (next turn = prompt +
    answer + new tokens)."""

    def __init__(self, seed: int, shared: list[list[int]], encode) -> None:
        self.rng = random.Random(seed)
        self.shared = shared
        self.encode = encode
        self.session: list[int] = []
        self.turn = 0
        self.session_id = f"s{seed}-0"

    def next(self, last_answer: str) -> Request:
        rng = self.rng
        stream, max_tokens = rng.random() < 0.5, rng.choice((4, 8, 16))
        if rng.random() < 0.5:
            ids = rng.choice(self.shared) + self._random(rng.randint(5, 40))
            return Request(tuple(ids), max_tokens, stream, f"shared-{rng.randrange(1 << 30)}")
        if self.turn >= SESSION_TURNS or not self.session or len(self.session) > MAX_PROMPT:
            self.session, self.turn = rng.choice(self.shared) + self._random(rng.randint(20, 60)), 0
            self.session_id = f"{self.session_id.rsplit('-', 1)[0]}-{rng.randrange(1 << 30)}"
        elif last_answer:
            self.session = self.session + self.encode(last_answer) + self._random(rng.randint(10, 30))
        self.turn += 1
        return Request(tuple(self.session), max_tokens, stream, self.session_id)

    def _random(self, n: int) -> list[int]:
        return [self.rng.choice(VOCAB) for _ in range(n)]


def shared_prefixes(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(VOCAB) for _ in range(rng.randint(96, 200))] for _ in range(count)]


def send(http: httpx.Client, base: str, request: Request) -> Outcome:
    body = {"prompt": list(request.ids), "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": request.stream}
    started = time.monotonic()
    try:
        if request.stream:
            text, hits = _streamed(http, base, body, request.session)
        else:
            response = http.post(f"{base}/v1/completions", json=body, headers={"x-session-id": request.session})
            _require_ok(response)
            payload = response.json()
            text, hits = payload["choices"][0]["text"], payload.get("kvshare", {}).get("pool_hit_tokens", 0)
    except (httpx.HTTPError, ValueError, KeyError) as error:
        return Outcome(request, started, time.monotonic(), False, error=f"{type(error).__name__}: {error}"[:300])
    return Outcome(request, started, time.monotonic(), True, text, hits)


def _streamed(http: httpx.Client, base: str, body: dict, session: str) -> tuple[str, int]:
    pieces, hits, finished, done = [], 0, False, False
    with http.stream("POST", f"{base}/v1/completions", json=body, headers={"x-session-id": session}) as response:
        _require_ok(response)
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    pieces.append(choice.get("text", ""))
                    finished = finished or choice.get("finish_reason") is not None
                hits = event.get("kvshare", {}).get("pool_hit_tokens", hits)
    if not (finished and done):
        raise ValueError("stream ended without finish_reason and [DONE]")  # a cut connection, not an answer
    return "".join(pieces), hits


def _require_ok(response: httpx.Response) -> None:
    if response.status_code != 200:
        response.read()
        raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")


@dataclass
class Reference:
    """Answers of the cache-OFF replica, memoised (the same prompt recurs across workers and sessions)."""

    base: str
    http: httpx.Client
    _answers: dict[Request, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # workers share the memo

    def answer(self, request: Request) -> str:
        key = Request(request.ids, request.max_tokens, False, "")
        with self._lock:
            if key in self._answers:
                return self._answers[key]
        outcome = send(self.http, self.base, key)
        if not outcome.ok:
            raise RuntimeError(f"the reference replica failed: {outcome.error}")
        with self._lock:
            self._answers[key] = outcome.text
        return outcome.text
