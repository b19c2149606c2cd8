"""OpenAI's wire format, the part kvshare serves: request models (strict pydantic), response bodies (msgspec structs),
and errors in OpenAI's `{"error": {"message", "type", "param", "code"}}` shape."""

from __future__ import annotations

import msgspec
import pydantic
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from kvshare.engine.api import Usage
from kvshare.httpguard.errors import ERROR_CAUSE_HEADER, REQUEST_CAUSED

# ---------------------------------------------------------------- requests (OpenAI's schema, the fields we serve)


# On a 5xx, says the request itself failed (alone: the other requests in its batch went on), so another replica would
# fail it too and a router must not retry it. Absent: the replica may be at fault.


class Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool (wrong types are errors, not guesses). Values are checked by the
    # server's validator, which says what range each field takes.
    model_config = ConfigDict(strict=True, extra="ignore")


class Request(Strict):
    # A request body keeps the fields it does not serve (`model_extra`): unsupported.py refuses, by name, every one
    # that asks for something (tools, logit_bias, ...), so no parameter is ever silently ignored.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
    include_usage: StrictBool = False


class SamplingFields(Request):
    model: StrictStr | None = None  # optional: a single-model server serves its model
    max_tokens: StrictInt | None = None
    temperature: StrictFloat = 0.0  # greedy unless asked (OpenAI's default is 1; benchmarks always set it)
    top_p: StrictFloat = 1.0
    top_k: StrictInt | None = None  # vLLM's field: -1 or 0 = no top-k cut
    presence_penalty: StrictFloat | None = None  # accepted only as 0: this engine applies no penalties
    frequency_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted for session routing upstream; no effect here
    cache_salt: StrictStr | None = None  # vLLM's field: requests with different salts never share pool chunks
    return_tokens_as_token_ids: StrictBool = False  # vLLM's field: logprobs name each token "token_id:<id>"


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them: one choice per prompt, in order
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # each token's logprob and this many most likely tokens'
    add_special_tokens: StrictBool = False  # vLLM's field: True adds what the tokenizer adds (e.g. a BOS) to text


class TextPart(Strict):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(Strict):
    # Other fields (name, tool_calls, tool_call_id, ...) go to the chat template as they are, as transformers hands
    # them over: a conversation's history renders whatever the template makes of it.
    model_config = ConfigDict(strict=True, extra="allow")

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None  # the newer OpenAI name for max_tokens
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None  # with logprobs: this many most likely tokens per position
    add_generation_prompt: StrictBool = True  # vLLM's field: False continues no assistant header


class TokenizeRequest(Request):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template first."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool | None = False
    tools: list[dict] | None = None  # rendered into the prompt by templates that take tools


class DetokenizeRequest(Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 request_caused: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"
        self.request_caused = request_caused  # a 5xx that another replica would give too (ERROR_CAUSE_HEADER)

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {ERROR_CAUSE_HEADER: REQUEST_CAUSED} if self.request_caused and self.status >= 500 else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers())


def parse_body(model: type[Strict], body: bytes) -> Strict:
    """Validates the raw body; malformed JSON and wrong or missing fields -> 400 (as OpenAI and vLLM answer), in
    OpenAI's shape."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON ({first['msg']}); send a JSON object") from None
        if not first["loc"]:
            raise ApiError(400, f"request body must be a JSON object, got: {first['msg']}") from None
        raise ApiError(400, _describe(error), param=str(first["loc"][0])) from None


_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of either (a batch)",
    "tokens": "a list of token ids",
    "messages": "a list of {role, content} objects, content a string or a list of text parts",
    "stop": "a string or a list of strings",
}


def _describe(error: pydantic.ValidationError) -> str:
    """One readable clause per wrong field (a union field's several complaints are joined), plus what to send."""
    by_field: dict[str, list[str]] = {}
    for item in error.errors():
        # loc like ("prompt", "list[int]", 3): the field, then union member tags and indexes inside it
        path = ".".join(str(p) for p in item["loc"] if not (isinstance(p, str) and ("[" in p or p == "str")))
        by_field.setdefault(path or str(item["loc"][0]), []).append(item["msg"])
    clauses = []
    for field, msgs in by_field.items():
        hint = _EXPECTED.get(field.split(".")[0])
        clauses.append(f"invalid '{field}': " + " or ".join(dict.fromkeys(msgs)) + (f" (send {hint})" if hint else ""))
    return "; ".join(clauses)


# ---------------------------------------------------------------- response bodies (OpenAI's shapes)


class KVShareHits(msgspec.Struct):
    local_hit_tokens: int
    pool_hit_tokens: int


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageBody(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kvshare: KVShareHits

    @classmethod
    def of(cls, usage: Usage) -> "UsageBody":
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens + usage.completion_tokens,
                   PromptTokensDetails(usage.cached_tokens), hits_of(usage))


def hits_of(usage: Usage) -> KVShareHits:
    return KVShareHits(usage.local_hit_tokens, usage.pool_hit_tokens)


class CompletionLogprobs(msgspec.Struct):
    """A completion choice's logprobs (OpenAI's legacy shape): per token its text, logprob, the most likely tokens'
    {text: logprob} and its character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class DeltaChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class Message(msgspec.Struct):
    role: str
    content: str


class MessageChoice(msgspec.Struct):
    index: int
    message: Message
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class Chunk(msgspec.Struct, omit_defaults=True):
    """A streamed chunk; `kvshare` rides on the chunk that carries finish_reason, `usage` on the include_usage one."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: UsageBody | None = None
    kvshare: KVShareHits | None = None


class Whole(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: UsageBody
    kvshare: KVShareHits


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
