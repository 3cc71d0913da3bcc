"""Run the configured probes on their schedules, follow the gateway logs, keep the history in SQLite or
PostgreSQL, and serve /metrics and the Alertmanager webhook (POST /alerts)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from kvwatch.cli.options import command
from kvwatch.collectors.gatewaylogs.sources import SourceUnavailable
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.serve import shard, startup
from kvwatch.serve.scheduler import Service

HELP = "run probes on a schedule and serve /metrics and the Alertmanager webhook"


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = command(commands, "serve", run, help=HELP, description=__doc__)
    serve.add_argument("--config", type=Path, required=True, help="kvwatch YAML config")
    serve.add_argument(
        "--shard",
        type=shard.parse,
        default=shard.WHOLE,
        metavar="I/N",
        help="probe and export only the targets of shard I mod N of N, split by hashing their names as "
        "Prometheus' hashmod does; instances I and I+N are replicas of one shard (default: every target)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_config(args.config)
        service = Service(config, args.shard, startup.prepare(config, args.shard, listen=True))
    except startup.StartRefused as refused:
        for problem in refused.problems:  # the lines `kvwatch config check` prints
            print(f"kvwatch serve: {problem}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, OSError) as error:
        print(f"kvwatch serve: {error}", file=sys.stderr)
        return 1

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await service.run(stop)

    try:
        asyncio.run(main())
    except SourceUnavailable as error:  # a gateway log's receiver cannot listen
        print(f"kvwatch serve: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the exporter's port, free at the check, was taken since
        print(f"kvwatch serve: {startup.cannot_listen(config.exporter, error)}", file=sys.stderr)
        return 1
    return 0
