"""Registering host memory (the arena mapping) for DMA in bounded pieces, in the background, demand first.

cudaHostRegister pins the pages and maps them for the GPU's copy engines, so copies to and from the arena run at
full PCIe speed (~55 GB/s on the H200 host instead of ~6.7 GB/s through pageable staging). It is slow (FACTS: 1.95 s
for 32 GiB of touched /dev/shm; a fresh replica attached to a 100 GiB pool took ~35-50 s more to start: the
registration faults in every page this process has not touched), and one registration of >= 512 GiB fails on some
drivers. So an arena view is registered as `Pieces`: ranges of whole pages of at most
`piece_bytes` each, registered by a few threads in the background, while a transfer waits only for the pieces its
pages lie in (`Registration.ensure`), taking a piece nobody has started yet on its own thread. Measured on an H200
(docs/results/h200/NOTES.md): in run 12 the engine waited for every piece before it was ready (+33 s at 100 GiB),
because its own driver calls queued behind the registering ones; with the transfer's driver calls made before the
registration starts, run 13's replica was ready 1.2-1.5 s after one without a pool, the pieces done ~10 s later.
While a piece registers the driver makes other calls wait (up to ~2 s for one call in run 13): the GIL is not the
cause, more threads do not help. A copy never spans two pieces (kvshare.transfer.cuda.page_runs): each is its own
allocation to the driver.

How cudaHostRegister is called (`register_via()`): through ctypes on the libcudart that torch loaded (the one this
process has mapped, else the one in torch's wheel directories), because a ctypes call releases the GIL for its whole
duration whatever torch version is installed, so a registration of seconds on a background thread cannot stop the
engine's thread from running Python; torch's binding (`torch.cuda.cudart()`) where no such library is found. The
environment variable KVSHARE_REGISTER_VIA=torch|ctypes (default ctypes, read at import) picks the path, so one
experiment can time both in fresh processes (experiments/h200_run13.py).

Invariants:
- A piece is registered at most once per process; unregistered only by `close()` (before the mapping goes away).
- `ensure(pages)` returns only when every piece holding one of `pages` is registered, or raises the error of the
  piece that failed (the connector then counts a miss): no copy ever reads or writes an unregistered arena page.
- In one process cuda_register and cuda_unregister take one path (the runtime is looked up once), and the ctypes path
  calls the runtime torch itself uses, never a second copy of it: a range pinned one way is unpinned the same way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

DEFAULT_PIECE_BYTES = 16 << 30  # FACTS: one registration of >= 512 GiB fails on the R580 driver line; vLLM uses 64
DEFAULT_THREADS = 4
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: another part of this process did it: fine
_lock = threading.Lock()  # guards _registrations: two transfers made from two threads must share one Registration
_registrations: dict[tuple[int, int], Registration] = {}
VIAS = ("ctypes", "torch")
REGISTER_VIA = os.environ.get("KVSHARE_REGISTER_VIA", "ctypes")  # see the module docstring; register_via() checks it
log = logging.getLogger("kvshare.transfer")


@dataclass(frozen=True)
class Pieces:
    """An arena of `num_pages` pages of `page_size` bytes cut into pieces of `pages_per_piece` whole pages (the last
    may be shorter). Pure arithmetic: what the registration and the copy plans agree on."""

    num_pages: int
    page_size: int
    pages_per_piece: int

    @classmethod
    def of(cls, num_pages: int, page_size: int, piece_bytes: int) -> Pieces:
        if piece_bytes <= 0:
            raise ValueError(f"registration piece must be positive, got {piece_bytes} bytes")
        return cls(num_pages, page_size, max(1, piece_bytes // page_size))

    @property
    def count(self) -> int:
        return -(-self.num_pages // self.pages_per_piece)

    def pages(self, piece: int) -> tuple[int, int]:
        """Pages [first, end) of `piece`."""
        first = piece * self.pages_per_piece
        return first, min(first + self.pages_per_piece, self.num_pages)

    def containing(self, page_ids: Iterable[int] | np.ndarray) -> list[int]:
        """The pieces that hold any of `page_ids`, ascending."""
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        return np.unique(ids // self.pages_per_piece).tolist() if ids.size else []


def cudart_in_maps(lines: Iterable[str]) -> str | None:
    """The first libcudart.so* file among /proc/<pid>/maps `lines`, or None."""
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and Path(fields[5]).name.startswith("libcudart.so"):
            return fields[5]
    return None


def find_cudart() -> str | None:
    """Path of the CUDA runtime torch uses: the libcudart this process has mapped (torch's wheels load it at import),
    else libcudart.so.<torch's CUDA major> in torch's lib directory or the nvidia wheels beside it; None for a CPU
    build of torch, or where the runtime is linked in statically (then only torch's binding can reach it)."""
    with open("/proc/self/maps") as maps:
        mapped = cudart_in_maps(maps)
    if mapped or not torch.version.cuda:
        return mapped
    major = torch.version.cuda.split(".")[0]
    site = Path(torch.__file__).parent.parent
    for folder in (site / "torch/lib", site / "nvidia/cuda_runtime/lib", site / f"nvidia/cu{major}/lib"):
        found = sorted(folder.glob(f"libcudart.so.{major}*"))
        if found:
            return str(found[0])
    return None


def bind_cudart(path: str) -> ctypes.CDLL:
    """The runtime at `path` with cudaHostRegister/cudaHostUnregister typed. A library already loaded is not loaded
    again (dlopen hands back torch's copy: one runtime, one primary context, whose registrations torch's copies see)."""
    library = ctypes.CDLL(path)  # CDLL, not PyDLL: every call releases the GIL
    library.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
    library.cudaHostRegister.restype = ctypes.c_int
    library.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
    library.cudaHostUnregister.restype = ctypes.c_int
    library.cudaGetLastError.argtypes = ()
    library.cudaGetLastError.restype = ctypes.c_int
    return library


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """torch's libcudart bound for ctypes, found once per process; None where it cannot be found or loaded."""
    path = find_cudart()
    if path is None:
        return None
    try:
        library = bind_cudart(path)
    except (OSError, AttributeError) as error:
        log.warning("cannot call %s through ctypes (%s): registering through torch's binding", path, error)
        return None
    log.info("registering arena memory through ctypes on %s", path)
    return library


def register_via() -> str:
    """"ctypes" where REGISTER_VIA asks for it and torch's libcudart was found, else "torch": the path that
    cuda_register and cuda_unregister take in this process."""
    if REGISTER_VIA not in VIAS:
        raise ValueError(f"KVSHARE_REGISTER_VIA={REGISTER_VIA!r}: use one of {', '.join(VIAS)}")
    return "ctypes" if REGISTER_VIA == "ctypes" and _runtime() is not None else "torch"


def cuda_register(ptr: int, nbytes: int) -> None:
    """Register [ptr, ptr + nbytes) for DMA; a range this process registered before is fine (error 712)."""
    # ctypes releases the GIL while the call runs (seconds for a piece of a fresh arena); torch's binding does only
    # in versions that wrap it in gil_scoped_release, so the engine's thread could otherwise stall behind it.
    if register_via() == "ctypes":
        result = int(_runtime().cudaHostRegister(ptr, nbytes, 0))
    else:
        result = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if result == _ALREADY_REGISTERED:
        _clear_last_error()
    elif result:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes of the arena failed with CUDA error {result}: check that the "
            "arena is mapped read-write and that the memlock limit (ulimit -l) allows pinning it; a smaller "
            "--register-piece helps where one large registration fails"
        )


def _clear_last_error() -> None:
    """Reset this thread's CUDA "last error" after a failure we accept (712): the runtime keeps it, and torch reads it
    after its next kernel launch on this thread, so an engine thread that registered a piece itself (ensure) would
    see its next kernel fail with "already mapped" (H200 run 13 hit this in a test)."""
    if register_via() == "ctypes":
        _runtime().cudaGetLastError()
        return
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)  # not in every torch's binding
    if clear is not None:
        clear()


def cuda_unregister(ptr: int) -> None:
    """Undo cuda_register(ptr, ...) by the same path; its result is ignored, as before (nothing to do about it)."""
    if register_via() == "ctypes":
        _runtime().cudaHostUnregister(ptr)
    else:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class Registration:
    """The DMA registration of one arena view, piece by piece. Thread-safe.

    Each piece is *claimed* once, under the lock, by whoever registers it: a background worker (start(): `threads`
    daemon threads taking pieces in ascending order) or a transfer's thread in ensure(), which takes any piece it
    needs that nobody has claimed yet and waits for those others hold. A claim is a Future that every waiter shares,
    so a failed registration raises the same error in each of them."""

    def __init__(self, base: int, pieces: Pieces, threads: int = DEFAULT_THREADS,
                 register: Callable[[int, int], None] = cuda_register,
                 unregister: Callable[[int], None] = cuda_unregister):
        if threads < 1:
            raise ValueError(f"registration threads must be >= 1, got {threads}")
        self.base, self.pieces, self.threads = base, pieces, threads
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()  # guards _claims and _next: a piece gets exactly one claim, whoever makes it
        self._claims: dict[int, Future] = {}
        self._next = 0  # the background workers' next candidate piece
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._all_done = False  # set once every piece is registered: ensure() is then one attribute read
        self._created = time.monotonic()
        self._told = False  # the "all registered" line is logged once (the last piece's thread logs it)

    def span(self, piece: int) -> tuple[int, int]:
        """(address, bytes) of `piece`."""
        first, end = self.pieces.pages(piece)
        return self.base + first * self.pieces.page_size, (end - first) * self.pieces.page_size

    def start(self) -> Registration:
        """Start the background workers (once); returns at once."""
        with self._lock:
            if self._workers or self._closed:
                return self
            # Daemon threads: a process that exits mid-registration must not wait for the rest of a 1 TiB arena.
            self._workers = [threading.Thread(target=self._work, name=f"kvshare-register-{i}", daemon=True)
                             for i in range(min(self.threads, self.pieces.count))]
        for worker in self._workers:
            worker.start()
        return self

    def ensure(self, page_ids: Iterable[int] | np.ndarray) -> None:
        """Return once every piece holding one of `page_ids` is registered (see the module's invariants)."""
        if self._all_done:
            return
        self._wait(self.pieces.containing(page_ids))

    def wait_all(self) -> None:
        """Register every piece (on this thread where nobody has claimed it) and wait for all of them."""
        self._wait(range(self.pieces.count))

    def registered(self) -> int:
        """Pieces registered so far."""
        with self._lock:
            claims = list(self._claims.values())
        return sum(f.done() and f.exception() is None for f in claims)

    def _claim(self, piece: int) -> Future | None:
        """A new claim on `piece` for the caller, or None if someone holds one. Under self._lock."""
        if piece in self._claims or self._closed:
            return None
        future = self._claims[piece] = Future()
        future.set_running_or_notify_cancel()  # never cancelled: it resolves when the registration ends
        return future

    def _run(self, piece: int, future: Future) -> None:
        try:
            self._register(*self.span(piece))
            future.set_result(None)
        except BaseException as error:  # the claim carries it to every waiter, now and later
            future.set_exception(error)
            return
        self._tell_if_all_registered()

    def _tell_if_all_registered(self) -> None:
        """Log, once, when the last piece is registered: a replica's log then says when loads stop waiting for
        registration (a transfer before that may wait for its pieces, and its time includes theirs)."""
        with self._lock:
            if self._told or len(self._claims) < self.pieces.count:
                return
            if not all(f.done() and f.exception() is None for f in self._claims.values()):
                return
            self._told = True
        nbytes = self.pieces.num_pages * self.pieces.page_size
        log.info("arena registered for DMA: %.1f GiB in %d pieces, %.1f s after this view's registration began",
                 nbytes / 2**30, self.pieces.count, time.monotonic() - self._created)

    def _work(self) -> None:
        while True:
            with self._lock:
                while self._next < self.pieces.count and self._next in self._claims:
                    self._next += 1
                if self._next >= self.pieces.count or self._closed:
                    return
                piece = self._next
                future = self._claim(piece)
            self._run(piece, future)

    def _wait(self, pieces: Iterable[int]) -> None:
        mine, waits = [], []
        with self._lock:
            if self._closed:
                raise RuntimeError("the arena's DMA registration was closed (the mapping is going away)")
            for piece in pieces:
                future = self._claim(piece)
                if future is not None:
                    mine.append((piece, future))
                waits.append(self._claims[piece])
        for piece, future in mine:
            self._run(piece, future)
        for future in waits:
            future.result()  # raises the piece's registration error, if any
        if self.registered() == self.pieces.count:
            self._all_done = True

    def close(self) -> None:
        """Stop the workers, wait for registrations under way, unregister every registered piece."""
        with self._lock:
            self._closed = True
            claims = dict(self._claims)
        for worker in self._workers:
            worker.join()
        for piece, future in sorted(claims.items()):
            if future.exception() is None:  # waits for a registration another thread is still running
                self._unregister(self.span(piece)[0])
        self._all_done = False


def registration(pages: torch.Tensor, piece_bytes: int = DEFAULT_PIECE_BYTES, threads: int = DEFAULT_THREADS,
                 ahead: bool = True) -> Registration:
    """The process's Registration of a host uint8 [num_pages, page_size] arena view (one per view: the first
    caller's piece size and threads win). `ahead`: start registering every piece in the background now; otherwise
    pieces are registered only when a transfer first needs them (only what this replica uses is pinned)."""
    key = (pages.data_ptr(), pages.numel())
    with _lock:
        found = _registrations.get(key)
        if found is None:
            found = _registrations[key] = Registration(
                pages.data_ptr(), Pieces.of(pages.shape[0], pages.shape[1], piece_bytes), threads)
    return found.start() if ahead else found


def register_pages(pages: torch.Tensor, num_pages: int | None = None, piece_bytes: int = DEFAULT_PIECE_BYTES,
                   threads: int = DEFAULT_THREADS) -> Registration:
    """Register the first `num_pages` pages (default: all) of an arena view now, returning when they are."""
    found = registration(pages, piece_bytes, threads, ahead=False)
    count = pages.shape[0] if num_pages is None else min(num_pages, pages.shape[0])
    found.ensure(range(count))
    return found


def unregister_pages(pages: torch.Tensor) -> None:
    """Undo the registration of every arena view inside `pages`; call before unmapping the arena (a new mapping at
    the same address would otherwise be taken as registered)."""
    start, end = pages.data_ptr(), pages.data_ptr() + pages.numel()
    with _lock:
        inside = [key for key in _registrations if start <= key[0] < end]
        found = [_registrations.pop(key) for key in inside]
    for registration_ in found:
        registration_.close()
