"""Envoy's JSON access log (Istio, Envoy Gateway, kgateway) with the `json_format` kvwatch documents:
examples/envoy-access-log.yaml (docs/gateway-logs.md).

Envoy renders a value it does not have as null: no session header, no upstream host. It has no field for
where the session id came from, so a gateway that assigns ids gives a request without one its own
x-request-id: a session id equal to the request id, or none at all, is the gateway's. A retry shows in
the attempt count, a failed upstream in the response flags. `first_body_byte_us`, optional, is
`%COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%` (Envoy 1.37 or later): from sending the request upstream
to the first byte of the answer's body, which for a stream is its first token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

from kvwatch.collectors.gatewaylogs.base import (
    NO_UPSTREAM,
    LogFormat,
    Malformed,
    Request,
    optional_number,
    path_of,
    request,
)

_OPTIONAL_TEXT = (str, type(None))
FIELDS = {
    "start_time": str,  # %START_TIME%: ISO 8601 with milliseconds, in UTC
    "duration": (int, float),  # %DURATION%: milliseconds to the last byte sent
    "listener": str,
    "response_code": int,
    "response_flags": str,  # "-" without any, else e.g. "UF,URX"
    "upstream_host": _OPTIONAL_TEXT,
    "upstream_request_attempt_count": int,
    "session_id": _OPTIONAL_TEXT,
    "request_id": _OPTIONAL_TEXT,
}
# Fields a line may have; the OTLP source reads them where a record has them.
OPTIONAL_FIELDS = {"path": _OPTIONAL_TEXT, "first_body_byte_us": (int, float, type(None))}
# UF: the connection to the upstream failed; URX: the retries ran out on failing upstreams.
FAILOVER_FLAGS = frozenset({"UF", "URX"})
# Envoy logs 0 when it sent no response because the client went away first: nginx's 499 for the same.
_NO_RESPONSE, _CLIENT_CLOSED = 0, 499


def read(record: Mapping[str, object], client_id: str | None = None) -> Request:
    """`client_id`: the id a session key's header carried (LogFormat.keyed), before `session_id`."""
    try:
        started = datetime.fromisoformat(record["start_time"])
    except ValueError:
        raise Malformed("bad_value") from None
    attempts, duration_ms = record["upstream_request_attempt_count"], record["duration"]
    if started.tzinfo is None or attempts < 0 or not 0 <= duration_ms < math.inf:
        raise Malformed("bad_value")
    session_id, request_id = client_id or record["session_id"], record["request_id"]
    status = record["response_code"]
    first_body_byte_us = optional_number(record, "first_body_byte_us")
    flags = record["response_flags"]
    return request(
        started.timestamp() + duration_ms / 1000,
        record["listener"],
        record["upstream_host"] or NO_UPSTREAM,
        attempts > 1 or (flags != "-" and not FAILOVER_FLAGS.isdisjoint(flags.split(","))),
        _CLIENT_CLOSED if status == _NO_RESPONSE else status,
        session_id or request_id or "",
        not session_id or session_id == request_id,
        path_of(record.get("path")),  # "%REQ(:PATH)%", optional
        None if first_body_byte_us is None else first_body_byte_us / 1e6,
    )


FORMAT = LogFormat(name="envoy", fields=FIELDS, read=read)
