"""The Grafana boards against the lab's real Prometheus: every panel's PromQL shows data, before and after the
gateway's session affinity breaks: the verdict panels turn to the alert's state, and real sessions spread.
Once kvwatch serve stops, the probe panels (and the Sessions and Per-round pages) equal the sessions it
stored, and the gateway panels the access log."""

from __future__ import annotations

import base64
import bisect
import contextlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from operator import not_

import httpx
import numpy as np
import pytest
import streamlit as st
from prometheus_client.parser import text_string_to_metric_families
from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest
from test_gatewaylog_lab import answered, chat
from test_grafana import every_query, in_clusters

from kvwatch.alerts.verdicts import (
    ENGINE_LOSS,
    FIRING,
    OK,
    ROUTE_REUSE,
    ROUTE_STICKY,
    ROUTER_PREDICTION_MISS,
    ROUTING_LOSS,
)
from kvwatch.collectors.gatewaylogs.base import path_of
from kvwatch.collectors.gatewaylogs.tally import INFERENCE_PATHS
from kvwatch.collectors.probe.records import ERROR_KINDS
from kvwatch.core.stats import CONFIDENCE
from kvwatch.prometheus import panel_queries, queries
from kvwatch.prometheus.rules import GATEWAY_RULES
from kvwatch.serve.exporter import TTFT_BUCKETS
from kvwatch.serve.scheduler import GATEWAY_POLL_SECONDS
from kvwatch.store.history import Store
from labs import stop_lab_serve
from paths import REPO
from processes import TLS, http_get

# What $__rate_interval stands for: short, so that a fault shows within the test's time budget (the lab
# probes every 5 s and scrapes every second). Panels on recording rules keep the rules' 2m window.
WINDOW = "30s"
AFFINITY_TARGET = "lab-affinity"
AFFINITY_LISTENER = {"log": "affinity", "listener": "affinity"}
# The lab runs no router: tests/integration/test_router_prediction.py proves these panels against a
# replayed one.
ROUTER_ONLY = {
    queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    queries.INSTANCE_ROUTER_PIN_KEPT,
    queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
    ROUTER_PREDICTION_MISS.state,
    # the reuse decomposition's: the lab's router is started by tests/integration/test_reuse_decomposition.py
    queries.INSTANCE_ROUTER_REUSE_SHARE,
    queries.CLUSTER_ROUTER_REUSE_SHARE,
    queries.INSTANCE_ROUTER_REUSE_LOSS,
    ROUTING_LOSS.state,
    ENGINE_LOSS.state,
    # AIBrix's, and the session tables' and KV-event index's: the lab's session table is behind its
    # SageMaker front (tests/integration/test_lab_session_life.py), its index is SMG's
    queries.INSTANCE_ROUTER_FALLBACKS,
    queries.INSTANCE_ROUTER_SESSION_BINDINGS,
    queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS,
    queries.INSTANCE_ROUTER_SESSION_INVALIDATIONS,
    queries.INSTANCE_ROUTER_KV_EVENT_LAG,
    queries.INSTANCE_ROUTER_KV_EVENT_GAPS,
    queries.INSTANCE_ROUTER_KV_EVENT_RESYNCS,
    queries.INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS,
    # LMCache's tiers: no LMCache in this lab (tests/unit/prometheus' promtool tests compute them)
    panel_queries.LMCACHE_HIT_SHARE_BY_TIER,
}
# The lab's rounds name their replica: no route is judged by reuse here. tests/integration/
# test_sagemaker_probe.py proves that verdict against the lab's SageMaker front.
REUSE_ONLY = {ROUTE_REUSE.state}


def instant(
    prometheus: str,
    expr: str,
    *,
    window: str = WINDOW,
    time_range: str = "5m",
    at: float | None = None,
    **variables: str,
) -> list[dict]:
    """The panel query's value now, or `at` a time, with its variables set."""
    expr = panel_queries.fill_variables(expr, window=window, time_range=time_range, **variables)
    params = {"query": expr} | ({"time": at} if at is not None else {})
    answer = http_get(f"{prometheus}/api/v1/query", params=params, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def value_for(prometheus: str, expr: str, **labels: str) -> float:
    """The query's value for the series with these labels; NaN while it has none."""
    found = [r for r in instant(prometheus, expr) if labels.items() <= r["metric"].items()]
    return float(found[0]["value"][1]) if found else math.nan


def affinity_value(prometheus: str, expr: str) -> float:
    """The query's value for the affinity route; NaN while it has none."""
    return value_for(prometheus, expr, target=AFFINITY_TARGET)


def real_spread(prometheus: str) -> float:
    """The share of real sessions through the affinity listener spread over replicas with no failover."""
    return value_for(prometheus, panel_queries.REAL_SESSIONS_SPREAD, **AFFINITY_LISTENER, failover="false")


def inference_requests(lines: list[dict]) -> list[dict]:
    """The logged requests to the inference paths, the only ones kvwatch counts as requests: serve's
    first probe run may fetch GET /metrics through the gateway, to learn the block size before
    Prometheus holds it."""
    return [line for line in lines if path_of(line["request"]) in INFERENCE_PATHS]


def logged_sessions(lab, listener: str, lines: int) -> tuple[int, int, int]:
    """The gateway log's own sessions in its first `lines` lines (what kvwatch had read): those with two or
    more requests, those of them served by more than one upstream with no failover, and those a failover
    moved (nginx tried an upstream before the one that served). The lab is younger than the spread
    window, so every request counts."""
    served: dict[str, list[str]] = {}
    failed_over: set[str] = set()
    for line in inference_requests(lab.access_log(listener)[:lines]):
        if ":" in line["upstream_addr"]:  # served by an upstream
            *before, upstream = line["upstream_addr"].split(", ")
            served.setdefault(line["session_id"], []).append(upstream)
            if before:
                failed_over.add(line["session_id"])
    returning = {session for session, upstreams in served.items() if len(upstreams) > 1}
    spread = {session for session in returning if len(set(served[session])) > 1}
    return len(returning), len(spread - failed_over), len(spread & failed_over)


def exported_poll(lab, log: str) -> tuple[float, int, int, int]:
    """The exporter's latest poll of the gateway log, once a new one has been taken: the lines it had
    read by then (which of the log's lines it counted, exactly, where a time would split the lines
    written while it polled), its sessions with two or more requests, and those of them spread with no
    failover and by one."""

    def snapshot() -> tuple[float, float, int, int, int]:
        found = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(http_get(f"{lab.status['exporter']}/metrics").text)
            for s in family.samples
        }
        listener = {"log": log, "listener": log}

        def spread(failover: str) -> int:
            return found[
                "kvwatch_gateway_session_spread_sessions",
                tuple(sorted({**listener, "failover": failover}.items())),
            ]

        return (
            found["kvwatch_gateway_log_last_poll_timestamp_seconds", (("log", log),)],
            found[f"{LINES_READ}_total", (("log", log),)],
            found["kvwatch_gateway_returning_sessions", tuple(sorted(listener.items()))],
            spread("false"),
            spread("true"),
        )

    first = snapshot()
    _, *poll_figures = poll(snapshot, lambda now: now[0] > first[0], GATEWAY_POLL_SECONDS + 5)
    return tuple(poll_figures)


def cluster_hit_ratio(prometheus: str) -> float:
    found = instant(prometheus, queries.CLUSTER_HIT_RATIO)
    return float(found[0]["value"][1]) if found else math.nan


def poll(probe, done, timeout: float):
    """Call `probe` every second until `done(value)` or `timeout` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while not done(value := probe()) and time.monotonic() < deadline:
        time.sleep(1)
    return value


def settled(changes: list[float]) -> bool:
    """The hit ratio moved less than 0.01 in the last 10 s (see below)."""
    return bool(changes) and abs(changes[0]) < 0.01


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "4", "--flavours", "vllm,sglang", "--users", "4", "--think", "0.2",
                     "--time-scale", "0.1")  # fmt: skip


@pytest.mark.integration
def test_panels_show_data_and_follow_a_broken_affinity(lab):
    prometheus = lab.status["prometheus"]
    # Healthy: every panel shows data, except the firing alerts, which are empty when all is well, and
    # the routers' and the reuse verdict's.
    unexpected = {
        in_clusters(expr) for expr in (panel_queries.FIRING_ALERTS_BY_NAME, *ROUTER_ONLY, *REUSE_ONLY)
    }
    expected = {expr: title for expr, title in every_query().items() if expr not in unexpected}
    empty = poll(
        lambda: [title for expr, title in expected.items() if not instant(prometheus, expr)], not_, 60
    )
    assert not empty, f"panels without data: {empty}"
    sticky, switches = panel_queries.PROBE_STICKY_SHARE, panel_queries.PROBE_BACKEND_SWITCHES_PER_SESSION
    # The round-robin route's first run may land before the affinity route's: wait for the latter too.
    healthy_sticky = poll(lambda: affinity_value(prometheus, sticky), lambda v: not math.isnan(v), 60)
    assert healthy_sticky == 1 and affinity_value(prometheus, switches) == 0
    assert affinity_value(prometheus, ROUTE_STICKY.state) == OK
    efficiency = affinity_value(prometheus, panel_queries.AFFINITY_EFFICIENCY)
    healthy_spread = real_spread(prometheus)
    assert healthy_spread == 0, "real sessions spread while affinity holds"
    # The hit ratio's recording rule averages 2 minutes, which at first still hold the cold start: let it
    # settle, or a fall after the fault could hide in the warm-up.
    change = f"{queries.CLUSTER_HIT_RATIO} - {queries.CLUSTER_HIT_RATIO} offset 10s"
    changes = poll(lambda: [float(r["value"][1]) for r in instant(prometheus, change)], settled, 60)
    assert settled(changes), f"the cluster hit ratio does not settle: {changes}"
    hit_ratio = cluster_hit_ratio(prometheus)

    assert lab.cli("fault", "break-affinity").returncode == 0
    try:
        value = poll(lambda: affinity_value(prometheus, sticky), lambda v: v < 1, 30)
        assert value < 1, f"the affinity route stays sticky: {value}"
        value = poll(lambda: affinity_value(prometheus, switches), lambda v: v > 0, 10)
        assert value > 0, f"no backend switches on the affinity route: {value}"
        assert affinity_value(prometheus, panel_queries.AFFINITY_EFFICIENCY) < efficiency
        firing = poll(lambda: instant(prometheus, panel_queries.FIRING_ALERTS_BY_NAME), bool, 15)
        assert "KVWatchSessionAffinityBroken" in {alert["metric"]["alertname"] for alert in firing}
        assert affinity_value(prometheus, ROUTE_STICKY.state) == FIRING  # the verdict panel
        value = poll(lambda: real_spread(prometheus), lambda v: v > 0, 30)
        assert value > 0, "real sessions through the affinity listener do not spread"
        # The panel against the gateway log itself, at the exporter's last poll: Prometheus scrapes the
        # exporter and records the share every second, well before the next poll.
        lines, *sessions = exported_poll(lab, AFFINITY_LISTENER["log"])
        assert tuple(sessions) == logged_sessions(lab, AFFINITY_LISTENER["listener"], int(lines))
        returning, spread, moved = sessions
        assert moved == 0, "no replica failed"
        share = pytest.approx(spread / returning)
        shown = poll(lambda: real_spread(prometheus), lambda v: v == share, GATEWAY_POLL_SECONDS)
        assert shown == share, f"Prometheus records {shown} of the poll's {spread} / {returning}"
        # Round robin still reuses the shared system prompt and the rule averages 2 minutes, so the hit
        # ratio sinks slowly: about 0.01 in 20 s in this lab.
        value = poll(lambda: cluster_hit_ratio(prometheus), lambda v: v < hit_ratio - 0.01, 45)
        assert value < hit_ratio - 0.01, f"the cluster hit ratio stays near {hit_ratio:.3f}: {value:.3f}"
    finally:
        assert lab.cli("heal").returncode == 0


# --- the probe panels against the sessions kvwatch stored ---------------------------------------------

ROUTES = {"affinity": AFFINITY_TARGET, "round_robin": "lab-round-robin"}  # route_mode -> the lab's target
BACKEND_ROUNDS = "kvwatch_probe_backend_rounds_total"  # a backend's series starts at its first rounds
LINES_READ = "kvwatch_gateway_lines"  # the log's lines kvwatch read, in the log's order
FAILED_OVER_SESSION = "kvwatch-board-test-failover"
EXPORTER_UP = 'up{job="kvwatch"}'  # kvwatch serve's exporter, scraped or not
# A listener's request counters start at the first poll that read one of its requests.
GATEWAY_REQUESTS = ("kvwatch_gateway_requests_total", "kvwatch_gateway_requests_without_session_key_total")


@contextlib.contextmanager
def paused(lab, *names: str) -> Iterator[None]:
    """The lab's processes of these names stopped (SIGSTOP) while the block runs, then resumed."""
    groups = [lab.status["processes"][name] for name in names]
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)


def stop_serve(lab) -> None:
    """Stop `kvwatch serve`, the lab's prober and exporter, so that neither the store nor the exported
    series move any more; returns once it is gone and Prometheus has recorded a failed scrape of it."""
    pid = stop_lab_serve(lab)
    # A failed scrape since: no sample of it is still on its way.
    up = poll(
        lambda: instant(lab.status["prometheus"], EXPORTER_UP), lambda found: found[0]["value"][1] == "0", 10
    )
    assert up[0]["value"][1] == "0", f"Prometheus still scrapes kvwatch serve ({pid}) 10 s after it stopped"


def exporter_scrapes(prometheus: str) -> list[float]:
    """When Prometheus scraped kvwatch serve's exporter successfully."""
    found = instant(prometheus, f"{EXPORTER_UP}[1h]")
    return [float(at) for series in found for at, up in series["values"] if up == "1"]


@dataclass(frozen=True)
class Ended:
    """Prometheus at its last scrape of the stopped exporter."""

    prometheus: str
    born: float  # its first scrape: every exported series starts then or later
    at: float

    def seconds(self, since: float) -> float:
        """A window from 1 ms before `since` to the last scrape: the sample at `since` is in it (whether
        a range holds its start or not), and rate() extrapolates 1 ms at most beyond it."""
        return round(self.at - since, 3) + 0.001

    def slack(self, since: float | None = None) -> float:
        """How far off a count per second over the window from `since` may be: rate()'s 1 ms of
        extrapolation (twice that, for the rounding to milliseconds), relative to the window."""
        return 0.002 / self.seconds(since or self.born)

    def counted(self, expected, since: float | None = None):
        """What a panel over the window from `since` shows of counts per second, or of their ratios:
        exact but for rate()'s extrapolation."""
        return pytest.approx(expected, rel=self.slack(since))

    def query(self, expr: str, since: float | None = None, **variables: str) -> list[dict]:
        """The panel's query at the last scrape, its window (rate interval and time range alike) from
        `since` on, by default the whole life: counters exported from 0 then, rate() counts them
        exactly."""
        window = f"{round(self.seconds(since or self.born) * 1000)}ms"
        return instant(self.prometheus, expr, window=window, time_range=window, at=self.at, **variables)

    def by(self, label: str, expr: str, since: float | None = None, **variables: str) -> dict[str, float]:
        return {r["metric"][label]: float(r["value"][1]) for r in self.query(expr, since, **variables)}

    def counted_by(self, at: float, target: str) -> float:
        """The end of the target's last run the exporter had counted at `at`; 0 before its first."""
        found = instant(self.prometheus, panel_queries.PROBE_LAST_RUN_AGE, at=at, target=target)
        return at - float(found[0]["value"][1]) + 0.001 if found else 0  # give or take time()'s rounding

    def born_last(self, *selectors: str) -> float:
        """When the last of these series got its first sample: a rate from then on counts all of them."""
        life = math.ceil(self.seconds(self.born))
        return max(float(r["values"][0][0]) for s in selectors for r in self.query(f"{s}[{life}s]"))


def counted_runs(
    store: Store, ended: Ended, target: str, after: float | None = None
) -> tuple[list[dict], list[dict]]:
    """The target's stored sessions and rounds of the runs the exporter counted after the scrape at
    `after` (the first by default: Prometheus may first scrape it after its first runs) and by the
    last: a run's sessions start after the run before it ended, and a run the stop cut short may be
    stored without ever being scraped."""
    since = ended.counted_by(ended.born if after is None else after, target)
    until = ended.counted_by(ended.at, target)
    sessions = [s for s in store.sessions(target=target) if since < s["started_at"] <= until]
    ids = {s["id"] for s in sessions}
    return sessions, [r for r in store.rounds(target=target) if r["session"] in ids]


def bucketed_median(ttfts: list[float], slack: float = 0.0) -> float:
    """What histogram_quantile(0.5) makes of these TTFTs in the exporter's buckets: the bucket holding
    the middle one, interpolated linearly within it. With `slack`, the most it can make of their rates
    when each is off by up to that share (the least, with a negative one): near a bucket's bound the
    interpolation multiplies a small error by the bucket's width over the requests in it."""
    rank = len(ttfts) / 2 * (1 + slack)
    for lower, upper in itertools.pairwise((0.0, *TTFT_BUCKETS)):
        below = sum(t <= lower for t in ttfts) * (1 - slack)
        within = sum(lower < t <= upper for t in ttfts) * (1 - slack)
        if below + within >= rank:
            return lower + (upper - lower) * (rank - below) / within
    return TTFT_BUCKETS[-1]  # in the +Inf bucket: its lower bound


def assert_bucketed_medians(
    target: str, shown: dict[str, float], ttfts: dict[str, list[float]], slack: float
) -> None:
    """Each round's median of `target` as a panel shows it is what histogram_quantile makes of the stored
    TTFTs, within what rate()'s extrapolation can move it."""
    assert shown.keys() == ttfts.keys(), target
    for round_, shown_median in shown.items():
        least, most = bucketed_median(ttfts[round_], -slack), bucketed_median(ttfts[round_], slack)
        assert least - 1e-12 <= shown_median <= most + 1e-12, (target, round_, least, shown_median, most)


def ttfts_by_round(rounds: list[dict]) -> dict[str, list[float]]:
    grouped: dict[str, list[float]] = {}
    for r in rounds:
        grouped.setdefault(str(r["round"]), []).append(r["ttft_seconds"])
    return grouped


@pytest.fixture(scope="module")
def ended(lab) -> Ended:
    """The lab once its probes and exporter stopped (after the break and heal above, when they ran)."""
    prometheus = lab.status["prometheus"]
    born = poll(lambda: exporter_scrapes(prometheus), bool, 30)[0]

    def counted_after_born() -> bool:
        ages = instant(prometheus, panel_queries.PROBE_LAST_RUN_AGE)
        return len(ages) == len(ROUTES) and all(
            at - float(age) > born for at, age in (a["value"] for a in ages)
        )

    # Standing alone, the tests wait for a run of each route that Prometheus saw counted.
    assert poll(counted_after_born, bool, 60), "no probe run after Prometheus's first scrape of kvwatch serve"
    # A replica fails between two rounds of a session: nginx tries it, then serves the round elsewhere.
    # The lab's users and probes wait meanwhile, so that none of them finds it dead first (nginx would
    # then move the session without trying it: no failover in the log).
    with httpx.Client(verify=TLS) as client:
        # A request the gateway assigns a session id to, on no inference path: not counted as keyless.
        assert client.get(f"{lab.affinity}/v1/models", timeout=10).status_code == 200
        served = answered(chat(client, lab.affinity, FAILED_OVER_SESSION))
        (failed,) = [r["id"] for r in lab.status["replicas"] if r["url"] == f"http://{served}"]
        with paused(lab, "traffic", "serve"):
            assert lab.cli("fault", "kill-replica", failed).returncode == 0
            moved_to = chat(client, lab.affinity, FAILED_OVER_SESSION)
    assert moved_to.startswith(f"{served}, "), f"no failover from {failed}: {moved_to}"

    def moved() -> float:
        return value_for(prometheus, panel_queries.REAL_SESSIONS_SPREAD, **AFFINITY_LISTENER, failover="true")

    assert poll(moved, lambda share: share > 0, 20) > 0, "Prometheus shows no session moved by a failover"
    stop_serve(lab)
    return Ended(prometheus, born, exporter_scrapes(prometheus)[-1])


@pytest.fixture(scope="module")
def store(lab, ended) -> Iterator[Store]:
    """The stopped lab's store, whole."""
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        yield store


@pytest.mark.integration
def test_probe_panels_equal_the_stored_sessions(ended, store):
    """Each probe panel over the lab's whole life against the probe sessions kvwatch stored, to the last
    one the exporter counted."""
    runs = {target: counted_runs(store, ended, target) for target in ROUTES.values()}
    errors: Counter[str] = Counter()
    per_round_medians = ended.query(panel_queries.PROBE_TTFT_BY_ROUND)
    for route_mode, target in ROUTES.items():
        sessions, rounds = runs[target]
        served = [r for r in rounds if r["error_kind"] is None]
        errors.update(r["error_kind"] for r in rounds if r["error_kind"] is not None)
        judged = [s["sticky"] for s in sessions if s["sticky"] is not None]
        echoed = [s["session_id_echoed"] for s in sessions if s["session_id_echoed"] is not None]
        warm = [r for r in served if r["round"] > 1]
        assert judged and echoed and warm, target

        def shown(expr: str) -> float:
            return ended.by("target", expr)[target]  # noqa: B023 - used in this iteration only

        assert shown(panel_queries.PROBE_STICKY_SHARE) == ended.counted(sum(judged) / len(judged)), target
        switches = sum(s["backend_switches"] or 0 for s in sessions)
        assert shown(panel_queries.PROBE_BACKEND_SWITCHES_PER_SESSION) == ended.counted(
            switches / len(sessions)
        ), target
        ideal = sum(r["ideal_cached_tokens"] for r in warm)
        assert shown(panel_queries.AFFINITY_EFFICIENCY) == ended.counted(
            sum(r["cached_tokens"] for r in warm) / ideal
        )
        not_echoed = echoed.count(False) / len(echoed)
        assert shown(panel_queries.SESSION_ID_NOT_ECHOED_SHARE) == ended.counted(not_echoed), target
        # The last counted run ended once it had learned the engine's block size: a loopback query after
        # its last session finished.
        since_last_session = ended.at - max(s["finished_at"] for s in sessions)
        assert 0 <= since_last_session - shown(panel_queries.PROBE_LAST_RUN_AGE) < 2, target

        overview = {r["metric"]["round"]: float(r["value"][1]) for r in per_round_medians
                    if r["metric"]["route_mode"] == route_mode}  # fmt: skip
        drilldown = ended.by("round", panel_queries.PROBE_TTFT_BY_ROUND_OVER_TIME, target=target)
        for shown_medians in (overview, drilldown):
            assert_bucketed_medians(target, shown_medians, ttfts_by_round(served), ended.slack())

        # rate() counts what a series gained after its first sample, and a backend's starts at the rounds
        # of the run that first landed on it: from the last backend's first sample on, every one counts.
        born = ended.born_last(f'{BACKEND_ROUNDS}{{target="{target}"}}')
        _, since_born = counted_runs(store, ended, target, after=born)
        served_since = Counter(r["backend"] for r in since_born if r["error_kind"] is None)
        shown_rounds = ended.by("backend", panel_queries.PROBE_ROUNDS_BY_BACKEND, born, target=target)
        per_second = {backend: served_since[backend] / ended.seconds(born) for backend in shown_rounds}
        assert shown_rounds == ended.counted(per_second, born), target
        assert set(Counter(r["backend"] for r in served)) == set(shown_rounds), target
    shown_errors = ended.by("kind", panel_queries.PROBE_ERRORS_BY_KIND)
    assert set(shown_errors) == set(ERROR_KINDS)
    assert shown_errors == ended.counted(
        {kind: errors[kind] / ended.seconds(ended.born) for kind in ERROR_KINDS}
    )


SESSIONS_CAPTION = (
    r"(\d+) sessions since .+? UTC; (\d+)% stayed on one replica; (\d+) backend switches; (\d+) failed\."
)
# The Per-round page's lines: the quantile, and how to take it of samples (linear between ranks).
PAGE_QUANTILES = {
    "median": (0.5, statistics.median),
    "p90": (0.9, lambda ordered: statistics.quantiles(ordered, n=10, method="inclusive")[-1]),
}


def plotted(values) -> list[float]:
    """A plotly trace's x or y: a list, or the typed array plotly's JSON makes of it."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return list(values)


def coverage(ordered: list[float], q: float, low: float, high: float) -> float:
    """How likely the samples ranked as `low` and `high` hold the true q-quantile: B ~ Binomial(n, q) of
    the samples below it lies from low's rank to just under high's."""
    n = len(ordered)
    first, last = bisect.bisect_left(ordered, low * 0.999999), bisect.bisect_right(ordered, high * 1.000001)
    return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(first + 1, last))


@pytest.mark.integration
def test_sessions_and_per_round_pages_equal_the_store(lab, store, monkeypatch):
    """The Sessions page's counts and the Per-round page's medians, p90s and their bands, through the
    dashboard's own data layer on the stopped lab's store."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(lab.state_dir / "kvwatch.yaml")])
    monkeypatch.setattr(manifest_scanner, "scan_component_manifests", list)  # the dashboard uses none
    st.cache_data.clear()
    sessions, rounds = store.sessions(), store.rounds()
    pages = REPO / "dashboard" / "app_pages"
    page = AppTest.from_file(str(pages / "sessions.py"), default_timeout=30).run()
    for target in ROUTES.values():
        page.selectbox(key="sessions_target").set_value(target).run()
        (caption,) = [c.value for c in page.caption if " sessions since " in c.value]
        found = re.fullmatch(SESSIONS_CAPTION, caption)
        assert found, caption
        mine = [s for s in sessions if s["target"] == target]
        judged = [s["sticky"] for s in mine if s["sticky"] is not None]
        assert int(found[1]) == len(mine), caption
        assert abs(int(found[2]) - 100 * sum(judged) / len(judged)) <= 0.5, caption
        assert int(found[3]) == sum(s["backend_switches"] or 0 for s in mine), caption
        assert int(found[4]) == sum(not s["ok"] for s in mine), caption

    page = AppTest.from_file(str(pages / "per_round.py"), default_timeout=30).run()
    # The probes' chart; below it, real users' from the gateway logs.
    (chart,) = [c for c in page.get("plotly_chart") if c.proto.id.endswith("per_round_chart")]
    traces = json.loads(chart.proto.spec)["data"]
    for band, line in zip(traces[::2], traces[1::2], strict=True):  # each line after its band
        target, quantile = line["name"].rsplit(" ", 1)
        q, of = PAGE_QUANTILES[quantile]
        numbers, shown = plotted(line["x"]), plotted(line["y"])
        edges = plotted(band["y"])  # the highs by round, then the lows backwards
        for i, number in enumerate(numbers):
            of_round = (target, number, None)
            ordered = sorted(
                r["ttft_seconds"] for r in rounds if (r["target"], r["round"], r["error_kind"]) == of_round
            )
            assert shown[i] / 1000 == pytest.approx(of(ordered)), (target, quantile, number)
            low, high = edges[-1 - i] / 1000, edges[i] / 1000
            assert low <= shown[i] / 1000 <= high, (target, quantile, number)
            # 95 %, or [smallest, largest] when there are too few samples for that.
            widest = 1 - q ** len(ordered) - (1 - q) ** len(ordered)
            assert coverage(ordered, q, low, high) >= min(CONFIDENCE, widest) - 1e-9, (
                target,
                quantile,
                number,
            )


@pytest.mark.integration
def test_gateway_panels_are_the_access_logs(lab, ended):
    """The real-sessions spread at the last scrape, moved by a failover and not, once a replica was
    killed, and the share of requests without a session key, against the affinity listener's access
    log up to the exporter's last poll (the lines it had read). The spread's recording rule by its own
    expression there: what its evaluation records from that scrape."""
    (rule,) = [rule for rule in GATEWAY_RULES if rule.record == panel_queries.REAL_SESSIONS_SPREAD]
    log, listener = AFFINITY_LISTENER["log"], AFFINITY_LISTENER["listener"]

    def lines_read(at: float) -> int:
        """How many of the log's lines kvwatch had read, as Prometheus last scraped it by `at`."""
        (read,) = instant(ended.prometheus, f'{LINES_READ}_total{{log="{log}"}}', at=at)
        return int(float(read["value"][1]))

    last = lines_read(ended.at)
    returning, spread, moved = logged_sessions(lab, listener, last)
    assert moved > 0
    shown = {r["metric"]["failover"]: float(r["value"][1]) for r in ended.query(rule.expr)
             if r["metric"]["log"] == log}  # fmt: skip
    assert shown == {"false": spread / returning, "true": moved / returning}

    born = ended.born_last(*(f'{counter}{{log="{log}"}}' for counter in GATEWAY_REQUESTS))
    read = inference_requests(lab.access_log(listener)[lines_read(born) : last])
    keyless = sum(line["session_source"] == "assigned" for line in read)
    (share,) = [
        r
        for r in ended.query(panel_queries.REQUESTS_WITHOUT_SESSION_KEY_SHARE, born)
        if r["metric"]["log"] == log
    ]
    assert float(share["value"][1]) == ended.counted(keyless / len(read), born)
