"""Checks of an OpenAI request that need the model (limits, vocabulary, name, sampling ranges) and the engine request
they turn into: every value that passes can be sampled, every failure is a 4xx ApiError naming its parameter."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Protocol, Sequence

from kvshare.engine.api import EngineProtocol, GenerationRequest, SamplingParams
from kvshare.serve.schema import ApiError, ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from kvshare.serve.unsupported import refuse_unsupported


class TokenizerProtocol(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_token_chars: int  # characters of the longest token (bounds the token count of a text from below)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str: ...

    def encode_with_special_tokens(self, text: str) -> list[int]: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...


SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as vLLM; torch's generators take any of these


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the replica beyond its size (`kvshare serve` flags). Stop strings are matched
    against the text after every token, so their number and length bound that work."""

    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_logprobs: int = 20  # most likely tokens returned per position (vLLM's default max_logprobs)
    max_prompts: int = 256  # prompts in one batch /v1/completions request (each is an engine request)


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check: what the engine gets and what the response needs."""

    request: GenerationRequest
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    arrived: float  # perf_counter() at arrival, for TTFT
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)


class Validator:
    """Semantic checks that need the model: limits, vocabulary, model name. Each failure is a 4xx ApiError."""

    def __init__(self, engine: EngineProtocol, tokenizer: TokenizerProtocol, model_name: str,
                 limits: RequestLimits) -> None:
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{self.model_name}' "
                                "(see /v1/models)", param="model", code="model_not_found")

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} in '{param}' is outside the vocabulary [0, {vocab})", param=param)

    def max_tokens(self, asked: int | None, prompt_len: int, default: int | None) -> int:
        """The completion budget; the prompt plus it must fit in max_model_len (both numbers in the message)."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise ApiError(400, f"the prompt has {prompt_len} tokens but this model's maximum context length is "
                                f"{limit} tokens (prompt + at least 1 generated token); shorten the prompt",
                           param="prompt", code="context_length_exceeded")
        if asked is None:
            return min(default, limit - prompt_len) if default is not None else limit - prompt_len
        if asked < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {asked}", param="max_tokens")
        if prompt_len + asked > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the request has "
                                f"{prompt_len} prompt tokens and asks for {asked} completion tokens; shorten the "
                                "prompt or lower max_tokens", param="max_tokens", code="context_length_exceeded")
        return asked

    def check_values(self, body: SamplingFields) -> None:
        """OpenAI's ranges (vLLM's for its extensions), checked before the prompt is tokenized: every value that
        passes can be sampled."""
        if body.n < 1:
            raise ApiError(400, f"n must be at least 1, got {body.n}", param="n")
        if body.n != 1:
            raise ApiError(400, f"n={body.n} is not supported; send n=1 (one choice per request)", param="n")
        _check_number("temperature", body.temperature, 0.0, 2.0)
        _check_number("top_p", body.top_p, 0.0, 1.0, open_below=True)
        top_k = 0 if body.top_k is None else body.top_k
        if top_k < -1:
            raise ApiError(400, f"top_k must be -1 or 0 (no top-k cut) or at least 1, got {top_k}", param="top_k")
        _check_no_penalty("presence_penalty", body.presence_penalty)
        _check_no_penalty("frequency_penalty", body.frequency_penalty)
        if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
            raise ApiError(400, f"seed must be a 64-bit signed integer, got {body.seed}", param="seed")
        self.check_stop_strings(_stop_strings(body.stop))
        refuse_unsupported(body.model_extra)
        self.logprobs(body)  # checks the range

    def logprobs(self, body: SamplingFields) -> int | None:
        """How many most likely tokens to return per position (0: the emitted token's logprob alone), or None.
        Completions send `logprobs: k`; chat sends `logprobs: true` and `top_logprobs: k`."""
        if isinstance(body, CompletionRequest):
            asked, param = body.logprobs, "logprobs"
        elif isinstance(body, ChatRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            asked, param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
        else:
            return None
        if asked is not None and not 0 <= asked <= self.limits.max_logprobs:
            raise ApiError(400, f"{param} must be in [0, {self.limits.max_logprobs}] (--max-logprobs), got {asked}",
                           param=param)
        return asked

    def sampling(self, body: SamplingFields, prompt_len: int, max_tokens: int | None, default: int | None
                 ) -> SamplingParams:
        """The engine's parameters for a body that passed check_values."""
        stop_ids = tuple(body.stop_token_ids or ())
        self.check_ids(stop_ids, "stop_token_ids")
        return SamplingParams(max_tokens=self.max_tokens(max_tokens, prompt_len, default),
                              temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, top_k=max(body.top_k or 0, 0),
                              logprobs=self.logprobs(body))

    def check_stop_strings(self, strings: tuple[str, ...]) -> None:
        if len(strings) > self.limits.max_stop_strings:
            raise ApiError(400, f"stop has {len(strings)} strings; this server accepts at most "
                                f"{self.limits.max_stop_strings} (--max-stop-strings)", param="stop")
        longest = max(map(len, strings), default=0)
        if longest > self.limits.max_stop_chars:
            raise ApiError(400, f"a stop string has {longest} characters; this server accepts at most "
                                f"{self.limits.max_stop_chars} (--max-stop-chars)", param="stop")

    def refuse_hopeless_text(self, chars: int, param: str) -> None:
        """A text longer than max_model_len * max_token_chars characters cannot fit: refuse it before tokenizing,
        which for megabytes of text would hold the process for seconds."""
        limit = self.engine.max_model_len * self.tokenizer.max_token_chars
        if chars > limit:
            raise ApiError(400, f"the prompt has {chars} characters, more than the model's maximum context length of "
                                f"{self.engine.max_model_len} tokens can hold (at most {limit} characters); send a "
                                "shorter prompt", param=param)

    def completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]],
                           add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each prompt of a request: one, or a batch (a list of texts or of id lists)."""
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > self.limits.max_prompts:
            raise ApiError(400, f"the request has {len(batch)} prompts; this server accepts at most "
                                f"{self.limits.max_prompts} in one request (--max-prompts)", param="prompt")
        return [self.completion_prompt(one, add_special_tokens) for one in batch]

    def completion_prompt(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        if isinstance(prompt, str):
            self.refuse_hopeless_text(len(prompt), "prompt")
            encode = self.tokenizer.encode_with_special_tokens if add_special_tokens else self.tokenizer.encode
            ids = encode(prompt) if prompt else []
        else:
            ids = list(prompt)
            self.check_ids(ids, "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty; send at least one token", param="prompt")
        return ids

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat's prompt text, as transformers' apply_chat_template renders it (a refusing template is a 400)."""
        if not messages:
            raise ApiError(400, "messages is empty; send at least one message", param="messages")
        plain = [_template_message(m) for m in messages]
        self.refuse_hopeless_text(sum(len(m["content"]) for m in plain), "messages")
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tools=tools)
        except ValueError as error:  # no chat template, or the template refused the conversation
            raise ApiError(400, str(error), param="messages") from None

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.encode(self.render_chat(messages, add_generation_prompt))
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", param="messages")
        return ids

    def prepare(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, default: int | None,
                request_id: str, arrived: float) -> Prepared:
        """`default`: the completion budget when max_tokens is absent (None: up to the context limit)."""
        sampling = self.sampling(body, len(prompt_ids), max_tokens, default)
        stop = tuple(s for s in _stop_strings(body.stop) if s)
        request = GenerationRequest(request_id=request_id, prompt_ids=tuple(prompt_ids), sampling=sampling,
                                    cache_salt=body.cache_salt or "")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(request, stop, body.stream, include_usage, arrived, body.return_tokens_as_token_ids)


def new_request_id(prefix: str) -> str:
    """A response's id (cmpl-..., chatcmpl-...); a batch's engine requests add "-<index>" to it."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _check_number(name: str, value: float, low: float, high: float, open_below: bool = False) -> None:
    """A finite number in [low, high] (or (low, high]); NaN and infinities fail every comparison, so they are named."""
    inside = math.isfinite(value) and (low < value if open_below else low <= value) and value <= high
    if not inside:
        interval = f"{'(' if open_below else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"{name} must be a finite number in {interval}, got {value}", param=name)


def _check_no_penalty(name: str, value: float | None) -> None:
    if value is None:
        return
    _check_number(name, value, -2.0, 2.0)
    if value != 0:
        raise ApiError(400, f"{name}={value} is not supported: this server samples without penalties; send 0 or "
                            "leave it out", param=name)


def _template_message(message: ChatMessage) -> dict:
    """The message as the chat template sees it, as vLLM hands it over: its other fields as sent (None ones are dropped
    by the template), content a string: text parts joined with newlines, none at all ""."""
    return {**(message.model_extra or {}), "role": message.role, "content": _message_text(message)}


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part of type '{part.type}' is not supported; send text parts only",
                           param="messages")
    return "\n".join(part.text or "" for part in message.content)
