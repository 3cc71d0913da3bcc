"""The Streamlit dashboard through AppTest, with its data layer replaced: every page with data, empty,
and in each error state; then the data layer itself against a closed port, a missing store and a bad
config."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import socket
import sys
import threading
import time
from dataclasses import asdict, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import streamlit as st
import yaml
from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest

from conftest import REPO, decoded, experiment_replica_bars, free_port, start_prometheus, stop
from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    FIRING,
    INSTANCE_HIT_RATIO_DROP,
    LISTENER_SPREAD,
    LOAD_IMBALANCE,
    OK,
    PENDING,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    ROUTER_PREDICTION_MISS,
    VERDICTS,
    Verdict,
)
from kvwatch.cli.main import main
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.config.settings import Config, DashboardSettings, GatewayLog, Service, StoreSettings, Target
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.core.stats import quantile_interval
from kvwatch.dashboard import data, stats, ui
from kvwatch.dashboard.data import Result
from kvwatch.doctor import checks
from kvwatch.doctor.caching import Cluster
from kvwatch.experiment.report import FILES
from kvwatch.grafana import panels
from kvwatch.prometheus import panel_queries, pipeline, promql, queries
from kvwatch.prometheus.pipeline import Link
from kvwatch.store.history import Store, life_columns

APP = REPO / "dashboard" / "app.py"
PAGES = ("overview", "per_round", "replicas", "sessions", "alerts", "experiment", "doctor")
PROMETHEUS = "http://127.0.0.1:18002"
ALERTMANAGER = "http://127.0.0.1:18003"
STORE = Path("/var/lib/kvwatch/kvwatch.db")
REPORTS = Path("/var/lib/kvwatch/experiments")
CONFIG = Config(
    targets=(
        Target("lab-affinity", "http://127.0.0.1:18000", "lab-model", route_mode="affinity"),
        Target("lab-round-robin", "http://127.0.0.1:18001", "lab-model", route_mode="round_robin"),
    ),
    gateway_logs=(
        GatewayLog("affinity", Path("/var/log/nginx/affinity.jsonl")),
        GatewayLog("round_robin", Path("/var/log/nginx/round_robin.jsonl"), expect_sticky=False),
    ),
    store=StoreSettings(STORE),
    prometheus=Service(PROMETHEUS),
    alertmanager=Service(ALERTMANAGER),
    dashboard=DashboardSettings(REPORTS),
)
T0 = 1_790_000_000.0
NOW = T0 + 86400 - T0 % data.REFRESH_SECONDS  # the pages' time, on the refresh grid


def session(
    number: int,
    target: str,
    backends: list[str],
    ttfts: list[float],
    failed: int = 0,
    at: float | None = None,
) -> SessionResult:
    """A probe session as the probe records it: rounds of 1000 + 300 tokens each, ideal reuse when sticky;
    it starts `at`, by default a minute after the one before, and each round a second after that."""
    at = T0 + number * 60 if at is None else at
    rounds = []
    for index, (backend, ttft) in enumerate(zip(backends, ttfts, strict=True), start=1):
        ideal = 0 if index == 1 else 1000 + 300 * (index - 1)
        stayed = index > 1 and backend == backends[index - 2]
        error = "timeout" if index == failed else None
        sid = f"sid-{number}"
        rounds.append(
            RoundResult(index, at + index, None if error else 200, error, None,
                        None if error else ttft, ttft + 0.1, 1000 + 300 * index, ideal if stayed else 0,
                        ideal, 8, backend, sid, sid)
        )  # fmt: skip
        if error:
            break
    mode = "affinity" if target == "lab-affinity" else "round_robin"
    return SessionResult(target, mode, f"sid-{number}", at, at + 10, tuple(rounds))


SESSIONS = {
    1: session(1, "lab-affinity", ["r1"] * 4, [0.40, 0.05, 0.05, 0.06]),
    2: session(2, "lab-affinity", ["r2"] * 4, [0.42, 0.06, 0.05, 0.05]),
    3: session(3, "lab-round-robin", ["r1", "r2", "r3", "r4"], [0.41, 0.50, 0.61, 0.72]),
    4: session(4, "lab-round-robin", ["r2", "r3", "r4", "r1"], [0.40, 0.52, 0.60, 0.70], failed=4),
}


def sessions_frame(sessions: dict[int, SessionResult] = SESSIONS) -> pd.DataFrame:
    """The sessions as data.sessions() gives them: the store's columns, newest first, times in UTC."""
    columns = ("target", "route_mode", "session_id", "ok", "error_kind", "sticky", "backend_switches",
               "session_id_echoed", "interrupted", "evidence", "warm_rounds", "warm_rounds_reused",
               "warm_cached_tokens", "warm_ideal_cached_tokens")  # fmt: skip
    rows = [
        {
            "id": i,
            **{c: getattr(s, c) for c in columns},
            **life_columns(s),
            "started_at": s.started_at,
            "finished_at": s.finished_at,
            "in_flight": False,
        }
        for i, s in reversed(sessions.items())
    ]
    frame = pd.DataFrame(rows)
    frame["started_at"] = pd.to_datetime(frame["started_at"], unit="s", utc=True)
    return frame


def rounds_frame(sessions: dict[int, SessionResult] = SESSIONS) -> pd.DataFrame:
    """The sessions' rounds as data.rounds() gives them, newest session first, times in UTC."""
    rows = [
        {"session": i, "target": s.target, "route_mode": s.route_mode, **asdict(r)}
        for i, s in reversed(sessions.items())
        for r in s.rounds
    ]
    frame = pd.DataFrame(rows)
    frame["started_at"] = pd.to_datetime(frame["started_at"], unit="s", utc=True)
    return frame


def points(over: data.Span, values: list[float], **labels: str) -> pd.DataFrame:
    """A range-query result: the values spread over the span, the last one at its end."""
    times = [over.end - over.step * (len(values) - 1 - i) for i in range(len(values))]
    frame = pd.DataFrame({**labels, "time": times, "value": values})
    frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame


def per_route(over: data.Span, affinity: list[float], round_robin: list[float]) -> pd.DataFrame:
    return pd.concat(
        [points(over, affinity, target="lab-affinity", route_mode="affinity"),
         points(over, round_robin, target="lab-round-robin", route_mode="round_robin")]
    )  # fmt: skip


def per_listener(over: data.Span, affinity: list[float], round_robin: list[float], **labels) -> pd.DataFrame:
    return pd.concat(
        [points(over, affinity, log="affinity", listener="affinity", **labels),
         points(over, round_robin, log="round_robin", listener="round_robin", **labels)]
    )  # fmt: skip


def states(**by_subject: int) -> pd.DataFrame:
    """A verdict's states as Prometheus answers `verdict.state`: one row per judged route or listener."""
    return pd.DataFrame([{**labels_of(subject), "value": state} for subject, state in by_subject.items()])


def labels_of(subject: str) -> dict[str, str]:
    return {"target": subject} if subject.startswith("lab") else {"log": subject, "listener": subject}


def cluster_state(state: int) -> pd.DataFrame:
    return pd.DataFrame({"value": [state]})


SERIES = {
    queries.CLUSTER_HIT_RATIO: lambda over: points(over, [0.80, 0.82, 0.87]),
    queries.CLUSTER_LOCAL_HIT_RATIO: lambda over: points(over, [0.90, 0.91, 0.93]),
    queries.STICKY_RATIO: lambda over: per_route(over, [1, 1, 1], [0, 0, 0]),
    queries.WARM_COLD_RATIO: lambda over: per_route(over, [0.2, 0.15, 0.14], [1.3, 1.5, 1.6]),
    panel_queries.AFFINITY_EFFICIENCY: lambda over: per_route(over, [0.97, 0.98, 0.99], [0.2, 0.25, 0.21]),
    queries.GATEWAY_SPREAD: lambda over: per_listener(over, [0, 0.01, 0.02], [0.9, 0.95, 0.96]),
    panel_queries.REAL_SESSIONS_SPREAD: lambda over: pd.concat(
        [
            per_listener(over, [0, 0.01, 0.02], [0.9, 0.95, 0.96], failover="false"),
            per_listener(over, [0, 0.1, 0.12], [0, 0, 0], failover="true"),
        ]
    ),  # fmt: skip
    panel_queries.HIT_RATIO_BY_INSTANCE: lambda over: pd.concat(
        [
            points(over, [0.8, 0.9], instance="127.0.0.1:18010"),
            points(over, [0.7, 0.6], instance="127.0.0.1:18011"),
        ]
    ),
    panel_queries.LOCAL_HIT_RATIO_BY_INSTANCE: lambda over: points(
        over, [0.9, 0.95], instance="127.0.0.1:18010"
    ),
    queries.CLUSTER_LOAD_IMBALANCE: lambda over: points(over, [1.2, 2.6]),
}
HEALTHY = {
    ROUTE_STICKY.state: states(**{"lab-affinity": OK}),
    ROUTE_WARM_ROUNDS.state: states(**{"lab-affinity": OK}),
    LISTENER_SPREAD.state: states(affinity=OK),
    CLUSTER_HIT_RATIO_DROP.state: cluster_state(OK),
    LOAD_IMBALANCE.state: cluster_state(PENDING),
    INSTANCE_HIT_RATIO_DROP.state: pd.DataFrame(
        {"instance": ["127.0.0.1:18010", "127.0.0.1:18011"], "value": [OK, OK]}
    ),
}
INSTANT = {
    **HEALTHY,
    panel_queries.CLUSTER_CACHED_SHARE_BY_SOURCE: pd.DataFrame(
        {"source": ["device", "host"], "value": [0.7, 0.1]}
    ),
    panel_queries.CACHED_SHARE_BY_SOURCE: pd.DataFrame(
        {"instance": ["127.0.0.1:18010"] * 2, "source": ["device", "host"], "value": [0.7, 0.1]}
    ),
    panel_queries.REQUEST_SHARE_BY_INSTANCE: pd.DataFrame(
        {"instance": ["127.0.0.1:18010", "127.0.0.1:18011"], "value": [0.7, 0.3]}
    ),
    panel_queries.TTFT_QUANTILES_BY_INSTANCE: pd.DataFrame(
        {"instance": ["127.0.0.1:18010"] * 3, "quantile": ["0.5", "0.9", "0.99"], "value": [0.02, 0.09, 0.2]}
    ),
    queries.INSTANCE_CACHE_SERIES: pd.DataFrame(
        {"instance": ["127.0.0.1:18010", "127.0.0.1:18011"],
         "series": ["vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total"], "value": [1, 1]}
    ),
    panel_queries.PREFIX_CACHING_CONFIG: pd.DataFrame(
        {"instance": ["127.0.0.1:18010"], "enable_prefix_caching": ["False"], "value": [1]}
    ),
}  # fmt: skip


def alerts_frame(**extra) -> pd.DataFrame:
    return pd.DataFrame(
        [{"alertname": "KVWatchSessionAffinityBroken", "severity": "critical", "state": "active",
          "target": "lab-affinity", "instance": None, "starts_at": pd.Timestamp(T0, unit="s", tz="UTC"),
          "summary": "Probe sessions through an affinity route change replica between rounds.",
          "runbook_url": f"{RUNBOOK_URL}#kvwatchsessionaffinitybroken", **extra}]
    )  # fmt: skip


NO_FRAME = pd.DataFrame(columns=["time", "value"])
DOWN = f"Cannot reach Prometheus at {PROMETHEUS}: Connection refused. Is it running?"
NO_STORE = f"no kvwatch store at {STORE}: `kvwatch serve` creates it (store.path in kvwatch.yaml)."
NO_ALERTMANAGER = f"Cannot reach Alertmanager at {ALERTMANAGER}/api/v2/alerts: Connection refused."
BAD_CONFIG = "error in /etc/kvwatch.yaml: cannot read it: No such file or directory."


READERS = ("settings", "range_query", "instant_query", "firing_alerts", "sessions", "rounds", "ttft_by_round",
           "received_alerts", "faults", "alerts", "experiment_report", "run_experiment",
           "run_doctor", "blind_spots")  # fmt: skip
FAULT_AT, ALERT_AT, HEAL_AT = 600, 660, 1200  # seconds into the span


class Fake:
    """The data layer's public readers, answering from canned frames, empty frames or errors."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.settings = Result(CONFIG)
        self.ranges, self.values = dict(SERIES), dict(INSTANT)  # what range and instant queries return
        self.prometheus = self.store = self.alertmanager = None  # an error message, when set
        self.empty = False
        self.probed = SESSIONS  # what data.sessions() reads from the store
        self.history = rounds_frame()  # what data.rounds() reads from the store
        self.rounds_read: list[tuple] = []  # data.rounds()'s arguments, call by call
        self.report = Result(None)
        self.reports_read: list[Path] = []
        self.doctor = Result(error="the doctor was not expected to run")
        self.runs: list[tuple] = []
        self.asked: list[str] = []  # every query Prometheus was asked, as narrowed
        self.blind = Result(())  # the pipeline's links that do not hold: none
        # What Prometheus' rules API says fires now; unread unless a test says, so that every verdict is
        # the alert's plain state at the page's time.
        self.firing = Result(error="Prometheus' rules API is not asked here")
        for name in READERS:
            monkeypatch.setattr(data, name, getattr(self, f"_{name}"))
        monkeypatch.setattr(data, "config_path", lambda: Path("kvwatch.yaml"))
        monkeypatch.setattr(data, "now", lambda: NOW)

    def _settings(self) -> Result:
        return self.settings

    def _frame(self, error: str | None, frame: pd.DataFrame) -> Result:
        if self.settings.error:
            return self.settings
        if error:
            return Result(error=error)
        return Result(frame.iloc[0:0] if self.empty else frame)

    def _range_query(self, query: str, over: data.Span) -> Result:
        self.asked.append(query)
        return self._frame(self.prometheus, self.ranges[query](over) if query in self.ranges else NO_FRAME)

    def _instant_query(self, query: str, over: data.Span) -> Result:
        self.asked.append(query)
        return self._frame(self.prometheus, self.values.get(query, NO_FRAME))

    def _blind_spots(self) -> Result:
        return self.blind

    def _firing_alerts(self, at: float) -> Result:
        return self.firing if self.firing.error else self._frame(self.prometheus, self.firing.value)

    def _sessions(self, since: float) -> Result:
        return self._frame(self.store, sessions_frame(self.probed))

    def _rounds(self, since: float, target: str | None = None, session: int | None = None) -> Result:
        self.rounds_read.append((since, target, session))
        rounds = self.history
        for column, value in (("target", target), ("session", session)):
            rounds = rounds if value is None else rounds[rounds[column] == value]
        return self._frame(self.store, rounds)

    def _ttft_by_round(self, since: float, split: float | None = None) -> Result:
        found = self._rounds(since)
        return found if found.error or found.value.empty else Result(stats.ttft_by_round(found.value, split))

    def _received_alerts(self, since: float) -> Result:
        received = pd.Timestamp(T0, unit="s", tz="UTC")
        started = pd.Timestamp(since + ALERT_AT, unit="s", tz="UTC")
        return self._frame(
            self.store, alerts_frame(state="firing", received_at=received, starts_at=started, ends_at=pd.NaT)
        )

    def _faults(self, since: float) -> Result:
        faults = pd.DataFrame(
            {"time": pd.to_datetime([since + FAULT_AT, since + HEAL_AT], unit="s", utc=True),
             "action": ["fault", "heal"], "fault": ["break-affinity", "break-affinity"], "replica": None}
        )  # fmt: skip
        return self._frame(None, faults)

    def _alerts(self) -> Result:
        return self._frame(self.alertmanager, alerts_frame())

    def _experiment_report(self, directory: Path) -> Result:
        self.reports_read.append(directory)
        return self.report

    def _run_experiment(self, a: Target, b: Target, out: Path, *workload_and_load) -> Result:
        self.runs.append((a, b, out, *workload_and_load))
        return Result([])

    def _run_doctor(self, target: Target, requests_sample: str) -> Result:
        self.runs.append((target.name, requests_sample))
        return self.doctor


@pytest.fixture
def fake(monkeypatch) -> Fake:
    return Fake(monkeypatch)


@pytest.fixture(autouse=True)
def no_component_scan(monkeypatch):
    """Every new AppTest reads the metadata of every installed distribution, looking for Streamlit
    components (over a second with the dev tools installed); the dashboard uses none."""
    monkeypatch.setattr(manifest_scanner, "scan_component_manifests", lambda: [])


def open_page(page: str) -> AppTest:
    at = AppTest.from_file(str(REPO / "dashboard" / "app_pages" / f"{page}.py"), default_timeout=30)
    return at.run()


def texts(at: AppTest) -> str:
    """Everything the page wrote, in one string to search."""
    kinds = ("markdown", "caption", "info", "error", "success", "warning")
    return "\n".join(str(e.value) for kind in kinds for e in getattr(at, kind))


def metrics(at: AppTest) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for metric in at.metric:
        found.setdefault(metric.label, []).append(metric.value)
    return found


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


def fires(verdict: Verdict) -> str:
    return f":red[{verdict.alert.name} fires: {verdict.alert.summary}]"


def pending(verdict: Verdict) -> str:
    return f":orange[{verdict.alert.name} is pending: "


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


@pytest.mark.parametrize("page", ["overview", "replicas"])
def test_every_verdict_whose_series_is_absent_says_it_is_not_watching(fake, page):
    """No state of a verdict's alert: Prometheus holds no series it judges. Never green, never "fine"."""
    for verdict in (*VERDICTS, ROUTER_PREDICTION_MISS):
        fake.values[verdict.state] = NO_FRAME
    said = texts(open_page(page))
    assert ":green[" not in said
    judged = {"overview": (CLUSTER_HIT_RATIO_DROP, ROUTE_STICKY, ROUTE_WARM_ROUNDS, LISTENER_SPREAD),
              "replicas": (INSTANCE_HIT_RATIO_DROP, LOAD_IMBALANCE)}[page]  # fmt: skip
    for verdict in judged:
        assert (
            f":gray[Not watching: Prometheus holds no series {verdict.alert.name} judges here now.]" in said
        )


def test_a_route_not_judged_after_a_replica_change_says_why(fake):
    """The affinity alert pauses while an engine of the cluster restarted, went down or came back: its
    tile says so, not that Prometheus holds nothing, and is never green."""
    fake.values[ROUTE_STICKY.state] = NO_FRAME
    fake.values[ROUTE_STICKY.paused[0]] = pd.DataFrame({"value": [1.0]})
    said = texts(open_page("overview"))
    assert f":gray[{ROUTE_STICKY.paused[1]}]" in said
    assert f"Prometheus holds no series {ROUTE_STICKY.alert.name} judges" not in said
    assert ROUTE_STICKY.paused[0] in fake.asked


def marks(at: AppTest, key: str) -> list[tuple[str, str]]:
    """(time, text) of every event marked on the chart of that key."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith(key)]
    layout = json.loads(chart.proto.spec)["layout"]
    return [(a["x"], a["text"]) for a in layout.get("annotations", [])]


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


def test_per_round_compares_routes_round_by_round(fake):
    at = open_page("per_round")
    assert not at.exception
    table = at.table[0].value
    assert list(table.columns) == ["lab-affinity", "lab-round-robin", "lab-affinity / lab-round-robin"]
    assert table.loc[1, "lab-affinity"] == pytest.approx(410)  # median of 0.40 and 0.42 s
    assert table.loc[3, "lab-round-robin"] == pytest.approx(605)
    assert table.loc[4, "lab-round-robin"] == pytest.approx(720)  # session 4 failed its round 4
    assert table.loc[2, "lab-affinity / lab-round-robin"] == pytest.approx(0.055 / 0.51)
    sessions = at.table[1].value  # the whole range: no split
    assert list(sessions.columns) == ["lab-affinity", "lab-round-robin"]
    assert list(sessions["lab-affinity"]) == [2, 2, 2, 2] and list(sessions["lab-round-robin"]) == [
        2,
        2,
        2,
        1,
    ]


def test_per_round_shows_only_the_picked_targets(fake):
    at = open_page("per_round")
    at.multiselect(key="per_round_targets").set_value(["lab-round-robin"]).run()
    assert list(at.table[0].value.columns) == ["lab-round-robin"]


SPAN_START = NOW - 3600  # the start of the pages' default range
FAULT = SPAN_START + FAULT_AT
# Probe sessions around the fault: affinity warm before it, cold after; round robin cold throughout.
BROKEN = {
    11: session(11, "lab-affinity", ["r1"] * 4, [0.40, 0.05, 0.05, 0.06], at=FAULT - 300),
    12: session(12, "lab-affinity", ["r2"] * 4, [0.42, 0.06, 0.04, 0.05], at=FAULT - 200),
    # Rounds 1 and 2 start before the fault, 3 and 4 after it.
    13: session(13, "lab-affinity", ["r1", "r1", "r2", "r3"], [0.40, 0.05, 0.52, 0.60], at=FAULT - 2.5),
    14: session(14, "lab-affinity", ["r3", "r4", "r1", "r2"], [0.41, 0.50, 0.61, 0.72], at=FAULT + 100),
    15: session(15, "lab-affinity", ["r4", "r1", "r2", "r3"], [0.43, 0.52, 0.60, 0.70], at=FAULT + 200),
    16: session(16, "lab-round-robin", ["r1", "r2", "r3", "r4"], [0.40, 0.50, 0.60, 0.70], at=FAULT - 100),
    17: session(17, "lab-round-robin", ["r2", "r3", "r4", "r1"], [0.42, 0.52, 0.63, 0.74], at=FAULT + 300),
}
SPLIT_COLUMNS = [f"{t} {p}" for t in ("lab-affinity", "lab-round-robin") for p in ("before", "after")]


def medians_and_counts(rounds: pd.DataFrame, split: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Median TTFT in ms and the number of rounds per round, target and period, straight from the rows."""
    fault = pd.Timestamp(split, unit="s", tz="UTC")
    rounds = rounds.assign(
        column=rounds["target"] + np.where(rounds["started_at"] < fault, " before", " after")
    )
    grouped = rounds.groupby(["round", "column"])["ttft_seconds"]
    return (grouped.median() * 1000).unstack()[SPLIT_COLUMNS], grouped.count().unstack()[SPLIT_COLUMNS]


def test_per_round_splits_at_a_fault_and_shows_the_change_with_session_counts(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    choice = at.selectbox(key="per_round_moment")
    assert choice.options == [
        "No split: the whole range",
        f"fault break-affinity, {ui.as_of(FAULT)}",
        f"KVWatchSessionAffinityBroken firing, {ui.as_of(SPAN_START + ALERT_AT)}",
        f"heal break-affinity, {ui.as_of(SPAN_START + HEAL_AT)}",
        "A time I pick (UTC)",
    ]
    choice.set_value(choice.options[1]).run()
    assert not at.exception
    medians, sessions = at.table[0].value, at.table[1].value
    expected_medians, expected_sessions = medians_and_counts(fake.history, FAULT)
    pd.testing.assert_frame_equal(medians[SPLIT_COLUMNS], expected_medians, check_names=False)
    pd.testing.assert_frame_equal(sessions, expected_sessions, check_names=False, check_dtype=False)
    assert list(sessions["lab-affinity before"]) == [3, 3, 2, 2]  # session 13's rounds 3 and 4 came after
    assert list(sessions["lab-affinity after"]) == [2, 2, 3, 3]
    # The change: affinity's warm rounds climb after the fault, round 1 and round robin hardly move.
    change = medians["lab-affinity after / before"]
    # Round 1: 0.40, 0.42, 0.40 before, 0.41, 0.43 after; round 3: 0.05, 0.04 before, 0.52, 0.61, 0.60 after.
    assert change[1] == pytest.approx(420 / 400) and change[3] == pytest.approx(600 / 45)
    assert medians["lab-round-robin after / before"].between(1, 1.06).all()
    assert "before 20" in texts(at) and "on the left and after it on the right" in texts(at)


def per_round_chart(at: AppTest) -> dict:
    """The per-round chart's plotly spec: data and layout."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("per_round_chart")]
    return json.loads(chart.proto.spec)


def chart_lines(at: AppTest) -> dict[tuple[str, str], list[float]]:
    """(panel's x axis, line name): y of every line of the per-round chart (its bands left out)."""
    lines = [t for t in per_round_chart(at)["data"] if t.get("fill") != "toself"]
    return {(t.get("xaxis", "x"), t["name"]): decoded(t["y"]) for t in lines}


def test_per_round_draws_before_and_after_side_by_side_with_their_bands(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    at.selectbox(key="per_round_moment").set_value(f"fault break-affinity, {ui.as_of(FAULT)}").run()
    lines = chart_lines(at)
    summary = stats.ttft_by_round(fake.history, FAULT).set_index(["target", "period", "round"])
    for axis, period in (("x", "before"), ("x2", "after")):
        for target in ("lab-affinity", "lab-round-robin"):
            for quantile in ("median", "p90"):
                drawn = lines[axis, f"{target} {quantile}"]
                assert drawn == pytest.approx(list(summary.loc[(target, period), quantile] * 1000))
    spec = per_round_chart(at)
    assert [a["text"] for a in spec["layout"]["annotations"]] == [
        f"before {ui.as_of(FAULT)}",
        f"after {ui.as_of(FAULT)}",
    ]
    bands = [t for t in spec["data"] if t.get("fill") == "toself"]
    assert len(bands) == 8  # a band for every line: 2 targets, median and p90, before and after
    after = summary.loc[("lab-affinity", "after")]  # the first band of the after panel: its median's
    drawn = decoded([t for t in bands if t.get("xaxis") == "x2"][0]["y"])
    assert drawn == pytest.approx(list(after["median_high"] * 1000) + list(after["median_low"][::-1] * 1000))


def test_per_round_splits_at_a_picked_time(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    at.selectbox(key="per_round_moment").set_value("A time I pick (UTC)").run()
    picked = datetime.datetime.fromtimestamp(FAULT + 150, datetime.UTC).replace(tzinfo=None)
    at.datetime_input(key="per_round_at").set_value(picked).run()
    assert not at.exception
    sessions = at.table[1].value
    # Session 14 (at the fault + 100 s) is now before; 15 after.
    assert list(sessions["lab-affinity after"]) == [1, 1, 1, 1]
    assert list(sessions["lab-affinity before"]) == [4, 4, 4, 4]


def test_replicas_show_share_imbalance_and_engines(fake):
    at = open_page("replicas")
    assert not at.exception
    assert metrics(at)["Load imbalance"] == ["2.60×"]
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == ["127.0.0.1:18010", "127.0.0.1:18011"]
    assert [line["name"] for line in charts["replicas_local"]] == ["127.0.0.1:18010"]
    assert [bar["name"] for bar in charts["replicas_sources"]] == ["device", "host"]
    assert pending(LOAD_IMBALANCE) in texts(at)  # above 2, for less than the alert's 15 minutes
    fake.values[LOAD_IMBALANCE.state] = cluster_state(FIRING)
    assert fires(LOAD_IMBALANCE) in texts(at.run())
    engines = at.dataframe[0].value.set_index("instance")
    assert engines.loc["127.0.0.1:18010", "engine"] == "vLLM V1"
    assert engines.loc["127.0.0.1:18010", "prefix caching"] == "off"
    assert engines.loc["127.0.0.1:18011", "engine"] == "SGLang"
    assert engines.loc["127.0.0.1:18011", "prefix caching"] == "not exported"


def test_replicas_judge_each_instance_as_its_hit_ratio_alert_does(fake):
    said = texts(open_page("replicas"))
    assert "`127.0.0.1:18010`: :green[Its hit ratio holds against its own past.]" in said
    fake.values[INSTANCE_HIT_RATIO_DROP.state] = pd.DataFrame(
        {"instance": ["127.0.0.1:18010", "127.0.0.1:18011"], "value": [OK, FIRING]}
    )
    said = texts(open_page("replicas"))
    assert "`127.0.0.1:18010`: :green[Its hit ratio holds against its own past.]" in said
    assert f"`127.0.0.1:18011`: {fires(INSTANCE_HIT_RATIO_DROP)}" in said


REPLICA_IDS = pd.DataFrame({"instance": ["127.0.0.1:18011"], "replica": ["r2"], "value": [1.0]})


def test_replicas_name_an_instance_with_a_replica_label_by_its_id_and_address(fake):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS  # r2's target carries the label, r1's does not
    at = open_page("replicas")
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    names = ["127.0.0.1:18010", "r2 (127.0.0.1:18011)"]
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == names
    assert list(at.dataframe[0].value["instance"]) == names
    assert "`r2 (127.0.0.1:18011)`: :green[Its hit ratio holds against its own past.]" in texts(at)


def test_sessions_name_each_backend_by_replica_id_and_address(fake):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS
    fake.history = rounds_frame(
        {**SESSIONS, 4: session(4, "lab-round-robin", ["127.0.0.1:18011"] * 4, [0.4] * 4)}
    )
    at = open_page("sessions")
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    at.selectbox(key="sessions_pick").set_value(4).run()
    assert list(at.table[0].value["backend"]) == ["r2 (127.0.0.1:18011)"] * 4
    timeline = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert "r2 (127.0.0.1:18011)" in [cells["name"] for cells in timeline]


NO_ROUTER = "No router in this Prometheus exports what it predicted: llm-d's EPP, Dynamo's KV router"
EPP = {"job": "epp", "instance": "10.0.0.5:9090"}  # predicts a hit ratio
SMG = {"job": "smg", "instance": "10.0.0.6:29000"}  # counts its sticky decisions
VLLM_ROUTER = {"job": "vllm-router", "instance": "10.0.0.7:29001"}  # counts its prefix-matched decisions


def routers(fake: Fake, miss: int) -> None:
    """llm-d's EPP predicting 80 % while the engines deliver 8 % of that, SMG keeping 6 of 7 pins and
    vllm-router sending 3 of 4 requests where its tree matched."""
    fake.ranges[queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO] = lambda over: points(over, [0.8, 0.8], **EPP)
    fake.values |= {
        queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO: pd.DataFrame([{**EPP, "value": 0.8}]),
        queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED: pd.DataFrame([{**EPP, "value": 0.08}]),
        queries.INSTANCE_ROUTER_PIN_KEPT: pd.DataFrame([{**SMG, "value": 6 / 7}]),
        queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS: pd.DataFrame([{**VLLM_ROUTER, "value": 0.75}]),
        ROUTER_PREDICTION_MISS.state: pd.DataFrame([{**EPP, "value": miss}]),
    }


def test_replicas_show_what_routers_predicted_against_what_the_engines_delivered(fake):
    routers(fake, FIRING)
    at = open_page("replicas")
    assert not at.exception
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_routers"]] == [
        "predicted by epp / 10.0.0.5:9090",
        "delivered by 127.0.0.1:18010",
        "delivered by 127.0.0.1:18011",
        "delivered by the cluster",
    ]
    figures = at.dataframe[1].value.set_index("job")
    assert figures.loc["epp", "predicted hit ratio"] == 0.8
    assert figures.loc["epp", "delivered per predicted"] == 0.08
    assert figures.loc["smg", "sticky decisions kept"] == pytest.approx(6 / 7)
    assert figures.loc["smg"].isna().sum() == 3  # SMG's manual policy predicts no hit ratio
    assert figures.loc["vllm-router", "prefix-matched decisions"] == 0.75
    said = texts(at)
    assert f"`epp / 10.0.0.5:9090`: {fires(ROUTER_PREDICTION_MISS)}" in said
    assert (
        "`smg / 10.0.0.6:29000`: :gray[Not watching: Prometheus holds no series KVWatchRouterPredictionMiss"
        in said
    )
    assert NO_ROUTER not in said


@pytest.mark.parametrize("miss", [OK, PENDING])
def test_replicas_judge_each_router_as_the_prediction_miss_alert_does(fake, miss):
    routers(fake, miss)
    said = texts(open_page("replicas"))
    ok = ":green[The engines deliver the reuse it predicts.]"
    expected = ok if miss == OK else pending(ROUTER_PREDICTION_MISS)
    assert f"`epp / 10.0.0.5:9090`: {expected}" in said
    assert fires(ROUTER_PREDICTION_MISS) not in said


def test_replicas_say_when_no_router_exports_predictions(fake):
    at = open_page("replicas")
    assert NO_ROUTER in texts(at)
    assert "replicas_routers" not in {c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")}
    assert len(at.dataframe) == 1  # the engines only


def test_sessions_list_and_drill_into_one(fake):
    at = open_page("sessions")
    assert not at.exception
    assert "2 sessions" in texts(at) and "100% stayed on one replica" in texts(at)
    assert "2 sessions judged by replica identity: each round named the replica that served it." in texts(at)
    assert "judged by reuse" not in texts(at)
    assert list(at.dataframe[0].value["evidence"]) == ["replica", "replica"]
    assert list(at.dataframe[0].value["id"]) == [2, 1]
    assert list(at.dataframe[0].value["interrupted"]) == [False, False]
    assert list(at.dataframe[0].value["in_flight"]) == [False, False]
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    assert "5 backend switches; 1 failed." in texts(at)  # session 4 failed in round 4: r2, r3, r4
    at.selectbox(key="sessions_pick").set_value(4).run()
    detail = at.table[0].value
    assert list(detail["backend"]) == ["r2", "r3", "r4", "r1"]
    assert list(detail["cached tokens"]) == [0, 0, 0, 0]
    assert list(detail["ideal cached tokens"]) == [0, 1300, 1600, 1900]
    assert detail["error"].iloc[-1] == "timeout"


def by_reuse(number: int, lost_round: int | None = None) -> SessionResult:
    """A session through a route that names no replica (a SageMaker endpoint), judged by its warm
    rounds' reuse: each cached all a replica holding the conversation would have, but `lost_round`."""
    judged = session(number, "lab-affinity", [None] * 4, [0.40, 0.05, 0.05, 0.05])
    rounds = tuple(replace(r, cached_tokens=0) if r.round == lost_round else r for r in judged.rounds)
    return replace(judged, rounds=rounds)


# lab-affinity names no replica: its warm rounds ideally cache 1300, 1600 and 1900 tokens; session 6's
# third round cached nothing. lab-round-robin's rounds still name theirs.
BY_REUSE = {
    **{i: s for i, s in SESSIONS.items() if s.target != "lab-affinity"},
    5: by_reuse(5),
    6: by_reuse(6, 3),
}
REUSE_WORDS = (
    "2 sessions judged by reuse: no round named its replica (SageMaker names none); their warm rounds "
    "cached 8,000 of the 9,600 tokens a replica holding the conversation would have (83%), and 5 of 6 "
    "warm rounds at least 50% of theirs."
)


def test_sessions_judged_by_reuse_say_so_with_their_warm_rounds_cached_and_ideal_tokens(fake):
    fake.probed, fake.history = BY_REUSE, rounds_frame(BY_REUSE)
    at = open_page("sessions")
    assert not at.exception
    assert REUSE_WORDS in texts(at) and "replica identity" not in texts(at)
    table = at.dataframe[0].value
    assert list(table["id"]) == [6, 5] and list(table["evidence"]) == ["reuse", "reuse"]
    assert list(table["sticky"]) == [False, True]
    assert list(table["warm_rounds"]) == [3, 3]
    assert list(table["warm_cached_tokens"]) == [1300 + 1900, 1300 + 1600 + 1900]
    assert list(table["warm_ideal_cached_tokens"]) == [1300 + 1600 + 1900] * 2


def test_the_overview_says_what_each_routes_stickiness_was_judged_by(fake):
    fake.probed = BY_REUSE
    said = texts(open_page("overview"))
    since = f"Since {ui.as_of(SPAN_START)}: "
    assert f"{since}{REUSE_WORDS}" in said
    assert (
        f"{since}2 sessions judged by replica identity: each round named the replica that served it." in said
    )
    fake.store = NO_STORE
    at = open_page("overview")
    assert not at.exception and metrics(at)["Sessions on one replica"] == ["100%", "0%"]
    assert f"What each route's stickiness was judged by is not shown: {NO_STORE}" in texts(at)
    assert "judged by reuse" not in texts(at)


def test_sessions_read_the_rounds_of_the_timeline_and_the_picked_session_only(fake):
    at = open_page("sessions")
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    fake.rounds_read.clear()
    at.selectbox(key="sessions_pick").set_value(4).run()
    oldest_shown = sessions_frame().query("target == 'lab-round-robin'")["started_at"].min().timestamp()
    assert fake.rounds_read == [(oldest_shown, "lab-round-robin", None), (SPAN_START, "lab-round-robin", 4)]


def test_alerts_from_alertmanager_and_the_webhook_with_runbooks(fake):
    at = open_page("alerts")
    assert not at.exception
    now, received = at.dataframe[0].value, at.dataframe[1].value
    assert list(now["alertname"]) == ["KVWatchSessionAffinityBroken"]
    assert list(received["state"]) == ["firing"]
    assert at.expander[0].label == "Runbook: KVWatchSessionAffinityBroken"
    assert "## KVWatchSessionAffinityBroken" in at.expander[0].markdown[0].value
    (link,) = at.expander[0].get("link_button")
    assert link.proto.url == f"{RUNBOOK_URL}#kvwatchsessionaffinitybroken"


def test_alerts_name_an_instance_with_a_replica_label_by_its_id_and_address(fake, monkeypatch):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS
    monkeypatch.setattr(data, "alerts", lambda: Result(alerts_frame(instance="127.0.0.1:18011")))
    assert list(open_page("alerts").dataframe[0].value["instance"]) == ["r2 (127.0.0.1:18011)"]


# --- several clusters in one Prometheus ------------------------------------------------------------------

CLUSTERS = panel_queries.clusters(CLUSTER_LABEL)


def in_cluster(query: str, cluster: str) -> str:
    return promql.with_matcher(query, panel_queries.one_cluster(CLUSTER_LABEL, cluster))


def two_clusters(fake: Fake) -> None:
    """Prometheus scrapes clusters a and b, whose hit ratios and hit-ratio alerts differ."""
    fake.values[CLUSTERS] = pd.DataFrame({"cluster": ["b", "a"], "value": [1, 1]})
    for cluster, ratios, state in (("a", [0.8, 0.9], OK), ("b", [0.3, 0.05], FIRING)):
        fake.ranges[in_cluster(queries.CLUSTER_HIT_RATIO, cluster)] = lambda over, r=ratios: points(over, r)
        fake.values[in_cluster(CLUSTER_HIT_RATIO_DROP.state, cluster)] = cluster_state(state)


def test_the_cluster_picker_shows_only_with_several_clusters(fake):
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.exception and not at.sidebar.selectbox
    two_clusters(fake)
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    (picker,) = at.sidebar.selectbox
    assert (picker.label, picker.options, picker.value) == ("Cluster", ["all", "a", "b"], "all")


def test_the_overview_shows_each_clusters_hit_ratio_apart_while_all_are_shown(fake):
    two_clusters(fake)
    at = open_page("overview")
    assert not at.exception
    assert metrics(at)["Cluster hit ratio"] == ["90%", "5%"]  # a's, then b's: never the two summed
    assert [h.value for h in at.subheader if h.value.startswith("Cluster")] == ["Cluster a", "Cluster b"]
    said = texts(at)
    assert ":green[Reuse holds" in said and fires(CLUSTER_HIT_RATIO_DROP) in said


def test_a_picked_cluster_narrows_every_prometheus_read_and_its_alerts(fake):
    two_clusters(fake)
    fake.values[in_cluster(panel_queries.FIRING_ALERTS_NOW, "b")] = pd.DataFrame(
        [{"alertname": "KVWatchPrefixCacheHitRateDrop", "severity": "warning", "cluster": "b", "value": 1}]
    )
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    fake.asked.clear()
    at.sidebar.selectbox[0].select("b").run()
    assert not at.exception
    assert metrics(at)["Cluster hit ratio"] == ["5%"]
    said = texts(at)
    assert fires(CLUSTER_HIT_RATIO_DROP) in said and ":green[Reuse holds" not in said
    assert "**KVWatchPrefixCacheHitRateDrop** (warning)" in said
    read = [query for query in fake.asked if query != CLUSTERS]
    assert read and all('cluster="b"' in query for query in read)


def test_the_alerts_name_each_alerts_cluster_and_a_picked_cluster_shows_only_its_own(fake, monkeypatch):
    two_clusters(fake)
    held = pd.concat([alerts_frame(cluster="a"), alerts_frame(cluster="b", target="lab-round-robin")])
    monkeypatch.setattr(data, "alerts", lambda: Result(held))
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("app_pages/alerts.py").run()
    shown = at.dataframe[0].value  # each alert's cluster beside what it is about
    assert list(shown.columns[:4]) == ["alertname", "severity", "state", "cluster"]
    assert list(zip(shown["cluster"], shown["target"], strict=True)) == [
        ("a", "lab-affinity"),
        ("b", "lab-round-robin"),
    ]
    at.sidebar.selectbox[0].select("b").run()
    assert not at.exception
    assert list(at.dataframe[0].value["target"]) == ["lab-round-robin"]


def test_with_all_clusters_shown_the_replicas_page_keeps_each_clusters_instances_apart(fake):
    """Issue 18: two clusters whose replicas have the same address read as two lines, two verdicts and
    two engines, each led by its cluster; a picked cluster reads its own, as before."""
    two_clusters(fake)
    same = "127.0.0.1:18010"
    fake.ranges[panel_queries.HIT_RATIO_BY_INSTANCE] = lambda over: pd.concat(
        [
            points(over, [0.8, 0.9], cluster="a", instance=same),
            points(over, [0.3, 0.1], cluster="b", instance=same),
        ]
    )
    fake.values[INSTANCE_HIT_RATIO_DROP.state] = pd.DataFrame(
        {"cluster": ["a", "b"], "instance": [same, same], "value": [OK, FIRING]}
    )
    fake.values[queries.INSTANCE_CACHE_SERIES] = pd.DataFrame(
        {"cluster": ["a", "b"], "instance": [same, same],
         "series": ["vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total"], "value": [1, 1]}
    )  # fmt: skip
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("app_pages/replicas.py").run()
    assert not at.exception
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == [f"a / {same}", f"b / {same}"]
    said = texts(at)
    assert f"`a / {same}`: :green[Its hit ratio holds against its own past.]" in said
    assert f"`b / {same}`: {fires(INSTANCE_HIT_RATIO_DROP)}" in said
    engines = at.dataframe[0].value
    assert list(zip(engines["cluster"], engines["engine"], strict=True)) == [
        ("a", "vLLM V1"),
        ("b", "SGLang"),
    ]
    fake.ranges[in_cluster(panel_queries.HIT_RATIO_BY_INSTANCE, "b")] = lambda over: points(
        over, [0.3, 0.1], cluster="b", instance=same
    )
    at.sidebar.selectbox[0].select("b").run()
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == [same]


def test_the_alerts_tables_show_no_cluster_column_without_the_label(fake, monkeypatch):
    monkeypatch.setattr(data, "alerts", lambda: Result(alerts_frame()))  # one cluster, without the label
    assert "cluster" not in open_page("alerts").dataframe[0].value


def test_experiment_shows_a_report_and_runs_one(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: a vs b\n\n| round |\n|---|\n", None))
    at = open_page("experiment")
    assert not at.exception
    assert "## A/B experiment: a vs b" in texts(at)
    at.number_input(key="experiment_sessions").set_value(3)
    at.button[0].click().run()
    assert "Done: the report is below." in texts(at)
    affinity, round_robin = CONFIG.targets
    assert fake.runs == [(round_robin, affinity, REPORTS, 3, 6, 0, None, None)]  # A spreads, B is sticky


def test_the_experiment_runs_under_the_load_set(fake):
    at = open_page("experiment")
    at.number_input(key="experiment_concurrency").set_value(4)
    at.number_input(key="experiment_request_rate").set_value(2.5)
    at.button[0].click().run()
    affinity, round_robin = CONFIG.targets
    assert fake.runs == [(round_robin, affinity, REPORTS, 20, 6, 0, 4, 2.5)]


LOAD = pd.DataFrame(
    {"route": ["rr", "aff"], "requests_per_second": [3.21, None], "ttft_median_seconds": [0.04, 0.02],
     "ttft_p90_seconds": [0.09, 0.03], "ttft_p99_seconds": [0.25, None], "ttft_p99_low_seconds": [0.2, None],
     "ttft_p99_high_seconds": [0.31, None]}
)  # fmt: skip
REPLICAS = pd.DataFrame(
    {"route": ["rr", "rr", "aff"], "replica": ["r0", "r1", "r0"], "requests": [60, 60, 120]}
)


def test_experiment_shows_each_routes_throughput_and_p99_and_each_replicas_load(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: rr vs aff\n", None, LOAD, REPLICAS))
    at = open_page("experiment")
    assert not at.exception
    shown = metrics(at)
    assert shown["rr: requests/s"] == ["3.21"] and shown["aff: requests/s"] == ["-"]
    assert shown["rr: TTFT p99 (ms)"] == ["250"] and shown["aff: TTFT p99 (ms)"] == ["-"]
    (p99,) = [m for m in at.metric if m.label == "rr: TTFT p99 (ms)"]
    assert "interval 200–310 ms; median 40 ms, p90 90 ms" in p99.help
    assert experiment_replica_bars(at) == {"rr": {"r0": 60, "r1": 60}, "aff": {"r0": 120}}


def test_an_older_report_without_load_files_shows_its_markdown_only(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: a vs b\n", None))
    at = open_page("experiment")
    assert not at.exception and not at.metric and not at.get("plotly_chart")
    assert "## A/B experiment: a vs b" in texts(at)


def test_the_experiment_runs_configured_targets_with_their_own_key_sources_only(fake):
    """Nothing to type but a report directory: no URL, no variable or file to take a key from."""
    keyed = Target("keyed", "http://127.0.0.1:18100", "m", api_key_env="KEYED_API_KEY")
    filed = Target("filed", "http://127.0.0.1:18101", "m", api_key_file=Path("/run/secrets/filed-key"))
    fake.settings = Result(replace(CONFIG, targets=(*CONFIG.targets, keyed, filed)))
    at = open_page("experiment")
    assert [field.key for field in at.text_input] == ["experiment_dir"]
    assert at.selectbox(key="experiment_a").options == [
        "lab-affinity (affinity, http://127.0.0.1:18000)",
        "lab-round-robin (round_robin, http://127.0.0.1:18001)",
        "keyed (affinity, http://127.0.0.1:18100)",
        "filed (affinity, http://127.0.0.1:18101)",
    ]
    at.selectbox(key="experiment_a").set_value(keyed)
    at.selectbox(key="experiment_b").set_value(filed)
    at.button[0].click().run()
    assert fake.runs == [(keyed, filed, REPORTS, 20, 6, 0, None, None)]  # as configured, key sources and all


def test_reports_are_read_and_written_under_the_report_directory_only(fake, tmp_path):
    root, outside = tmp_path / "reports", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(root)))
    at = open_page("experiment")
    for name in ("../outside", "link", str(outside)):
        at.text_input(key="experiment_dir").set_value(name).run()
        assert [e.value for e in at.error] == [
            f'"{name}" is outside the report directory {root}: name a directory under it.'
        ]
        assert not at.button  # no form to run one there
    at.text_input(key="experiment_dir").set_value("ab-1").run()
    at.button[0].click().run()
    assert fake.reports_read == [root, root / "ab-1", root / "ab-1"]  # before and after the run
    assert [run[2] for run in fake.runs] == [root / "ab-1"]


def test_a_report_directory_that_cannot_be_resolved_is_named(fake, tmp_path):
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert data.report_directory("loop").error.startswith('"loop" cannot be a report directory: ')
    assert data.report_directory("a\0b").error == '"a\0b" cannot be a report directory: embedded null byte'


LONG_NAME = "r" * 5000
TOO_LONG = f'"{"r" * 79}…" (5,000 characters) cannot be a report directory: File name too long.'


def test_a_report_name_too_long_for_the_file_system_is_named_cut_and_the_page_goes_on(fake, tmp_path):
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    at = open_page("experiment")
    at.text_input(key="experiment_dir").set_value(LONG_NAME).run()
    assert not at.exception
    assert [e.value for e in at.error] == [TOO_LONG]
    assert not at.button and fake.reports_read == [tmp_path]  # nothing read or run there
    at.text_input(key="experiment_dir").set_value("ab-1").run()
    assert not at.error and fake.reports_read == [tmp_path, tmp_path / "ab-1"]


def test_the_report_reader_names_a_directory_it_cannot_look_into(monkeypatch, tmp_path):
    """The real data layer on a real directory: a name over 255 bytes, or a path over 4096, is refused
    with its length; the reader itself answers an error, not an OSError, for such a directory."""
    monkeypatch.setattr(
        data, "settings", lambda: Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    )
    assert data.report_directory(LONG_NAME).error == TOO_LONG
    deep = "/".join(["d" * 200] * 25)
    assert data.report_directory(deep).error.endswith(
        "(5,024 characters) cannot be a report directory: File name too long."
    )
    st.cache_data.clear()
    assert data.experiment_report(tmp_path / LONG_NAME).error.startswith("Cannot read the experiment report")


def test_doctor_runs_and_lists_its_findings(fake):
    fake.doctor = Result(
        {"checks": [{"name": "reachability", "status": "pass", "evidence": "200", "fix": ""},
                    {"name": "hash key", "status": "fail", "evidence": "4 backends", "fix": "hash on it"}],
         "causes": ["hash_key_not_session"]}
    )  # fmt: skip
    at = open_page("doctor")
    at.button(key="doctor_run").click().run()
    assert not at.exception
    assert fake.runs == [("lab-affinity", "")]
    assert "hash_key_not_session" in at.error[0].value
    assert list(at.table[0].value["status"]) == ["pass", "fail"]


def test_per_round_shows_real_users_ttft_by_round_per_gateway_listener(fake):
    fake.values[panel_queries.GATEWAY_FIRST_BYTE_BY_ROUND] = pd.DataFrame(
        {"log": ["gw"] * 4, "listener": ["affinity", "affinity", "round_robin", "round_robin"],
         "round": ["2", "1", "1", "8+"], "value": [0.03, 0.1, 0.1, 0.4]}
    )  # fmt: skip
    at = open_page("per_round")
    assert not at.exception
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("real_users_chart")]
    bars = {t["name"]: (t["x"], decoded(t["y"])) for t in json.loads(chart.proto.spec)["data"]}
    assert bars == {
        "gw / affinity": (["1", "2"], [pytest.approx(100), pytest.approx(30)]),
        "gw / round_robin": (["1", "8+"], [pytest.approx(100), pytest.approx(400)]),
    }


def test_per_round_says_when_no_gateway_log_timed_a_first_byte(fake):
    assert "No gateway log has timed a request's first byte yet" in texts(open_page("per_round"))


# --- empty ---------------------------------------------------------------------------------------------


EMPTY = {
    "overview": "no data",
    "per_round": "No successful probe rounds in this range yet",
    "replicas": "No engine served prompt tokens in this range",
    "sessions": "No probe sessions through lab-affinity in this range yet",
    "alerts": "Alertmanager holds no kvwatch alert",
    "experiment": f"No experiment report in {REPORTS} yet",
    "doctor": "The doctor sends a few short multi-turn sessions through http://127.0.0.1:18000",
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_says_when_there_is_no_data_yet(fake, page):
    fake.empty = True
    at = open_page(page)
    assert not at.exception and not at.error
    assert EMPTY[page] in texts(at) + str(metrics(at))


def test_the_overview_without_data_says_so_in_every_tile(fake):
    fake.empty = True
    shown = metrics(open_page("overview"))
    assert shown.pop("Cluster hit ratio") == ["no data"]
    assert shown == dict.fromkeys(
        ["Sessions on one replica", "Warm / cold TTFT", "Affinity efficiency"], ["no data", "no data"]
    )  # per target; no gateway listener seen yet
    assert texts(open_page("overview")).count("No session came back through the gateway log") == 2


# --- errors --------------------------------------------------------------------------------------------

PROMETHEUS_PAGES = ("overview", "replicas")
STORE_PAGES = ("per_round", "sessions", "alerts")


@pytest.mark.parametrize(
    "source, error, page",
    [("prometheus", DOWN, page) for page in PROMETHEUS_PAGES]
    + [("store", NO_STORE, page) for page in STORE_PAGES],
)
def test_an_unreachable_prometheus_or_a_missing_store_is_named(fake, source, error, page):
    setattr(fake, source, error)
    at = open_page(page)
    assert not at.exception
    assert at.error[0].value == error


def test_an_unreachable_alertmanager_leaves_the_received_alerts(fake):
    fake.alertmanager = NO_ALERTMANAGER
    at = open_page("alerts")
    assert [e.value for e in at.error] == [NO_ALERTMANAGER]
    assert list(at.dataframe[0].value["state"]) == ["firing"]


@pytest.mark.parametrize("page", PAGES)
def test_a_bad_config_is_named(fake, page):
    fake.settings = Result(error=BAD_CONFIG)
    at = open_page(page)
    assert not at.exception
    assert at.error[0].value == BAD_CONFIG


def test_an_unreadable_experiment_report_is_named(fake):
    fake.report = Result(error="Cannot read the experiment report in /tmp/x: [Errno 13] Permission denied")
    assert "Permission denied" in open_page("experiment").error[0].value


def test_a_failing_doctor_run_is_named(fake):
    fake.doctor = Result(error="target lab-affinity: environment variable LAB_KEY is not set")
    at = open_page("doctor")
    at.button(key="doctor_run").click().run()
    assert at.error[0].value == "target lab-affinity: environment variable LAB_KEY is not set"


# --- secrets -------------------------------------------------------------------------------------------

URL_PASSWORD, KEY = "pw-3f1c9e", "kv-8d2a71b4"  # nothing marks them as secrets but the config
KEY_ENV = "KVWATCH_DASHBOARD_TEST_KEY"


def with_password(url: str) -> str:
    return url.replace("://", f"://probe:{URL_PASSWORD}@")


SECRET_CONFIG = replace(
    CONFIG,
    targets=tuple(
        replace(t, base_url=with_password(t.base_url), api_key_env=KEY_ENV) for t in CONFIG.targets
    ),
    prometheus=Service(with_password(PROMETHEUS)),
    alertmanager=Service(with_password(ALERTMANAGER)),
)


def rendered(at: AppTest) -> str:
    """Everything the page sent to the browser, each element's whole message: texts, labels, options,
    tables, charts and exceptions."""

    def walk(node) -> list[str]:
        children = getattr(node, "children", {}).values()
        return [str(node.proto or ""), *(text for child in children for text in walk(child))]

    return "\n".join(text for root in (at.main, at.sidebar) for text in walk(root))


@pytest.mark.parametrize("page", PAGES)
def test_no_page_shows_a_url_password_or_the_api_key(fake, monkeypatch, page):
    monkeypatch.setenv(KEY_ENV, KEY)
    fake.settings = Result(SECRET_CONFIG)
    shown = rendered(open_page(page))
    assert "probe:" + URL_PASSWORD not in shown and URL_PASSWORD not in shown and KEY not in shown
    if page in ("overview", "experiment", "doctor"):  # they name the URLs, without the password
        assert "probe:[redacted]@127.0.0.1" in shown


def test_the_data_layer_names_urls_without_their_passwords(config_file):
    text = config_file.read_text().replace("http://", f"http://probe:{URL_PASSWORD}@")
    config_file.write_text(text)
    errors = [data.series(queries.CLUSTER_HIT_RATIO, data.span(900)).error, data.alerts().error]
    assert all(e.startswith("Cannot reach ") and "probe:[redacted]@127.0.0.1" in e for e in errors), errors
    assert not any(URL_PASSWORD in e for e in errors)
    config_file.write_text(text.replace("http://", "ftp://", 1))  # refused, and quoted in the error
    st.cache_data.clear()
    assert "probe:[redacted]@127.0.0.1" in data.settings().error
    assert URL_PASSWORD not in data.settings().error


# --- the data layer ------------------------------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path, monkeypatch) -> Path:
    """A kvwatch config the real data layer reads: Prometheus and Alertmanager on a closed port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    path = tmp_path / "kvwatch.yaml"
    path.write_text(
        "targets: [{name: t, base_url: 'http://127.0.0.1:1', model: m}]\n"
        f"prometheus: {{url: 'http://127.0.0.1:{closed}'}}\nalertmanager: {{url: 'http://127.0.0.1:{closed}'}}\n"
        f"store: {{path: '{tmp_path / 'kvwatch.db'}'}}\n"
    )
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(path)])
    st.cache_data.clear()
    yield path
    st.cache_data.clear()


def test_the_data_layer_names_what_it_could_not_reach(config_file):
    url = data.settings().value.prometheus.url
    assert data.series(queries.CLUSTER_HIT_RATIO, data.span(900)).error == (
        f"Cannot reach Prometheus at {url}: Connection refused. Is it running?"
    )
    assert data.alerts().error == (
        f"Cannot reach Alertmanager at {url}/api/v2/alerts: Connection refused. Is it running?"
    )
    store = config_file.parent / "kvwatch.db"
    assert data.sessions(0).error == (
        f"no kvwatch store at {store}: `kvwatch serve` creates it (store.path in {config_file})."
    )


def test_the_data_layer_names_a_bad_config(config_file):
    config_file.write_text("targets: [{name: t}]\n")
    assert data.settings().error == (
        f"error in {config_file}: targets[0].base_url: required key is missing. "
        "Start the dashboard with `kvwatch dashboard --config FILE`."
    )


def test_the_data_layer_reads_the_store(config_file):
    alert = {"status": "firing", "labels": {"alertname": "Watchdog"}, "annotations": {"summary": "alive"},
             "startsAt": "2026-11-29T18:00:00Z", "fingerprint": "f1"}  # fmt: skip
    with Store(config_file.parent / "kvwatch.db") as store:
        for result in SESSIONS.values():
            store.add_session(result)
        store.add_alerts({"version": "4", "alerts": [alert]}, received_at=T0)
    assert list(data.sessions(0).value["session_id"]) == ["sid-4", "sid-3", "sid-2", "sid-1"]
    assert len(data.rounds(0).value) == 16  # 4 sessions of 4 rounds, the last one failed
    summary = data.ttft_by_round(0).value.set_index(["target", "round"])
    assert summary.loc[("lab-affinity", 1), "median"] == pytest.approx(0.41)
    (received,) = data.received_alerts(0).value.to_dict("records")
    assert received["alertname"] == "Watchdog" and received["state"] == "firing"
    assert received["starts_at"] == pd.Timestamp("2026-11-29T18:00:00Z")
    assert received["received_at"] == pd.Timestamp(T0, unit="s", tz="UTC")


def test_the_data_layer_splits_the_stores_rounds_at_a_moment(config_file):
    with Store(config_file.parent / "kvwatch.db") as store:
        for result in BROKEN.values():
            store.add_session(result)
    split = data.ttft_by_round(0, FAULT).value.set_index(["target", "period", "round"])
    assert list(split.loc[("lab-affinity", "before"), "n"]) == [3, 3, 2, 2]  # session 13 straddles it
    assert list(split.loc[("lab-affinity", "after"), "n"]) == [2, 2, 3, 3]
    assert split.loc[("lab-affinity", "after", 3), "median"] == pytest.approx(0.60)  # 0.52, 0.60, 0.61
    whole = data.ttft_by_round(0).value
    assert set(whole["period"]) == {"all"} and list(whole["n"]) == [5] * 4 + [2] * 4


def test_queries_get_a_rate_window_of_ten_minutes_or_one_step():
    hour, week = data.Span(0, 3600, 15), data.Span(0, 7 * 86400, 2520)
    assert "[600s]" in data.filled(panel_queries.AFFINITY_EFFICIENCY, hour)
    assert "[2520s]" in data.filled(panel_queries.AFFINITY_EFFICIENCY, week)
    assert "$" not in data.filled(panel_queries.PROBE_STICKY_SHARE, hour)


class Clusters(BaseHTTPRequestHandler):
    """Two clusters' kvwatch exporters on one port, /a and /b: each route's last run stuck differently."""

    STICKY = {"a": 1.0, "b": 0.25}
    WARM_COLD = {"a": 0.4, "b": 0.9}
    CACHING = {"a": ("True", 32), "b": ("False", 16)}  # each cluster's engine: prefix caching, block size

    def do_GET(self) -> None:
        cluster = self.path.strip("/").partition("/")[0]
        labels = 'target="lab-affinity",route_mode="affinity"'
        caching, block = self.CACHING[cluster]
        body = (
            f"kvwatch_probe_sticky_ratio{{{labels}}} {self.STICKY[cluster]}\n"
            f"kvwatch_probe_warm_cold_ttft_ratio{{{labels}}} {self.WARM_COLD[cluster]}\n"
            f'vllm:cache_config_info{{enable_prefix_caching="{caching}",block_size="{block}"}} 1\n'
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.mark.integration
def test_the_data_layer_reads_each_cluster_apart_in_a_real_prometheus(tmp_path, monkeypatch):
    """One real Prometheus scraping two clusters (the target label `cluster`, as external_labels or
    relabelling set it): the clusters are listed, and each cluster's read holds its series alone. The
    Grafana boards' per-route line, with All clusters picked, is one line per cluster, never their max.
    The doctor of one cluster reads that cluster's engines alone, and says which it read."""
    exporters = ThreadingHTTPServer(("127.0.0.1", 0), Clusters)
    threading.Thread(target=exporters.serve_forever, daemon=True).start()
    address, port = f"127.0.0.1:{exporters.server_address[1]}", free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "kvwatch", "static_configs": [
            {"targets": [address], "labels": {"cluster": name, "__metrics_path__": f"/{name}/metrics"}}
            for name in Clusters.STICKY]}],
    }))  # fmt: skip
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        "targets: [{name: lab-affinity, base_url: 'http://127.0.0.1:1', model: m}]\n"
        f"prometheus: {{url: 'http://127.0.0.1:{port}'}}\n"
    )
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(config)])
    monkeypatch.setattr(data, "now", time.time)  # Prometheus holds nothing before it started
    prometheus, log = start_prometheus(tmp_path, port)
    try:
        deadline = time.monotonic() + 15
        while True:
            st.cache_data.clear()
            over = data.span(60)
            read = {name: data.instant(queries.STICKY_RATIO, over, name) for name in Clusters.STICKY}
            if all(not r.error and len(r.value) for r in read.values()):
                break
            assert time.monotonic() < deadline, f"{read}\n{log.read_text()[-2000:]}"
            time.sleep(0.2)
        assert data.clusters().value == ["a", "b"]
        assert {name: list(r.value["value"]) for name, r in read.items()} == {"a": [1.0], "b": [0.25]}
        board = data.instant_query(
            panels.as_board_runs(panel_queries.WARM_COLD_TTFT_RATIO, "cluster"), over
        ).value
        assert dict(zip(board["cluster"], board["value"], strict=True)) == Clusters.WARM_COLD
        prometheus_url = f"http://127.0.0.1:{port}"
        route = ProbeSettings(base_url="http://127.0.0.1:1", model="m", timeout_seconds=2)
        found = {}
        for name in (None, *Clusters.CACHING, "c"):
            cluster = Cluster(name) if name else None
            judged = checks.diagnose(route, prometheus_url, cluster=cluster).checks
            found[name] = next(c for c in judged if c.name == "prefix caching")
        unknown = found.pop("c")  # a cluster Prometheus holds no engine of: named, with those it holds
        assert unknown.cause == "cluster_not_found"
        said = 'no engine series has cluster="c", so none is judged; its engines\' cluster values are a, b'
        assert said in unknown.evidence
        found = {name: check.evidence for name, check in found.items()}
        off = f"{address} in cluster b reports enable_prefix_caching=False"
        assert f"Prometheus: {off}" in found[None]
        assert "Prometheus (cluster a): no engine has prefix caching off" in found["a"]
        assert off not in found["a"]
        assert f"Prometheus (cluster b): {off}" in found["b"]
        for name, (_, block) in Clusters.CACHING.items():  # the block size the doctor learns, per cluster
            narrowed = Cluster(name).narrowed(blocksize.PROMETHEUS_QUERY)
            sources = blocksize.BlockSizeSources(prometheus_url=prometheus_url, prometheus_query=narrowed)
            assert asyncio.run(blocksize.learn(sources, [])).tokens == block
    finally:
        stop(prometheus)
        exporters.shutdown()
        exporters.server_close()
        st.cache_data.clear()


def test_the_doctor_names_a_missing_api_key(config_file, monkeypatch):
    monkeypatch.delenv("KVWATCH_TEST_KEY", raising=False)
    target = Target("t", "http://127.0.0.1:1", "m", api_key_env="KVWATCH_TEST_KEY")
    assert data.run_doctor(target).error == "target t: environment variable KVWATCH_TEST_KEY is not set"


def test_an_experiment_report_reads_the_load_and_replica_files_the_experiment_wrote(tmp_path):
    files = {name: tmp_path / FILES[name] for name in ("report", "load", "replicas")}
    files["report"].write_text("## A/B experiment: rr vs aff\n")
    assert data.experiment_report(tmp_path).value == data.Report(
        tmp_path, "## A/B experiment: rr vs aff\n", None
    )
    LOAD.to_csv(files["load"], index=False)
    REPLICAS.to_csv(files["replicas"], index=False)
    data.experiment_report.clear()
    report = data.experiment_report(tmp_path).value
    pd.testing.assert_frame_equal(report.load, LOAD)
    pd.testing.assert_frame_equal(report.replicas, REPLICAS)
    files["load"].write_text('route,requests\n"rr,1\n')
    data.experiment_report.clear()
    assert data.experiment_report(tmp_path).error.startswith(
        f"Cannot read the experiment report in {tmp_path}: "
    )


def test_an_experiment_run_reads_each_targets_own_key_and_says_why_it_failed(config_file, monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    keyed, plain = Target("keyed", closed, "m", api_key_env=KEY_ENV), Target("plain", closed, "m")
    out = config_file.parent / "reports" / "ab-1"
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert data.run_experiment(keyed, plain, out, 1, 2, 0).error == (
        f"The experiment cannot run: target keyed: environment variable {KEY_ENV} is not set"
    )
    monkeypatch.setenv(KEY_ENV, KEY)
    failed = data.run_experiment(keyed, plain, out, 1, 2, 0).error
    assert failed.startswith("2 of 2 sessions failed; connection_refused (") and KEY not in failed
    assert list(out.iterdir()) == []  # made before the run, and nothing written when every session failed


def test_runbook_sections_come_from_the_runbook_kvwatch_ships(fake):
    section = data.runbook(f"{RUNBOOK_URL}#kvwatchprobestale").value
    assert section.startswith("## KVWatchProbeStale\n")
    missing = data.runbook(f"{RUNBOOK_URL}#nothing").error
    assert missing.startswith("No section #nothing in the runbook")
    assert data.runbook("https://wiki.example.net/other-runbook#kvwatchprobestale") == Result(None)
    wiki = "https://wiki.example.net/sre/kvwatch-runbook"  # where `make generate RUNBOOK_URL=...` put it
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(REPORTS, runbook_url=wiki)))
    assert data.runbook(f"{wiki}#kvwatchprobestale").value == section


def test_quantile_intervals_hold_the_quantile():
    values = pd.Series(range(1, 101), dtype=float).to_numpy()
    median, low, high = quantile_interval(values, 0.5)
    assert median == 50.5 and low < median < high
    assert (low, high) == (40.0, 61.0)  # 1.76 % of Binomial(100, 0.5) lies below 40, 1.76 % above 60
    assert quantile_interval(values[:1], 0.9) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("n", [5, 20, 28, 30, 45, 100, 1000])
@pytest.mark.parametrize("q", [0.5, 0.9])
def test_quantile_intervals_are_95_percent_or_the_widest_there_is(n, q):
    """The samples ranked low and high hold the true quantile when B, the number of samples below it
    (Binomial(n, q)), is at least low's rank and below high's."""
    _, low, high = quantile_interval(np.arange(1, n + 1, dtype=float), q)
    held = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(int(low), int(high)))
    assert held >= min(0.95, 1 - q**n - (1 - q) ** n) - 1e-12  # [smallest, largest] when too few for 95 %


def test_the_app_takes_its_config_and_refresh_from_what_kvwatch_dashboard_passes(monkeypatch, tmp_path):
    execs = []
    monkeypatch.setattr("os.execv", lambda path, argv: execs.append(argv))
    config = tmp_path / "kvwatch.yaml"
    assert main(["dashboard", "--config", str(config), "--refresh-seconds", "5"]) is None
    passed = execs[0][execs[0].index("--") + 1 :]  # what Streamlit hands the app as its sys.argv[1:]
    assert (data.app_options(passed).config, data.app_options(passed).refresh_seconds) == (config, 5)
    assert data.app_options(["-q", "tests"]).refresh_seconds == 15  # any other command line: defaults


def test_a_refresh_out_of_range_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["dashboard", "--refresh-seconds", "0"])
    assert (
        exit_.value.code == 2
        and capsys.readouterr().err == "kvwatch dashboard: --refresh-seconds must be 1 to 3600\n"
    )
