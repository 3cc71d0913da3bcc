"""`kvwatch config check`: load a config file and run every check `kvwatch serve` runs before it starts
(serve.startup), and say what it configures."""

from __future__ import annotations

import argparse
import sys

from kvwatch.cli.options import command
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.serve import startup


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
        description="Load a config file and run every check `kvwatch serve` runs before it starts, on this "
        "machine: the keys and values of the file, the environment variables and files that hold its "
        "secrets, the ShareGPT files, the exporter's address (it must be free to bind) and the store "
        "(opened, and created when missing, as serve does). Print OK and what it configures, or every "
        "problem, one a line, as serve would say it, and exit 1.",
    )
    check.add_argument("file", metavar="FILE", help="the YAML config, e.g. examples/kvwatch.lab.yaml")
    mode = check.add_mutually_exclusive_group()
    mode.add_argument(
        "--online",
        action="store_true",
        help="also ask the network: each target lists its model (GET <base_url>/models with its key), "
        "Prometheus answers a query, Alertmanager its status",
    )
    mode.add_argument(
        "--file-only",
        action="store_true",
        help="check the file alone (keys, types, ranges), for a config that runs on another machine",
    )


def run_check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 1
    problems = []
    if not args.file_only:
        try:
            prepared = startup.prepare(config, listen=True)
        except startup.StartRefused as refused:
            problems = refused.problems
        else:
            prepared.store.close()
            if args.online:
                problems = startup.online_problems(config, prepared.api_keys)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    targets, logs = _count(len(config.targets), "target"), _count(len(config.gateway_logs), "gateway log")
    checked = "; the file only" if args.file_only else "; every service answers" if args.online else ""
    print(f"{args.file}: OK ({targets}, {logs}{checked})")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
