"""Option groups that several commands take, written once so that each reads and behaves alike."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvwatch.collectors import identity


class _RefuseKey(argparse.Action):
    """`--api-key` exists only to say no, before argparse could echo the key in an error message."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            "the API key is never taken from the command line (ps and shell history would show it): "
            "use --api-key-env VAR or --api-key-file FILE"
        )


def add_base_url_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="API root, with or without /v1")


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


def add_identity_arguments(parser: argparse.ArgumentParser) -> None:
    """--router (a router that names the replica only when asked) and --backend-header."""
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


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse
