"""Streaming client that measures time to first content token at the client, for any OpenAI-compatible server.

TTFT = `time.perf_counter()` from just before the request is sent to the arrival of the first streamed chunk whose
text (completions) or delta content (chat) is non-empty. Latency = the same clock to the end of the stream.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 900.0  # a 256k OFF prefill takes ~90 s on an H200; leave room for a slow CPU


class BenchError(Exception):
    """A request could not be measured; the message says what was wrong and what to do."""


class EndpointUnreachable(BenchError):
    pass


@dataclass(frozen=True)
class StreamResult:
    text: str
    started_at: float
    ttft_s: float | None
    latency_s: float
    replica: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    local_hit_tokens: int = 0
    pool_hit_tokens: int = 0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int | None  # vLLM and kvshare report it on /v1/models; None when the server does not


@dataclass
class _Accumulator:
    pieces: list[str] = field(default_factory=list)
    first_content: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    kvshare: dict[str, Any] = field(default_factory=dict)


def new_http_client(timeout_s: float = REQUEST_TIMEOUT_S) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0), trust_env=False)


def model_info(http: httpx.Client, base_url: str) -> ModelInfo:
    """The first model a server lists; raises EndpointUnreachable with advice when it cannot be asked."""
    try:
        response = http.get(f"{base_url}/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]
    except httpx.HTTPError as error:
        raise EndpointUnreachable(
            f"cannot reach {base_url}/v1/models ({type(error).__name__}: {error}): start the server or fix the URL"
        ) from error
    except (KeyError, IndexError, ValueError) as error:
        raise BenchError(f"{base_url}/v1/models did not list a model: is this an OpenAI-compatible server?") from error
    return ModelInfo(name=model["id"], max_model_len=model.get("max_model_len"))


def completion_body(model: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy streamed completion of a token-id prompt; ignore_eos keeps answer lengths equal between arms."""
    return {
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, user: str) -> dict[str, Any]:
    return {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "ignore_eos": True, "user": user, "stream_options": {"include_usage": True},
    }


def stream(
    http: httpx.Client, base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> StreamResult:
    """Send one streamed request and time it. Raises BenchError (EndpointUnreachable when nothing answered)."""
    url = f"{base_url}{path}"
    started_at, start = time.time(), time.perf_counter()
    acc = _Accumulator()
    try:
        with http.stream("POST", url, json=body, headers=headers or {}) as response:
            if response.status_code >= 400:
                raise BenchError(f"{url} answered {response.status_code}: {_error_message(response)}")
            replica = response.headers.get("x-kvshare-replica", base_url)
            for line in response.iter_lines():
                if _consume(line, acc, start):
                    break
    except httpx.ConnectError as error:
        raise EndpointUnreachable(f"cannot connect to {url} ({error}): is the server running at {base_url}?") from error
    except httpx.HTTPError as error:
        raise BenchError(f"request to {url} failed mid-stream ({type(error).__name__}: {error})") from error
    latency = time.perf_counter() - start
    ttft = acc.first_content - start if acc.first_content is not None else None
    return _result(acc, started_at, ttft, latency, replica)


def _consume(line: str, acc: _Accumulator, start: float) -> bool:
    """Fold one SSE line into `acc`; True at the end of the stream."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        return True
    chunk = json.loads(payload)
    if "error" in chunk:
        raise BenchError(f"the server reported an error mid-stream: {chunk['error']}")
    for choice in chunk.get("choices") or ():
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text and acc.first_content is None:
            acc.first_content = time.perf_counter()
        acc.pieces.append(text)
    acc.usage = chunk.get("usage") or acc.usage
    acc.kvshare = chunk.get("kvshare") or acc.usage.get("kvshare") or acc.kvshare
    return False


def _result(acc: _Accumulator, started_at: float, ttft: float | None, latency: float, replica: str) -> StreamResult:
    usage, hits = acc.usage, acc.kvshare
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        text="".join(acc.pieces), started_at=started_at, ttft_s=ttft, latency_s=latency, replica=replica,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        local_hit_tokens=int(hits.get("local_hit_tokens") or 0),
        pool_hit_tokens=int(hits.get("pool_hit_tokens") or 0),
    )


def _error_message(response: httpx.Response) -> str:
    response.read()
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
