"""Prompt chunk keys for cache-aware placement, and the bounded per-replica memory of keys recently sent there.

Keys are kvshare.keys chunk keys, so they follow the same prefix chain as the pool's:
- token-id prompts: chunk_keys over the ids in chunks of `prefix_chunk_tokens`;
- text prompts: the UTF-8 bytes cut into fixed pieces of `prefix_chunk_bytes`, each byte hashed as one "token".
The two forms hash under different router namespaces, so a text prompt never matches an id prompt. Only full
chunks have keys: a prompt shorter than one chunk has none and gives every replica a 0 match.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvshare.keys import chunk_keys, fingerprint
from kvshare.router.request import RequestInfo

_TOKENS_NAMESPACE = bytes.fromhex(fingerprint("kvshare/router/prefix/token-ids/v1"))
_BYTES_NAMESPACE = bytes.fromhex(fingerprint("kvshare/router/prefix/utf8-bytes/v1"))


def prompt_keys(request: RequestInfo, chunk_tokens: int, chunk_bytes: int) -> list[bytes]:
    if request.prompt_ids is not None:
        return chunk_keys(_TOKENS_NAMESPACE, request.prompt_ids, chunk_tokens)
    return chunk_keys(_BYTES_NAMESPACE, np.frombuffer(request.prompt_text, dtype=np.uint8), chunk_bytes)


class PrefixMemory:
    """Chunk keys recently sent to one replica, least recently used first; at most `capacity` keys.

    A chain key stands for its whole prefix, so the longest cached prefix of a prompt is the deepest of its keys
    still remembered (a parent evicted before its child does not shorten the match)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def matched_chunks(self, keys: list[bytes]) -> int:
        for depth in range(len(keys), 0, -1):
            if keys[depth - 1] in self._keys:
                return depth
        return 0

    def remember(self, keys: list[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)
