"""kvwatch's exporter: probe results and gateway-log statistics as Prometheus metrics (served, with the
Alertmanager webhook, by collectors.endpoints).

Probe sessions are expensive, so they run on the scheduler's clock, not on Prometheus's: each run adds
its immutable SessionResults to `ProbeResults`, and one custom Collector builds fresh metric families
from them at every scrape (the HELP texts say "cached"). Session ids never become label values; backend
names do, from a bounded set per route.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvwatch.collectors.probe.lifecycle import IDLE_OUTCOMES, life_of
from kvwatch.collectors.probe.metrics import COUNTERS, ROUTE_LABELS
from kvwatch.collectors.probe.records import (
    ERROR_KINDS,
    EVIDENCE,
    SESSION_LOSS_KINDS,
    RoundResult,
    SessionResult,
)
from kvwatch.config.settings import STICKY_ROUTE_MODES
from kvwatch.core.labels import BoundedLabel
from kvwatch.core.stats import median

log = logging.getLogger("kvwatch.exporter")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Route = tuple[str, str]  # (target, route_mode)
# What a round answered with a 200 may leave out of its usage, so that kvwatch cannot count its tokens.
UNMETERED = ("usage", "cached_tokens")


class LabelledRegistry(CollectorRegistry):
    """A registry that adds the same labels to every sample it serves (the exporter's cluster label):
    a Prometheus that scrapes several clusters' kvwatch without external_labels still tells them apart."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        super().__init__()
        self.labels = dict(labels)

    def collect(self) -> Iterator:
        for family in super().collect():
            family.samples = [
                sample._replace(labels={**sample.labels, **self.labels}) for sample in family.samples
            ]
            yield family


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(TTFT_BUCKETS, value)
        if index < len(self.buckets):
            self.buckets[index] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        running, out = 0, []
        for bound, hits in zip(TTFT_BUCKETS, self.buckets, strict=True):
            running += hits
            out.append((repr(bound), running))
        out.append(("+Inf", self.count))
        return out


@dataclass(frozen=True)
class LastRun:
    started_at: float
    finished_at: float
    sessions: tuple[SessionResult, ...]


class ProbeResults:
    """Every probe run so far: the latest run per route and running totals, safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[Route, LastRun] = {}
        self._totals: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._ttft: dict[tuple[str, str, str], _Histogram] = defaultdict(_Histogram)
        self._backends: dict[Route, BoundedLabel] = {}
        self._routes: dict[Route, float] = {}  # when each route was first declared or run

    def declare(self, route: Route, rounds: int = 0) -> None:
        """Export a route's outcome counters, and its per-round counters and TTFT histograms of rounds
        1..`rounds`, at 0 before its first run, so that rate() and increase() count that run too: a
        counter first seen at 2 shows no increase, and a panel over a time range since kvwatch started
        would leave the first run out."""
        with self._lock:
            self._start_at_zero(route)
            for round_ in range(1, rounds + 1):
                labels = (*route, str(round_))
                for key in ("rounds", "prompt", "cached", "ideal"):
                    self._totals[key, labels] += 0
                self._ttft.setdefault(labels, _Histogram())

    def add_run(self, route: Route, sessions: Sequence[SessionResult], started_at: float, finished_at: float):
        with self._lock:
            self._start_at_zero(route)
            self._last[route] = LastRun(started_at, finished_at, tuple(sessions))
            for session in sessions:
                self._count_session(route, session)

    def add_round(self, route: Route, result: RoundResult) -> None:
        """Count one round's tokens as the engine counted them, as soon as the round ends (failed or not):
        the engines count them at that moment too, so a rate of kvwatch's probe tokens lines up with the
        engines' rate and the difference is the real traffic's (add_run counts the rest at the run's end)."""
        with self._lock:
            self._start_at_zero(route)
            totals = self._totals
            if result.prompt_tokens is not None:
                totals["engine_prompt", route] += result.prompt_tokens
                totals["engine_cached", route] += result.cached_tokens or 0
            if result.status == 200 and (result.prompt_tokens is None or result.cached_tokens is None):
                missing = "usage" if result.prompt_tokens is None else "cached_tokens"
                totals["unmetered", (*route, missing)] += 1

    def _start_at_zero(self, route: Route) -> None:
        """Create a route's outcome counters at 0 (adding 0 to those that exist)."""
        self._routes.setdefault(route, time.time())
        for key, values in (
            ("sessions", ("success", "failure")),
            ("stickiness", ("true", "false", "unknown")),
            ("echo", ("true", "false")),
            ("errors", ERROR_KINDS),
            ("evidence", EVIDENCE),
            ("losses", SESSION_LOSS_KINDS),
            ("idle", IDLE_OUTCOMES),
            ("close_checks", ("true", "false")),
        ):
            for value in values:
                self._totals[key, (*route, value)] += 0
        for key in ("switches", "engine_prompt", "engine_cached"):
            self._totals[key, route] += 0
        for missing in UNMETERED:
            self._totals["unmetered", (*route, missing)] += 0
        if route not in self._backends:  # its folded counts start at 0 too
            self._backends[route] = BoundedLabel()

    def _count_session(self, route: Route, session: SessionResult) -> None:
        totals = self._totals
        totals["sessions", (*route, "success" if session.ok else "failure")] += 1
        sticky = {True: "true", False: "false", None: "unknown"}[session.sticky]
        totals["stickiness", (*route, sticky)] += 1
        totals["evidence", (*route, session.evidence)] += 1
        for _, kind in session.session_losses:
            totals["losses", (*route, kind)] += 1
        totals["switches", route] += session.backend_switches or 0
        self._count_life(route, session)
        if session.session_id_echoed is not None:
            totals["echo", (*route, str(session.session_id_echoed).lower())] += 1
        for r in session.rounds:
            labels = (*route, str(r.round))
            if r.pin_outcome is not None:
                totals["pins", (*route, r.pin_outcome)] += 1
            if not r.ok:
                totals["errors", (*route, r.error_kind)] += 1
                continue
            totals["rounds", labels] += 1
            totals["prompt", labels] += r.prompt_tokens or 0
            totals["cached", labels] += r.cached_tokens or 0
            totals["ideal", labels] += r.ideal_cached_tokens or 0
            if r.backend:
                totals["backend", (*route, self._backends[route](r.backend))] += 1
            if r.ttft_seconds is not None:
                self._ttft[labels].observe(r.ttft_seconds)

    def _count_life(self, route: Route, session: SessionResult) -> None:
        """An idled session's life after its idle, and a checked close (collectors.probe.lifecycle)."""
        if (life := life_of(session)) is not None:
            facts = {"idled": True, "expired": life.expiry is not None, "cold": life.cold}
            facts |= {"new_replica": life.new_replica, "repinned": life.repinned}
            for outcome, happened in facts.items():
                self._totals["idle", (*route, outcome)] += bool(happened)
        if session.close_gone is not None:
            self._totals["close_checks", (*route, str(session.close_gone).lower())] += 1

    def snapshot(self) -> tuple[dict[Route, float], dict[Route, LastRun], Counter, dict]:
        with self._lock:
            ttft = {labels: (h.cumulative(), h.total) for labels, h in self._ttft.items()}
            totals = Counter(self._totals)
            for route, backends in self._backends.items():
                for reason, count in backends.folded.items():
                    totals["folded", (*route, "backend", reason)] = count
            return dict(self._routes), dict(self._last), totals, ttft


class ProbeCollector(Collector):
    """Turns the probe results into fresh metric families at every scrape."""

    def __init__(
        self,
        results: ProbeResults,
        intervals: dict[str, float],
        expect_sticky: Mapping[str, bool] | None = None,
    ) -> None:
        self.results = results
        self.intervals = intervals  # target -> seconds between runs, for the HELP texts
        # target -> whether its sessions must stay on one replica; others: their route mode's default
        self.expect_sticky = expect_sticky or {}

    def collect(self) -> Iterator:
        routes, last, totals, ttft = self.results.snapshot()
        yield self._route_info(routes)
        yield from self._watched_families(routes)
        families = {
            key: CounterMetricFamily(name, doc, labels=[*ROUTE_LABELS, *extra])
            for key, (name, doc, extra) in COUNTERS.items()
        }
        for (key, labels), value in sorted(totals.items()):
            families[key].add_metric(list(labels), value)
        yield from families.values()

        histogram = HistogramMetricFamily(
            "kvwatch_probe_ttft_seconds",
            "Client-side time to first token of successful probe rounds.",
            labels=[*ROUTE_LABELS, "round"],
        )
        for labels, (buckets, total) in sorted(ttft.items()):
            histogram.add_metric(list(labels), buckets, total)
        yield histogram
        yield from self._last_run_families(last)

    def _route_info(self, routes: dict[Route, float]) -> GaugeMetricFamily:
        """Which routes the affinity alerts watch: they select on expect_sticky, not on a route mode name."""
        info = GaugeMetricFamily(
            "kvwatch_probe_route_info",
            "A probed route's settings: expect_sticky says whether its sessions must stay on one replica.",
            labels=[*ROUTE_LABELS, "expect_sticky"],
        )
        for target, mode in sorted(routes):
            sticky = self.expect_sticky.get(target, mode in STICKY_ROUTE_MODES)
            info.add_metric([target, mode, str(sticky).lower()], 1)
        return info

    def _watched_families(self, routes: dict[Route, float]) -> Iterator[GaugeMetricFamily]:
        """Every configured route from the start, before its first result: KVWatchProbeNoResults fires
        for one whose results never come, which no alert on its results can see."""
        since = GaugeMetricFamily(
            "kvwatch_probe_watched_since_timestamp_seconds",
            "When kvwatch serve began to probe the route.",
            labels=ROUTE_LABELS,
        )
        interval = GaugeMetricFamily(
            "kvwatch_probe_interval_seconds", "Seconds between scheduled probe runs.", labels=ROUTE_LABELS
        )
        for route, declared_at in sorted(routes.items()):
            since.add_metric(list(route), declared_at)
            if route[0] in self.intervals:
                interval.add_metric(list(route), self.intervals[route[0]])
        yield from (since, interval)

    def _last_run_families(self, last: dict[Route, LastRun]) -> Iterator:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(
                name, doc + " (cached; refreshed by the scheduler)", labels=[*ROUTE_LABELS, *extra]
            )

        timestamp = gauge("kvwatch_probe_last_run_timestamp_seconds", "When the last probe run finished")
        duration = gauge("kvwatch_probe_last_run_duration_seconds", "How long the last probe run took")
        success = gauge("kvwatch_probe_success", "1 if every session of the last probe run succeeded")
        sticky = gauge(
            "kvwatch_probe_sticky_ratio",
            "Share of the last run's judged sessions that were sticky; evidence: replica when a round named "
            "its replica (KVWatchSessionAffinityBroken judges it), else reuse (KVWatchSessionReuseLost)",
            ("evidence",),
        )
        echo = gauge(
            "kvwatch_probe_session_id_echo_ratio", "Share of the last run's sessions whose id came back"
        )
        last_ttft = gauge(
            "kvwatch_probe_last_ttft_seconds", "Median TTFT per round in the last run", ("round",)
        )
        warm_cold = gauge(
            "kvwatch_probe_warm_cold_ttft_ratio", "Median TTFT of rounds 2+ over round 1's in the last run"
        )
        reuse = gauge(
            "kvwatch_probe_warm_reuse_ratio",
            "Cached over ideal cached tokens of the last run's warm rounds; evidence: replica when a round "
            "named its replica, else reuse",
            ("evidence",),
        )
        for route, run in sorted(last.items()):
            labels = list(route)
            timestamp.add_metric(labels, run.finished_at)
            duration.add_metric(labels, run.finished_at - run.started_at)
            success.add_metric(labels, float(bool(run.sessions) and all(s.ok for s in run.sessions)))
            evidence = _run_evidence(run.sessions)
            judged = [s.sticky for s in run.sessions if s.sticky is not None]
            if judged:
                sticky.add_metric([*labels, evidence], sum(judged) / len(judged))
            echoed = [s.session_id_echoed for s in run.sessions if s.session_id_echoed is not None]
            if echoed:
                echo.add_metric(labels, sum(echoed) / len(echoed))
            medians = _median_ttft_by_round(run.sessions)
            for round_, value in medians.items():
                last_ttft.add_metric([*labels, str(round_)], value)
            warm = [r.ttft_seconds for s in run.sessions for r in s.rounds if r.round > 1 and r.ttft_seconds]
            if medians.get(1) and warm:
                warm_cold.add_metric(labels, median(warm) / medians[1])
            if (reused := _warm_reuse(run.sessions)) is not None:
                reuse.add_metric([*labels, evidence], reused)
        yield from (timestamp, duration, success, sticky, echo, last_ttft, warm_cold, reuse)


def _run_evidence(sessions: Sequence[SessionResult]) -> str:
    """What a run's stickiness and warm reuse stand for: "replica" when a round of it named its replica,
    else "reuse" (the run's sticky ratio then counts its sessions' verdicts by reuse)."""
    return "replica" if any(s.evidence == "replica" for s in sessions) else "reuse"


def _warm_reuse(sessions: Sequence[SessionResult]) -> float | None:
    """Cached over ideal tokens of the warm rounds that report cached tokens; None without any."""
    warm = [r for s in sessions for r in s.rounds[1:] if r.ok and r.cached_tokens is not None]
    ideal = sum(r.ideal_cached_tokens or 0 for r in warm)
    return sum(r.cached_tokens for r in warm) / ideal if ideal else None


def _median_ttft_by_round(sessions: Sequence[SessionResult]) -> dict[int, float]:
    by_round: dict[int, list[float]] = defaultdict(list)
    for session in sessions:
        for r in session.rounds:
            if r.ok and r.ttft_seconds is not None:
                by_round[r.round].append(r.ttft_seconds)
    return {round_: median(values) for round_, values in sorted(by_round.items())}
