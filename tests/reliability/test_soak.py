"""A two-minute soak under every kind of fault: no wrong answer, no request lost except on a killed replica, no
leaked page or lease after recovery, and the cache was really in use."""

from __future__ import annotations

import pytest

from kvshare.validate.faults import KINDS
from kvshare.validate.soak import SoakConfig, run_soak

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_two_minute_soak_under_faults(tmp_path):
    result = run_soak(SoakConfig(minutes=2.0, fault_period_s=8.0, log_dir=str(tmp_path / "logs")))
    assert result.mismatches == 0, result.mismatch_examples
    assert result.request_errors == 0, result.error_examples
    assert result.leaked_pages == 0 and result.leaked_leases == 0, result.final_pool
    assert result.leased_pages_by_client == {}
    assert result.integrity_ok
    assert result.fence_violations == 0
    assert all(result.faults[kind] >= 1 for kind in KINDS)
    assert result.requests_served > 100 and result.streamed_served > 0
    assert result.pool_hit_tokens > 0  # the pool served hits: the check compared cached answers, not only misses
    assert result.passed
