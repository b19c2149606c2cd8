"""Who pays tmpfs's zeroing of a fresh arena (issue 19, pools of any size): the pool's preparation (default) or, with
`--no-fault-in`, the first process that touches each page. Pools of each kind alternate in one run (fault-in,
no-fault-in, no-fault-in, fault-in, ...); for each: the pool's time to ready, a first client's MAP_POPULATE of the
whole arena (what a GPU replica's cudaHostRegister does too: it faults every page in), and another first client's
first write of every 4 KiB page (a first store into fresh pages, without populate).

    .venv/bin/python experiments/arena_fault_in.py --size 2GiB --repeats 3 --out docs/results/arena-fault-in
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvshare.pool.client import PoolClient, read_stats
from kvshare.processes import kvshare_argv
from kvshare.units import parse_size


def one_pool(size: str, fault_in: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="fault-in-") as tmp:
        address, arena = os.path.join(tmp, "pool.sock"), f"/dev/shm/fault-in-{os.getpid()}.arena"
        argv = kvshare_argv("pool", "serve", "--size", size, "--socket", address, "--arena", arena,
                            "--page-size", "1MiB", *([] if fault_in else ["--no-fault-in"]))
        started = time.monotonic()
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ready = _wait_ready(address, started)
            t = time.perf_counter()
            PoolClient.connect(address, populate=True).close()
            populate = time.perf_counter() - t
            with PoolClient.connect(address) as client:  # its pages were populated by the other client: this is
                t = time.perf_counter()                  # the per-process page-table cost only
                client.pages[:, ::4096] = 1
                write_after_populate = time.perf_counter() - t
        finally:
            process.terminate()
            process.wait(30)
        return {"fault_in": fault_in, "ready_s": ready, "first_populate_s": populate,
                "later_first_write_s": write_after_populate}


def first_write(size: str, fault_in: bool) -> float:
    """A fresh pool's first client writing one byte of every 4 KiB page (no populate): a first store."""
    with tempfile.TemporaryDirectory(prefix="fault-in-") as tmp:
        address, arena = os.path.join(tmp, "pool.sock"), f"/dev/shm/fault-in-w-{os.getpid()}.arena"
        argv = kvshare_argv("pool", "serve", "--size", size, "--socket", address, "--arena", arena,
                            "--page-size", "1MiB", *([] if fault_in else ["--no-fault-in"]))
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(address, time.monotonic())
            with PoolClient.connect(address) as client:
                t = time.perf_counter()
                client.pages[:, ::4096] = 1
                return time.perf_counter() - t
        finally:
            process.terminate()
            process.wait(30)


def _wait_ready(address: str, started: float, timeout_s: float = 300.0) -> float:
    while time.monotonic() - started < timeout_s:
        try:
            if read_stats(address, timeout=1.0).ready:
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.02)
    raise TimeoutError(f"pool at {address} not ready after {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for r in range(args.repeats):
        for fault_in in ((True, False) if r % 2 == 0 else (False, True)):
            row = one_pool(args.size, fault_in) | {"first_write_s": first_write(args.size, fault_in), "repeat": r}
            rows.append(row)
            print(row, flush=True)
    gib = parse_size(args.size) / 2**30
    lines = [f"Arena fault-in, {args.size}, {args.repeats} pools of each kind alternating; "
             f"the build machine ({os.cpu_count()} cores); medians (min-max) in seconds", "",
             "| preparation | pool ready | first client's MAP_POPULATE | s/GiB | first client's first write of "
             "every page | another client's first write |", "| --- | --- | --- | --- | --- | --- |"]
    summary = {}
    for fault_in in (True, False):
        mine = [row for row in rows if row["fault_in"] == fault_in]
        cell = {k: (statistics.median(row[k] for row in mine), min(row[k] for row in mine),
                    max(row[k] for row in mine)) for k in ("ready_s", "first_populate_s", "first_write_s",
                                                           "later_first_write_s")}
        summary["fault-in" if fault_in else "no-fault-in"] = cell

        def fmt(key, cell=cell):
            m, lo, hi = cell[key]
            return f"{m:.3f} ({lo:.3f}-{hi:.3f})"

        lines.append(f"| {'fault-in (default)' if fault_in else '--no-fault-in'} | {fmt('ready_s')} | "
                     f"{fmt('first_populate_s')} | {cell['first_populate_s'][0] / gib:.3f} | {fmt('first_write_s')} | "
                     f"{fmt('later_first_write_s')} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"size": args.size, "rows": rows, "summary": summary,
                                                       "cpus": os.cpu_count()}, indent=1))
    (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
