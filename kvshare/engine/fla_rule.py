"""The gated delta rule's prefill through flash-linear-attention's Triton kernels (`fla.ops.gated_delta_rule`, the
library vLLM's own Gated DeltaNet kernels come from), for CUDA; the torch form in kvshare.engine.linear_attention is
the reference it is tested against and what runs on a CPU.

Invariant: the span is cut at every snapshot position and each piece is one kernel call that starts from the state
the previous one ended with (fp32), so a snapshot is the state a replica that starts there reads back, and a prefill
cut at a 64-aligned position runs the same 64-token chunks as one that is not.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from typing import Sequence

import torch

from kvshare.engine.linear_attention import check_span


def available(device: torch.device) -> bool:
    """Whether the kernels can run here: a CUDA device and the fla package (fla-core) importable."""
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def fla_prefill(q, k, v, g, beta, state, start: int = 0, block: int = 64,
                snapshot_at: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """gated_delta_prefill's contract (shapes, alignment, snapshots) through fla's chunk kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t = q.shape[0]
    check_span(start, t, block, snapshot_at)
    cuts = sorted({start, start + t, *snapshot_at})
    outputs, snapshots = [], {}
    for a, b in pairwise(cuts):
        piece = slice(a - start, b - start)
        out, state = chunk_gated_delta_rule(q[None, piece], k[None, piece], v[None, piece], g[None, piece].float(),
                                            beta[None, piece], initial_state=state[None].float(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        state = state[0]  # (H, Dk, Dv) fp32
        outputs.append(out[0])
        if b in snapshot_at:
            snapshots[b] = state
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), state, snapshots
