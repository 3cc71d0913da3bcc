"""Real users' sessions are watched without any probe: in a lab started with --no-probes, after
`break-affinity` the Overview's share of real sessions spread over replicas (from the gateway log) rises,
and its verdict turns orange while KVWatchGatewaySessionsSpread is pending and red once it fires, each in
the evaluation the alert changed."""

from __future__ import annotations

import time

import pytest
import test_dashboard_browser as dashboard_browser
from test_dashboard_browser import (
    Refresh,
    alert_now,
    as_asked,
    assert_follows_the_alert,
    notified,
    number,
    prometheus,
    refreshes,
    settle,
    state_of,
    unix,
    value_of,
    visit,
    wait_for_data,
)

from kvwatch.alerts.verdicts import LISTENER_SPREAD
from kvwatch.prometheus import queries
from kvwatch.prometheus.thresholds import THRESHOLDS
from kvwatch.store.history import Store

browser, page = dashboard_browser.browser, dashboard_browser.page  # the same Chromium fixtures
pytestmark = pytest.mark.integration

VERDICT = LISTENER_SPREAD
LISTENER = {"log": "affinity", "listener": "affinity"}  # the lab's background users go through it


@pytest.fixture(scope="module")
def started(start_lab):
    # Rules at a fortieth of production: the gateway log's spread window is 15 s, so that the sessions
    # pinned before the break soon leave it.
    return start_lab("--replicas", "3", "--users", "4", "--think", "0.2", "--time-scale", "0.2",
                     "--rule-time-scale", "0.025", "--no-probes", dashboard=True)  # fmt: skip


@pytest.fixture(scope="module")
def lab(started, page):
    wait_for_data(started, page, {queries.GATEWAY_SPREAD: 1})
    return started


def spread(shown: Refresh):
    """The affinity listener's tile: the first of its kind, the round-robin listener has no traffic."""
    return next(tile for tile in shown.tiles if tile.label == "Real sessions on several replicas")


def color(shown: Refresh) -> str:
    return state_of(VERDICT, spread(shown).verdict)


def test_real_sessions_spread_turns_red_with_its_alert_without_any_probe(lab, page):
    visit(page, lab, "Overview", '[data-testid="stMetric"]', "overview-no-probes")
    healthy = refreshes(page, lambda shown: color(shown) == "green")[-1]
    assert number(spread(healthy).value) < THRESHOLDS.spread_share_above
    broke = time.time()
    assert lab.cli("fault", "break-affinity").returncode == 0
    try:
        seen = refreshes(page, lambda shown: color(shown) == "red")
        active_at = unix(alert_now(lab, VERDICT, **LISTENER)["activeAt"])
        fired_at = notified(lab, VERDICT, "firing", broke, **LISTENER)["starts_at"]
        settle(page, '[data-testid="stMetric"]', "overview-real-sessions-spread")
    finally:
        assert lab.cli("heal").returncode == 0
    assert_follows_the_alert(seen, color, active_at, fired_at)
    red = seen[-1]
    truth = value_of(prometheus(lab, as_asked(queries.GATEWAY_SPREAD, red.as_of), red.as_of), **LISTENER)
    assert number(spread(red).value) == pytest.approx(truth, abs=0.0051)
    assert truth > THRESHOLDS.spread_share_above  # the signal rose past the alert's threshold
    # the banner names every alert firing: break-affinity also moves real sessions that return
    banner = next(line for line in red.text.splitlines() if line.startswith("Firing now: "))
    assert "KVWatchGatewaySessionsSpread (critical) on affinity / affinity" in banner, banner
    # and not a single probe ran
    assert "No probe targets in" in red.text
    assert prometheus(lab, "kvwatch_probe_sessions_total") == []
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        assert store.sessions() == []
