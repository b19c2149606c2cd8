"""Chunk keys are identical in every process, whatever PYTHONHASHSEED (kvshare.keys)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvshare.keys import Namespace, chunk_keys, token_bytes

SCRIPT = """
from kvshare.keys import Namespace, chunk_keys
ns = Namespace("model-abc", "bfloat16", "layout-1", chunk_tokens=4, salt="tenant")
keys = chunk_keys(ns.key, list(range(1000, 1010)), 4)
print(ns.key.hex(), *[k.hex() for k in keys], hash("x") % 1000)
"""


def keys_in_subprocess(seed: str) -> tuple[list[str], str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    *keys, python_hash = out.split()
    return keys, python_hash


def test_keys_match_across_processes_and_hash_seeds():
    results = [keys_in_subprocess(seed) for seed in ("0", "1", "12345", "random")]
    assert len({python_hash for _, python_hash in results}) > 1  # the seeds really changed Python's hash()
    assert all(keys == results[0][0] for keys, _ in results)
    ns = Namespace("model-abc", "bfloat16", "layout-1", chunk_tokens=4, salt="tenant")
    assert results[0][0] == [ns.key.hex()] + [k.hex() for k in chunk_keys(ns.key, list(range(1000, 1010)), 4)]
    assert len(results[0][0]) == 1 + 2  # 10 tokens at 4 per chunk: only the 2 full chunks get keys


def test_keys_change_with_any_namespace_field_or_token():
    base = Namespace("m", "bfloat16", "l")
    variants = [Namespace("m2", "bfloat16", "l"), Namespace("m", "float16", "l"), Namespace("m", "bfloat16", "l2"),
                Namespace("m", "bfloat16", "l", chunk_tokens=128),
                Namespace("m", "bfloat16", "l", tp_rank=1, tp_size=2),
                Namespace("m", "bfloat16", "l", salt="s")]
    assert len({base.key, *(v.key for v in variants)}) == 1 + len(variants)
    a = chunk_keys(base.key, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys(base.key, [1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]


def test_token_ids_become_the_same_little_endian_bytes_from_any_container():
    ids = [0, 1, 255, 256, 65536, 2**31, 2**32 - 1]
    expected = b"".join(i.to_bytes(4, "little") for i in ids)
    assert token_bytes(ids) == token_bytes(tuple(ids)) == token_bytes(np.array(ids, dtype=np.int64)) == expected
    assert token_bytes([]) == token_bytes(np.array([], dtype=np.int64)) == b""


@pytest.mark.parametrize("bad", [[-1], [2**32], [5, 2**40], [1.5], np.array([-1]), np.array([2**32]),
                                 np.array([1.5])])
def test_token_ids_outside_uint32_are_refused_not_wrapped(bad):
    """A wrapped or truncated id would give another prompt's key."""
    with pytest.raises(ValueError, match="integers in"):
        token_bytes(bad)
