"""kvwatch's Grafana boards, built from the panel queries in prometheus/queries.py.

`python -m kvwatch.cli.generate` writes each board twice: grafana/dashboards/ for file provisioning (a
`datasource` variable and no `__inputs`, which provisioning never resolves) and grafana/import/ for the
UI's Import, whose `__inputs` make Grafana ask for a Prometheus data source and start on it. Output is
deterministic: uids hash the file name, panel ids count up in layout order.

`python -m kvwatch.grafana.boards --prometheus URL` draws the overview from a live Prometheus with
matplotlib,
panel by panel where Grafana lays it out, for the README (Grafana itself is not needed).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvwatch.core.promapi import PrometheusApi
from kvwatch.prometheus import promql, queries
from kvwatch.prometheus.queries import THRESHOLDS

JSON = dict[str, Any]
DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
IMPORT_INPUT = "DS_PROMETHEUS"
GRID_WIDTH = 24
TAG = "kvwatch"
SCHEMA_VERSION = 39
MIN_GRAFANA = "10.4.0"  # schemaVersion 39
# A probe runs every interval_seconds (60 s by default): a narrower rate window often holds no run.
PROBE_MIN_INTERVAL = "2m"
PROMETHEUS_TIMEOUT_S = 30.0  # per query of the README picture, the whole answer included
RUNBOOKS = {alert.name: alert.runbook_url for alert in queries.ALERTS}
FIXED_WINDOW = (
    f"\n\nRead from a recording rule with a fixed {queries.WINDOW} rate window, so the time range does not "
    "change it."
)
ROUTE_LEGEND = "{{target}} ({{route_mode}})"

NO_ENGINE_DATA = "No engine traffic, or no cache metrics"
NO_PROBE_DATA = "No probe run in this window"
NO_GATEWAY_DATA = "No gateway requests"
NO_ROUTER_DATA = "No router exports what it predicted"


# --- panels ---------------------------------------------------------------------------------------


def target(expr: str, legend: str = "__auto", *, instant: bool = False, fmt: str = "time_series") -> JSON:
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
    }


def runbook_link(alert: str) -> JSON:
    return {"targetBlank": True, "title": f"Runbook: {alert}", "url": RUNBOOKS[alert]}


def drilldown_link(variable: str) -> JSON:
    """A data link to the drill-down board for the series' `variable` label, keeping time and source."""
    url = (
        f"/d/{uid(DRILLDOWN)}?var-{variable}=${{__field.labels.{variable}}}"
        f"&${{datasource:queryparam}}&${{{queries.CLUSTER_VARIABLE}:queryparam}}&${{__url_time_range}}"
    )
    return {"targetBlank": False, "title": f"Drill down into ${{__field.labels.{variable}}}", "url": url}


def _panel(
    kind: str,
    title: str,
    description: str,
    targets: list[JSON],
    *,
    unit: str,
    no_value: str,
    alert: str | None = None,
    interval: str | None = None,
    drilldown: str | None = None,
) -> JSON:
    """What every panel has: the data source variable, a unit, a text for no data (never a silent 0),
    a runbook link when an alert watches the same signal, and a data link to the drill-down board."""
    defaults: JSON = {"noValue": no_value, "unit": unit}
    if drilldown:
        defaults["links"] = [drilldown_link(drilldown)]
    panel = {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "links": [runbook_link(alert)] if alert else [],
        "targets": [t | {"refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
        "title": title,
        "type": kind,
    }
    if interval:
        panel["interval"] = interval
    return panel


def timeseries(
    title: str, description: str, targets: list[JSON], *, max_value: float | None = None, **options: Any
) -> JSON:
    """Lines from 0, up to `max_value` when given."""
    panel = _panel("timeseries", title, description, targets, **options)
    defaults = panel["fieldConfig"]["defaults"]
    defaults["custom"] = {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never", "spanNulls": False}
    defaults["min"] = 0
    if max_value is not None:
        defaults["max"] = max_value
    panel["options"] = {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel


def stat(
    title: str, description: str, targets: list[JSON], *, steps: list[tuple[str, float | None]], **options
) -> JSON:
    """The latest value of each series with its trend as a sparkline, coloured by `steps` of (colour,
    from value)."""
    panel = _panel("stat", title, description, targets, **options)
    panel["fieldConfig"]["defaults"] |= {
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]},
    }
    panel["options"] = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    }
    return panel


VERDICT_WORDS = {
    queries.OK: ("OK", "green"),
    queries.PENDING: ("pending", "orange"),
    queries.FIRING: ("firing", "red"),
}


def verdict_stat(title: str, what: str, verdict: queries.Verdict, legend: str) -> JSON:
    """What an alert says now of each route, listener or instance it watches (or of the cluster), from
    its own expression: a coloured OK, pending or firing."""
    alert = verdict.alert
    held = (
        f"Pending: its condition holds, and it fires once that lasts {alert.for_}"
        if alert.for_ != "0m"
        else "It fires in the evaluation its condition holds"
    )
    reads_a_rule = any(rule.record in verdict.state for rule in queries.WINDOWED_RULES)
    panel = stat(
        title,
        f"{what}: the state of {alert.name}, computed from the alert's own expression, windows and "
        "thresholds (prometheus/queries.py), so that it is red exactly when the alert fires. The board's "
        "filters do not apply; what the alert does not watch is not shown.\n\n"
        f"Good: OK. Bad: firing. {alert.summary} {held}." + (FIXED_WINDOW if reads_a_rule else ""),
        [target(verdict.state, legend)],
        steps=[("green", None), ("orange", queries.PENDING), ("red", queries.FIRING)],
        unit="none",
        no_value="Nothing to judge",
        alert=alert.name,
    )
    panel["fieldConfig"]["defaults"]["mappings"] = [
        {
            "type": "value",
            "options": {
                str(state): {"color": color, "index": state, "text": text}
                for state, (text, color) in VERDICT_WORDS.items()
            },
        }
    ]
    panel["options"] |= {"colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}
    return panel


def rounds_barchart(title: str, description: str, expr: str, **options: Any) -> JSON:
    """Bars per round (x axis) and route mode, from an instant query by (round, route_mode).

    Rounds are sorted as numbers before the table is pivoted, so round 10 follows round 9."""
    panel = _panel("barchart", title, description, [target(expr, instant=True, fmt="table")], **options)
    panel["transformations"] = [
        {
            "id": "convertFieldType",
            "options": {"conversions": [{"destinationType": "number", "targetField": "round"}], "fields": {}},
        },
        {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "round"}]}},
        {
            "id": "groupingToMatrix",
            "options": {
                "columnField": "route_mode",
                "emptyValue": "null",
                "rowField": "round",
                "valueField": "Value",
            },
        },
        {"id": "organize", "options": {"renameByName": {"round\\route_mode": "round"}}},
    ]
    panel["options"] = {
        "barWidth": 0.9,
        "groupWidth": 0.7,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "orientation": "vertical",
        "showValue": "never",
        "stacking": "none",
        "tooltip": {"mode": "multi", "sort": "none"},
        "xTickLabelRotation": 0,
    }
    return panel


def heatmap(title: str, description: str, expr: str, **options: Any) -> JSON:
    """A Prometheus histogram's bucket rates over time: `format: heatmap` de-accumulates the `le` buckets."""
    panel = _panel(
        "heatmap", title, description, [target(expr, "{{le}}", fmt="heatmap")], unit="s", **options
    )
    panel["options"] = {
        "calculate": False,
        "cellGap": 1,
        "color": {"exponent": 0.5, "mode": "scheme", "scale": "exponential", "scheme": "Blues", "steps": 64},
        "filterValues": {"le": 1e-9},
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "tooltip": {"mode": "single", "yHistogram": True},
        "yAxis": {"axisPlacement": "left", "unit": "s"},
    }
    return panel


def state_timeline(title: str, description: str, targets: list[JSON], **options: Any) -> JSON:
    """When each series had a value (a firing alert), as red bars."""
    panel = _panel("state-timeline", title, description, targets, **options)
    panel["fieldConfig"]["defaults"]["color"] = {"fixedColor": "red", "mode": "fixed"}
    panel["options"] = {
        "alignValue": "left",
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "mergeValues": True,
        "rowHeight": 0.8,
        "showValue": "never",
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return panel


# Panels on both boards.


def hit_ratio_by_instance() -> JSON:
    return timeseries(
        "Hit ratio per instance (cached / prompt tokens)",
        "Each instance's prompt tokens served from cached KV (its prefix cache, host memory, disk or "
        "another instance) over all its prompt tokens, token-weighted, vLLM and SGLang alike, with the "
        "cluster's for reference: the ratio the hit-rate alert judges. A replica with prefix caching off "
        "is at 0 %.\n\n"
        "Good: instances close to each other and steady. Bad: all falling together (sessions no longer "
        "reach the replica holding their history, or a timestamp leads the prompt), or one instance far "
        "below the rest (prefix caching off there, or just restarted)." + FIXED_WINDOW,
        [target(queries.HIT_RATIO_BY_INSTANCE, "{{instance}}"), target(queries.CLUSTER_HIT_RATIO, "cluster")],
        unit="percentunit",
        max_value=1,
        no_value=NO_ENGINE_DATA,
        alert="KVWatchPrefixCacheHitRateDrop",
        drilldown="instance",
    )


def local_hit_ratio_by_instance() -> JSON:
    return timeseries(
        "Local lookup ratio per instance (hits / lookups)",
        "The second figure beside the hit ratio: tokens found over tokens looked up in each engine's own "
        "prefix cache. vLLM stops looking up when caching is off, so such a replica drops out of this "
        "ratio instead of counting as 0 %; KV from host, disk or another instance is not in it.\n\n"
        "Good: close to the hit ratio. Bad: far above it (reuse comes from elsewhere, or a replica "
        "with caching off dropped out), or falling with it." + FIXED_WINDOW,
        [
            target(queries.LOCAL_HIT_RATIO_BY_INSTANCE, "{{instance}}"),
            target(queries.CLUSTER_LOCAL_HIT_RATIO, "cluster"),
        ],
        unit="percentunit",
        max_value=1,
        no_value=NO_ENGINE_DATA,
        drilldown="instance",
    )


def cached_share_by_source() -> JSON:
    return timeseries(
        "Cached prompt tokens by source",
        "Each source's share of an instance's prompt tokens, as its engine names it (vLLM: device, host, "
        "disk, p2p, external; SGLang: device, host, storage): the hit ratio, split. Decode pods fed by KV "
        "transfer and offloaded KV show here instead of as misses.\n\n"
        "Good: the sources you deployed, steady. Bad: a source falling to 0 (an offload tier or the KV "
        "transfer stopped), or only the device where you expected more." + FIXED_WINDOW,
        [target(queries.CACHED_SHARE_BY_SOURCE, "{{instance}} {{source}}")],
        unit="percentunit",
        max_value=1,
        no_value="No engine exports where its cached tokens came from",
        drilldown="instance",
    )


def request_share_by_instance() -> JSON:
    return timeseries(
        "Request share per instance",
        "Each instance's share of the finished requests. Consistent hashing on the session id trades "
        "balance for cache reuse.\n\n"
        "Good: each near 1/N of N instances. Bad: one instance far above the rest (a hot session key, or "
        "replicas missing from the hash ring) or one at 0 (out of rotation)." + FIXED_WINDOW,
        [target(queries.REQUEST_SHARE_BY_INSTANCE, "{{instance}}")],
        unit="percentunit",
        max_value=1,
        no_value=NO_ENGINE_DATA,
        drilldown="instance",
    )


# --- boards ---------------------------------------------------------------------------------------


class Layout:
    """Places panels left to right on Grafana's 24-column grid, under row headers, with ids in order."""

    def __init__(self) -> None:
        self.panels: list[JSON] = []
        self._x = self._y = self._line_height = 0

    def _add(self, panel: JSON, w: int, h: int) -> None:
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)

    def _newline(self) -> None:
        self._x, self._y, self._line_height = 0, self._y + self._line_height, 0

    def row(self, title: str) -> None:
        self._newline()
        self._add({"collapsed": False, "panels": [], "title": title, "type": "row"}, GRID_WIDTH, 1)
        self._y += 1

    def add(self, panel: JSON, w: int, h: int = 8) -> None:
        if self._x + w > GRID_WIDTH:
            self._newline()
        self._add(panel, w, h)
        self._x += w
        self._line_height = max(self._line_height, h)


def datasource_variable() -> JSON:
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "type": "datasource",
    }


def label_variable(name: str, label: str, series: str, *, many: bool = True) -> JSON:
    """A variable listing a label's values on `series`; `many` allows several and All. All is `.+`, not
    `.*`: "any value" still needs the label, so a series without it never slips into a filtered panel."""
    query = f"label_values({series}, {name})"
    variable = {
        "current": {},
        "datasource": DATASOURCE,
        "definition": query,
        "hide": 0,
        "includeAll": many,
        "label": label,
        "multi": many,
        "name": name,
        "options": [],
        "query": query,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "type": "query",
    }
    if many:
        variable |= {
            "allValue": queries.ALL_VALUES,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }
    return variable


def cluster_variable(cluster_label: str) -> JSON:
    """The clusters, as the values of `cluster_label`; All is `.*`, so that it matches series without
    the label too and a Prometheus of one cluster, without the label, shows everything as before."""
    variable = label_variable(cluster_label, "Cluster", queries.CLUSTERS_SERIES)
    variable |= {"allValue": queries.ALL_CLUSTERS, "name": queries.CLUSTER_VARIABLE}
    return variable


def as_board_runs(expr: str, cluster_label: str, *, per_cluster: bool = True) -> str:
    """A query of prometheus/queries.py as a board runs it: narrowed to the picked clusters and, unless a
    table or heatmap sums them, one series per cluster, never a sum or join across clusters."""
    narrowed = promql.with_matcher(expr, queries.cluster_matcher(cluster_label))
    return promql.keeping(narrowed, cluster_label) if per_cluster else narrowed


def cluster_legend(legend: str, cluster_label: str) -> str:
    """The legend led by the series' cluster, so that All tells two clusters' lines apart. Grafana shows
    a label a series lacks as its name: a Prometheus of one cluster, without the label, reads "cluster"
    alone for the cluster's line and "cluster / ..." before the others."""
    cluster = f"{{{{{cluster_label}}}}}"
    return cluster if legend == "cluster" else f"{cluster} / {legend}"


def in_clusters(board: JSON, cluster_label: str) -> JSON:
    """The board with a Cluster variable after the data source, every panel query, variable query and
    annotation matching its clusters, and every time series and stat one series per cluster, named by
    its legend: one pass over the finished board, so that no panel can miss it. A heatmap's buckets and
    a table's rows (the per-round bars) are over the picked clusters: pick one to read one."""
    matcher = queries.cluster_matcher(cluster_label)
    for query in (t for panel in board["panels"] for t in panel.get("targets", [])):
        per_cluster = query["format"] == "time_series"
        query["expr"] = as_board_runs(query["expr"], cluster_label, per_cluster=per_cluster)
        if per_cluster and query["legendFormat"] != "__auto":  # Grafana's auto legend lists every label
            query["legendFormat"] = cluster_legend(query["legendFormat"], cluster_label)
    for annotation in board["annotations"]["list"]:
        if "expr" in annotation:
            annotation["expr"] = promql.with_matcher(annotation["expr"], matcher)
    listed = board["templating"]["list"]
    for variable in listed:
        if variable["type"] == "query":
            series, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]).groups()
            query = f"label_values({promql.with_matcher(series, matcher)}, {label})"
            variable |= {"definition": query, "query": query}
    listed.insert(1, cluster_variable(cluster_label))
    return board


def variables(*, many_targets: bool) -> list[JSON]:
    """Data source, then engines by job and instance (from the recorded cache series), then probe targets.
    Jobs and instances are always several (so instances can be set side by side) with All, as Grafana's
    dashboard-linter asks; a probe target is one where its rounds' medians must not mix routes."""
    engines = queries.INSTANCE_CACHE_SERIES
    return [
        datasource_variable(),
        label_variable("job", "Engine job", engines),
        label_variable("instance", "Instance", f'{engines}{{job=~"$job"}}'),
        label_variable("target", "Probe target", "kvwatch_probe_sessions_total", many=many_targets),
    ]


def uid(file_name: str) -> str:
    return hashlib.sha256(file_name.encode()).hexdigest()[:32]


def dashboard(
    file_name: str, title: str, description: str, layout: Layout, *, many_targets: bool, cluster_label: str
) -> JSON:
    board = {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "datasource": DATASOURCE,
                    "enable": True,
                    "expr": queries.FIRING_ALERTS_BY_NAME,
                    "iconColor": "red",
                    "name": "kvwatch alerts",
                    "step": "15s",
                    "tagKeys": "severity",
                    "titleFormat": "{{alertname}} firing",
                },
            ]
        },
        "description": description,
        # Generated: change grafana/boards.py and regenerate rather than edit the board.
        "editable": False,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "tags": [TAG],
                "title": "kvwatch boards",
                "type": "dashboards",
            },
            {"targetBlank": True, "title": "kvwatch runbook", "type": "link", "url": queries.RUNBOOK_URL},
        ],
        "panels": layout.panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": [TAG],
        "templating": {"list": variables(many_targets=many_targets)},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid(file_name),
        "version": 1,
        "weekStart": "",
    }
    return in_clusters(board, cluster_label)


VERDICT_PANELS = (
    ("Session affinity (probes)", "Whether probe sessions through each sticky route stay on one replica",
     queries.ROUTE_STICKY, "{{target}}"),
    ("Real sessions (gateway logs)", "Whether real sessions through each sticky gateway listener stay on "
     "one replica", queries.LISTENER_SPREAD, "{{log}} / {{listener}}"),
    ("Warm rounds (probes)", "Whether warm rounds through each sticky route are faster than round 1",
     queries.ROUTE_WARM_ROUNDS, "{{target}}"),
    ("Cluster hit ratio drop", "Whether the cluster's hit ratio dropped", queries.CLUSTER_HIT_RATIO_DROP,
     "cluster"),
    ("Instance hit ratio drop", "Whether an instance's hit ratio dropped", queries.INSTANCE_HIT_RATIO_DROP,
     "{{instance}}"),
    ("Load balance", "Whether requests are spread evenly over the replicas", queries.LOAD_IMBALANCE,
     "cluster"),
    ("Router predictions", "Whether the engines deliver the prefix reuse each router predicts",
     queries.ROUTER_PREDICTION_MISS, "{{job}} / {{instance}}"),
)  # fmt: skip


def router_row(layout: Layout) -> None:
    """What the routers predicted they would reuse, against what the engines delivered."""
    miss = queries.ROUTER_PREDICTION_MISS.alert.name
    layout.row("Router: predicted vs delivered")
    layout.add(
        timeseries(
            "Predicted by the router, delivered by the engines",
            "What each router predicted it would find cached when it chose a replica (the mean of its "
            "per-request predicted hit ratios), beside what the engines delivered: each instance's and "
            "the cluster's prompt tokens served from cached KV. llm-d's EPP exports its prefix indexer's "
            "prediction (llm_d_epp_prefix_indexer_hit_ratio, and the deprecated inference_extension_ "
            "name), Dynamo's KV router dynamo_component_router_kv_hit_rate (KV mode only), SMG's "
            "cache_aware policy smg_cache_aware_match_ratio. vllm-router, sglang-router 0.2 and AIBrix "
            "count their decisions by outcome rather than as a share of the prompt (Prefix-matched "
            "decisions), and SMG's manual policy its sticky decisions (Sticky decisions kept): they "
            "draw no line here. A router is named by its scrape job and instance; the job and "
            "instance filters apply to the engines only.\n\n"
            "Good: the delivered lines near the router's. Bad: the router's line high while the engines' "
            "stay low: it sends requests where its index believes their prefix cached, and the engines "
            "compute it all again (the index drifted from the engines' caches, or caching is off on a "
            "replica)." + FIXED_WINDOW,
            [
                target(queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO, "predicted by {{job}} / {{instance}}"),
                target(queries.HIT_RATIO_BY_INSTANCE, "delivered by {{instance}}"),
                target(queries.CLUSTER_HIT_RATIO, "delivered by all instances"),
            ],
            unit="percentunit",
            max_value=1,
            no_value=NO_ROUTER_DATA,
            alert=miss,
        ),
        10,
    )
    layout.add(
        timeseries(
            "Delivered per predicted",
            "The cluster's delivered hit ratio over each router's predicted one: what "
            f"{miss} judges (it fires below {THRESHOLDS.delivered_per_predicted_below:.0%} while the router "
            f"predicts above {THRESHOLDS.router_predicted_above:.0%}, for "
            f"{queries.ROUTER_PREDICTION_MISS.alert.for_}). Only llm-d's EPP, Dynamo's KV router and SMG's "
            "cache_aware policy predict a hit ratio to compare.\n\n"
            "Good: near 100 %: the prediction holds; above it, the engines reuse more than the router "
            "expected (KV from host memory, disk or another instance). Bad: near 0 %: the router's index "
            "says hit while the engines prefill everything." + FIXED_WINDOW,
            [target(queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED, "{{job}} / {{instance}}")],
            unit="percentunit",
            no_value=NO_ROUTER_DATA,
            alert=miss,
        ),
        7,
    )
    layout.add(
        timeseries(
            "Sticky decisions kept (SMG)",
            "SMG's manual (routing-key) policy: of the requests whose routing key was already pinned to a "
            'worker, the share that reached it (smg_manual_policy_branch_total{branch="occupied_hit"}) '
            "rather than another (occupied_miss: the pinned worker was gone or overloaded). The router's "
            "own stickiness, beside the probes' (Sticky probe sessions); kvwatch reads it from SMG "
            "only.\n\n"
            "Good: near 100 %. Bad: falling: routing keys respill to other workers, and their sessions' "
            "history is prefilled again." + FIXED_WINDOW,
            [target(queries.INSTANCE_ROUTER_PIN_KEPT, "{{job}} / {{instance}}")],
            unit="percentunit",
            max_value=1,
            no_value="No SMG router with the manual policy",
        ),
        7,
    )
    layout.add(
        timeseries(
            "Prefix-matched decisions",
            "Cache-aware routers: the share of their routing decisions that went where their own index "
            "matched a cached prefix, as each counts them: SMG's cache_aware policy "
            '(smg_cache_aware_policy_branch_total{branch="tree_match"}, not spill or a fallback), '
            'vllm-router (vllm_router_prefix_routing_decisions_total{outcome="prefix_hit"}, else its '
            "cache_hits_total / cache_misses_total, as sglang-router 0.2's sgl_router_ ones), AIBrix "
            '(aibrix_prefix_cache_routing_decisions_total{match_percent_bucket!="0"}). The router\'s '
            "guess from its index, not an engine hit: compare it with the engines' delivered hit ratio "
            "(Predicted by the router, delivered by the engines).\n\n"
            "Good: steady and high on multi-turn traffic. Bad: falling while the traffic is unchanged "
            "(the index lost its prefixes: a router restart, workers replaced), or high while the engines "
            "deliver little (the index drifted from the engines' caches)." + FIXED_WINDOW,
            [target(queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS, "{{job}} / {{instance}}")],
            unit="percentunit",
            max_value=1,
            no_value="No cache-aware router counting its prefix matches",
        ),
        GRID_WIDTH,
    )


def overview(cluster_label: str = queries.CLUSTER_LABEL) -> JSON:
    layout = Layout()
    layout.row("What the alerts say")
    count = len(VERDICT_PANELS)
    for i, (title, what, verdict, legend) in enumerate(VERDICT_PANELS):
        width = GRID_WIDTH * (i + 1) // count - GRID_WIDTH * i // count  # one line, the whole width
        layout.add(verdict_stat(title, what, verdict, legend), width, 4)
    layout.row("Is the KV cache reused?")
    layout.add(
        stat(
            "Cluster hit ratio",
            "Delivered: prompt tokens served from cached KV (the prefix caches, host memory, disk or another "
            "instance) over all prompt tokens, token-weighted across the whole fleet, a replica with caching "
            "off counted as 0 % (the job and instance filters do not apply). Beside it, labelled, the local "
            "lookup ratio: tokens found over tokens looked up in the engines' own prefix caches.\n\n"
            "Good: steady, and high for multi-turn chat (the lab holds about 80 % with affinity). Bad: a "
            "drop when the gateway changed: sessions no longer land where their history is cached. Whether "
            "the alert says so is in Cluster hit ratio drop, under What the alerts say." + FIXED_WINDOW,
            [
                target(queries.CLUSTER_HIT_RATIO, "delivered (cached / prompt tokens)"),
                target(queries.CLUSTER_LOCAL_HIT_RATIO, "local lookups (hits / lookups)"),
            ],
            steps=[("blue", None)],
            unit="percentunit",
            no_value=NO_ENGINE_DATA,
            alert="KVWatchPrefixCacheHitRateDrop",
        ),
        5,
    )
    layout.add(hit_ratio_by_instance(), 9)
    layout.add(
        rounds_barchart(
            "Probe TTFT per round: affinity vs round robin",
            "Median client-side time to first token of the probe's sessions, per round (x axis) and route "
            "mode, over the whole time range: the source article's A/B chart.\n\n"
            "Good: the affinity bars stay flat from round 2 on while round robin's grow with the history. "
            "Bad: the affinity bars climb like round robin's: rounds 2+ pay a full prefill again. Medians "
            "are interpolated within the probe's TTFT histogram buckets.",
            queries.PROBE_TTFT_BY_ROUND,
            unit="s",
            no_value=NO_PROBE_DATA,
            alert="KVWatchWarmRoundNoGain",
        ),
        10,
    )

    layout.add(local_hit_ratio_by_instance(), 12)
    layout.add(cached_share_by_source(), 12)

    layout.row("Are sessions pinned?")
    layout.add(
        timeseries(
            "Sticky probe sessions",
            "Share of probe sessions whose rounds all landed on one replica (sessions without evidence "
            "either way are left out), over the rate window: a trend over more runs than the alert's, "
            "which judges the last run (see Session affinity under What the alerts say).\n\n"
            "Good: 100 % on a sticky route. Bad: below 100 % there: the gateway lost the session "
            "pinning (round robin back, session header dropped, hash key not the session id). A "
            "round-robin route sits near 0 %.",
            [target(queries.PROBE_STICKY_SHARE, ROUTE_LEGEND)],
            unit="percentunit",
            max_value=1,
            no_value=NO_PROBE_DATA,
            alert="KVWatchSessionAffinityBroken",
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
        ),
        6,
    )
    layout.add(
        timeseries(
            "Real sessions on several replicas (gateway logs)",
            "Of the real sessions that came back to a gateway listener within its log's spread window "
            "(spread_window_seconds, 10 minutes by default), the share served by more than one replica: "
            "failover=false with nothing to explain the move (what KVWatchGatewaySessionsSpread judges), "
            "failover=true moved by a failed replica, kept apart.\n\n"
            "Good: near 0 % without a failover on a sticky listener. Bad: rising there: the gateway no "
            "longer pins real users' sessions, whatever the probes see. A round-robin listener sits high.",
            [target(queries.REAL_SESSIONS_SPREAD, "{{log}} / {{listener}}, failover={{failover}}")],
            unit="percentunit",
            max_value=1,
            no_value=NO_GATEWAY_DATA,
            alert="KVWatchGatewaySessionsSpread",
        ),
        6,
    )
    layout.add(
        timeseries(
            "Backend switches per probe session",
            "How often consecutive rounds of a probe session changed replica.\n\n"
            "Good: 0 on a sticky route. Bad: above 0 there, up to rounds - 1 when every round lands "
            "elsewhere, as on a round-robin route.",
            [target(queries.PROBE_BACKEND_SWITCHES_PER_SESSION, ROUTE_LEGEND)],
            unit="short",
            no_value=NO_PROBE_DATA,
            alert="KVWatchSessionAffinityBroken",
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
        ),
        6,
    )
    layout.add(
        timeseries(
            "Warm / cold TTFT ratio",
            "Median TTFT of rounds 2+ over round 1's, per probe route, in each run: the gauge the alert "
            "judges.\n\n"
            "Good: well below 100 % on a sticky route: warm rounds reuse their history (the alert fires "
            f"above {THRESHOLDS.warm_cold_ratio_above:.0%} for {queries.ROUTE_WARM_ROUNDS.alert.for_}). Bad: "
            "near or above 100 %: every round prefills the whole conversation, as on the round-robin route.",
            [target(queries.WARM_COLD_TTFT_RATIO, ROUTE_LEGEND)],
            unit="percentunit",
            no_value=NO_PROBE_DATA,
            alert="KVWatchWarmRoundNoGain",
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
        ),
        6,
    )

    layout.row("Reuse and session keys")
    layout.add(
        timeseries(
            "Affinity efficiency (cached / ideal tokens)",
            "Prompt tokens the engine reported cached in rounds 2+, over what a perfectly pinned replica "
            "would have cached (the previous round's prompt and answer, block-aligned).\n\n"
            "Good: near 100 % on an affinity route. Bad: falling towards the shared system prompt's share "
            "of the prompt: the history is recomputed on another replica; falling on every route: the KV "
            "cache evicts too early, or prefix caching is off.",
            [target(queries.AFFINITY_EFFICIENCY, ROUTE_LEGEND)],
            unit="percentunit",
            no_value=NO_PROBE_DATA,
            alert="KVWatchSessionAffinityBroken",
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
        ),
        8,
    )
    layout.add(
        timeseries(
            "Session-key health",
            "Gateway: share of requests that arrived without a session key, so the gateway assigned one. "
            "Probe: share of probe sessions whose session id did not come back.\n\n"
            "Good: at the gateway, about one request per conversation (1 / rounds) when clients follow the "
            "protocol, 0 when they make their own ids; for the probe, 0. Bad: requests without a key "
            "nearing 100 % (clients do not send the id back), or a probe id not echoed (the gateway drops "
            "or replaces it).",
            [
                target(queries.REQUESTS_WITHOUT_SESSION_KEY_SHARE, "gateway {{log}} / {{listener}}: no key"),
                target(queries.SESSION_ID_NOT_ECHOED_SHARE, "probe {{target}}: id not echoed"),
            ],
            unit="percentunit",
            max_value=1,
            no_value=NO_GATEWAY_DATA,
            alert="KVWatchSessionIdNotPropagated",
            interval=PROBE_MIN_INTERVAL,
        ),
        8,
    )
    layout.add(request_share_by_instance(), 8)

    router_row(layout)

    layout.row("Load, probe errors and alerts")
    layout.add(
        timeseries(
            "Load imbalance (busiest / mean)",
            "Finished requests per second of the busiest instance over the mean of all instances.\n\n"
            "Good: close to 1 (1 is perfectly even). Bad: above "
            f"{THRESHOLDS.load_imbalance_above:g}, the alert's threshold: one replica takes the heat "
            "while others idle." + FIXED_WINDOW,
            [target(queries.CLUSTER_LOAD_IMBALANCE, "busiest / mean")],
            unit="short",
            no_value=NO_ENGINE_DATA,
            alert="KVWatchReplicaLoadImbalance",
        ),
        8,
    )
    layout.add(
        timeseries(
            "Probe errors by kind",
            "Failed probe rounds per second, by error kind. Every kind is exported from 0, so a flat 0 is "
            "a real zero.\n\n"
            "Good: 0. Bad: unauthorized or forbidden (the API key), not_found (model id or base URL), "
            "connection_refused, timeout, bad_response (an error object instead of choices), stream_error, "
            "http_error, tls_error, protocol_error (an answer that is no HTTP/1.1), internal_error (a bug).",
            [target(queries.PROBE_ERRORS_BY_KIND, "{{kind}}")],
            unit="reqps",
            no_value=NO_PROBE_DATA,
            alert="KVWatchProbeFailing",
            interval=PROBE_MIN_INTERVAL,
        ),
        8,
    )
    layout.add(
        state_timeline(
            "Firing kvwatch alerts",
            "kvwatch alerts firing in this Prometheus over time (the always-firing Watchdog left out).\n\n"
            "Good: empty. Bad: any bar: open the runbook at that alert.",
            [target(queries.FIRING_ALERTS_BY_NAME, "{{alertname}} ({{severity}})")],
            unit="short",
            no_value="No kvwatch alert firing",
        ),
        8,
    )

    layout.row("Engine TTFT")
    for engine, expr in queries.ENGINE_TTFT_BUCKET_RATES.items():
        layout.add(
            heatmap(
                f"Engine TTFT distribution ({engine})",
                f"Time to first token as the {engine} engines measure it: requests per second in each "
                "histogram bucket over time.\n\n"
                "Good: one tight band low down, at the cost of a cached prefill. Bad: a second band higher "
                "up (requests prefilling their whole history: cache misses) or the band creeping upwards "
                "(queueing).",
                expr,
                no_value=f"No {engine} engine among the selected instances",
            ),
            12,
        )
    return dashboard(
        OVERVIEW,
        "kvwatch: KV-cache session affinity",
        "Whether each conversation stays on the replica that holds its KV cache: hit ratios, per-round "
        "TTFT, probe stickiness, session keys and load.",
        layout,
        many_targets=True,
        cluster_label=cluster_label,
    )


def drilldown(cluster_label: str = queries.CLUSTER_LABEL) -> JSON:
    layout = Layout()
    layout.row("Probe target $target")
    layout.add(
        timeseries(
            "Probe TTFT per round over time",
            "Median TTFT of each round of the probe's sessions through this target: the per-round chart as "
            "lines over time, to see when a change began.\n\n"
            "Good: rounds 2+ at or below round 1. Bad: later rounds above round 1, the more so the later "
            "the round.",
            [target(queries.PROBE_TTFT_BY_ROUND_OVER_TIME, "round {{round}}")],
            unit="s",
            no_value=NO_PROBE_DATA,
            alert="KVWatchWarmRoundNoGain",
            interval=PROBE_MIN_INTERVAL,
        ),
        10,
    )
    layout.add(
        timeseries(
            "Probe rounds per backend",
            "Which replicas served the probe's rounds through this target.\n\n"
            "Good: the rounds spread over the replicas while each session keeps to one (see Sticky probe "
            "sessions). Bad: a replica missing (down, or out of the hash ring), or `other`: more backends "
            "than kvwatch tracks per route.",
            [target(queries.PROBE_ROUNDS_BY_BACKEND, "{{backend}}")],
            unit="reqps",
            no_value=NO_PROBE_DATA,
            interval=PROBE_MIN_INTERVAL,
        ),
        9,
    )
    layout.add(
        stat(
            "Since the last probe run",
            "Time since the probe's last run through this target finished.\n\n"
            "Good: under the probe interval (interval_seconds). Bad: several intervals: the scheduler is "
            "stuck or kvwatch serve is down, and the probe panels are stale.",
            [target(queries.PROBE_LAST_RUN_AGE)],
            steps=[("blue", None)],
            unit="s",
            no_value="The probe never ran for this target",
            alert="KVWatchProbeStale",
        ),
        5,
    )
    layout.row("Instances $instance")
    layout.add(hit_ratio_by_instance(), 8)
    layout.add(
        timeseries(
            "Engine TTFT quantiles",
            "Each instance's TTFT quantiles as its engine measures them (server side, without the "
            "gateway).\n\n"
            "Good: the median near the cost of a cached prefill. Bad: the median rising towards a full "
            "prefill (its requests miss the cache), or p99 far above the median (queueing)." + FIXED_WINDOW,
            [target(queries.TTFT_QUANTILES_BY_INSTANCE, "{{instance}} {{quantile}} quantile")],
            unit="s",
            no_value=NO_ENGINE_DATA,
        ),
        8,
    )
    layout.add(request_share_by_instance(), 8)
    layout.add(local_hit_ratio_by_instance(), 12)
    layout.add(cached_share_by_source(), 12)
    return dashboard(
        DRILLDOWN,
        "kvwatch: one probe target and chosen instances",
        "One probe route's rounds and backends, and the chosen engine instances' cache, TTFT and load.",
        layout,
        many_targets=False,
        cluster_label=cluster_label,
    )


OVERVIEW = "kvwatch-overview.json"
DRILLDOWN = "kvwatch-drilldown.json"
BOARDS = {OVERVIEW: overview, DRILLDOWN: drilldown}


def for_import(board: JSON) -> JSON:
    """The board for the UI's Import: Grafana asks for a Prometheus data source, writes its uid where
    `${DS_PROMETHEUS}` stands, and the `datasource` variable starts on it."""
    board = copy.deepcopy(board)
    (source,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    source["current"] = {"selected": True, "text": f"${{{IMPORT_INPUT}}}", "value": f"${{{IMPORT_INPUT}}}"}
    panel_types = sorted({p["type"] for p in board["panels"] if p["type"] != "row"})
    board["__inputs"] = [
        {
            "description": "The Prometheus that scrapes the engines and kvwatch",
            "label": "Prometheus",
            "name": IMPORT_INPUT,
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
            "type": "datasource",
        }
    ]
    board["__requires"] = [
        {"id": "grafana", "name": "Grafana", "type": "grafana", "version": MIN_GRAFANA},
        {"id": "prometheus", "name": "Prometheus", "type": "datasource", "version": "1.0.0"},
        *({"id": kind, "name": kind, "type": "panel", "version": ""} for kind in panel_types),
    ]
    return board


def _dump(board: JSON) -> str:
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def dashboard_files(cluster_label: str = queries.CLUSTER_LABEL) -> dict[str, str]:
    """Repository path -> text of every generated board, both variants, telling clusters apart by
    `cluster_label`."""
    files = {}
    for name, build in BOARDS.items():
        board = build(cluster_label)
        files[f"grafana/dashboards/{name}"] = _dump(board)
        files[f"grafana/import/{name}"] = _dump(for_import(board))
    return files


# --- a picture of the overview, for the README ----------------------------------------------------


def evaluate(
    prometheus: str, query: JSON, *, start: float, end: float, window: str
) -> list[tuple[dict, list]]:
    """A panel target's series from Prometheus, as (labels, [(seconds before `end`, value)])."""
    expr = queries.fill_variables(query["expr"], window=window, time_range=f"{round(end - start)}s")
    prometheus_api = PrometheusApi(prometheus, PROMETHEUS_TIMEOUT_S)
    if query["instant"]:
        series = prometheus_api.query(expr, at=end)
    else:
        series = prometheus_api.query_range(expr, start, end, step=max(1.0, (end - start) / 240))
    return [
        (s["metric"], [(float(t) - end, float(v)) for t, v in s.get("values", [s.get("value")])])
        for s in series
    ]


def _legend(template: str, labels: dict) -> str:
    """The legend as Grafana renders it: a label the series lacks reads as its name."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda match: labels.get(match[1]) or match[1], template)


def _format(unit: str, value: float) -> str:
    if unit == "percentunit":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
    return f"{value:.3g}/s" if unit == "reqps" else f"{value:.3g}"


def _draw_timeseries(axes, panel: JSON, results: list) -> None:
    for query, series in results:
        for labels, points in series:
            minutes, values = zip(*((t / 60, v) for t, v in points), strict=True)
            axes.plot(minutes, values, label=_legend(query["legendFormat"], labels), linewidth=1.2)
    defaults = panel["fieldConfig"]["defaults"]
    axes.set_ylim(bottom=0, top=defaults.get("max"))
    axes.legend(fontsize=7, loc="lower left", ncol=2)


def _draw_stat(axes, panel: JSON, results: list) -> None:
    """Each series' latest value, as the word the panel maps it to if it does; a lone one with its trend."""
    defaults = panel["fieldConfig"]["defaults"]
    words = {
        float(value): (shown["text"], shown["color"])
        for mapping in defaults.get("mappings", [])
        for value, shown in mapping["options"].items()
    }
    color = defaults["thresholds"]["steps"][0]["color"]
    shown = [(_legend(q["legendFormat"], labels), points) for q, found in results for labels, points in found]
    if len(shown) == 1:
        minutes, values = zip(*((t / 60, v) for t, v in shown[0][1]), strict=True)
        axes.fill_between(minutes, values, alpha=0.15, color=color)
        axes.set_ylim(0, max(values) * 1.5 or 1)
    for row, (name, points) in enumerate(shown):
        value = points[-1][1]
        text, tint = words.get(value, (_format(defaults["unit"], value), color))
        y = 1 - (row + 1) / (len(shown) + 1)
        label, size = (text, 36) if len(shown) == 1 else (f"{name}: {text}", 11)
        axes.text(0.5, y, label, transform=axes.transAxes, ha="center", va="center", size=size, color=tint)
    axes.set_yticks([])


def _draw_barchart(axes, panel: JSON, results: list) -> None:
    [(_, series)] = results
    modes = sorted({labels["route_mode"] for labels, _ in series})
    rounds = sorted({int(labels["round"]) for labels, _ in series})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        by_round = {
            int(labels["round"]): points[0][1] for labels, points in series if labels["route_mode"] == mode
        }
        values = [by_round.get(r, math.nan) for r in rounds]
        axes.bar([r + (i - (len(modes) - 1) / 2) * width for r in rounds], values, width, label=mode)
    axes.set_xticks(rounds)
    axes.set_xlabel("round")
    axes.legend(fontsize=8)


def _draw_heatmap(axes, panel: JSON, results: list) -> None:
    [(_, series)] = results
    buckets = sorted(series, key=lambda s: float(s[0]["le"]))
    times = sorted({t for _, points in buckets for t, _ in points})
    cumulative = [[dict(points).get(t, math.nan) for t in times] for _, points in buckets]
    per_bucket = [cumulative[0]] + [
        [upper - lower for upper, lower in zip(above, below, strict=True)]
        for above, below in zip(cumulative[1:], cumulative, strict=False)
    ]
    axes.pcolormesh([t / 60 for t in times], range(len(buckets)), per_bucket, cmap="Blues", shading="nearest")
    labels = [s[0]["le"] for s in buckets]
    step = max(1, len(labels) // 8)
    axes.set_yticks(range(0, len(labels), step), [f"≤ {le}" for le in labels[::step]], fontsize=7)


def _draw_state_timeline(axes, panel: JSON, results: list) -> None:
    [(query, series)] = results
    for row, (labels, points) in enumerate(series):
        minutes = [t / 60 for t, _ in points]
        step = min((b - a for a, b in zip(minutes, minutes[1:], strict=False)), default=0.1)
        axes.broken_barh([(m, step) for m in minutes], (row, 0.8), color="tab:red")
        axes.text(
            0.01, row + 0.4, _legend(query["legendFormat"], labels), transform=axes.get_yaxis_transform()
        )
    axes.set_ylim(0, len(series))
    axes.set_yticks([])


DRAW = {
    "timeseries": _draw_timeseries,
    "stat": _draw_stat,
    "barchart": _draw_barchart,
    "heatmap": _draw_heatmap,
    "state-timeline": _draw_state_timeline,
}


def _panel_axes(figure, pos: JSON, height: int):
    """Axes in a panel's cell of the grid (`height` rows), leaving room for its title and ticks."""
    width_in, height_in = figure.get_size_inches()
    left = pos["x"] / GRID_WIDTH + 0.6 / width_in
    right = (pos["x"] + pos["w"]) / GRID_WIDTH - 0.15 / width_in
    top = 1 - pos["y"] / height - 0.35 / height_in
    bottom = 1 - (pos["y"] + pos["h"]) / height + 0.5 / height_in
    return figure.add_axes((left, bottom, right - left, top - bottom))


def render(prometheus: str, out: Path, *, minutes: int, window: str) -> None:
    """Draw the overview's panels where Grafana places them, each from its own queries. `window` stands
    in for $__rate_interval, except on panels with a minimum interval, which use that."""
    import matplotlib  # only this picture needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import FuncFormatter

    board = overview()
    end = time.time()
    start = end - minutes * 60
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    figure = pyplot.figure(figsize=(24, height * 0.5))
    for panel in board["panels"]:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            figure.text(0.005, 1 - (pos["y"] + 0.6) / height, panel["title"], fontsize=14, weight="bold")
            continue
        axes = _panel_axes(figure, pos, height)
        axes.set_title(panel["title"], loc="left", fontsize=11)
        panel_window = panel.get("interval", window)
        results = [
            (q, evaluate(prometheus, q, start=start, end=end, window=panel_window)) for q in panel["targets"]
        ]
        if not any(series for _, series in results):
            axes.text(
                0.5, 0.5, panel["fieldConfig"]["defaults"]["noValue"], ha="center", transform=axes.transAxes
            )
            axes.set_xticks([])
            axes.set_yticks([])
            continue
        DRAW[panel["type"]](axes, panel, results)
        if panel["type"] in ("timeseries", "barchart"):
            unit = panel["fieldConfig"]["defaults"]["unit"]
            axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _, unit=unit: _format(unit, value)))
        if panel["type"] != "barchart":
            axes.set_xlim(-minutes, 0)
            axes.set_xlabel("minutes ago", fontsize=8)
    figure.suptitle(f"{board['title']}: the last {minutes} minutes", fontsize=16, y=1.02)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=60, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvwatch.grafana.boards",
        description="Draw the Grafana overview board from a live Prometheus, with matplotlib.",
    )
    parser.add_argument("--prometheus", required=True, help="e.g. the lab's http://127.0.0.1:18002")
    parser.add_argument("--out", type=Path, default=Path("docs/grafana-overview.png"))
    parser.add_argument("--minutes", type=int, default=15, help="time range (default %(default)s)")
    parser.add_argument(
        "--window", default="1m", help="what $__rate_interval stands for (default %(default)s)"
    )
    args = parser.parse_args(argv)
    render(args.prometheus.rstrip("/"), args.out, minutes=args.minutes, window=args.window)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
