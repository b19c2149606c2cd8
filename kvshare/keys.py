"""Every key kvshare makes: the pool's namespace and chunk keys (a seedless xxh3-128 prefix chain over token ids,
identical in every process and host), the reference engine's local prefix-cache block hashes, and the keys kvshare's
own tools (checks, benchmarks, fault injection) store under. Nothing else in kvshare builds a key.

Invariants:
- A key depends only on its inputs' bytes (never on Python's `hash()`, PYTHONHASHSEED, the host or the process).
- chunk_key(i) = H(chunk_key(i-1) or namespace key, token ids of chunk i as little-endian uint32), so equal keys
  mean equal namespaces and equal whole prefixes (up to a 128-bit collision, which the pool rules out by comparing
  the stored tokens on every hit).
- A prompt is stored and looked up as its full chunks and at most one partial tail (whole engine blocks past the
  last full chunk): n // chunk_tokens + 1 keys at most. A tail's key is tagged apart and carries its token count, so
  it is never computed as a full chunk's key is, and the pool compares the stored tokens (of another length) on
  every hit: a tail never answers for a full chunk, nor for a tail of another length.
- A hybrid model's chunk carries the linear layers' state at its last token as an object of its own, keyed
  xxh3-128(state tag || chunk key) and stored right after its chunk in one chain (`with_states`): chunk 0, its state,
  chunk 1, its state, ... Each object's parent is the one before it, so the pool's prefix verification covers the
  pairs as it covers chunks, and the longest verified prefix always ends on a chunk whose state is there or just
  before it (the state is what a hit needs: a chunk without its state is never a hit).
- Tools' namespaces and keys are tagged apart from model namespaces, so they can never equal a replica's.
"""

from __future__ import annotations

import array
import functools
import json
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import xxhash

KEY_BYTES = 16
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)  # "I" wherever C's int is 32 bits
_NAMESPACE_TAG = b"kvshare/namespace/v1\0"


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two replicas to share KV bytes."""

    model_fingerprint: str  # hash of the model's config and weights identity
    dtype: str  # e.g. "bfloat16"
    layout_id: str  # KVLayout.layout_id(): shapes, strides and block size of the engine's KV cache
    chunk_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""  # optional tenant salt: different salts never share

    def __post_init__(self):
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")

    @classmethod
    def of_replica(cls, model_fingerprint: str, dtype: str, layout_id: str, block_size: int,
                   chunk_tokens: int) -> "Namespace":
        """A replica's namespace (both engines build theirs here). A chunk is whole KV blocks: chunk_tokens must be
        a multiple of the engine's block size."""
        if chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of the KV block size {block_size}")
        return cls(model_fingerprint, dtype, layout_id, chunk_tokens)

    @functools.cached_property  # computed once per instance (frozen, so it never goes stale)
    def key(self) -> bytes:
        """The 16-byte namespace key: xxh3-128 of the canonical JSON of every field."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return xxhash.xxh3_128_digest(_NAMESPACE_TAG + canonical)

    def describe(self) -> str:
        return f"{self.model_fingerprint[:12]}/{self.dtype}/{self.layout_id[:12]}/c{self.chunk_tokens}" + (
            f"/tp{self.tp_rank}of{self.tp_size}" if self.tp_size > 1 else ""
        ) + ("/salted" if self.salt else "")


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes: the form that is hashed and that the pool stores for verification.

    A list or tuple goes through the standard library's array (1 ms for a 128k prompt's ids, numpy's conversion 2 ms:
    a pool hit's admission converts its prompt twice), which refuses ids outside [0, 2**32) and non-integers."""
    if isinstance(token_ids, np.ndarray):
        if not np.issubdtype(token_ids.dtype, np.integer) or (
                token_ids.size and (token_ids.min() < 0 or token_ids.max() >= 2**32)):
            raise ValueError("token ids must be integers in [0, 2**32)")
        return token_ids.astype("<u4").tobytes()
    try:
        ids = array.array(_UINT32, token_ids)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def chunk_keys(namespace_key: bytes, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int) -> list[bytes]:
    """Keys of every full chunk of `token_ids`, in prefix order."""
    return _chained_keys(namespace_key, token_bytes(token_ids), chunk_tokens)


def _chained_keys(namespace_key: bytes, data: bytes, chunk_tokens: int) -> list[bytes]:
    """chunk_keys of token ids already in token_bytes form."""
    step = chunk_tokens * 4
    keys: list[bytes] = []
    parent = namespace_key
    for start in range(0, len(data) - step + 1, step):
        parent = xxhash.xxh3_128_digest(parent + data[start : start + step])
        keys.append(parent)
    return keys


_TAIL_TAG = b"kvshare/tail/v1\0"


def tail_key(parent: bytes, tail_tokens: bytes) -> bytes:
    """The key of a partial last chunk: xxh3-128(tag || parent key || token count || token ids as uint32)."""
    return xxhash.xxh3_128_digest(_TAIL_TAG + parent + (len(tail_tokens) // 4).to_bytes(4, "little") + tail_tokens)


@dataclass(frozen=True)
class PromptChunks:
    """A prompt's chunks in prefix order: chunk i covers tokens [i * chunk_tokens, i * chunk_tokens + counts[i]).
    Every count is chunk_tokens except perhaps the last (the tail), a whole number of blocks below chunk_tokens."""

    chunk_tokens: int
    keys: list[bytes]
    parents: list[bytes]  # keys[i - 1], the namespace key for i = 0
    tokens: list[bytes]  # each chunk's token ids as little-endian uint32: what the pool stores and compares
    counts: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def end(self, n: int | None = None) -> int:
        """Tokens covered by the first n chunks (all of them by default); a state entry (with_states) covers none."""
        return sum(self.counts[:n])

    def first(self, n: int) -> PromptChunks:
        """The first n chunks."""
        return PromptChunks(self.chunk_tokens, self.keys[:n], self.parents[:n], self.tokens[:n], self.counts[:n])


def prompt_chunks(namespace_key: bytes, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
                  tail_block_tokens: int = 0) -> PromptChunks:
    """The full chunks of `token_ids` and, when tail_block_tokens (the engine's block size) is given, a tail of the
    whole blocks after them, if there is one: what a prompt is stored and looked up as (see the module docstring)."""
    full = len(token_ids) // chunk_tokens * chunk_tokens
    tail = (len(token_ids) - full) // tail_block_tokens * tail_block_tokens if tail_block_tokens else 0
    data = token_bytes(token_ids[: full + tail])  # once, for the keys and the tokens the pool compares
    keys = _chained_keys(namespace_key, data[: full * 4], chunk_tokens)
    step = 4 * chunk_tokens
    tokens = [data[i * step : (i + 1) * step] for i in range(len(keys))]
    parents = [namespace_key, *keys]
    counts = [chunk_tokens] * len(keys)
    if tail:
        tokens.append(data[full * 4 :])
        keys.append(tail_key(parents[-1], tokens[-1]))
        counts.append(tail)
    return PromptChunks(chunk_tokens, keys, parents[: len(keys)], tokens, counts)


_STATE_TAG = b"kvshare/state/v1\0"


def state_key(chunk_key: bytes) -> bytes:
    """The key of the linear-attention state at a chunk's last token (hybrid models)."""
    return xxhash.xxh3_128_digest(_STATE_TAG + chunk_key)


def with_states(chunks: PromptChunks) -> PromptChunks:
    """The chain a hybrid model stores and looks up: each chunk followed by its state (no tokens of its own), each
    entry's parent the entry before it. `end(n)` still counts the tokens the first n entries cover."""
    keys, parents, tokens, counts = [], [], [], []
    parent = chunks.parents[0] if chunks.keys else b""
    for key, data, count in zip(chunks.keys, chunks.tokens, chunks.counts):
        state = state_key(key)
        keys += (key, state)
        parents += (parent, key)
        tokens += (data, b"")
        counts += (count, 0)
        parent = state
    return PromptChunks(chunks.chunk_tokens, keys, parents, tokens, counts)


def fingerprint(*parts: bytes | str) -> str:
    """Hex xxh3-128 of the given parts, length-prefixed so that ("ab", "c") != ("a", "bc")."""
    h = xxhash.xxh3_128()
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        h.update(len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


# ---- the reference engine's local prefix cache ----------------------------------------------------------------

_SALT_TAG = b"kvshare/salt\0"


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A full block's hash in the local prefix cache: xxh3-64(parent block's hash || its token ids as uint32). A hit
    is confirmed by comparing the stored token ids, so a collision cannot serve wrong K/V."""
    prefix = b"" if parent is None else parent.to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(prefix + token_bytes(list(token_ids)))


def block_hashes(parent: int | None, token_ids: Sequence[int], block_size: int) -> list[int]:
    """block_hash of each full block of token_ids in turn, chained from `parent` (the hash before the first block):
    the same values as calling block_hash block by block, with the ids converted to bytes once (a 128k-token prompt:
    8,192 blocks)."""
    data, step, hashes = token_bytes(token_ids), 4 * block_size, []
    for offset in range(0, len(data) - step + 1, step):
        prefix = b"" if parent is None else parent.to_bytes(8, "little")
        parent = xxhash.xxh3_64_intdigest(prefix + data[offset : offset + step])
        hashes.append(parent)
    return hashes


def block_chain_root(salt: str) -> int | None:
    """The parent of a sequence's first block: tenants with different cache salts never share local blocks either
    (a shared block would leak, through timing, that another tenant sent the same prefix)."""
    return None if not salt else xxhash.xxh3_64_intdigest(_SALT_TAG + salt.encode())


# ---- kvshare's own tools --------------------------------------------------------------------------------------

_TOOL_TAG = b"kvshare/tool/"


def tool_namespace(name: str) -> bytes:
    """The namespace key a tool (pool check, benchmark, fault injector) stores under: never a replica's."""
    return xxhash.xxh3_128_digest(_TOOL_TAG + name.encode())


def synthetic_keys(tag: bytes | str, count: int) -> list[bytes]:
    """`count` distinct 16-byte chunk keys for a tool's chunks; a fresh `tag` gives fresh keys."""
    raw = tag.encode() if isinstance(tag, str) else tag
    return [xxhash.xxh3_128_digest(_TOOL_TAG + raw + b"\0" + i.to_bytes(8, "little")) for i in range(count)]
