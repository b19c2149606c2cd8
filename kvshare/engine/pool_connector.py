"""The reference engine's KV connector: the connector core (kvshare.connector) plus per-request bookkeeping of the
hits a LOOKUP found, behind the engine-facing KVConnector protocol (kvshare.connector.contract)."""

from __future__ import annotations

import threading
from typing import Sequence

from kvshare.connector.config import ConnectorConfig
from kvshare.connector.contract import StoreHandle
from kvshare.connector.core import ConnectorCore, PoolHit
from kvshare.connector.pending_load import PendingLoad
from kvshare.keys import Namespace
from kvshare.transfer import KVLayout


class PoolConnector:
    """The reference engine's KVConnector: ConnectorCore plus per-request bookkeeping of hits."""

    def __init__(self, core: ConnectorCore):
        self.core = core
        self.chunk_tokens = core.chunk_tokens
        self.stats = core.stats
        self._hits: dict[str, tuple[PoolHit, str]] = {}  # request -> its hit and the salt it was found under
        self._lock = threading.Lock()  # submit() and the engine thread may both touch _hits

    @classmethod
    def for_engine(cls, engine, config: ConnectorConfig) -> "PoolConnector":
        layout = KVLayout.from_tensors(engine.kv_caches, kind="packed_kv", block_size=engine.block_size)
        dtype = str(engine.dtype).removeprefix("torch.")
        if engine.kv_dtype != engine.dtype:  # an fp8 cache: KV bytes of another kind (the layout id differs too)
            dtype += "/kv=" + str(engine.kv_dtype).removeprefix("torch.")
        state_layout = engine.state_layout  # a hybrid model's packed state (None for a dense one)
        layout_id = layout.layout_id() + ("" if state_layout is None else "|" + state_layout.layout_id())
        namespace = Namespace.of_replica(engine.model_fingerprint, dtype, layout_id, engine.block_size,
                                         config.chunk_tokens)
        core = ConnectorCore(config, namespace, block_tokens=engine.block_size, state_layout=state_layout)
        core.attach(layout, engine.kv_caches)
        return cls(core)

    def lookup(self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: str = "") -> int:
        hit = self.core.find(token_ids, num_computed, salt)
        if hit is None:
            return 0
        with self._lock:
            self._hits[request_id] = hit, salt
        return hit.end - num_computed

    def start_load(self, request_id: str, block_ids: Sequence[int], num_computed: int,
                   num_tokens: int, state=None) -> PendingLoad | None:
        with self._lock:
            found = self._hits.pop(request_id, None)
        if found is None:
            return None
        hit, salt = found
        return self.core.start_load(hit, block_ids, num_computed, waves=self.core.config.load_waves, state=state,
                                    salt=salt)

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.core.observe_prefill(new_tokens, cached_tokens, seconds)

    def release(self, request_id: str) -> None:
        with self._lock:
            found = self._hits.pop(request_id, None)
        if found is not None:
            self.core.release_hit(found[0])

    def store(self, request_id, token_ids, block_ids, num_stored, salt: str = "",
              tail: bool = False, states=None) -> StoreHandle | None:
        return self.core.store(token_ids, block_ids, num_stored, salt, tail, states)

    def close(self) -> None:
        self.core.close()
