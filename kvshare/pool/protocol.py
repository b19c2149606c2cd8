"""The control-plane wire format: typed msgspec messages in length-prefixed msgpack frames.

A frame is a 4-byte little-endian body length followed by a msgpack body. Each request gets exactly one reply, in
order, on the same connection. Requests and replies are tagged unions (the tag is the class name), so a frame can
only decode into one of the types below; anything else is a "malformed" error reply, never a crash.
"""

from __future__ import annotations

import struct
from itertools import accumulate
from typing import Union

import msgspec
import numpy as np

from kvshare.pool.stats import PoolStats

HEADER = struct.Struct("<I")
# 2: LOOKUP replies carry flat little-endian arrays (LookupReply) instead of a list of ChunkRef structs.
PROTOCOL_VERSION = 2


class ErrorCode:
    """The `code` of an Error reply. Clients branch on these, never on message text."""

    MALFORMED = "malformed"  # the frame did not decode into a request
    TOO_LARGE = "too_large"  # frame over the server's limit; the server closes that connection
    AUTH = "auth"  # missing or wrong token over TCP; the server closes that connection
    BAD_REQUEST = "bad_request"  # decoded, but the values make no sense (lengths differ, nbytes <= 0, ...)
    UNKNOWN_NAMESPACE = "unknown_namespace"
    UNKNOWN_LEASE = "unknown_lease"  # never existed, already ended, or owned by another connection
    LEASE_EXPIRED = "lease_expired"  # COMMIT of a lease fenced after its deadline or connection: nothing published
    NO_SPACE = "no_space"  # RESERVE could not find enough unleased pages, even after eviction
    LEASE_LIMIT = "lease_limit"  # RESERVE would take the client past its leased-pages limit (LOOKUP shortens instead)
    INTEGRITY = "integrity"  # debug check failed after a request: a server bug
    INTERNAL = "internal"
    VERSION = "version"  # ATTACH from a client speaking another PROTOCOL_VERSION (connect fails with this code)
    BUSY = "busy"  # the pool has --max-connections connections; the server closes this one
    LIMIT = "limit"  # a request over a --max-* limit (keys per request, description, namespaces)


# ---- requests ------------------------------------------------------------------------------------------------


class Request(msgspec.Struct, tag=True, frozen=True):
    pass


class Attach(Request):
    """First message of a connection: returns where the arena is. Over TCP it must carry the shared token."""

    token: str = ""
    pid: int = 0
    version: int = 1  # PROTOCOL_VERSION of the client (clients before version 2 did not send it)


class Hello(Request):
    namespace: bytes
    description: str = ""


class NewChunk(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: bytes
    parent: bytes  # the previous chunk's key, or the namespace key for the first chunk
    tokens: bytes  # the chunk's token ids as little-endian uint32 (kvshare.keys.token_bytes)
    nbytes: int


class Lookup(Request):
    """`tokens` is every chunk's expected token bytes concatenated, `token_lengths` their sizes: one 1 MiB blob
    encodes and decodes as a single copy, where 1,024 small byte strings cost a millisecond more."""

    namespace: bytes
    keys: list[bytes]
    # Decoded as a view into the server's receive buffer (no 1 MiB copy): valid only while that request is handled.
    # Senders may pass bytes.
    tokens: memoryview
    token_lengths: list[int]
    # With --l2: may the pool promote L2 hits past L1's prefix before it answers? False answers from L1 alone, so a
    # replica can decide per request whether promotion beats recompute (then LOOKUP again with True).
    promote: bool = True

    @classmethod
    def of(cls, namespace: bytes, keys: list[bytes], tokens: list[bytes], promote: bool = True) -> "Lookup":
        return cls(namespace, keys, b"".join(tokens), list(map(len, tokens)), promote)  # type: ignore[arg-type]

    def check_lengths(self) -> None:
        """Raise ValueError unless token_lengths are non-negative, one per key, and add up to len(tokens)."""
        if len(self.token_lengths) != len(self.keys):
            raise ValueError(f"{len(self.keys)} keys but {len(self.token_lengths)} token lengths")
        if sum(self.token_lengths) != len(self.tokens) or min(self.token_lengths, default=0) < 0:
            raise ValueError(f"token_lengths add up to {sum(self.token_lengths)}, tokens has {len(self.tokens)} bytes")


class Reserve(Request):
    namespace: bytes
    chunks: list[NewChunk]
    evict: bool = True  # False: free pages only, never drop a committed chunk (a check of a live pool)


class Commit(Request):
    lease: int
    checksums: list[int]  # xxh3-64 of each reserved chunk's bytes, in order


class Release(Request):
    lease: int


class Discard(Request):
    """Remove these committed chunks: the sender read one and its bytes did not match its checksum (I11)."""

    namespace: bytes
    keys: list[bytes]


class Stats(Request):
    pass


class Clear(Request):
    pass


class Health(Request):
    deep: bool = False  # also run check_integrity() on the server


AnyRequest = Union[Attach, Hello, Lookup, Reserve, Commit, Release, Discard, Stats, Clear, Health]

# ---- replies -------------------------------------------------------------------------------------------------


class Reply(msgspec.Struct, tag=True, frozen=True):
    pass


class ChunkRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: bytes
    pages: list[int]  # arena page indices, in the chunk's byte order (byte i lives in pages[i // page_size])
    nbytes: int
    checksum: int = 0  # 0 in a reservation (not written yet)


class ArenaInfo(Reply):
    path: str
    page_size: int
    num_pages: int
    pages_prepared: int
    instance: str = ""  # random per server life: a restarted pool reuses page numbers for other bytes


class Ok(Reply):
    count: int = 0  # CLEAR, DISCARD: chunks removed


# One LookupReply record per chunk found: nbytes, checksum, page count (little-endian uint64, uint64, uint32).
CHUNK_RECORD = struct.Struct("<QQI")
_RECORD_DTYPE = np.dtype([("nbytes", "<u8"), ("checksum", "<u8"), ("pages", "<u4")])
PAGE_INDEX = np.dtype("<u4")


class LookupReply(Reply):
    """The hit of a LOOKUP: the first `len(records) // CHUNK_RECORD.size` requested keys, as flat arrays.

    1,024 ChunkRef structs with page lists cost ~0.3 ms to encode and decode (much more at many pages a chunk);
    two byte strings cost ~nothing, and the server keeps each chunk's record and page bytes ready (index.Entry).
    The keys are not repeated: they are the request's. refs() turns the arrays back into ChunkRefs."""

    lease: int  # 0 when nothing was found (no lease is held)
    records: bytes = b""  # CHUNK_RECORD per chunk found, in prefix order
    pages: bytes = b""  # every found chunk's page indices (PAGE_INDEX), concatenated in prefix order

    @property
    def num_chunks(self) -> int:
        return len(self.records) // CHUNK_RECORD.size

    def refs(self, keys: list[bytes]) -> list[ChunkRef]:
        """ChunkRefs of the chunks found, given the LOOKUP's keys; ValueError if the arrays do not fit together."""
        n = self.num_chunks
        if len(self.records) % CHUNK_RECORD.size or n > len(keys) or len(self.pages) % PAGE_INDEX.itemsize:
            raise ValueError(f"LOOKUP reply of {len(self.records)} record bytes for {len(keys)} keys is malformed")
        records = np.frombuffer(self.records, _RECORD_DTYPE)
        counts = records["pages"].tolist()
        pages = np.frombuffer(self.pages, PAGE_INDEX)
        if sum(counts) != len(pages):
            raise ValueError(f"LOOKUP reply lists {len(pages)} pages, its records count {sum(counts)}")
        if n and counts.count(counts[0]) == n:  # the usual case, every chunk the same size: lists made in C
            page_lists = pages.reshape(n, counts[0]).tolist()
        else:
            flat = pages.tolist()
            page_lists = [flat[end - c : end] for c, end in zip(counts, accumulate(counts))]
        return list(map(ChunkRef, keys[:n], page_lists, records["nbytes"].tolist(), records["checksum"].tolist()))


class ReserveReply(Reply):
    lease: int  # 0 when every chunk was skipped
    chunks: list[Union[ChunkRef, None]]  # None: already committed or being written by someone: do not write it


class StatsReply(Reply):
    stats: PoolStats


class HealthReply(Reply):
    ok: bool
    detail: str = ""


class Error(Reply):
    code: str
    message: str


AnyReply = Union[ArenaInfo, Ok, LookupReply, ReserveReply, StatsReply, HealthReply, Error]

request_decoder = msgspec.msgpack.Decoder(AnyRequest)
reply_decoder = msgspec.msgpack.Decoder(AnyReply)


# ---- the server's decoding: list fields counted before they are decoded ---------------------------------------
#
# A LOOKUP of 3.4M keys is a 54 MB frame that decodes into millions of objects (and seconds of the loop). The server
# decodes requests in two steps: the variants below take each per-key list as raw msgpack (zero copy), the server
# reads the list's length from its header and refuses it over --max-keys, and only then decodes its items. Same
# tags and field names as the requests above: the wire format is theirs.


class LimitExceeded(ValueError):
    """A request over one of the server's --max-* limits (an Error reply with ErrorCode.LIMIT)."""


class _RawLookup(Request, tag="Lookup"):
    namespace: bytes
    keys: msgspec.Raw
    tokens: memoryview
    token_lengths: msgspec.Raw
    promote: bool = True


class _RawReserve(Request, tag="Reserve"):
    namespace: bytes
    chunks: msgspec.Raw
    evict: bool = True


class _RawCommit(Request, tag="Commit"):
    lease: int
    checksums: msgspec.Raw


class _RawDiscard(Request, tag="Discard"):
    namespace: bytes
    keys: msgspec.Raw


_server_decoder = msgspec.msgpack.Decoder(
    Union[Attach, Hello, _RawLookup, _RawReserve, _RawCommit, Release, _RawDiscard, Stats, Clear, Health])
_keys = msgspec.msgpack.Decoder(list[bytes])
_ints = msgspec.msgpack.Decoder(list[int])
_chunks = msgspec.msgpack.Decoder(list[NewChunk])


def decode_request(body: bytes | memoryview, max_keys: int) -> Request:
    """A request from a frame's body, refusing (LimitExceeded) any per-key list longer than `max_keys` before its
    items are decoded; msgspec.DecodeError if the body is not a request. Lookup.tokens stays a view into `body`."""
    request = _server_decoder.decode(body)
    match request:
        case _RawLookup(namespace, keys, tokens, lengths, promote):
            return Lookup(namespace, _bounded(_keys, keys, max_keys, "LOOKUP keys"), tokens,
                          _bounded(_ints, lengths, max_keys, "LOOKUP token_lengths"), promote)
        case _RawReserve(namespace, chunks, evict):
            return Reserve(namespace, _bounded(_chunks, chunks, max_keys, "RESERVE chunks"), evict)
        case _RawCommit(lease, checksums):
            return Commit(lease, _bounded(_ints, checksums, max_keys, "COMMIT checksums"))
        case _RawDiscard(namespace, keys):
            return Discard(namespace, _bounded(_keys, keys, max_keys, "DISCARD keys"))
    return request


def _bounded(decoder: msgspec.msgpack.Decoder, raw: msgspec.Raw, limit: int, what: str) -> list:
    n = msgpack_array_length(raw)
    if n > limit:
        raise LimitExceeded(f"{what}: {n} items, over the pool's limit of {limit} (--max-keys): split the request")
    return decoder.decode(raw)


def msgpack_array_length(raw: bytes | msgspec.Raw) -> int:
    """The element count in a msgpack array's header (fixarray, array 16, array 32); DecodeError if not an array."""
    view = memoryview(raw)
    first = view[0] if len(view) else -1
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC and len(view) >= 3:
        return int.from_bytes(view[1:3], "big")
    if first == 0xDD and len(view) >= 5:
        return int.from_bytes(view[1:5], "big")
    raise msgspec.DecodeError("expected an array")
_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytearray:
    """A message as one length-prefixed frame (encoded in place after the header: no copy of a large body)."""
    buffer = bytearray(HEADER.size)
    _encoder.encode_into(message, buffer, HEADER.size)
    HEADER.pack_into(buffer, 0, len(buffer) - HEADER.size)
    return buffer
