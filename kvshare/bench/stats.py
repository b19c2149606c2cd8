"""Robust statistics for benchmark samples: median, IQR, seeded percentile-bootstrap CIs, speedups and block pairs.

Invariants:
- Every function is deterministic for a given `seed` (numpy's PCG64), so a report can be recomputed exactly.
- Quantiles use numpy's default linear interpolation; the IQR of [1..5] is (2, 4).
- Empty samples give NaN summaries rather than raising: a partial run still gets a (partial) report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

N_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Summary:
    """One sample: its size, median, quartiles and the bootstrap CI of the median."""

    n: int
    median: float
    q1: float
    q3: float
    ci_low: float
    ci_high: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


@dataclass(frozen=True)
class Comparison:
    """OFF vs ON: speedup = median(OFF) / median(ON), with its bootstrap CI (OFF and ON resampled independently)."""

    off: Summary
    on: Summary
    speedup: float
    speedup_ci_low: float
    speedup_ci_high: float


def median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else math.nan


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(Q1, Q3) with linear interpolation."""
    if not len(values):
        return math.nan, math.nan
    q1, q3 = np.percentile(np.asarray(values, dtype=float), [25, 75])
    return float(q1), float(q3)


def bootstrap_ci(
    values: Sequence[float],
    statistic: Callable[[np.ndarray], np.ndarray] = lambda resamples: np.median(resamples, axis=-1),
    *,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap CI of `statistic` (vectorised over the last axis of an [n_resamples, n] array)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    resamples = data[rng.integers(0, data.size, size=(n_resamples, data.size))]
    return _percentile_interval(statistic(resamples), confidence)


def ratio_ci(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap CI of median(numerator) / median(denominator), the two samples resampled independently."""
    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.size == 0 or b.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    medians_a = np.median(a[rng.integers(0, a.size, size=(n_resamples, a.size))], axis=1)
    medians_b = np.median(b[rng.integers(0, b.size, size=(n_resamples, b.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _percentile_interval(medians_a / medians_b, confidence)


def summarize(values: Sequence[float], seed: int = 0) -> Summary:
    q1, q3 = quartiles(values)
    low, high = bootstrap_ci(values, seed=seed)
    return Summary(n=len(values), median=median(values), q1=q1, q3=q3, ci_low=low, ci_high=high)


def compare(off: Sequence[float], on: Sequence[float], seed: int = 0) -> Comparison:
    """OFF vs ON for one condition; the speedup is NaN when either side is empty."""
    low, high = ratio_ci(off, on, seed=seed)
    return Comparison(
        off=summarize(off, seed),
        on=summarize(on, seed + 1),
        speedup=ratio(median(off), median(on)),
        speedup_ci_low=low,
        speedup_ci_high=high,
    )


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def improvement(off: float, on: float) -> float:
    """Fraction of OFF's time that ON saves: 1 - on/off (0.35 = 35% faster)."""
    return 1.0 - on / off if off and not math.isnan(off) and not math.isnan(on) else math.nan


def _percentile_interval(estimates: np.ndarray, confidence: float) -> tuple[float, float]:
    finite = estimates[np.isfinite(estimates)]
    if finite.size == 0:
        return math.nan, math.nan
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class BlockPair:
    """Two adjacent blocks of the OFF-ON-ON-OFF design; each pair's own speedup shows drift between the pairs."""

    off_block: str
    on_block: str
    off_median: float
    on_median: float
    speedup: float


def block_pairs(by_block: dict[str, Sequence[float]]) -> list[BlockPair]:
    """OFF1 vs ON1 and ON2 vs OFF2, for the blocks present in `by_block` (keys such as "OFF1", "ON2")."""
    pairs = []
    for off_name, on_name in (("OFF1", "ON1"), ("OFF2", "ON2")):
        off, on = median(by_block.get(off_name, ())), median(by_block.get(on_name, ()))
        pairs.append(BlockPair(off_name, on_name, off, on, ratio(off, on)))
    return pairs
