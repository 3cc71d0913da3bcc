"""Option groups that several commands take, written once so that each reads and behaves alike."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvwatch.collectors import identity, sessionkeys
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets.sagemaker import EndpointProblem, SageMakerEndpoint
from kvwatch.core.connections import url_problem
from kvwatch.core.redaction import redact


def command(
    commands: argparse._SubParsersAction, name: str, handler: Callable, **texts: str
) -> argparse.ArgumentParser:
    """The subcommand `name` (its `help`, `description`, ... as argparse takes them), run by `handler`."""
    parser = commands.add_parser(name, **texts)
    parser.set_defaults(handler=handler)
    return parser


def kvwatch_command() -> str:
    """How to run this kvwatch from a new shell, for the commands a message suggests: `kvwatch` when the
    one on PATH is this one outside an activated virtualenv, else this one's full path (a virtualenv,
    such as the one `make up` makes, is not activated in a new shell)."""
    installed = Path(sys.executable).parent / "kvwatch"
    if not installed.is_file():
        return "kvwatch"
    on_path = shutil.which("kvwatch")
    if on_path and Path(on_path).resolve() == installed.resolve() and not os.environ.get("VIRTUAL_ENV"):
        return "kvwatch"
    return str(installed.absolute())


class _RefuseKey(argparse.Action):
    """`--api-key` exists only to say no, before argparse could echo the key in an error message."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            "the API key is never taken from the command line (ps and shell history would show it): "
            "use --api-key-env VAR or --api-key-file FILE"
        )


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """--api-key-env / --api-key-file, and an --api-key that only refuses: keys never come from argv."""
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    key.add_argument("--api-key-file", metavar="FILE", help="file holding the API key")
    key.add_argument("--api-key", nargs="?", action=_RefuseKey, help=argparse.SUPPRESS)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="model id, as GET <base URL>/models lists it (default: the one model it lists)"
    )


def add_route_arguments(
    parser: argparse.ArgumentParser, required: bool = True, sagemaker: bool = False
) -> None:
    """--base-url, --model and the API key's options: the one route a command talks to; with `sagemaker`,
    a SageMaker endpoint (add_sagemaker_arguments) may be named instead of the base URL."""
    base_url = "API root, with or without /v1"
    if not sagemaker:
        parser.add_argument("--base-url", required=required, help=base_url)
    else:
        route = parser.add_mutually_exclusive_group(required=required)
        route.add_argument("--base-url", help=base_url)
        route.add_argument(
            "--sagemaker-endpoint",
            metavar="NAME",
            help="probe this Amazon SageMaker endpoint through its runtime API instead (with --region; "
            "AWS credentials from the standard chain: environment, shared files, --aws-profile)",
        )
        add_sagemaker_arguments(parser)
    add_model_argument(parser)
    add_api_key_arguments(parser)


def add_sagemaker_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a --sagemaker-endpoint is: what sagemaker_endpoint reads."""
    group = parser.add_argument_group("SageMaker endpoint (with --sagemaker-endpoint)")
    group.add_argument("--region", help="the endpoint's AWS region, e.g. us-east-1")
    group.add_argument("--variant", help="the production variant to invoke (TargetVariant)")
    group.add_argument("--inference-component", metavar="NAME", help="the inference component to invoke")
    group.add_argument("--endpoint-url", metavar="URL", help="another runtime URL (a VPC endpoint, a lab)")
    group.add_argument("--aws-profile", metavar="NAME", help="a profile of the shared AWS config files")


def sagemaker_endpoint(args: argparse.Namespace) -> SageMakerEndpoint | None:
    """The endpoint --sagemaker-endpoint names, or None; ValueError naming a wrong or missing option."""
    if not getattr(args, "sagemaker_endpoint", None):
        for flag in ("region", "variant", "inference_component", "endpoint_url", "aws_profile"):
            if getattr(args, flag, None):
                raise ValueError(f"--{flag.replace('_', '-')} is for a --sagemaker-endpoint")
        return None
    if not args.region:
        raise ValueError("--sagemaker-endpoint needs --region")
    if not args.model:
        raise ValueError("--sagemaker-endpoint needs --model (the model the container serves)")
    try:
        return SageMakerEndpoint(
            args.sagemaker_endpoint,
            args.region,
            variant=args.variant,
            inference_component=args.inference_component,
            endpoint_url=args.endpoint_url,
            profile=args.aws_profile,
        )
    except EndpointProblem as problem:
        flag = {"endpoint_name": "sagemaker-endpoint", "profile": "aws-profile"}.get(
            problem.where, problem.where
        )
        raise ValueError(f"--{flag.replace('_', '-')}: {problem.message}") from None


def route_settings(args: argparse.Namespace, **fields) -> ProbeSettings:
    """ProbeSettings for one route: add_session_arguments' options from `args`, the rest (the base URL,
    model, API key, timeouts...) as the command gives them."""
    return ProbeSettings(
        session_header=args.session_header,
        session_key=args.session_key,
        backend_headers=tuple(args.backend_headers or identity.DEFAULT_HEADERS),
        router=args.router,
        **fields,
    )


def add_session_arguments(parser: argparse.ArgumentParser, session_header_help: str) -> None:
    """--session-header (each command words its help for its use of it), --router (a router that names
    the replica only when asked) and --backend-header: what route_settings reads."""
    parser.add_argument(
        "--session-header",
        metavar="H",
        help=f"{session_header_help} (default X-Session-Id; on SageMaker, SessionId's "
        "X-Amzn-SageMaker-Session-Id: any other header is sent as a custom one, which SageMaker strips)",
    )
    parser.add_argument(
        "--session-key",
        choices=sorted(sessionkeys.SESSION_KEYS),
        help="the router's or client's session convention: its header carries the session id "
        "(dynamo: X-Dynamo-Session-ID, litellm: x-litellm-session-id, smg: X-SMG-Routing-Key, ...); "
        "--session-header names one of your own instead",
    )
    parser.add_argument(
        "--router",
        choices=sorted(identity.ROUTERS),
        help="the route is this router's frontend: ask it to name the serving replica "
        "(dynamo: nvext.extra_fields); by default the request carries nothing beyond the OpenAI API",
    )
    parser.add_argument(
        "--backend-header",
        action="append",
        dest="backend_headers",
        metavar="H",
        help="response header naming the serving backend; repeatable; replaces the defaults "
        f"({', '.join(identity.DEFAULT_HEADERS)})",
    )


def add_block_size_arguments(parser: argparse.ArgumentParser) -> None:
    """--block-size, --prometheus and --metrics-url: the block size given, or where to learn it."""
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="the engines' KV block size in tokens, for the ideal cached tokens; default: learned from "
        "--prometheus, then --metrics-url (or the base URL's origin + /metrics), then the reported "
        f"cached_tokens, else {blocksize.DEFAULT_TOKENS}",
    )
    parser.add_argument("--prometheus", metavar="URL", help="Prometheus scraping the engines")
    parser.add_argument(
        "--metrics-url",
        metavar="URL",
        help="an engine's /metrics, for its block size (default: the base URL's origin + /metrics)",
    )


def block_size_sources(args: argparse.Namespace, base_urls: Sequence[str]) -> blocksize.BlockSizeSources:
    """Where add_block_size_arguments' options say to learn the block size; ValueError naming the option
    when one is wrong."""
    if args.block_size is not None and (wrong := blocksize.problem(args.block_size)):
        raise ValueError(f"--block-size {wrong}")
    for flag, url in (("--prometheus", args.prometheus), ("--metrics-url", args.metrics_url)):
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} must start with http:// or https://")
        if url and (reason := url_problem(url)):
            raise ValueError(f"{flag} {redact(url)} is not a valid URL: {reason}")
    override = None if args.block_size is None else blocksize.BlockSize(args.block_size, "--block-size")
    return blocksize.sources_for(base_urls, args.prometheus, override, args.metrics_url)


def not_positive(values: dict[str, float]) -> list[str]:
    """ "FLAG must be positive" for each option of `values` (by flag, in order) that is not above zero."""
    return [f"{flag} must be positive" for flag, value in values.items() if value <= 0]


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse
