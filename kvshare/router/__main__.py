"""`python -m kvshare.router ARGS` runs `kvshare route ARGS` without importing the project's other parts."""

import logging
import sys

from kvshare.cli import CommandLine
from kvshare.router.cli import register


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cli = CommandLine()
    register(cli)
    args = cli.parser.parse_args(["route", *(sys.argv[1:] if argv is None else argv)])
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
