"""Gateway access-log formats behind one interface: one module per format (`nginx`, `ingress-nginx`,
`envoy`).

Each turns one decoded JSON line into the `Request` that the follower (collectors/gatewaylogs/follower.py)
counts; a gateway log's `format` in the config picks one by name (`LOG_FORMATS.lookup`), its
`session_keys` the session-key headers whose logged values name a session before the format's own field
(`LogFormat.keyed`).
"""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs import envoy, ingress_nginx, nginx
from kvwatch.collectors.gatewaylogs.base import (
    MALFORMED_REASONS,
    NO_UPSTREAM,
    LogFormat,
    Malformed,
    Request,
    json_object,
    session_fields,
)
from kvwatch.core.registry import Registry

LOG_FORMATS = Registry("gateway log format", (module.FORMAT for module in (nginx, ingress_nginx, envoy)))

__all__ = [
    "LOG_FORMATS",
    "MALFORMED_REASONS",
    "NO_UPSTREAM",
    "LogFormat",
    "Malformed",
    "Request",
    "json_object",
    "session_fields",
]
