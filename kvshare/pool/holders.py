"""Which process holds a connection, and whether it has exited: what lets the pool end a fenced lease (I10).

A pidfd names one process for as long as it is open, so a pid reused after the holder exited is never mistaken for
it; it becomes readable when that process exits. Unix-socket peers are identified by the kernel (SO_PEERCRED); a TCP
client by the pid it sends in ATTACH (it must run on the pool's host to map the arena, and it has the token).
"""

from __future__ import annotations

import os
import select
import socket
import struct

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket (0 if the kernel cannot tell, e.g. another pid
    namespace)."""
    pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid


class ProcessWatch:
    """A handle on one process that tells whether it has exited. `watch(pid)` returns None when the process cannot
    be watched (gone already, another pid namespace, no pidfd support): the pool then bounds its fences by time."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self._fd = pid, fd

    @classmethod
    def watch(cls, pid: int) -> "ProcessWatch | None":
        if pid <= 0:
            return None
        try:
            return cls(pid, os.pidfd_open(pid))
        except (OSError, AttributeError):  # ProcessLookupError, ENOSYS, or a platform without pidfd_open
            return None

    def exited(self) -> bool:
        """True once the process has exited (its pidfd is readable; never blocks)."""
        if self._fd < 0:
            return True
        readable, _, _ = select.select([self._fd], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
