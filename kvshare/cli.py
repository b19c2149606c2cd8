"""The `kvshare` command line: one parser, with each part of the project registering its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each module has `register(cli: CommandLine)` and adds its subcommands; handlers import heavy modules lazily
# so that `kvshare --help` stays fast.
COMMAND_MODULES = (
    "kvshare.pool.cli",  # kvshare pool serve|stats|check|bench
    "kvshare.serve.cli",  # kvshare serve
    "kvshare.engine.cli",  # kvshare make-model
    "kvshare.router.cli",  # kvshare route
    "kvshare.bench.cli",  # kvshare bench cross-replica|sessions|pool|transfer|router-overhead, kvshare demo
    "kvshare.validate.cli",  # kvshare validate transfer|service|soak|hostile
    "kvshare.advise.cli",  # kvshare advise
)
# The optional dependencies a command may need, by the top-level module it imports, and the extra that brings it.
EXTRAS = {"torch": "engine", "redis": "l2", "vllm": "vllm"}
GROUPS = {
    "pool": "the shared host-memory KV pool",
    "validate": "correctness checks: byte-exact transfers, service regression",
    "bench": "benchmarks: transfer, cross-replica TTFT, sessions",
}


class CommandLine:
    """The top-level parser and its command groups; modules add commands with `command()`."""

    def __init__(self) -> None:
        self.parser = argparse.ArgumentParser(prog="kvshare", description=__doc__)
        self.parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        self._top = self.parser.add_subparsers(dest="command", metavar="COMMAND")
        self._groups = {}
        for name, help_text in GROUPS.items():
            group = self._top.add_parser(name, help=help_text)
            group.set_defaults(run=lambda args, group=group: group.print_help() or 2)
            self._groups[name] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")

    def command(self, name: str, help: str, group: str | None = None) -> argparse.ArgumentParser:
        """A new subcommand parser: `kvshare NAME` or `kvshare GROUP NAME`. Set its handler with set_defaults(run=f)."""
        subparsers = self._groups[group] if group else self._top
        return subparsers.add_parser(name, help=help, description=help)


def build() -> CommandLine:
    cli = CommandLine()
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise  # a missing dependency, not a part of kvshare that is absent
            continue
        module.register(cli)
    show_defaults(cli.parser)
    return cli


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default, unless its text already says it: `(default: 8000)`; a flag that is
    off unless given shows `(default: off)`, an option with no value `(default: none)`. Required options and help
    texts that name a default themselves are left as written."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)
            continue
        help_text = action.help or ""
        if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                or "default" in help_text.lower()):
            continue
        action.help = f"{help_text} (default: {_shown_default(action)})".lstrip()


def _shown_default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0:  # store_true / store_false: the default is the flag not given
        return "off" if action.default in (False, None) else "on"
    if action.default in (None, "", []):
        return "none"
    return "%(default)s"  # argparse fills it in (and escapes nothing else in the text)


def main(argv: list[str] | None = None) -> int:
    cli = build()
    args = cli.parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not hasattr(args, "run"):
        cli.parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        command = " ".join(filter(None, ("kvshare", args.command, getattr(args, "subcommand", None))))
        print(f"{command}: needs {missing}, which is not installed here: pip install 'kvshare[{EXTRAS[missing]}]'",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
