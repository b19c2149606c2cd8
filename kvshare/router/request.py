"""What placement needs to know about one request: its session id and its prompt, read from the OpenAI JSON body.

The session id is the `X-Session-ID` header, else the OpenAI `user` field, else None (no session).
The prompt is either token ids (a completions `prompt` given as a list of ints) or text: a completions `prompt`
string, or a chat `messages` list written canonically as "role\\ncontent\\n\\n" per message (text parts of a list
content joined), so that a conversation's next turn extends the previous turn's text. For a batched prompt
(a list of prompts) the first one is used.

A generation request (POST to /v1/completions or /v1/chat/completions) whose body is not a JSON object in valid UTF-8
with valid Unicode (no lone surrogates) and bounded nesting is malformed: the router answers it 400 itself, since no
replica could serve it. On other paths such a body places like a request with no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

SESSION_HEADER = "x-session-id"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class MalformedBody(ValueError):
    """A generation request whose body no replica could read; the message says what is wrong."""


@dataclass(frozen=True)
class RequestInfo:
    session_id: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # set when the client sent token ids
    prompt_text: bytes = b""  # UTF-8 prompt text when no token ids were sent


class _TokenIdsBody(msgspec.Struct):
    """A body whose `prompt` is one list of non-negative ints and that has no `messages`: the long-context client's
    form, decoded and checked in one pass in C (131,072 ids: ~5 ms, against ~13 ms for decoding to Python objects and
    checking each id). Anything else fails to decode into it and takes the general path, so both paths place every
    body alike."""

    prompt: list[Annotated[int, msgspec.Meta(ge=0)]]
    user: Any = None
    messages: Any = msgspec.UNSET


class _SessionBody(msgspec.Struct):
    """The one field a policy that ignores the prompt reads: the prompt is parsed for validity but never built into
    objects (131,072 ids: ~1 ms)."""

    user: Any = None


_TOKEN_IDS_BODY = msgspec.json.Decoder(_TokenIdsBody)
_SESSION_BODY = msgspec.json.Decoder(_SessionBody)


def parse_request(path: str, headers: list[tuple[str, str]], body: bytes, read_prompt: bool = True) -> RequestInfo:
    """Raises MalformedBody only for a generation request whose body is not a readable JSON object; anything readable
    is placed and forwarded, for the replica to judge (its 4xx pass through). With read_prompt False the prompt is
    left out (None, b""), for a policy that does not read it; the session and every refusal stay the same."""
    # The typed decoders skip the fields they do not name without checking the UTF-8 of their strings, which the
    # general path refuses; an ASCII body (id prompts, escaped text) is valid UTF-8 by construction, and isascii()
    # costs ~0.03 ms at 820 KB. Every other body takes the general path.
    typed = _typed_reading(headers, body, read_prompt) if body.isascii() else None
    if typed is not None:
        return typed
    payload = _json_object(body, strict=path in GENERATION_PATHS)
    session = _first(headers, SESSION_HEADER) or _as_str(payload.get("user"))
    if "messages" in payload:
        return RequestInfo(session, None, _chat_text(payload["messages"]).encode())
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # batched prompts: place by the first
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return RequestInfo(session, tuple(prompt), b"")
    if isinstance(prompt, str):
        return RequestInfo(session, None, prompt.encode())
    return RequestInfo(session, None, b"")


def _typed_reading(headers: list[tuple[str, str]], body: bytes, read_prompt: bool) -> RequestInfo | None:
    """The session alone (read_prompt False), or the session and an id prompt; None where only the general path can
    tell (not an object, not an id prompt, chat messages)."""
    try:
        if not read_prompt:
            return RequestInfo(_first(headers, SESSION_HEADER) or _as_str(_SESSION_BODY.decode(body).user))
        ids = _TOKEN_IDS_BODY.decode(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        return None
    if ids.messages is not msgspec.UNSET:
        return None
    return RequestInfo(_first(headers, SESSION_HEADER) or _as_str(ids.user), tuple(ids.prompt), b"")


def _json_object(body: bytes, strict: bool) -> dict:
    """msgspec refuses invalid UTF-8 and lone surrogates (the json module accepts "\\ud800", which then cannot be
    encoded) and raises RecursionError on deep nesting instead of recursing without bound."""
    try:
        payload = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError as error:
        if strict:
            raise MalformedBody(f"the request body is not valid JSON ({error}); send a JSON object in UTF-8") from None
        return {}
    except RecursionError:
        if strict:
            raise MalformedBody("the request body nests JSON too deeply; send a flat JSON object") from None
        return {}
    if isinstance(payload, dict):
        return payload
    if strict:
        raise MalformedBody(f"the request body must be a JSON object, got {type(payload).__name__ if body else 'none'}")
    return {}


def _first(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((value for key, value in headers if key == name), None)


def _as_str(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _chat_text(messages) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n\n")
    return "".join(parts)


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
