"""Each gateway's or router's affinity settings, as the doctor's fixes name them, and how a response's
headers tell which system answered."""

from __future__ import annotations

import pytest

from kvwatch.doctor import affinity
from kvwatch.doctor.affinity import SYSTEMS, recognised

ENVOY_HASH = (
    "Envoy / Istio: the Istio DestinationRule's `trafficPolicy.loadBalancer.consistentHash.httpHeaderName: "
    "X-Session-Id`, which Envoy serves as the route's `hash_policy: [{header: {header_name: x-session-id}}]` "
    "over a cluster with `lb_policy: RING_HASH` or `MAGLEV`"
)
SMG_KEY = "`--routing-key-headers x-session-id` (default x-smg-routing-key)"


@pytest.mark.parametrize(
    "system, setting, expected",
    [
        ("nginx", "forward", "nginx: `proxy_set_header X-Session-Id $http_x_session_id;`"),
        ("nginx", "echo", "nginx: `add_header X-Session-Id $http_x_session_id always;`"),
        ("nginx", "hash_on", "nginx: `hash $http_x_session_id consistent;` in the upstream"),
        (
            "envoy",
            "forward",
            "Envoy / Istio: it passes X-Session-Id on unless a route's `request_headers_to_remove`",
        ),
        (
            "envoy",
            "echo",
            "Envoy / Istio: the route's `response_headers_to_add` with `X-Session-Id: %REQ(X-Session-Id)%`",
        ),
        ("envoy", "hash_on", ENVOY_HASH),
        ("smg", "forward", f"SMG: it drops custom headers but its routing keys: start it with {SMG_KEY}"),
        ("smg", "echo", "SMG: it returns no routing key but names the worker in x-smg-routed-worker-id"),
        (
            "smg",
            "hash_on",
            f"SMG: `--policy manual` (or `--routing-key-override` to make any policy sticky) with {SMG_KEY}",
        ),
        ("vllm-router", "forward", "vllm-router: it passes X-Session-Id on"),
        (
            "vllm-router",
            "hash_on",
            "vllm-router: `--policy consistent_hash` (or `sticky_least_loaded`), keyed by X-Session-ID",
        ),
        ("dynamo", "forward", "Dynamo: it keeps sessions by X-Dynamo-Session-ID (or a coding agent's own"),
        ("dynamo", "hash_on", "Dynamo: start the frontend with `--router-session-affinity-ttl-secs N`"),
    ],
)
def test_each_fix_names_the_setting_of_its_own_system(system, setting, expected):
    assert SYSTEMS[system].fix(setting, "X-Session-Id").startswith(expected)


def test_smg_and_vllm_router_say_when_the_session_header_is_not_their_key():
    assert (
        SYSTEMS["smg"]
        .hash_on("x-smg-routing-key")
        .endswith("with its default routing-key header x-smg-routing-key")
    )
    assert (
        SYSTEMS["vllm-router"]
        .hash_on("X-Conversation")
        .endswith("; it reads no X-Conversation: send the id as X-Session-ID")
    )
    assert SYSTEMS["vllm-router"].hash_on("x-session-id").endswith("keyed by X-Session-ID")


@pytest.mark.parametrize(
    "headers, system",
    [
        ({"Server": "nginx/1.22.1"}, "nginx"),
        ({"server": "envoy", "x-envoy-upstream-service-time": "3"}, "envoy"),
        ({"server": "istio-envoy"}, "envoy"),  # Istio's ingress gateway
        ({"X-Envoy-Upstream-Service-Time": "3", "server": "Python/3.11 aiohttp/3.14.5"}, "envoy"),
        ({"x-smg-routed-worker-id": "http://10.0.0.1:8000", "server": "Python/3.11 aiohttp/3.14.5"}, "smg"),
        (
            {"server": "Python/3.11 aiohttp/3.14.5", "x-request-id": "req-1"},
            None,
        ),  # a replica, or vllm-router
        ({"server": "nginx", "x-smg-routed-worker-id": "http://10.0.0.1:8000"}, None),  # nginx before SMG
    ],
)
def test_a_responses_headers_name_the_system_that_answered_when_only_one_left_its_marks(headers, system):
    found = recognised(headers)
    assert (found.name if found else None) == system


def test_the_registry_holds_one_system_per_module():
    assert list(SYSTEMS) == ["nginx", "envoy", "smg", "vllm-router", "dynamo"]
    assert all(isinstance(system, affinity.Affinity) for system in SYSTEMS.values())
