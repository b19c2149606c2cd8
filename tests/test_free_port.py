"""kvshare.processes.free_port: a port handed out is never handed out again in the same process, even when the OS
offers it again because its server has not bound it yet."""

from __future__ import annotations

import itertools

from kvshare import processes


class _Socket:
    """A socket whose bind(port 0) gets the next of a fixed sequence of ports, as the OS may repeat one."""

    offered = itertools.chain([50001, 50001, 50001, 50002], itertools.count(50003))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = next(self.offered)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setattr(processes.socket, "socket", _Socket)
    monkeypatch.setattr(processes, "_HANDED_OUT", set())
    assert [processes.free_port() for _ in range(3)] == [50001, 50002, 50003]


def test_the_ports_are_free_on_loopback():
    import socket

    port = processes.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing listens there
