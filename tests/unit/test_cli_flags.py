"""Pins the ``chameleon`` command's sub-commands and flags: a change here is a change to
the user interface, and should be deliberate (update the README too)."""

from __future__ import annotations

import argparse

from chameleon_ft.cli import COMMANDS, build_parser

FLAGS = {
    "estimate": {"--config", "--fail", "--json"},
    "plan": {"--config", "--fail", "--horizon-s", "--json", "--node-mtbf-hours", "--policy",
             "--slow", "--slow-policy"},
    "simulate": {"--config", "--days", "--job", "--jobs", "--json", "--memory-checkpoint",
                 "--no-repair", "--node-mtbf-hours", "--spare-nodes",
                 "--out", "--policies", "--repair-hours", "--save-trace", "--scenario", "--seed",
                 "--seeds", "--slow-policy", "--trace"},
    "trace": {"--days", "--degraded-factor", "--format", "--input", "--min-steps",
              "--num-nodes", "--out", "--threshold", "--workers-per-node"},
    "train": {"--config", "--drain-timeout", "--dtype", "--fault", "--host", "--job-name",
              "--json",
              "--log-every", "--out",
              "--policy", "--port", "--rejoin", "--remote-workers", "--resume",
              "--slow-policy", "--steps", "--tensorboard", "--token", "--trace", "--workers"},
    "worker": {"--address", "--advertise-address", "--connect-timeout", "--coordinator",
               "--drain-timeout", "--job", "--num-workers", "--token"},
    "prepare-data": {"--input", "--out", "--tokenizer"},
}


COMMON = {"--log-level"}
"""Flags every command takes (``chameleon_ft.cli.add_log_level``)."""


def test_commands_and_flags_are_pinned() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS) == set(FLAGS)
    for name, command in sub.choices.items():
        flags = {o for a in command._actions for o in a.option_strings} - {"-h", "--help"}
        assert flags == FLAGS[name] | COMMON, name


def test_required_flags() -> None:
    parser = build_parser()
    for argv in (["estimate"], ["plan", "--config", "x.toml"], ["train"],
                 ["plan", "--config", "x.toml", "--fail", "1", "--slow", "2:2"],
                 ["trace", "import", "--format", "node-json", "--input", "x.json"],
                 ["trace", "--format", "node-json", "--input", "x.json", "--out", "y.csv"],
                 ["prepare-data", "--tokenizer", "t", "--out", "o.bin"]):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2
        else:  # pragma: no cover - the assertion below explains
            raise AssertionError(f"{argv} parsed without its required flags")
