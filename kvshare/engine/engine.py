"""The engine: one thread running schedule -> (pool load) -> model step -> sample -> emit events, for every request.

`submit()` and `abort()` are thread-safe (they only touch the inbox under its lock); everything else, including
every callback, runs on the engine thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvshare.connector.contract import KVConnector
from kvshare.engine.api import EngineLoad, EventCallback, GenerationRequest, TokenEvent, TokenLogprobs, Usage
from kvshare.engine.block_manager import BlockManager
from kvshare.engine.config import EngineConfig
from kvshare.engine.model_runner import ModelRunner, StagedInputs
from kvshare.engine.pool_hooks import PoolHooks, PoolLoad
from kvshare.engine.sampler import RowFailure, Sampled, sample
from kvshare.engine.scheduler import Batch, Scheduler
from kvshare.engine.sequence import Sequence
from kvshare.hf.config import ModelConfig

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # idle loop period: bounds how late a completed store's blocks are given back


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json (either may hold an int or a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(sorted(ids))


class Engine:
    """Implements kvshare.engine.api.EngineProtocol, and exposes its KV cache for a KV connector."""

    def __init__(self, config: EngineConfig, start: bool = True):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.runner = ModelRunner(config, self.model_config)
        # A hybrid model's blocks hold no linear-attention state, so it has no local prefix cache (block_manager.py)
        self.block_manager = BlockManager(self.runner.usable_blocks, config.block_size,
                                          prefix_caching=self.model_config.linear is None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs)
        self.model_name = config.served_model_name or Path(config.model).name
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(config.model)
        self.model_fingerprint = self.runner.model_fingerprint  # covers the weights' bytes (kvshare.identity)
        self.pool: PoolHooks | None = None
        self._lock = threading.Condition()  # guards _inbox, _aborts and _stopped; notified on each change
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kvshare-engine", daemon=True)
        if start:
            self._thread.start()

    # --- what a KV connector reads -------------------------------------------------------------------------------
    kv_caches = property(lambda self: self.runner.kv_caches)
    num_layers = property(lambda self: self.model_config.num_layers)
    num_blocks = property(lambda self: self.runner.num_blocks)
    block_size = property(lambda self: self.config.block_size)
    num_kv_heads = property(lambda self: self.model_config.num_kv_heads)
    head_size = property(lambda self: self.model_config.head_dim)
    dtype = property(lambda self: self.runner.dtype)
    kv_dtype = property(lambda self: self.runner.kv_dtype)  # the cache's: dtype, or fp8 (--kv-cache-dtype)
    device = property(lambda self: self.runner.device)
    state_layout = property(lambda self: self.runner.state_layout)  # a hybrid model's packed state, else None

    def set_connector(self, connector: KVConnector | None) -> None:
        """Plug in the pool (None: cache OFF). Call before the first request."""
        self.pool = None if connector is None else PoolHooks(connector, self.block_manager, self.state_layout,
                                                              self.device)
        if self.runner.states is not None:  # snapshot the state wherever a chunk the pool stores ends
            self.runner.snapshot_every = 0 if connector is None else connector.chunk_tokens

    @property
    def connector(self) -> KVConnector | None:
        """The attached connector (its `stats` feed /metrics), or None with --pool none."""
        return self.pool.connector if self.pool else None

    def is_alive(self) -> bool:
        """True while the engine thread runs (answers /health)."""
        return self._thread.is_alive()

    def load(self) -> EngineLoad:
        """Requests and KV blocks held now; called from the server's thread (for /metrics). Each count is one len()
        of a container the engine thread mutates, atomic under the GIL: a count may be a step old, never torn."""
        requests = len(self._inbox) + len(self.scheduler.waiting) + len(self.scheduler.running)
        total = self.block_manager.num_blocks
        return EngineLoad(requests, total - self.block_manager.num_free, total)

    # --- EngineProtocol ------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, callback: EventCallback) -> None:
        with self._lock:
            self._inbox.append(Sequence(request, callback))
            self._lock.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join()

    # --- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step; False when there was nothing to run."""
        self._take_inbox()
        if self.pool:
            self.pool.poll()
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        seq = batch.seqs[0]
        hit = self.pool.find_prefix(seq) if batch.is_prefill and self.pool else 0
        # A prefill's inputs (the tokens after the hit) go to the device before a pool load queues its copies
        # (ModelRunner.stage says why).
        staged = self.runner.stage(seq, seq.num_computed + hit) if batch.is_prefill else None
        loading = self.pool.load_prefix(seq, hit) if hit else None
        started = time.perf_counter()
        results = self._run(batch.is_prefill, batch.seqs, loading, staged)  # sampled: the device's work is over
        if batch.is_prefill and self.pool:  # the connector's L2 decision weighs promotion against this prefill time
            # num_computed is still what the prefill started from (a failed load took its tokens back)
            self.pool.observe_prefill(seq, seq.num_computed, time.perf_counter() - started)
        self._postprocess(batch, results)
        return True

    def _run(self, is_prefill: bool, seqs: list[Sequence], loading: PoolLoad | None = None,
             staged: StagedInputs | None = None) -> list[Sampled | RowFailure]:
        """Model step and sampling: a token, or a failure, per request. A step that fails for several requests is run
        again one request at a time (running a decode again only rewrites the K/V of the same positions), so a request
        that fails alone fails alone and the others go on. A failed step counts as the request's own (another replica
        would fail it too) only when another request of the batch went on: a step that fails for every request, or for
        the only one, may be the replica's fault."""
        try:
            logits = self._prefill(seqs[0], loading, staged) if is_prefill else self.runner.decode(seqs)
        except Exception as error:  # noqa: BLE001 - one request's failure must not end the others
            if len(seqs) == 1:
                log.warning("model step of request %s failed: %r", seqs[0].request_id, error)
                return [RowFailure(f"the model step failed: {error!r}", request_caused=False)]
            log.warning("a decode step of %d requests failed (%r); running them one at a time", len(seqs), error)
            results = [self._run(False, [seq])[0] for seq in seqs]
            if any(not isinstance(r, RowFailure) for r in results):
                results = [RowFailure(r.message, True) if isinstance(r, RowFailure) else r for r in results]
            return results
        return sample(logits, seqs)

    def _prefill(self, seq: Sequence, loading: PoolLoad | None, staged: StagedInputs | None = None):
        """The prefill's logits. With a pool load under way, each layer's attention waits for its layer's copies and
        the load is settled before anything is sampled: if it failed (copies, or verification of bytes the forward
        may already have read), the loaded tokens are computed again and those logits are the answer."""
        if loading is None:
            return self.runner.prefill(seq, staged=staged)
        try:
            logits = self.runner.prefill(seq, before_attention=loading.wait_layer, staged=staged)
        finally:
            loaded = loading.finish()  # also when the forward raised: the lease and the arena are given back
        return logits if loaded else self.runner.prefill(seq, staged=staged)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    break
                if not (self._inbox or self._aborts or self.scheduler.has_work()):
                    self._lock.wait(IDLE_WAIT_S)
            try:
                if not self.step():
                    with self._lock:
                        if not (self._inbox or self._aborts or self._stopped):
                            self._lock.wait(IDLE_WAIT_S)  # nothing runnable (e.g. blocks held by stores)
            except Exception as error:  # noqa: BLE001 - a bug must end the requests in flight, not the server
                log.exception("engine step failed; failing the requests in flight")
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(seq, "error", error=f"engine error: {error!r}")
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "abort", error="engine shut down")

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq in new:
            problem = self._validate(seq)
            if problem:
                self._emit(seq, TokenEvent(seq.request_id, None, True, "error", self._usage(seq), problem,
                                           request_caused=True))
            else:
                self.scheduler.add(seq)
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.request_id in aborts:
                self._finish(seq, "abort")

    def _validate(self, seq: Sequence) -> str | None:
        n, vocab = seq.num_prompt_tokens, self.model_config.vocab_size
        if n == 0:
            return "the prompt is empty: send at least one token"
        if n >= self.max_model_len:
            return (f"the prompt has {n} tokens but this model accepts at most {self.max_model_len - 1}: "
                    "shorten it or start the server with a larger --max-model-len / KV cache")
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            return f"token ids must be in [0, {vocab}): the prompt holds {min(seq.token_ids)}..{max(seq.token_ids)}"
        if seq.sampling.max_tokens < 1:
            return f"max_tokens must be at least 1, got {seq.sampling.max_tokens}"
        return None

    def _postprocess(self, batch: Batch, results: list[Sampled | RowFailure]) -> None:
        for seq, sampled in zip(batch.seqs, results):
            if isinstance(sampled, RowFailure):
                self._finish(seq, "error", error=sampled.message, request_caused=sampled.request_caused)
                continue
            token = sampled.token_id
            if batch.is_prefill and not seq.admitted:  # hits count once: a preempted request's recompute is no hit
                seq.admitted = True
                seq.local_hit_tokens = seq.num_computed - seq.pool_hit_tokens
            seq.num_computed = seq.num_tokens
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is None or reason == "length":  # EOS and stop tokens are not part of the output
                self._emit(seq, TokenEvent(seq.request_id, token, logprobs=sampled.logprobs))
            # After the token left, before anything else on this thread reads the prefix cache: entering a long
            # prompt's blocks hashes each one (8,192 blocks at 128k: ~35 ms of an H200 ON request's TTFT, run 14).
            self.block_manager.register_computed(seq)
            if batch.is_prefill and self.pool:
                self.pool.store(seq, seq.num_prompt_tokens)  # after the first token left: no TTFT cost
            if reason:
                self._finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, request_caused: bool = False) -> None:
        """Store the chunks completed by generated tokens, emit the finished event, free the blocks (stores hold
        theirs)."""
        if self.pool:
            if seq.block_table and reason in ("stop", "length"):
                self.pool.store(seq, seq.num_computed)
            self.pool.release(seq)
        self._emit(seq, TokenEvent(seq.request_id, None, True, reason, self._usage(seq), error, request_caused))
        self.scheduler.remove(seq)
        if self.runner.states is not None:
            self.runner.states.release(seq)
            seq.state_snapshots.clear()

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.local_hit_tokens, seq.pool_hit_tokens)

    def _emit(self, seq: Sequence, event: TokenEvent) -> None:
        try:
            seq.callback(event)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
            log.exception("callback of request %s failed", seq.request_id)


@dataclass
class Result:
    """What generate() returns per request: the emitted tokens and the finished event."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # one per emitted token
    finished: TokenEvent | None = None


def generate(engine: Engine, requests: list[GenerationRequest], timeout: float = 600.0) -> list[Result]:
    """Submit every request, wait for all to finish (bounded by timeout), return their results in order."""
    results = {r.request_id: Result() for r in requests}
    done = threading.Semaphore(0)

    def on_event(event: TokenEvent) -> None:
        result = results[event.request_id]
        if event.token_id is not None:
            result.token_ids.append(event.token_id)
            result.logprobs.append(event.logprobs)
        if event.finished:
            result.finished = event
            done.release()

    for request in requests:
        engine.submit(request, on_event)
    for _ in requests:
        if not done.acquire(timeout=timeout):
            raise TimeoutError(f"requests not finished within {timeout} s")
    return [results[r.request_id] for r in requests]
