"""The detection benchmark's floors come from the config a lab ran, and a fault waits until the alerts
before it have resolved at the webhook and their Alertmanager groups are gone."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.bench_detection import (
    BREAK_AFFINITY,
    CACHING_OFF,
    CACHING_OFF_UNREPORTED,
    DROP_SESSION_HEADER,
    FAST,
    KILL_REPLICA,
    RESTART_REPLICA,
    SCALE_OUT,
    LabRun,
    awaited,
    floor,
    group_wait,
    groups_gone_at,
    seconds,
    unexpected,
    unresolved,
)
from kvwatch.lab.configs import scale_durations
from paths import REPO

REPO_ALERTS = REPO / "alerts"
SHIPPED_ROUTE = yaml.safe_load((REPO_ALERTS / "alertmanager.yml").read_text())["route"]


@pytest.mark.parametrize(
    ("duration", "expected"), [("0m", 0), ("30s", 30), ("1m30s", 90), ("1h", 3600), ("1.5s", 1.5)]
)
def test_durations_are_read_as_prometheus_writes_them(duration, expected):
    assert seconds(duration) == expected


def test_a_duration_prometheus_would_reject_is_an_error():
    with pytest.raises(ValueError, match="not a duration"):
        seconds("5 minutes")


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"alertname": "Watchdog"}, 0),  # its own route
        (
            {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical"},
            10,
        ),  # inherited from the root
        ({"alertname": "KVWatchPrefixCachingDisabled", "severity": "warning"}, 10),
    ],
)
def test_group_wait_is_the_first_matching_routes_or_inherited(labels, expected):
    assert group_wait(SHIPPED_ROUTE, labels) == expected


def test_a_nested_route_inherits_its_parents_group_wait_and_can_set_its_own():
    route = {
        "group_wait": "30s",
        "routes": [
            {
                "matchers": ['team!="db"'],
                "group_wait": "5s",
                "routes": [{"matchers": ['severity=~"crit.*"']}],
            },
            {"matchers": ['team="db"']},
        ],
    }
    assert group_wait(route, {"severity": "critical"}) == 5
    assert group_wait(route, {"team": "db", "severity": "critical"}) == 30


def lab_state_dir(tmp_path, *, scrape: str, probe_interval: int, scale: float):
    """A state directory as `kvwatch lab up` writes it: the shipped rules at a time scale, the shipped
    Alertmanager route, the lab's scrape and evaluation interval and its probe interval."""
    (tmp_path / "rules").mkdir()
    rules = (REPO_ALERTS / "kvwatch.rules.yml").read_text()
    (tmp_path / "rules" / "kvwatch.rules.yml").write_text(scale_durations(rules, scale))
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": scrape, "evaluation_interval": scrape}})
    )
    targets = [{"name": "lab-affinity", "interval_seconds": probe_interval}]
    (tmp_path / "kvwatch.yaml").write_text(yaml.safe_dump({"targets": targets}))
    alertmanager = (REPO_ALERTS / "alertmanager.yml").read_text()
    (tmp_path / "alertmanager.yml").write_text(scale_durations(alertmanager, scale))
    return tmp_path


def test_a_probe_alerts_floor_adds_the_probe_interval_scrape_evaluation_for_and_group_wait(tmp_path):
    state_dir = lab_state_dir(tmp_path, scrape="5s", probe_interval=30, scale=1)
    found = floor(state_dir, BREAK_AFFINITY)
    assert (found.probe_s, found.scrape_s, found.evaluation_s, found.for_s, found.group_wait_s) == (
        30,
        5,
        5,
        0,
        10,
    )
    assert (found.earliest, found.latest, str(found)) == (10, 50, "10-50 s (30+5+5+0+10)")
    assert floor(state_dir, DROP_SESSION_HEADER).latest == 50  # the probe's rule, not the gateway log's 5 m


def test_an_engine_alerts_floor_has_no_probe_interval_and_takes_its_fastest_rule(tmp_path):
    state_dir = lab_state_dir(tmp_path, scrape="5s", probe_interval=30, scale=1)
    assert floor(state_dir, CACHING_OFF).latest == 20  # the config gauge's `for: 0m`, not the lookups' 30 s
    assert floor(state_dir, CACHING_OFF_UNREPORTED).for_s == 300


def test_the_floor_follows_the_labs_rule_time_scale(tmp_path):
    state_dir = lab_state_dir(tmp_path, scrape="1s", probe_interval=5, scale=0.1)
    assert (
        floor(state_dir, CACHING_OFF_UNREPORTED).latest == 1 + 1 + 30 + 3
    )  # group_wait 10 s scaled to 1 s: min 3
    assert floor(state_dir, BREAK_AFFINITY).latest == 5 + 1 + 1 + 0 + 3


FIRING = {"status": "firing", "labels": {"alertname": "KVWatchSessionAffinityBroken"}, "received_at": 100.0}
RESOLVED = {**FIRING, "status": "resolved", "received_at": 105.0}


def test_an_alert_whose_resolution_has_not_reached_the_webhook_holds_the_next_fault():
    # Still firing (keep_firing_for), it would carry the next fault's alert of the same labels, which
    # Alertmanager sends again only after the route's repeat_interval (6 min when fast).
    assert unresolved([FIRING]) == {'{"alertname": "KVWatchSessionAffinityBroken"}'}
    assert unresolved([{**FIRING, "received_at": 110.0}, RESOLVED])  # resolved, then fired again


def test_an_alert_resolved_at_the_webhook_lets_the_next_fault_start_even_before_the_heal():
    # A replica restart's TargetDown resolves on its own, before the heal.
    assert unresolved([RESOLVED, FIRING]) == set()


def test_a_later_faults_alert_raised_by_an_earlier_fault_must_resolve_before_the_next_fault():
    # A restart breaks the probe's affinity while its sessions fail over: still firing, that alert
    # would hide the break's.
    run = LabRun("probed", FAST, 0, ((RESTART_REPLICA, SCALE_OUT), (BREAK_AFFINITY,), (KILL_REPLICA,)))
    assert awaited(run, 0) == {"KVWatchSessionAffinityBroken", "KVWatchTargetDown"}
    assert awaited(run, 1) == {"KVWatchSessionAffinityBroken", "KVWatchTargetDown"}
    assert awaited(run, 2) == {"KVWatchTargetDown"}


def test_the_next_fault_waits_until_alertmanager_has_dropped_the_resolved_alerts_group():
    # Joining the old group, the next fault's alert of the same group labels would skip group_wait.
    assert groups_gone_at([FIRING, RESOLVED]) == 105 + 30 + 1


def test_an_unexpected_alert_is_named_with_the_replica_it_is_about():
    alerts = [
        {"alertname": "KVWatchTargetDown", "labels": {"replica": "r4"}},
        {"alertname": "KVWatchTargetDown", "labels": {"replica": "r4"}},
        {"alertname": "KVWatchGatewaySessionsSpread", "labels": {"log": "affinity"}},
        {"alertname": "KVWatchPrefixCachingDisabled", "labels": {}},
    ]
    assert unexpected(alerts, {"KVWatchPrefixCachingDisabled"}) == [
        "KVWatchGatewaySessionsSpread",
        "KVWatchTargetDown on r4",
    ]
