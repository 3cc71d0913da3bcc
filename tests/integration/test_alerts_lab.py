"""Alerts end to end in the lab: each fault's alert travels through the real Prometheus and
Alertmanager to kvwatch's webhook, and resolves after `kvwatch lab heal`; a healthy baseline with a
replica restart raises nothing but Watchdog.

The lab runs with --fast (1 s scrapes and rule evaluations, probes every 5 s) and --rule-time-scale 0.1:
every rule window, `for` and Alertmanager timer at a tenth of its production value.
"""

from __future__ import annotations

import time

import pytest

from kvwatch.core.promapi import PrometheusApi
from kvwatch.lab.configs import scale_durations
from kvwatch.prometheus.queries import STICKY_ROUTES_JUDGED
from kvwatch.prometheus.thresholds import THRESHOLDS
from kvwatch.store.history import Store
from labs import Lab
from processes import wait_for as until

pytestmark = pytest.mark.integration

WAIT_S = 90
RULE_TIME_SCALE = 0.1
CHANGE_WINDOW_S = int(scale_durations(THRESHOLDS.replica_change_window, RULE_TIME_SCALE).removesuffix("s"))
# Eight users, so that their prompt tokens outweigh the probes' (every 5 s with --fast, and untouched by
# the dynamic-prefix fault): the fault takes the cluster ratio from 0.8 to below 0.3, well under half of
# its past; with four users it fell only to about 0.34, at the alert's threshold.
LAB_OPTIONS = ("--replicas", "4", "--users", "8", "--think", "0.2",
               "--time-scale", "0.3", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip
# The fault tests' alerts come from the probes and the engines' own metrics: one user is enough traffic,
# and the eight users' requests through a second lab would double the module's CPU.
FAULT_LAB_OPTIONS = ("--replicas", "4", "--users", "1", "--think", "0.2",
                     "--time-scale", "0.3", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip


@pytest.fixture(scope="module")
def healthy_lab(start_lab) -> Lab:
    """The healthy baseline's lab, then, once the fault tests have spent two minutes in a lab of their
    own, the dynamic-prefix test's: its alert compares with a past that no other fault lowered."""
    return start_lab(*LAB_OPTIONS)


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    return start_lab(*FAULT_LAB_OPTIONS)


def received(lab, since: float) -> list[dict]:
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        return [a for a in store.alerts() if a["received_at"] >= since]


def wait_for(lab, since: float, alertname: str, status: str, **labels) -> dict:
    """The first alert of that name, status and labels that reached the webhook after `since`."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for alert in received(lab, since):
            matches = all(alert["labels"].get(k) == v for k, v in labels.items())
            if alert["alertname"] == alertname and alert["status"] == status and matches:
                return alert
        time.sleep(1)
    seen = sorted({(a["alertname"], a["status"]) for a in received(lab, since)})
    raise AssertionError(f"no {status} {alertname} {labels} within {WAIT_S} s; received: {seen}")


def fault(lab, *args: str) -> float:
    started = time.time()
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr
    return started


def heal(lab) -> float:
    started = time.time()
    assert lab.cli("heal").returncode == 0
    return started


def judged_routes(lab) -> set[str]:
    """The routes KVWatchSessionAffinityBroken judges now, as the lab's Prometheus evaluates its rule."""
    expr = f"group by (target) (kvwatch_probe_route_info)\nand {STICKY_ROUTES_JUDGED}"
    return {sample["metric"]["target"] for sample in PrometheusApi(lab.status["prometheus"], 10).query(expr)}


def test_a_healthy_lab_with_a_replica_restart_raises_only_watchdog(healthy_lab):
    since = time.time()
    wait_for(healthy_lab, since - 60, "Watchdog", "firing")
    time.sleep(15)
    assert judged_routes(healthy_lab) == {"lab-affinity"}
    restarted = fault(healthy_lab, "restart-replica", "r4")
    # The gateway may move r4's sessions: the affinity alert judges no route until the restart is a
    # whole window old (its counters went back), then the sticky route again.
    until(lambda: judged_routes(healthy_lab) == set(), "the restart seen", 20, 0.5)
    until(lambda: judged_routes(healthy_lab) == {"lab-affinity"}, "the route judged again", 90, 0.5)
    assert time.time() - restarted >= CHANGE_WINDOW_S
    others = {a["alertname"] for a in received(healthy_lab, since)} - {"Watchdog"}
    assert others == set()


def test_affinity_prefix_cache_and_replica_faults_fire_and_resolve(lab):
    r2 = lab.replica_url("r2").removeprefix("http://")
    r3 = lab.replica_url("r3").removeprefix("http://")
    since = fault(lab, "break-affinity")
    fault(lab, "disable-prefix-cache", "--replica", "r2")
    fault(lab, "kill-replica", "r3")
    wait_for(lab, since, "KVWatchSessionAffinityBroken", "firing", target="lab-affinity")
    wait_for(lab, since, "KVWatchPrefixCachingDisabled", "firing", instance=r2)
    wait_for(lab, since, "KVWatchTargetDown", "firing", instance=r3)
    healed = heal(lab)
    wait_for(lab, healed, "KVWatchSessionAffinityBroken", "resolved", target="lab-affinity")
    wait_for(lab, healed, "KVWatchPrefixCachingDisabled", "resolved", instance=r2)
    wait_for(lab, healed, "KVWatchTargetDown", "resolved", instance=r3)


def test_a_dropped_session_header_fires_not_propagated(lab):
    since = fault(lab, "drop-session-header")
    wait_for(lab, since, "KVWatchSessionIdNotPropagated", "firing", target="lab-affinity")
    healed = heal(lab)
    wait_for(lab, healed, "KVWatchSessionIdNotPropagated", "resolved", target="lab-affinity")


def test_hashing_the_request_id_fires_affinity_broken(lab):
    since = fault(lab, "hash-request-id")
    wait_for(lab, since, "KVWatchSessionAffinityBroken", "firing", target="lab-affinity")
    healed = heal(lab)
    wait_for(lab, healed, "KVWatchSessionAffinityBroken", "resolved", target="lab-affinity")


def test_a_dynamic_prompt_prefix_fires_hit_rate_drop(healthy_lab):
    # The alert compares the ratio with its own recent past (an hour before the last 10 minutes, in
    # production; 6 minutes before the last minute here): two minutes of the healthy lab's, spent by the
    # time the fault tests are done, and no other fault's lower hit ratio is part of it.
    time.sleep(max(0.0, healthy_lab.started_at + 120 - time.time()))
    since = fault(healthy_lab, "dynamic-prefix")
    wait_for(healthy_lab, since, "KVWatchPrefixCacheHitRateDrop", "firing", scope="cluster")
    healed = heal(healthy_lab)
    wait_for(healthy_lab, healed, "KVWatchPrefixCacheHitRateDrop", "resolved", scope="cluster")
