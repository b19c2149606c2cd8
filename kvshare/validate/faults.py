"""The soak's fault injector: kill and restart the pool, kill a replica mid-stream and restart it, fill the arena,
and stall a client holding leases until it dies. Run as `python -m kvshare.validate.faults stall ADDRESS` it is
that stalled client.

Every fault is recorded with its time window, so a request that failed can be classified: only a request in
flight on a killed replica may be lost; any other failure is an error of the system under test.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import xxhash

from kvshare.validate.deployment import SoakDeployment

STALLER_REPORT_TIMEOUT_S = 30.0
KINDS = ("pool_restart", "replica_kill", "fill_arena", "stall_client")
STALL_NAMESPACE = xxhash.xxh3_128_digest(b"kvshare/soak-staller")
FILL_NAMESPACE = xxhash.xxh3_128_digest(b"kvshare/soak-filler")


@dataclass(frozen=True)
class Fault:
    kind: str
    started: float
    ended: float
    target: str = ""
    detail: str = ""


class Injector:
    """Injects one fault every `period_s`, cycling through KINDS, until stopped; `faults` is the record."""

    def __init__(self, deployment: SoakDeployment, period_s: float) -> None:
        self.d, self.period_s = deployment, period_s
        self.faults: list[Fault] = []
        self.lost_by_injector = 0  # the injector's own mid-stream requests on killed replicas
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join()

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(self.period_s):
            kind = KINDS[n % len(KINDS)]
            started = time.monotonic()
            target, detail = getattr(self, f"_{kind}")(n)
            self.faults.append(Fault(kind, started, time.monotonic(), target, detail))
            n += 1

    def _pool_restart(self, n: int) -> tuple[str, str]:
        self.d.kill_pool()
        time.sleep(1.0)  # replicas see the pool gone and serve without it meanwhile
        self.d.start_pool()
        from kvshare.pool.client import read_stats

        chunks = read_stats(self.d.pool_socket).chunks  # a restarted pool must start empty (replicas may have stored)
        return "pool", f"life {self.d.pool_lives}, {chunks} chunks when first asked"

    def _replica_kill(self, n: int) -> tuple[str, str]:
        name = "ab"[(n // len(KINDS)) % 2]
        got = self._kill_mid_stream(name)
        self.d.start_replica(name)
        return name, f"killed after {got} streamed events of an open request"

    def _kill_mid_stream(self, name: str) -> int:
        """Open a long stream directly on the replica, read a few events, then SIGKILL the replica under it."""
        body = {"prompt": list(range(100, 400)), "max_tokens": 2000, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        got = 0
        try:
            with httpx.stream("POST", f"{self.d.url(name)}/v1/completions", json=body, timeout=60,
                              trust_env=False) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue  # the blank lines between SSE events
                    got += 1
                    if got == 3:
                        self.d.kill_replica(name)
                        self.lost_by_injector += 1
        except httpx.HTTPError:
            pass  # the connection died with the replica: that is the fault
        self.d.kill_replica(name)  # if the stream ended first, still kill it
        return got

    def _fill_arena(self, n: int) -> tuple[str, str]:
        from kvshare.pool.client import PoolClient, PoolError

        with PoolClient.connect(self.d.pool_socket) as client:
            client.hello(FILL_NAMESPACE, "soak arena filler")
            page, batch = client.page_size, 8
            stored = 0
            for i in range(0, 2 * client.num_pages, batch):
                chunks = _junk_chunks(FILL_NAMESPACE, f"{n}-{i}", batch, page)
                try:
                    r = client.reserve(FILL_NAMESPACE, chunks)
                except PoolError as error:
                    return "pool", f"stored {stored} junk pages, then {error.code}"
                for ref in r.chunks:
                    client.write(ref, os.urandom(16) * (page // 16))
                client.commit(r.lease, [0] * len(r.chunks))
                stored += len(r.chunks)
            stats = client.stats()
        return "pool", f"stored {stored} junk pages ({stats.pages_free} free, {stats.evictions} evictions so far)"

    def _stall_client(self, n: int) -> tuple[str, str]:
        """A client process that pins pages under read leases and never answers again; killed after the lease
        timeout has passed (so both expiry and the connection drop end its leases, I8)."""
        staller = subprocess.Popen([sys.executable, "-m", "kvshare.validate.faults", "stall", self.d.pool_socket],
                                   stdout=subprocess.PIPE, text=True)
        try:
            # Bounded: a staller stuck before it reports is killed below like one that reported.
            ready, _, _ = select.select([staller.stdout], [], [], STALLER_REPORT_TIMEOUT_S)
            report = json.loads(staller.stdout.readline() or "{}") if ready else {}
            time.sleep(self.d.config.lease_timeout_s + 1.0)
        finally:
            staller.kill()
            staller.wait()
        return "pool", f"staller held {report.get('leased_pages', '?')} pages in {report.get('leases', '?')} leases"


def _junk_chunks(namespace: bytes, tag: str, count: int, nbytes: int):
    from kvshare.pool.client import NewChunk

    keys = [xxhash.xxh3_128_digest(f"{tag}-{i}".encode()) for i in range(count)]
    return [NewChunk(k, namespace if i == 0 else keys[i - 1], b"", nbytes) for i, k in enumerate(keys)]


def stall(address: str) -> None:
    """Store a few chunks, then LOOKUP them again and again (never releasing) until the pool's per-client limit
    shortens the answer to nothing; report what is held and hang."""
    from kvshare.pool.client import PoolClient

    client = PoolClient.connect(address)
    client.hello(STALL_NAMESPACE, "soak staller")
    chunks = _junk_chunks(STALL_NAMESPACE, f"stall-{os.getpid()}", 4, client.page_size)
    r = client.reserve(STALL_NAMESPACE, chunks)
    client.commit(r.lease, [0] * len(chunks))
    keys, tokens = [c.key for c in chunks], [b""] * len(chunks)
    leases = 0
    while client.lookup(STALL_NAMESPACE, keys, tokens).chunks and leases < client.num_pages:
        leases += 1
    print(json.dumps({"leases": leases, "leased_pages": leases * len(chunks)}), flush=True)
    threading.Event().wait()  # stalled: holds its leases and its connection until killed


if __name__ == "__main__":
    if sys.argv[1:2] == ["stall"]:
        stall(sys.argv[2])
