"""Fixtures: three stub replicas shared by a module, and a factory for routers (and extra replicas) that stops
every process it started, even when the test fails."""

from __future__ import annotations

import pytest

from .servers import ServerProcess, router, stub_replica


@pytest.fixture(scope="module")
def replicas():
    started: list[ServerProcess] = []
    try:
        for name in ("A", "B", "C"):
            started.append(stub_replica(name).start())
        yield started
    finally:
        for process in started:
            process.stop()


@pytest.fixture
def launch():
    """launch(server) starts a ServerProcess and stops it at the end of the test."""
    started: list[ServerProcess] = []

    def start(server: ServerProcess) -> ServerProcess:
        started.append(server)
        return server.start()

    yield start
    for process in reversed(started):
        process.stop()


@pytest.fixture
def make_router(launch):
    def make(replica_urls, policy="round-robin", *extra):
        return launch(router(list(replica_urls), policy, *extra))

    return make
