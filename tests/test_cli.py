"""The `kvshare` command line as a user meets it: every option's default in --help, one-line errors (a missing model,
a busy port, a missing pool socket or socket directory, a missing optional dependency), `python -m kvshare`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.cli import build

TIMEOUT_S = 120


def kvshare(*args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m kvshare ARGS` in a child; each module named in `blocked` fails to import there, as if it were not
    installed."""
    argv = blocked_argv(blocked, *args) if blocked else [sys.executable, "-m", "kvshare", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)


def blocked_argv(blocked: tuple[str, ...], *args: str) -> list[str]:
    """`kvshare ARGS` where sys.modules[name] = None makes `import name` raise ModuleNotFoundError."""
    code = ("import sys\n"
            f"for name in {list(blocked)!r}: sys.modules[name] = None\n"
            "from kvshare.cli import main; sys.exit(main(sys.argv[1:]))\n")
    return [sys.executable, "-c", code, *args]


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error a command printed: exactly one line, no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def options(parser: argparse.ArgumentParser, name: str = "kvshare"):
    """(command, parser, action) for every option of every command, nested groups included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, subparser in action.choices.items():
                yield from options(subparser, f"{name} {sub_name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield name, parser, action


def test_every_option_shows_its_default_in_help():
    missing = [f"{command} {action.option_strings[-1]}" for command, _, action in options(build().parser)
               if not action.required and "default" not in (action.help or "")]
    assert not missing, f"options whose --help shows no default: {missing}"


def test_every_help_text_renders():
    """A default shown through %(default)s must format; a literal % in a help text would break --help."""
    parsers = {id(parser): parser for _, parser, _ in options(build().parser)}
    for parser in parsers.values():
        assert "default" in parser.format_help()


@pytest.mark.parametrize("command", ["serve", "route"])
def test_serve_and_route_say_they_both_default_to_port_8000(command):
    result = kvshare(command, "--help")
    assert result.returncode == 0, result.stderr
    port_help = " ".join(result.stdout.split("\n  --port PORT", 1)[1].split())
    assert port_help.startswith("port to listen on (default: 8000, which is also")
    assert "8001 and 8002" in port_help


def test_python_dash_m_kvshare_is_the_command():
    result = kvshare("--help")
    assert result.returncode == 0 and "pool" in result.stdout and "route" in result.stdout


def test_serve_with_a_missing_model_folder_prints_one_line(tmp_path):
    line = one_line_error(kvshare("serve", "--model", str(tmp_path / "nonexistent")))
    assert f"model folder {tmp_path / 'nonexistent'} not found" in line and "kvshare make-model" in line


def test_serve_with_no_load_waves_prints_one_line(tmp_path):
    line = one_line_error(kvshare("serve", "--model", str(tmp_path), "--pool", str(tmp_path / "pool.sock"),
                                  "--load-waves", "0"))
    assert "--load-waves must be >= 1" in line


def test_serve_with_a_folder_that_is_no_model_prints_one_line(tmp_path):
    line = one_line_error(kvshare("serve", "--model", str(tmp_path)))
    assert "has no config.json" in line


def test_serve_on_a_busy_port_fails_before_announcing_it(tiny_model):
    with busy_port() as port:
        result = kvshare("serve", "--model", str(tiny_model), "--port", str(port))
    line = one_line_error(result)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line
    assert "serving" not in result.stdout + result.stderr


def test_route_on_a_busy_port_fails_in_one_line():
    with busy_port() as port:
        line = one_line_error(kvshare("route", "--replica", "http://127.0.0.1:9", "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_pool_stats_on_a_missing_socket_suggests_starting_the_pool(tmp_path):
    socket_path = tmp_path / "pool.sock"
    line = one_line_error(kvshare("pool", "stats", "--socket", str(socket_path)))
    assert f"kvshare pool serve --socket {socket_path}" in line
    assert "--pool none" not in line  # a `kvshare serve` flag: no use to `pool stats`


def test_pool_serve_in_a_missing_directory_names_it(tmp_path):
    directory = tmp_path / "absent" / "kvshare"
    line = one_line_error(kvshare("pool", "serve", "--size", "64MiB", "--socket", str(directory / "pool.sock")))
    assert f"socket directory {directory} does not exist" in line and "Errno" not in line


def test_serve_warns_once_that_its_pool_socket_is_absent(tmp_path, caplog):
    from kvshare.serve.cli import warn_if_pool_absent

    missing = tmp_path / "pool.sock"
    with caplog.at_level(logging.WARNING):
        warn_if_pool_absent(str(missing))
        warn_if_pool_absent("none")
    assert [r.getMessage() for r in caplog.records] == [
        f"pool socket {missing} not found: serving with the cache OFF until `kvshare pool serve --socket {missing}` "
        "runs (or pass --pool none to run without a pool)"]


def test_serve_without_torch_says_which_extra_to_install(tiny_model):
    line = one_line_error(kvshare("serve", "--model", str(tiny_model), blocked=("torch",)))
    assert line == "kvshare serve: needs torch, which is not installed here: pip install 'kvshare[engine]'"


def test_pool_with_l2_without_redis_says_which_extra_to_install(tmp_path):
    result = kvshare("pool", "serve", "--size", "64MiB", "--socket", str(tmp_path / "pool.sock"),
                     "--l2", "redis://127.0.0.1:9", blocked=("redis",))
    line = one_line_error(result)
    assert line == "kvshare pool serve: needs redis, which is not installed here: pip install 'kvshare[l2]'"
    assert not list(tmp_path.iterdir())  # it stopped before creating anything


def test_the_pool_and_the_router_serve_where_torch_is_not_installed(tmp_path):
    """Not only their imports (tests/test_layering.py): a pool serves STATS and a router answers /health with every
    import of torch failing."""
    from kvshare.pool.client import read_stats
    from kvshare.processes import ManagedProcess, ServerProcess, free_port, wait_socket_ready

    socket_path = str(tmp_path / "pool.sock")
    pool = ManagedProcess("pool", blocked_argv(("torch",), "pool", "serve", "--size", "64MiB", "--socket",
                                               socket_path), log_path=tmp_path / "pool.log")
    try:
        wait_socket_ready(socket_path, pool, TIMEOUT_S)
        assert read_stats(socket_path).num_pages == 32
    finally:
        pool.stop()
    port = free_port()
    with ServerProcess(blocked_argv(("torch",), "route", "--replica", "http://127.0.0.1:9", "--port", str(port)),
                       port, "router") as router:
        assert "torch" not in router.log_text()


def test_torch_is_an_extra_not_a_dependency():
    """Installing kvshare for the pool or the router pulls no torch; `make` installs the extras the tests use."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("torch")]
    extras = project["optional-dependencies"]
    assert extras["engine"] == ["torch>=2.11"] and extras["l2"] == ["redis>=5"] and extras["vllm"] == ["vllm==0.32.0"]
    assert "pip install -q -e '.[engine,l2,dev]'" in (root / "Makefile").read_text()


def test_serve_asked_for_the_triton_kernels_without_a_gpu_says_what_they_need(tiny_model):
    """`--attention-backend triton` on a CPU (no Triton interpreter): one line naming what it needs, no traceback."""
    line = one_line_error(kvshare("serve", "--model", str(tiny_model), "--attention-backend", "triton"))
    assert "--attention-backend triton needs a CUDA device" in line, line
