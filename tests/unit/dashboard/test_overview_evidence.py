"""The Overview judges a route by the evidence it has: where no round names its replica (SageMaker), by the
share of its sessions that kept their reuse, the figure KVWatchSessionReuseLost fires on, with its verdict
and the warm rounds' reuse beside it, instead of a replica stickiness that cannot apply; a route whose
rounds name their replica keeps its stickiness tile and verdict."""

from __future__ import annotations

import json

import pandas as pd
from fake_dashboard import Fake, fires, marks, metrics, open_page, per_route, points, states, texts
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan
from test_meaning import CLEARS, STOPPED, held

from kvwatch.alerts.verdicts import FIRING, OK, PENDING, ROUTE_REUSE, ROUTE_STICKY
from kvwatch.dashboard import data, ui
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import queries

REUSE_OK = ":green[Sessions reuse their history: they reach the replica that holds it.]"
REUSED = "Sessions reusing their history"
STICKY_OK = ":green[Sessions stay on their replica.]"
AFFINITY = {"target": "lab-affinity", "route_mode": "affinity"}


def judged_by_reuse(fake: Fake, reused: list[float], state: int) -> None:
    """lab-affinity names no replica: Prometheus holds the share of its sessions that kept their reuse, in
    `state` of KVWatchSessionReuseLost, and its warm rounds' reuse (0.74: a round sent to the other
    instance still finds that session's older history there). The affinity alert's verdict says
    something else of a stickiness judged by replica: the page must not show it for this route."""
    fake.ranges[queries.REUSED_SESSIONS_RATIO] = lambda over: points(over, reused, **AFFINITY)
    fake.ranges[queries.WARM_REUSE_RATIO] = lambda over: points(over, [0.9, 0.74], **AFFINITY)
    fake.ranges[queries.STICKY_RATIO] = lambda over: per_route(over, [1, 0.5], [0, 0])
    fake.values[ROUTE_REUSE.state] = states(**{"lab-affinity": state})
    fake.values[ROUTE_STICKY.state] = states(**{"lab-affinity": PENDING})


def changes_lines(at) -> list[str]:
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("overview_changes")]
    return [line["name"] for line in json.loads(chart.proto.spec)["data"]]


def test_a_route_judged_by_reuse_shows_its_reused_sessions_with_the_reuse_alerts_verdict(fake):
    judged_by_reuse(fake, [0.5, 1], OK)
    at = open_page("overview")
    assert not at.exception
    shown = metrics(at)
    assert shown[REUSED] == ["100%"]
    assert shown["Warm rounds' reuse"] == ["74%"]  # the context, judged by no alert
    assert shown["Sessions on one replica"] == ["0%"]  # the round-robin route only: it names its replica
    said = texts(at)
    assert REUSE_OK in said and ":gray[No alert judges it: the tokens behind the share" in said
    assert STICKY_OK not in said and ":orange[KVWatchSessionAffinityBroken" not in said
    assert said.count(":gray[Not expected to stay on one replica") == 3  # round robin's tiles and log's
    assert "lab-affinity: sessions reusing their history" in changes_lines(at)
    assert "lab-affinity: sessions on one replica" not in changes_lines(at)


def test_a_route_judged_by_reuse_is_red_while_the_reuse_alert_fires_and_pending_before(fake):
    """Red on the share the alert fires on, beside a warm reuse that fell far less."""
    judged_by_reuse(fake, [1, 0], FIRING)
    at = open_page("overview")
    assert metrics(at)[REUSED] == ["0%"] and metrics(at)["Warm rounds' reuse"] == ["74%"]
    said = texts(at)
    assert fires(ROUTE_REUSE) in said and REUSE_OK not in said
    fake.values[ROUTE_REUSE.state] = states(**{"lab-affinity": PENDING})
    said = texts(open_page("overview"))
    assert f":orange[{ROUTE_REUSE.alert.name} is pending: " in said and fires(ROUTE_REUSE) not in said


def test_a_route_judged_by_reuse_reads_as_resolving_while_the_reuse_alert_is_held(fake):
    judged_by_reuse(fake, [0, 1], FIRING)
    fake.firing = Result(held(**AFFINITY).assign(alertname=ROUTE_REUSE.alert.name))
    said = texts(open_page("overview"))
    clock = ui.clock  # the page's own clock format
    assert (
        f":blue[Healthy again since {clock(pd.Timestamp(STOPPED, unit='s', tz='UTC'))}: "
        f"{ROUTE_REUSE.alert.name} still fires, held by its keep_firing_for of 120 s, and clears at "
        f"{clock(pd.Timestamp(CLEARS, unit='s', tz='UTC'))}.]"
    ) in said
    assert fires(ROUTE_REUSE) not in said


def test_a_route_judged_by_reuse_without_the_reuse_alerts_series_is_not_watched(fake):
    judged_by_reuse(fake, [0.5, 1], OK)
    fake.values[ROUTE_REUSE.state] = pd.DataFrame(columns=["value"])
    said = texts(open_page("overview"))
    assert (
        f":gray[Not watching: Prometheus holds no series {ROUTE_REUSE.alert.name} judges here now.]" in said
    )
    assert REUSE_OK not in said


def test_a_route_whose_rounds_name_their_replica_keeps_its_stickiness_verdict(fake):
    """No session judged by reuse: the replica each round names judges the route, as before."""
    fake.values[ROUTE_REUSE.state] = states(**{"lab-affinity": FIRING})  # no route of it shown
    at = open_page("overview")
    shown = metrics(at)
    assert REUSED not in shown and "Warm rounds' reuse" not in shown
    assert shown["Sessions on one replica"] == ["100%", "0%"]
    said = texts(at)
    assert STICKY_OK in said and fires(ROUTE_REUSE) not in said
    assert "lab-affinity: sessions on one replica" in changes_lines(at)


def test_marks_at_nanoseconds_draw_without_a_warning(fake, monkeypatch):
    """Alertmanager times alerts to the nanosecond; a chart's marks take them without a warning box."""
    received = fake._received_alerts

    def to_the_nanosecond(since: float) -> Result:
        alerts = received(since).value
        return Result(alerts.assign(starts_at=alerts["starts_at"] + pd.Timedelta(nanoseconds=123)))

    monkeypatch.setattr(data, "received_alerts", to_the_nanosecond)
    at = open_page("overview")
    assert not at.exception, [e.message for e in at.exception]
    assert "KVWatchSessionAffinityBroken firing" in [text for _, text in marks(at, "overview_changes")]
