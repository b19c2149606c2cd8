"""Logprobs over HTTP from a real `kvshare serve`: completions (`logprobs: k`) and chat (`logprobs: true`,
`top_logprobs: k`), whole and streamed, greedy and sampled. Each emitted token's logprob is log_softmax of the
model's logits at its position, computed here with the same weights run in-process."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.model import Rotary
from kvshare.engine.weights import load_model
from kvshare.hf.tokenizer import Tokenizer

from .conftest import MAX_LOGPROBS, post, stream

PROMPT = "Logprobs are the log of each token's probability under the model."


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(tiny_model, "auto", "cpu", torch.float32).model


def reference(model, prompt_ids: list[int], output_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax of the logits that chose each output token, each from a fresh whole-sequence prefill."""
    c, tokens, out = model.config, prompt_ids + output_ids, []
    rotary = Rotary(c, torch.device("cpu"), torch.float32)
    for end in range(len(prompt_ids), len(tokens)):
        caches = [torch.zeros(64, 2, 16, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
        with torch.no_grad():
            logits = model.prefill(torch.tensor(tokens[:end]), 0, caches, torch.arange(64), rotary, chunk=4096)
        out.append(torch.log_softmax(logits[0], dim=-1))
    return out


def ids_of(names: list[str]) -> list[int]:
    """Token ids from logprobs that name tokens "token_id:<id>" (return_tokens_as_token_ids)."""
    assert all(name.startswith("token_id:") for name in names), names
    return [int(name.removeprefix("token_id:")) for name in names]


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=1.5, top_p=0.95, seed=3)],
                         ids=["greedy", "sampled"])
def test_completion_logprobs_equal_log_softmax_of_the_logits(url, tokenizer, model, fields):
    ask = dict(prompt=PROMPT, max_tokens=6, ignore_eos=True, logprobs=3, **fields)
    body = post(url, "/v1/completions", return_tokens_as_token_ids=True, **ask).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == body["usage"]["completion_tokens"] == 6
    ids = ids_of(logprobs["tokens"])
    assert tokenizer.decode(ids) == body["choices"][0]["text"]
    for i, (token, want) in enumerate(zip(ids, reference(model, tokenizer.encode(PROMPT), ids))):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(want[token]), abs=1e-5)
        top = want.topk(3)
        expected = {f"token_id:{t}": v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        expected.setdefault(f"token_id:{token}", float(want[token]))  # the emitted token is always listed
        assert logprobs["top_logprobs"][i] == pytest.approx(expected, abs=1e-5)

    # Named by their text (the default), streamed: the same tokens (greedy, or the same seed), split over chunks.
    # The prompt now hits the local prefix cache, so the logits come from another path through the model: equal
    # within float rounding.
    whole = post(url, "/v1/completions", **ask).json()["choices"][0]
    texts = [tokenizer.decode([token]) for token in ids]
    assert whole["logprobs"]["tokens"] == texts and "".join(texts) == whole["text"]
    assert whole["logprobs"]["text_offset"] == [sum(map(len, texts[:i])) for i in range(6)]
    chunks = stream(url, "/v1/completions", **ask)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    joined = {key: [v for part in streamed for v in part[key]] for key in whole["logprobs"]}
    assert joined["tokens"] == texts and joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)


def test_chat_logprobs_with_top_logprobs(url, tokenizer, model):
    messages = [{"role": "user", "content": PROMPT}]
    ask = dict(messages=messages, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2, temperature=0)
    content = post(url, "/v1/chat/completions", return_tokens_as_token_ids=True, **ask).json()[
        "choices"][0]["logprobs"]["content"]
    ids = ids_of([entry["token"] for entry in content])
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    for entry, token, want in zip(content, ids, reference(model, prompt_ids, ids)):
        assert entry["logprob"] == pytest.approx(float(want[token]), abs=1e-5)
        top = want.topk(2)
        assert [t["token"] for t in entry["top_logprobs"]] == [f"token_id:{i}" for i in top.indices.tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert top.indices[0] == token  # greedy: the most likely token was emitted

    whole = post(url, "/v1/chat/completions", **ask).json()["choices"][0]
    named = whole["logprobs"]["content"]
    assert [entry["token"] for entry in named] == [tokenizer.decode([token]) for token in ids]
    assert "".join(entry["token"] for entry in named) == whole["message"]["content"]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in named)
    chunks = stream(url, "/v1/chat/completions", **ask)
    streamed = [e for c in chunks for choice in c["choices"] if choice.get("logprobs")
                for e in choice["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in named]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    plain = post(url, "/v1/chat/completions", messages=messages, max_tokens=2).json()
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", dict(prompt="x", logprobs=MAX_LOGPROBS + 1), "logprobs"),
    ("/v1/completions", dict(prompt="x", logprobs=-1), "logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=MAX_LOGPROBS + 1), "top_logprobs"),
], ids=["too many", "negative", "top without logprobs", "too many top"])
def test_logprobs_out_of_range_are_400(url, path, fields, param):
    response = post(url, path, max_tokens=2, **fields)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert post(url, "/v1/completions", prompt="x", max_tokens=2, logprobs=MAX_LOGPROBS).status_code == 200
