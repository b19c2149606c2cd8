"""Workloads: length parsing, the OFF-ON-ON-OFF schedule, unique and exact-length documents."""

import pytest

from kvshare.bench.workload import block_schedule, document_ids, parse_lengths, session_script


class LetterCodec:
    """A real (if simple) codec: one token per character. Enough to test lengths and uniqueness."""

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_parse_lengths():
    assert parse_lengths("1k, 2k,512") == [("1k", 1024), ("2k", 2048), ("512", 512)]
    with pytest.raises(ValueError, match="cannot read length"):
        parse_lengths("1k,lots")
    with pytest.raises(ValueError):
        parse_lengths("")


def test_schedule_is_off_on_on_off_with_every_length_per_block_and_unique_streams():
    blocks = block_schedule([("1k", 1024), ("2k", 2048)], per_block=3, seed=1)
    assert [(b[0].block, b[0].arm) for b in blocks] == [("OFF1", "OFF"), ("ON1", "ON"), ("ON2", "ON"), ("OFF2", "OFF")]
    for block in blocks:
        assert sorted(p.length_label for p in block) == ["1k"] * 3 + ["2k"] * 3
    streams = [p.stream for b in blocks for p in b]
    assert len(set(streams)) == len(streams)
    orders = [[p.length_label for p in b] for b in blocks]
    assert len({tuple(o) for o in orders}) > 1  # interleaved in a seeded random order, not one fixed order
    assert blocks == block_schedule([("1k", 1024), ("2k", 2048)], per_block=3, seed=1)


def test_documents_are_exact_length_deterministic_and_unique():
    codec = LetterCodec()
    a = document_ids(codec, 500, 0, 1)
    assert len(a) == 500 and a == document_ids(codec, 500, 0, 1)
    assert a[:64] != document_ids(codec, 500, 0, 2)[:64]
    assert a[:64] != document_ids(codec, 500, 1, 1)[:64]


def test_session_script_has_one_message_per_turn_with_the_context_first():
    script = session_script(LetterCodec(), ("1k", 1024), turns=6, user_tokens=100, seed=0, stream=3)
    assert len(script.user_messages) == 6
    assert len(script.user_messages[0]) > 1024 > len(script.user_messages[1]) > 100
