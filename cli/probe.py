"""Run multi-turn probe sessions once through an OpenAI-compatible route (a gateway or router in front of vLLM
/ SGLang replicas) or an Amazon SageMaker endpoint, and print, per round, the median TTFT, cached vs ideal
cached tokens and the backends seen, then each session's stickiness."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from kvwatch.cli import options
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.models import NO_COMPLETION, chosen_model, explanation
from kvwatch.collectors.probe.report import failure_hints, format_report, session_json
from kvwatch.collectors.probe.session import SESSION_MODES, ProbeSettings, resolve_api_key
from kvwatch.collectors.probe.targets import metrics_base_urls, probe_once
from kvwatch.collectors.probe.workload import Conversation, load_sharegpt, synthetic
from kvwatch.config.settings import Target, Workload
from kvwatch.core.progress import Progress

HELP = "run synthetic multi-turn sessions through a route and report TTFT, cache reuse and stickiness"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """`kvwatch probe`, with the defaults of a configured target."""
    parser = options.command(subparsers, "probe", run, help=HELP, description=__doc__)
    options.add_route_arguments(parser, sagemaker=True)
    for flag, dest, kind, default, text in (
        ("--rounds", "rounds", int, Target.rounds, "rounds per session"),
        ("--sessions", "sessions", int, 3, "sessions"),
        ("--concurrency", "concurrency", int, 1, "sessions at once; more adds queueing to TTFT"),
        ("--system-tokens", "system_tokens", int, Workload.system_tokens, "tokens of the system prompt"),
        ("--turn-tokens", "turn_tokens", int, Workload.turn_tokens, "tokens of each user turn"),
        ("--max-tokens", "max_tokens", int, Workload.max_tokens, "tokens of each answer"),
        ("--seed", "seed", int, Workload.seed, "seed of the workload"),
        ("--timeout", "timeout", float, Target.timeout_seconds, "seconds a round may take in full"),
    ):
        metavar = "S" if kind is float else "N"
        parser.add_argument(
            flag, type=kind, dest=dest, default=default, metavar=metavar, help=f"{text} (default %(default)g)"
        )
    parser.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default=ProbeSettings.session_mode,
        help="client: a new id per session; server: send none in round 1, then the id the gateway "
        "returned; none: never send one (default %(default)s). On SageMaker, client and server open a "
        "stateful session per conversation",
    )
    parser.add_argument(
        "--no-session",
        action="store_const",
        const="none",
        dest="session_mode",
        help="send no session id (--session-mode none): the A/B against sessions",
    )
    options.add_session_arguments(parser, "session id header, e.g. x-smg-routing-key for SMG's manual policy")
    parser.add_argument(
        "--sharegpt",
        metavar="FILE",
        help="take the conversations from a ShareGPT-style JSON file (those of 4 or more user turns) "
        "instead of synthetic ones",
    )
    _add_lifecycle_arguments(parser)
    options.add_block_size_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help='print {"block_size": {...}, "sessions": [...]} as JSON'
    )


def _add_lifecycle_arguments(parser: argparse.ArgumentParser) -> None:
    """A session's whole life: idle past the route's session TTL mid-session, check a close."""
    parser.add_argument(
        "--idle-after-round",
        type=int,
        metavar="N",
        help="idle after round N for --idle-seconds (past the route's session TTL) and report what follows: "
        "the expiry, the cold round after it and the re-pin",
    )
    parser.add_argument("--idle-seconds", type=float, default=0.0, metavar="S", help="seconds to idle")
    parser.add_argument(
        "--check-close",
        action="store_true",
        help="after closing a session (SageMaker's CLOSE), check that it is gone",
    )


def run(args: argparse.Namespace) -> int:
    """`kvwatch probe`: run the sessions once and report; 1 when a session failed, 2 on bad arguments."""
    try:
        settings, conversations, sources = _read_args(args)
    except ValueError as error:
        print(f"kvwatch probe: {error}", file=sys.stderr)
        return 2
    with Progress.on_terminal("probe", "sessions", json=args.json) as progress:
        progress.start(len(conversations))
        sessions = probe_once(settings, conversations, args.concurrency, progress.advance)
    block = asyncio.run(blocksize.learn(sources, sessions))
    sessions = blocksize.with_block_size(sessions, block.tokens)
    if args.json:
        report = {"block_size": block.as_json(), "sessions": [session_json(s) for s in sessions]}
        print(json.dumps(report, indent=2))
    else:
        print(format_report(settings, sessions, block))
    failed = [s for s in sessions if not s.ok]
    if failed:
        print(f"kvwatch probe: {len(failed)} of {len(sessions)} sessions failed", file=sys.stderr)
        for line in failure_hints(failed):
            print(f"  {line}", file=sys.stderr)
        no_completion = settings.kind == "openai" and any(s.error_kind in NO_COMPLETION for s in failed)
        if no_completion and (said := asyncio.run(explanation(settings))):
            print(f"  {said}", file=sys.stderr)
        return 1
    return 0


def _read_args(
    args: argparse.Namespace,
) -> tuple[ProbeSettings, list[Conversation], blocksize.BlockSizeSources]:
    """The settings, the conversations and the block size's sources; ValueError naming a bad option."""
    problems = options.not_positive(
        {
            "--rounds": args.rounds,
            "--sessions": args.sessions,
            "--concurrency": args.concurrency,
            "--system-tokens": args.system_tokens,
            "--turn-tokens": args.turn_tokens,
            "--max-tokens": args.max_tokens,
            "--timeout": args.timeout,
        }
    )
    if problems:
        raise ValueError("; ".join(problems))
    api_key = resolve_api_key(args.api_key_env, args.api_key_file)
    endpoint = options.sagemaker_endpoint(args)
    if args.sharegpt:
        conversations = [
            Conversation(c.system_prompt, c.user_turns[: args.rounds])
            for c in load_sharegpt(args.sharegpt, limit=args.sessions, seed=args.seed)
        ]
    else:
        conversations = synthetic(args.rounds, args.system_tokens, args.turn_tokens, args.seed, args.sessions)
    base_url = endpoint.base_url if endpoint else args.base_url
    model = args.model if endpoint else None  # last: the model may have to be asked for
    settings = options.route_settings(
        args,
        base_url=base_url,
        model=model or chosen_model(args.model, base_url, api_key, args.timeout, "probe"),
        api_key=api_key,
        session_mode=args.session_mode,
        max_tokens=args.max_tokens,
        timeout_seconds=args.timeout,
        kind="sagemaker" if endpoint else "openai",
        sagemaker=endpoint,
        idle_after_round=args.idle_after_round,
        idle_seconds=args.idle_seconds,
        check_close=args.check_close,
    )
    return settings, conversations, options.block_size_sources(args, metrics_base_urls(settings))
