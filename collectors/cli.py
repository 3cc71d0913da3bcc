"""The `kvwatch` command."""

from __future__ import annotations

import argparse
import sys

from collectors import scrape
from lab import cli as lab_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="Watch whether a multi-replica LLM cluster keeps each conversation on the "
        "replica that holds its KV cache.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    lab_cli.add_parser(commands)
    scrape.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
