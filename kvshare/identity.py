"""Model identity: the fingerprint that decides which replicas may share KV (I9).

Two replicas may share a chunk only if they compute the same KV from the same token ids, so the fingerprint covers
what decides that: the model's config and the bytes of its weights, not only their names and shapes (two fine-tunes
of one architecture have the same config and the same safetensors headers). How the weights are identified depends
on who reads them:

- kvshare reads them (`kvshare serve`): `TensorDigests` hashes every tensor's name, dtype, shape and raw bytes as the
  loader reads it on the host (no second pass over the files), and lists them in sorted name order.
- another engine reads them (vLLM): `checkpoint_digest` hashes the checkpoint's weight files once per process; a
  Hugging Face cache snapshot names each file by its content hash, which then stands for the bytes without reading.
- seeded random ("dummy") weights: `generator_identity` names what decides the numbers a seeded generator draws.

An explicit model id (a repository revision, a release name) is added to the fingerprint, never used instead of it.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
import xxhash

from kvshare.keys import fingerprint

IDENTITY_TAG = "kvshare/model-identity/v2"  # v1 hashed shard names, sizes and headers only
HASH_THREADS = min(8, os.cpu_count() or 1)  # xxh3 runs ~15 GB/s a thread and releases the GIL
PIECE_BYTES = 64 << 20  # a file is hashed in pieces of this size, in parallel; the digest does not depend on threads
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # every weight format vLLM reads from a folder
_HUB_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git blob sha1 (small files) or sha256 (LFS files)


def model_fingerprint(config_bytes: bytes, weights: str, model_id: str = "") -> str:
    """The model identity: config.json's bytes, a weights identity (one of the three above) and the optional id."""
    return fingerprint(IDENTITY_TAG, config_bytes, weights, model_id)


# --- weights read by kvshare -----------------------------------------------------------------------------------------
def tensor_digest(tensor: torch.Tensor) -> bytes:
    """xxh3-128 of a host tensor's raw bytes (in its own dtype, row-major)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # (numel * itemsize,) bytes
    return xxhash.xxh3_128_digest(raw.numpy())


class TensorDigests:
    """Per-tensor digests computed on background threads while the caller reads the next tensor.

    Invariants: the digest depends only on the set of (name, dtype, shape, bytes) added, never on the order of adds
    (names are sorted) or on the thread count; a later add of a name replaces the earlier one, as a later tensor
    replaces an earlier one in a state dict. At most 2 x threads tensors wait for their hash: the reader then waits,
    so host memory held for hashing stays bounded whatever the model's size. Use as a context manager."""

    def __init__(self, threads: int = HASH_THREADS):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-weights-hash")
        self._max_pending = 2 * threads
        self._pending: deque[Future] = deque()
        self._entries: dict[str, tuple[str, str, Future]] = {}  # name -> (dtype, shape, digest)

    def __enter__(self) -> "TensorDigests":
        return self

    def __exit__(self, *exc) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hash `tensor`, a host tensor exactly as read from the checkpoint (before any cast or move)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"hash {name} on the host, as read from the checkpoint (got a {tensor.device} tensor)")
        future = self._executor.submit(tensor_digest, tensor)  # the task holds the tensor until it is hashed
        self._entries[name] = (str(tensor.dtype).removeprefix("torch."), ",".join(map(str, tensor.shape)), future)
        self._pending.append(future)
        while len(self._pending) > self._max_pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        """Identity of every tensor added: waits for the hashes still running."""
        parts: list[bytes | str] = []
        for name in sorted(self._entries):  # sorted: shard and file order must not matter
            dtype, shape, digest = self._entries[name]
            parts += [name, dtype, shape, digest.result()]
        return "tensors:" + fingerprint(*parts)


# --- seeded random weights -------------------------------------------------------------------------------------------
def generator_identity(device: torch.device) -> str:
    """What decides the numbers a seeded torch generator draws on `device`, beside the seed, shapes and dtype.

    CPU (Mersenne Twister) and CUDA (Philox) give different numbers for one seed. On CUDA the launch grid of torch's
    random kernels, sized from the GPU's multiprocessor count and threads per multiprocessor, decides which number
    lands where, so two GPU models can differ too; on CPU the vector ISA torch dispatches to selects another normal
    fill. torch's version is included because any of this may change between releases."""
    version = torch.__version__.split("+")[0]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda/torch-{version}/sm{props.multi_processor_count}x{props.max_threads_per_multi_processor}"
    if device.type == "cpu":
        return f"cpu/torch-{version}/{torch.backends.cpu.get_cpu_capability()}"
    return f"{device.type}/torch-{version}"


# --- weights read by another engine ----------------------------------------------------------------------------------
def weight_files(path: Path) -> list[Path]:
    """The files an engine may read weights from: `path` itself if it is a file (GGUF), else the folder's top-level
    files with a weight suffix, sorted by name. Sub-folders are not included."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def checkpoint_location(model: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """Where an engine given `model` read the weights: `model` itself if it is a local path, else the Hugging Face
    cache snapshot of that repository at `revision` (found offline: the engine downloaded it before loading); None if
    neither."""
    if Path(model).exists():
        return Path(model)
    from huggingface_hub import snapshot_download  # here: `kvshare serve` never needs the hub client
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError):
        return None


def hub_blob_name(path: Path) -> str | None:
    """The content hash a Hugging Face cache snapshot names `path` by, or None if `path` is not such a file.

    The hub cache stores each file once as blobs/<hash> (an LFS file's sha256, a small file's git blob sha1) and links
    snapshots/<commit>/<name> to it, so the name identifies the bytes without reading them."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    in_hub_cache = target.parent.name == "blobs" and target.parent.parent.name.startswith("models--")
    return target.name if in_hub_cache and _HUB_BLOB.fullmatch(target.name) else None


def _piece_digest(view: memoryview, start: int) -> bytes:
    return xxhash.xxh3_128_digest(view[start : start + PIECE_BYTES])


def file_digest(path: Path, executor: ThreadPoolExecutor) -> str:
    """`blob:<hash>` for a hub cache file, else xxh3-128 over the size and the digests of its PIECE_BYTES pieces,
    hashed on `executor`'s threads straight from a read-only mapping (no copy)."""
    blob = hub_blob_name(path)
    if blob is not None:
        return f"blob:{blob}"
    size = path.stat().st_size
    if size == 0:
        return fingerprint("0")
    pieces: list[Future] = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            pieces = [executor.submit(_piece_digest, view, start) for start in range(0, size, PIECE_BYTES)]
        finally:
            wait(pieces)  # no thread may still read the mapping when it closes
            view.release()
    return "xxh3:" + fingerprint(str(size), *[piece.result() for piece in pieces])


def checkpoint_digest(path: str | Path, threads: int = HASH_THREADS) -> str:
    """Identity of the weight files at `path` (see weight_files): each file's name and file_digest. Computed once per
    process for a given set of files (name, size, mtime, inode): a connector's two halves in one process hash once."""
    path = Path(path).resolve()
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {path}")
    signature = tuple((f.name, *_stat_key(f)) for f in files)
    return _checkpoint_digest(path, signature, threads)


def _stat_key(path: Path) -> tuple[int, int, int]:
    stat = path.stat()  # follows a hub snapshot's link to its blob
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


@functools.lru_cache(maxsize=8)
def _checkpoint_digest(path: Path, signature: tuple, threads: int) -> str:
    return files_digest(weight_files(path), threads)


def files_digest(files: list[Path], threads: int = HASH_THREADS) -> str:
    """Identity of `files` in the order given: each one's name and file_digest (uncached)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="kvshare-weights-hash") as executor:
        parts = [part for f in files for part in (f.name, file_digest(f, executor))]
    return "files:" + fingerprint(*parts)
