"""The pieces kvwatch's Grafana boards are built of (grafana/boards.py): panels of every kind, each
reading one query of prometheus/panel_queries.py, the verdict stats, the grid layout, the variables, and the
board frame narrowed to the clusters picked."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kvwatch.alerts.alerts import ALERTS
from kvwatch.alerts.verdicts import (
    FIRING,
    NOT_WATCHING,
    OK,
    PENDING,
    Verdict,
)
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.prometheus import panel_queries, promql, queries
from kvwatch.prometheus.rules import WINDOWED_RULES

JSON = dict[str, Any]
DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
IMPORT_INPUT = "DS_PROMETHEUS"
OVERVIEW = "kvwatch-overview.json"  # the boards' file names
DRILLDOWN = "kvwatch-drilldown.json"
GRID_WIDTH = 24
TAG = "kvwatch"
SCHEMA_VERSION = 39
MIN_GRAFANA = "10.4.0"  # schemaVersion 39
# A probe runs every interval_seconds (60 s by default): a narrower rate window often holds no run.
PROBE_MIN_INTERVAL = "2m"
RUNBOOKS = {alert.name: alert.runbook_url for alert in ALERTS}
FIXED_WINDOW = (
    f"\n\nRead from a recording rule with a fixed {queries.WINDOW} rate window, so the time range does not "
    "change it."
)
ROUTE_LEGEND = "{{target}} ({{route_mode}})"
ROUTER_LEGEND = "{{job}} / {{instance}}"

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
        f"&${{datasource:queryparam}}&${{{panel_queries.CLUSTER_VARIABLE}:queryparam}}&${{__url_time_range}}"
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
    a runbook link when an alert watches the same signal, a data link to the drill-down board, and, when it
    reads a recording rule, that its window is fixed."""
    defaults: JSON = {"noValue": no_value, "unit": unit}
    if any(rule.record in t["expr"] for t in targets for rule in WINDOWED_RULES):
        description += FIXED_WINDOW
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


def share_timeseries(title: str, description: str, targets: list[JSON], **options: Any) -> JSON:
    """Shares and ratios, from 0 to 100 %."""
    return timeseries(title, description, targets, unit="percentunit", max_value=1, **options)


def probe_timeseries(title: str, description: str, targets: list[JSON], **options: Any) -> JSON:
    """A signal of the probe's runs, at the probe's pace: nothing to draw before a run in the window."""
    return timeseries(
        title, description, targets, no_value=NO_PROBE_DATA, interval=PROBE_MIN_INTERVAL, **options
    )


def probe_route_timeseries(title: str, description: str, expr: str, **options: Any) -> JSON:
    """A probe signal per route, linked to the target's drill-down board."""
    return probe_timeseries(title, description, [target(expr, ROUTE_LEGEND)], drilldown="target", **options)


def router_shares_timeseries(title: str, description: str, targets: list[JSON], **options: Any) -> JSON:
    """Shares of prompt tokens on a router panel, from 0 to 100 %: it says so where no router exports any."""
    return timeseries(
        title, description, targets, unit="percentunit", max_value=1, no_value=NO_ROUTER_DATA, **options
    )


def router_share_timeseries(title: str, description: str, expr: str, **options: Any) -> JSON:
    """A share each router counts, one line per router by its scrape job and instance."""
    return timeseries(title, description, [target(expr, ROUTER_LEGEND)], unit="percentunit", **options)


def instance_share_timeseries(
    title: str, description: str, targets: list[JSON], *, no_value: str = NO_ENGINE_DATA, **options: Any
) -> JSON:
    """Each engine instance's share, from 0 to 100 %, linked to the instance's drill-down board."""
    return timeseries(
        title,
        description,
        targets,
        unit="percentunit",
        max_value=1,
        no_value=no_value,
        drilldown="instance",
        **options,
    )


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
    OK: ("OK", "green"),
    PENDING: ("pending", "orange"),
    FIRING: ("firing", "red"),
}


def verdict_stat(title: str, what: str, verdict: Verdict, legend: str) -> JSON:
    """What an alert says now of each route, listener or instance it watches (or of the cluster), from
    its own expression: a coloured OK, pending or firing."""
    alert = verdict.alert
    held = (
        f"Pending: its condition holds, and it fires once that lasts {alert.for_}"
        if alert.for_ != "0m"
        else "It fires in the evaluation its condition holds"
    )
    panel = stat(
        title,
        f"{what}: the state of {alert.name}, computed from the alert's own expression, windows and "
        "thresholds (alerts/alerts.py, prometheus/thresholds.py), so that it is red exactly when the alert "
        "fires. The board's filters do not apply; what the alert does not watch is not shown.\n\n"
        f"Good: OK. Bad: firing. {alert.summary} {held}. {NOT_WATCHING} (gray): Prometheus holds no series "
        "the alert judges, so it can say neither.",
        [target(verdict.state, legend)],
        steps=[("green", None), ("orange", PENDING), ("red", FIRING)],
        unit="none",
        no_value=NOT_WATCHING,
        alert=alert.name,
    )
    panel["fieldConfig"]["defaults"]["mappings"] = [
        {
            "type": "value",
            "options": {
                str(state): {"color": color, "index": state, "text": text}
                for state, (text, color) in VERDICT_WORDS.items()
            },
        },
        # Without it Grafana colours a tile with no series by the first step: green, while blind.
        {"type": "special", "options": {"match": "null", "result": {"color": "gray", "text": NOT_WATCHING}}},
    ]
    panel["options"] |= {"colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}
    return panel


def rounds_barchart(
    title: str, description: str, expr: str, column: str = "route_mode", capped: bool = False, **options: Any
) -> JSON:
    """Bars per round (x axis) and `column` (a route mode, a gateway listener), from an instant query by
    (round, column).

    Rounds are sorted as numbers before the table is pivoted, so round 10 follows round 9; `capped`
    rounds (1 to 7 and "8+", rounds.ROUNDS) sort as they are, which a number would lose the "+" of."""
    panel = _panel("barchart", title, description, [target(expr, instant=True, fmt="table")], **options)
    as_numbers = {
        "id": "convertFieldType",
        "options": {"conversions": [{"destinationType": "number", "targetField": "round"}], "fields": {}},
    }
    panel["transformations"] = [
        *([] if capped else [as_numbers]),
        {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "round"}]}},
        {
            "id": "groupingToMatrix",
            "options": {
                "columnField": column,
                "emptyValue": "null",
                "rowField": "round",
                "valueField": "Value",
            },
        },
        {"id": "organize", "options": {"renameByName": {f"round\\{column}": "round"}}},
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


def with_cluster(by_instance: str, cluster: str) -> list[JSON]:
    """A ratio's series per instance, and the cluster's beside them for reference."""
    return [target(by_instance, "{{instance}}"), target(cluster, "cluster")]


def hit_ratio_by_instance() -> JSON:
    return instance_share_timeseries(
        "Hit ratio per instance (cached / prompt tokens)",
        "Each instance's prompt tokens served from cached KV (its prefix cache, host memory, disk or "
        "another instance) over all its prompt tokens, token-weighted, vLLM and SGLang alike, with the "
        "cluster's for reference: the ratio the hit-rate alert judges. A replica with prefix caching off "
        "is at 0 %.\n\n"
        "Good: instances close to each other and steady. Bad: all falling together (sessions no longer "
        "reach the replica holding their history, or a timestamp leads the prompt), or one instance far "
        "below the rest (prefix caching off there, or just restarted).",
        with_cluster(panel_queries.HIT_RATIO_BY_INSTANCE, queries.CLUSTER_HIT_RATIO),
        alert="KVWatchPrefixCacheHitRateDrop",
    )


def local_hit_ratio_by_instance() -> JSON:
    return instance_share_timeseries(
        "Local lookup ratio per instance (hits / lookups)",
        "The second figure beside the hit ratio: tokens found over tokens looked up in each engine's own "
        "prefix cache. vLLM stops looking up when caching is off, so such a replica drops out of this "
        "ratio instead of counting as 0 %; KV from host, disk or another instance is not in it.\n\n"
        "Good: close to the hit ratio. Bad: far above it (reuse comes from elsewhere, or a replica "
        "with caching off dropped out), or falling with it.",
        with_cluster(panel_queries.LOCAL_HIT_RATIO_BY_INSTANCE, queries.CLUSTER_LOCAL_HIT_RATIO),
    )


def cached_share_by_source() -> JSON:
    return instance_share_timeseries(
        "Cached prompt tokens by source",
        "Each source's share of an instance's prompt tokens, as its engine names it (vLLM: device, host, "
        "disk, p2p, external; SGLang: device, host, storage): the hit ratio, split. Decode pods fed by KV "
        "transfer and offloaded KV show here instead of as misses. Beside them, LMCache's multi-process "
        "server's tiers: of the tokens asked of it, the share it found in L1 (its CPU memory) and in L2 "
        "(disk or a remote store), lmcache_mp_lookup_hit_l1_tokens_total and ..._l2_... over "
        "lmcache_mp_lookup_requested_tokens_total; a target of its own, which the job and instance "
        "filters pick as any other.\n\n"
        "Good: the sources you deployed, steady. Bad: a source falling to 0 (an offload tier or the KV "
        "transfer stopped), or only the device where you expected more.",
        [
            target(panel_queries.CACHED_SHARE_BY_SOURCE, "{{instance}} {{source}}"),
            target(panel_queries.LMCACHE_HIT_SHARE_BY_TIER, "{{instance}} LMCache {{source}}"),
        ],
        no_value="No engine exports where its cached tokens came from",
    )


def request_share_by_instance() -> JSON:
    return instance_share_timeseries(
        "Request share per instance",
        "Each instance's share of the finished requests. Consistent hashing on the session id trades "
        "balance for cache reuse.\n\n"
        "Good: each near 1/N of N instances. Bad: one instance far above the rest (a hot session key, or "
        "replicas missing from the hash ring) or one at 0 (out of rotation).",
        [target(panel_queries.REQUEST_SHARE_BY_INSTANCE, "{{instance}}")],
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
            "allValue": panel_queries.ALL_VALUES,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }
    return variable


def cluster_variable(cluster_label: str) -> JSON:
    """The clusters, as the values of `cluster_label`; All is `.*`, so that it matches series without
    the label too and a Prometheus of one cluster, without the label, shows everything as before."""
    variable = label_variable(cluster_label, "Cluster", panel_queries.CLUSTERS_SERIES)
    variable |= {"allValue": panel_queries.ALL_CLUSTERS, "name": panel_queries.CLUSTER_VARIABLE}
    return variable


def as_board_runs(expr: str, cluster_label: str, *, per_cluster: bool = True) -> str:
    """A panel query (prometheus/panel_queries.py) as a board runs it: narrowed to the picked clusters
    and, unless a table or heatmap sums them, one series per cluster, never a sum or join across clusters."""
    narrowed = promql.with_matcher(expr, panel_queries.cluster_matcher(cluster_label))
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
    matcher = panel_queries.cluster_matcher(cluster_label)
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
                    "expr": panel_queries.FIRING_ALERTS_BY_NAME,
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
            {"targetBlank": True, "title": "kvwatch runbook", "type": "link", "url": RUNBOOK_URL},
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
