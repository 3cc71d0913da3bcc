"""`kvwatch lab ...`: run the simulated cluster and its parts."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from lab.engine import ReplicaSettings
from lab.flavours import FLAVOURS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser(
        "lab", help="run the simulated cluster (the lab)", description="Run the simulated cluster."
    )
    commands = lab.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)
    _add_replica(commands)


def _add_replica(commands: argparse._SubParsersAction) -> None:
    defaults = ReplicaSettings(replica_id="")
    replica = commands.add_parser(
        "replica",
        help="serve one simulated vLLM / SGLang replica on 127.0.0.1",
        description="Serve one simulated inference replica on 127.0.0.1: an OpenAI-compatible API, "
        "a real prefix cache, engine metrics of the chosen flavour, ground truth and faults.",
    )
    replica.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    replica.add_argument("--id", required=True, dest="replica_id", help="replica name, e.g. r1")
    replica.add_argument(
        "--flavour",
        choices=sorted(FLAVOURS),
        default=defaults.flavour,
        help="engine whose metrics to expose (default %(default)s)",
    )
    replica.add_argument("--model", default=defaults.model, help="served model name")
    replica.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help="prefix-cache block size in tokens (default %(default)s)",
    )
    replica.add_argument(
        "--cache-blocks",
        type=int,
        default=defaults.cache_blocks,
        help="prefix-cache capacity in blocks (default %(default)s)",
    )
    replica.add_argument(
        "--prefill-rate",
        type=float,
        default=defaults.prefill_tokens_per_s,
        dest="prefill_tokens_per_s",
        help="prefill tokens per second (default %(default)s)",
    )
    replica.add_argument(
        "--decode-rate",
        type=float,
        default=defaults.decode_tokens_per_s,
        dest="decode_tokens_per_s",
        help="decode tokens per second per sequence (default %(default)s)",
    )
    replica.add_argument(
        "--overhead",
        type=float,
        default=defaults.request_overhead_s,
        dest="request_overhead_s",
        help="fixed seconds per request (default %(default)s)",
    )
    replica.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="concurrent sequences before requests wait (default %(default)s)",
    )
    replica.add_argument(
        "--answer-tokens",
        type=int,
        default=defaults.answer_tokens,
        help="tokens per answer unless max_tokens is lower (default %(default)s)",
    )
    replica.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="multiply every simulated delay, e.g. 0.1 for fast tests",
    )
    replica.add_argument(
        "--no-identity-header",
        action="store_false",
        dest="identity_header",
        help="do not send X-Worker-Id (like a real engine, which names no replica)",
    )
    replica.add_argument(
        "--ground-truth",
        type=Path,
        dest="ground_truth_path",
        help="also append every request's ground truth to this JSONL file",
    )
    replica.add_argument("--seed", type=int, default=defaults.seed, help="seed of the error fault")
    replica.set_defaults(handler=_run_replica)


def _run_replica(args: argparse.Namespace) -> int:
    from lab.server import PortInUse, serve

    fields = ReplicaSettings.__dataclass_fields__
    settings = ReplicaSettings(**{k: v for k, v in vars(args).items() if k in fields})
    problems = [
        f"--{name.replace('_', '-')} must be positive"
        for name in ("block_size", "cache_blocks", "max_num_seqs", "answer_tokens")
        if getattr(settings, name) < 1
    ] + [
        f"{flag} must be positive"
        for flag, value in (
            ("--prefill-rate", settings.prefill_tokens_per_s),
            ("--decode-rate", settings.decode_tokens_per_s),
            ("--time-scale", settings.time_scale),
        )
        if value <= 0
    ]
    if settings.request_overhead_s < 0:
        problems.append("--overhead must not be negative")
    if problems:
        print("kvwatch lab replica: " + "; ".join(problems), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(settings, args.port))
    except PortInUse as error:
        print(f"kvwatch lab replica: {error}", file=sys.stderr)
        return 1
    return 0
