"""nginx's JSON access log: the `kvwatch_json` log_format of docs/gateway-logs.md (the lab's too).

nginx names the session's source itself (`session_source`), and lists every server it tried in
`upstream_addr`: more than one is a failover. `upstream_header_time`, optional, is the upstream's time to
the first byte of its answer's headers, a list as `upstream_addr` is: the last server's is the answer's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvwatch.collectors.gatewaylogs.base import (
    NO_UPSTREAM,
    LogFormat,
    Malformed,
    Request,
    check_fields,
    optional_number,
    path_of,
    request,
)

FIELDS = {
    "msec": (int, float),
    "listener": str,
    "status": int,
    "upstream_addr": str,
    "session_id": str,
    "session_source": str,
}
# nginx joins the servers it tried with ", " and the groups of an internal redirect with " : ".
_UPSTREAM_SEPARATOR = re.compile(r", | : ")


def upstream_tried(upstream_addr: str) -> tuple[str, bool]:
    """The last server nginx tried (NO_UPSTREAM for none), and whether it tried more than one."""
    tried = _UPSTREAM_SEPARATOR.split(upstream_addr) if upstream_addr else []
    # An upstream group's name instead of an address means nginx found no live server.
    return (tried[-1] if tried and ":" in tried[-1] else NO_UPSTREAM), len(tried) > 1


def header_time(record: Mapping[str, object]) -> float | None:
    """The last server's `$upstream_header_time` in seconds; None when the line has none or the server
    sent no headers ("-")."""
    times = record.get("upstream_header_time")
    if times is None:
        return None
    if not isinstance(times, str):
        raise Malformed("wrong_type")
    return optional_number({"last": _UPSTREAM_SEPARATOR.split(times)[-1]}, "last")


def parse(record: Mapping[str, object]) -> Request:
    check_fields(record, FIELDS)
    if record["session_source"] not in ("client", "assigned"):
        raise Malformed("bad_value")
    upstream, failover = upstream_tried(record["upstream_addr"])
    return request(
        time=record["msec"],
        listener=record["listener"],
        upstream=upstream,
        failover=failover,
        status=record["status"],
        session_id=record["session_id"],
        assigned=record["session_source"] == "assigned",
        path=path_of(record.get("request")),  # "POST /v1/chat/completions": method and $uri
        first_byte_seconds=header_time(record),
    )


FORMAT = LogFormat(name="nginx", parse=parse)
