"""PromotionPolicy: when the pool holds less of a prompt than its chunks (an L1 miss, or a short hit), does promoting
the rest from L2 beat recomputing it? Decided per request with the cost model of `kvshare advise`
(kvshare.costmodel) and the rates this replica measures as it runs:

- its prefill times: the engine reports each prefill (new tokens, tokens already cached, seconds), and the last
  WINDOW of them fit the prefill curve;
- its loads from the pool: the connector's own load_bytes / load_seconds (a vLLM scheduler process loads nothing
  itself: there the load term is left out, on both sides of the comparison);
- L2 -> pool promotion: the pool's STATS (l2_promoted_bytes / l2_promote_seconds), read at most every
  STATS_INTERVAL_S seconds;
- KV bytes per token: from the chunks the pool reports (nbytes of a chunk / its tokens).

Until it has them (fewer than MIN_SAMPLES prefills of distinct lengths, or no promotion seen by the pool yet) it
promotes: today's behaviour, which also measures the L2 rate. Mode "always" promotes every time (the decision off).
Counted in ConnectorStats: l2_promote_chosen and l2_promote_declined (the model's decisions), l2_promote_unmeasured
(promoted for want of rates).

Thread-safety: observe_prefill() runs on the engine's thread, decide() on the connector caller's; the lock guards
the samples and rates (never held during a pool call).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kvshare.connector.contract import ConnectorStats
from kvshare.costmodel import CostModel, PrefillCurve, PrefillSample, Rates

MODES = ("decide", "always")
MIN_SAMPLES = 3  # prefills of distinct lengths before the curve is trusted
WINDOW = 64  # prefills kept (the most recent): the curve follows the replica's current speed
STATS_INTERVAL_S = 5.0  # how stale the pool's L2 rate may be
UNKNOWN_LOAD_GB_S = 1e6  # no load measured in this process: the load term is left out on both sides


@dataclass(frozen=True)
class Decision:
    promote: bool
    measured: bool  # False: promoted for want of rates
    promote_s: float = 0.0  # the model's time with promotion (measured decisions only)
    stay_s: float = 0.0  # and without


class PromotionPolicy:
    def __init__(self, mode: str, chunk_tokens: int, stats: ConnectorStats, clock=time.monotonic) -> None:
        if mode not in MODES:
            raise ValueError(f"L2 promotion mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.chunk_tokens, self.stats, self.clock = mode, chunk_tokens, stats, clock
        self._lock = threading.Lock()
        self._samples: deque[PrefillSample] = deque(maxlen=WINDOW)
        self._curve: PrefillCurve | None = None  # fitted lazily; None after each new sample
        self._kv_bytes_per_token = 0.0
        self._l2_gb_s = 0.0
        self._l2_enabled = True  # until the pool's STATS say otherwise
        self._stats_read_at = -STATS_INTERVAL_S

    @property
    def deciding(self) -> bool:
        """Does a LOOKUP ask the pool without promotion first?"""
        return self.mode == "decide" and self._l2_enabled

    # ---- what the replica measures --------------------------------------------------------------------------
    def observe_prefill(self, new: int, cached: int, seconds: float) -> None:
        if new > 0 and seconds > 0:
            with self._lock:
                self._samples.append(PrefillSample(new, cached, seconds))
                self._curve = None

    def observe_chunk(self, nbytes: int, tokens: int) -> None:
        if nbytes > 0 and tokens > 0:
            with self._lock:
                self._kv_bytes_per_token = nbytes / tokens

    def stats_due(self) -> bool:
        return self.mode == "decide" and self.clock() - self._stats_read_at >= STATS_INTERVAL_S

    def observe_pool(self, l2_enabled: bool, promoted_bytes: int, promote_seconds: float) -> None:
        with self._lock:
            self._stats_read_at = self.clock()
            self._l2_enabled = l2_enabled
            if promote_seconds > 0 and promoted_bytes > 0:
                self._l2_gb_s = promoted_bytes / promote_seconds / 1e9

    # ---- the decision ---------------------------------------------------------------------------------------
    def decide(self, prompt_tokens: int, local: int, l1_hit: int, l2_hit: int) -> Decision:
        """Promote tokens l1_hit..l2_hit of a prompt whose first `local` tokens the engine holds itself? Counted."""
        model = self._model() if self.mode == "decide" else None
        if model is None:
            if self.mode == "decide":
                self.stats.l2_promote_unmeasured += 1
            return Decision(True, False)
        promote_s = model.l2(prompt_tokens, l2_hit, l1_hit, local)
        stay_s = (model.pool(prompt_tokens, l1_hit, local) if l1_hit > local else
                  model.recompute(prompt_tokens, local))
        promote = promote_s < stay_s
        if promote:
            self.stats.l2_promote_chosen += 1
        else:
            self.stats.l2_promote_declined += 1
        return Decision(promote, True, promote_s, stay_s)

    def _model(self) -> CostModel | None:
        with self._lock:
            if len({s.new + s.cached for s in self._samples}) < MIN_SAMPLES or not self._l2_gb_s:
                return None
            if not self._kv_bytes_per_token:
                return None
            if self._curve is None:
                self._curve = PrefillCurve.fit(list(self._samples))
            load = self._load_gb_s()
            return CostModel(Rates(self._curve, self._kv_bytes_per_token, load, self._l2_gb_s, self.chunk_tokens))

    def _load_gb_s(self) -> float:
        s = self.stats
        return s.load_bytes / s.load_seconds / 1e9 if s.loads and s.load_seconds > 0 else UNKNOWN_LOAD_GB_S
