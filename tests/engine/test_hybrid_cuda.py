"""The hybrid model's CUDA path: flash-linear-attention's chunk kernel (what replicas run on a GPU) against the torch
form it replaces, and the properties sharing relies on. Skips without a CUDA device and the fla-core package."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine import fla_rule
from kvshare.engine.linear_attention import gated_delta_prefill

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not fla_rule.available(CUDA),
                                reason="needs a CUDA device and fla-core")


def inputs(t: int, heads: int = 4, dim: int = 64, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=CUDA)  # noqa: E731
    q, k, v = (rand(t, heads, dim).to(dtype) for _ in range(3))
    decay = -0.05 * torch.nn.functional.softplus(rand(t, heads))  # a long memory: the state matters
    beta = torch.sigmoid(rand(t, heads)).to(dtype)
    state = 0.1 * rand(heads, dim, dim)
    return q, k, v, decay, beta, state


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fla_agrees_with_the_torch_form():
    """Same outputs and final state as the torch form (bf16 inputs, fp32 state), with a non-zero initial state and a
    length that is not a multiple of 64, to the relative error of bf16 matmuls in another order (~1e-3; a wrong
    decay, gate or normalisation is off by tens of percent). A relative norm, not elementwise tolerances: the two
    accumulate in different orders over 1000 steps of a long memory."""
    q, k, v, g, beta, state = inputs(1000)
    out, final, _ = fla_rule.fla_prefill(q, k, v, g, beta, state)
    ref_out, ref_final, _ = gated_delta_prefill(q, k, v, g, beta, state)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape and final.dtype == torch.float32
    errors = {"output": relative_error(out, ref_out), "state": relative_error(final, ref_final)}
    print(f"fla vs torch form, relative error: {errors}")
    assert errors["output"] < 2e-2 and errors["state"] < 2e-2, errors


def test_fla_is_split_invariant_at_chunk_boundaries_bitwise():
    """A prefill cut at a 64-aligned position (a chunk boundary where a replica loads a stored state) gives the
    bits of the uncut prefill, outputs and state; the snapshot is that state."""
    q, k, v, g, beta, state = inputs(700, seed=1)
    whole, whole_final, _ = fla_rule.fla_prefill(q, k, v, g, beta, state)  # one kernel call
    _, _, snaps = fla_rule.fla_prefill(q, k, v, g, beta, state, snapshot_at=[256])
    first, mid, _ = fla_rule.fla_prefill(q[:256], k[:256], v[:256], g[:256], beta[:256], state)
    rest, rest_final, _ = fla_rule.fla_prefill(q[256:], k[256:], v[256:], g[256:], beta[256:], mid, start=256)
    assert torch.equal(snaps[256], mid)
    assert torch.equal(torch.cat([first, rest]), whole) and torch.equal(rest_final, whole_final)
