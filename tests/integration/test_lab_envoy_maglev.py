"""`kvwatch lab up --gateway envoy --envoy-lb maglev`: Envoy really balances the affinity cluster with
MAGLEV, and Maglev keeps sessions where the ring hash does, while round robin still spreads them.

A lab of its own (the other Envoy tests share a RING_HASH one): quiet, so that only this test's
requests pass Envoy and what its round robin does with them is known exactly.
"""

from __future__ import annotations

import pytest

from gateway_checks import LAB_CLIENT as CLIENT
from gateway_checks import assert_baseline, upstreams
from kvwatch.lab.state import LabState

pytestmark = pytest.mark.integration

REPLICAS = 3
SESSIONS = [f"sess-{i}" for i in range(6)]
ROUND_ROBIN_SESSIONS = [f"rr-{i}" for i in range(4)]  # not a multiple of the replicas: each moves on


def served_config(lab) -> tuple[dict[str, str], dict[str, list]]:
    """From Envoy's own config dump: each cluster's lb_policy and each route config's hash policies."""
    admin = LabState(lab.state_dir, lab.base_port).ports.gateway_admin
    dump = CLIENT.get(f"http://127.0.0.1:{admin}/config_dump").json()
    policies, hashing = {}, {}
    for config in dump["configs"]:
        for entry in config.get("dynamic_active_clusters", []):
            cluster = entry["cluster"]
            policies[cluster["name"]] = cluster.get("lb_policy", "ROUND_ROBIN")  # the default is left out
        for entry in config.get("dynamic_route_configs", []):
            routes = entry["route_config"]["virtual_hosts"][0]["routes"]
            hashing[entry["route_config"]["name"]] = [
                r["route"]["hash_policy"] for r in routes if "hash_policy" in r.get("route", {})
            ]
    return policies, hashing


def test_maglev_keeps_affinity_sessions_sticky_and_round_robin_spreads_them(start_lab):
    quiet = ("--users", "0", "--no-probes", "--time-scale", "0.2")
    lab = start_lab("--gateway", "envoy", "--envoy-lb", "maglev", "--replicas", str(REPLICAS), *quiet)
    policies, hashing = served_config(lab)
    assert policies == {"affinity": "MAGLEV", "round_robin": "ROUND_ROBIN"}
    assert (
        hashing["affinity"] == [[{"header": {"header_name": "x-session-id"}}]] and not hashing["round_robin"]
    )

    assert_baseline(lab, SESSIONS)  # every session on one replica, its id echoed
    pinned = {rounds[0] for rounds in upstreams(lab.affinity, SESSIONS).values()}
    assert len(pinned) > 1, "Maglev put every session on one replica"
    spread = upstreams(lab.round_robin, ROUND_ROBIN_SESSIONS)
    assert all(len(set(rounds)) == REPLICAS for rounds in spread.values()), spread
