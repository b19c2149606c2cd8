"""The cost model's arithmetic: the prefill fit, each option's time, break-even lengths and the placement answer,
against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from kvshare.costmodel import CostModel, PrefillCurve, PrefillSample, Rates, SessionKind, mix_gain, session_estimate

CURVE = PrefillCurve(fixed_s=0.05, per_token_s=1e-4, per_pair_s=1e-9)


def _rates(**overrides) -> Rates:
    fields = dict(prefill=CURVE, kv_bytes_per_token=1e5, load_gb_s=10.0, l2_gb_s=0.5, chunk_tokens=256)
    fields.update(overrides)
    return Rates(**fields)


def test_fit_recovers_the_curve_that_made_the_samples():
    samples = [PrefillSample(n, c, CURVE.seconds(n, c)) for n, c in [(512, 0), (4096, 0), (30000, 0), (1000, 8000)]]
    fitted = PrefillCurve.fit(samples)
    assert fitted.fixed_s == pytest.approx(CURVE.fixed_s, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(CURVE.per_token_s, rel=1e-6)
    assert fitted.per_pair_s == pytest.approx(CURVE.per_pair_s, rel=1e-6)


def test_fit_never_gives_a_negative_cost():
    # times that fall per token as prompts grow (noise, or a warm-up in the first sample): least squares alone
    # would make the fixed or the per-token term negative
    samples = [PrefillSample(256, 0, 0.5), PrefillSample(1024, 0, 0.55), PrefillSample(4096, 0, 0.9)]
    fitted = PrefillCurve.fit(samples)
    assert min(fitted.fixed_s, fitted.per_token_s, fitted.per_pair_s) >= 0
    assert all(fitted.seconds(s.new) == pytest.approx(s.seconds, rel=0.25) for s in samples)


def test_option_times_add_up_as_documented():
    model = CostModel(_rates(pool_fixed_s=0.01, l2_fixed_s=0.002))
    n, hit, l1 = 10_000, 9_984, 2_560
    tail = CURVE.seconds(n - hit, hit)
    assert model.pool(n, hit) == pytest.approx(0.01 + hit * 1e5 / 10e9 + tail)
    assert model.l2(n, hit, l1) == pytest.approx(0.002 + (hit - l1) * 1e5 / 0.5e9 + model.pool(n, hit))
    assert model.hit_tokens(10_000) == 9_984 and model.hit_tokens(512) == 256 and model.hit_tokens(256) == 0


def test_l2_break_even_is_where_attention_makes_recompute_dearer_than_fetching():
    # No fixed costs, an instant pool: recompute(n) = b n + c n^2 and an L2 hit of h = n - t costs h*k + tail, so
    # recompute wins below the length where c n^2 + b n = k h + tail; found by the model to the token.
    curve = PrefillCurve(0.0, 1e-4, 1e-9)
    model = CostModel(_rates(prefill=curve, load_gb_s=1e9, l2_gb_s=1e5 / 2e-4 / 1e9))  # 2e-4 s per token fetched
    (point,) = model.break_even("l2", 1 << 20)
    assert model.recompute(point) > model.l2(point, model.hit_tokens(point))
    assert model.recompute(point - 1) <= model.l2(point - 1, model.hit_tokens(point - 1))
    assert point == pytest.approx(1e-4 / 1e-9, rel=0.01)  # c n = per-token fetch - b  ->  n = 1e5


def test_promotion_pays_only_where_the_model_says_l2_is_faster():
    model = CostModel(_rates(l2_gb_s=0.2))  # fetching costs 0.5 ms a token: more than prefilling short prompts
    short, long_ = 2_048, 1_000_000  # prefill per token: ~0.1 ms at 2k, ~1.1 ms at 1M (attention)
    assert not model.promotion_pays(short, 0, model.hit_tokens(short))
    assert model.promotion_pays(long_, 0, model.hit_tokens(long_))
    assert model.choose(short).best == "recompute" and model.choose(long_).best == "l2"
    assert not model.promotion_pays(long_, model.hit_tokens(long_), model.hit_tokens(long_))  # nothing to promote


def test_sessions_gain_only_when_turns_change_replicas():
    model = CostModel(_rates())
    kind = SessionKind(context=8192, turns=4, user_tokens=256, answer_tokens=32)
    fixed = session_estimate(model, kind, "fixed")
    alternate = session_estimate(model, kind, "alternate")
    assert fixed.gain == pytest.approx(0.0)  # the replica's own cache already holds every earlier turn
    assert alternate.gain > 0.3
    # alternate OFF by hand: turn k on replica k % 2, which last saw turn k - 2 (prompt and answer)
    prompts = [8192 + k * 288 for k in range(4)]
    off = model.recompute(prompts[0]) + model.recompute(prompts[1])
    off += sum(model.recompute(prompts[k], prompts[k - 2] + 32) for k in (2, 3))
    assert alternate.off_s == pytest.approx(off)
    pooled = [(p - 256) // 256 * 256 for p in prompts]  # the previous turn's prompt and answer, whole chunks
    on = model.recompute(prompts[0]) + model.pool(prompts[1], pooled[1])
    for k in (2, 3):
        local = prompts[k - 2] + 32
        on += min(model.recompute(prompts[k], local), model.pool(prompts[k], pooled[k], local))
    assert alternate.on_s == pytest.approx(on)
    both_on, both_off = fixed.on_s + alternate.on_s, fixed.off_s + alternate.off_s
    assert mix_gain([fixed, alternate]) == pytest.approx(1 - both_on / both_off)
    assert math.isfinite(alternate.on_s)
