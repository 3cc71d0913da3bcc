"""The `kvwatch` command."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from collectors import config, doctor, experiment, probe, scheduler, scrape
from dashboard import cli as dashboard_cli
from lab import cli as lab_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="Watch whether a multi-replica LLM cluster keeps each conversation on the "
        "replica that holds its KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    lab_cli.add_parser(commands)
    scrape.add_parser(commands)
    probe.add_parser(commands)
    config.add_parser(commands)
    scheduler.add_parser(commands)
    experiment.add_parser(commands)
    doctor.add_parser(commands)
    dashboard_cli.add_parser(commands)
    return parser


def version() -> str:
    """The installed distribution's version: what pip and a bug report name."""
    try:
        return metadata.version("kvwatch")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
