"""vLLM's /tokenize and /detokenize, as `vllm bench serve` and vLLM clients call them: text (or a chat, rendered with
the model's template) to token ids and back, with the model's tokenizer and nothing else."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import Request
from fastapi.responses import Response

from kvshare.serve.schema import (
    ApiError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    parse_body,
)
from kvshare.serve.unsupported import refuse_unsupported
from kvshare.serve.validation import TokenizerProtocol, Validator

_encoder = msgspec.json.Encoder()


class Tokenization:
    """The two endpoints. Tokenizing runs in a worker thread (a long text takes long enough to stall other streams
    on the event loop)."""

    def __init__(self, validator: Validator, tokenizer: TokenizerProtocol, max_model_len: int) -> None:
        self.validator, self.tokenizer, self.max_model_len = validator, tokenizer, max_model_len

    async def tokenize(self, request: Request) -> Response:
        body = parse_body(TokenizeRequest, await request.body())
        self.validator.check_model(body.model)
        refuse_unsupported(body.model_extra)
        ids = await asyncio.to_thread(self._ids, body)
        strings = self.tokenizer.token_strings(ids) if body.return_token_strs else None
        return _json(TokenizeResponse(len(ids), self.max_model_len, ids, strings))

    def _ids(self, body: TokenizeRequest) -> list[int]:
        """A prompt's ids (special tokens added unless asked not to, as vLLM), or a chat's (rendered, then encoded
        as written: the template places its special tokens itself)."""
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either 'prompt' (text) or 'messages' (a chat), not both or neither",
                           param="prompt")
        if body.messages is not None:
            text = self.validator.render_chat(body.messages, body.add_generation_prompt, body.tools)
            add_special = bool(body.add_special_tokens)
        else:
            text, add_special = body.prompt, body.add_special_tokens is not False
        return self.tokenizer.encode_with_special_tokens(text) if add_special else self.tokenizer.encode(text)

    async def detokenize(self, request: Request) -> Response:
        body = parse_body(DetokenizeRequest, await request.body())
        self.validator.check_model(body.model)
        refuse_unsupported(body.model_extra)
        self.validator.check_ids(body.tokens, "tokens")
        # Special tokens stay in the text, so that a prompt cut at a token count round-trips through /tokenize.
        text = await asyncio.to_thread(self.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return _json(DetokenizeResponse(text))


def _json(body: msgspec.Struct) -> Response:
    return Response(_encoder.encode(body), media_type="application/json")
