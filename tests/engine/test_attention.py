"""prefill_attention against attention written out by hand (float64), for both of its forms: square (no cached
context, or a tail at least as long as it) and lower right (a short tail after a long context, a decode step)."""

from types import SimpleNamespace

import pytest
import torch

from kvshare.engine import attention
from kvshare.engine.attention import prefill_attention, slot_indices, write_kv

HEADS, KV_HEADS, D, BLOCK = 6, 2, 8, 4


def reference(q, k, v, start, scale):
    """Query i (position start + i) attends to keys [0, start + i]; GQA by repeating each KV head."""
    t = q.shape[0]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (S, H, D)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    visible = torch.arange(start + t)[None, :] <= (start + torch.arange(t))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


def run(start, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = start + t
    k = torch.randn(total, KV_HEADS, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, D, generator=g, dtype=torch.float64)
    q = torch.randn(t, HEADS, D, generator=g, dtype=torch.float64)
    cache = torch.zeros(32, 2, BLOCK, KV_HEADS, D, dtype=torch.float64)
    table = torch.randperm(32, generator=g)
    write_kv(cache, *slot_indices(table, 0, total, BLOCK), k, v)
    scale = D**-0.5
    out = q.clone()
    prefill_attention(out, cache, table, start, scale)
    return out, reference(q, k, v, start, scale)


@pytest.mark.parametrize("start,t", [(0, 13), (3, 20), (7, 7), (20, 3), (22, 1), (0, 1), (1, 1)])
def test_matches_attention_written_out(start, t):
    got, want = run(start, t)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("start,t,square", [(0, 50, True), (16, 50, True), (50, 50, True), (51, 50, False),
                                            (60, 1, False)])
def test_long_tail_takes_the_square_causal_form(monkeypatch, start, t, square):
    """A tail at least as long as its cached context must reach SDPA as plain causal attention with no mask (the form
    cuDNN runs on H200); only a shorter tail may use the lower-right mask (flash attention, ~40% slower)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None, args[0].shape[2]))
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    # A stand-in for the module's `F` (not a patch of torch's own function, which the lower-right mask dispatches on).
    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    got, want = run(start, t)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert calls and all(c == ((True, True, start + t) if square else (False, False, t)) for c in calls), calls
