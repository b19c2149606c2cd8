"""Next-token choice: greedy (temperature 0) or temperature + top-k + top-p with the request's own seeded generator.
Each row is sampled on its own: a row that cannot be sampled fails its own request, never the batch. A request that
asks for logprobs gets them from the same logits: log_softmax of the raw row (as vLLM's default, raw_logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.engine.api import TokenLogprobs
from kvshare.engine.sequence import Sequence

# Below this temperature sampling is greedy (as vLLM does): logits / 1e-300 overflow to inf and softmax to NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class RowFailure:
    """A row of a step that produced no token; the engine fails that request alone with this message.
    `request_caused`: the request's own parameters are to blame (its logits were finite), so another replica would
    fail it too; otherwise the replica may be at fault."""

    message: str
    request_caused: bool


@dataclass(frozen=True)
class Sampled:
    """A row's token, with its logprobs when the request asked for them."""

    token_id: int
    logprobs: TokenLogprobs | None = None


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled | RowFailure]:
    """One token (or a failure) per row of logits (B, vocab, fp32). Sampling draws from each request's CPU generator,
    so a seeded request gives the same tokens whatever else is batched with it."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[Sampled | RowFailure] = []
    for row, seq, best in zip(logits, seqs, greedy):
        sp = seq.sampling
        if sp.temperature < GREEDY_BELOW:
            tokens.append(Sampled(best, _logprobs(row, best, sp.logprobs)))
            continue
        try:
            token = _sample_row(row.cpu(), sp.temperature, sp.top_k, sp.top_p, seq.generator)
        except (RuntimeError, ValueError) as error:  # torch's "invalid multinomial distribution" and the like
            finite = bool(torch.isfinite(row).all())
            tokens.append(RowFailure(f"sampling failed with temperature={sp.temperature}, top_k={sp.top_k}, "
                                     f"top_p={sp.top_p}{'' if finite else ' (the model produced non-finite logits)'}: "
                                     f"{error}", request_caused=finite))
            continue
        tokens.append(Sampled(token, _logprobs(row, token, sp.logprobs)))
    return tokens


def _logprobs(row: torch.Tensor, token: int, top: int | None) -> TokenLogprobs | None:
    """`token`'s logprob under log_softmax(row) and the `top` most likely (id, logprob), most likely first; None when
    the request asked for none. One log_softmax over the vocabulary, only for requests that ask."""
    if top is None:
        return None
    logprobs = torch.log_softmax(row.float(), dim=-1)  # (vocab,)
    best = logprobs.topk(min(top, logprobs.numel())) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprobs(float(logprobs[token]), pairs)


def _sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if 0 < top_k < probs.numel() or top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p, at most top_k tokens, and always the most likely one (a
        # top_p too small for float32 would otherwise keep nothing).
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        if top_k > 0:
            keep[top_k:] = False
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
