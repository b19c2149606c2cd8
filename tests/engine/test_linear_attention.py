"""The Gated DeltaNet math (kvshare.engine.linear_attention): the chunked prefill and the recurrent decode agree with
the per-token definition, and the conv and the prefill are bitwise split-invariant at block boundaries."""

import pytest
import torch
import torch.nn.functional as F

from kvshare.engine import linear_attention as la

H, DK, DV = 3, 16, 24
TOL = dict(atol=1e-5, rtol=1e-4)


def inputs(t, h=H, dk=DK, dv=DV, seed=0, dtype=torch.float32, decay=1.0):
    """Raw (pre-normalisation) q, k, v with g = -decay * softplus(randn) and beta = sigmoid(randn), as the layer makes
    them; a small decay keeps the state's memory long, so a wrong state or a wrong inter-block step shows."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, h, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(t, h, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(t, h, generator=gen)) * decay
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))
    return q, k, v, g, beta


def random_state(h=H, dk=DK, dv=DV, seed=1):
    return torch.randn(h, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.5


def zero_state(h=H, dk=DK, dv=DV):
    return torch.zeros(h, dk, dv)


def span(xs, a, b):
    return [x[a:b] for x in xs]


@pytest.mark.parametrize(
    "t, block, nonzero, decay",
    [(192, 64, False, 1.0), (200, 64, False, 1.0), (40, 64, False, 1.0), (130, 32, True, 1.0), (300, 64, True, 0.02)],
)
def test_prefill_matches_reference(t, block, nonzero, decay):
    """The chunked prefill equals the per-token loop (full blocks, a partial last block, T < block, a prior state)."""
    xs = inputs(t, decay=decay)
    state = random_state() if nonzero else zero_state()
    out, final, _ = la.gated_delta_prefill(*xs, state, block=block)
    ref_out, ref_final = la.gated_delta_reference(*xs, state)
    assert out.shape == (t, H, DV) and final.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


@pytest.mark.parametrize("split_blocks", [1, 2])
def test_prefill_split_invariant_bitwise(split_blocks):
    """Prefill [0,T) equals [0,a) then [a,T) with the carried state bitwise, for a = block and 2*block."""
    block, t = 32, 150
    xs, state = inputs(t, seed=2, decay=0.05), random_state()
    out, final, _ = la.gated_delta_prefill(*xs, state, block=block)
    a = split_blocks * block
    out1, mid, _ = la.gated_delta_prefill(*span(xs, 0, a), state, block=block)
    out2, final2, _ = la.gated_delta_prefill(*span(xs, a, t), mid, start=a, block=block)
    assert torch.equal(torch.cat([out1, out2]), out)
    assert torch.equal(final2, final)


def test_snapshots_equal_prefill_stopping_there():
    """Each snapshot is bitwise the final state of a prefill that stops at that position, also mid-call."""
    block, t = 32, 140
    xs, state = inputs(t, seed=3), random_state()
    _, _, snaps = la.gated_delta_prefill(*xs, state, block=block, snapshot_at=(32, 96, 128))
    assert sorted(snaps) == [32, 96, 128]
    for p, snap in snaps.items():
        assert torch.equal(snap, la.gated_delta_prefill(*span(xs, 0, p), state, block=block)[1])
    # a call that starts mid-sequence reports absolute positions
    _, mid, _ = la.gated_delta_prefill(*span(xs, 0, 64), state, block=block)
    _, _, later = la.gated_delta_prefill(*span(xs, 64, t), mid, start=64, block=block, snapshot_at=(96, 128))
    assert torch.equal(later[96], snaps[96]) and torch.equal(later[128], snaps[128])


def test_decode_step_continues_prefill():
    """A batched decode step after each sequence's prefill equals the per-token loop over T+1 tokens."""
    t, block = 70, 32
    seqs = [inputs(t + 1, seed=10 + i, decay=0.05) for i in range(3)]
    starts = [zero_state(), random_state(seed=5), random_state(seed=6) * 2]
    states, refs = [], []
    for xs, s0 in zip(seqs, starts):
        states.append(la.gated_delta_prefill(*span(xs, 0, t), s0, block=block)[1])
        refs.append(la.gated_delta_reference(*xs, s0))
    last = [torch.stack([xs[i][t] for xs in seqs]) for i in range(5)]  # q, k, v, g, beta of token t, (B, ...)
    out, new_states = la.gated_delta_step(*last, torch.stack(states))
    assert out.shape == (3, H, DV) and new_states.shape == (3, H, DK, DV)
    torch.testing.assert_close(out, torch.stack([r[0][t] for r in refs]), **TOL)
    torch.testing.assert_close(new_states, torch.stack([r[1] for r in refs]), **TOL)


def test_output_dtype_follows_v():
    """bf16 inputs give bf16 outputs and an fp32 state, close to the fp32 result."""
    xs = inputs(50, seed=7)
    out, final, _ = la.gated_delta_prefill(*[x.bfloat16() if x.dim() == 3 else x for x in xs], zero_state())
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(out.float(), la.gated_delta_prefill(*xs, zero_state())[0], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_split_and_step_bitwise(dtype):
    """The conv split anywhere with the carried state, and the decode step, equal one conv over the span bitwise."""
    gen = torch.Generator().manual_seed(4)
    t, c, kk = 37, 12, 4
    x = torch.randn(t, c, generator=gen).to(dtype)
    w = torch.randn(c, kk, generator=gen).to(dtype)
    s0 = torch.randn(c, kk - 1, generator=gen).to(dtype)
    out, state = la.causal_conv(x, w, s0)
    assert out.dtype == dtype and state.shape == (c, kk - 1)
    for a in (1, 2, 5, 36):
        o1, mid = la.causal_conv(x[:a], w, s0)
        o2, end = la.causal_conv(x[a:], w, mid)
        assert torch.equal(torch.cat([o1, o2]), out) and torch.equal(end, state)
    # decode over B=2 sequences: sequence 0 at token 20, sequence 1 at token 30
    mids = torch.stack([la.causal_conv(x[:20], w, s0)[1], la.causal_conv(x[:30], w, s0)[1]])
    step_out, step_states = la.causal_conv_step(torch.stack([x[20], x[30]]), w, mids)
    assert torch.equal(step_out, torch.stack([out[20], out[30]]))
    assert torch.equal(step_states[0], la.causal_conv(x[:21], w, s0)[1])
    assert torch.equal(step_states[1], la.causal_conv(x[:31], w, s0)[1])


def test_causal_conv_matches_conv1d():
    """From a zero state the conv is F.conv1d with padding K-1 (first T outputs) followed by SiLU."""
    gen = torch.Generator().manual_seed(8)
    t, c, kk = 25, 10, 4
    x, w = torch.randn(t, c, generator=gen), torch.randn(c, kk, generator=gen)
    out, state = la.causal_conv(x, w, torch.zeros(c, kk - 1))
    expected = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=kk - 1, groups=c)[0, :, :t]).t()
    torch.testing.assert_close(out, expected, **TOL)
    assert torch.equal(state, x[-(kk - 1) :].t())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(start=16), "start 16 is not a multiple of block 32"),
        (dict(snapshot_at=(40,)), "snapshot position 40 must be a multiple of block 32"),
        (dict(snapshot_at=(0,)), "snapshot position 0 must be a multiple of block 32 in \\(0, 70\\]"),
        (dict(snapshot_at=(96,)), "snapshot position 96 must be a multiple of block 32 in \\(0, 70\\]"),
        (dict(start=32, snapshot_at=(32,)), "snapshot position 32 .* in \\(32, 102\\]"),
        (dict(block=0), "block must be positive"),
    ],
)
def test_prefill_rejects_bad_spans(kwargs, match):
    """Unaligned starts and snapshot positions off the block grid or outside the span raise a clear ValueError."""
    with pytest.raises(ValueError, match=match):
        la.gated_delta_prefill(*inputs(70), zero_state(), **{"block": 32, **kwargs})


def test_prefill_rejects_non_fp32_state():
    """States are fp32 by invariant: a bf16 state is refused rather than silently widened."""
    with pytest.raises(ValueError, match="float32"):
        la.gated_delta_prefill(*inputs(8), zero_state().bfloat16())


def test_split_needs_the_carried_state():
    """Carrying a zero state across the split instead of the real one changes the outputs: the split test can fail."""
    block, t = 32, 100
    xs = inputs(t, seed=9, decay=0.05)
    out, final, _ = la.gated_delta_prefill(*xs, zero_state(), block=block)
    _, mid, _ = la.gated_delta_prefill(*span(xs, 0, block), zero_state(), block=block)
    assert mid.abs().max() > 0.1
    wrong, wrong_final, _ = la.gated_delta_prefill(*span(xs, block, t), zero_state(), start=block, block=block)
    assert (wrong - out[block:]).abs().max() > 1e-2
    assert not torch.equal(wrong_final, final)
