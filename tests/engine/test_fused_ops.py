"""The fused per-token kernels (kvshare.engine.fused_ops) against the torch forms they replace, on CUDA or under
Triton's interpreter (tests/engine/test_paged_interpreter.py); skipped where neither runs. The K/V write must give
the cache's bytes exactly (fp8 included: the pool moves those bytes); norm and rotary agree to rounding."""

import pytest
import torch

from kvshare.engine import fused_ops
from kvshare.engine import paged_attention as pa
from kvshare.engine.attention import write_kv
from kvshare.engine.kv_quant import KVScales
from kvshare.engine.model import RMSNorm, _rope

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not pa.available(DEVICE), reason="needs CUDA + Triton, or Triton's interpreter")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter has no bf16 arithmetic


def randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, DTYPE)


@pytest.mark.parametrize("hidden", [96, 5120])
def test_rms_norm_matches_torch(hidden):
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data = randn(hidden, seed=1)
    x = randn(9, hidden, seed=2, scale=3.0)
    expected = norm(x)
    got = fused_ops.rms_norm(x, norm.weight, 1e-6)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-2 if DTYPE == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 48), (40, 8, 128)])
def test_rope_in_place_matches_torch(heads, kv_heads, head_dim):
    t = 5
    product = randn(t, (heads + 2 * kv_heads) * head_dim, seed=3)  # q|k|v as the fused projection returns them
    q = product[:, : heads * head_dim].view(t, heads, head_dim)
    k = product[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = product[:, (heads + kv_heads) * head_dim :].clone()
    half = randn(t, 1, head_dim // 2, seed=4)
    cos, sin = torch.cat([half, half], -1), torch.cat([half.flip(-1), half.flip(-1)], -1)
    exact = [_rope(x.double(), cos.double(), sin.double()) for x in (q, k)]  # the rotation without rounding
    terms = [_magnitude(x.double(), cos.double(), sin.double()) for x in (q, k)]
    fused_ops.rope_(q, k, cos, sin)
    # fp32 arithmetic (a few units of 2^-24 of the terms' size, which matters only where x1 cos - x2 sin cancels),
    # then one rounding to the model's dtype: half a unit in the last place, at most 2^-8 relative for bf16. The
    # torch form rounds after each of its three bf16 operations and can be several units off.
    unit = 2.0**-8 if DTYPE == torch.bfloat16 else 0.0
    for got, want, size in zip((q, k), exact, terms):
        assert ((got.double() - want).abs() <= want.abs() * unit + size * 2.0**-22).all()
    assert torch.equal(product[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def _magnitude(x, cos, sin):
    """|x1 cos| + |x2 sin| (and its mirror): the size of the terms the rotation adds."""
    x1, x2 = x.chunk(2, dim=-1)
    return x.abs() * cos.abs() + torch.cat((x2.abs(), x1.abs()), dim=-1) * sin.abs()


@pytest.mark.parametrize("kv", ["model", "fp8", "fp8-scaled"])
def test_kv_write_gives_the_same_bytes(kv):
    if kv != "model" and DEVICE.type == "cpu":
        pytest.skip("Triton's interpreter rounds fp32 -> e4m3 wrongly (e.g. 124.5 -> 64): fp8 bytes checked on CUDA")
    dtype = DTYPE if kv == "model" else torch.float8_e4m3fn
    scales = KVScales(0.37, 3.0) if kv == "fp8-scaled" else KVScales()
    expected = torch.zeros(8, 2, 16, 2, 48, dtype=dtype, device=DEVICE)
    got = expected.clone()
    k, v = randn(6, 2, 48, seed=5, scale=300.0), randn(6, 2, 48, seed=6)  # k saturates fp8 here and there
    blocks = torch.tensor([3, 3, 5, 1, 0, 7], device=DEVICE)
    offsets = torch.tensor([0, 15, 2, 7, 9, 15], device=DEVICE)
    write_kv(expected, blocks, offsets, k, v, scales)
    fused_ops.write_kv(got, blocks, offsets, k, v, scales.k, scales.v)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
