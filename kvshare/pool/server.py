"""The pool server: one asyncio loop that dispatches requests to PoolState and keeps connections apart.

Each connection's frames are read and its replies written by a ClientProtocol (connection.py), which also enforces
the per-connection limits; the frame budget shared by all connections lives here.
Handlers are short and synchronous: every policy lives in PoolState (state.py) and below. Because everything runs
on the loop's one thread, PoolState needs no lock; the only other thread is arena preparation, which reports
progress through loop.call_soon_threadsafe. A bad frame or request gets an Error reply and never stops the server;
an oversized frame or a failed TCP authentication also closes that one connection.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import itertools
import logging
import os
import resource
import signal
import socket
import stat
import time
from typing import TYPE_CHECKING, Awaitable

import msgspec

from kvshare.pool import protocol as p
from kvshare.pool.arena import Arena, prepare_rate, remove_stale_arenas
from kvshare.pool.config import PoolConfig
from kvshare.pool.connection import ClientProtocol, CloseConnection, Connection, FrameBudget
from kvshare.pool.holders import ProcessWatch, peer_pid
from kvshare.pool.state import IntegrityError, PoolState, RequestError
from kvshare.pool.stats import LatencyRecorder, PoolStats
from kvshare.units import format_size

if TYPE_CHECKING:
    from kvshare.pool.l2.tier import L2Tier

log = logging.getLogger(__name__)
EXPIRY_PERIOD = 0.25  # seconds between lease-expiry sweeps (a lease may outlive its timeout by this much)
MUTATING = (p.Hello, p.Lookup, p.Reserve, p.Commit, p.Release, p.Discard, p.Clear)


class NoL2:
    """The tier a pool without --l2 has: LOOKUP answers from L1 at once, nothing is written behind."""

    def __init__(self, state: PoolState) -> None:
        self.state = state

    def lookup(self, client: int, namespace: bytes, keys: list[bytes], tokens: memoryview,
               lengths: list[int], promote: bool) -> p.LookupReply:
        return self.state.lookup_joined(client, namespace, keys, tokens, lengths)

    def after_commit(self, entries: list) -> None:
        pass

    def fill(self, stats: PoolStats) -> None:
        pass

    def close(self) -> None:
        pass


class PoolServer:
    def __init__(self, config: PoolConfig, arena: Arena) -> None:
        self.config = config
        self.arena = arena
        self.state = PoolState(
            config.num_pages, config.page_size, prepared=0, lease_timeout=config.lease_timeout,
            high_watermark=config.high_watermark, low_watermark=config.low_watermark,
            max_leased_pages_per_client=config.lease_limit, max_description=config.max_description,
            max_namespaces=config.max_namespaces,
        )
        self.latency = LatencyRecorder()
        self.clients = 0
        self.started = time.monotonic()
        self._ids = itertools.count(1)
        self.instance = os.urandom(8).hex()  # identity only, never a key: clients tell pool lives apart by it
        self.watches: dict[int, ProcessWatch] = {}  # connection id -> its process, while it is open or holds leases
        self.budget = FrameBudget(config.max_buffered)
        self._stop = asyncio.Event()
        self.l2: L2Tier | NoL2 = NoL2(self.state)  # the L2Tier (kvshare.pool.l2) once run() starts it with --l2

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        servers = [await loop.create_unix_server(lambda: self._connection(True), self.config.socket)]
        os.chmod(self.config.socket, 0o660)  # owner and group only
        set_group(self.config.socket, self.config.group)
        if self.config.tcp:
            host, port = self.config.tcp.rsplit(":", 1)  # asyncio sets TCP_NODELAY on TCP transports
            servers.append(await loop.create_server(lambda: self._connection(False), host, int(port)))
        if self.config.metrics_port:
            servers.append(await self._serve_metrics())
        announce(f"serving on {self.config.socket}" + (f" and tcp {self.config.tcp}" if self.config.tcp else "")
                 + f" (arena {self.arena.path}, {format_size(self.arena.size)}, {self.config.num_pages} pages of "
                 f"{format_size(self.config.page_size)})")
        started = time.monotonic()
        self.arena.prepare(self.config.threads, lambda n: self._from_preparer(loop, n, started),
                           self.config.fault_in)
        expiry = asyncio.create_task(self._expire_leases())
        if self.config.l2 is not None:
            from kvshare.pool.l2.tier import L2Tier  # lazy: redis-py is needed only with --l2

            self.l2 = L2Tier(self.config.l2, self.state, self.arena.path, self.config.page_size,
                             self.config.num_pages, loop)
            announce(f"L2 {self.config.l2.url} ({'cluster' if self.config.l2.cluster else 'standalone'})")
        await self._stop.wait()
        expiry.cancel()
        self.l2.close()
        for server in servers:
            server.close()
        announce("shutting down")

    async def _serve_metrics(self) -> asyncio.Server:
        """The Prometheus endpoint, on this loop: it reads STATS through _stats(), on the loop thread that owns
        PoolState (kvshare.pool.metrics says why not a thread)."""
        from kvshare.pool.metrics import MetricsEndpoint  # lazy: prometheus-client is read only with --metrics-port

        endpoint = MetricsEndpoint(self._stats, self.config.frame_timeout, self.config.metrics_max_connections)
        server = await endpoint.start(self.config.metrics_host, self.config.metrics_port)
        announce(f"metrics on http://{self.config.metrics_host}:{self.config.metrics_port}/metrics")
        return server

    def _from_preparer(self, loop: asyncio.AbstractEventLoop, nbytes: int, started: float) -> None:
        """Called on the preparation thread: hand the progress to the loop's thread, which owns PoolState."""
        try:
            loop.call_soon_threadsafe(self._prepared, nbytes, started)
        except RuntimeError:
            pass  # the loop has closed: shutting down

    def _prepared(self, nbytes: int, started: float) -> None:
        self.state.allocator.add_prepared(nbytes // self.config.page_size)
        if self.state.allocator.prepared == self.config.num_pages:
            announce(f"ready: {prepare_rate(self.arena.size, time.monotonic() - started)} prepared")

    async def _expire_leases(self) -> None:
        """Fence leases past their deadline, and end the fences of holders whose process has exited (I8, I10)."""
        while True:
            await asyncio.sleep(min(EXPIRY_PERIOD, self.config.lease_timeout / 4))
            if n := self.state.expire():
                log.info("%d lease(s) expired after %g s: fenced until their holders finish or exit", n,
                         self.config.lease_timeout)
            for client in self.state.leases.fenced_clients():
                watch = self.watches.get(client)
                if watch is not None and watch.exited():
                    self._gone(client)

    # ---- connections -------------------------------------------------------------------------------------------

    def _connection(self, is_unix: bool) -> ClientProtocol:
        """A new connection: Unix sockets are authenticated by file permissions, TCP by the token in ATTACH."""
        return ClientProtocol(self, Connection(next(self._ids), authenticated=is_unix or not self.config.token,
                                               is_unix=is_unix))

    def connected(self, conn: Connection, sock) -> None:
        """A Unix-socket peer is identified by the kernel at once; a TCP peer when its ATTACH names its pid."""
        self.clients += 1
        if conn.is_unix and sock is not None:
            self._identify(conn, peer_pid(sock))

    def _identify(self, conn: Connection, pid: int) -> None:
        watch = ProcessWatch.watch(pid)
        if watch is not None:
            self.watches[conn.id] = watch
            self.state.identify(conn.id, pid)

    def disconnected(self, conn: Connection) -> None:
        """The connection closed: its leases are fenced (I10) and end now if its process has already exited, else
        when the expiry sweep sees it exit (a process's sockets close before its pidfd becomes readable)."""
        self.clients -= 1
        watch = self.watches.get(conn.id)
        self.state.drop_client(conn.id, watched=watch is not None)
        if watch is not None and (watch.exited() or not self.state.leases.of_client(conn.id)):
            self._gone(conn.id)

    def _gone(self, client: int) -> None:
        self.state.client_gone(client)
        watch = self.watches.pop(client, None)
        if watch is not None:
            watch.close()

    def handle(self, conn: Connection, body: memoryview) -> p.Reply | Awaitable[p.Reply]:
        """One request -> one reply, or a coroutine of it (a LOOKUP waiting for L2 promotion); every failure becomes
        an Error reply, except CloseConnection. `body` is decoded before this returns (the caller reuses it)."""
        started = time.perf_counter()
        kind = "malformed"
        try:
            request = p.decode_request(body, self.config.max_keys)
            kind = type(request).__name__.lower()
            reply = self._dispatch(conn, request)
            if inspect.isawaitable(reply):  # bounded by the L2 promote timeout; the loop serves others meanwhile
                return self._finish(request, kind, reply, started)
            self._after(request)
        except CloseConnection:
            raise
        except Exception as error:
            reply = self._error(error, kind)
            if not conn.authenticated:  # before authentication nothing but a good ATTACH is answered twice
                raise CloseConnection(reply.code, reply.message) from None
        self.latency.record(kind, time.perf_counter() - started, isinstance(reply, p.Error))
        return reply

    async def _finish(self, request: p.Request, kind: str, pending: Awaitable[p.Reply], started: float) -> p.Reply:
        try:
            reply = await pending
            self._after(request)
        except Exception as error:
            reply = self._error(error, kind)
        self.latency.record(kind, time.perf_counter() - started, isinstance(reply, p.Error))
        return reply

    def _after(self, request: p.Request) -> None:
        if self.config.check_integrity and isinstance(request, MUTATING):
            self.state.check_integrity()

    def _error(self, error: Exception, kind: str) -> p.Error:
        if isinstance(error, msgspec.DecodeError):
            return p.Error(p.ErrorCode.MALFORMED, f"malformed request: {error}; use kvshare.pool.client")
        if isinstance(error, RequestError):
            return p.Error(error.code, error.message)
        if isinstance(error, p.LimitExceeded):
            return p.Error(p.ErrorCode.LIMIT, str(error))
        if isinstance(error, IntegrityError):
            log.error("integrity check failed: %s", error)
            return p.Error(p.ErrorCode.INTEGRITY, f"integrity check failed: {error} (a pool bug: report it)")
        # A bug must not take down the server that every replica shares.
        log.error("internal error handling %s", kind, exc_info=error)
        return p.Error(p.ErrorCode.INTERNAL, f"internal error: {error!r} (a pool bug: report it)")

    def _dispatch(self, conn: Connection, request: p.Request) -> p.Reply:
        s = self.state
        if not conn.authenticated:
            if isinstance(request, p.Attach) and hmac.compare_digest(request.token.encode(),
                                                                     self.config.token.encode()):
                conn.authenticated = True
            else:
                raise CloseConnection(p.ErrorCode.AUTH, "authentication failed: over TCP the first message must be "
                                      "ATTACH with the pool's token (pass token= to PoolClient.connect)")
        match request:
            case p.Attach(version=version) if version != p.PROTOCOL_VERSION:
                raise RequestError(p.ErrorCode.VERSION, f"client speaks pool protocol {version}, this pool "
                                   f"{p.PROTOCOL_VERSION}: run the same kvshare version on both sides")
            case p.Attach(pid=pid):
                if not conn.is_unix and conn.id not in self.watches:
                    self._identify(conn, pid)
                return p.ArenaInfo(self.arena.path, self.config.page_size, self.config.num_pages, s.allocator.prepared,
                                   self.instance)
            case p.Hello(namespace, description):
                s.hello(namespace, description, conn.id)
                return p.Ok()
            case p.Lookup(namespace, keys, tokens, lengths, promote):
                try:
                    request.check_lengths()
                except ValueError as error:
                    raise RequestError(p.ErrorCode.BAD_REQUEST, f"LOOKUP: {error}") from None
                return self.l2.lookup(conn.id, namespace, keys, tokens, lengths, promote)
            case p.Reserve(namespace, chunks, evict):
                return s.reserve(conn.id, namespace, chunks, evict)
            case p.Commit(lease, checksums):
                entries = s.commit(conn.id, lease, checksums)
                self.l2.after_commit(entries)  # write-behind: enqueue only, never waits for L2
                return p.Ok()
            case p.Release(lease):
                s.release(conn.id, lease)
                return p.Ok()
            case p.Discard(namespace, keys):
                return p.Ok(s.discard(namespace, keys))
            case p.Clear():
                return p.Ok(s.clear())
            case p.Stats():
                return p.StatsReply(self._stats())
            case p.Health(deep):
                if deep:
                    s.check_integrity()
                return p.HealthReply(True, "integrity checked" if deep else "")
        raise RequestError(p.ErrorCode.BAD_REQUEST, f"unexpected request {type(request).__name__}")

    def _stats(self):
        stats = self.state.stats()
        stats.clients = self.clients
        stats.buffered_bytes, stats.frames_waiting = self.budget.used, self.budget.waiting
        self.l2.fill(stats)
        stats.uptime_s = time.monotonic() - self.started
        stats.requests = self.latency.snapshot()
        return stats


def announce(message: str) -> None:
    """A status line for people and scripts (start_pool waits on the socket, not on this)."""
    print(f"kvshare pool: {message}", flush=True)
    log.debug(message)


def prepare_socket(path: str) -> None:
    """Remove a stale socket file; refuse if a live pool answers on it, if the path is not a socket at all, or if its
    directory is missing (bind's bare `[Errno 2]` would not say which)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise RuntimeError(f"socket directory {directory} does not exist: create it (mkdir -p {directory}) or pass "
                           "another --socket")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket: pass another --socket (nothing was removed)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: its server is gone
        return
    finally:
        probe.close()
    raise RuntimeError(f"a pool is already serving on {path}: stop it or pass another --socket")


def set_group(path: str, group: str) -> None:
    """Give `path` to `group` (mode stays 0660), so that replicas running as other users of that group can connect
    and map the arena, and nobody else can."""
    if not group:
        return
    import grp

    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise RuntimeError(f"group {group!r} does not exist: create it or pass another --group") from None
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise RuntimeError(f"cannot give {path} to group {group!r}: the pool's user must be a member of it") from None


# glibc's malloc gives freed memory at the top of the heap back to the kernel once it exceeds about twice the
# largest recent allocation. A 1,024-chunk LOOKUP allocates and frees ~2 MiB (its decoded tokens and their joined
# copy), so each one page-faulted ~500 fresh pages back in: ~1 ms per LOOKUP on the build machine's VM, more than
# the handler's own work. The server therefore keeps up to TRIM_THRESHOLD of freed memory for reuse.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
TRIM_THRESHOLD, MMAP_THRESHOLD = 64 << 20, 32 << 20


def keep_freed_memory() -> None:
    """Tune glibc's malloc for the server (see above); a no-op where the C library has no mallopt (musl, macOS)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # fixed: glibc's own adjustment would be turned off by the next line
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def allow_connections(n: int) -> None:
    """Raise the open-file limit so that `n` connections (plus the arena, pidfds and a margin) fit, as far as the
    hard limit allows; a lower hard limit is said once, not discovered by failing accepts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * n + 64  # a socket and a pidfd per connection
    if soft < wanted:
        new_soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        if hard != resource.RLIM_INFINITY and hard < wanted:
            announce(f"open-file limit {hard} holds fewer than --max-connections {n}: raise it (ulimit -Hn)")


def serve(config: PoolConfig) -> int:
    """Create the arena, serve until SIGTERM/SIGINT, then remove socket and arena (unless config.keep)."""
    prepare_socket(config.socket)
    keep_freed_memory()
    allow_connections(config.max_connections)
    for path, nbytes in remove_stale_arenas(os.path.dirname(config.arena_path)):
        announce(f"removed {path} ({format_size(nbytes)} of memory), the arena of a pool that died without removing it")
    arena = Arena.create(config.arena_path, config.num_pages * config.page_size)
    try:
        set_group(arena.path, config.group)
        asyncio.run(PoolServer(config, arena).run())
    finally:
        arena.close(remove=not config.keep)
        if not config.keep and os.path.exists(config.socket):
            os.unlink(config.socket)
    return 0
