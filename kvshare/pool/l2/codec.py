"""Redis key names and the L2 value format: a 4-byte header length, a msgspec header, then the chunk's raw bytes.

Key: `kvshare:v1:<namespace hex>:{<chunk key hex>}`. The namespace in the name keeps tenants and models apart (and
lets an operator SCAN one namespace away); the braces are a cluster hash tag on the chunk key, so everything stored
for one chunk lands in one slot while different chunks spread over every master.

A value is self-describing and verified on every read: the header repeats key, namespace, parent, tokens and nbytes,
and carries the chunk checksum of the bytes (`kvshare.checksum`, the one COMMIT carries: a promoted chunk is
committed with it and replicas verify their loads against it). decode_verified() rejects anything that does not
match what the reader asked for, so a corrupted, truncated, foreign or colliding value is a miss, never wrong KV.
"""

from __future__ import annotations

import struct

import msgspec

from kvshare.checksum import checksum as chunk_checksum

VERSION = 1
_LENGTH = struct.Struct("<I")


class Header(msgspec.Struct, frozen=True, array_like=True):
    version: int
    namespace: bytes
    key: bytes
    parent: bytes
    tokens: bytes  # little-endian uint32 token ids, as the pool's index keeps them
    nbytes: int
    checksum: int  # kvshare.checksum of the payload


class Rejected(Exception):
    """An L2 value that must not be promoted; the message says which check failed."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header)


def redis_key(namespace: bytes, key: bytes) -> str:
    return f"kvshare:v1:{namespace.hex()}:{{{key.hex()}}}"


def encode(header: Header, payload) -> bytes:
    return encode_parts(header, [payload])


def encode_parts(header: Header, parts) -> bytes:
    """The value: header length, header, then the payload given as consecutive buffers (joined in one copy)."""
    head = _encoder.encode(header)
    return b"".join([_LENGTH.pack(len(head)), head, *parts])


def payload_offset(head: bytes) -> int:
    """Where the payload starts in a value whose first bytes are `head` (0 if too short to tell)."""
    return _LENGTH.size + _LENGTH.unpack_from(head)[0] if len(head) >= _LENGTH.size else 0


def decode_verified(
    value: bytes, namespace: bytes, key: bytes, parent: bytes, tokens: bytes,
) -> tuple[Header, memoryview]:
    """(header, payload) of a value that is exactly the chunk asked for, intact; raises Rejected otherwise."""
    view = memoryview(value)
    try:
        (length,) = _LENGTH.unpack_from(view)
        header = _decoder.decode(view[_LENGTH.size : _LENGTH.size + length])
    except (struct.error, msgspec.DecodeError) as error:
        raise Rejected(f"undecodable header: {error}") from None
    payload = view[_LENGTH.size + length :]
    if header.version != VERSION:
        raise Rejected(f"value format {header.version}, expected {VERSION}")
    if header.key != key or header.namespace != namespace:
        raise Rejected("key or namespace differs from the Redis key name")
    if header.parent != parent or header.tokens != tokens:
        raise Rejected("parent or tokens differ from the LOOKUP's (a collision or a foreign value)")
    if header.nbytes != len(payload) or header.nbytes <= 0:
        raise Rejected(f"{len(payload)} payload bytes, header says {header.nbytes}")
    if chunk_checksum(payload) != header.checksum:
        raise Rejected("checksum mismatch: the bytes were corrupted")
    return header, payload
