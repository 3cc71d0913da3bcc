"""ingress-nginx's access log as its users configure it: `log-format-upstream` as JSON (with
`log-format-escape-json`) in the controller's ConfigMap, the lines of docs/gateway-logs.md.

An ingress backend (`$proxy_upstream_name`, namespace-service-port) is the listener. ingress-nginx has no
variable that says where a session id came from: the session header logs empty when the client sent
none, and the request's own id (`$req_id`) stands for the session the gateway gives it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.collectors.gatewaylogs.base import LogFormat, Request, path_of
from kvwatch.collectors.gatewaylogs.nginx import NGINX_FIELDS, nginx_request

FIELDS = {
    **NGINX_FIELDS,  # its session_id: "$http_x_session_id", or whichever header the ingress hashes by
    "req_id": str,
    "proxy_upstream_name": str,
}


def read(record: Mapping[str, object], client_id: str | None = None) -> Request:
    """`client_id`: the id a session key's header carried (LogFormat.keyed), before `session_id`."""
    session_id = client_id or record["session_id"]
    return nginx_request(
        record,
        record["proxy_upstream_name"],
        session_id or record["req_id"],
        not session_id,
        path_of(record.get("uri")),  # "$uri", optional
    )


FORMAT = LogFormat(name="ingress-nginx", fields=FIELDS, read=read)
