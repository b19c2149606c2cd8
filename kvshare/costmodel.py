"""The cost model: for a prompt of n tokens, how long a recompute, a pool hit and an L2 hit take before the first
token, from measured rates; where the fastest changes (break-even lengths); and what a router policy gains on a mix
of sessions.

Times (seconds):
- prefill of `new` tokens after `cached` ones: fixed + per_token * new + per_pair * ((cached + new)^2 - cached^2).
  The linear term is the token-wise work (projections, MLP), the quadratic one causal attention (each new token
  attends to every earlier one); fitted to measured prefills (PrefillCurve.fit), so no FLOP count is needed.
- recompute(n) = prefill(n, 0)
- pool hit of h tokens: pool_fixed + h * kv_bytes_per_token / load rate + prefill(n - h, h)
- L2 hit of h tokens of which l1 are in the pool already: l2_fixed + (h - l1) * kv_bytes_per_token / L2 rate, then
  the pool hit of h (promotion into the pool precedes the replica's load; they do not overlap today).

A hit covers whole chunks and leaves at least the prompt's last token to compute (the first output token needs it).
Pure arithmetic: no I/O, no torch; the connector's promotion decision imports it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

CHOICES = ("recompute", "pool", "l2")


@dataclass(frozen=True)
class PrefillSample:
    new: int  # tokens computed
    cached: int  # tokens already in the KV cache before them
    seconds: float


@dataclass(frozen=True)
class PrefillCurve:
    fixed_s: float
    per_token_s: float
    per_pair_s: float  # coefficient of the attention term ((cached + new)^2 - cached^2)

    def seconds(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        pairs = (cached + new) ** 2 - cached**2
        return self.fixed_s + self.per_token_s * new + self.per_pair_s * pairs

    @classmethod
    def fit(cls, samples: list[PrefillSample]) -> "PrefillCurve":
        """Least squares with every coefficient >= 0 (a negative cost per token is noise, not physics): the best
        fit over the subsets of terms whose unconstrained solution is non-negative. Relative errors are
        minimised (each sample weighted by 1/seconds), so short prompts count as much as long ones."""
        if not samples:
            raise ValueError("no prefill samples: give measured prefill times (or a replica to calibrate against)")
        rows = np.array([[1.0, s.new, (s.cached + s.new) ** 2 - s.cached**2] for s in samples])
        times = np.array([s.seconds for s in samples])
        weights = 1.0 / np.maximum(times, 1e-9)
        best, best_error = None, math.inf
        for terms in _subsets(3, at_most=len(samples)):
            a = rows[:, terms] * weights[:, None]
            coef, *_ = np.linalg.lstsq(a, times * weights, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(terms)] = coef
            error = float(((rows @ full - times) * weights) @ ((rows @ full - times) * weights))
            if error < best_error:
                best, best_error = full, error
        return cls(*map(float, best))


def _subsets(n: int, at_most: int):
    for size in range(1, min(n, at_most) + 1):
        yield from (list(c) for c in itertools.combinations(range(n), size))


@dataclass(frozen=True)
class Rates:
    """What the model is computed from (each measured: see calibrate.py and docs/results/advise.md)."""

    prefill: PrefillCurve
    kv_bytes_per_token: float
    load_gb_s: float  # pool (host memory) -> the engine's KV cache
    l2_gb_s: float  # L2 -> pool promotion, verification and arena copy included
    chunk_tokens: int = 256
    pool_fixed_s: float = 0.0  # a pool hit's cost beyond bytes: LOOKUP, leases, request handling
    l2_fixed_s: float = 0.0  # a promotion's cost beyond bytes: round trips to L2 and back


@dataclass(frozen=True)
class Choice:
    best: str  # one of CHOICES
    seconds: dict[str, float]  # every option's time (an option that cannot apply is absent)


class CostModel:
    def __init__(self, rates: Rates) -> None:
        self.rates = rates

    def hit_tokens(self, n: int) -> int:
        """Tokens a full-prefix hit covers: whole chunks, leaving the last token to compute."""
        return (n - 1) // self.rates.chunk_tokens * self.rates.chunk_tokens

    def recompute(self, n: int, cached: int = 0) -> float:
        return self.rates.prefill.seconds(n - cached, cached)

    def pool(self, n: int, hit: int, local: int = 0) -> float:
        """A pool hit of `hit` tokens for an engine that holds the first `local` of them already (loads the rest)."""
        r = self.rates
        loaded = max(0, hit - local)
        return r.pool_fixed_s + loaded * r.kv_bytes_per_token / (r.load_gb_s * 1e9) + r.prefill.seconds(n - hit, hit)

    def l2(self, n: int, hit: int, l1_hit: int = 0, local: int = 0) -> float:
        """Promote tokens l1_hit..hit into the pool, then a pool hit of `hit` (the engine holding `local`)."""
        r = self.rates
        promoted = max(0, hit - l1_hit) * r.kv_bytes_per_token / (r.l2_gb_s * 1e9)
        return r.l2_fixed_s + promoted + self.pool(n, hit, local)

    def choose(self, n: int, l1_hit: int = 0, l2_hit: int | None = None) -> Choice:
        """The fastest way to the first token of an n-token prompt whose first l1_hit tokens are in the pool and
        first l2_hit (default: the full prefix) in L2."""
        l2_hit = self.hit_tokens(n) if l2_hit is None else l2_hit
        seconds = {"recompute": self.recompute(n)}
        if l1_hit > 0:
            seconds["pool"] = self.pool(n, l1_hit)
        if l2_hit > l1_hit:
            seconds["l2"] = self.l2(n, l2_hit, l1_hit)
        return Choice(min(seconds, key=seconds.get), seconds)

    def promotion_pays(self, n: int, l1_hit: int, l2_hit: int) -> bool:
        """Does promoting tokens l1_hit..l2_hit from L2 beat using the pool's l1_hit (or recomputing)?"""
        stay = self.pool(n, l1_hit) if l1_hit > 0 else self.recompute(n)
        return l2_hit > l1_hit and self.l2(n, l2_hit, l1_hit) < stay

    def break_even(self, option: str, max_tokens: int) -> list[int]:
        """Prompt lengths (tokens) where `option` (pool or l2, a full-prefix hit) and recompute trade places, in
        increasing order, found on a grid of whole chunks up to max_tokens and refined to the token."""
        cost = self.pool if option == "pool" else self.l2

        def gain(n: int) -> float:
            return self.recompute(n) - cost(n, self.hit_tokens(n))

        grid = sorted({int(x) for x in np.geomspace(self.rates.chunk_tokens + 1, max_tokens, 400)})
        points = []
        for lo, hi in itertools.pairwise(grid):
            if (gain(lo) > 0) != (gain(hi) > 0):
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if (gain(mid) > 0) == (gain(lo) > 0) else (lo, mid)
                points.append(hi)
        return points


# ---- placement: sessions under a router policy ------------------------------------------------------------------


@dataclass(frozen=True)
class SessionKind:
    """Sessions that start with `context` tokens, then `turns` turns, each adding a user message and an answer."""

    context: int
    turns: int = 6
    user_tokens: int = 256
    answer_tokens: int = 32
    weight: float = 1.0  # share of this kind in the mix


@dataclass(frozen=True)
class SessionEstimate:
    kind: SessionKind
    policy: str
    off_s: float  # the session's TTFTs (plus decode, if given) without the pool
    on_s: float  # with the pool

    @property
    def gain(self) -> float:
        return 1.0 - self.on_s / self.off_s if self.off_s else 0.0


def session_estimate(model: CostModel, kind: SessionKind, policy: str, replicas: int = 2,
                     decode_s_per_token: float = 0.0) -> SessionEstimate:
    """Both arms of one session: `alternate` sends turn k to replica k mod replicas, `fixed` keeps it on one.

    A replica's own prefix cache holds what it computed (prompt and answer) for its last turn of the session; the
    pool holds every earlier turn's full chunks. Turn k's prompt (k = 0, 1, ...) is the context plus k user messages
    and k answers."""
    off = on = 0.0
    last_seen: dict[int, int] = {}  # replica -> tokens of this session in its own cache
    chunk = model.rates.chunk_tokens
    for k in range(kind.turns):
        prompt = kind.context + k * (kind.user_tokens + kind.answer_tokens)
        replica = k % replicas if policy == "alternate" else 0
        local = min(last_seen.get(replica, 0), prompt - 1)
        # the previous turn's prompt and answer, stored at its end, in whole chunks
        pooled = min((prompt - kind.user_tokens) // chunk * chunk, model.hit_tokens(prompt)) if k else 0
        off += model.recompute(prompt, local)
        on += min(model.recompute(prompt, local), model.pool(prompt, pooled, local) if pooled > local else math.inf)
        last_seen[replica] = prompt + kind.answer_tokens
    decode = kind.turns * kind.answer_tokens * decode_s_per_token
    return SessionEstimate(kind, policy, off + decode, on + decode)


def mix_gain(estimates: list[SessionEstimate]) -> float:
    """The mix's gain: 1 - weighted ON time / weighted OFF time."""
    off = sum(e.kind.weight * e.off_s for e in estimates)
    on = sum(e.kind.weight * e.on_s for e in estimates)
    return 1.0 - on / off if off else 0.0
