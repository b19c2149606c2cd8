"""Next-token choice: greedy (temperature 0) or temperature + top-p with the request's own seeded generator."""

from __future__ import annotations

import torch

from kvshare.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits (B, vocab, fp32). Sampling draws from each request's CPU generator, so a seeded
    request gives the same tokens whatever else is batched with it."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, seq, best in zip(logits, seqs, greedy):
        sp = seq.sampling
        tokens.append(best if sp.temperature <= 0 else _sample_row(row.cpu(), sp.temperature, sp.top_p, seq.generator))
    return tokens


def _sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the most likely token).
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
