"""ingress-nginx's access log as its users configure it: `log-format-upstream` as JSON (with
`log-format-escape-json`) in the controller's ConfigMap, the lines of docs/gateway-logs.md.

An ingress backend (`$proxy_upstream_name`, namespace-service-port) is the listener. ingress-nginx has no
variable that says where a session id came from: the session header logs empty when the client sent
none, and the request's own id (`$req_id`) stands for the session the gateway gives it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.collectors.gatewaylogs.base import LogFormat, Request, check_fields, path_of, request
from kvwatch.collectors.gatewaylogs.nginx import header_time, upstream_tried

FIELDS = {
    "msec": (int, float),
    "req_id": str,
    "proxy_upstream_name": str,
    "upstream_addr": str,
    "status": int,
    "session_id": str,  # "$http_x_session_id", or whichever header the ingress hashes by
}


def parse(record: Mapping[str, object]) -> Request:
    check_fields(record, FIELDS)
    upstream, failover = upstream_tried(record["upstream_addr"])
    session_id = record["session_id"]
    return request(
        time=record["msec"],
        listener=record["proxy_upstream_name"],
        upstream=upstream,
        failover=failover,
        status=record["status"],
        session_id=session_id or record["req_id"],
        assigned=not session_id,
        path=path_of(record.get("uri")),  # "$uri", optional
        first_byte_seconds=header_time(record),  # "$upstream_header_time", optional
    )


FORMAT = LogFormat(name="ingress-nginx", parse=parse)
