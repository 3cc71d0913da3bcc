"""What the dashboard's tests share: the Fake data layer answering every page from canned frames, its
fixtures (each test module imports them), and helpers to open a page and read what it shows."""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import streamlit as st
from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest

from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    INSTANCE_HIT_RATIO_DROP,
    LISTENER_SPREAD,
    LOAD_IMBALANCE,
    OK,
    PENDING,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    Verdict,
)
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.config.settings import Config, DashboardSettings, GatewayLog, Service, StoreSettings, Target
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.dashboard import data, stats
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import panel_queries, queries
from kvwatch.store.history import life_columns
from paths import REPO

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


def fires(verdict: Verdict) -> str:
    return f":red[{verdict.alert.name} fires: {verdict.alert.summary}]"


def pending(verdict: Verdict) -> str:
    return f":orange[{verdict.alert.name} is pending: "


def marks(at: AppTest, key: str) -> list[tuple[str, str]]:
    """(time, text) of every event marked on the chart of that key."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith(key)]
    layout = json.loads(chart.proto.spec)["layout"]
    return [(a["x"], a["text"]) for a in layout.get("annotations", [])]


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
REPLICA_IDS = pd.DataFrame({"instance": ["127.0.0.1:18011"], "replica": ["r2"], "value": [1.0]})


LOAD = pd.DataFrame(
    {"route": ["rr", "aff"], "requests_per_second": [3.21, None], "ttft_median_seconds": [0.04, 0.02],
     "ttft_p90_seconds": [0.09, 0.03], "ttft_p99_seconds": [0.25, None], "ttft_p99_low_seconds": [0.2, None],
     "ttft_p99_high_seconds": [0.31, None]}
)  # fmt: skip
REPLICAS = pd.DataFrame(
    {"route": ["rr", "rr", "aff"], "replica": ["r0", "r1", "r0"], "requests": [60, 60, 120]}
)

URL_PASSWORD, KEY = "pw-3f1c9e", "kv-8d2a71b4"  # nothing marks them as secrets but the config
KEY_ENV = "KVWATCH_DASHBOARD_TEST_KEY"


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
