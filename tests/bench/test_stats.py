"""Statistics on known data: exact medians and IQRs, CIs that cover known values, block pairs."""

import math

import numpy as np

from kvshare.bench import stats


def test_median_and_quartiles_are_exact_on_known_data():
    assert stats.median([5, 1, 3, 2, 4]) == 3
    assert stats.median([1, 2, 3, 4]) == 2.5
    assert stats.quartiles([1, 2, 3, 4, 5]) == (2.0, 4.0)
    summary = stats.summarize([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (summary.n, summary.median, summary.q1, summary.q3, summary.iqr) == (9, 5.0, 3.0, 7.0, 4.0)


def test_empty_sample_gives_nan_not_an_exception():
    summary = stats.summarize([])
    assert summary.n == 0 and math.isnan(summary.median) and math.isnan(summary.ci_low)
    assert math.isnan(stats.compare([], [1.0]).speedup)


def test_bootstrap_ci_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    covered = 0
    for trial in range(100):
        sample = rng.normal(loc=10.0, scale=2.0, size=100)  # true median 10
        low, high = stats.bootstrap_ci(sample, seed=trial, n_resamples=1000)
        assert low <= stats.median(sample) <= high
        covered += low < 10.0 < high
    assert 85 <= covered <= 100  # nominal 95%; a broken CI (too narrow, shifted) falls far below


def test_bootstrap_ci_is_deterministic_and_narrows_with_more_data():
    sample = np.random.default_rng(1).normal(10.0, 2.0, size=400)
    assert stats.bootstrap_ci(sample, seed=3) == stats.bootstrap_ci(sample, seed=3)
    low, high = stats.bootstrap_ci(sample, seed=3)
    small_low, small_high = stats.bootstrap_ci(sample[:25], seed=3)
    assert high - low < small_high - small_low


def test_constant_sample_has_a_zero_width_ci():
    assert stats.bootstrap_ci([2.0] * 10) == (2.0, 2.0)


def test_ratio_ci_covers_the_true_speedup():
    rng = np.random.default_rng(11)
    off = rng.lognormal(mean=np.log(30.0), sigma=0.1, size=200)  # median 30
    on = rng.lognormal(mean=np.log(0.6), sigma=0.1, size=200)  # median 0.6: true speedup 50
    comparison = stats.compare(off, on, seed=5)
    assert comparison.speedup_ci_low < 50.0 < comparison.speedup_ci_high
    assert comparison.speedup_ci_low <= comparison.speedup <= comparison.speedup_ci_high
    assert abs(comparison.speedup - 50.0) < 5.0


def test_block_pairs_compare_off1_on1_and_off2_on2():
    pairs = stats.block_pairs({"OFF1": [10, 12, 14], "ON1": [1, 2, 3], "ON2": [2, 2], "OFF2": [8]})
    assert [(p.off_block, p.on_block) for p in pairs] == [("OFF1", "ON1"), ("OFF2", "ON2")]
    assert pairs[0].speedup == 6.0 and pairs[1].speedup == 4.0


def test_improvement():
    assert stats.improvement(10.0, 6.5) == 0.35
    assert math.isnan(stats.improvement(0.0, 1.0))
