"""Envoy and what runs on it (Istio, Envoy Gateway, kgateway): a route's hash policy on the session
header over a consistent-hash cluster; Istio writes both from one DestinationRule."""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.doctor.affinity.base import Affinity


def forward(header: str) -> str:
    return (
        f"it passes {header} on unless a route's `request_headers_to_remove` drops it (Istio: a "
        "VirtualService's `headers.request.remove`)"
    )


def echo(header: str) -> str:
    return f"the route's `response_headers_to_add` with `{header}: %REQ({header})%`"


def hash_on(header: str) -> str:
    return (
        f"the Istio DestinationRule's `trafficPolicy.loadBalancer.consistentHash.httpHeaderName: {header}`, "
        f"which Envoy serves as the route's `hash_policy: [{{header: {{header_name: {header.lower()}}}}}]` "
        "over a cluster with `lb_policy: RING_HASH` or `MAGLEV` (not ROUND_ROBIN, not a hash of x-request-id)"
    )


def recognise(headers: Mapping[str, str]) -> bool:
    """Envoy names itself in `server` (Istio's gateways: istio-envoy) and times the upstream."""
    return "envoy" in headers.get("server", "").lower() or "x-envoy-upstream-service-time" in headers


AFFINITY = Affinity("envoy", "Envoy / Istio", forward, echo, hash_on, recognise)
