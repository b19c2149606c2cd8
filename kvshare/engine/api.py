"""The engine's public contract: requests in, token events out, and the hook through which a KV connector plugs in.

The HTTP server, the benchmark and the connector code against these types only, never against engine internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0; otherwise temperature/top-k/top-p sampling, reproducible when `seed` is set."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0  # sample among the k most likely tokens; 0 (or -1): all of them
    logprobs: int | None = None  # None: none; k >= 0: each emitted token's logprob and the k most likely tokens'


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    cache_salt: str = ""  # tenants with different salts never share pool chunks


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    local_hit_tokens: int  # prompt tokens served from this replica's own prefix cache
    pool_hit_tokens: int  # prompt tokens loaded from the shared pool

    @property
    def cached_tokens(self) -> int:
        return self.local_hit_tokens + self.pool_hit_tokens


@dataclass(frozen=True)
class TokenLogprobs:
    """An emitted token's log-probability under the model's raw next-token distribution (log_softmax of its logits,
    before temperature, top-k or top-p), and the `top` most likely tokens' (most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's life, delivered in order. The last event has finished=True (and usage set)."""

    request_id: str
    token_id: int | None  # None only on a final event that carries no new token (or an error)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    usage: Usage | None = None
    error: str | None = None
    request_caused: bool = False  # with error: this request failed alone (others went on); another replica would too
    logprobs: TokenLogprobs | None = None  # with token_id, when the request asked for logprobs


EventCallback = Callable[[TokenEvent], None]


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds right now (read from another thread: each count may be a step old, never torn)."""

    requests: int  # submitted and not finished: queued, waiting or running
    blocks_used: int  # KV blocks held by requests or by stores still reading them
    blocks_total: int


class EngineProtocol(Protocol):
    """What a server needs from an engine. `submit` is thread-safe and returns at once; `callback` is called from
    the engine's thread, once per event, in order, ending with a finished event (also on error or abort)."""

    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def submit(self, request: GenerationRequest, callback: EventCallback) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...
