"""`kvwatch init`: look at a gateway (and a Prometheus), then write a kvwatch config and the Prometheus and
Alertmanager pieces that go with it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvwatch.cli import options
from kvwatch.collectors.probe.session import resolve_api_key
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import STICKY_ROUTE_MODES, RouteMode
from kvwatch.doctor import affinity
from kvwatch.onboarding import summary, survey, writers

DEFAULT_DIRECTORY = Path("kvwatch-setup")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = options.command(
        commands,
        "init",
        run,
        help="look at your gateway and Prometheus, then write a kvwatch config and the pieces around it",
        description="Look before writing: the models the gateway lists, whether it echoes or assigns "
        "session ids (a short real probe session), which response header names the replica, the engines "
        "and routers your Prometheus scrapes and their KV block size. Then write, in DIR, kvwatch.yaml, a "
        "webhook token, prometheus.yml (engines with their `replica` label, routers, kvwatch's exporter, "
        "the rule files in rules/) and alertmanager.yml (kvwatch's webhook with the token), and print "
        "what was found, what was assumed and what to check. Existing files are kept unless --force.",
    )
    parser.add_argument("base_url", metavar="URL", help="the gateway's API root, with or without /v1")
    options.add_model_argument(parser)
    options.add_api_key_arguments(parser)
    parser.add_argument(
        "--prometheus", metavar="URL", help="your Prometheus: the engines it scrapes are listed"
    )
    parser.add_argument("--alertmanager", default=writers.Layout.alertmanager_url, metavar="URL",
                        help="your Alertmanager (default %(default)s)")  # fmt: skip
    parser.add_argument("--gateway", choices=list(affinity.SYSTEMS),
                        help="the gateway or router kind (smg routes on X-SMG-Routing-Key)")  # fmt: skip
    parser.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                        help="an engine's /metrics address to scrape; repeatable")  # fmt: skip
    parser.add_argument("--listen", default=writers.Layout.listen, metavar="HOST:PORT",
                        help="where kvwatch serve listens for Prometheus and Alertmanager "
                        "(default %(default)s)")  # fmt: skip
    parser.add_argument("--name", help="the target's name (default: from the URL's host)")
    parser.add_argument("--route-mode", choices=RouteMode.__args__,
                        help="how the gateway picks a replica; sticky: "
                        f"{', '.join(sorted(STICKY_ROUTE_MODES))} (default: manual with --gateway smg, "
                        "else affinity)")  # fmt: skip
    parser.add_argument("--interval", type=options.positive(int), default=writers.Layout.interval_seconds,
                        metavar="S", help="seconds between probe runs (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_DIRECTORY, help="where to write (default %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")


def run(args: argparse.Namespace) -> int:
    """Survey, write, summarise: 1 when the route cannot be looked at or a file exists, 2 on bad arguments."""
    try:
        wanted = survey.Request(
            base_url=args.base_url,
            api_key=resolve_api_key(args.api_key_env, args.api_key_file),
            model=args.model,
            prometheus_url=args.prometheus,
            gateway=args.gateway,
            engines=tuple(args.engine),
        )
        layout = writers.Layout(
            directory=args.dir.resolve(),
            listen=args.listen,
            prometheus_url=args.prometheus or writers.Layout.prometheus_url,
            alertmanager_url=args.alertmanager,
            target_name=args.name or writers.target_name(args.base_url),
            route_mode=args.route_mode or wanted.route_mode,
            interval_seconds=args.interval,
            api_key_env=args.api_key_env,
            api_key_file=args.api_key_file and str(Path(args.api_key_file).resolve()),
        )
    except ValueError as error:
        print(f"kvwatch init: {error}", file=sys.stderr)
        return 2
    try:
        found = survey.survey(wanted)
        files = writers.planned(found, layout)
        writers.write(files, layout.directory / writers.TOKEN, args.force)
    except (survey.SurveyError, writers.ExistingFiles, ConfigError) as error:
        print(f"kvwatch init: {error}", file=sys.stderr)
        return 1
    print(summary.summary(found, layout, [*files, layout.directory / writers.TOKEN]))
    return 0
