"""The chunk checksum's terms (kvshare.checksum) as one Triton kernel, for the GPU's staging slots.

Why: torch's form (checksum.torch_terms_sum) is eight elementwise kernels and a sum for every staging slot hashed,
each a launch from the thread that queues the transfer's copies: under the profiler ~0.2 ms of host time a slot
(H200 run 14: 1,026 calls of each elementwise op for a 512-slot load), as much as the rest of a slot's copies,
scatter and events together. A load in layer waves queues several slots per chunk, and the host's queueing then
decides when the copies start. Here: one kernel writes a partial sum per (page, block of words), and one sum adds
them, with the same bits.

Arithmetic: words and coefficients are read as uint64, so shifts are logical and products and sums wrap mod 2^64,
exactly as the numpy definition's uint64 arithmetic; the partial sums are added by torch in int64, which wraps the
same way. A coefficient of 0 leaves its word out, as in the torch form.
"""

from __future__ import annotations

import os

import torch

from kvshare import checksum

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton: the torch form serves there
    triton = None

BLOCK_WORDS = 4096  # words one program reads from one page row (32 KiB)


def available(device: torch.device) -> bool:
    """True where the kernel runs: Triton importable, and a CUDA device or Triton's interpreter (TRITON_INTERPRET=1,
    read when Triton is imported: how the tests check the kernel without a GPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def terms_sum(words: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """sum mix(words) * coefficients mod 2^64 as a 0-dim int64 tensor on the words' device (no host sync): the value
    of kvshare.transfer.checksum.torch_terms_sum. `words` and `coefficients`: int64 [rows, n], unit stride along n
    (a staging slot's page rows and their c_i). Needs available(words.device)."""
    rows, n = words.shape
    if rows == 0 or n == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    blocks = triton.cdiv(n, BLOCK_WORDS)
    partial = torch.empty(rows * blocks, dtype=torch.int64, device=words.device)
    _terms[(rows, blocks)](words, coefficients, partial, n, words.stride(0), coefficients.stride(0),
                           checksum.MIX_MULTIPLIER, BLOCK=BLOCK_WORDS)
    return partial.sum(dtype=torch.int64)


if triton is not None:

    @triton.jit
    def _terms(words, coefficients, partial, n, words_row, coefficients_row, mix_multiplier, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        w = tl.load(words + row * words_row + cols, mask=inside, other=0).to(tl.uint64, bitcast=True)
        c = tl.load(coefficients + row * coefficients_row + cols, mask=inside, other=0).to(tl.uint64, bitcast=True)
        x = w ^ (w >> 32)  # fold
        x = x * mix_multiplier.to(tl.uint64)
        x = x ^ (x >> 32)  # fold
        total = tl.sum(x * c, axis=0)  # wraps mod 2^64; masked words have c = 0
        tl.store(partial + row * tl.num_programs(1) + block, total.to(tl.int64, bitcast=True))
