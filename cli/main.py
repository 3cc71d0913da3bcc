"""The `kvwatch` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Every command's module under kvwatch.cli, in the order `kvwatch --help` lists them. A command imports only
# its own module: each lab replica and simulated user is a `kvwatch lab ...` process, and importing every
# command (psycopg, requests, the probe, the doctor) would double what starting one costs.
COMMANDS = (
    "init", "lab", "scrape", "probe", "config", "serve", "experiment", "doctor", "dashboard", "generate",
    "completion",
)  # fmt: skip

# What each command's exit code means, in one place: under the command's --help and in docs/probing.md, for
# the scripts and CI jobs that branch on it. argparse exits 2 on an unknown option or a missing argument.
BAD_ARGUMENTS = "2 on bad arguments"
NO_MODEL = "or without --model when GET <base URL>/models does not list exactly one model"
EXIT_CODES = {
    "lab replica": f"0 after SIGINT or SIGTERM; 1 when its port is taken; {BAD_ARGUMENTS}",
    "lab traffic": f"0 after SIGINT or SIGTERM; {BAD_ARGUMENTS}",
    "lab up": "0 once the lab is up (--detach) or after a stop (in the foreground); 1 when options conflict "
    f"or the lab cannot start or stop, the reason on stderr; {BAD_ARGUMENTS}; 130 when interrupted while "
    "starting (everything started is stopped)",
    "lab down": f"0 once every process of the lab is stopped; 1 when there is no lab there; {BAD_ARGUMENTS}",
    "lab status": f"0 with the lab's URLs; 1 when there is no lab there; {BAD_ARGUMENTS}",
    "lab fault": "0 once the fault is in effect; 1 when there is no lab there, no such replica, or the fault "
    f"did not take effect; {BAD_ARGUMENTS}",
    "lab heal": f"0 once every fault is undone; 1 when there is no lab there or one is not; {BAD_ARGUMENTS}",
    "scrape": "0 when every source was read; 1 when one was not (the others are still reported); "
    f"{BAD_ARGUMENTS}",
    "probe": f"0 when every session succeeded; 1 when one failed; {BAD_ARGUMENTS}, {NO_MODEL}",
    "config check": "0 when the file is a valid config; 1 when it is not, the first error on stderr; "
    f"{BAD_ARGUMENTS}",
    "serve": "0 after SIGINT or SIGTERM; 1 when the config or the store cannot be used or the exporter "
    f"cannot listen; {BAD_ARGUMENTS}",
    "experiment": "0 when it ran, whatever it found; 1 when every session failed; "
    f"{BAD_ARGUMENTS}, {NO_MODEL}",
    "doctor": f"0 when no check fails; 1 when one does (with --setup: when a link is broken or could not be "
    f"judged); {BAD_ARGUMENTS}, {NO_MODEL}",
    "dashboard": f"Streamlit's, which replaces this process: 0 after Ctrl-C; {BAD_ARGUMENTS}",
    "init": "0 once the files are written; 1 when the gateway cannot be looked at, the config would be "
    f"invalid or a file exists (without --force), the reason on stderr; {BAD_ARGUMENTS}",
    "completion": f"0 with the script on stdout; {BAD_ARGUMENTS}",
    "generate": "0 once the files are written (with --check: when none is stale); 1 when --check finds "
    f"stale files or the thresholds file cannot be used, the reason on stderr; {BAD_ARGUMENTS}",
}


def runnable_commands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command that runs something (a leaf of the subcommand tree) by its path, e.g. "lab up"."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= runnable_commands(sub, f"{prefix}{name} ") or {f"{prefix}{name}": sub}
    return found


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """kvwatch's parser: every command, or with `only` that command alone (what running it needs)."""
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="Watch whether a multi-replica LLM cluster keeps each conversation on the "
        "replica that holds its KV cache.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show kvwatch's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if only is None else (only,):
        module = importlib.import_module(f"kvwatch.cli.{name}")
        if name == "completion":
            module.add_parser(commands, build_parser)
        else:
            module.add_parser(commands)
    for path, command in runnable_commands(parser).items():
        command.epilog = f"Exit codes: {EXIT_CODES[path]}."
    return parser


class _Version(argparse.Action):
    """--version, looked up only when asked: importing importlib.metadata would cost every command."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {version()}")
        parser.exit()


def version() -> str:
    """The installed distribution's version: what pip and a bug report name."""
    from importlib import metadata

    try:
        return metadata.version("kvwatch")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    if problem := ca_bundle_problem():
        print(f"kvwatch: {problem}", file=sys.stderr)
        return 2
    return args.handler(args)


def ca_bundle_problem() -> str | None:
    """Why the CAs the environment names for every kvwatch TLS connection (httpx's order: SSL_CERT_FILE,
    else SSL_CERT_DIR) cannot be used, if they cannot: said once before a command starts, not as a
    traceback at its first connection. A look, not a parse: parsing a system bundle costs every command
    a tenth of a second."""
    if path := os.environ.get("SSL_CERT_FILE"):
        try:
            with open(path, "rb") as bundle:
                text = bundle.read()
        except OSError as error:
            return f"SSL_CERT_FILE={path} cannot be read as the CAs kvwatch trusts: {error.strerror}"
        if b"CERTIFICATE-----" not in text:
            return f"SSL_CERT_FILE={path} holds no PEM certificate for kvwatch to trust"
    elif (path := os.environ.get("SSL_CERT_DIR")) and not os.path.isdir(path):
        return f"SSL_CERT_DIR={path} is no directory of CA certificates"
    return None


if __name__ == "__main__":
    sys.exit(main())
