"""The soak's fault injector: kill and restart the pool, kill a replica mid-stream and restart it, fill the arena,
stall a client holding leases until it dies, and stop a writer (a reader) right after RESERVE (LOOKUP) until its
lease has expired and others have stored, then let it finish its copy (I10). Run as `python -m
kvshare.validate.faults stall|stall-writer|stall-reader ADDRESS` it is one of those stalled clients.

Every fault is recorded with its time window, so a request that failed can be classified: only a request in
flight on a killed replica may be lost; any other failure is an error of the system under test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from kvshare.keys import synthetic_keys, tool_namespace
from kvshare.validate.deployment import SoakDeployment

STALLER_REPORT_TIMEOUT_S = 30.0
KINDS = ("pool_restart", "replica_kill", "fill_arena", "stall_client", "stall_writer", "stall_reader")
STALL_NAMESPACE = tool_namespace("soak-staller")
# What a resumed stalled writer or reader may say (its last line); anything else is a fence violation.
FENCE_KEPT = {"stall_writer": "lease_expired", "stall_reader": "same"}
FILL_NAMESPACE = tool_namespace("soak-filler")


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
        self.fence_violations = 0  # stalled writers whose late COMMIT was accepted, readers whose pages changed
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


    def _stall_writer(self, n: int) -> tuple[str, str]:
        return self._stopped_client("stall-writer", "stall_writer")

    def _stall_reader(self, n: int) -> tuple[str, str]:
        return self._stopped_client("stall-reader", "stall_reader")

    def _stopped_client(self, mode: str, kind: str) -> tuple[str, str]:
        """A client process that stops itself (SIGSTOP) holding a fresh lease; resumed once the lease has expired
        while the workload went on storing (so the pool had every chance to hand its pages on), it finishes its copy
        and reports whether the fence held."""
        process = subprocess.Popen([sys.executable, "-m", "kvshare.validate.faults", mode, self.d.pool_socket],
                                   stdout=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([process.stdout], [], [], STALLER_REPORT_TIMEOUT_S)
            held = process.stdout.readline().strip() if ready else ""
            time.sleep(self.d.config.lease_timeout_s + 2.0)
            process.send_signal(signal.SIGCONT)
            ready, _, _ = select.select([process.stdout], [], [], STALLER_REPORT_TIMEOUT_S)
            verdict = process.stdout.readline().strip() if ready else "no answer"
        finally:
            process.kill()
            process.wait()
        if not held:
            return "pool", f"{mode} never got its lease (pool busy or restarting)"
        if verdict != FENCE_KEPT[kind]:
            self.fence_violations += 1
            return "pool", f"FENCE VIOLATED: {held}, resumed: {verdict}"
        return "pool", f"{held}, resumed: {verdict}"


def _junk_chunks(namespace: bytes, tag: str, count: int, nbytes: int):
    from kvshare.pool.client import NewChunk

    keys = synthetic_keys(tag, count)
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


def stall_writer(address: str) -> None:
    """RESERVE a few pages, report, stop; once continued, write noise into every reserved page, then COMMIT and
    print the outcome ("lease_expired" when the pool fenced the expired lease, "committed" if it accepted it)."""
    from kvshare.pool.client import PoolClient, PoolError

    with PoolClient.connect(address) as client:
        client.hello(STALL_NAMESPACE, "soak stalled writer")
        r = client.reserve(STALL_NAMESPACE, _junk_chunks(STALL_NAMESPACE, f"writer-{os.getpid()}", 4, client.page_size))
        print(f"reserved {sum(ref is not None for ref in r.chunks)} pages", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        noise = np.random.default_rng(os.getpid()).integers(0, 256, client.page_size, dtype=np.uint8)
        for ref in r.chunks:
            client.write(ref, noise)
        try:
            client.commit(r.lease, [0] * len(r.chunks))
            print("committed", flush=True)
        except PoolError as error:
            print(error.code, flush=True)


def stall_reader(address: str) -> None:
    """Store a few chunks, LOOKUP them (read lease), read them, report, stop; once continued, read again and print
    "same" if the bytes did not change under the lease (the fence kept them from eviction and reuse), else
    "changed"."""
    from kvshare.pool.client import PoolClient

    with PoolClient.connect(address) as client:
        client.hello(STALL_NAMESPACE, "soak stalled reader")
        chunks = _junk_chunks(STALL_NAMESPACE, f"reader-{os.getpid()}", 4, client.page_size)
        r = client.reserve(STALL_NAMESPACE, chunks)
        for ref in r.chunks:
            client.write(ref, os.urandom(client.page_size))
        client.commit(r.lease, [0] * len(r.chunks))
        found = client.lookup(STALL_NAMESPACE, [c.key for c in chunks], [b""] * len(chunks))
        before = [client.read(ref).tobytes() for ref in found.chunks]
        print(f"read-leased {len(found.chunks)} pages", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        after = [client.read(ref).tobytes() for ref in found.chunks]
        print("same" if after == before else "changed", flush=True)
        client.release(found.lease)


if __name__ == "__main__":
    {"stall": stall, "stall-writer": stall_writer, "stall-reader": stall_reader}[sys.argv[1]](sys.argv[2])
