"""Chat templates render exactly as transformers' apply_chat_template renders them (the prompt vLLM builds), for the
template styles models ship: Llama-3 (headers, a date from strftime_now, tools as indented JSON), Qwen2 (tools in the
system prompt, tool calls as JSON, namespace), Mistral (raise_exception on roles out of turn, loop controls) and
ChatML; messages hold <, >, &, quotes and non-ASCII text, which jinja2's own tojson would escape."""

from __future__ import annotations

import json
import shutil

import pytest

from kvshare.hf.chat_template import ChatTemplateError
from kvshare.hf.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You may call these functions:\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN2_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(seen_user=false) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- set ns.seen_user = true %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls | default([]) %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- set turn = loop.index0 - (1 if messages[0]['role'] == 'system' else 0) %}
    {%- if (message['role'] == 'user') != (turn % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

CHATML = """{% for message in messages %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
{% endif %}"""

TRICKY = "Is a<b && c>d? Say \"yes\" or 'no' — naïve café, 日本語, emoji 🙂"
CONVERSATION = [
    {"role": "system", "content": "You answer <briefly> & \"precisely\"."},
    {"role": "user", "content": TRICKY},
    {"role": "assistant", "content": "a<b: true & c>d: «false»"},
    {"role": "user", "content": "Now in <html> & 'quotes'"},
]
TOOLS = [{"type": "function", "function": {
    "name": "compare", "description": "Checks a<b & c>d for \"x\" — naïve",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "e.g. 1<2 & 'ü'"}},
                   "required": ["expr"]}}}]
TOOL_TURNS = [
    {"role": "user", "content": TRICKY},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "compare", "arguments": {"expr": "a<b & \"c\">'d' ü"}}}]},
    {"role": "tool", "content": "{\"result\": \"<true> & ünïcode\"}"},
]


def folder_with_template(tiny_model, tmp_path, template: str):
    """The tiny model's tokenizer files with `template` as its chat template (both libraries read this folder)."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(tiny_model / name, tmp_path / name)
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def both(folder):
    return Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(folder)


CASES = [
    ("llama3", LLAMA3, CONVERSATION, None),
    ("llama3-tools", LLAMA3, CONVERSATION, TOOLS),
    ("qwen2-tools", QWEN2_TOOLS, [CONVERSATION[0], *TOOL_TURNS], TOOLS),
    ("qwen2-plain", QWEN2_TOOLS, CONVERSATION, None),
    ("mistral", MISTRAL, CONVERSATION, None),
    ("chatml", CHATML, CONVERSATION, None),
]


@pytest.mark.parametrize("name, template, messages, tools", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(tiny_model, tmp_path, name, template, messages, tools, add_generation_prompt):
    ours, theirs = both(folder_with_template(tiny_model, tmp_path, template))
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    assert rendered == expected
    if tools:  # the case jinja2's own tojson gets wrong: tool schemas keep <, >, & and non-ASCII as written
        assert "a<b & c>d" in rendered and "naïve" in rendered and "\\u003c" not in rendered


def test_a_template_that_refuses_the_roles_refuses_in_both(tiny_model, tmp_path):
    ours, theirs = both(folder_with_template(tiny_model, tmp_path, MISTRAL))
    out_of_turn = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        theirs.apply_chat_template(out_of_turn, tokenize=False)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.apply_chat_template(out_of_turn)


def test_named_templates_pick_tool_use_when_tools_are_given(tiny_model, tmp_path):
    folder = folder_with_template(tiny_model, tmp_path, [{"name": "default", "template": CHATML},
                                                         {"name": "tool_use", "template": QWEN2_TOOLS}])
    ours, theirs = both(folder)
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(CONVERSATION, tools=tools) == expected


def test_namespace_refuses_underscore_attributes(tiny_model, tmp_path):
    template = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    ours, _ = both(folder_with_template(tiny_model, tmp_path, template))
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template(CONVERSATION)
