"""The ``chameleon`` command.

Each sub-command lives in its own module of this package (``prepare-data`` in
``prepare_data_cmd``) with two functions, ``add_arguments(parser)`` and ``run(args) ->
int``; modules are imported only when their command runs, so ``chameleon estimate`` never
pays for importing torch.

Bad input raises ``ValueError`` anywhere below; it is printed as one line on stderr and the
command exits with status 2. No traceback reaches the user.

Every command takes ``--log-level`` (``debug``, ``info``, ``warning``, ``error``): the
package's ``logging`` records are shown on stderr at that level (``chameleon train`` and
``chameleon worker`` choose their own streams: the lines they have always printed, where
they printed them). Handlers are configured here and nowhere in the library
(``chameleon_ft.logs``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from chameleon_ft import logs

COMMANDS: dict[str, str] = {
    "estimate": "Estimate step time, throughput and memory of a job, failure-free or rerouted.",
    "plan": "Decide how to recover from a failure: every candidate, priced, and the choice.",
    "simulate": "Replay failure traces against every policy side by side.",
    "trace": "Import a public fault trace (node faults, straggler timings) as a trace.",
    "train": "Train a GPT on worker processes and survive killed or hung workers.",
    "worker": "Join a running `chameleon train` from another host.",
    "prepare-data": "Tokenize local text or JSONL files into a token file for training.",
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (imports every command module)."""
    parser = _Parser(prog="chameleon", description="Adaptive fault tolerance for LLM training.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        module = _command_module(name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        add_log_level(p)
    return parser


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, common to every command."""
    parser.add_argument("--log-level", choices=tuple(logs.LEVELS), default=logs.DEFAULT_LEVEL,
                        help="the least severe messages shown: debug adds each worker's and "
                             "the coordinator's inner steps, with time, level and worker; "
                             f"warning and error show fewer (default {logs.DEFAULT_LEVEL})")


def _command_module(name: str) -> Any:
    """The module of sub-command ``name``."""
    return importlib.import_module(f"chameleon_ft.cli.{name.replace('-', '_')}_cmd")


def _version() -> str:
    from chameleon_ft import __version__

    return f"chameleon {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``chameleon`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if command in COMMANDS:
        # Import only the command that runs.
        parser = _Parser(prog="chameleon")
        sub = parser.add_subparsers(dest="command", parser_class=_Parser)
        module = _command_module(command)
        p = sub.add_parser(command, help=COMMANDS[command], description=COMMANDS[command])
        module.add_arguments(p)
        add_log_level(p)
    else:
        parser = build_parser()
        module = None
    args = parser.parse_args(args_list)
    if module is None:
        parser.print_help()
        return EXIT_USAGE if args_list and args_list[0] not in ("-h", "--help") else 0
    logs.configure(args.log_level, sys.stderr)
    try:
        return int(module.run(args))
    except ValueError as exc:
        print(f"chameleon {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"chameleon {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
