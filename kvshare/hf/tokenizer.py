"""Text <-> token ids for a model folder: tokenizer.json through `tokenizers`, chat templates rendered with jinja2."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A model folder's tokenizer. Invariant: eos_token_ids holds every id that ends generation (tokenizer_config's
    eos token and generation_config's eos_token_id, which may be a list)."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, generation_config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = set()
        if self.eos_token is not None and tokenizer.token_to_id(self.eos_token) is not None:
            eos.add(tokenizer.token_to_id(self.eos_token))
        gen_eos = generation_config.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.chat_template = chat_template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: the model folder needs a fast tokenizer (tokenizer.json)")
        config = _read_json(model_dir / "tokenizer_config.json")
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").exists():  # newer transformers save the template beside the config
            template = (model_dir / "chat_template.jinja").read_text()
        return cls(HFTokenizer.from_file(str(path)), config, _read_json(model_dir / "generation_config.json"), template)

    @functools.cached_property
    def vocab_size(self) -> int:
        """Read once: the tokenizer never changes, and the library call walks the whole vocabulary (~4 ms with 150k
        added tokens - once per prompt id, that made a 32k-id request take 2 minutes before reaching the engine)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token: a text of n characters has at least n / max_token_chars tokens, which
        lets a server refuse a hopelessly long prompt before spending seconds tokenizing it."""
        return max((len(token) for token in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") are recognised."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat (messages: [{"role": ..., "content": ...}])."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat_template: use /v1/completions with a plain prompt")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)
