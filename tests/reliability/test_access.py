"""Access: socket and arena are owner/group only (and can be given to a group), TCP listens only when asked and only
with a token, and a client that fails authentication gets nothing but the refusal."""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct
import subprocess
import sys

import psutil
import pytest

from kvshare.pool import protocol as p
from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.testing import start_pool
from kvshare.processes import free_port
from tests.pool.conftest import new_chunks, prompt, random_bytes

PAGE = 64 << 10


def arena_of(address: str) -> str:
    with PoolClient.connect(address, map_arena=False) as client:
        return client.arena_path


def test_socket_and_arena_are_owner_and_group_only():
    with start_pool("1MiB", page_size=PAGE) as (address, process):
        for path in (address, arena_of(address)):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path
        tcp = [c for c in psutil.Process(process.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert tcp == []  # no TCP listener unless --tcp is given


def member_group() -> grp.struct_group:
    """A group the pool's user may give files to, other than its primary group where possible (root: any group)."""
    if os.geteuid() == 0:
        return next(g for g in grp.getgrall() if g.gr_gid != os.getgid())
    return grp.getgrgid(([g for g in os.getgroups() if g != os.getgid()] or [os.getgid()])[0])


def test_group_option_gives_socket_and_arena_to_that_group():
    group = member_group()
    with start_pool("1MiB", page_size=PAGE, group=group.gr_name) as (address, _):
        for path in (address, arena_of(address)):
            info = os.stat(path)
            assert info.st_gid == group.gr_gid and stat.S_IMODE(info.st_mode) == 0o660


def serve(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvshare.cli", "pool", "serve", "--size", "1MiB", "--page-size", "64KiB", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_unknown_group_and_tcp_without_token_are_refused_at_start(tmp_path):
    arena = f"/dev/shm/kvshare-test-access-{os.getpid()}.arena"
    out = serve("--socket", str(tmp_path / "a.sock"), "--arena", arena, "--group", "no-such-group-kvshare")
    assert out.returncode == 1 and "group 'no-such-group-kvshare' does not exist" in out.stderr
    assert not os.path.exists(arena)  # nothing left behind
    out = serve("--socket", str(tmp_path / "b.sock"), "--tcp", f"127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "--token-file" in out.stderr


def exchange(sock: socket.socket, request: p.Request) -> p.Reply:
    sock.sendall(p.frame(request))
    header = sock.recv(4, socket.MSG_WAITALL)
    body = sock.recv(struct.unpack("<I", header)[0], socket.MSG_WAITALL)
    return p.reply_decoder.decode(body)


@pytest.mark.parametrize("first", [p.Stats(), p.Attach("wrong"), p.Attach(""), p.Clear(), p.Health(True)])
def test_tcp_client_that_fails_authentication_gets_nothing(tmp_path, first):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    port = free_port()
    with start_pool("1MiB", page_size=PAGE, tcp=f"127.0.0.1:{port}", token_file=token_file) as (address, _):
        with PoolClient.connect(address) as local:  # a Unix-socket client stores a chunk the intruder must not see
            ns = b"n" * 16
            local.hello(ns)
            keys, tokens = prompt(1, ns=ns)
            reservation = local.reserve(ns, new_chunks(keys, tokens, PAGE, first_parent=ns))
            local.write(reservation.chunks[0], random_bytes(PAGE, seed=1))
            local.commit(reservation.lease, [checksum(random_bytes(PAGE, seed=1))])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as intruder:
            reply = exchange(intruder, first)
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.AUTH  # no arena path, no stats
            assert intruder.recv(1) == b""  # and the connection is closed: nothing more can be asked
        with PoolClient.connect(f"tcp://127.0.0.1:{port}", token="s3cret", map_arena=False) as client:
            stats = client.stats()
            # the intruder changed nothing
            assert client.health(deep=True) and stats.namespaces == 1 and stats.chunks == 1
