"""The engine's side of the KV connector: when to look up, load and store, with every connector failure (including
an exception, which the protocol forbids but a bug may raise) turned into a miss so the request never fails (I7),
under the connector's error policy (kvshare.connector.failures: counted, the first of a kind logged with its
traceback)."""

from __future__ import annotations

from typing import Callable

from kvshare.connector.contract import KVConnector, LayerLoad, StoreHandle
from kvshare.connector.failures import Failures
from kvshare.engine.block_manager import BlockManager
from kvshare.engine.sequence import Sequence


class PoolHooks:
    """Invariant: blocks named by a StoreHandle that is not done() have an extra hold in the block manager, so they
    are neither freed nor reused until the store has read them (I4). A done() that raises cannot confirm the store
    is over, so its blocks stay held (a bounded leak, counted and logged, never a block overwritten mid-copy)."""

    def __init__(self, connector: KVConnector, block_manager: BlockManager, state_layout=None, device="cpu"):
        self.connector = connector
        self.block_manager = block_manager
        self.state_layout = state_layout  # a hybrid model's packed state (kvshare.transfer.state), else None
        self.device = device
        self.pending: list[tuple[StoreHandle, list[int]]] = []
        self._failures = Failures(connector.stats)

    def _guard(self, what: str, call: Callable, default):
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - any connector failure is a miss, never a failed request
            self._failures.record(f"connector {what}", error)
            return default

    def find_prefix(self, seq: Sequence) -> int:
        """After allocation: LOOKUP what the pool holds beyond seq.num_computed; the tokens to load (under the
        connector's read lease until load_prefix or its release), or 0."""
        tokens = seq.token_ids[: seq.num_tokens]
        n = self._guard("lookup", lambda: self.connector.lookup(seq.request_id, tokens, seq.num_computed, seq.salt), 0)
        if not n or n < 0 or seq.num_computed + n >= len(tokens):  # the last token is always computed, for its logits
            if n:
                self._guard("release", lambda: self.connector.release(seq.request_id), None)
            return 0
        return n

    def load_prefix(self, seq: Sequence, n: int) -> "PoolLoad | None":
        """Start loading the n tokens find_prefix found into seq's blocks. The tokens count as computed from here
        on; the engine's forward reads each layer after wait_layer and calls PoolLoad.finish before the token is
        sampled, which takes them back if the load failed."""
        state = None if self.state_layout is None else self.state_layout.new_buffer(self.device)
        extra = () if state is None else (state,)  # a dense model's connector takes no state
        pending = self._guard("load", lambda: self.connector.start_load(seq.request_id, seq.block_table,
                                                                        seq.num_computed, n, *extra), None)
        if pending is None:
            return None
        seq.loaded_state = state  # the prefill starts from it (a failed load's recompute starts from 0 instead)
        loading = PoolLoad(self, pending, seq, (seq.num_computed, seq.pool_hit_tokens, seq.num_stored))
        seq.num_computed += n
        seq.pool_hit_tokens += 0 if seq.admitted else n
        seq.num_stored = max(seq.num_stored, seq.num_computed)
        return loading

    def store(self, seq: Sequence, num_tokens: int) -> None:
        """Store the chunks of seq's first num_tokens tokens (whose K/V exists) not yet in the pool: the full chunks,
        and for the prompt's own store (num_tokens within the prompt) the whole blocks after them as its one tail."""
        chunk, block = self.connector.chunk_tokens, self.block_manager.block_size
        hybrid = self.state_layout is not None  # whole chunks with their states only: no tail
        tail = num_tokens <= seq.num_prompt_tokens and not hybrid
        end = num_tokens // block * block if tail else num_tokens // chunk * chunk
        if end <= seq.num_stored:
            return
        tokens, blocks = seq.token_ids[:num_tokens], list(seq.block_table)
        extra = (dict(seq.state_snapshots),) if hybrid else ()
        handle = self._guard("store", lambda: self.connector.store(seq.request_id, tokens, blocks, seq.num_stored,
                                                                   seq.salt, tail, *extra), None)
        if hybrid:  # the store keeps its own references; later stores need only later boundaries
            for boundary in [p for p in seq.state_snapshots if p <= end]:
                del seq.state_snapshots[boundary]
        if handle is None:
            return
        seq.num_stored = end
        held = list(handle.block_ids) or blocks
        if not self._guard("store", handle.done, False):
            self.block_manager.hold(held)
            self.pending.append((handle, held))

    def observe_prefill(self, seq: Sequence, cached: int, seconds: float) -> None:
        """seq's prefill computed its tokens after the first `cached` in `seconds`."""
        new = seq.num_tokens - cached
        self._guard("observe", lambda: self.connector.observe_prefill(new, cached, seconds), None)

    def release(self, seq: Sequence) -> None:
        self._guard("release", lambda: self.connector.release(seq.request_id), None)

    def poll(self) -> None:
        """Give back the blocks of stores that have completed (a done() that raises keeps them held: see above)."""
        still = []
        for handle, blocks in self.pending:
            if self._guard("store", handle.done, False):
                self.block_manager.release(blocks)
            else:
                still.append((handle, blocks))
        self.pending = still


class PoolLoad:
    """A pool load under way for one sequence, as the engine's forward sees it: wait_layer before a layer reads its
    cache, finish once the forward is over. A failed load gives the sequence back the counts it had before it (its
    loaded tokens are then computed again, by the forward the engine runs next)."""

    def __init__(self, hooks: PoolHooks, pending: LayerLoad, seq: Sequence, before: tuple[int, int, int]):
        self._hooks, self._pending, self._seq, self._before = hooks, pending, seq, before
        self._failed = False  # a wait that raised ordered nothing: the load cannot count

    def wait_layer(self, layer: int) -> None:
        if not self._hooks._guard("load", lambda: self._pending.wait_layer(layer) or True, False):
            self._failed = True

    def finish(self) -> bool:
        """Settle the load (exactly once, after the forward's last read of its blocks): True if they count."""
        ok = self._hooks._guard("load", self._pending.finish, False) and not self._failed
        if not ok:
            seq = self._seq
            seq.num_computed, seq.pool_hit_tokens, seq.num_stored = self._before
        return ok
