"""The connector's worker half: attaches vLLM's KV tensors, runs the step's loads and stores, reports completions.

Invariants:
- Loads start in start_load_kv, which vLLM calls before the forward of a step with synchronous loads. With
  load_waves 1 (kv_connector_extra_config) each is in the blocks, for every later kernel, when it returns. With more
  waves the pages move wave by wave (kvshare.transfer.waves) and vLLM's attention layer calls wait_for_layer_load
  before it reads a layer (vllm/model_executor/layers/attention/kv_transfer_utils.py), which orders that read after
  the layer's copies (I5 per layer). Loads are settled (copies waited, checksums compared) in wait_for_save or
  get_block_ids_with_load_errors, both after the forward; a load any of whose layers was never waited for counts as
  failed, since attention may have read that layer early.
- Stores run in wait_for_save, after the forward that wrote the KV; on CUDA the transfer layer orders its copy
  after the current stream's work (I4). A request with stores is reported in get_finished only once every store
  out of its blocks is settled (copies done, then committed and counted, or dropped), and the scheduler half keeps
  its blocks allocated until then. Settled, not only copied: vLLM takes the connector's stats in the same step,
  after get_finished, and steps no more once nothing is pending, so a store counted after its request was reported
  would stay off /metrics while the replica is idle. It holds the blocks one COMMIT round trip longer.
- A failed load reports exactly the blocks it was to fill, so vLLM (kv_load_failure_policy "recompute")
  recomputes them; a failed store is a future miss and nothing else.
- A request whose load failed stores nothing from then on, nor does any request of that step whose store would read
  one of the failed load's blocks (a block vLLM's prefix cache shared). The step's forward has already read those
  blocks (bytes that failed verification, or that were never written) and computed the rest of the step on them;
  vLLM recomputes after the step, but the step's stores run before that, and the pool would then hold wrong bytes
  under the right keys, with checksums of those bytes, which no verification catches. The next request that misses
  those chunks stores them.
- A hybrid model (kvshare.integrations.vllm.hybrid) loads asynchronously: its request is not in the step's forward,
  and the load runs whole in start_load_kv, state first (ConnectorCore verifies it before any K/V copy), then the
  K/V, both verified before the state is written into vLLM's block for the hit boundary; the request is then
  reported received, or received and failed (vLLM recomputes it from its start; no block-level errors, which vLLM
  refuses for several groups). Its stores pack each offered boundary state out of vLLM's blocks in the step's
  wait_for_save, the one point where vLLM guarantees those bytes, before the store is queued.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

from kvshare.connector import ConnectorCore
from kvshare.connector.contract import StoreHandle
from kvshare.connector.pending_load import PendingLoad
from kvshare.integrations.vllm.hybrid import HybridGroups, StatePages
from kvshare.integrations.vllm.metadata import KVShareMetadata, KVShareWorkerMetadata, LoadSpec, StoreSpec
from kvshare.transfer import KVLayout, LayoutMismatch

log = logging.getLogger("vllm.kvshare")  # under vLLM's logger, so its handlers show our lines

PREEMPTION_WAIT_S = 30.0  # bound on waiting for a preempted request's stores (copies take milliseconds)


class WorkerSide:
    def __init__(self, core: ConnectorCore, expected: KVLayout, hybrid: HybridGroups | None = None):
        self.core, self.expected, self.hybrid = core, expected, hybrid
        self._state_pages: StatePages | None = None  # a hybrid model's mamba pages (register)
        self._received: set[str] = set()  # hybrid loads ended this step (vLLM's finished_recving)
        self._failed: set[str] = set()  # among them, the failed ones (failed_recving)
        self._failed_loads: list[str] = []  # the same, for the scheduler half (take_loaded)
        self._stores: dict[str, list[StoreHandle]] = {}  # requests that were sent StoreSpecs -> their handles
        self._finishing: set[str] = set()  # finished by vLLM, waiting for their copies
        self._loaded: list[str] = []  # loads ended this step (reported to the scheduler half)
        self._invalid: set[int] = set()  # blocks of failed loads this step
        self._pending: list[tuple[LoadSpec, PendingLoad | None]] = []  # this step's loads, until settled
        self._waited: set[int] = set()  # layers vLLM waited for this step
        self._step_failed: set[int] = set()  # blocks of this step's failed loads (kept until the next step's load)
        self._tainted: set[str] = set()  # requests that store nothing more: a load failed under them (see save)
        self._layer_index: dict[str, int] = {}  # vLLM's layer name -> index in the registered KV caches
        self._warned_unwaited = False

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        """Attach the attention layers' tensors (all of them, or a hybrid model's attention group's) to the core;
        a hybrid model's mamba pages are kept for its states."""
        if self.hybrid is not None:
            self._state_pages = StatePages(self.hybrid, kv_caches)
            kv_caches = {name: kv_caches[name] for name in self.hybrid.attention_layers}
        layout = KVLayout.from_tensors(list(kv_caches.values()), kind=self.expected.kind,
                                       block_size=self.expected.block_size)
        if layout.layout_id() != self.expected.layout_id():
            raise LayoutMismatch(
                f"vLLM registered KV caches {layout.describe()} but its config describes {self.expected.describe()}"
            )
        self.core.attach(layout, list(kv_caches.values()))
        self._layer_index = {name: index for index, name in enumerate(kv_caches)}
        log.info("kvshare connector attached: %s, %s", layout.describe(), self.core.namespace().describe())
        return layout

    # ---- per step ------------------------------------------------------------------------------------------
    def load(self, meta: KVShareMetadata) -> None:
        """start_load_kv: start every load of the step (settle_loads ends them)."""
        self.settle_loads()  # a step whose loads were never settled (none expected): end them first
        # A new step: the last one's stores ran in its wait_for_save (or never will), after its loads were settled.
        self._step_failed = set()
        if self.hybrid is not None:
            for spec in meta.loads:
                self._load_hybrid(spec)
            return
        self._pending = [(spec, self._start_one(spec)) for spec in meta.loads]

    def _load_hybrid(self, spec: LoadSpec) -> None:
        """One asynchronous hybrid load, whole: reported received (and failed, unless it all verified)."""
        ok = False
        try:
            ok = self._hybrid_copies(spec)
        finally:  # reported whatever happened: vLLM waits for the request until it is
            self._loaded.append(spec.req_id)
            self._received.add(spec.req_id)
            if not ok:
                self._failed.add(spec.req_id)
                self._failed_loads.append(spec.req_id)

    def _hybrid_copies(self, spec: LoadSpec) -> bool:
        hit = spec.hit
        if hit.end - spec.num_computed != spec.num_tokens or not spec.state_blocks or not all(spec.state_blocks):
            log.warning("vLLM accepted %d external tokens of a %d-token pool hit (state blocks %s); recomputing",
                        spec.num_tokens, hit.end - spec.num_computed, spec.state_blocks)
            return False
        state = self.hybrid.state_layout.new_buffer()
        # The state is copied and verified first (start_load), the K/V copies and checksums end in finish(); only
        # then does vLLM's block get the state, so a failed load leaves nothing of it there.
        pending = self.core.start_load(hit, spec.block_ids, spec.num_computed, waves=1, release=False, state=state,
                                       salt=spec.salt)
        if not pending.finish():
            return False
        if not self.core.config.unsafe_skip_state_load:  # the negative control leaves vLLM's block as it was
            self._state_pages.unpack(state, spec.state_blocks)
        return True

    def take_received(self) -> tuple[set[str], set[str]]:
        """(hybrid loads ended since the last call, the failed ones among them)."""
        received, failed = self._received, self._failed
        self._received, self._failed = set(), set()
        return received, failed

    def _start_one(self, spec: LoadSpec) -> PendingLoad | None:
        hit = spec.hit
        if hit.end - spec.num_computed != spec.num_tokens:
            log.warning("vLLM accepted %d external tokens of a %d-token pool hit; recomputing them",
                        spec.num_tokens, hit.end - spec.num_computed)
            return None
        # release=False: the read lease is the scheduler process's; it ends it when this step's output arrives,
        # which is after settle_loads has waited for the copies.
        return self.core.start_load(hit, spec.block_ids, spec.num_computed, waves=self.core.config.load_waves,
                                    release=False, salt=spec.salt)

    def wait_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: order the layer's reads after its copies, for every load of the step."""
        index = self._layer_index.get(layer_name)
        if index is None or not self._pending:
            return
        self._waited.add(index)
        for _, pending in self._pending:
            if pending is not None:
                pending.wait_layer(index)

    def settle_loads(self) -> None:
        """After the forward: wait for the step's loads and record the blocks of those that failed."""
        layered = self.core.config.load_waves > 1
        unwaited = layered and self._pending and len(self._waited) < len(self._layer_index)
        if unwaited and not self._warned_unwaited:
            self._warned_unwaited = True  # once: the same vLLM would do it every step
            log.warning("vLLM did not wait for %d layer(s) of this step's pool loads; counting such loads as failed "
                        "(set \"load_waves\": 1 in kv_connector_extra_config to load whole before the forward)",
                        len(self._layer_index) - len(self._waited))
        for spec, pending in self._pending:
            if pending is not None and unwaited:
                pending.discard()
            ok = pending is not None and pending.finish()
            if not ok:
                blocks = spec.block_range(self.expected.block_size)
                self._invalid.update(blocks)
                self._step_failed.update(blocks)
                self._taint(spec.req_id)
            self._loaded.append(spec.req_id)
        self._pending, self._waited = [], set()

    def save(self, meta: KVShareMetadata) -> None:
        self.settle_loads()  # first: the loads' copies are over before any store of this step reads blocks
        for spec in meta.stores:
            if self._tainted_store(spec):
                self._stores.setdefault(spec.req_id, [])  # reported in get_finished all the same
                continue
            handle = self.core.store(spec.token_ids, spec.block_ids, spec.num_stored, spec.salt, spec.tail,
                                     self._states_of(spec))
            # Tracked even when the store was skipped (None): the scheduler half delays every request it sent.
            self._stores.setdefault(spec.req_id, []).extend([handle] if handle is not None else [])

    def _tainted_store(self, spec: StoreSpec) -> bool:
        """Whether the store must not run: its request's load failed, or it reads a block of a load that failed this
        step (which taints its request too: see the module's invariants)."""
        # The common case (no load failed this step) looks at no block: a 128k store names 8,192 of them.
        if spec.req_id not in self._tainted and (not self._step_failed
                                                 or self._step_failed.isdisjoint(spec.block_ids)):
            return False
        self._taint(spec.req_id)
        return True

    def _taint(self, req_id: str) -> None:
        if req_id not in self._tainted:
            self._tainted.add(req_id)
            log.warning("request %s computed on KV that failed to load: none of its KV is stored (vLLM recomputes "
                        "it; the next request that misses those chunks stores them)", req_id)

    def _states_of(self, spec: StoreSpec) -> dict[int, torch.Tensor] | None:
        """A hybrid store's offered boundary states, packed now (vLLM may reuse those blocks after this step)."""
        if self._state_pages is None:
            return None
        return {boundary: self._state_pages.pack(blocks) for boundary, blocks in spec.states.items()}

    def preempted(self, meta: KVShareMetadata) -> None:
        """vLLM frees a preempted request's blocks without asking: finish copying out of them first."""
        deadline = time.monotonic() + PREEMPTION_WAIT_S
        for rid in meta.preempted:
            while not all(h.done() for h in self._stores.get(rid, ())) and time.monotonic() < deadline:
                time.sleep(0.001)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests (among those sent stores) that vLLM finished and whose stores are all settled."""
        self._tainted -= finished_req_ids
        self._finishing |= finished_req_ids & self._stores.keys()
        done = {rid for rid in self._finishing if all(h.settled() for h in self._stores[rid])}
        for rid in done:
            del self._stores[rid]
        self._finishing -= done
        return done

    def take_loaded(self) -> KVShareWorkerMetadata | None:
        loaded, self._loaded = self._loaded, []
        failed, self._failed_loads = self._failed_loads, []
        return KVShareWorkerMetadata(loaded, failed) if loaded else None

    def take_invalid(self) -> set[int]:
        self.settle_loads()  # vLLM may skip wait_for_save (deferred finalization): settle here too
        invalid, self._invalid = self._invalid, set()
        return invalid
