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
    optional_number,
    path_of,
    request,
)

# What nginx logs alike as kvwatch's log_format and as ingress-nginx's: `nginx_request` reads them.
NGINX_FIELDS = {"msec": (int, float), "status": int, "upstream_addr": str, "session_id": str}
FIELDS = {**NGINX_FIELDS, "listener": str, "session_source": str}
# nginx joins the servers it tried with ", " and the groups of an internal redirect with " : ".
_UPSTREAM_SEPARATOR = re.compile(r", | : ")


def upstream_tried(upstream_addr: str) -> tuple[str, bool]:
    """The last server nginx tried (NO_UPSTREAM for none), and whether it tried more than one."""
    if ", " not in upstream_addr and " : " not in upstream_addr:  # one server, or none: most lines
        # An upstream group's name instead of an address means nginx found no live server.
        return (upstream_addr if ":" in upstream_addr else NO_UPSTREAM), False
    tried = _UPSTREAM_SEPARATOR.split(upstream_addr)
    return (tried[-1] if ":" in tried[-1] else NO_UPSTREAM), True


def header_time(record: Mapping[str, object]) -> float | None:
    """The last server's `$upstream_header_time` in seconds; None when the line has none or the server
    sent no headers ("-")."""
    times = record.get("upstream_header_time")
    if times is None:
        return None
    if not isinstance(times, str):
        raise Malformed("wrong_type")
    return optional_number({"last": _UPSTREAM_SEPARATOR.split(times)[-1]}, "last")


def nginx_request(
    record: Mapping[str, object], listener: str, session_id: str, assigned: bool, path: str | None
) -> Request:
    """The request of a line with NGINX_FIELDS: its time, status and the servers tried, with the
    `listener`, `session_id`, `assigned` and `path` the format says in its own way, and the first byte's
    time where the line has `upstream_header_time`."""
    upstream, failover = upstream_tried(record["upstream_addr"])
    return request(
        record["msec"],
        listener,
        upstream,
        failover,
        record["status"],
        session_id,
        assigned,
        path,
        header_time(record),  # "$upstream_header_time", optional
    )


def read(record: Mapping[str, object], client_id: str | None = None) -> Request:
    """`client_id`: the id a session key's header carried (LogFormat.keyed), before the map's."""
    session_source = record["session_source"]
    if session_source != "client" and session_source != "assigned":
        raise Malformed("bad_value")
    return nginx_request(
        record,
        record["listener"],
        client_id or record["session_id"],
        not client_id and session_source == "assigned",
        path_of(record.get("request")),  # "POST /v1/chat/completions": method and $uri
    )


FORMAT = LogFormat(name="nginx", fields=FIELDS, read=read)
