"""README.md as a newcomer uses it: its tables are valid GitHub markdown, the Pieces table lists every command, and
the hand deployment, run as written (tests/readme_blocks.py says what is rewritten), shows a pool hit on the second
replica and leaves nothing running."""

from __future__ import annotations

import argparse
import re

import pytest
from readme_blocks import README, block_after, completions, port_is_free, rewrite, run_block

from kvshare.cli import GROUPS, build

HAND_MARKER = "<!-- tests/test_readme.py runs this block"
CHUNK = 256


def tables(text: str) -> list[list[str]]:
    """Every markdown table of `text`, as its lines."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def cells(row: str) -> list[str]:
    """A table row's cells, split on the pipes that are not escaped (GitHub reads `\\|` as a | inside a cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def test_every_table_row_has_as_many_cells_as_its_header():
    for table in tables(README.read_text()):
        width = len(cells(table[0]))
        bad = [row for row in table if len(cells(row)) != width]
        assert not bad, f"rows whose cell count differs from the header's {width} (escape | as \\|): {bad}"


def commands(parser: argparse.ArgumentParser, prefix: str = "kvshare") -> set[str]:
    """Every runnable command line prefix: 'kvshare serve', 'kvshare pool stats', ..."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                nested = commands(subparser, f"{prefix} {name}")
                found |= nested or {f"{prefix} {name}"}
    return found


def listed_commands() -> set[str]:
    """The commands the README's Pieces table names: `kvshare bench pool\\|transfer ...` names each alternative."""
    text = README.read_text()
    section = text[text.index("## Pieces"):]
    table = tables(section)[0]
    listed = set()
    for row in table[2:]:
        words = cells(row)[0].strip("`").split()
        *group, choices = words[:3] if words[1] in GROUPS else words[:2]  # `kvshare GROUP a\|b` or `kvshare a`
        listed |= {" ".join([*group, choice]) for choice in choices.split("\\|")}
    return listed


def test_the_pieces_table_lists_every_command():
    missing = commands(build().parser) - listed_commands()
    assert not missing, f"commands the README's Pieces table does not list: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_hand_deployment_runs_as_written_and_shows_a_pool_hit(tmp_path):
    block = rewrite(block_after(HAND_MARKER), tmp_path, folders=("/tmp/kvshare", "models/small"))
    run = run_block(block.script, tmp_path / "block.log", timeout_s=600)
    assert run.returncode == 0, run.output[-6000:]
    first, second = completions(run.output)
    tokens = first["usage"]["prompt_tokens"]
    assert tokens > CHUNK  # a prompt shorter than one chunk could never hit
    assert first["usage"]["kvshare"]["pool_hit_tokens"] == 0  # replica A computed it
    # B loads every whole chunk at least, and the tail's whole blocks; never the last token, which it computes.
    assert (tokens - 1) // CHUNK * CHUNK <= second["usage"]["kvshare"]["pool_hit_tokens"] < tokens, run.output[-6000:]
    assert "hits / misses" in run.output  # the block's last step printed the pool's statistics
    assert not run.leftovers, f"the block left processes running: {run.leftovers}"
    assert not (block.folders["/tmp/kvshare"] / "pool.sock").exists()  # the pool shut down and removed its socket
    assert all(port_is_free(port) for port in block.ports.values())


def test_a_server_log_line_after_an_answer_does_not_hide_it():
    """The blocks' background servers share their output: a log line can land between curl's JSON and the `echo`
    that ends its line (CI, 2026-12-06). The answer is still read; lines that are not answers are not."""
    output = ('{"id":"a","usage":{"prompt_tokens":3}}INFO:     127.0.0.1:33804 - "GET /health HTTP/1.1" 200 OK\n'
              '{"chunks": 4}\n{not json\nINFO: {"id"\n{"id":"b","usage":{"prompt_tokens":3}}\n')
    assert [a["id"] for a in completions(output)] == ["a", "b"]
