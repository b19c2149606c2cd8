"""What an engine and a KV connector agree on: the connector protocol the engine calls, the handle of a store in
flight, and the counters a connector keeps. The reference engine (kvshare.engine) and vLLM (kvshare.integrations.vllm)
both implement against these; nothing here imports an engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Protocol, Sequence


@dataclass
class StoreHandle:
    """Completion of an asynchronous store. The engine must not free or reuse the source blocks until done(): the
    copies out of them are over. settled() comes after done(): the store is also committed (and counted in the
    connector's stats) or dropped, so a caller that reports a store over once settled reports its counters with it."""

    is_done: Callable[[], bool] = lambda: True
    block_ids: Sequence[int] = field(default_factory=tuple)
    is_settled: Callable[[], bool] | None = None  # None: settled once done

    def done(self) -> bool:
        return self.is_done()

    def settled(self) -> bool:
        return self.is_done() if self.is_settled is None else self.is_settled()


class LayerLoad(Protocol):
    """A load under way (KVConnector.start_load). Neither method raises."""

    def wait_layer(self, layer: int) -> None:
        """Order the caller's next reads of layer `layer`'s loaded blocks after their copies: kernels then queued on
        the current stream (a GPU), or the caller's own reads (a CPU)."""

    def finish(self) -> bool:
        """Wait for every copy and settle the load (the lease ends here). True: the loaded blocks hold the pool's
        bytes. False: they do not count, and whatever was computed from them must be computed again."""


class KVConnector(Protocol):
    """The engine's view of the shared pool (kvshare.engine.pool_connector implements it). Never raises: any pool
    failure becomes a miss (lookup returns 0, a load's finish() False, store returns None) and costs only recompute
    (I7)."""

    chunk_tokens: int
    stats: ConnectorStats

    def lookup(self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: str = "") -> int:
        """Tokens beyond `num_computed` that the pool holds of `token_ids` (the request's tokens, its last included),
        under a read lease kept for this request until its load is finished or release(). The engine accepts an answer
        only if it leaves the last token to compute; kvshare's connector answers up to a block boundary before it."""

    def start_load(self, request_id: str, block_ids: Sequence[int], num_computed: int,
                   num_tokens: int, state=None) -> "LayerLoad | None":
        """Start loading tokens [num_computed, num_computed + num_tokens) into `block_ids` (the request's whole block
        table), the hit lookup() found; a hybrid model's linear-attention state at the hit's end goes into `state` (a
        packed state, kvshare.transfer.state) before this returns. The K/V copies may still run when it returns: the
        engine calls wait_layer(l) before anything reads layer l's loaded blocks (I5 per layer) and finish() once after
        its last such read.
        None means nothing was started: the engine recomputes those tokens."""

    def release(self, request_id: str) -> None:
        """Drop any lease still held for the request (e.g. it was aborted before load)."""

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """The engine computed `new_tokens` after `cached_tokens` already in its KV cache in `seconds`: what the
        connector's L2 promotion decision weighs a promotion against (kvshare.connector.promotion)."""

    def store(
        self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int, salt: str = "",
        tail: bool = False, states=None,
    ) -> StoreHandle | None:
        """Store the full chunks of `token_ids` beyond the first `num_stored` tokens (already stored) from
        `block_ids`, and with `tail` (the prompt's own store) the whole blocks after them as one partial chunk.
        A hybrid model passes `states` (chunk boundary -> packed state) and stores no tail. Ordered after all work
        already queued on the current stream (I4)."""


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
    l2_promote_chosen: int = 0  # LOOKUPs whose L2 promotion the cost model chose (faster than recompute)
    l2_promote_declined: int = 0  # LOOKUPs whose L2 promotion the cost model declined (recompute is faster)
    l2_promote_unmeasured: int = 0  # promoted without a decision: the rates were not measured yet

    def values(self) -> dict[str, float]:
        """Every counter by field name (a snapshot; each field only grows)."""
        return {counter.name: getattr(self, counter.name) for counter in fields(self)}


# What each ConnectorStats counter means: both engines export every field as a Prometheus counter
# kvshare_pool_<field>_total with this help (kvshare.serve.metrics, kvshare.integrations.vllm.stats).
STAT_HELP = {
    "lookups": "LOOKUPs the connector sent to the pool",
    "lookup_hit_tokens": "prompt tokens the pool reported as cached",
    "loads": "chunk loads from the pool",
    "load_bytes": "KV bytes loaded from the pool",
    "load_seconds": "seconds spent loading KV from the pool",
    "load_failures": "loads that failed and were recomputed",
    "stores": "chunk stores into the pool",
    "store_bytes": "KV bytes stored into the pool",
    "store_seconds": "seconds spent storing KV into the pool",
    "store_skipped_chunks": "chunks not stored because the pool already held them",
    "store_limited_chunks": "chunks not stored because one prompt's KV exceeds the pool's per-client lease limit",
    "corrupt_chunks": "loaded chunks whose bytes failed their checksum (recomputed)",
    "discarded_chunks": "corrupt chunks removed from the pool so that the next store replaces them",
    "errors": "pool errors of any kind, each turned into a cache miss",
    "l2_promote_chosen": "L1 misses the cost model promoted from L2 (faster than recompute)",
    "l2_promote_declined": "L1 misses the cost model recomputed instead of promoting from L2",
    "l2_promote_unmeasured": "L1 misses promoted from L2 before the rates were measured",
}
