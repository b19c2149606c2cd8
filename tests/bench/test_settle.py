"""LocalDeployment.settle against a real pool: it returns only once no reservation is left uncommitted, so the
measured request after a warm one finds everything the warm one stored."""

import threading
import time
from pathlib import Path

from kvshare.bench.deploy import LocalConfig, LocalDeployment
from kvshare.pool.client import PoolClient, checksum
from kvshare.pool.testing import start_pool
from tests.pool.conftest import NS, PAGE, new_chunks, prompt, random_bytes


def test_settle_waits_for_the_commit_of_an_open_reservation(tmp_path):
    with start_pool("8MiB", page_size=PAGE) as (address, _):
        deployment = LocalDeployment(LocalConfig(model_dir=Path("unused"), log_dir=tmp_path))
        deployment.pool_socket, deployment.arm, deployment.pool = address, "ON", object()  # the pool started above
        keys, tokens = prompt(2, seed=1)
        data = [random_bytes(PAGE, seed=i) for i in range(2)]
        with PoolClient.connect(address) as client:
            client.hello(NS, "writer")
            reservation = client.reserve(NS, new_chunks(keys, tokens, PAGE))
            for ref, chunk in zip(reservation.chunks, data):
                client.write(ref, chunk)
            deployment.arm = "OFF"
            off = threading.Thread(target=deployment.settle, kwargs=dict(timeout_s=30))
            off.start()
            off.join(10)
            # the OFF arm's replicas use no pool: nothing to wait for, open reservation or not
            assert not off.is_alive()
            deployment.arm = "ON"
            settled = threading.Event()
            waiter = threading.Thread(target=lambda: (deployment.settle(timeout_s=30), settled.set()))
            waiter.start()
            time.sleep(0.5)
            assert not settled.is_set()  # the reservation is still open
            client.commit(reservation.lease, [checksum(d) for d in data])
            waiter.join(10)
            assert settled.is_set()
            assert len(client.lookup(NS, keys, tokens).chunks) == 2
    deployment.settle(timeout_s=5)  # the pool is gone: nothing left to commit, and the benchmark goes on
    deployment._tmp.cleanup()
