"""nginx's JSON access log: the `kvwatch_json` log_format of docs/gateway-logs.md (the lab's too).

nginx names the session's source itself (`session_source`), and lists every server it tried in
`upstream_addr`: more than one is a failover.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvwatch.collectors.gatewaylogs.base import (
    NO_UPSTREAM,
    LogFormat,
    Malformed,
    Request,
    field_check,
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
_check = field_check(FIELDS)  # check_fields(record, FIELDS), quick for a good line
# nginx joins the servers it tried with ", " and the groups of an internal redirect with " : ".
_UPSTREAM_SEPARATOR = re.compile(r", | : ")


def upstream_tried(upstream_addr: str) -> tuple[str, bool]:
    """The last server nginx tried (NO_UPSTREAM for none), and whether it tried more than one."""
    if ", " not in upstream_addr and " : " not in upstream_addr:  # one server, or none: most lines
        # An upstream group's name instead of an address means nginx found no live server.
        return (upstream_addr if ":" in upstream_addr else NO_UPSTREAM), False
    tried = _UPSTREAM_SEPARATOR.split(upstream_addr)
    return (tried[-1] if ":" in tried[-1] else NO_UPSTREAM), True


def parse(record: Mapping[str, object]) -> Request:
    _check(record)
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
    )


FORMAT = LogFormat(name="nginx", parse=parse)
