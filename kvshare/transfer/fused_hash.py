"""The chunk checksum of kvshare.checksum as one compiled loop: the same bits, one pass, no GIL held.

Why: the numpy path makes seven passes over every word (two folds, two multiplies, a sum) and hashes ~3 GB/s on one
core; a CPU replica's verified load of 6,144 tokens of the `small` model spent 37-50 ms hashing beside a 27 ms copy
(docs/results/connectors-cpu/load-verify). Here each word is read once: fold, multiply, fold, times its inner
coefficient, summed per coefficient block and the block's sum times its outer coefficient (the numpy path's
grouping; a sum mod 2^64 in any grouping has the same bits).

How it is built: the C source below, compiled once per process by the system C compiler (`cc`, the one vLLM's CPU
build and torch's compiler need too) into a temporary shared library and called through ctypes. A ctypes call
releases the GIL, so the hashing threads (kvshare.transfer.checksum) run it in parallel with each other and beside a
transfer's copy loop, whatever the process's OpenMP settings (a vLLM CPU worker binds OpenMP to the model's cores).
A kernel made by torch's compiler was tried first: its generated binding holds the GIL and its OpenMP threads
followed vLLM's binding to one core (docs/results/connectors-cpu/README.md).

Invariants:
- Bits: `chunk_checksum` equals `kvshare.checksum.pages_checksum` for every chunk it accepts (`supports`); the
  tests compare them over many shapes, and the kernel checks itself against numpy once before first use. It reads
  exactly the extent (the first `nbytes` of the chunk's pages) and only pages the arena holds (page ids are checked
  in Python before the C loop sees them).
- Mode (`KVSHARE_HOST_HASH`): "auto" (default) compiles in the background when a transfer first asks (`prepare`);
  until it is ready, and for good where it cannot be built (no C compiler), callers use numpy. "compiled" compiles
  on first use and raises if it cannot. "numpy" never compiles.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from kvshare import checksum

log = logging.getLogger(__name__)

MODES = ("auto", "compiled", "numpy")
_MAX_BLOCKS = 1 << 16  # outer coefficients kept for extents of up to 16 GiB (a chunk is tens of MiB)

SOURCE = r"""
#include <stdint.h>

#define BLOCK_WORDS %(block)du
#define MIX %(mix)dull

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 32;
    x *= MIX;
    return x ^ (x >> 32);
}

/* sum over extent words i < nwords of mix(w_i) * inner[i %% BLOCK] * outer[i / BLOCK], mod 2^64. The extent is the
   pages page_ids[0 .. pages) of arena, page_words words each, laid end to end. */
uint64_t kvshare_terms(const uint64_t *arena, uint64_t page_words, const int64_t *page_ids, uint64_t pages,
                       uint64_t nwords, const uint64_t *inner, const uint64_t *outer) {
    uint64_t total = 0, i = 0;
    for (uint64_t p = 0; p < pages && i < nwords; p++) {
        const uint64_t *page = arena + (uint64_t)page_ids[p] * page_words;
        uint64_t first = i, end = nwords - i < page_words ? nwords : i + page_words;
        while (i < end) {
            uint64_t block = i / BLOCK_WORDS, stop = (block + 1) * BLOCK_WORDS;
            if (stop > end) stop = end;
            const uint64_t *w = page + (i - first), *a = inner + (i - block * BLOCK_WORDS);
            uint64_t sum = 0, n = stop - i;
            for (uint64_t k = 0; k < n; k++) sum += mix(w[k]) * a[k];
            total += sum * outer[block];
            i = stop;
        }
    }
    return total;
}
""" % {"block": checksum.BLOCK_WORDS, "mix": checksum.MIX_MULTIPLIER}


def mode() -> str:
    value = os.environ.get("KVSHARE_HOST_HASH", "auto")
    if value not in MODES:
        raise ValueError(f"KVSHARE_HOST_HASH must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _build(folder: Path) -> ctypes.CDLL:
    """Compile SOURCE into `folder` and load it: for this CPU first (-march=native), else for any of its kind."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source, library = folder / "kvshare_hash.c", folder / "kvshare_hash.so"
    source.write_text(SOURCE)
    for flags in (["-O3", "-march=native"], ["-O3"]):
        built = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(library), str(source)],
                               capture_output=True, text=True, timeout=120)
        if built.returncode == 0:
            break
    else:
        raise RuntimeError(f"{compiler} failed: {built.stderr.strip().splitlines()[-1] if built.stderr else ''}")
    loaded = ctypes.CDLL(str(library))  # CDLL: each call releases the GIL
    loaded.kvshare_terms.restype = ctypes.c_uint64
    loaded.kvshare_terms.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64,
                                     ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
    return loaded


class _Kernel:
    """The compiled loop, built at most once per process (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.library: ctypes.CDLL | None = None
        self.failed: str | None = None
        self.inner = checksum._A  # uint64 [BLOCK_WORDS]
        self.outer = checksum._outer(np.arange(_MAX_BLOCKS))  # uint64 [_MAX_BLOCKS]

    def ready(self) -> bool:
        return self._ready.is_set() and self.library is not None

    def build(self) -> None:
        """Compile, load and check the loop against the numpy path on a small extent (once; later calls return)."""
        with self._lock:
            if self._ready.is_set():
                return
            started = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory(prefix="kvshare-hash-") as folder:
                    library = _build(Path(folder))  # loaded: the file may go, the mapping stays
                self.library = library if self._self_check(library) else None
                if self.library is None:
                    self.failed = "the compiled checksum differs from the numpy path's"
            except Exception as error:  # noqa: BLE001 - whatever fails, numpy stays
                self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if self.failed:
                log.warning("kvshare: the compiled host checksum is not available (%s); using numpy", self.failed)
            else:
                log.info("kvshare: compiled host checksum ready (%.1f s)", time.perf_counter() - started)
            self._ready.set()

    def _self_check(self, library: ctypes.CDLL) -> bool:
        arena = np.random.default_rng(0).integers(0, 256, size=(3, 2 * checksum.BLOCK_WORDS * 8 + 24),
                                                  dtype=np.uint8)
        nbytes = arena.shape[1] + 8 * 40_000
        return self.checksum(library, arena, [2, 0], nbytes) == checksum.pages_checksum(arena, [2, 0], nbytes)

    def checksum(self, library: ctypes.CDLL, arena: np.ndarray, page_ids: Sequence[int], nbytes: int) -> int:
        ids = np.ascontiguousarray(page_ids, dtype=np.int64)
        total = library.kvshare_terms(arena.ctypes.data, arena.shape[1] // checksum.WORD, ids.ctypes.data, len(ids),
                                      nbytes // checksum.WORD, self.inner.ctypes.data, self.outer.ctypes.data)
        return checksum.finish(total, nbytes)


_kernel = _Kernel()


def prepare() -> None:
    """Make the kernel available as the mode says: "auto" starts building it in the background (once), "compiled"
    builds it now and raises if it cannot, "numpy" does nothing."""
    chosen = mode()
    if chosen == "numpy" or _kernel._ready.is_set():
        pass
    elif chosen == "compiled":
        _kernel.build()
    else:
        threading.Thread(target=_kernel.build, name="kvshare-hash-build", daemon=True).start()
    if chosen == "compiled" and not _kernel.ready():
        raise RuntimeError(f"KVSHARE_HOST_HASH=compiled, but the kernel could not be built: {_kernel.failed}")


def available() -> bool:
    """Whether chunk_checksum can run now (the mode allows it and the kernel is built and checked)."""
    return mode() != "numpy" and _kernel.ready()


def supports(page_size: int, nbytes: int) -> bool:
    """Whether chunk_checksum takes chunks of `nbytes` in pages of `page_size` (whole words, an extent the outer
    table covers, a little-endian host); the numpy path takes any."""
    return (sys.byteorder == "little" and page_size % checksum.WORD == 0 and nbytes % checksum.WORD == 0
            and nbytes <= _MAX_BLOCKS * checksum.BLOCK_WORDS * checksum.WORD)


def chunk_checksum(arena: np.ndarray, page_ids: Sequence[int], nbytes: int) -> int:
    """kvshare.checksum.pages_checksum of a chunk held by `page_ids` of `arena` (a C-contiguous uint8 numpy array
    [num_pages, page_size]), by the compiled loop, on this thread, without the GIL. Needs available() and
    supports(page_size, nbytes)."""
    num_pages, page_size = arena.shape
    need = -(-nbytes // page_size)
    if len(page_ids) != need:
        raise ValueError(f"{nbytes} bytes span {need} pages of {page_size}, got {len(page_ids)}")
    if not arena.flags.c_contiguous or arena.dtype != np.uint8:
        raise ValueError("the arena must be a C-contiguous uint8 array")
    if any(not 0 <= page < num_pages for page in page_ids):  # the C loop reads where these point
        raise ValueError(f"page ids {list(page_ids)} outside an arena of {num_pages} pages")
    return _kernel.checksum(_kernel.library, arena, page_ids, nbytes)
