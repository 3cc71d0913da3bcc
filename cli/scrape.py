"""Read vLLM, SGLang or router (SMG / sglang-router, vllm-router, llm-d EPP, Dynamo, AIBrix) /metrics from
URLs or files and print the prefix-cache hit ratio, TTFT quantiles, load, requests per worker and the
router's predicted hit ratio. One scrape gives lifetime figures; --interval scrapes twice and gives the
figures of that window."""

from __future__ import annotations

import argparse
import asyncio
import json

from kvwatch.cli.options import command, positive
from kvwatch.collectors.engines import ENGINE_FLAVOURS
from kvwatch.collectors.engines.scrape import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, format_result, scrape

HELP = "read engine / router /metrics and print normalised cache-reuse figures"


# The limits on one read: (flag, type, default, metavar, help).
_LIMITS = (
    ("--timeout", float, DEFAULT_TIMEOUT, "S", "seconds a URL has to answer in full (default %(default)g)"),
    ("--max-bytes", int, DEFAULT_MAX_BYTES, "N",
     "refuse a source larger than N bytes (default %(default)d, 32 MiB)"),
)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = command(subparsers, "scrape", run, help=HELP, description=__doc__)
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a /metrics URL (a bare http://host:port gets /metrics) or a file",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per source")
    parser.add_argument("--interval", type=positive(float), metavar="S", help="scrape twice, S seconds apart")
    parser.add_argument(
        "--flavour", choices=sorted(ENGINE_FLAVOURS), help="skip detection and read as this flavour"
    )
    for flag, kind, default, metavar, text in _LIMITS:
        parser.add_argument(flag, type=positive(kind), default=default, metavar=metavar, help=text)


def run(args: argparse.Namespace) -> int:
    """Print every source's figures; exit 1 when any source failed."""
    flavour = ENGINE_FLAVOURS.lookup(args.flavour) if args.flavour else None
    results = asyncio.run(scrape(args.sources, args.interval, flavour, args.timeout, args.max_bytes))
    if args.json:
        print(json.dumps([result.as_json() for result in results], indent=2))
    else:
        print("\n\n".join(map(format_result, results)))
    return 1 if any(result.error for result in results) else 0
