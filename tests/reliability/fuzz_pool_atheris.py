"""Coverage-guided fuzzing of the pool's frame handler with atheris (libFuzzer): any body must get exactly one
non-internal reply and leave the pool consistent. `python -m tests.reliability.fuzz_pool_atheris -runs=N`."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvshare.pool import protocol as _protocol  # noqa: F401
    from kvshare.pool import state as _state  # noqa: F401  (instrumented for coverage)

from tests.reliability.pool_harness import Harness  # noqa: E402

HARNESS = Harness()


def one_input(data: bytes) -> None:
    client = data[0] % 2 if data else 0
    HARNESS.handle(data[1:], client)
    if data[:1] == b"\xff":
        HARNESS.drop(client)


def main() -> None:
    try:
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()
    finally:
        HARNESS.close()


if __name__ == "__main__":
    main()
