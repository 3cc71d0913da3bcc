"""KVWatchGatewaySessionsMoved end to end from real traffic: the lab's users talk through the real nginx,
`kvwatch serve` counts their returning requests from its access log, the real Prometheus judges them and
the real Alertmanager holds the alert. Healthy traffic, a replica restart included, raises nothing;
break-affinity raises it. No probes: only the users' own requests count.

The lab runs with --fast (1 s scrapes and evaluations) and --rule-time-scale 0.5: a 30 s window.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvwatch.core.promapi import PrometheusApi
from kvwatch.prometheus.queries import GATEWAY_MOVED_SHARE, GATEWAY_RETURNING_REQUESTS
from kvwatch.prometheus.thresholds import THRESHOLDS
from labs import Lab

pytestmark = pytest.mark.integration

ALERT = "KVWatchGatewaySessionsMoved"
WAIT_S = 180
# Four users over three replicas: a broken gateway's round robin cannot send each user's next request to
# the replica of its previous one.
LAB_OPTIONS = ("--replicas", "3", "--users", "4", "--think", "0.2", "--time-scale", "0.2", "--no-probes",
               "--rule-time-scale", "0.5")  # fmt: skip
AFFINITY = '{log="affinity", listener="affinity"}'
HEALTHY_EVALUATIONS = 60  # a minute of 1 s evaluations, two of the alert's scaled windows


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    return start_lab(*LAB_OPTIONS)


def prometheus(lab: Lab) -> PrometheusApi:
    return PrometheusApi(lab.status["prometheus"], 10)


def held_by_alertmanager(lab: Lab) -> list[dict]:
    """The alert's instances Alertmanager holds active now."""
    answer = httpx.get(f"{lab.status['alertmanager']}/api/v2/alerts",
                       params={"active": "true", "filter": f'alertname="{ALERT}"'}, timeout=10)  # fmt: skip
    answer.raise_for_status()
    return answer.json()


def judged_samples(lab: Lab, since: float) -> list[float]:
    """The unexplained moved share of the affinity listener at every evaluation since `since` at which
    the alert's traffic guard held: what the alert judged."""
    guard = THRESHOLDS.min_returning_requests_per_minute
    expr = (
        f'{GATEWAY_MOVED_SHARE}{{log="affinity", listener="affinity", failover="false"}}\n'
        f"and on(log, listener) {GATEWAY_RETURNING_REQUESTS}{AFFINITY} * 60 >= {guard:g}"
    )
    series = prometheus(lab).query_range(expr, since, time.time(), step=1)
    return [float(value) for one in series for _, value in one["values"]]


def test_healthy_traffic_with_a_replica_restart_raises_nothing(lab):
    since = time.time()
    assert lab.cli("fault", "restart-replica", "r2").returncode == 0
    deadline = time.monotonic() + WAIT_S
    while len(judged := judged_samples(lab, since)) < HEALTHY_EVALUATIONS:
        assert time.monotonic() < deadline, f"only {len(judged)} evaluations judged within {WAIT_S} s"
        time.sleep(2)
    assert max(judged) <= THRESHOLDS.moved_share_above, judged
    pending = prometheus(lab).query_range(f'ALERTS{{alertname="{ALERT}"}}', since, time.time(), step=1)
    assert pending == [] and held_by_alertmanager(lab) == []
    assert lab.cli("heal").returncode == 0


def test_break_affinity_raises_the_alert_from_returning_requests(lab):
    assert lab.cli("fault", "break-affinity").returncode == 0
    deadline = time.monotonic() + WAIT_S
    while not (held := held_by_alertmanager(lab)):
        assert time.monotonic() < deadline, f"Alertmanager held no {ALERT} within {WAIT_S} s"
        time.sleep(1)
    (alert,) = held
    wanted = {"log": "affinity", "listener": "affinity", "severity": "critical"}
    assert wanted.items() <= alert["labels"].items()
    assert lab.cli("heal").returncode == 0
