"""The engine's KV-connector hook with a real in-process connector (a dict of chunk KV shared by engines):
cross-engine loads give the cache-OFF greedy tokens, Usage reports pool hits, and a failing connector changes
nothing but the hit counts (I6, I7)."""

import threading
import time
from typing import Sequence

import torch

from kvshare.connector.contract import ConnectorStats, StoreHandle
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import generate
from kvshare.keys import Namespace, chunk_keys

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


class DictConnector:
    """KVConnector storing each full chunk's K|V blocks (every layer) under its chunk key in a shared dict. Stores
    complete asynchronously: a handle turns done only after `store_delay` polls, exercising the engine's holds."""

    def __init__(self, engine, store: dict, chunk_tokens: int = 32, store_delay: int = 3):
        self.engine, self.store_dict, self.chunk_tokens, self.store_delay = engine, store, chunk_tokens, store_delay
        self.stats = ConnectorStats()
        self.namespace = Namespace(engine.model_fingerprint, str(engine.dtype), "test-layout", chunk_tokens).key
        self.leases: dict[str, int] = {}
        self.prefills: list[tuple[int, int]] = []  # (new tokens, cached tokens) of each prefill the engine reported
        self.load_ok = True  # what a load's finish() says

    def _blocks(self, block_ids, chunk_index):
        per = self.chunk_tokens // self.engine.block_size
        return torch.tensor(block_ids[chunk_index * per : (chunk_index + 1) * per])

    def lookup(self, request_id, token_ids: Sequence[int], num_computed, salt=""):
        self.stats.lookups += 1
        hit = 0
        for key in chunk_keys(self.namespace, token_ids, self.chunk_tokens):
            if key not in self.store_dict:
                break
            hit += self.chunk_tokens
        n = max(0, hit - num_computed)
        self.leases[request_id] = n
        self.stats.lookup_hit_tokens += n
        return n

    def start_load(self, request_id, block_ids, num_computed, num_tokens):
        del self.leases[request_id]
        self.stats.loads += 1
        self.started = LazyLoad(self, self.tokens_of[request_id], block_ids, num_computed, num_tokens, ok=self.load_ok)
        return self.started

    def copy_layer(self, layer, token_ids, block_ids, num_computed, num_tokens):
        """Layer `layer`'s K/V of tokens [num_computed, num_computed + num_tokens) from the dict into its blocks."""
        keys = chunk_keys(self.namespace, token_ids, self.chunk_tokens)
        bs, cache = self.engine.block_size, self.engine.kv_caches[layer]
        for c in range(num_computed // self.chunk_tokens, (num_computed + num_tokens) // self.chunk_tokens):
            blocks = self._blocks(block_ids, c)
            first = max(0, (num_computed - c * self.chunk_tokens) // bs)  # blocks already computed stay untouched
            cache[blocks[first:]] = self.store_dict[keys[c]][layer][first:]

    def release(self, request_id):
        self.leases.pop(request_id, None)

    def observe_prefill(self, new_tokens, cached_tokens, seconds):
        assert seconds > 0
        self.prefills.append((new_tokens, cached_tokens))

    def store(self, request_id, token_ids, block_ids, num_stored, salt="", tail=False):  # full chunks only
        keys = chunk_keys(self.namespace, token_ids, self.chunk_tokens)
        for c in range(num_stored // self.chunk_tokens, len(keys)):
            if keys[c] not in self.store_dict:
                blocks = self._blocks(block_ids, c)
                self.store_dict[keys[c]] = [cache[blocks].clone() for cache in self.engine.kv_caches]
                self.stats.stores += 1
        polls = iter(range(self.store_delay, -1, -1))
        return StoreHandle(is_done=lambda: next(polls, 0) == 0, block_ids=tuple(block_ids))


class LazyLoad:
    """A layer-by-layer load that copies each layer only when the engine asks for it (wait_layer), the rest at
    finish(): an engine that read a layer's cache before asking would read blocks the load has not written."""

    def __init__(self, connector, *where, ok=True):
        self.connector, self.where, self.ok = connector, where, ok
        self.pending = set(range(len(connector.engine.kv_caches)))
        self.finished = 0  # finish() calls

    def wait_layer(self, layer):
        if layer in self.pending:
            self.pending.discard(layer)
            self.connector.copy_layer(layer, *self.where)

    def finish(self):
        self.finished += 1
        for layer in sorted(self.pending):
            self.wait_layer(layer)
        return self.ok


class RecordingDictConnector(DictConnector):
    """load() needs the request's tokens to name chunks; a real connector keeps them from lookup, so does this."""

    def lookup(self, request_id, token_ids, num_computed, salt=""):
        self.tokens_of = getattr(self, "tokens_of", {})
        self.tokens_of[request_id] = list(token_ids)
        return super().lookup(request_id, token_ids, num_computed, salt)


class BrokenConnector(RecordingDictConnector):
    """A pool that fails on every call (as a crashed pool would, if the connector let exceptions through)."""

    def lookup(self, *args, **kwargs):
        raise ConnectionError("pool is gone")

    def store(self, *args, **kwargs):
        raise ConnectionError("pool is gone")


def wait_for_stores(engine):
    """The engine thread gives back a completed store's blocks within its idle period; wait (bounded) for that."""
    for _ in range(200):
        if not engine.pool.pending:
            return
        time.sleep(0.05)
    raise TimeoutError("stores still pending after 10 s")


def prompt(n, offset=0):
    return tuple((11 * i + offset) % 1000 + 3 for i in range(n))


def test_cross_engine_pool_hits_give_identical_tokens(make_engine):
    pool: dict = {}
    a, b, c, off = make_engine(), make_engine(), make_engine(), make_engine()
    for engine in (a, b, c):
        engine.set_connector(RecordingDictConnector(engine, pool))
    p = prompt(100)
    (first,) = generate(a, [GenerationRequest("a1", p, GREEDY)])
    assert first.finished.usage.pool_hit_tokens == 0
    (cross,) = generate(b, [GenerationRequest("b1", p, GREEDY)])
    (expected,) = generate(off, [GenerationRequest("off1", p, GREEDY)])
    assert cross.token_ids == expected.token_ids == first.token_ids
    assert cross.finished.usage.pool_hit_tokens == 96 and cross.finished.usage.local_hit_tokens == 0

    # Multi-turn on the other engine: chunks completed by A's generated tokens were stored at A's request end.
    turn2 = p + tuple(first.token_ids) + prompt(7, 3)
    (hit,) = generate(a, [GenerationRequest("a2", turn2, GREEDY)])  # A has it locally; C must get it from the pool
    (cross2,) = generate(c, [GenerationRequest("c2", turn2, GREEDY)])
    (expected2,) = generate(off, [GenerationRequest("off2", turn2, GREEDY)])
    assert cross2.token_ids == expected2.token_ids == hit.token_ids
    usage = cross2.finished.usage
    assert usage.cached_tokens == (len(p) + len(first.token_ids)) // 32 * 32
    assert usage.local_hit_tokens == 0 and usage.pool_hit_tokens == usage.cached_tokens
    assert hit.finished.usage.local_hit_tokens == (len(p) + len(first.token_ids) - 1) // 16 * 16

    # A local hit extended from the pool: B holds 128 tokens of turn3 locally (its own first answer).
    turn3 = turn2 + tuple(hit.token_ids) + prompt(5, 9)
    (cross3,) = generate(b, [GenerationRequest("b3", turn3, GREEDY)])
    (expected3,) = generate(off, [GenerationRequest("off3", turn3, GREEDY)])
    assert cross3.token_ids == expected3.token_ids
    assert cross3.finished.usage.local_hit_tokens == 128 and cross3.finished.usage.pool_hit_tokens > 0

    for engine in (a, b, c):  # every store completed and gave its blocks back
        wait_for_stores(engine)
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_free == engine.num_blocks


def test_engine_reports_each_prefill_to_its_connector(make_engine):
    """What the connector's L2 decision learns this replica's prefill speed from: tokens computed after those
    already cached (a pool hit's), and the time."""
    pool: dict = {}
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        engine.set_connector(RecordingDictConnector(engine, pool))
    p = prompt(100, 5)
    generate(a, [GenerationRequest("a1", p, GREEDY)])
    wait_for_stores(a)
    generate(b, [GenerationRequest("b1", p, GREEDY)])
    assert a.connector.prefills == [(100, 0)]
    assert b.connector.prefills == [(4, 96)]  # 96 tokens loaded from the pool, the last 4 computed


def test_failing_connector_changes_nothing(make_engine):
    broken, off = make_engine(), make_engine()
    broken.set_connector(BrokenConnector(broken, {}))
    p = prompt(80, 1)
    (got,) = generate(broken, [GenerationRequest("x", p, GREEDY)])
    (expected,) = generate(off, [GenerationRequest("y", p, GREEDY)])
    assert got.token_ids == expected.token_ids and got.finished.finish_reason == "length"
    assert got.finished.usage.pool_hit_tokens == 0 and broken.connector.stats.errors >= 2


class CorruptingConnector(RecordingDictConnector):
    """Loads wrong bytes into every layer and says so only at finish(), after the forward read them (as a checksum
    mismatch found once the copies are over does); with `raise_on`, wait_layer of that layer raises instead."""

    def __init__(self, engine, store, raise_on=None):
        super().__init__(engine, store)
        self.load_ok, self.raise_on = raise_on is not None, raise_on

    def copy_layer(self, layer, token_ids, block_ids, num_computed, num_tokens):
        if layer == self.raise_on:
            raise RuntimeError("copy engine fault")
        super().copy_layer(layer, token_ids, block_ids, num_computed, num_tokens)
        bs = self.engine.block_size
        self.engine.kv_caches[layer][block_ids[num_computed // bs : (num_computed + num_tokens) // bs]] *= -3


def test_a_load_that_fails_after_the_forward_read_it_changes_no_answer(make_engine):
    """A layered load is settled after the forward that read its layers: when it fails then (wrong bytes found, or
    a layer's wait raised), the engine recomputes before sampling. Answers equal cache OFF; no pool hit counted."""
    pool: dict = {}
    a, off = make_engine(), make_engine()
    a.set_connector(RecordingDictConnector(a, pool))
    p = prompt(100, 7)
    (expected,) = generate(off, [GenerationRequest("off", p, GREEDY)])
    generate(a, [GenerationRequest("a", p, GREEDY)])
    wait_for_stores(a)
    for raise_on in (None, 1):
        b = make_engine()
        b.set_connector(CorruptingConnector(b, pool, raise_on))
        (got,) = generate(b, [GenerationRequest("b", p, GREEDY)])
        assert got.token_ids == expected.token_ids
        assert got.finished.usage.pool_hit_tokens == 0 and b.connector.started.finished == 1
        assert b.connector.prefills == [(100, 0)]  # the prefill the engine ran in the end
        assert b.connector.stats.errors == (raise_on is not None)


class OrderConnector(RecordingDictConnector):
    """Notes in `events` when a load starts (its copies would be queued)."""

    def start_load(self, request_id, block_ids, num_computed, num_tokens):
        self.events.append("start_load")
        return super().start_load(request_id, block_ids, num_computed, num_tokens)


def test_a_prefill_uploads_its_inputs_before_a_pool_load_starts(make_engine):
    """On a GPU every host->device copy goes through one queue in the order queued: inputs uploaded after a load's
    copies would wait for all of them (ModelRunner.stage). So the forward uploads nothing once the load started,
    and its answer is the one of inputs uploaded in the forward (cache OFF)."""
    pool: dict = {}
    a, b, off = make_engine(), make_engine(), make_engine()
    a.set_connector(RecordingDictConnector(a, pool))
    b.set_connector(OrderConnector(b, pool))
    events = b.connector.events = []
    upload, prefill = b.runner._to_device, b.runner.prefill
    b.runner._to_device = lambda values: events.append("upload") or upload(values)

    def recorded_prefill(seq, **kwargs):
        events.append("prefill")
        logits = prefill(seq, **kwargs)
        events.append("prefill done")
        return logits

    b.runner.prefill = recorded_prefill
    p = prompt(100, 11)
    generate(a, [GenerationRequest("a", p, GREEDY)])
    wait_for_stores(a)
    (got,) = generate(b, [GenerationRequest("b", p, GREEDY)])
    (expected,) = generate(off, [GenerationRequest("off", p, GREEDY)])
    assert got.token_ids == expected.token_ids and got.finished.usage.pool_hit_tokens == 96
    # tokens and block table, then the load, then a forward that uploads nothing
    assert events[: events.index("prefill done") + 1] == ["upload", "upload", "start_load", "prefill", "prefill done"]


def test_a_failed_upload_of_a_prefills_inputs_ends_the_pool_lease(make_engine):
    """Between the LOOKUP (which leases the hit) and the load, the engine uploads the forward's inputs: if that
    fails, the request fails alone (the step's failure ends its lease with it), and the next is served from the
    pool."""
    pool: dict = {}
    a, b, off = make_engine(), make_engine(), make_engine()
    a.set_connector(RecordingDictConnector(a, pool))
    b.set_connector(RecordingDictConnector(b, pool))
    p = prompt(100, 13)
    generate(a, [GenerationRequest("a", p, GREEDY)])
    wait_for_stores(a)
    stage = b.runner.stage

    def failing_stage(seq, start):
        raise RuntimeError("pinned memory exhausted")

    b.runner.stage = failing_stage
    (failed,) = generate(b, [GenerationRequest("b1", p, GREEDY)])
    assert failed.finished.finish_reason == "error" and b.connector.leases == {}
    b.runner.stage = stage
    (got,) = generate(b, [GenerationRequest("b2", p, GREEDY)])
    (expected,) = generate(off, [GenerationRequest("off", p, GREEDY)])
    assert got.token_ids == expected.token_ids and got.finished.usage.pool_hit_tokens == 96


class UnconfirmableConnector(RecordingDictConnector):
    """A store whose completion cannot be confirmed: its handle's done() raises (a connector bug)."""

    def store(self, request_id, token_ids, block_ids, num_stored, salt="", tail=False):
        super().store(request_id, token_ids, block_ids, num_stored, salt)

        def done() -> bool:
            raise RuntimeError("cannot tell")

        return StoreHandle(is_done=done, block_ids=tuple(block_ids))


def test_blocks_of_a_store_whose_completion_cannot_be_confirmed_stay_held(make_engine):
    """The answer is unaffected, and the blocks the store may still read are never freed for reuse (I4): a done()
    that raises is not taken for done (it was before: the blocks went back to the free list)."""
    engine, off = make_engine(), make_engine()
    engine.set_connector(UnconfirmableConnector(engine, {}))
    p = prompt(80, 3)
    (got,) = generate(engine, [GenerationRequest("u", p, GREEDY)])
    (expected,) = generate(off, [GenerationRequest("v", p, GREEDY)])
    assert got.token_ids == expected.token_ids
    time.sleep(0.3)  # several idle polls of the engine thread
    held = engine.pool.pending[0][1]
    assert held and all(engine.block_manager.blocks[b].ref_count > 0 for b in held)
    assert engine.connector.stats.errors >= 1


class GatedConnector(RecordingDictConnector):
    """Stores stay pending until the test opens the gate, like a slow device-to-host copy."""

    def __init__(self, engine, store):
        super().__init__(engine, store)
        self.gate = threading.Event()
        self.handles = []

    def store(self, request_id, token_ids, block_ids, num_stored, salt="", tail=False):
        super().store(request_id, token_ids, block_ids, num_stored, salt)
        handle = StoreHandle(is_done=self.gate.is_set, block_ids=tuple(block_ids))
        self.handles.append(handle)
        return handle


def test_blocks_of_pending_stores_are_not_reused(make_engine):
    engine = make_engine(num_blocks=16)  # 256 tokens: the second request needs blocks the first one freed
    connector = GatedConnector(engine, {})
    engine.set_connector(connector)
    (first,) = generate(engine, [GenerationRequest("a", prompt(100), SamplingParams(max_tokens=4, ignore_eos=True))])
    held = set(connector.handles[0].block_ids)
    assert held and all(engine.block_manager.blocks[b].ref_count > 0 for b in held)
    # A request needing more than the unheld blocks waits instead of overwriting blocks a store still reads.
    done = threading.Event()
    engine.submit(GenerationRequest("b", prompt(200, 5), SamplingParams(max_tokens=2, ignore_eos=True)),
                  lambda event: event.finished and done.set())
    assert not done.wait(1.0)
    connector.gate.set()
    assert done.wait(60)
    wait_for_stores(engine)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free == 16
