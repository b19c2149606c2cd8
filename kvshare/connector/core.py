"""Connector core: chunk keys, pool calls and transfers for any engine; every pool failure becomes a miss (I7).

Split in two halves so that an engine whose scheduler and workers live in different processes (vLLM) can use one
half in each: `find`/`release_hit` need no KV tensors; `attach`, `load` and `store` move bytes. `PoolConnector` puts
both halves behind the engine-facing `kvshare.connector.contract.KVConnector` protocol for the reference engine
(kvshare.engine.pool_connector).

Invariants:
- No method raises because of the pool: a missing, crashed, slow or full pool only costs recompute (I7).
- A hit's pages are read only under its read lease, and the lease is released only after the load's copies have
  completed (I3); a hit taken from one pool instance is never loaded from another (pool restarts reuse page numbers).
- A store's chunk becomes visible only when COMMIT follows the completed copy (I2), and the engine gets a
  StoreHandle that stays not-done until the copy out of its blocks has finished (I4).
- Reuse reaches the engine's block: a prompt is stored as its full chunks plus at most one tail of whole blocks
  (kvshare.keys.prompt_chunks), and a hit ends on a block boundary before the prompt's last token, possibly inside
  a chunk (a prefix of a stored chunk is loaded, its other blocks skipped). A replica that finds the prompt stored
  whole therefore recomputes between 1 and block_size tokens, not up to a chunk.
- A hybrid model (a StateLayout given) stores each full chunk followed by the linear layers' state at its last token
  (kvshare.keys.with_states; no tails), and a hit ends where the last chunk whose state the pool holds ends: the
  state is loaded and verified before any KV copy starts, and a hit is never reported without it. A boundary where
  the engine kept no state (vLLM keeps one only where a prefill step ended) is stored as a NO_STATE marker
  (kvshare.transfer.state) when a later state follows; a hit never ends on one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import msgspec
import torch

from kvshare.connector.arena_life import ArenaLife
from kvshare.connector.committer import Committer, PendingStore
from kvshare.connector.config import ConnectorConfig
from kvshare.connector.contract import ConnectorStats, StoreHandle
from kvshare.connector.failures import Failures
from kvshare.connector.link import PoolLink
from kvshare.connector.pending_load import PendingLoad
from kvshare.connector.promotion import PromotionPolicy
from kvshare.connector.storer import Storer, StoreTask
from kvshare.keys import Namespace, PromptChunks, prompt_chunks, with_states
from kvshare.pool.client import LookupResult, NewChunk, PoolClient
from kvshare.transfer import (
    SKIP,
    KVLayout,
    LoadJob,
    StoreJob,
    TransferHandle,
    TransferOptions,
    arena_pages,
    make_transfer,
)
from kvshare.transfer.state import NO_STATE_NBYTES, StateLayout, load_state, store_state

log = logging.getLogger("kvshare.connector")
_NO_STATE = torch.zeros(NO_STATE_NBYTES, dtype=torch.uint8)  # what a NO_STATE marker holds


class PoolHit(msgspec.Struct, frozen=True):
    """A cached run of chunks under a read lease; serializable so a scheduler can hand it to a worker process."""

    pool_instance: str  # which pool life the pages belong to
    lease: int
    first_chunk: int  # index (in the prompt) of chunks[0]
    pages: list[list[int]]  # per chunk
    nbytes: list[int]
    checksums: list[int]
    namespace: bytes = b""  # the namespace key and the chunks' keys: what a DISCARD of corrupt chunks names
    keys: list[bytes] = []
    counts: list[int] = []  # tokens in each chunk: chunk_tokens, or fewer for a tail
    end: int = 0  # the hit covers tokens [.., end): block-aligned, maybe inside the last chunk (the rest is skipped)
    # A hybrid model's hit: the state at `end` (the last chunk's end), its pages, size, checksum and key.
    state_pages: list[int] = []
    state_nbytes: int = 0
    state_checksum: int = 0
    state_key: bytes = b""

    @property
    def num_chunks(self) -> int:
        return len(self.pages)

    def held(self, chunk_tokens: int) -> int:
        """Tokens from the prompt's start that the pool held as whole chunks when the hit was found: the chunks before
        the hit's first (full: only a prompt's last chunk can be a tail; LOOKUP found them too) and the hit's own. It
        may pass `end`, which stops before the prompt's last token."""
        return self.first_chunk * chunk_tokens + sum(self.counts)


@dataclass(frozen=True)
class EngineKV:
    """The engine's KV tensors and the layout that describes them (the worker half has them; the scheduler half of a
    vLLM replica never does)."""

    layout: KVLayout
    kv_caches: list[torch.Tensor]


def _instance_of(client: PoolClient) -> str:
    """Which pool life a connection talks to: a restarted pool reuses page numbers (and maybe its arena path) for
    other bytes, and its random instance id tells the lives apart."""
    return f"{client.arena_path}:{client.instance_id}"


class ConnectorCore:
    """Keys, LOOKUP/RESERVE/COMMIT and transfers for one engine (one TP rank)."""

    def __init__(self, config: ConnectorConfig, namespace: Namespace, block_tokens: int | None = None,
                 state_layout: StateLayout | None = None):
        """block_tokens: the engine's block size, the unit of a hit and of a stored tail (None: whole chunks only);
        state_layout: a hybrid model's packed linear-attention state (its hits and stores end on chunk boundaries)."""
        if namespace.chunk_tokens != config.chunk_tokens:
            raise ValueError(f"namespace chunk_tokens {namespace.chunk_tokens} != "
                             f"connector chunk_tokens {config.chunk_tokens}")
        block_tokens = block_tokens or config.chunk_tokens
        if config.chunk_tokens % block_tokens:
            raise ValueError(f"chunk_tokens {config.chunk_tokens} must be a multiple of the block size {block_tokens}")
        if state_layout is not None and state_layout.nbytes == NO_STATE_NBYTES:
            raise ValueError(f"a packed state of {NO_STATE_NBYTES} bytes cannot be told from a boundary without one")
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.block_tokens = block_tokens
        self.state_layout = state_layout
        self.stats = ConnectorStats()
        self._base_namespace = namespace
        self._kv: EngineKV | None = None
        self._attached = ArenaLife()  # replaced as one object on each new connection, so that readers on other
        # threads never pair one pool life's page numbers with another life's arena
        self._lease_limit = 0  # pages one connection may hold under leases (the pool's STATS; 0: none)
        self._warned_foreign = False  # _foreign logged its error
        self._failures = Failures(self.stats)
        self._link = PoolLink(config, self._failures, self._on_connect, self._on_disconnect)
        self._committer = Committer(self._commit, self.stats, self._failures)
        self._storer = Storer(self._store_task, self._failures)
        self.promotion = PromotionPolicy(config.l2_promotion, config.chunk_tokens, self.stats)

    # ---- both halves -------------------------------------------------------------------------------------------
    def namespace(self, salt: str = "") -> Namespace:
        base = self._base_namespace
        return base if salt == base.salt else dataclasses.replace(base, salt=salt)

    def chunk_plan(self, token_ids: Sequence[int], salt: str = "") -> tuple[Namespace, list[bytes], list[bytes]]:
        """(namespace, keys, token bytes per chunk) for every full chunk of token_ids (prompt_plan without a tail)."""
        namespace, plan = self.prompt_plan(token_ids, salt, tail=False)
        return namespace, plan.keys, plan.tokens

    def prompt_plan(self, token_ids: Sequence[int], salt: str = "",
                    tail: bool = True) -> tuple[Namespace, PromptChunks]:
        """(namespace, chunks) of token_ids: its full chunks and, with `tail`, the tail of whole blocks after them; for
        a hybrid model its full chunks each followed by its state (kvshare.keys.with_states)."""
        namespace = self.namespace(salt)
        if self.state_layout is not None:
            return namespace, with_states(prompt_chunks(namespace.key, token_ids, self.chunk_tokens))
        blocks = self.block_tokens if tail and self.block_tokens < self.chunk_tokens else 0
        return namespace, prompt_chunks(namespace.key, token_ids, self.chunk_tokens, blocks)

    # ---- scheduler half: no tensors -----------------------------------------------------------------------------
    def find(self, token_ids: Sequence[int], num_computed: int, salt: str = "") -> PoolHit | None:
        """What the pool holds of token_ids (a request's tokens, its last included) beyond the first `num_computed`,
        under a read lease, or None. The hit ends on a block boundary before the last token, which the engine must
        compute for its logits; it may end inside a stored chunk. Never raises."""
        try:
            return self._find(token_ids, num_computed, salt)
        except Exception as error:  # noqa: BLE001 - a bug here is a miss, recorded with its traceback
            self._failures.record("lookup", error)
            return None

    def _find(self, token_ids: Sequence[int], num_computed: int, salt: str) -> PoolHit | None:
        if self.state_layout is not None:
            return self._find_with_state(token_ids, num_computed, salt)
        namespace, plan = self.prompt_plan(token_ids, salt)
        limit = (len(token_ids) - 1) // self.block_tokens * self.block_tokens  # whole blocks, never the last token
        plan = plan.first(-(-limit // self.chunk_tokens))  # the chunks that start before the limit
        if min(plan.end(), limit) <= num_computed:
            return None
        self.stats.lookups += 1
        found = self._lookup(namespace, plan, len(token_ids), num_computed, limit)
        if found is None:
            return None
        lookup, instance = found
        first = num_computed // self.chunk_tokens
        end = min(plan.end(len(lookup.chunks)), limit)
        if end <= num_computed:
            if lookup.lease:
                self._link.call("release", lambda c: c.release(lookup.lease))
            return None
        chunks = lookup.chunks[first:]
        hit = PoolHit(instance, lookup.lease, first, [list(c.pages) for c in chunks], [c.nbytes for c in chunks],
                      [c.checksum for c in chunks], namespace.key, [c.key for c in chunks],
                      plan.counts[first : len(lookup.chunks)], end)
        self.stats.lookup_hit_tokens += end - num_computed
        return hit

    def _find_with_state(self, token_ids: Sequence[int], num_computed: int, salt: str) -> PoolHit | None:
        """A hybrid model's hit: whole chunks before the last token, up to the last one whose state the pool holds
        (the verified prefix of chunk, state, chunk, state...; a chunk found without its state is not part of it,
        nor is a chunk whose boundary was stored as a NO_STATE marker, unless a later real state follows)."""
        namespace, plan = self.prompt_plan(token_ids, salt)
        chunk = self.chunk_tokens
        usable = (len(token_ids) - 1) // chunk  # chunks that end before the last token
        plan = plan.first(2 * usable)
        if usable * chunk <= num_computed:
            return None
        self.stats.lookups += 1
        found = self._lookup(namespace, plan, len(token_ids), num_computed, usable * chunk)
        if found is None:
            return None
        lookup, instance = found
        pairs, first = len(lookup.chunks) // 2, -(-num_computed // chunk)
        while pairs and lookup.chunks[2 * pairs - 1].nbytes != self.state_layout.nbytes:
            pairs -= 1  # a NO_STATE marker: the hit ends at the last boundary with a real state
        if pairs * chunk <= num_computed or num_computed % chunk:  # a state exists only at chunk ends
            if lookup.lease:
                self._link.call("release", lambda c: c.release(lookup.lease))
            return None
        chunks, state = lookup.chunks[2 * first : 2 * pairs : 2], lookup.chunks[2 * pairs - 1]
        hit = PoolHit(instance, lookup.lease, first, [list(c.pages) for c in chunks], [c.nbytes for c in chunks],
                      [c.checksum for c in chunks], namespace.key, [c.key for c in chunks], [chunk] * len(chunks),
                      pairs * chunk, list(state.pages), state.nbytes, state.checksum, state.key)
        self.stats.lookup_hit_tokens += hit.end - num_computed
        return hit

    def _lookup(self, namespace: Namespace, plan: PromptChunks, prompt_tokens: int, num_computed: int,
                limit: int) -> tuple[LookupResult, str] | None:
        """LOOKUP, and the L2 decision: when deciding, the pool answers from its own memory first; if that covers less
        than the plan and the policy says promotion beats recompute, LOOKUP again letting the pool promote from L2
        (the first answer's lease ends after the second, so the pool's prefix stays leased throughout)."""
        policy = self.promotion
        if policy.stats_due():
            self._read_pool_rates()

        def lookup(promote: bool):
            # LOOKUP always starts at chunk 0 so the pool verifies the whole chain (parents and tokens) it serves.
            return self._link.call("lookup", lambda c: (c.lookup(namespace.key, plan.keys, plan.tokens, promote),
                                                        _instance_of(c)), namespace)

        deciding = policy.deciding
        found = lookup(not deciding)
        if found is not None and found[0].chunks:  # the KV bytes per token the decision weighs
            policy.observe_chunk(found[0].chunks[0].nbytes, plan.counts[0])
        if found is None or not deciding or len(found[0].chunks) == len(plan.keys):
            return found
        first, _ = found
        l1_hit = min(plan.end(len(first.chunks)), limit)
        if limit <= max(l1_hit, num_computed):
            return found
        if not policy.decide(prompt_tokens, num_computed, l1_hit, limit).promote:
            return found
        promoted = lookup(True)
        if promoted is None:
            return found
        if promoted[0].chunks:
            policy.observe_chunk(promoted[0].chunks[0].nbytes, plan.counts[0])
        if first.lease and promoted[1] == found[1]:  # a lease of an earlier pool life is gone already
            self._link.call("release", lambda c: c.release(first.lease))
        return promoted

    def _read_pool_rates(self) -> None:
        stats = self._link.call("stats", lambda c: c.stats())
        if stats is not None:
            self.promotion.observe_pool(stats.l2_enabled, stats.l2_promoted_bytes, stats.l2_promote_seconds)

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """See KVConnector.observe_prefill: feeds the L2 promotion decision."""
        self.promotion.observe_prefill(new_tokens, cached_tokens, seconds)

    def release_hit(self, hit: PoolHit) -> None:
        """End the hit's read lease. It belongs to the process (and pool life) that took it: from a newer connection
        of this process the pool accepts it once that lease is fenced; a lease of an earlier pool life is gone."""
        self._link.call("release", lambda c: c.release(hit.lease) if _instance_of(c) == hit.pool_instance else None)

    # ---- worker half: moves bytes ------------------------------------------------------------------------------
    def attach(self, layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> None:
        """Give the core the engine's KV tensors (described by `layout`)."""
        self._kv = EngineKV(layout, list(kv_caches))
        self._link.client()  # connect now so the first request does not pay for mapping/registration

    def _on_connect(self, client) -> None:
        # Called under the link's lock for each new connection: the arena (and so every page view) is new.
        # A hit from an earlier pool life is never loaded (see _instance_of; the checksum would catch it too).
        self._lease_limit = client.stats().max_leased_pages_per_client
        transfer = None
        if self._kv is not None:
            config = self.config
            options = TransferOptions(checksums=config.checksums_on, register_piece_bytes=config.register_piece,
                                      register_threads=config.register_threads, register_ahead=config.register_ahead,
                                      stream_priority=config.stream_priority)
            transfer = make_transfer(self._kv.layout, self._kv.kv_caches, arena_pages(client), options=options)
        retired, self._attached = self._attached, ArenaLife(_instance_of(client), transfer, client)
        retired.retire()  # normally retired already, by _on_disconnect

    def _on_disconnect(self, client: PoolClient) -> None:
        # Called under the link's lock once `client`'s connection failed or closed: its pool life ends here. Copies
        # under way finish on the old arena (their pages are leased, or the pool is gone); then it is unregistered
        # and unmapped (kvshare.connector.arena_life), so a dead pool's memory is not held until a reconnect.
        life = self._attached
        if life.instance == _instance_of(client):
            self._attached = ArenaLife()
            life.retire()
        else:
            client.close()

    def load(self, hit: PoolHit, block_ids: Sequence[int], num_computed: int, release: bool = True) -> bool:
        """Load the hit's chunks into `block_ids` (the request's block table), skipping blocks below num_computed.

        Returns True once later work on the current stream is ordered after the copies (I5); False = recompute.
        release=False leaves the read lease to whoever took it: a lease belongs to one pool connection, and in
        vLLM the scheduler process (find) and the worker process (load) have different ones.
        """
        return self.start_load(hit, block_ids, num_computed, waves=1, release=release).finish()

    def start_load(self, hit: PoolHit, block_ids: Sequence[int], num_computed: int, waves: int = 1,
                   release: bool = True, state: torch.Tensor | None = None, salt: str = "") -> PendingLoad:
        """Start loading the hit as load() does, in `waves` layer waves (kvshare.transfer.waves), and return while
        the copies run: the caller reads layer l's blocks only after wait_layer(l), and calls finish() once after its
        last such read (the read lease and the arena are held until then: I3). A hybrid hit's state is copied into
        `state` (a packed state, StateLayout) and verified before this returns; if it cannot be, no KV copy starts
        and finish() says False. A hit keyed under another namespace than this core's of `salt` (the request's) is
        never copied (I9; see _foreign). Never raises."""
        started = time.perf_counter()
        life = self._attached
        # Order: acquire() last, since it takes a reference on the arena that only _settle gives back.
        if self._foreign(hit, salt) or hit.pool_instance != life.instance or not life.acquire():
            # Another namespace's bytes, or the pool restarted since the lookup (those page numbers now mean other
            # bytes): a miss.
            return PendingLoad(None, lambda handle, usable: self._settle(hit, None, None, started, release, False),
                               self._failures)
        try:
            loaded_state = self._load_state(life, hit, state)
            handle = self._start_copies(life, self._kv, hit, block_ids, num_computed, waves) if loaded_state else None
        except Exception as error:  # noqa: BLE001 - a failed load is a miss, never a failed request
            self._failures.record("load", error)
            handle = None
        return PendingLoad(handle, lambda handle, usable: self._settle(hit, life, handle, started, release, usable),
                           self._failures)

    def _foreign(self, hit: PoolHit, salt: str) -> bool:
        """Whether `hit` was found under a namespace other than the one this core's KV is stored under, for the
        request's salt. Where one core both finds and loads (kvshare serve) it never is; vLLM's connector finds in
        its scheduler process and loads in its worker, each half resolving the namespace itself, and a hit from a
        half that resolved another KV layout would put bytes of one layout into blocks of another: same bytes,
        checksums passing, wrong answers. Logged once: every hit of such a replica would say the same."""
        own = self.namespace(salt)
        if hit.namespace == own.key:
            return False
        self.stats.errors += 1
        if not self._warned_foreign:
            self._warned_foreign = True
            log.error("a pool hit was found under namespace %s but this replica's KV is namespace %s (%s): the "
                      "connector's halves resolved different KV layouts or identities; such hits are recomputed, "
                      "never loaded", hit.namespace.hex()[:12], own.key.hex()[:12], own.describe())
        return True

    def _load_state(self, life: ArenaLife, hit: PoolHit, state: torch.Tensor | None) -> bool:
        """Copy a hybrid hit's state into `state` and verify it (True for a hit without one). Before the KV copies
        and on the caller's thread: the forward's first linear layer reads it, and it is small (its own object, read
        only for the boundary the hit ends on)."""
        if not hit.state_pages:
            return True
        if state is None or life.transfer is None:
            return False
        if self.config.unsafe_skip_state_load:  # the negative control: attention K/V without the state
            state.zero_()  # the state a sequence starts from (the buffer is uninitialised: NaN on the H200, run 33)
            return True
        read = load_state(life.transfer.pages, hit.state_pages, state)
        if self.config.verify_checksums and read != hit.state_checksum:
            self.stats.errors += 1
            log.error("a pool state failed its checksum; recomputing and discarding it (pages %s)",
                      hit.state_pages[:4])
            self.stats.corrupt_chunks += 1
            removed = self._link.call("discard", lambda c: c.discard(hit.namespace, [hit.state_key])
                                      if _instance_of(c) == hit.pool_instance else 0)
            self.stats.discarded_chunks += removed or 0
            return False
        return True

    def _start_copies(self, life: ArenaLife, kv: EngineKV | None, hit: PoolHit, block_ids: Sequence[int],
                      num_computed: int, waves: int) -> TransferHandle | None:
        transfer = life.transfer
        if transfer is None or kv is None:
            return None
        # Verification hashes the bytes the load reads: on a GPU from each staging slot after its copy, beside the
        # scatter (only the last slot's hash outlasts the copies); on a CPU, on host threads from the pages while
        # the copies run (the read lease keeps them unchanged). A mismatch fails the load after its copies have
        # written the blocks: a failed load's blocks count as not computed, and the engine (or vLLM's recompute
        # policy) recomputes them, and what it computed from them.
        block = kv.layout.block_size
        per_chunk = self.chunk_tokens // block
        # Blocks the engine has (below num_computed) or will compute (from hit.end) are skipped; the whole chunk is
        # still read for its checksum.
        wanted = range(num_computed // block, hit.end // block)
        jobs = []
        for i, pages in enumerate(hit.pages):
            first_block = (hit.first_chunk + i) * per_chunk
            chunk_blocks = range(first_block, first_block + hit.counts[i] // block)
            jobs.append(LoadJob(pages=pages, block_ids=[block_ids[j] if j in wanted else SKIP for j in chunk_blocks]))
        return transfer.load(jobs, checksums=self.config.verify_checksums, waves=waves)

    def _settle(self, hit: PoolHit, life: ArenaLife | None, handle: TransferHandle | None, started: float,
                release: bool, usable: bool) -> bool:
        """End a load (PendingLoad.finish): wait for its copies, compare checksums, give back the arena and the lease
        (in that order: I3), count it; `usable` False: it counts as failed whatever the copies did. Never raises."""
        try:
            ok = handle is not None and self._verified(hit, handle) and usable
        except Exception as error:  # noqa: BLE001 - a failed load is a miss, never a failed request
            self._failures.record("load", error)
            ok = False
        finally:
            if life is not None:
                life.release()  # after the copies and the hash are over (_verified waited for them)
            # The lease ends only here, after the copies: until then the pages cannot be evicted.
            if release:
                self.release_hit(hit)
        if ok:
            self.stats.loads += 1
            self.stats.load_bytes += sum(hit.nbytes) + hit.state_nbytes
            # The reference engine settles a load after the forward that overlapped it (start_load): its seconds
            # then include the layers that ran after the last copy (a lower rate for the L2 decision: recompute is
            # chosen a little sooner); load() settles at once.
            self.stats.load_seconds += time.perf_counter() - started
        else:
            self.stats.load_failures += 1
        return ok

    def _verified(self, hit: PoolHit, handle: TransferHandle) -> bool:
        """Wait for the copies; True unless verification found chunks whose bytes are not the writer's (those are
        DISCARDed: I11)."""
        verify = self.config.verify_checksums
        try:
            read = handle.checksums() if verify else hit.checksums
            bad = [i for i, (want, got) in enumerate(zip(hit.checksums, read)) if got != want]  # chunk indices
        finally:
            # wait(), also when hashing raised: the lease is released right after, so the host must know the page
            # reads are finished (I3). It raises if a copy failed.
            handle.wait()
        if bad:
            self.stats.errors += 1
            log.error("%d pool chunk(s) failed their checksum; recomputing and discarding them (pages %s)", len(bad),
                      hit.pages[bad[0]][:4])
            self._discard(hit, bad)
            return False
        return True

    def _discard(self, hit: PoolHit, corrupt: list[int]) -> None:
        """Remove chunks whose bytes failed verification from the pool (I11): otherwise they stay committed and every
        later LOOKUP of the prefix pays a load, a hash and a recompute. Sent after the load's copies are over; the
        pool frees the pages when the last read lease on them ends, so a reader still copying is never overwritten."""
        self.stats.corrupt_chunks += len(corrupt)
        keys = [hit.keys[i] for i in corrupt]
        removed = self._link.call("discard", lambda c: c.discard(hit.namespace, keys)
                                  if _instance_of(c) == hit.pool_instance else 0)
        self.stats.discarded_chunks += removed or 0

    def store(self, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int, salt: str = "",
              tail: bool = False, states: Mapping[int, torch.Tensor] | None = None) -> StoreHandle | None:
        """Store the chunks of token_ids beyond the first `num_stored` tokens: its full chunks and, with `tail`, the
        whole blocks after them as one partial chunk (a prompt's own store: at most one tail per prompt). Never
        raises. On a CPU replica it returns at once and the storer thread does the work (kvshare.connector.storer);
        on a GPU the copies are queued on side streams here, ordered after the caller's stream (I4). A hybrid model
        passes `states`, its packed state at each chunk boundary it has (fresh host tensors, never changed after the
        hand-over: the committer writes them into the pool): chunks are stored up to the first one without its
        state."""
        try:
            kv = self._kv
            if kv is not None and kv.kv_caches[0].device.type == "cpu":
                return self._storer.submit(token_ids, block_ids, num_stored, salt, tail, states)
            return self._store(token_ids, block_ids, num_stored, salt, tail, states)
        except Exception as error:  # noqa: BLE001 - a failed store is a future miss, never a failed request
            self._failures.record("store", error, "continuing without it")
            return None

    def _store_task(self, task: StoreTask) -> StoreHandle | None:
        """The storer thread's work: the store itself; its copies are over when this returns (CPU transfers)."""
        return self._store(task.token_ids, task.block_ids, task.num_stored, task.salt, task.tail, task.states)

    def _store(self, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int,
               salt: str, tail: bool, states: Mapping[int, torch.Tensor] | None = None) -> StoreHandle | None:
        if self.state_layout is not None:
            return self._store_with_states(token_ids, block_ids, num_stored, salt, states or {})
        namespace, plan = self.prompt_plan(token_ids, salt, tail)
        first = num_stored // self.chunk_tokens
        if first < len(plan) and plan.end(first + 1) <= num_stored:
            first += 1  # a tail stored before, up to num_stored
        kv = self._kv
        if first >= len(plan) or kv is None:
            return None

        def reserve(client):
            # A chunk's extent depends on the arena's page size: units never straddle pages (KVLayout.chunk_nbytes).
            full_pages = -(-kv.layout.chunk_nbytes(self.chunk_tokens, client.page_size) // client.page_size)
            end = self._within_lease_limit(first, len(plan), full_pages)
            new = [NewChunk(key=plan.keys[i], parent=plan.parents[i], tokens=plan.tokens[i],
                            nbytes=kv.layout.chunk_nbytes(plan.counts[i], client.page_size)) for i in range(first, end)]
            return (client.reserve(namespace.key, new), _instance_of(client)) if new else None

        return self._reserved_store(namespace, reserve, lambda life, reservation, started: self._store_into(
            life, kv, plan, first, reservation, block_ids, started))

    def _reserved_store(self, namespace: Namespace, reserve, copy) -> StoreHandle | None:
        """RESERVE through `reserve(client)`, then `copy(life, reservation, started)` into the reserved pages through
        the pool life the reservation belongs to, acquired for the copies (the committer releases it once they are
        over; here, if nothing was copied)."""
        started = time.perf_counter()
        found = self._link.call("reserve", reserve, namespace)
        if found is None:
            return None
        reservation, reserved_in = found
        life = self._attached
        if reserved_in != life.instance or not life.acquire():  # reconnected in between: another arena's pages
            if reservation.lease:
                self._link.call("release", lambda c: c.release(reservation.lease))
            return None
        try:
            handle = copy(life, reservation, started)
        except BaseException:
            life.release()
            raise
        if handle is None:
            life.release()
        return handle

    def _store_into(self, life: ArenaLife, kv: EngineKV, plan: PromptChunks, first: int, reservation,
                    block_ids: Sequence[int], started: float) -> StoreHandle | None:
        """The copies of a reserved store, through `life` (acquired: the committer releases it once they are over,
        or the caller does when this returns None)."""
        transfer = life.transfer
        if transfer is None:
            if reservation.lease:
                self._link.call("release", lambda c: c.release(reservation.lease))
            return None
        block = kv.layout.block_size
        per_chunk = self.chunk_tokens // block
        jobs, refs = [], []
        for i, ref in enumerate(reservation.chunks, start=first):
            if ref is None:
                self.stats.store_skipped_chunks += 1
                continue
            blocks = block_ids[i * per_chunk : i * per_chunk + plan.counts[i] // block]
            jobs.append(StoreJob(block_ids=list(blocks), pages=list(ref.pages)))
            refs.append(ref)
        if not jobs:
            if reservation.lease:
                self._link.call("release", lambda c: c.release(reservation.lease))
            return None
        handle = transfer.store(jobs)
        # COMMIT only after the copies finished (I2): the committer thread waits on the handle and its checksums (from
        # the bytes the store wrote), then commits.
        pending = PendingStore(reservation.lease, refs, handle, started, on_copied=life.release)
        self._committer.submit(pending)
        return StoreHandle(is_done=handle.done, block_ids=tuple(b for job in jobs for b in job.block_ids),
                           is_settled=pending.settled.is_set)

    def _store_with_states(self, token_ids: Sequence[int], block_ids: Sequence[int], num_stored: int, salt: str,
                           states: Mapping[int, torch.Tensor]) -> StoreHandle | None:
        """A hybrid model's store: each new full chunk and then its state, in one RESERVE, up to the last chunk whose
        state the engine kept; a boundary before it without a state (an engine that keeps states only where a
        prefill step ended: vLLM) gets a NO_STATE marker, which keeps the chain whole and is never a hit's end."""
        namespace, plan = self.prompt_plan(token_ids, salt)
        chunk, kv = self.chunk_tokens, self._kv
        first = -(-num_stored // chunk)
        end = max((i + 1 for i in range(first, len(plan) // 2) if (i + 1) * chunk in states), default=first)
        if first >= end or kv is None:
            return None

        def reserve(client):
            kv_bytes = kv.layout.chunk_nbytes(chunk, client.page_size)
            pair_pages = -(-kv_bytes // client.page_size) + self.state_layout.pages_for(client.page_size)
            last = self._within_lease_limit(first, end, pair_pages)
            new = [NewChunk(key=plan.keys[j], parent=plan.parents[j], tokens=plan.tokens[j],
                            nbytes=kv_bytes if j % 2 == 0 else self._state_nbytes(states, j // 2))
                   for j in range(2 * first, 2 * last)]
            return (client.reserve(namespace.key, new), _instance_of(client)) if new else None

        return self._reserved_store(namespace, reserve, lambda life, reservation, started: self._store_pairs(
            life, kv, first, reservation, block_ids, states, started))

    def _store_pairs(self, life: ArenaLife, kv: EngineKV, first: int, reservation, block_ids: Sequence[int],
                     states: Mapping[int, torch.Tensor], started: float) -> StoreHandle | None:
        """The copies of a reserved hybrid store: the chunks' K/V through the transfer, queued here; the states
        written into their pages on the committer thread, after the K/V copies and before COMMIT (the store's
        checksums are asked for there, and a state's is known once it is written). Off the caller's thread because
        the caller is the engine's loop on a GPU: a 128k prompt's 32 states of the 27B shape are 4.6 GiB to copy
        and hash, a second or more that no decode step should wait for. The packed states are the caller's fresh
        host tensors, never changed after the hand-over (StateSlots.pack, the vLLM worker's StatePages.pack).
        COMMIT carries every written entry's checksum in reservation order."""
        transfer = life.transfer
        jobs, refs, order = [], [], []  # order: ("kv", job index) or ("state", (pages, packed)) per written entry
        per_chunk = self.chunk_tokens // kv.layout.block_size
        for j, ref in enumerate(reservation.chunks, start=2 * first):
            if ref is None:
                self.stats.store_skipped_chunks += 1
                continue
            i = j // 2
            if transfer is None:
                break
            if j % 2:
                order.append(("state", (ref.pages, states.get((i + 1) * self.chunk_tokens, _NO_STATE))))
            else:
                jobs.append(StoreJob(block_ids=list(block_ids[i * per_chunk : (i + 1) * per_chunk]),
                                     pages=list(ref.pages)))
                order.append(("kv", len(jobs) - 1))
            refs.append(ref)
        if transfer is None or not refs:
            if reservation.lease:
                self._link.call("release", lambda c: c.release(reservation.lease))
            return None
        kv_handle = transfer.store(jobs) if jobs else TransferHandle(checksums=lambda: [])

        def checksums() -> list[int]:  # the committer's thread, once the K/V copies are done (Committer._settle)
            kv_sums = kv_handle.checksums()
            return [kv_sums[value] if kind == "kv" else store_state(transfer.pages, *value) for kind, value in order]

        handle = TransferHandle(is_done=kv_handle.done, wait=kv_handle.wait, checksums=checksums)
        pending = PendingStore(reservation.lease, refs, handle, started, on_copied=life.release)
        self._committer.submit(pending)
        return StoreHandle(is_done=handle.done, block_ids=tuple(b for job in jobs for b in job.block_ids),
                           is_settled=pending.settled.is_set)

    def _state_nbytes(self, states: Mapping[int, torch.Tensor], chunk_index: int) -> int:
        """The size of the object after chunk `chunk_index`: its state, or a NO_STATE marker where there is none."""
        return self.state_layout.nbytes if (chunk_index + 1) * self.chunk_tokens in states else NO_STATE_NBYTES

    def _commit(self, lease: int, checksums: list[int]) -> bool:
        """COMMIT a store's lease (the committer thread calls this once the copies are done); False if refused."""
        return bool(self._link.call("commit", lambda c: c.commit(lease, checksums) or True))

    def _within_lease_limit(self, first: int, end: int, pages_per_chunk: int) -> int:
        """Where a store of chunks [first, end) must stop for one RESERVE to fit the pool's per-client lease limit.

        RESERVE is all or nothing, so a prompt whose KV exceeds the limit (a 256k prompt is 64 GiB; the default
        limit is half the arena) would otherwise store nothing at all. Its first chunks are the ones every later
        request shares, and a reader's LOOKUP is shortened to the same limit, so the stored prefix is all that one
        connection could load back anyway.
        """
        fits = self._lease_limit // pages_per_chunk if self._lease_limit else end - first
        if end - first <= fits:
            return end
        self.stats.store_limited_chunks += end - first - fits
        log.warning(
            "pool lease limit: storing %d of this prompt's %d new chunks (%d pages each, limit %d pages per client); "
            "raise the pool's --max-leased-pages-per-client or its --size to store prompts this long whole",
            fits, end - first, pages_per_chunk, self._lease_limit)
        return first + fits

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every store submitted so far is committed (tests, shutdown): the storer has handed each to the
        committer before the committer's flush is queued."""
        self._storer.flush(timeout)
        self._committer.flush(timeout)

    def close(self) -> None:
        self.flush(10.0)
        self._link.close()
        self._attached.retire()
