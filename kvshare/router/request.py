"""What placement needs to know about one request: its session id and its prompt, read from the OpenAI JSON body.

The session id is the `X-Session-ID` header, else the OpenAI `user` field, else None (no session).
The prompt is either token ids (a completions `prompt` given as a list of ints) or text: a completions `prompt`
string, or a chat `messages` list written canonically as "role\\ncontent\\n\\n" per message (text parts of a list
content joined), so that a conversation's next turn extends the previous turn's text. For a batched prompt
(a list of prompts) the first one is used. A body that is not JSON places like a request with no prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class RequestInfo:
    session_id: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # set when the client sent token ids
    prompt_text: bytes = b""  # UTF-8 prompt text when no token ids were sent


def parse_request(headers: dict[str, str], body: bytes) -> RequestInfo:
    """Never raises: placement must not reject a request that the replica should judge (4xx pass through)."""
    payload = _json_object(body)
    session = headers.get(SESSION_HEADER) or _as_str(payload.get("user"))
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


def _json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return payload if isinstance(payload, dict) else {}


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
