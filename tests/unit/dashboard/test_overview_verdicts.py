"""The app's pages and the Overview: each number with its verdict, the banners, and what it cannot see."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
from fake_dashboard import (
    ALERT_AT,
    APP,
    CONFIG,
    FAULT_AT,
    HEAL_AT,
    NO_FRAME,
    NOW,
    PAGES,
    PROMETHEUS,
    cluster_state,
    fires,
    marks,
    metrics,
    open_page,
    pending,
    per_route,
    points,
    states,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan
from streamlit.testing.v1 import AppTest

from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    FIRING,
    LISTENER_SPREAD,
    OK,
    PENDING,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
)
from kvwatch.config.settings import Target
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import panel_queries, pipeline, queries
from kvwatch.prometheus.pipeline import Link

# --- the app as a whole --------------------------------------------------------------------------------


def test_the_app_routes_to_every_page(fake):
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.exception and at.title[0].value == "Overview"
    for page in PAGES[1:]:
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, page
        assert at.title, page


# --- with data ---------------------------------------------------------------------------------------


def test_overview_shows_each_number_with_its_verdict(fake):
    at = open_page("overview")
    assert not at.exception
    shown = metrics(at)
    assert shown["Cluster hit ratio"] == ["87%"]  # delivered: cached / prompt tokens
    assert "Local lookup ratio" not in shown  # a line beside the hit ratio, not a second tile like it
    assert shown["Sessions on one replica"] == ["100%", "0%"]
    assert shown["Warm / cold TTFT"] == ["0.14×", "1.60×"]
    assert shown["Affinity efficiency"] == ["99%", "21%"]
    assert shown["Real sessions on several replicas"] == ["2%", "96%"]  # without a failover
    assert shown["Moved by a failover"] == ["12%", "0%"]
    said = texts(at)
    assert "No kvwatch alert is firing." in said
    assert ":green[Reuse holds" in said
    assert "device: 70%" in said and "host: 10%" in said
    assert "Local lookups found 93% of what they looked up." in said
    assert ":green[Sessions stay on their replica.]" in said
    assert ":green[Real sessions stay on their replica.]" in said
    # the round-robin route and log are the baseline: never judged, so never red
    assert said.count(":gray[Not expected to stay on one replica") == 3
    assert f"from Prometheus at {PROMETHEUS}" in said


# Each verdict on the Overview: its tile, its value when judged healthy and when not, the state frame
# Prometheus answers to its query, and its words when the alert finds nothing wrong.
VERDICT_TILES = {
    "route stickiness": (ROUTE_STICKY, queries.STICKY_RATIO, "lab-affinity",
                         ":green[Sessions stay on their replica.]"),
    "warm rounds": (ROUTE_WARM_ROUNDS, queries.WARM_COLD_RATIO, "lab-affinity",
                    ":green[Warm rounds are faster than round 1"),
    "gateway spread": (LISTENER_SPREAD, queries.GATEWAY_SPREAD, "affinity",
                       ":green[Real sessions stay on their replica.]"),
    "cluster hit ratio": (CLUSTER_HIT_RATIO_DROP, queries.CLUSTER_HIT_RATIO, None,
                          ":green[Reuse holds"),
}  # fmt: skip


def state_of(subject: str | None, state: int) -> pd.DataFrame:
    return cluster_state(state) if subject is None else states(**{subject: state})


@pytest.mark.parametrize("name", VERDICT_TILES)
def test_each_overview_verdict_is_its_alerts_state(fake, name):
    verdict, signal, subject, ok = VERDICT_TILES[name]
    for state, expected in ((FIRING, fires(verdict)), (PENDING, pending(verdict)),
                            (OK, ok)):  # fmt: skip
        fake.values[verdict.state] = state_of(subject, state)
        said = texts(open_page("overview"))
        assert expected in said, (name, state)
        assert (fires(verdict) in said) == (state == FIRING)


def test_a_tile_is_red_when_its_alert_fires_whatever_a_threshold_would_say(fake):
    """The issue's Overview: 89 % of sessions on one replica, in green, while the critical alert fired."""
    fake.ranges[queries.STICKY_RATIO] = lambda over: per_route(over, [1, 0.89], [0, 0])
    fake.values[ROUTE_STICKY.state] = states(**{"lab-affinity": FIRING})
    fake.ranges[queries.CLUSTER_HIT_RATIO] = lambda over: points(over, [0.8, 0.05])  # under the floor
    fake.values[CLUSTER_HIT_RATIO_DROP.state] = cluster_state(OK)  # but not for 5 min
    at = open_page("overview")
    assert metrics(at)["Sessions on one replica"][0] == "89%"
    said = texts(at)
    assert fires(ROUTE_STICKY) in said and ":green[Sessions stay" not in said
    assert ":green[Reuse holds" in said


def test_a_route_is_judged_when_expected_sticky_whatever_its_mode(fake):
    manual = Target("lab-round-robin", "http://127.0.0.1:18001", "lab-model", route_mode="round_robin",
                    expect_sticky=True)  # fmt: skip
    fake.settings = Result(replace(CONFIG, targets=(CONFIG.targets[0], manual)))
    fake.values[ROUTE_STICKY.state] = states(**{"lab-affinity": OK, "lab-round-robin": FIRING})
    said = texts(open_page("overview"))
    assert ":green[Sessions stay on their replica.]" in said and fires(ROUTE_STICKY) in said
    assert said.count(":gray[Not expected to stay on one replica") == 1  # the round-robin log only


def firing_alert(name: str, severity: str, **labels: str) -> dict:
    return {"__name__": "ALERTS", "alertname": name, "alertstate": "firing", "severity": severity,
            **labels, "value": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("firing", "kind", "banner"),
    [
        ([], "success", "No kvwatch alert is firing."),
        ([firing_alert("KVWatchPrefixCacheHitRateDrop", "warning", scope="cluster"),
          firing_alert("KVWatchSessionAffinityBroken", "critical", target="lab-affinity"),
          firing_alert("KVWatchGatewaySessionsSpread", "critical", log="affinity", listener="affinity")],
         "error",
         "Firing now: **KVWatchGatewaySessionsSpread** (critical) on affinity / affinity; "
         "**KVWatchSessionAffinityBroken** (critical) on lab-affinity; "
         "**KVWatchPrefixCacheHitRateDrop** (warning) on the cluster."),
        ([firing_alert("KVWatchPrefixCachingDisabled", "warning", instance="127.0.0.1:18011")],
         "warning", "Firing now: **KVWatchPrefixCachingDisabled** (warning) on 127.0.0.1:18011."),
    ],
    ids=["none", "critical first", "warnings only"],
)  # fmt: skip
def test_the_overview_banner_names_what_fires_now(fake, firing, kind, banner):
    fake.values[panel_queries.FIRING_ALERTS_NOW] = pd.DataFrame(firing)
    at = open_page("overview")
    title, top, *_ = (e for e in at.main if e.type not in ("main", "flex_container"))
    assert (title.value, top.type) == ("Overview", kind)  # right under the title
    assert top.value.startswith(banner), top.value


NOT_SCRAPED = Link(
    "Prometheus scrapes kvwatch serve",
    pipeline.BROKEN,
    "Prometheus has no scrape target on port 9464 and holds none of kvwatch serve's series.",
    "Add a scrape job for kvwatch serve's /metrics on port 9464.",
)
NOT_EVALUATED = Link("Prometheus evaluates kvwatch's rules", pipeline.UNKNOWN, "Not evaluated yet: Watchdog.")


def banners(at: AppTest) -> list[tuple[str, str]]:
    """(kind, text) of every banner above the page's content."""
    return [(e.type, e.value) for kind in ("success", "error", "warning") for e in getattr(at, kind)]


def test_a_blind_overview_shows_no_healthy_banner_and_names_what_it_cannot_see(fake):
    """The issue's blind kvwatch: nothing fires because nothing is scraped; not green, and why."""
    fake.blind = Result((NOT_SCRAPED,))
    shown = banners(open_page("overview"))
    assert shown == [(
        "error",
        '**Not watching**: the link "Prometheus scrapes kvwatch serve" is broken. Prometheus has no scrape '
        "target on port 9464 and holds none of kvwatch serve's series. Fix: Add a scrape job for kvwatch "
        "serve's /metrics on port 9464.",
    )]  # fmt: skip


def test_a_link_that_cannot_be_judged_is_no_health_either(fake):
    fake.blind = Result((NOT_EVALUATED,))
    shown = banners(open_page("overview"))
    assert shown == [
        (
            "warning",
            'Cannot tell whether kvwatch watches: the link "Prometheus evaluates kvwatch\'s rules" is '
            "unknown. Not evaluated yet: Watchdog.",
        )
    ]


def test_when_the_pipeline_cannot_be_asked_the_overview_says_so_and_is_not_green(fake):
    fake.blind = Result(error="Prometheus at http://127.0.0.1:18002 did not answer within 5 s.")
    shown = banners(open_page("overview"))
    said = "Cannot tell what kvwatch sees: Prometheus at http://127.0.0.1:18002 did not answer within 5 s."
    assert shown == [("warning", said)]


def test_alerts_that_fire_are_shown_beside_what_kvwatch_cannot_see(fake):
    fake.blind = Result((NOT_SCRAPED,))
    fake.values[panel_queries.FIRING_ALERTS_NOW] = pd.DataFrame(
        [firing_alert("KVWatchTargetDown", "critical")]
    )
    kinds = [kind for kind, _ in banners(open_page("overview"))]
    assert kinds == ["error", "error"]  # not watching, and what fires


def test_a_route_not_judged_after_a_replica_change_says_why(fake):
    """The affinity alert pauses while an engine of the cluster restarted, went down or came back: its
    tile says so, not that Prometheus holds nothing, and is never green."""
    fake.values[ROUTE_STICKY.state] = NO_FRAME
    fake.values[ROUTE_STICKY.paused[0]] = pd.DataFrame({"value": [1.0]})
    said = texts(open_page("overview"))
    assert f":gray[{ROUTE_STICKY.paused[1]}]" in said
    assert f"Prometheus holds no series {ROUTE_STICKY.alert.name} judges" not in said
    assert ROUTE_STICKY.paused[0] in fake.asked


def iso(seconds: float) -> str:
    return pd.Timestamp(seconds, unit="s", tz="UTC").isoformat()


CHARTS_OVER_TIME = [("overview", "overview_changes"), ("replicas", "replicas_hit_ratio")]


@pytest.mark.parametrize(("page", "chart"), CHARTS_OVER_TIME)
def test_faults_and_alerts_are_marked_when_they_happened(fake, page, chart):
    at = open_page(page)
    start = NOW - 3600  # the default range
    assert sorted(marks(at, chart)) == [
        (iso(start + FAULT_AT), "fault break-affinity"),
        (iso(start + ALERT_AT), "KVWatchSessionAffinityBroken firing"),
        (iso(start + HEAL_AT), "heal break-affinity"),
    ]
