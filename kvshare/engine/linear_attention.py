"""The math of the Gated DeltaNet linear-attention layer of Qwen3.5 / Qwen3-Next hybrids as pure torch functions: the
depthwise causal conv with its carried state, and the gated delta rule in a chunked prefill form and a recurrent
decode form (GQA head expansion and the layer's projections belong to the caller).

Invariants: recurrent states are fp32, (H, Dk, Dv) per sequence; the conv and the prefill are bitwise
split-invariant, i.e. running a span in two calls that carry the state gives torch.equal outputs and states to one
call, for the conv at any split and for the prefill at multiples of `block` (its blocks are aligned to absolute
positions and every block runs the same ops on tensors of the same shapes).

Per value head and token t (q, k l2-normalised, q scaled by Dk**-0.5, math in fp32):
    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + outer(k_t, delta);  o_t = q_t^T S
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit L2 norm over the last dimension; eps inside the rsqrt, as flash-linear-attention does."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- causal conv ----------------------------------------------------------------------------------------------------


def _conv_taps(xpad: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """silu(sum_j w[:, j] * xpad[j:j+n]) along dim -2 of xpad (..., n+K-1, C), accumulated in fp32 tap by tap."""
    w = weight.to(torch.float32).t()  # (K, C)
    xpad = xpad.to(torch.float32)
    # A fixed order of elementwise mul/add per output element is what makes any split of the time axis bitwise equal.
    acc = xpad[..., 0:n, :] * w[0]
    for j in range(1, w.shape[0]):
        acc = acc + xpad[..., j : j + n, :] * w[j]
    return _silu_positionwise(acc)


def _silu_positionwise(x: torch.Tensor) -> torch.Tensor:
    """F.silu whose value at an element does not depend on where that element sits in the tensor."""
    # On CPU torch runs a SIMD exp over full vectors and a scalar exp over the tail, which differ in the last bit, so
    # a contiguous input's result would depend on T. A strided input takes the scalar path for every element.
    buf = x.new_empty((*x.shape, 2))
    buf[..., 0] = x
    return F.silu(buf[..., 0])


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one sequence x (T, C) with weight (C, K), continuing from state (C, K-1) (the
    previous K-1 inputs; zeros at sequence start). Returns (out (T, C) in x's dtype, new state (C, K-1))."""
    xpad = torch.cat([state.t().to(x.dtype), x], 0)  # (K-1+T, C)
    out = _conv_taps(xpad, weight, x.shape[0]).to(x.dtype)
    return out, xpad[xpad.shape[0] - state.shape[1] :].t().contiguous()


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for each of B sequences: x (B, C), states (B, C, K-1). Returns (out (B, C), new states
    (B, C, K-1)), bitwise what causal_conv gives for that one token."""
    xpad = torch.cat([states.to(x.dtype), x[:, :, None]], 2).transpose(1, 2)  # (B, K, C)
    out = _conv_taps(xpad, weight, 1)[:, 0].to(x.dtype)  # (B, C)
    return out, xpad[:, 1:].transpose(1, 2).contiguous()


# ---- gated delta rule -----------------------------------------------------------------------------------------------


def _prep_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = l2norm(q.to(torch.float32)), l2norm(k.to(torch.float32))
    return q * q.shape[-1] ** -0.5, k


def _check_state(state: torch.Tensor) -> None:
    if state.dtype != torch.float32:
        raise ValueError(f"gated delta states must be float32, got {state.dtype}")


def check_span(start: int, t: int, block: int, snapshot_at: Sequence[int]) -> None:
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if start % block:
        raise ValueError(f"prefill start {start} is not a multiple of block {block}: blocks are aligned to absolute "
                         "positions, so a span must begin on a block boundary")
    for p in snapshot_at:
        if p % block or not start < p <= start + t:
            raise ValueError(f"snapshot position {p} must be a multiple of block {block} in ({start}, {start + t}]")


def _to_block(x: torch.Tensor, s: int, block: int) -> torch.Tensor:
    """Rows [s, s+block) of x (T, H, ...) as a fresh head-major fp32 tensor (H, block, ...), zero past the end."""
    rows = x[s : s + block]
    buf = x.new_zeros((block, *x.shape[1:]), dtype=torch.float32)
    buf[: rows.shape[0]] = rows
    # A fresh contiguous tensor per block: same layout and alignment for every block, whatever call it came from.
    return buf.transpose(0, 1).contiguous()


def _prefill_block(q, k, v, g, beta, state):
    """One block of the chunked rule. q, k (H, L, Dk) normalised; v (H, L, Dv); g, beta (H, L); state (H, Dk, Dv).
    Returns (out (H, L, Dv), state after the block (H, Dk, Dv))."""
    n = g.shape[1]
    gc = g.cumsum(-1)  # (H, L) log decay from the block start
    causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    # Mask before exp: the upper triangle would be exp of a positive sum and could overflow.
    decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, L, L)
    kb = k * beta[..., None]
    # WY / UT transform: the per-token deltas solve (I + L) delta = beta * (v - exp(gc) k S), L strictly lower.
    system = torch.eye(n, device=g.device) + (kb @ k.transpose(1, 2) * decay).tril(-1)  # (H, L, L)
    rhs = torch.cat([v * beta[..., None], kb * gc.exp()[..., None]], -1)  # (H, L, Dv + Dk)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], -1)
    delta = u - w @ state  # (H, L, Dv)
    out = (q * gc.exp()[..., None]) @ state + (q @ k.transpose(1, 2) * decay) @ delta
    tail = gc[:, -1:]  # (H, 1); padded tokens have g = 0, so this is the last real token's cumulative decay
    state = state * tail[..., None].exp() + (k * (tail - gc).exp()[..., None]).transpose(1, 2) @ delta
    return out, state


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    start: int = 0,
    block: int = 64,
    snapshot_at: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Chunked gated delta rule over one sequence: q, k (T, H, Dk); v (T, H, Dv); g, beta (T, H); state (H, Dk, Dv)
    fp32, the state before absolute position `start` (a multiple of `block`). Returns (out (T, H, Dv) in v's dtype,
    final state, {p: state after the first p - start tokens} for each p in snapshot_at, multiples of block)."""
    t = q.shape[0]
    check_span(start, t, block, snapshot_at)
    _check_state(state)
    wanted = set(snapshot_at)
    # A private contiguous copy, so the first block sees the same layout whether the state came from a pool view or
    # from the previous block of the same call.
    state = state.clone(memory_format=torch.contiguous_format)
    outs, snapshots = [], {}
    for s in range(0, t, block):
        n = min(block, t - s)
        qb, kb = _prep_qk(_to_block(q, s, block), _to_block(k, s, block))
        out, state = _prefill_block(qb, kb, *(_to_block(x, s, block) for x in (v, g, beta)), state)
        outs.append(out[:, :n].transpose(0, 1))  # (n, H, Dv)
        if start + s + n in wanted:
            snapshots[start + s + n] = state
    out = torch.cat(outs, 0) if outs else v.new_zeros(v.shape, dtype=torch.float32)
    return out.to(v.dtype), state, snapshots


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for each of B sequences (recurrent form): q, k (B, H, Dk); v (B, H, Dv); g, beta (B, H);
    states (B, H, Dk, Dv) fp32. Returns (out (B, H, Dv) in v's dtype, new states (B, H, Dk, Dv) fp32)."""
    _check_state(states)
    q, k = _prep_qk(q, k)
    vf, g, beta = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)
    states = states * g.exp()[..., None, None]
    remembered = (states * k[..., None]).sum(-2)  # (B, H, Dv)
    delta = (vf - remembered) * beta[..., None]
    states = states + k[..., None] * delta[..., None, :]
    return (states * q[..., None]).sum(-2).to(v.dtype), states


def gated_delta_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token definition looped over one sequence (T, H, ...), for tests: (out (T, H, Dv), final state)."""
    q, k = _prep_qk(q, k)
    vf, g, beta = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)
    s = state.to(torch.float32)  # (H, Dk, Dv)
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (vf[t] - (k[t, :, None, :] @ s)[:, 0]) * beta[t][:, None]  # (H, Dv)
        s = s + k[t, :, :, None] @ delta[:, None, :]
        outs.append((q[t, :, None, :] @ s)[:, 0])
    out = torch.stack(outs) if outs else vf.new_zeros(vf.shape)
    return out.to(v.dtype), s
