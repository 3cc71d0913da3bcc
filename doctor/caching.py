"""The doctor's prefix-caching check: whether the engines cache prompt prefixes, from the sessions the route
checks ran and, given Prometheus, from the engines' own metrics, judged as the alert rules judge them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvwatch.alerts.alerts import Alert, alerts
from kvwatch.config.settings import label_name_problem
from kvwatch.core.errors import KVWatchError, UpstreamError, UpstreamTimeout
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.doctor.findings import Check
from kvwatch.doctor.route import Route
from kvwatch.prometheus import panel_queries, promql
from kvwatch.prometheus.queries import Grouping
from kvwatch.prometheus.thresholds import THRESHOLDS

PROMETHEUS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Cluster:
    """Which clusters' engines the doctor reads in a Prometheus that holds several, told apart by the
    label `label`: the one whose value is `name`, or without a name every one, each instance named with
    its own."""

    name: str | None
    label: str = CLUSTER_LABEL

    def __post_init__(self) -> None:
        if self.name == "":
            raise ValueError("the cluster needs a name")
        if wrong := label_name_problem(self.label):
            raise ValueError(f"the cluster label {wrong}")

    def __str__(self) -> str:
        """As the evidence names it: `cluster a`, `region eu`."""
        return f"{self.label} {self.name}"

    def narrowed(self, expr: str) -> str:
        return (
            expr
            if self.name is None
            else promql.with_matcher(expr, panel_queries.one_cluster(self.label, self.name))
        )


EVERY_CLUSTER = Cluster(None)


def caching_off_alerts(cluster_label: str = CLUSTER_LABEL) -> list[Alert]:
    """The alert rules' two kinds of evidence, queried as they are, so that the doctor and the alerts
    agree; aggregated by `cluster_label`, so that each instance keeps its cluster."""
    every_alert = alerts(THRESHOLDS, Grouping(cluster_label))
    return [a for a in every_alert if a.name == "KVWatchPrefixCachingDisabled"]


CACHING_OFF_EVIDENCE = {
    "lookups": "serves prompt tokens while its prefix-cache lookups stay flat",
    "config": "reports enable_prefix_caching=False",
}


class NoEngineSeries(KVWatchError, ValueError):
    """Prometheus holds no engine series that the caching-off queries could read (in the cluster named):
    their silence would say nothing of the engines."""


async def _query(url: str, expr: str) -> list[dict]:
    """The series of an instant query; raises an UpstreamError."""
    return await asyncio.to_thread(PrometheusApi(url, PROMETHEUS_TIMEOUT_S).query, expr)


async def _engines_there(url: str, cluster: Cluster) -> None:
    """Raises NoEngineSeries, naming the clusters that do hold engines, when Prometheus holds none of the
    series the caching-off queries read, or none in `cluster`."""
    alerts = caching_off_alerts(cluster.label)
    names = list(dict.fromkeys(name for alert in alerts for name in promql.series_names(alert.expr)))
    expr = f"group by ({cluster.label}) ({{__name__=~{promql.string('|'.join(names))}}})"
    values = {series["metric"].get(cluster.label, "") for series in await _query(url, expr)}
    if not values:
        raise NoEngineSeries(f"holds no engine series ({', '.join(names)}) to judge")
    if cluster.name is None or cluster.name in values:
        return
    named = sorted(values - {""})
    there = (
        f"its engines' {cluster.label} values are {', '.join(named)}"
        if named
        else f"no engine series there carries the label {cluster.label}"
    )
    matcher = panel_queries.one_cluster(cluster.label, cluster.name)
    raise NoEngineSeries(f"no engine series has {matcher}, so none is judged; {there}")


async def _caching_off_in_prometheus(url: str, cluster: Cluster = EVERY_CLUSTER) -> list[str]:
    """Instances Prometheus sees without prefix caching, in `cluster` alone when it names one; raises
    an UpstreamError, NoEngineSeries when the queries would read no engine."""
    await _engines_there(url, cluster)
    found = []
    for alert in caching_off_alerts(cluster.label):
        what = CACHING_OFF_EVIDENCE[alert.labels["evidence"]]
        found += [
            f"{_instance_in_cluster(series['metric'], cluster.label)} {what}"
            for series in await _query(url, cluster.narrowed(alert.expr))
        ]
    return found


def _instance_in_cluster(labels: dict[str, str], cluster_label: str) -> str:
    """An instance as the alerts name it; with its cluster where Prometheus holds several."""
    instance, cluster = labels.get("instance", "an instance"), labels.get(cluster_label)
    return f"{instance} in {cluster_label} {cluster}" if cluster else instance


async def prefix_caching(
    route: Route, prometheus_url: str | None, blocker: Check | None, cluster: Cluster = EVERY_CLUSTER
) -> Check:
    """A session pinned to one backend that reuses nothing of its history means the engine caches nothing.

    Prometheus, when given, adds the engines' own word and covers replicas no session landed on: those
    of `cluster` alone, when it names one, which its evidence names then. A cluster Prometheus holds no
    engine of fails as cluster_not_found: its empty answer would otherwise pass.
    """
    name, off, seen = "prefix caching", [], []
    pinned = [s for s in route.sessions if s.sticky]
    reported = [s for s in pinned if all(r.cached_tokens is not None for r in s.rounds[1:] if r.ok)]
    reuse: dict[str, list[int]] = {}  # backend: [cached, ideal] tokens of the warm rounds pinned to it
    for session in reported:
        figures = reuse.setdefault(session.backends[0] if session.backends else "a backend", [0, 0])
        for r in session.rounds[1:]:
            if r.ok and r.ideal_cached_tokens:
                figures[0] += r.cached_tokens
                figures[1] += r.ideal_cached_tokens
    ratios = [cached / ideal for cached, ideal in reuse.values() if cached and ideal]
    off += [
        f"{b} reused 0 of {ideal} history tokens"
        for b, (cached, ideal) in reuse.items()
        if ideal and not cached
    ]
    if ratios:
        seen.append(f"pinned sessions reused their history (cached / ideal tokens: lowest {min(ratios):.0%})")
    elif not route.sessions:
        seen.append(f"not meaningful while {blocker.name} fails")
    elif not pinned:
        seen.append("no session stayed on one backend")
    elif not reported:
        seen.append("the engine reports no cached_tokens in usage")
    if reuse:  # the blocks its cached / ideal tokens count
        seen.append(route.block.describe())
    flagged, selects_nothing = None, False  # the engines Prometheus names, once it answered
    said = "Prometheus" if cluster.name is None else f"Prometheus ({cluster})"
    if prometheus_url:
        try:
            flagged = await _caching_off_in_prometheus(prometheus_url, cluster)
        except NoEngineSeries as error:
            seen.append(f"{said}: {error}")
            selects_nothing = cluster.name is not None
        except UpstreamError as error:
            kind = "TimeoutException" if isinstance(error, UpstreamTimeout) else type(error).__name__
            seen.append(redact(f"Prometheus at {prometheus_url} cannot be queried ({kind}: {error})"))
    off += [f"{said}: {line}" for line in flagged or []]
    seen += [f"{said}: no engine has prefix caching off"] if flagged == [] else []
    evidence = "; ".join(off + seen)
    if off:
        fix = (
            "start the engines with prefix caching on: vLLM V1 has it on by default (drop "
            "--no-enable-prefix-caching), V0 needs --enable-prefix-caching, SGLang must not get "
            "--disable-radix-cache"
        )
        return Check(name, "fail", evidence, fix, "prefix_cache_disabled")
    if selects_nothing:
        fix = (
            "name a cluster that holds engines (--cluster, the dashboard's cluster picker), or the label "
            "that tells clusters apart (--cluster-label, cluster_label in kvwatch.yaml)"
        )
        return Check(name, "fail", evidence, fix, "cluster_not_found")
    if ratios and min(ratios) < 0.5:
        return Check(name, "warn", evidence, "a cache too small for the working set evicts: check KV usage")
    if ratios or flagged is not None:
        return Check(name, "pass", evidence)
    if pinned:
        fix = "have the engine report them: vLLM --enable-prompt-tokens-details, SGLang --enable-cache-report"
        return Check(name, "warn", evidence, fix)
    if prometheus_url:
        return Check(name, "warn", evidence, "check the --prometheus URL")
    return Check(name, "skipped", f"{evidence}; --prometheus reads the engines themselves")
