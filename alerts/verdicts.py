"""What the Streamlit pages and the Grafana boards say of a route, a gateway listener or the cluster: the
state of the alert that watches it, computed from the alert's own expression, so that a page is red
exactly when the alert fires, never by a threshold of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from kvwatch.alerts.alerts import ALERTS, Alert
from kvwatch.prometheus.queries import (
    CLUSTER_ENGINES_CHANGED,
    CLUSTER_HIT_RATIO,
    CLUSTER_LOAD_IMBALANCE,
    CLUSTER_PROBE_SHARE,
    GATEWAY_SPREAD,
    INSTANCE,
    INSTANCE_HIT_RATIO,
    INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    INSTANCE_ROUTER_KV_EVENT_LAG,
    INSTANCE_ROUTER_REUSE_LOSS,
    INSTANCE_ROUTER_SESSION_BIND_REJECTIONS,
    INSTANCE_ROUTER_SESSION_BINDINGS,
    LISTENER,
    REUSED_SESSIONS_RATIO,
    ROUTE,
    STICKY_RATIO,
    STICKY_ROUTES_JUDGED,
    WARM_COLD_RATIO,
    WATCHED_LISTENERS,
    WATCHED_ROUTES,
)

OK, PENDING, FIRING = 0, 1, 2
# A verdict whose signal is absent, as every page and board says it: neither healthy nor broken, unknown.
NOT_WATCHING = "Not watching"


@dataclass(frozen=True)
class Verdict:
    """What the alert watching `signal` says of each thing it judges, as one query for every page."""

    alert: Alert
    signal: str  # what the alert compares with its threshold, one series per `by`
    by: str  # the labels naming what is judged; "" for the cluster
    watched: str | None = None  # the `and` filter keeping only what the alert watches
    # A series whose presence pauses the alert's judging (its `unless`), and what a page says meanwhile
    # instead of "Not watching": the alert holds the series it judges and knows why it does not judge.
    paused: tuple[str, str] | None = None

    def alerts(self, alertstate: str) -> str:
        """The alert's own series in Prometheus in that state (firing also while `keep_firing_for`
        holds it): the page reads the rule's evaluation instead of repeating its expression, so it
        agrees with the alert under any rule windows (the lab scales them)."""
        labels = {"alertname": self.alert.name, "alertstate": alertstate, **(self.alert.labels or {})}
        return "ALERTS{" + ", ".join(f'{name}="{value}"' for name, value in labels.items()) + "}"

    @property
    def state(self) -> str:
        """FIRING while the alert fires; PENDING while its condition holds for less than its `for`; OK
        where it judges the signal and finds nothing wrong; no sample where it has nothing to judge."""
        group = f"group by ({self.by})"  # by () for the cluster, so that the boards can add their label
        judged = f"{self.signal}\nand {self.watched}" if self.watched else self.signal
        return (
            f"{FIRING} * {group} ({self.alerts('firing')})\n"
            f"or {PENDING} * {group} ({self.alerts('pending')})\n"
            f"or {OK} * {group} ({judged})"
        )


def _alert(name: str, **labels: str) -> Alert:
    """The alert of that name, and of those labels where one name has several rules."""
    (found,) = (a for a in ALERTS if a.name == name and labels.items() <= (a.labels or {}).items())
    return found


ROUTE_STICKY = Verdict(
    _alert("KVWatchSessionAffinityBroken"),
    STICKY_RATIO,
    ROUTE,
    STICKY_ROUTES_JUDGED,
    paused=(
        CLUSTER_ENGINES_CHANGED,
        "Not judged now: an engine of this cluster restarted, went down or came back within the replica "
        "change window, and the gateway's failover moves sessions then.",
    ),
)
ROUTE_REUSE = Verdict(_alert("KVWatchSessionReuseLost"), REUSED_SESSIONS_RATIO, ROUTE, WATCHED_ROUTES)
ROUTE_WARM_ROUNDS = Verdict(_alert("KVWatchWarmRoundNoGain"), WARM_COLD_RATIO, ROUTE, WATCHED_ROUTES)
LISTENER_SPREAD = Verdict(_alert("KVWatchGatewaySessionsSpread"), GATEWAY_SPREAD, LISTENER, WATCHED_LISTENERS)
CLUSTER_HIT_RATIO_DROP = Verdict(
    _alert("KVWatchPrefixCacheHitRateDrop", scope="cluster"), CLUSTER_HIT_RATIO, ""
)
INSTANCE_HIT_RATIO_DROP = Verdict(
    _alert("KVWatchPrefixCacheHitRateDrop", scope="instance"), INSTANCE_HIT_RATIO, INSTANCE
)
LOAD_IMBALANCE = Verdict(_alert("KVWatchReplicaLoadImbalance"), CLUSTER_LOAD_IMBALANCE, "")
ROUTER_PREDICTION_MISS = Verdict(
    _alert("KVWatchRouterPredictionMiss"), INSTANCE_ROUTER_DELIVERED_PER_PREDICTED, INSTANCE
)
PROBES_DOMINATE = Verdict(_alert("KVWatchProbesDominate"), CLUSTER_PROBE_SHARE, "")
ROUTING_LOSS = Verdict(
    _alert("KVWatchReuseLostToRouting"), f'{INSTANCE_ROUTER_REUSE_LOSS}{{loss="routing"}}', INSTANCE
)
ENGINE_LOSS = Verdict(
    _alert("KVWatchReuseLostInEngine"), f'{INSTANCE_ROUTER_REUSE_LOSS}{{loss="engine"}}', INSTANCE
)
# A router's session table and its KV-event index: judged where it exports the table's rejections, its
# bindings (what the invalidation surge divides by) and the index's lag. The Cache & replicas page says
# them per router; the boards' row of them links each alert from its panel, not in the verdicts' row.
SESSION_TABLE_FULL = Verdict(
    _alert("KVWatchRouterSessionTableFull"), INSTANCE_ROUTER_SESSION_BIND_REJECTIONS, INSTANCE
)
SESSION_INVALIDATIONS = Verdict(
    _alert("KVWatchRouterSessionInvalidationSurge"), INSTANCE_ROUTER_SESSION_BINDINGS, INSTANCE
)
INDEX_STALLED = Verdict(_alert("KVWatchRouterIndexStalled"), INSTANCE_ROUTER_KV_EVENT_LAG, INSTANCE)
VERDICTS = (
    ROUTE_STICKY,
    ROUTE_REUSE,
    ROUTE_WARM_ROUNDS,
    LISTENER_SPREAD,
    CLUSTER_HIT_RATIO_DROP,
    INSTANCE_HIT_RATIO_DROP,
    LOAD_IMBALANCE,
    ROUTER_PREDICTION_MISS,
    PROBES_DOMINATE,
    ROUTING_LOSS,
    ENGINE_LOSS,
)


def clears_at(keep_firing_since: float, keep_firing_for: float, interval: float) -> float:
    """When Prometheus resolves an alert that its keep_firing_for holds: at the first evaluation of its
    group (every `interval` seconds from `keep_firing_since`, the evaluation that first found the
    expression empty) at least `keep_firing_for` seconds later. Unix seconds."""
    return keep_firing_since + math.ceil(keep_firing_for / interval - 1e-9) * interval


def held(alert: dict, rule: dict) -> dict[str, float | None]:
    """For an alert of Prometheus' rules API: when its expression stopped matching (`stopped_at`), when
    its rule's keep_firing_for lets it clear (`clears_at`) and that keep_firing_for in seconds, as
    Prometheus loaded it; all None while the expression still matches."""
    if not alert.get("keepFiringSince"):
        return dict.fromkeys(("stopped_at", "clears_at", "keep_firing_for"))
    # RFC 3339 as Prometheus writes it; Python 3.11 reads its nanoseconds (to microseconds) and its zone
    stopped = datetime.fromisoformat(alert["keepFiringSince"]).timestamp()
    held_for = float(rule.get("keepFiringFor", 0))
    return {
        "stopped_at": stopped,
        "clears_at": clears_at(stopped, held_for, rule["interval"]),
        "keep_firing_for": held_for,
    }
