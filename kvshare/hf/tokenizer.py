"""Text <-> token ids for a model folder: tokenizer.json through `tokenizers`, chat templates rendered with jinja2."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer

from kvshare.hf.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, pick_template


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A model folder's tokenizer. Invariant: eos_token_ids holds every id that ends generation (tokenizer_config's
    eos token and generation_config's eos_token_id, which may be a list)."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, generation_config: dict,
                 chat_template: str | list | None, special_tokens_map: dict | None = None):
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # Named special tokens as a chat template sees them: tokenizer_config's, else special_tokens_map.json's.
        legacy = special_tokens_map or {}
        named = {name: _token_text(config.get(name) or legacy.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.special_tokens = {name: text for name, text in named.items() if text is not None}
        eos = set()
        if self.eos_token is not None and tokenizer.token_to_id(self.eos_token) is not None:
            eos.add(tokenizer.token_to_id(self.eos_token))
        gen_eos = generation_config.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.chat_template = chat_template  # a string, or tokenizer_config's list of named templates
        self._compiled: dict[str, ChatTemplate] = {}

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
        return cls(HFTokenizer.from_file(str(path)), config, _read_json(model_dir / "generation_config.json"), template,
                   _read_json(model_dir / "special_tokens_map.json"))

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

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text of a chat (messages: [{"role": ..., "content": ...}, ...]), exactly as transformers'
        apply_chat_template(..., tokenize=False) renders it (kvshare.hf.chat_template). Raises ValueError (a
        ChatTemplateError when the template refuses the conversation)."""
        source = pick_template(self.chat_template, tools=bool(tools))
        if source is None:
            raise ValueError("this model's tokenizer has no chat_template: use /v1/completions with a plain prompt")
        if source not in self._compiled:
            self._compiled[source] = ChatTemplate(source, self.special_tokens)
        return self._compiled[source].render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level BPE shows a leading space as "Ġ"), as /tokenize returns them."""
        return [self._tok.id_to_token(i) or "" for i in token_ids]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Token ids of `text` with the tokenizer's own additions (e.g. a BOS that its post-processor adds)."""
        return self._tok.encode(text, add_special_tokens=True).ids


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
