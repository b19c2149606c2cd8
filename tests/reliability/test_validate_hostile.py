"""`kvshare validate hostile` against a local deployment (a pool with a loopback TCP listener, a `kvshare serve`
replica of the tiny model on it and a `kvshare route` in front, with short timeouts): every attack, the pool's and a
small flood included, is handled and the command exits 0; against a server without the defences (the router's stub
replica) the same attacks are reported NOT HANDLED."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvshare.pool.testing import start_pool
from kvshare.processes import free_port
from kvshare.router.local import router, stub_replica
from kvshare.validate.hostile import ATTACKS, probe_for, run_attacks
from kvshare.validate.pool_attacks import POOL_ATTACKS

from .conftest import kvshare_serve, running

pytestmark = pytest.mark.slow  # ~30 s: 33 attacks, five of which wait for a server's timeout
SHORT = ("--header-timeout", "1", "--body-timeout", "1", "--write-timeout", "1", "--send-buffer", "16KiB",
         "--max-body-size", "1MiB")


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    token, pool_token = tmp / "admin-token", tmp / "pool-token"
    token.write_text("validate-hostile-token")
    pool_token.write_text("validate-hostile-pool-token")
    tcp = f"127.0.0.1:{free_port()}"
    with start_pool("256MiB", tcp=tcp, token_file=pool_token, auth_timeout=2.0, check_integrity=False) as (pool, _):
        with running(kvshare_serve(tiny_model, pool, *SHORT)) as (replica,):
            with running(router([replica.url], "round-robin", "--admin-token-file", str(token), *SHORT)) as (routed,):
                yield replica.url, routed.url, pool, tcp


def test_validate_hostile_passes_against_a_defended_deployment(deployment):
    replica, routed, pool, tcp = deployment
    done = subprocess.run([sys.executable, "-m", "kvshare.cli", "validate", "hostile", "--replica", replica,
                           "--router", routed, "--pool", pool, "--pool-tcp", tcp, "--flood", "200",
                           "--flood-seconds", "3", "--patience", "8", "--body-size", "8MiB"],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "COLUMNS": "200"})
    report = done.stdout
    assert done.returncode == 0, report + done.stderr[-3000:]
    flood_rows = 3  # pool memory, innocent STATS p99, innocent failures
    expected_rows = (sum(len(attack.targets & {"replica", "router"}) for attack in ATTACKS) + len(POOL_ATTACKS)
                     + flood_rows)
    assert f"{expected_rows} of {expected_rows} attacks handled" in report
    assert "NOT HANDLED" not in report
    for attack in (*ATTACKS, *POOL_ATTACKS):
        assert attack.name in report


def test_validate_hostile_reports_a_server_without_defences():
    """The negative control: the stub replica validates nothing and answers everything 200."""
    fast = tuple(a for a in ATTACKS if a.name in ("NaN temperature", "out-of-range sampling", "lone surrogate in JSON",
                                                  "chunked body past the limit"))
    with running(stub_replica("S")) as (stub,):
        rows = run_attacks([probe_for("replica", stub.url, patience_s=5, body_bytes=1 << 20)], fast)
    assert [row.handled for row in rows] == [False, False, False, False]
    assert "200" in rows[0].observed
