"""SMG (the SGLang Model Gateway, once sglang-router): it routes on its routing-key headers only, and
forwards no other custom header."""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.doctor.affinity.base import Affinity

KEY_HEADER = "x-smg-routing-key"  # its default routing-key header
WORKER_HEADER = "x-smg-routed-worker-id"  # names the worker of every answer


def _key_headers(header: str) -> str:
    if header.lower() == KEY_HEADER:
        return f"its default routing-key header {KEY_HEADER}"
    return f"`--routing-key-headers {header.lower()}` (default {KEY_HEADER})"


def forward(header: str) -> str:
    return f"it drops custom headers but its routing keys: start it with {_key_headers(header)}"


def echo(header: str) -> str:
    return f"it returns no routing key but names the worker in {WORKER_HEADER}, which kvwatch reads"


def hash_on(header: str) -> str:
    return (
        f"`--policy manual` (or `--routing-key-override` to make any policy sticky) with "
        f"{_key_headers(header)}"
    )


def recognise(headers: Mapping[str, str]) -> bool:
    return WORKER_HEADER in headers


AFFINITY = Affinity("smg", "SMG", forward, echo, hash_on, recognise)
