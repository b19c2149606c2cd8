"""The engine's public contract: requests in, token events out, and the hook through which a KV connector plugs in.

The HTTP server, the benchmark and the connector code against these types only, never against engine internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


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
class TokenEvent:
    """One step of a request's life, delivered in order. The last event has finished=True (and usage set)."""

    request_id: str
    token_id: int | None  # None only on a final event that carries no new token (or an error)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    usage: Usage | None = None
    error: str | None = None
    request_caused: bool = False  # with error: this request failed alone (others went on); another replica would too


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


@dataclass
class StoreHandle:
    """Completion of an asynchronous store. The engine must not free or reuse the source blocks until done()."""

    is_done: Callable[[], bool] = lambda: True
    block_ids: Sequence[int] = field(default_factory=tuple)

    def done(self) -> bool:
        return self.is_done()


class KVConnector(Protocol):
    """The engine's view of the shared pool (implemented by kvshare.connector). Never raises: any pool failure
    becomes a miss (lookup returns 0, load returns False, store returns None) and costs only recompute (I7)."""

    chunk_tokens: int
    stats: ConnectorStats

    def lookup(self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: str = "") -> int:
        """Tokens beyond `num_computed` (a multiple of chunk_tokens, full chunks only) that the pool holds, under a
        read lease kept for this request until load() or release()."""

    def load(self, request_id: str, block_ids: Sequence[int], num_computed: int, num_tokens: int) -> bool:
        """Load tokens [num_computed, num_computed + num_tokens) into `block_ids` (the request's whole block table).
        Returns once every later kernel on the current stream is ordered after the copy (I5); False means failed:
        the engine recomputes those tokens."""

    def release(self, request_id: str) -> None:
        """Drop any lease still held for the request (e.g. it was aborted before load)."""

    def store(
        self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int, salt: str = ""
    ) -> StoreHandle | None:
        """Store the full chunks of `token_ids` beyond the first `num_stored` tokens (already stored) from
        `block_ids`. Ordered after all work already queued on the current stream (I4)."""


@dataclass
class ConnectorStats:
    """Counters a KV connector keeps; the server exports them on /metrics."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    stores: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    store_skipped_chunks: int = 0  # already in the pool
    store_limited_chunks: int = 0  # beyond what the pool's per-client lease limit lets one RESERVE hold
    corrupt_chunks: int = 0  # loaded chunks whose bytes failed their checksum (recomputed, then DISCARDed: I11)
    discarded_chunks: int = 0  # of those, removed from the pool so that the next store replaces them
    errors: int = 0  # pool errors of any kind, each turned into a miss
