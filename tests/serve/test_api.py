"""OpenAI/vLLM API parity of a real `kvshare serve`: /tokenize and /detokenize as vLLM serves them, GET
/v1/models/{id}, batch prompts on /v1/completions (streamed too), 400 for every validation error, unsupported
parameters refused by name, the chat template's errors as 400, and the latency histograms."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.hf.tokenizer import Tokenizer

from .conftest import MAX_MODEL_LEN, MAX_PROMPTS, MODEL, post, stream

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Naïve café: a<b & c>d, \"quoted\"."]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ------------------------------------------------------------------------------------------------ tokenize


def test_tokenize_and_detokenize_as_vllm_serves_them(url, tokenizer):
    text = PROMPTS[1]
    # vllm bench serve's call: the ids, and detokenize of a prefix of them gives the text that tokenizes to it
    body = post(url, "/tokenize", prompt=text, add_special_tokens=False).json()
    ids = tokenizer.encode(text)
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    prefix = post(url, "/detokenize", tokens=ids[:5]).json()["prompt"]
    assert prefix == tokenizer.decode(ids[:5], skip_special_tokens=False)
    assert post(url, "/tokenize", prompt=prefix, add_special_tokens=False).json()["tokens"] == ids[:5]
    # the defaults: special tokens added to a prompt (as the tokenizer adds them), token strings on request
    default = post(url, "/tokenize", prompt=text, return_token_strs=True).json()
    assert default["tokens"] == tokenizer.encode_with_special_tokens(text)
    assert default["token_strs"] == tokenizer.token_strings(default["tokens"])
    # a chat: rendered with the model's template, then encoded as written; special tokens round-trip
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = post(url, "/tokenize", messages=messages).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert post(url, "/detokenize", tokens=chat["tokens"]).json()["prompt"] == tokenizer.apply_chat_template(messages)
    bare = post(url, "/tokenize", messages=messages, add_generation_prompt=False).json()
    assert bare["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
], ids=["model", "prompt type", "both", "neither", "chat_template", "tokens type", "id too large", "negative id"])
def test_tokenize_errors(url, path, body, status, param):
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert error_of(response, status)["param"] == param


# ------------------------------------------------------------------------------------------------ models


def test_models_retrieve_and_an_unknown_id(url):
    card = httpx.get(f"{url}/v1/models/{MODEL}", timeout=30).json()
    assert card == httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    for other in ("gpt-4", "org/model-name"):
        error = error_of(httpx.get(f"{url}/v1/models/{other}", timeout=30), 404)
        assert error["code"] == "model_not_found" and other in error["message"]


# ------------------------------------------------------------------------------------------------ batch prompts


@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token ids"])
def test_a_batch_gives_one_choice_per_prompt_as_single_requests_would(url, tokenizer, as_ids):
    prompts = [tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    fields = dict(max_tokens=6, temperature=0, ignore_eos=True)
    singles = [post(url, "/v1/completions", prompt=p, **fields).json() for p in prompts]
    batch = post(url, "/v1/completions", prompt=prompts, **fields).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)

    events = stream(url, "/v1/completions", prompt=prompts, stream_options={"include_usage": True}, **fields)
    texts, finished = ["", ""], [None, None]
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == [c["text"] for c in batch["choices"]] and finished == ["length", "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_a_batch_over_max_prompts_is_refused(url):
    assert post(url, "/v1/completions", prompt=["a"] * MAX_PROMPTS, max_tokens=1).status_code == 200
    error = error_of(post(url, "/v1/completions", prompt=["a"] * (MAX_PROMPTS + 1), max_tokens=1), 400)
    assert "--max-prompts" in error["message"] and error["param"] == "prompt"


def test_a_bad_prompt_in_a_batch_fails_the_request(url):
    error = error_of(post(url, "/v1/completions", prompt=["fine", ""], max_tokens=2), 400)
    assert "empty" in error["message"]
    error = error_of(post(url, "/v1/completions", prompt=[[1, 2], ["x"]], max_tokens=2), 400)
    assert error["param"] == "prompt"


# ------------------------------------------------------------------------------------------------ 400s, refusals


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [["x"]]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
    ("/v1/completions", {"prompt": "x", "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}),
    ("/v1/chat/completions", {"messages": "hello"}),
], ids=["nested prompt", "float max_tokens", "bool logprobs", "role type", "int chat logprobs", "messages type"])
def test_wrong_types_are_400_never_422(url, path, body):
    error = error_of(httpx.post(f"{url}{path}", json=body, timeout=30), 400)
    assert error["type"] == "invalid_request_error" and error["param"]


CHAT = "/v1/chat/completions"
REFUSED = [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "logit_bias", {"5": 10}),
    ("/v1/completions", "logit_bias", {"5": 10}),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "repetition_penalty", 1.2),
    ("/v1/completions", "min_p", 0.1),
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "frobnicate", 1),
]


@pytest.mark.parametrize("path, field, value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in REFUSED])
def test_unsupported_parameters_are_refused_by_name(url, path, field, value):
    body = {"prompt": "hi"} if path.endswith("/completions") and path != CHAT else {
        "messages": [{"role": "user", "content": "hi"}]}
    error = error_of(post(url, path, max_tokens=2, **body, **{field: value}), 400)
    assert error["param"] == field and f"'{field}'" in error["message"]


def test_parameters_at_values_that_ask_for_nothing_are_served(url):
    neutral = dict(tools=[], tool_choice="none", logit_bias={}, response_format={"type": "text"}, best_of=1,
                   echo=False, repetition_penalty=1.0, logprobs=None, parallel_tool_calls=False, metadata={"a": "b"},
                   store=False, user="u")
    messages = [{"role": "user", "content": "hi"}]
    chat = post(url, CHAT, messages=messages, max_tokens=2, **{k: v for k, v in neutral.items() if k != "best_of"})
    assert chat.status_code == 200, chat.text
    done = post(url, "/v1/completions", prompt="hi", max_tokens=2, logit_bias={}, echo=False, best_of=1,
                repetition_penalty=1, min_p=0.0, skip_special_tokens=True)
    assert done.status_code == 200, done.text


def test_a_chat_template_error_is_a_400(url):
    # The tiny model's ChatML template concatenates message['content']: a message whose content is a list with a
    # non-text part is refused before the template; an empty conversation too.
    error = error_of(post(url, CHAT, messages=[]), 400)
    assert error["param"] == "messages"
    error = error_of(post(url, CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400)
    assert "image_url" in error["message"]


# ------------------------------------------------------------------------------------------------ metrics


def histogram_counts(url: str) -> dict[tuple[str, str], float]:
    """{(histogram, endpoint): observation count} from /metrics."""
    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name.endswith("_count"):
                counts[(sample.name, sample.labels.get("endpoint", ""))] = sample.value
    return counts


def test_e2e_and_inter_token_latency_histograms(url):
    before = histogram_counts(url)
    stream(url, "/v1/completions", prompt="measure me", max_tokens=7, ignore_eos=True)
    post(url, CHAT, messages=[{"role": "user", "content": "and me"}], max_tokens=4, ignore_eos=True)
    after = histogram_counts(url)

    def grew(name: str, endpoint: str) -> float:
        key = (name + "_count", endpoint)
        return after.get(key, 0) - before.get(key, 0)

    assert grew("kvshare_e2e_request_latency_seconds", "/v1/completions") == 1
    assert grew("kvshare_e2e_request_latency_seconds", CHAT) == 1
    assert grew("kvshare_inter_token_latency_seconds", "/v1/completions") == 6  # one gap per token after the first
    assert grew("kvshare_inter_token_latency_seconds", CHAT) == 3
    assert grew("kvshare_time_to_first_token_seconds", "/v1/completions") == 1
