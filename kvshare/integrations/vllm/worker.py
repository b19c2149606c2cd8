"""The connector's worker half: attaches vLLM's KV tensors, runs the step's loads and stores, reports completions.

Invariants:
- Loads run in start_load_kv, which vLLM calls before the forward of a step with synchronous loads, and return
  only when the bytes are in the blocks (ConnectorCore.load waits), so attention never reads a block early (I5).
- Stores run in wait_for_save, after the forward that wrote the KV; on CUDA the transfer layer orders its copy
  after the current stream's work (I4). A request with stores is reported in get_finished only once every copy
  out of its blocks is done, and the scheduler half keeps its blocks allocated until then.
- A failed load reports exactly the blocks it was to fill, so vLLM (kv_load_failure_policy "recompute")
  recomputes them; a failed store is a future miss and nothing else.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

from kvshare.connector import ConnectorCore
from kvshare.connector.contract import StoreHandle
from kvshare.integrations.vllm.metadata import KVShareMetadata, KVShareWorkerMetadata, LoadSpec
from kvshare.transfer import KVLayout, LayoutMismatch

log = logging.getLogger("vllm.kvshare")  # under vLLM's logger, so its handlers show our lines

PREEMPTION_WAIT_S = 30.0  # bound on waiting for a preempted request's stores (copies take milliseconds)


class WorkerSide:
    def __init__(self, core: ConnectorCore, expected: KVLayout):
        self.core, self.expected = core, expected
        self._stores: dict[str, list[StoreHandle]] = {}  # requests that were sent StoreSpecs -> their handles
        self._finishing: set[str] = set()  # finished by vLLM, waiting for their copies
        self._loaded: list[str] = []  # loads ended this step (reported to the scheduler half)
        self._invalid: set[int] = set()  # blocks of failed loads this step

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        layout = KVLayout.from_tensors(list(kv_caches.values()), kind=self.expected.kind,
                                       block_size=self.expected.block_size)
        if layout.layout_id() != self.expected.layout_id():
            raise LayoutMismatch(
                f"vLLM registered KV caches {layout.describe()} but its config describes {self.expected.describe()}"
            )
        self.core.attach(layout, list(kv_caches.values()))
        log.info("kvshare connector attached: %s, %s", layout.describe(), self.core.namespace().describe())
        return layout

    # ---- per step ------------------------------------------------------------------------------------------
    def load(self, meta: KVShareMetadata) -> None:
        for spec in meta.loads:
            if not self._load_one(spec):
                self._invalid.update(spec.block_range(self.expected.block_size))
            self._loaded.append(spec.req_id)

    def _load_one(self, spec: LoadSpec) -> bool:
        hit = spec.hit
        if hit.end - spec.num_computed != spec.num_tokens:
            log.warning("vLLM accepted %d external tokens of a %d-token pool hit; recomputing them",
                        spec.num_tokens, hit.end - spec.num_computed)
            return False
        # release=False: the read lease is the scheduler process's; it ends it when this step's output arrives.
        return self.core.load(hit, spec.block_ids, spec.num_computed, release=False)

    def save(self, meta: KVShareMetadata) -> None:
        for spec in meta.stores:
            handle = self.core.store(spec.token_ids, spec.block_ids, spec.num_stored, spec.salt, spec.tail)
            # Tracked even when the store was skipped (None): the scheduler half delays every request it sent.
            self._stores.setdefault(spec.req_id, []).extend([handle] if handle is not None else [])

    def preempted(self, meta: KVShareMetadata) -> None:
        """vLLM frees a preempted request's blocks without asking: finish copying out of them first."""
        deadline = time.monotonic() + PREEMPTION_WAIT_S
        for rid in meta.preempted:
            while not all(h.done() for h in self._stores.get(rid, ())) and time.monotonic() < deadline:
                time.sleep(0.001)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests (among those sent stores) that vLLM finished and whose copies are all done."""
        self._finishing |= finished_req_ids & self._stores.keys()
        done = {rid for rid in self._finishing if all(h.done() for h in self._stores[rid])}
        for rid in done:
            del self._stores[rid]
        self._finishing -= done
        return done

    def take_loaded(self) -> KVShareWorkerMetadata | None:
        loaded, self._loaded = self._loaded, []
        return KVShareWorkerMetadata(loaded) if loaded else None

    def take_invalid(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
