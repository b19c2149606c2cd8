"""Incremental detokenization for streaming: generated token ids in, text deltas out, safe for byte-level BPE.

Invariants:
- The concatenation of every delta returned by `add` and `finish` equals the final text: decode(all accepted ids),
  cut before the first stop string when one occurs.
- A delta never ends inside a multi-byte character: a byte-level BPE token can hold part of a UTF-8 sequence, which
  decodes to a trailing U+FFFD until the rest arrives, so trailing U+FFFD is held back (and flushed by `finish`,
  where it is a real replacement character).
- While stop strings are set, text that could still be the start of one is held back, so a stop string never leaks
  out in pieces.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Decodes all generated ids at each step and returns the new, stable part of the text."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._sent = ""  # text already returned
        self.stopped = False  # a stop string was found; the text is final

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text that became stable (possibly "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids).rstrip(REPLACEMENT)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        return self._advance(text[: len(text) - self._stop_prefix_len(text)])

    def finish(self) -> str:
        """The rest of the text (held-back partial characters or stop-string prefixes); call once at the end."""
        if self.stopped or not self._ids:
            return ""
        return self._advance(self._decode(self._ids))

    @property
    def text(self) -> str:
        return self._sent

    def _advance(self, stable: str) -> str:
        # Decoding is prefix-stable for byte-level BPE once trailing U+FFFD is dropped; if a tokenizer ever rewrote
        # earlier text, the sent text cannot be taken back, so only genuinely new characters go out.
        if len(stable) <= len(self._sent) or not stable.startswith(self._sent):
            return ""
        delta = stable[len(self._sent):]
        self._sent = stable
        return delta

    def _first_stop(self, text: str) -> int | None:
        # Only the part that may contain a new match is searched: a stop string ending in the unsent text.
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, len(self._sent) - longest + 1)
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
