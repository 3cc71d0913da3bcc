"""Gateway access-log formats behind one interface: one module per format (`nginx`, `envoy`).

Each turns one decoded JSON line into the `Request` that the follower (collectors/gatewaylogs/follower.py)
counts; a gateway log's `format` in the config picks one by name.
"""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs import envoy, nginx
from kvwatch.collectors.gatewaylogs.base import (
    MALFORMED_REASONS,
    NO_UPSTREAM,
    LogFormat,
    Malformed,
    Request,
    json_object,
)

FORMATS: dict[str, LogFormat] = {module.FORMAT.name: module.FORMAT for module in (nginx, envoy)}

__all__ = [
    "FORMATS",
    "MALFORMED_REASONS",
    "NO_UPSTREAM",
    "LogFormat",
    "Malformed",
    "Request",
    "json_object",
    "log_format",
]


def log_format(name: str) -> LogFormat:
    """The format called `name`; a ValueError naming the known ones for any other."""
    if name not in FORMATS:
        raise ValueError(f'unknown gateway log format "{name}"; known: {", ".join(sorted(FORMATS))}')
    return FORMATS[name]
