"""Seeded synthetic workloads: unique documents of exact token lengths, the OFF-ON-ON-OFF schedule, session scripts.

Invariants:
- The same (seed, stream) always gives the same text and token ids; different streams give different documents,
  so no measured request can hit a prefix cached by an earlier one except by design (warm request on replica A).
- Documents are built from encoded text, so every id is an ordinary token a real tokenizer produces (no special
  tokens), which keeps them valid for vLLM too.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

BLOCKS = (("OFF1", "OFF"), ("ON1", "ON"), ("ON2", "ON"), ("OFF2", "OFF"))
_LENGTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


class Codec(Protocol):
    """The part of a tokenizer the workloads need (kvshare.hf.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def parse_lengths(text: str) -> list[tuple[str, int]]:
    """"1k,2k,512" -> [("1k", 1024), ("2k", 2048), ("512", 512)] (k = 1024 tokens, m = 1024k)."""
    lengths = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _LENGTH.match(item)
        if not match:
            raise ValueError(
                f"cannot read length {item!r}: write token counts such as 512, 2k or 128k, comma-separated")
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
        tokens = int(float(match.group(1)) * scale)
        if tokens <= 0:
            raise ValueError(f"length {item!r} must be positive")
        lengths.append((item, tokens))
    if not lengths:
        raise ValueError("no lengths given: pass e.g. --lengths 1k,2k")
    return lengths


def random_text(rng: np.random.Generator, words: int) -> str:
    """Pseudo-words of 2-9 lowercase letters with some punctuation: tokenizes like prose, never repeats across seeds."""
    letters = np.array(list(string.ascii_lowercase))
    sizes = rng.integers(2, 10, size=words)
    chars = letters[rng.integers(0, 26, size=int(sizes.sum()))]
    out, pos = [], 0
    for i, size in enumerate(sizes):
        out.append("".join(chars[pos : pos + size]) + ("." if i % 13 == 12 else ""))
        pos += size
    return " ".join(out)


def document_ids(codec: Codec, tokens: int, seed: int, *stream: int) -> list[int]:
    """Exactly `tokens` token ids of unique text for (seed, *stream)."""
    rng = np.random.default_rng([seed, *stream])
    words = max(16, tokens)
    for _ in range(20):  # bounded: each round doubles the text
        ids = codec.encode(random_text(rng, words))
        if len(ids) >= tokens:
            return list(ids[:tokens])
        words *= 2
    raise RuntimeError(f"the tokenizer gave fewer than {tokens} tokens for {words} words of text")


def document_text(codec: Codec, tokens: int, seed: int, *stream: int) -> str:
    """Text of about `tokens` tokens (the decoded prefix of a unique document; re-encoding may differ slightly)."""
    return codec.decode(document_ids(codec, tokens, seed, *stream))


@dataclass(frozen=True)
class PlannedRequest:
    """One measured cross-replica request: its block, arm, length and a stream id unique in the whole run."""

    block: str
    arm: str
    length_label: str
    length: int
    index: int  # position within the block
    stream: int  # unique per request: seeds the document and the questions


def block_schedule(lengths: list[tuple[str, int]], per_block: int, seed: int) -> list[list[PlannedRequest]]:
    """Four blocks OFF1, ON1, ON2, OFF2; each holds `per_block` requests per length in a seeded random order."""
    rng = np.random.default_rng([seed, 0xB10C])
    blocks, stream = [], 0
    for block, arm in BLOCKS:
        slots = [(label, tokens) for label, tokens in lengths for _ in range(per_block)]
        order = rng.permutation(len(slots))
        planned = []
        for index, slot in enumerate(order):
            label, tokens = slots[slot]
            planned.append(PlannedRequest(block, arm, label, tokens, index, stream))
            stream += 1
        blocks.append(planned)
    return blocks


@dataclass(frozen=True)
class SessionScript:
    """A synthetic multi-turn session: turn 1 = context + question; later turns = a new user message each."""

    context_label: str
    context_tokens: int
    user_messages: tuple[str, ...]  # one per turn; the first already contains the context


def session_script(
    codec: Codec, context: tuple[str, int], turns: int, user_tokens: int, seed: int, stream: int
) -> SessionScript:
    label, tokens = context
    document = document_text(codec, tokens, seed, stream, 0)
    messages = [f"Read this document.\n\n{document}\n\nQuestion 1: what is its main point?"]
    for turn in range(2, turns + 1):
        follow_up = document_text(codec, user_tokens, seed, stream, turn)
        messages.append(f"Question {turn}: relate this passage to the document.\n\n{follow_up}")
    return SessionScript(label, tokens, tuple(messages))
