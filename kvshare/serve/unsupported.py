"""The request parameters kvshare serve does not implement, refused by name: a client that asks for tools, a JSON
schema, a logit bias or beam search gets a 400 that says so, never an answer that silently ignored what it asked.

Every field of a request body is one of: served (a field of the request model in schema.py); known here, accepted only
at a value that asks for nothing (`tools: []`, `repetition_penalty: 1`, `echo: false`: clients send such defaults
explicitly); harmless (bookkeeping that changes no output); or unknown, refused as OpenAI refuses it.
"""

from __future__ import annotations

import json
from typing import Any

from kvshare.serve.schema import ApiError

TOOLS = "this server does not call tools (no tool-call parsing)"
STRUCTURED = "this server has no structured (guided) output"
BEAM = "this server samples one sequence per prompt (no beam search, best_of or n > 1)"
PENALTY = "this server samples without penalties"
OUTPUT_TEXT = "this server returns the generated text only, decoded with special tokens skipped"
PROMPT_LOGPROBS = "this server returns logprobs of generated tokens only"

# name -> (the values that ask for nothing, why anything else is refused)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), TOOLS),
    "tool_choice": ((None, "none"), TOOLS),
    "functions": ((None, []), TOOLS),
    "function_call": ((None, "none"), TOOLS),
    "parallel_tool_calls": ((None, True, False), TOOLS),  # means nothing without tools
    "response_format": ((None, {"type": "text"}), STRUCTURED),
    "structured_outputs": ((None,), STRUCTURED),
    "guided_json": ((None,), STRUCTURED),
    "guided_regex": ((None,), STRUCTURED),
    "guided_choice": ((None,), STRUCTURED),
    "guided_grammar": ((None,), STRUCTURED),
    "guided_decoding_backend": ((None,), STRUCTURED),
    "logit_bias": ((None, {}), "this server applies no logit bias"),
    "allowed_token_ids": ((None,), "this server does not restrict the vocabulary"),
    "bad_words": ((None, []), "this server does not ban words"),
    "logits_processors": ((None, []), "this server runs no logits processors"),
    "best_of": ((None, 1), BEAM),
    "use_beam_search": ((None, False), BEAM),
    "length_penalty": ((None, 1.0), BEAM),
    "repetition_penalty": ((None, 1.0), PENALTY),
    "min_p": ((None, 0.0), "this server samples with temperature, top_k and top_p only"),
    "min_tokens": ((None, 0), "this server stops at EOS or a stop condition from the first token on"),
    "echo": ((None, False), "this server does not echo the prompt"),
    "suffix": ((None, ""), "this server does not insert text (no suffix)"),
    "prompt_logprobs": ((None,), PROMPT_LOGPROBS),
    "include_stop_str_in_output": ((None, False), OUTPUT_TEXT),
    "skip_special_tokens": ((None, True), OUTPUT_TEXT),
    "spaces_between_special_tokens": ((None, True), OUTPUT_TEXT),
    "return_token_ids": ((None, False), OUTPUT_TEXT),
    "truncate_prompt_tokens": ((None,), "this server never truncates a prompt; shorten it"),
    "continue_final_message": ((None, False), "this server always starts a new assistant message"),
    "chat_template": ((None,), "this server renders the model's own chat template only"),
    "chat_template_kwargs": ((None, {}), "this server renders the model's own chat template only"),
    "documents": ((None, []), "this server renders no documents into the chat template"),
    "mm_processor_kwargs": ((None, {}), "this server serves text only"),
    "modalities": ((None, ["text"]), "this server serves text only"),
    "audio": ((None,), "this server serves text only"),
    "prediction": ((None,), "this server does not use predicted outputs"),
    "reasoning_effort": ((None,), "this server has no reasoning settings"),
    "web_search_options": ((None,), "this server does not search the web"),
    "priority": ((None, 0), "this server schedules first come, first served"),
    "kv_transfer_params": ((None,), "this server shares KV through its pool only"),
    "vllm_xargs": ((None, {}), "this server takes no extra engine arguments"),
}

# Accepted whatever their value: they change no output (request bookkeeping, cache hints).
HARMLESS = frozenset({"metadata", "store", "service_tier", "request_id", "prompt_cache_key", "safety_identifier"})


def refuse_unsupported(extra: dict[str, Any] | None) -> None:
    """Raises a 400 ApiError naming the first field of `extra` (the body's fields the request model does not serve)
    that asks for something this server does not do."""
    for name, value in (extra or {}).items():
        if name in HARMLESS:
            continue
        if name not in NEUTRAL:
            raise ApiError(400, f"unknown parameter '{name}': this server does not implement it; leave it out",
                           param=name, code="unsupported_parameter")
        neutral, why = NEUTRAL[name]
        if not any(_same(value, n) for n in neutral):
            raise ApiError(400, f"'{name}' is not supported: {why}; leave it out (or send {_shown(neutral)})",
                           param=name, code="unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
    """Equal as JSON values: true is not 1, 1 is 1.0."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _shown(neutral: tuple[Any, ...]) -> str:
    values = [v for v in neutral if v is not None]
    return " or ".join(json.dumps(v) for v in values) if values else "null"
