"""Serve the Streamlit dashboard. It reads Prometheus, Alertmanager and the SQLite store named in the kvwatch
config."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from kvwatch.cli.options import command
from kvwatch.dashboard.defaults import DEFAULT_CONFIG, DEFAULT_REFRESH_SECONDS

HELP = "serve the Streamlit dashboard"

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"


def add_parser(commands: argparse._SubParsersAction) -> None:
    dashboard = command(commands, "dashboard", _run, help=HELP, description=__doc__)
    dashboard.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=DEFAULT_CONFIG,
        help="kvwatch YAML config (default: the lab's, %(default)s)",
    )
    dashboard.add_argument("--port", type=int, default=8501, metavar="N", help="port (default %(default)s)")
    dashboard.add_argument(
        "--refresh-seconds",
        type=int,
        default=DEFAULT_REFRESH_SECONDS,
        metavar="S",
        help="how often the pages refresh, and the time grid they ask Prometheus on; 1 to 3600 "
        "(default %(default)s; the lab's --fast dashboard refreshes as often as its probes run)",
    )
    dashboard.add_argument(
        "--address",
        default="127.0.0.1",
        metavar="HOST",
        help="address to bind; 0.0.0.0 for every interface (default %(default)s)",
    )


def _run(args: argparse.Namespace) -> NoReturn:
    if not 1 <= args.refresh_seconds <= 3600:
        print("kvwatch dashboard: --refresh-seconds must be 1 to 3600", file=sys.stderr)
        sys.exit(2)
    # Streamlit replaces this process, so a supervisor's PID (the lab's) is the server's; the config
    # path and the refresh stay on the command line, after `--`, where the app reads them.
    argv = [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--server.address", args.address, "--server.port", str(args.port),
        "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer",
        "--", "--config", str(args.config.resolve()), "--refresh-seconds", str(args.refresh_seconds),
    ]  # fmt: skip
    os.execv(sys.executable, argv)
