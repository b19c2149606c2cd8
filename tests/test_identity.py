"""kvshare.identity: weight files and tensors are identified by their bytes (a Hugging Face cache snapshot by its
blobs' content hashes), independently of paths, file order and thread counts; dummy weights by their generator."""

from __future__ import annotations

import hashlib
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from kvshare import identity
from kvshare.identity import TensorDigests, checkpoint_digest, generator_identity


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def folder(tmp_path):
    """A model folder: two weight shards, and files that are not weights."""
    root = tmp_path / "model"
    write(root / "model-00001-of-00002.safetensors", os.urandom(3000))
    write(root / "model-00002-of-00002.safetensors", os.urandom(5000))
    write(root / "config.json", b"{}")
    write(root / "tokenizer.json", b"{}")
    return root


def test_checkpoint_digest_is_of_the_weight_bytes_not_the_path(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "PIECE_BYTES", 1024)  # several pieces per file, hashed on several threads
    copy = shutil.copytree(folder, tmp_path / "elsewhere")
    assert checkpoint_digest(folder, threads=3) == checkpoint_digest(copy, threads=1)
    (copy / "tokenizer.json").write_bytes(b'{"other": 1}')  # not a weight file
    assert checkpoint_digest(copy) == checkpoint_digest(folder)
    shard = copy / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[4500] ^= 1  # one bit, in the last piece of the last shard; same size, same name
    shard.write_bytes(bytes(data))
    assert checkpoint_digest(copy) != checkpoint_digest(folder)


def test_checkpoint_digest_is_computed_once_per_process_while_files_are_unchanged(folder, monkeypatch):
    calls = []
    real = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda path, executor: calls.append(path.name) or real(path, executor))
    first = checkpoint_digest(folder)
    assert checkpoint_digest(folder) == first and len(calls) == 2  # the second call hashed nothing
    write(folder / "model-00001-of-00002.safetensors", os.urandom(3001))  # replaced: new size, inode, mtime
    assert checkpoint_digest(folder) != first and len(calls) == 4


def test_no_weight_files_is_an_error(tmp_path):
    write(tmp_path / "config.json", b"{}")
    with pytest.raises(FileNotFoundError, match="no weight files"):
        checkpoint_digest(tmp_path)


def hub_snapshot(cache, repo: str, commit: str, files: dict[str, bytes]):
    """A Hugging Face cache layout: blobs named by sha256, snapshots/<commit>/<name> linking to them."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = write(root / "blobs" / hashlib.sha256(data).hexdigest(), data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_hub_snapshot_is_identified_by_blob_names(tmp_path):
    weights, tuned = os.urandom(4000), os.urandom(4000)
    base = hub_snapshot(tmp_path, "org/m", "a" * 40, {"model.safetensors": weights, "config.json": b"{}"})
    same = hub_snapshot(tmp_path, "org/m", "b" * 40, {"model.safetensors": weights, "config.json": b"{ }"})
    other = hub_snapshot(tmp_path, "org/m", "c" * 40, {"model.safetensors": tuned, "config.json": b"{}"})
    assert identity.hub_blob_name(base / "model.safetensors") == hashlib.sha256(weights).hexdigest()
    assert checkpoint_digest(base) == checkpoint_digest(same) != checkpoint_digest(other)
    # A copy of the snapshot's files outside the cache is hashed by its bytes: another identity, never a false match.
    plain = tmp_path / "plain"
    write(plain / "model.safetensors", weights)
    assert identity.hub_blob_name(plain / "model.safetensors") is None
    assert checkpoint_digest(plain) != checkpoint_digest(base)


def test_a_repository_id_is_found_in_the_hub_cache_at_its_revision(tmp_path):
    old = hub_snapshot(tmp_path, "org/m", "a" * 40, {"model.safetensors": b"old weights"})
    new = hub_snapshot(tmp_path, "org/m", "b" * 40, {"model.safetensors": b"new weights"})
    write(tmp_path / "models--org--m" / "refs" / "main", b"b" * 40)  # main moved to the new commit
    assert identity.checkpoint_location("org/m", None, str(tmp_path)) == new
    assert identity.checkpoint_location("org/m", "a" * 40, str(tmp_path)) == old
    assert identity.checkpoint_location("org/other", None, str(tmp_path)) is None
    assert identity.checkpoint_location(str(old), None, None) == old  # a local path is itself


def test_tensor_digests_cover_names_dtypes_shapes_and_bytes_in_any_order():
    def digest(tensors: dict[str, torch.Tensor], order=None) -> str:
        with TensorDigests(threads=2) as digests:
            for name in order or tensors:
                digests.add(name, tensors[name])
            return digests.hexdigest()

    base = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    assert digest(base) == digest(base, order=["b", "a"])  # shard and file order never matter
    flipped = {**base, "a": base["a"].clone()}
    flipped["a"][2, 3] = 11.5
    variants = [
        flipped,
        {**base, "a": base["a"].reshape(4, 3)},  # same bytes, other shape
        {**base, "b": base["b"].view(torch.int16)},  # same bytes, other dtype
        {"c": base["a"], "b": base["b"]},  # same bytes, other name
    ]
    assert len({digest(base), *map(digest, variants)}) == 1 + len(variants)


def test_tensor_digests_take_host_tensors_only():
    with TensorDigests(threads=1) as digests, pytest.raises(ValueError, match="on the host"):
        digests.add("w", torch.empty(2, device="meta"))


def test_generator_identity_differs_by_device_type_and_gpu(monkeypatch):
    gpus = {0: SimpleNamespace(multi_processor_count=132, max_threads_per_multi_processor=2048),
            1: SimpleNamespace(multi_processor_count=108, max_threads_per_multi_processor=2048)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpus[device.index or 0])
    cpu, h, a = (generator_identity(torch.device(d)) for d in ("cpu", "cuda:0", "cuda:1"))
    assert len({cpu, h, a}) == 3 and cpu.startswith("cpu/") and h.startswith("cuda/")
