"""The dashboard says what its numbers mean, through AppTest with the data layer replaced (the Fake of
fake_dashboard): an alert that keep_firing_for holds after its signal recovered reads as resolving, with
the time it clears; a change is coloured by what a rise of the number means; lines and bars of things
with no good or bad take no red or green; close marks share a label; counts agree with their nouns; and
Watchdog is the pipeline's heartbeat, not an alert."""

from __future__ import annotations

import pandas as pd
import plotly.io
import pytest
import streamlit as st
from fake_dashboard import (
    ALERT_AT,
    FAULT_AT,
    NOW,
    T0,
    Fake,
    alerts_frame,
    cluster_state,
    fires,
    open_page,
    per_listener,
    per_route,
    points,
    sessions_frame,
    states,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan
from streamlit.proto.Metric_pb2 import Metric

from kvwatch.alerts.verdicts import CLUSTER_HIT_RATIO_DROP, FIRING, OK, ROUTE_STICKY
from kvwatch.core.naming import plural
from kvwatch.dashboard import data, ui
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import panel_queries, queries

STOPPED, CLEARS = NOW - 40, NOW + 83  # the affinity alert's expression stopped matching, and it clears


def held(**labels: str) -> pd.DataFrame:
    """data.firing_alerts' answer: the affinity alert held by its keep_firing_for of 2 minutes."""
    at = {
        key: pd.Timestamp(t, unit="s", tz="UTC")
        for key, t in (("stopped_at", STOPPED), ("clears_at", CLEARS))
    }
    return pd.DataFrame(
        [
            {
                "alertname": ROUTE_STICKY.alert.name,
                "severity": "critical",
                **labels,
                **at,
                "keep_firing_for": 120.0,
            }
        ]
    )


def still_firing(**labels: str) -> pd.DataFrame:
    """data.firing_alerts' answer for an alert whose expression still matches."""
    return held(**labels).assign(stopped_at=pd.NaT, clears_at=pd.NaT, keep_firing_for=float("nan"))


def firing_now(**labels: str) -> pd.DataFrame:
    return pd.DataFrame(
        [{"alertname": ROUTE_STICKY.alert.name, "alertstate": "firing", "severity": "critical", **labels,
          "value": 1.0}]
    )  # fmt: skip


RESOLVING = (
    f":blue[Healthy again since {ui.clock(pd.Timestamp(STOPPED, unit='s', tz='UTC'))}: "
    f"{ROUTE_STICKY.alert.name} still fires, held by its keep_firing_for of 120 s, and clears at "
    f"{ui.clock(pd.Timestamp(CLEARS, unit='s', tz='UTC'))}.]"
)


def recovered(fake: Fake) -> None:
    """The issue's page 50 s after the heal: 100 % on one replica while the alert still fires."""
    fake.ranges[queries.STICKY_RATIO] = lambda over: per_route(over, [0.2, 1.0], [0, 0])
    fake.values[ROUTE_STICKY.state] = states(**{"lab-affinity": FIRING})
    fake.values[panel_queries.FIRING_ALERTS_NOW] = firing_now(target="lab-affinity", route_mode="affinity")


def test_a_recovered_signal_whose_alert_is_held_reads_as_resolving_with_its_clear_time(fake):
    recovered(fake)
    said = texts(open_page("overview"))
    assert fires(ROUTE_STICKY) in said and RESOLVING not in said  # nothing says it is held: red
    fake.firing = Result(still_firing(target="lab-affinity", route_mode="affinity"))
    assert fires(ROUTE_STICKY) in texts(open_page("overview"))  # Prometheus says it still fires: red
    fake.firing = Result(held(target="lab-affinity", route_mode="affinity"))
    at = open_page("overview")
    said = texts(at)
    assert RESOLVING in said and fires(ROUTE_STICKY) not in said
    assert not at.error and not at.success  # neither "Firing now" nor "No kvwatch alert is firing"
    assert at.info[0].value.startswith(
        f"Healthy again: **{ROUTE_STICKY.alert.name}** on lab-affinity, clearing at "
        f"{ui.clock(pd.Timestamp(CLEARS, unit='s', tz='UTC'))}."
    )


def test_a_held_alert_of_another_route_leaves_a_firing_one_red(fake):
    recovered(fake)
    fake.firing = Result(
        pd.concat([held(target="other-route", route_mode="affinity"),
                   still_firing(target="lab-affinity", route_mode="affinity")])
    )  # fmt: skip
    at = open_page("overview")
    assert fires(ROUTE_STICKY) in texts(at) and RESOLVING not in texts(at)
    assert at.error[0].value.startswith(
        f"Firing now: **{ROUTE_STICKY.alert.name}** (critical) on lab-affinity"
    )


def test_an_alert_cleared_since_the_pages_time_reads_as_healthy_again(fake):
    """The page reads Prometheus a few seconds back (data.now): its alert may have cleared since."""
    recovered(fake)
    fake.firing = Result(data.FIRING_NONE)
    at = open_page("overview")
    assert (
        f":blue[Healthy again: {ROUTE_STICKY.alert.name} fired at this page's time and has cleared since.]"
        in (texts(at))
    )
    assert not at.error and at.info[0].value.startswith(
        f"Healthy again: **{ROUTE_STICKY.alert.name}** on lab-affinity, cleared since this page's time."
    )


def test_when_prometheus_rules_cannot_be_read_the_verdicts_are_the_alerts_plain_state(fake):
    recovered(fake)
    fake.firing = Result(error="Prometheus at X refused: nope")
    at = open_page("overview")
    assert fires(ROUTE_STICKY) in texts(at)
    assert "Alerts held by their keep_firing_for are not told apart: Prometheus at X refused" in texts(at)


def test_the_overview_answers_the_stickiness_question_first(fake):
    at = open_page("overview")
    assert [h.value for h in at.header] == [
        "Do sessions stay on their replica, and what does it cost?",
        "Is the KV cache reused?",
    ]
    assert [m.label for m in at.metric][:3] == [
        "Sessions on one replica",
        "Warm / cold TTFT",
        "Affinity efficiency",
    ]
    assert [m.label for m in at.metric].count("Cluster hit ratio") == 1  # after the routes and logs
    assert [m.label for m in at.metric][-1] == "Cluster hit ratio"


def metric_colors(at) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for metric in at.metric:
        found.setdefault(metric.label, []).append(metric.proto.color)
    return found


def test_a_change_is_coloured_by_what_a_rise_of_the_number_means_not_by_its_verdict(fake):
    """The issue's "↓ -9 pp" in green: a falling hit ratio the alert still finds fine is red."""
    fake.ranges[queries.CLUSTER_HIT_RATIO] = lambda over: points(over, [0.96, 0.87])
    fake.values[CLUSTER_HIT_RATIO_DROP.state] = cluster_state(OK)
    fake.ranges[queries.GATEWAY_SPREAD] = lambda over: per_listener(over, [0.3, 0.1], [0.9, 0.96])
    fake.ranges[queries.WARM_COLD_RATIO] = lambda over: per_route(over, [0.2, 0.3], [1.6, 1.3])
    at = open_page("overview")
    hit_ratio = next(m for m in at.metric if m.label == "Cluster hit ratio")
    assert hit_ratio.delta == "-9 pp" and ":green[Reuse holds" in texts(at)
    colors = metric_colors(at)
    assert colors["Cluster hit ratio"] == [Metric.RED]
    assert colors["Real sessions on several replicas"] == [Metric.GREEN, Metric.RED]  # falls, rises
    assert colors["Warm / cold TTFT"] == [Metric.RED, Metric.GREEN]  # warm rounds slower; faster
    assert colors["Sessions on one replica"] == [Metric.GRAY, Metric.GRAY]  # unchanged: 1 and 0 throughout


def figures(at) -> dict[str, object]:
    """The plotly figures the page drew, by their key."""
    return {c.proto.id.rsplit("-", 1)[-1]: plotly.io.from_json(c.proto.spec) for c in at.get("plotly_chart")}


MEANING = {"#d62728", "#2ca02c", "#ff7f0e", "red", "green", "orange"}  # what verdicts and marks say


def trace_colors(figure) -> list[str | None]:
    """Each trace's colour as drawn: its line's, else its markers'; None where the theme would pick."""
    return [
        (trace.line.color if "line" in trace and trace.line.color else None)
        or (trace.marker.color if "marker" in trace else None)
        or (trace.fillcolor if "fillcolor" in trace else None)
        for trace in figure.data
    ]


def test_the_overview_lines_are_coloured_by_what_they_measure(fake):
    """The healthy stickiness line was red: the theme's third colour."""
    (figure,) = figures(open_page("overview")).values()
    lines = {trace.name: trace.line for trace in figure.data}
    assert list(lines) == ["cluster hit ratio", "lab-affinity: sessions on one replica",
                           "affinity / affinity: real sessions spread"]  # fmt: skip
    assert lines["lab-affinity: sessions on one replica"].color == ui.SERIES_COLORS[1]
    assert not MEANING & set(trace_colors(figure)) and None not in trace_colors(figure)


@pytest.mark.parametrize("page", ["overview", "per_round", "replicas", "sessions"])
def test_no_page_draws_a_thing_without_good_or_bad_in_red_or_green(fake, page):
    at = open_page(page)
    for key, figure in figures(at).items():
        meant = {"backend switch", "failed"}  # the timeline's: a switch is red, a failed round a black x
        drawn = [
            c for trace, c in zip(figure.data, trace_colors(figure), strict=True) if trace.name not in meant
        ]
        assert drawn and None not in drawn and not MEANING & set(drawn), (key, drawn)


def annotations(figure) -> list[str]:
    return [a.text for a in figure.layout.annotations]


@pytest.mark.parametrize(("apart", "labels"), [
    (10, ["fault break-affinity<br>KVWatchSessionAffinityBroken firing", "heal break-affinity"]),
    (60, ["fault break-affinity", "KVWatchSessionAffinityBroken firing", "heal break-affinity"]),
])  # fmt: skip
def test_marks_too_close_to_read_apart_share_one_label(fake, monkeypatch, apart, labels):
    """On a chart of the last 50 minutes (the first mark to the last point) a label is some 40 s wide: a
    fault and the alert 10 s after it overlapped."""
    started = pd.Timestamp(NOW - 3600 + FAULT_AT + apart, unit="s", tz="UTC")
    received = pd.Timestamp(T0, unit="s", tz="UTC")
    repeated = alerts_frame(state="firing", received_at=received, starts_at=started, ends_at=pd.NaT)
    monkeypatch.setattr(data, "received_alerts", lambda since: Result(pd.concat([repeated, repeated])))
    (figure,) = figures(open_page("overview")).values()
    assert sorted(annotations(figure)) == sorted(labels)  # the repeated notification marked once
    assert len(figure.layout.shapes) == 3  # a line for each event still
    assert FAULT_AT < ALERT_AT  # the Fake's default: 60 s apart


def test_counts_agree_with_their_nouns(fake, monkeypatch):
    assert (plural(1, "session"), plural(2, "session")) == ("1 session", "2 sessions")
    assert plural(1, "backend switch", "backend switches") == "1 backend switch"
    one = sessions_frame().query("id == 3")  # 3 backend switches
    monkeypatch.setattr(data, "sessions", lambda since: Result(one))
    at = open_page("sessions")
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    assert "1 session since" in texts(at) and "3 backend switches; 0 failed." in texts(at)
    per_round = open_page("per_round")
    (figure,) = figures(per_round).values()
    robin = next(t for t in figure.data if t.name == "lab-round-robin median")
    assert list(robin.customdata) == ["2 sessions", "2 sessions", "2 sessions", "1 session"]


WATCHDOG = {
    "alertname": "Watchdog",
    "severity": "none",
    "target": None,
    "summary": "alive",
    "runbook_url": None,
}


def test_watchdog_is_the_pipelines_heartbeat_not_a_firing_alert(fake, monkeypatch):
    held_now = pd.concat([alerts_frame(), alerts_frame(**WATCHDOG)])
    monkeypatch.setattr(data, "alerts", lambda: Result(held_now))
    beat = alerts_frame(**WATCHDOG, state="firing", received_at=pd.Timestamp(T0 + 60, unit="s", tz="UTC"),
                        starts_at=pd.Timestamp(T0, unit="s", tz="UTC"), ends_at=pd.NaT)  # fmt: skip
    kvwatch = alerts_frame(state="firing", received_at=pd.Timestamp(T0, unit="s", tz="UTC"), ends_at=pd.NaT)
    monkeypatch.setattr(data, "received_alerts", lambda since: Result(pd.concat([kvwatch, beat])))
    at = open_page("alerts")
    assert not at.exception
    assert [list(table.value["alertname"]) for table in at.dataframe] == [[ROUTE_STICKY.alert.name]] * 2
    assert at.success[0].value.startswith(
        "Heartbeat: Alertmanager holds Watchdog, the alert that always fires"
    )
    assert f"kvwatch's webhook last received it at {ui.as_of(T0 + 60)}." in at.success[0].value
    assert [e.label for e in at.expander] == [f"Runbook: {ROUTE_STICKY.alert.name}"]


def test_without_watchdog_the_alerts_page_says_the_pipeline_is_broken(fake):
    at = open_page("alerts")  # Alertmanager holds the affinity alert only
    assert at.warning[0].value.startswith("No heartbeat: Alertmanager does not hold Watchdog")
    assert not at.success


def test_the_data_layer_reads_the_firing_and_held_alerts_from_prometheus_rules_api(monkeypatch):
    """keepFiringSince, keepFiringFor and the group's interval as Prometheus 2.42 answers them."""
    rules = [
        {"name": ROUTE_STICKY.alert.name, "keepFiringFor": 12, "interval": 5.0, "alerts": [
            {"labels": {"alertname": ROUTE_STICKY.alert.name, "target": "a"}, "state": "firing",
             "activeAt": "2026-12-05T04:22:56.6Z", "keepFiringSince": "2026-12-05T04:22:57.632510205Z"},
            {"labels": {"alertname": ROUTE_STICKY.alert.name, "target": "b"}, "state": "firing",
             "activeAt": "2026-12-05T04:22:56.6Z"},
            {"labels": {"alertname": ROUTE_STICKY.alert.name, "target": "c"}, "state": "pending",
             "activeAt": "2026-12-05T04:22:56.6Z"}]},
        {"name": "Watchdog", "keepFiringFor": 0, "interval": 5.0, "alerts": [
            {"labels": {"alertname": "Watchdog"}, "state": "firing", "activeAt": "2026-12-05T04:00:00Z"}]},
    ]  # fmt: skip
    monkeypatch.setattr(data, "_service_url", lambda name: Result("http://127.0.0.1:1"))
    monkeypatch.setattr(data.PrometheusApi, "alerting_rules", lambda self: rules)
    st.cache_data.clear()
    found = data.firing_alerts(0).value.set_index(["alertname", "target"], drop=False)
    st.cache_data.clear()
    assert sorted(found["target"].fillna("-")) == ["-", "a", "b"]  # firing ones only
    held_a, firing_b = found.loc[(ROUTE_STICKY.alert.name, "a")], found.loc[(ROUTE_STICKY.alert.name, "b")]
    stopped, clears = (
        pd.Timestamp(t).timestamp() for t in ("2026-12-05T04:22:57.63251Z", "2026-12-05T04:23:12.63251Z")
    )
    assert held_a["stopped_at"].timestamp() == pytest.approx(stopped, abs=1e-6)
    assert held_a["clears_at"].timestamp() == pytest.approx(clears, abs=1e-6)  # 3 evaluations of 5 s on
    assert held_a["keep_firing_for"] == 12
    assert pd.isna(firing_b["stopped_at"]) and pd.isna(firing_b["clears_at"])
