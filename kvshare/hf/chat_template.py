"""Chat templates rendered as Hugging Face transformers renders them, so a prompt built here is the prompt vLLM and
`tokenizer.apply_chat_template` build for the same messages.

What a template sees, and why each piece is here (every one changes output or success for real templates):
- a sandboxed, immutable jinja2 environment with trim_blocks and lstrip_blocks (template whitespace as written on the
  Hub assumes both) and the loop-controls extension (`{% break %}`, `{% continue %}`);
- `tojson` that writes plain JSON (json.dumps, non-ASCII kept, nothing HTML-escaped: jinja2's own filter writes "<"
  as "\\u003c", which changes every tool schema or argument holding <, >, & or ');
- globals `raise_exception(message)` (templates refuse bad conversations with it), `strftime_now(format)`, a `dict`
  that only builds dicts, and a `namespace` that refuses underscore-named attributes;
- a `{% generation %}...{% endgeneration %}` block tag, rendered as its body (training-time templates mark the
  assistant's tokens with it);
- variables: messages (keys whose value is None dropped, as transformers drops them), tools, documents,
  add_generation_prompt, and the tokenizer's named special tokens (bos_token, eos_token, ...) when it has them.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# The special tokens transformers hands every template (those the tokenizer defines).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or could not render it; the message says why."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictBuilder:
    """The template's `dict`: builds dicts, and exposes nothing of the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() that refuses attributes whose name starts with "_" (no reach into Python internals)."""

    def __init__(*args, **kwargs):  # jinja2's own signature trick: `self` may also be an attribute name
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders as `body`."""

    tags = {"generation"}

    def parse(self, parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictBuilder(),
                       namespace=_Namespace)
    return env


class ChatTemplate:
    """One compiled template. `render` raises ChatTemplateError (a ValueError) when the template refuses."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template does not compile: {error}") from None
        self._special = dict(special_tokens)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None) -> str:
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._template.render(messages=plain, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **self._special)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"the chat template refused the conversation: {error}") from None


def pick_template(value: str | list | None, tools: bool) -> str | None:
    """tokenizer_config's chat_template is a string, or a list of {"name", "template"}: then "tool_use" when tools
    are given and it exists, else "default" (as transformers picks)."""
    if value is None or isinstance(value, str):
        return value
    named = {entry["name"]: entry["template"] for entry in value}
    if tools and "tool_use" in named:
        return named["tool_use"]
    return named.get("default")
