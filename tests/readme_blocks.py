"""The README's shell blocks as the tests run them: each found by the HTML comment above it, run with bash from the
repository's root as a user pastes it, with only its ports and folders rewritten to fresh ones, bounded in time,
and checked to leave nothing running.

What is rewritten, and nothing else: the ports 8000, 8001 and 8002 (wherever they appear: `--port 8001`,
`localhost:8001`, `http://127.0.0.1:8001`) become unused ones, and each folder in `folders` (e.g. /tmp/kvshare,
models/small) becomes one under the test's temporary directory, so that a run never touches a user's files or a
deployment already on those ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_PORTS = (8000, 8001, 8002)
STOP_GRACE_S = 60.0  # a vLLM replica takes a while to stop its engine processes after its server exits


def block_after(marker: str, readme: Path = README) -> str:
    """The ```bash block that follows the line starting with `marker` (an HTML comment naming the test)."""
    text = readme.read_text()
    start = text.index(marker)
    fence = text.index("```bash\n", start) + len("```bash\n")
    return text[fence:text.index("\n```", fence) + 1]


@dataclass(frozen=True)
class Rewritten:
    script: str
    ports: dict[int, int]  # README port -> the port the test uses
    folders: dict[str, Path]  # README folder -> the folder the test uses


def rewrite(block: str, tmp: Path, folders: tuple[str, ...]) -> Rewritten:
    ports = dict(zip(README_PORTS, unclaimed_ports(len(README_PORTS))))
    script = re.sub(r"\b(800[0-2])\b", lambda m: str(ports[int(m.group(1))]), block)
    moved = {}
    for i, folder in enumerate(folders):
        moved[folder] = tmp / f"folder{i}" / Path(folder).name
        assert folder in script, f"{folder} is not in the README block any more: update the test"
        script = script.replace(folder, str(moved[folder]))
    return Rewritten(script, ports, moved)


def unclaimed_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on now, below the kernel's ephemeral range: a block binds its ports many
    seconds after they are chosen (vLLM replicas start after setup), and in the ephemeral range any outgoing
    connection of the machine may take one meanwhile (kvshare.processes.free_port's ports come from there)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chooser = random.Random()
    while True:
        ports = chooser.sample(range(10000, low), n)
        if all(port_is_free(port) for port in ports):
            return ports


@dataclass(frozen=True)
class BlockRun:
    returncode: int
    output: str
    leftovers: list[str]  # processes of the block still alive after it ended and a grace period (killed since)


def run_block(script: str, log: Path, timeout_s: float, env: dict[str, str] | None = None) -> BlockRun:
    """bash -c SCRIPT from the repository's root, in a process group of its own (a non-interactive shell keeps its
    background jobs in it), output to `log`. On timeout the whole group is killed and the run fails."""
    with log.open("wb") as out:
        shell = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, **(env or {})})
        try:
            returncode = shell.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(shell.pid)
            shell.wait()
            raise AssertionError(f"the README block ran over {timeout_s:.0f} s; its output:\n"
                                 f"{log.read_text(errors='replace')[-6000:]}") from None
    leftovers = _wait_group_empty(shell.pid, STOP_GRACE_S)
    if leftovers:
        _kill_group(shell.pid)
    return BlockRun(returncode, log.read_text(errors="replace"), leftovers)


def _group_members(pgid: int) -> list[str]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
                members.append(f"{stat.parent.name}: {(stat.parent / 'cmdline').read_bytes()[:200]!r}")
    return members


def _wait_group_empty(pgid: int, grace_s: float) -> list[str]:
    deadline = time.monotonic() + grace_s
    while (members := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return members


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def completions(output: str) -> list[dict]:
    """The completions (JSON objects with "usage") a block's `ask` printed, in order. Each is read from the start of
    its line and what follows it on that line is ignored: the block's background servers share its output, and a
    log line of theirs can land between curl's body and the `echo` that ends it (CI, 2026-12-06: a /health access
    line right after the JSON)."""
    found = []
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        try:
            answer, _ = json.JSONDecoder().raw_decode(line)
        except json.JSONDecodeError:
            continue
        if isinstance(answer, dict) and "usage" in answer:
            found.append(answer)
    return found
