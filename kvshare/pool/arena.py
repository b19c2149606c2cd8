"""The arena file: create it (checking memory first), prepare its pages in the background, map it, remove it.

Preparation allocates the file's memory with posix_fallocate in segments on several threads (os.posix_fallocate
releases the GIL). Segments finish out of order; `on_progress` is called with the length of the fully prepared
*prefix*, so the pool hands out only pages whose memory exists — a write into the arena can never fault for lack of
memory (SIGBUS on tmpfs). Serving starts at once; capacity grows as preparation proceeds (FACTS: a 256 GiB tmpfs
arena takes about a minute to prepare).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import psutil

from kvshare.units import format_size

log = logging.getLogger(__name__)
FILE_MODE = 0o660  # owner and group only: the arena holds other replicas' KV data
SEGMENT = 64 << 20  # preparation unit: small enough for smooth progress, large enough to amortise the syscall
DEFAULT_NAME = re.compile(r"kvshare-(\d+)\.arena")  # PoolConfig.arena_path's default: kvshare-<pool pid>.arena


class ArenaError(Exception):
    """The arena cannot be created: the message says why and what to do."""


@dataclass
class Arena:
    path: str
    size: int
    fd: int
    stopping: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def create(cls, path: str, size: int) -> "Arena":
        """A new arena file of `size` bytes (not yet prepared). Fails at once if the memory is not there."""
        check_memory(path, size)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            raise ArenaError(f"arena file {path} already exists: another pool may use it; stop that pool or remove "
                             "the file, or pass another --arena") from None
        except OSError as error:
            raise ArenaError(f"cannot create arena file {path}: {error.strerror}; pass another --arena") from None
        os.fchmod(fd, FILE_MODE)  # the umask may have removed group bits
        # Held for the pool's life (the lock goes with the last fd, i.e. with the process, however it ends): an arena
        # nobody holds locked belongs to a dead pool (remove_stale_arenas).
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.ftruncate(fd, size)
        except OSError as error:
            os.close(fd)
            os.unlink(path)
            raise ArenaError(f"cannot size arena {path} to {size} bytes: {error.strerror}") from None
        return cls(path, size, fd)

    def prepare(self, threads: int, on_progress: Callable[[int], None], fault_in: bool = True) -> threading.Thread:
        """Start allocating the file's memory in the background (and with `fault_in` faulting it in: `_fault_in`);
        `on_progress(prepared_bytes)` is called from the worker thread with the fully prepared prefix, ending with
        `self.size` (or earlier on failure, logged)."""
        thread = threading.Thread(target=self._prepare, args=(threads, on_progress, fault_in), name="arena-prepare",
                                  daemon=True)
        thread.start()
        return thread

    def _prepare(self, threads: int, on_progress: Callable[[int], None], fault_in: bool) -> None:
        starts = list(range(0, self.size, SEGMENT))
        done = [False] * len(starts)
        prefix = 0  # segments [0, prefix) are prepared
        lock = threading.Lock()  # guards `done` and `prefix`: workers finish segments out of order

        def work(i: int) -> None:
            nonlocal prefix
            if self.stopping.is_set():
                return  # shutting down: the fd is about to close
            length = min(SEGMENT, self.size - starts[i])
            os.posix_fallocate(self.fd, starts[i], length)
            if fault_in:
                _fault_in(self.fd, starts[i], length)
            with lock:
                done[i] = True
                advanced = prefix
                while prefix < len(done) and done[prefix]:
                    prefix += 1
                if prefix != advanced:
                    on_progress(min(prefix * SEGMENT, self.size))

        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="arena-prepare") as pool:
                for future in [pool.submit(work, i) for i in range(len(starts))]:
                    future.result()
        except OSError as error:
            log.error("arena preparation stopped at %s: %s; the pool serves only the prepared part",
                      format_size(prefix * SEGMENT), error.strerror)

    def close(self, remove: bool) -> None:
        self.stopping.set()
        time.sleep(0.05)  # let a worker inside posix_fallocate of its last segment notice before the fd closes
        os.close(self.fd)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _fault_in(fd: int, offset: int, length: int) -> None:
    """Fault a prepared segment in once, here: tmpfs zeroes a fallocated page on its first touch, and whoever touches
    it first pays (docs/results/arena-fault-in: 0.366 s/GiB for a client's first MAP_POPULATE against 0.064 s/GiB
    once faulted in, on the build machine; on the H200 host a GPU replica's first cudaHostRegister of a fresh arena
    cost 0.33-0.37 s/GiB against 0.09-0.13 for later ones). Paid by the pool's preparation threads, it no longer lands
    on the first store into each page or on the first replica's registration."""
    mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), offset=offset)
    mapping.close()


def remove_stale_arenas(directory: str) -> list[tuple[str, int]]:
    """Remove arenas that dead pools of this user left in `directory` (a pool killed with SIGKILL cannot remove its
    own); returns (path, bytes) of each. Only files named as pools name them by default (kvshare-<pid>.arena), owned
    by this user, locked by nobody (every live pool holds its arena's lock) and whose pid is not running."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = DEFAULT_NAME.fullmatch(name)
        path = os.path.join(directory, name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a live pool holds it
            os.unlink(path)
            removed.append((path, info.st_blocks * 512))
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def check_memory(path: str, size: int) -> None:
    """Raise ArenaError if `size` bytes exceed the free space of the arena's file system or the available RAM."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ArenaError(f"arena directory {directory} does not exist: pass --arena in an existing directory")
    fs = os.statvfs(directory)
    fs_free = fs.f_bavail * fs.f_frsize
    ram = psutil.virtual_memory().available
    if size > fs_free:
        raise ArenaError(f"pool size {format_size(size)} exceeds the free space of {directory} "
                         f"({format_size(fs_free)}): lower --size or free memory there")
    if size > ram:
        raise ArenaError(f"pool size {format_size(size)} exceeds the available memory ({format_size(ram)}): "
                         "lower --size")


class Mapping:
    """A process's shared, writable mapping of an arena as a uint8 [num_pages, page_size] numpy array."""

    def __init__(self, path: str, page_size: int, num_pages: int, populate: bool = False) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self._mmap = mmap.mmap(fd, page_size * num_pages, flags=flags)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self.pages = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_pages, page_size)

    def close(self) -> None:
        self.pages = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes when they do


def prepare_rate(size: int, seconds: float) -> str:
    return f"{format_size(size)} in {seconds:.2f} s ({size / max(seconds, 1e-9) / 2**30:.2f} GiB/s)"
