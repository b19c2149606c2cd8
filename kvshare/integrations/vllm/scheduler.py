"""The connector's scheduler half: reports pool hits to vLLM's scheduler and plans each step's loads and stores.

Invariants:
- Reported external tokens are whole blocks the pool holds *now* (full chunks, a tail, or a stored chunk's first
  blocks), under a read lease, beyond vLLM's own prefix hit, and never the last token (vLLM must compute >= 1 token
  to sample).
- Every lease taken ends exactly once: when the request is re-queried, when vLLM allocates nothing for it, when
  it finishes unscheduled, or when the worker reports the load over (the lease belongs to this process's pool
  connection, so only this half can end it).
- A request stores only what comes after the chunks its pool hit found (the pool holds those already).
- A request returns delay_free=True from request_finished iff a StoreSpec was ever sent for it; the worker half
  tracks the same set and reports each one in get_finished once its copies are done (blocks stay alive until then).
- A hybrid model (kvshare.integrations.vllm.hybrid): hits end on a chunk boundary where the pool holds the state
  (ConnectorCore's hybrid path) and load asynchronously (the request waits for the worker's report); stores are
  planned only from vLLM's boundary-state offers of the step, each up to the last offered boundary, so a chunk is
  stored with the state at its end where vLLM has one and a NO_STATE marker where it has none.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from kvshare.connector import ConnectorCore, PoolHit
from kvshare.integrations.vllm.compat import BlockTables
from kvshare.integrations.vllm.hybrid import HybridGroups
from kvshare.integrations.vllm.metadata import KVShareMetadata, KVShareWorkerMetadata, LoadSpec, StoreSpec

log = logging.getLogger("vllm.kvshare")  # under vLLM's logger, so its handlers show our lines

BlockIds = KVCacheManager | BlockTables  # what answers get_block_ids(req_id): vLLM 0.32's manager, 0.26's tables


@dataclass(frozen=True)
class _Hit:
    hit: PoolHit
    num_computed: int  # vLLM's block-aligned local hit when we looked
    offered: int  # tokens reported to vLLM
    accepted: int = 0  # tokens vLLM allocated for (update_state_after_alloc)


@dataclass(frozen=True)
class _Step:
    started: float  # perf_counter() when the step was planned (build)
    prefill: tuple[int, int] | None  # (new tokens, cached tokens) when the step ran one prefill and nothing else


class SchedulerSide:
    def __init__(self, core: ConnectorCore, block_size: int, hybrid: HybridGroups | None = None):
        self.core, self.block_size, self.chunk = core, block_size, core.chunk_tokens
        self.hybrid = hybrid
        self._failed: set[str] = set()  # hybrid requests whose load failed: recomputed, never offered a hit again
        self._found: dict[str, _Hit] = {}  # leased, waiting for allocation
        self._to_load: dict[str, _Hit] = {}  # allocated, goes into the next metadata
        self._loading: dict[str, PoolHit] = {}  # sent to the worker; lease ends when it reports
        self._requests: dict[str, Request] = {}
        self._stored: dict[str, int] = {}  # tokens whose chunks were sent for storing or its hit found held
        self._store_sent: set[str] = set()
        self._prompt_stored: set[str] = set()  # requests whose prompt store (with its tail) was sent
        # Steps planned and not yet reported, oldest first: vLLM reports a step's output (update_connector_output)
        # once it ran, in order, so the oldest pending step is the one reported. Bounded, should a report be missed.
        self._steps: deque[_Step] = deque(maxlen=8)

    # ---- lookups -------------------------------------------------------------------------------------------
    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """(tokens the pool adds to vLLM's own hit, whether they load asynchronously: a hybrid model's do)."""
        rid = request.request_id
        self._end(self._found.pop(rid, None))  # a re-query replaces the earlier answer (and its lease)
        self._requests[rid] = request
        if rid in self._failed:
            return 0, False
        # find() answers whole blocks before the last token, which vLLM must compute to sample.
        tokens = list(request.all_token_ids[: request.num_tokens])
        hit = self.core.find(tokens, num_computed, salt=request.cache_salt or "")
        if hit is None:
            return 0, False
        offered = hit.end - num_computed
        self._found[rid] = _Hit(hit, num_computed, offered)
        return offered, self.hybrid is not None

    def allocated(self, request: Request, num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, None)
        if found is None:
            return
        if num_external_tokens == 0:
            self._end(found)
            return
        rid = request.request_id
        self._to_load[rid] = replace(found, accepted=num_external_tokens)
        # The pool holds the hit's chunks and those before it: the request stores only what comes after them. Sending
        # them again made the worker hash the whole prompt and RESERVE chunks the pool already held, after the forward
        # and before the first token (at 128k, 512 chunks). Should the load fail, the worker stores nothing of the
        # request at all (WorkerSide.save), and the next request that misses those chunks stores them.
        self._stored[rid] = max(self._stored.get(rid, 0), found.hit.held(self.chunk))

    def worker_reported(self, meta: KVShareWorkerMetadata | None) -> None:
        self._step_over()
        for rid in meta.loaded if meta else ():
            hit = self._loading.pop(rid, None)
            if hit is not None:
                self.core.release_hit(hit)
        self._failed.update(rid for rid in (meta.failed if meta else ()) if rid in self._requests)

    # ---- the step's plan -----------------------------------------------------------------------------------
    def build(self, output: SchedulerOutput, kv_cache_manager: BlockIds) -> KVShareMetadata:
        self._steps.append(_Step(time.perf_counter(), self._lone_prefill(output)))
        meta = KVShareMetadata(preempted=sorted(output.preempted_req_ids or ()))
        for rid, found in self._to_load.items():
            meta.loads.append(self._load_spec(rid, found, kv_cache_manager.get_block_ids(rid)))
            self._loading[rid] = found.hit
        self._to_load.clear()
        if self.hybrid is not None:
            meta.stores.extend(self._hybrid_stores(output, kv_cache_manager))
            return meta
        for rid, scheduled in output.num_scheduled_tokens.items():
            spec = self._store_spec(rid, scheduled, kv_cache_manager)
            if spec is not None:
                meta.stores.append(spec)
        return meta

    def _load_spec(self, rid: str, found: _Hit, tables: tuple[list[int], ...]) -> LoadSpec:
        """The load of a hit into the request's blocks: its only group's, or a hybrid model's attention group's
        plus, per mamba group, the block at the hit's boundary (where vLLM reads the state from when the request
        runs: it copies that block into the running one first)."""
        hybrid, salt = self.hybrid, self._requests[rid].cache_salt or ""
        if hybrid is None:
            return LoadSpec(rid, found.hit, list(tables[0]), found.num_computed, found.accepted, salt=salt)
        index = hybrid.state_index(found.hit.end)
        state_blocks = [tables[g][index] if index < len(tables[g]) else 0 for g in hybrid.mamba]
        return LoadSpec(rid, found.hit, list(tables[hybrid.attention]), found.num_computed, found.accepted,
                        state_blocks, salt)

    def _hybrid_stores(self, output: SchedulerOutput, kv_cache_manager: BlockIds) -> list[StoreSpec]:
        """One store per request with boundary states offered this step (vLLM's boundary_state_offloads: group,
        block, boundary tokens), up to its last boundary where every mamba group offered a block."""
        block_state = output.kv_connector_block_state
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        specs = []
        for rid, entries in offers.items():
            request, stored = self._requests.get(rid), self._stored.get(rid, 0)
            states = _complete_states(entries, self.hybrid.mamba, self.chunk, stored)
            if request is None or not states:
                continue
            end = max(states)
            self._stored[rid] = end
            self._store_sent.add(rid)
            blocks = list(kv_cache_manager.get_block_ids(rid)[self.hybrid.attention][: end // self.block_size])
            specs.append(StoreSpec(rid, list(request.all_token_ids[:end]), blocks, stored,
                                   request.cache_salt or "", False, states))
        return specs

    def _lone_prefill(self, output: SchedulerOutput) -> tuple[int, int] | None:
        """(tokens scheduled, tokens computed before) of the step's prefill, if it schedules exactly one request and
        that request is prefilling: only then is the step's time that prefill's (what the L2 decision learns from)."""
        if len(output.num_scheduled_tokens) != 1:
            return None
        ((rid, scheduled),) = output.num_scheduled_tokens.items()
        request = self._requests.get(rid)
        if request is None or request.num_computed_tokens >= request.num_prompt_tokens:
            return None
        return scheduled, request.num_computed_tokens

    def _step_over(self) -> None:
        if self._steps:
            step = self._steps.popleft()
            if step.prefill is not None:
                self.core.observe_prefill(*step.prefill, time.perf_counter() - step.started)

    def _store_spec(self, rid: str, scheduled: int, kv_cache_manager: BlockIds) -> StoreSpec | None:
        request = self._requests.get(rid)
        if request is None:
            return None
        # num_computed_tokens is not yet advanced for this step: after its forward, KV exists up to `computed`.
        # With async scheduling the newest token may not be known yet, hence the clamp to all_token_ids.
        computed = min(request.num_computed_tokens + scheduled, request.num_tokens)
        # Once the prompt is computed, its own store: full chunks and the whole blocks after them (its one tail, what
        # another replica given the same prompt looks up). Then the full chunks that generated tokens complete.
        tail = computed >= request.num_prompt_tokens and rid not in self._prompt_stored
        if tail:
            self._prompt_stored.add(rid)
            storable = request.num_prompt_tokens // self.block_size * self.block_size
        else:
            storable = computed // self.chunk * self.chunk
        stored = self._stored.get(rid, 0)
        if storable <= stored:
            return None
        self._stored[rid] = storable
        self._store_sent.add(rid)
        blocks = list(kv_cache_manager.get_block_ids(rid)[0][: storable // self.block_size])
        tokens = list(request.all_token_ids[:storable])
        return StoreSpec(rid, tokens, blocks, stored, request.cache_salt or "", tail)

    # ---- end of a request ----------------------------------------------------------------------------------
    def finished(self, request: Request) -> bool:
        """True: vLLM must keep the request's blocks until the worker reports its stores done."""
        rid = request.request_id
        self._end(self._found.pop(rid, None))
        self._end(self._to_load.pop(rid, None))  # finished (aborted) before its load was sent
        self._requests.pop(rid, None)
        self._stored.pop(rid, None)
        self._prompt_stored.discard(rid)
        self._failed.discard(rid)
        delay = rid in self._store_sent
        self._store_sent.discard(rid)
        return delay

    def _end(self, found: _Hit | None) -> None:
        if found is not None:
            self.core.release_hit(found.hit)


def _complete_states(entries: list[tuple[int, int, int]], mamba: tuple[int, ...], chunk: int,
                     stored: int) -> dict[int, list[int]]:
    """boundary -> [block per mamba group] for the offered boundaries past `stored`, on chunk ends, that every
    mamba group offered (a state missing one layer's part is no state)."""
    by_boundary: dict[int, dict[int, int]] = {}
    for group, block, boundary in entries:
        by_boundary.setdefault(boundary, {})[group] = block
    return {boundary: [blocks[g] for g in mamba] for boundary, blocks in sorted(by_boundary.items())
            if boundary > stored and boundary % chunk == 0 and all(g in blocks for g in mamba)}
