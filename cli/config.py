"""`kvwatch config check`: load a config file as `kvwatch serve` would, and say what it configures."""

from __future__ import annotations

import argparse
import sys

from kvwatch.cli.options import command
from kvwatch.config.settings import ConfigError, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser(
        "config", help="check a kvwatch config file", description="Work with the kvwatch config file."
    )
    commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = command(
        commands,
        "check",
        run_check,
        help="check a config file and exit",
        description="Load a config file as `kvwatch serve` would. Print OK and what it configures, or "
        "the first error with its key's path and exit 1.",
    )
    check.add_argument("file", metavar="FILE", help="the YAML config, e.g. examples/kvwatch.lab.yaml")


def run_check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 1
    targets, logs = _count(len(config.targets), "target"), _count(len(config.gateway_logs), "gateway log")
    print(f"{args.file}: OK ({targets}, {logs})")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
