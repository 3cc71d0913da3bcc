"""Run the same seeded multi-turn sessions through route A (e.g. a round-robin gateway) and route B (e.g.
session affinity), each conversation arriving for both at the same moment. Report per round the median, p90
and p99 TTFT with bootstrap 95 % intervals and the cached ratio, and per route the stickiness, the
throughput and the requests each replica served: CSVs, a Markdown report and a plot (PNG and interactive
HTML) in DIR, and the report on stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvwatch.cli import options
from kvwatch.collectors.probe.models import chosen_model
from kvwatch.collectors.probe.session import SESSION_MODES, ProbeSettings, resolve_api_key
from kvwatch.core.progress import Progress
from kvwatch.experiment.design import Load, Workload
from kvwatch.experiment.report import FILES
from kvwatch.experiment.runner import failures, run_into

HELP = "the source article's A/B run: the same sessions through two routes, TTFT and reuse by round"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = options.command(subparsers, "experiment", run_cli, help=HELP, description=__doc__)
    parser.add_argument("--a", metavar="URL", help="route A's API root, with or without /v1")
    parser.add_argument("--b", metavar="URL", help="route B's API root, with or without /v1")
    parser.add_argument(
        "--sagemaker-endpoint",
        metavar="NAME",
        help="instead of --a and --b: one Amazon SageMaker endpoint, route A without sessions and route B "
        "with stateful sessions (labels no_session and session unless given; with --region and --model)",
    )
    options.add_sagemaker_arguments(parser)
    parser.add_argument(
        "--label-a", default="round_robin", metavar="LABEL", help="route A's name (default %(default)s)"
    )
    parser.add_argument(
        "--label-b", default="affinity", metavar="LABEL", help="route B's name (default %(default)s)"
    )
    options.add_model_argument(parser)
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the results")
    options.add_api_key_arguments(parser)
    workload = Workload()
    for flag, default, what in (
        ("--sessions", workload.sessions, "sessions per route"),
        ("--rounds", workload.rounds, "rounds per session"),
        ("--system-tokens", workload.system_tokens, "synthetic system prompt, in tokens"),
        ("--turn-tokens", workload.turn_tokens, "synthetic user turn, in tokens"),
        ("--max-tokens", 8, "answer length in tokens; TTFT is what is measured"),
        ("--seed", workload.seed, "seed of the workload"),
    ):
        parser.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    parser.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="sessions in flight per route; default: no cap with --request-rate, else one session at a "
        "time over both routes, interleaved",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        metavar="R",
        help="sessions arriving per second per route, with seeded exponential gaps (a Poisson process); "
        "default: all at the start",
    )
    parser.add_argument(
        "--sharegpt", type=Path, metavar="FILE", help="user turns from a ShareGPT-style JSON file"
    )
    parser.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default=ProbeSettings.session_mode,
        help="client: a new id per session; server: adopt the id the gateway returns; none: send none "
        "(default %(default)s)",
    )
    options.add_session_arguments(parser, "session id header")
    options.add_block_size_arguments(parser)


def _routes(args: argparse.Namespace, api_key: str | None) -> tuple[ProbeSettings, ProbeSettings]:
    """Routes A and B: two OpenAI-compatible routes, or one SageMaker endpoint without and with sessions
    (the article's A/B on SageMaker). ValueError naming a wrong or missing option."""
    endpoint = options.sagemaker_endpoint(args)
    if endpoint is not None:
        if args.a or args.b:
            raise ValueError("--sagemaker-endpoint is both routes: leave out --a and --b")
        labels = [
            label if label != default else sagemaker_label
            for label, default, sagemaker_label in (
                (args.label_a, "round_robin", "no_session"),
                (args.label_b, "affinity", "session"),
            )
        ]
        routes = zip((endpoint.base_url,) * 2, labels, ("none", "client"), strict=True)
        model, kind = args.model, "sagemaker"
    else:
        if not (args.a and args.b):
            raise ValueError("name both routes with --a and --b, or a --sagemaker-endpoint")
        routes = ((args.a, args.label_a, args.session_mode), (args.b, args.label_b, args.session_mode))
        # Both routes reach the same engines, so route A's listing speaks for both.
        model = chosen_model(args.model, args.a, api_key, ProbeSettings.timeout_seconds, "experiment")
        kind = "openai"
    a, b = (
        options.route_settings(
            args,
            base_url=url,
            model=model,
            api_key=api_key,
            target=label,
            route_mode=label,
            session_mode=mode,
            max_tokens=args.max_tokens,
            kind=kind,
            sagemaker=endpoint,
        )
        for url, label, mode in routes
    )
    return a, b


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch experiment`: 0 when it ran, 1 when every session failed, 2 on bad arguments."""
    try:
        api_key = resolve_api_key(args.api_key_env, args.api_key_file)
        workload = Workload(
            args.sessions, args.rounds, args.system_tokens, args.turn_tokens, args.seed, args.sharegpt
        )
        load = Load(args.concurrency, args.request_rate, args.seed)
        # A SageMaker endpoint has no --a or --b, and its runtime API serves no /metrics.
        sources = options.block_size_sources(args, [url for url in (args.a, args.b) if url])
        a, b = _routes(args, api_key)
        # It checks its arguments before it runs.
        with Progress.on_terminal("experiment", "sessions", json=False) as progress:
            experiment, markdown = run_into(a, b, workload, args.out, load, sources, progress)
    except (ValueError, OSError) as error:
        print(f"kvwatch experiment: {error}", file=sys.stderr)
        return 2
    if markdown is not None:
        print(markdown)
        print(f"Written to {args.out}: {', '.join(FILES.values())}")
    summary = failures(experiment)
    if summary:
        print(f"kvwatch experiment: {summary[0]}", file=sys.stderr)
        for line in summary[1:]:
            print(f"  {line}", file=sys.stderr)
    return 1 if markdown is None else 0
