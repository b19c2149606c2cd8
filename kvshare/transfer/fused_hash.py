"""The chunk checksum of kvshare.checksum as one fused CPU kernel, made by torch's compiler: the same bits, one pass.

Why: the numpy path makes seven passes over every word (two folds, two multiplies, a sum) and hashes ~3 GB/s on one
core; a CPU replica's verified load of 6144 tokens of the `small` model spent 37-50 ms hashing beside a 27 ms copy
(docs/results/connectors-cpu/load-verify). Here the gather of the chunk's pages, the coefficients c_i, both folds,
the multiplies and the sum are one loop that reads each word once (~2x faster on one core, and torch's intra-op
threads split it).

Invariants:
- Bits: `chunk_checksum` equals `kvshare.checksum.pages_checksum` for every chunk it accepts (`supports`); the
  tests compare them over many shapes. It reads exactly the extent: words past `nbytes` get coefficient 0.
- The kernel holds the GIL while it runs (torch's generated binding does not release it): beside a copy loop that
  needs the GIL between rows it only takes turns with it (measured: no faster than hashing after the copies). So
  callers start it once their copies are done (`start`), and it runs on one thread of its own, allowed on every CPU,
  with its own OpenMP threads (THREADS, fixed when it is compiled): a vLLM CPU worker's thread, pinned to the
  model's cores with one intra-op thread, would otherwise hash on one core.
- Mode (`KVSHARE_HOST_HASH`): "auto" (default) compiles once per process in the background when a transfer first
  asks (`prepare`); until it is ready, and for good if compiling fails (no C++ compiler), callers use the numpy
  path. "compiled" compiles on first use and raises if it cannot. "numpy" never compiles.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from kvshare import checksum
from kvshare.transfer.checksum import HASH_THREADS, _shifted_high, _signed, run_on_every_cpu

log = logging.getLogger(__name__)

MODES = ("auto", "compiled", "numpy")
_BLOCK = checksum.BLOCK_WORDS
_MIX = _signed(checksum.MIX_MULTIPLIER)  # as int64: torch multiplies int64 with wraparound, as numpy uint64
_MAX_BLOCKS = 1 << 16  # outer coefficients kept for extents of up to 16 GiB (a chunk is tens of MiB)


def mode() -> str:
    value = os.environ.get("KVSHARE_HOST_HASH", "auto")
    if value not in MODES:
        raise ValueError(f"KVSHARE_HOST_HASH must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _terms(arena: torch.Tensor, page_ids: torch.Tensor, nwords: int, inner: torch.Tensor,
           outer: torch.Tensor) -> torch.Tensor:
    """sum_i mix(w_i) * c_i (int64, wrapping) over the first `nwords` words of the extent made of `page_ids`' rows
    of `arena` (int64 [num_pages, page_words], page_words a multiple of the coefficient block). Traced by the
    compiler into one loop; written with whole coefficient blocks so that c_i = inner[r] * outer[block] needs no
    division per word."""
    pages, page_words = page_ids.shape[0], arena.shape[1]
    blocks_per_page = page_words // _BLOCK
    words = arena[page_ids].view(pages, blocks_per_page, _BLOCK)
    block = (torch.arange(pages).view(pages, 1) * blocks_per_page + torch.arange(blocks_per_page).view(1, -1))
    position = block.view(pages, blocks_per_page, 1) * _BLOCK + torch.arange(_BLOCK).view(1, 1, _BLOCK)
    c = inner.view(1, 1, _BLOCK) * outer[block].view(pages, blocks_per_page, 1)
    c = torch.where(position < nwords, c, 0)
    x = _shifted_high(words).bitwise_xor(words)  # fold
    x = x * _MIX
    x = x.bitwise_xor(_shifted_high(x))  # fold
    return (x * c).sum(dtype=torch.int64)


class _Kernel:
    """The compiled `_terms`, made at most once per process (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._fn = None
        self.failed: str | None = None
        self._inner = torch.from_numpy(checksum._A.view(np.int64))
        self._outer = torch.from_numpy(checksum._outer(np.arange(_MAX_BLOCKS)).view(np.int64))

    def ready(self) -> bool:
        return self._ready.is_set() and self._fn is not None

    def compile(self) -> None:
        """Compile and check the kernel against the numpy path on a small extent (once; later calls return)."""
        with self._lock:
            if self._ready.is_set():
                return
            started = time.perf_counter()
            try:
                # dynamic: one kernel for every chunk and arena size. cpp.threads: the OpenMP threads of each call,
                # whatever the intra-op threads of the process (vLLM's CPU worker sets one for a pinned core)
                fn = torch.compile(_terms, dynamic=True, fullgraph=True, options={"cpp.threads": HASH_THREADS})
                self._fn = fn if self._self_check(fn) else None
                if self._fn is None:
                    self.failed = "the compiled kernel's checksum differs from the numpy path's"
            except Exception as error:  # noqa: BLE001 - any compiler failure means: use numpy
                self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if self.failed:
                log.warning("kvshare: the compiled host checksum is not available (%s); using numpy", self.failed)
            else:
                log.info("kvshare: compiled host checksum ready (%.1f s)", time.perf_counter() - started)
            self._ready.set()

    def _self_check(self, fn) -> bool:
        page_words = 2 * _BLOCK
        arena = np.random.default_rng(0).integers(0, 1 << 63, size=(3, page_words), dtype=np.uint64)
        nbytes = (page_words + 5) * checksum.WORD
        got = int(fn(torch.from_numpy(arena.view(np.int64)), torch.tensor([2, 0]), nbytes // checksum.WORD,
                     self._inner, self._outer))
        expected = checksum.pages_checksum(arena.view(np.uint8), [2, 0], nbytes)
        return checksum.finish(got & checksum.MASK, nbytes) == expected

    def terms(self, arena: torch.Tensor, page_ids: Sequence[int], nwords: int) -> int:
        return int(self._fn(arena, torch.tensor(page_ids, dtype=torch.int64), nwords, self._inner, self._outer))


_kernel = _Kernel()


def prepare() -> None:
    """Make the kernel available as the mode says: "auto" starts compiling in the background (once), "compiled"
    compiles now and raises if it cannot, "numpy" does nothing."""
    chosen = mode()
    if chosen == "numpy" or _kernel._ready.is_set():
        pass
    elif chosen == "compiled":
        _kernel.compile()
    else:
        threading.Thread(target=_kernel.compile, name="kvshare-hash-compile", daemon=True).start()
    if chosen == "compiled" and not _kernel.ready():
        raise RuntimeError(f"KVSHARE_HOST_HASH=compiled, but the kernel could not be compiled: {_kernel.failed}")


def available() -> bool:
    """Whether chunk_checksum can run now (the mode allows it and the kernel is compiled and checked)."""
    return mode() != "numpy" and _kernel.ready()


def supports(page_size: int, nbytes: int) -> bool:
    """Whether chunk_checksum takes chunks of `nbytes` in pages of `page_size` (whole coefficient blocks a page,
    whole words, an extent the outer table covers); the numpy path takes any."""
    return (page_size % (_BLOCK * checksum.WORD) == 0 and nbytes % checksum.WORD == 0
            and nbytes <= _MAX_BLOCKS * _BLOCK * checksum.WORD)


@lru_cache(maxsize=1)
def _thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="kvshare-fused-hash", initializer=run_on_every_cpu)


def start(arena: torch.Tensor, extents: Sequence[tuple[Sequence[int], int]]) -> Future:
    """A future of [chunk_checksum(arena, page ids, nbytes) for each extent], hashed on the kernel's own thread. The
    caller keeps those pages unchanged until it is done (a read lease, or a finished store)."""
    return _thread().submit(lambda: [chunk_checksum(arena, ids, nbytes) for ids, nbytes in extents])


def chunk_checksum(arena: torch.Tensor, page_ids: Sequence[int], nbytes: int) -> int:
    """kvshare.checksum.pages_checksum of a chunk held by `page_ids` of `arena` (uint8 [num_pages, page_size]),
    computed by the compiled kernel on this thread (it holds the GIL: see `start`). Needs available() and
    supports(page_size, nbytes)."""
    page_size = arena.shape[1]
    need = -(-nbytes // page_size)
    if len(page_ids) != need:
        raise ValueError(f"{nbytes} bytes span {need} pages of {page_size}, got {len(page_ids)}")
    total = _kernel.terms(arena.view(torch.int64), page_ids, nbytes // checksum.WORD)
    return checksum.finish(total & checksum.MASK, nbytes)
