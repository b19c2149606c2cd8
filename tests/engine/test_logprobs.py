"""Logprobs from the engine: each emitted token's logprob is log_softmax of the model's logits at its position (the
raw distribution, whatever the temperature), and the top-k list is that distribution's k most likely tokens. The
reference runs the model in-process, one unpaged whole-sequence prefill per position."""

import pytest
import torch

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import generate
from kvshare.engine.model import Rotary

PROMPT = tuple((11 * i + 5) % 900 + 3 for i in range(37))


def reference_logprobs(model, tokens: list[int], start: int) -> list[torch.Tensor]:
    """log_softmax of the logits that predicted tokens[start:], each from a fresh prefill of everything before it."""
    c = model.config
    rotary = Rotary(c, torch.device("cpu"), torch.float32)
    out = []
    for end in range(start, len(tokens)):
        caches = [torch.zeros(64, 2, 16, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
        with torch.no_grad():
            logits = model.prefill(torch.tensor(tokens[:end]), 0, caches, torch.arange(64), rotary, chunk=4096)
        out.append(torch.log_softmax(logits[0].float(), dim=-1))
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5),
                                      SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, temperature=1.3,
                                                     top_k=40, top_p=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_log_softmax_of_the_models_logits(make_engine, sampling):
    engine = make_engine()
    (result,) = generate(engine, [GenerationRequest("r", PROMPT, sampling)], timeout=120)
    events = result.logprobs
    assert len(events) == len(result.token_ids) == 8
    expected = reference_logprobs(engine.runner.model, list(PROMPT) + result.token_ids, len(PROMPT))
    for token, got, want in zip(result.token_ids, events, expected):
        assert got.logprob == pytest.approx(float(want[token]), abs=1e-5)
        top = want.topk(sampling.logprobs)
        assert [i for i, _ in got.top] == top.indices.tolist()
        assert [lp for _, lp in got.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    if sampling.temperature == 0:  # greedy: the emitted token is the most likely one
        assert all(got.top[0][0] == token for token, got in zip(result.token_ids, events))


def test_no_logprobs_unless_asked_and_zero_means_the_token_alone(make_engine):
    engine = make_engine()
    plain, zero = generate(engine, [GenerationRequest("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)),
                                    GenerationRequest("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                  logprobs=0))], timeout=120)
    assert plain.logprobs == [None] * 3
    assert all(lp is not None and lp.top == () and lp.logprob <= 0 for lp in zero.logprobs)
    assert plain.token_ids == zero.token_ids  # asking for logprobs changes no token
