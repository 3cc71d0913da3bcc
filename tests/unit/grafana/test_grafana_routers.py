"""The overview board's router panels that say why reuse is low beyond the routers' predictions: their
session tables and KV-event index, each panel linked to the alert that judges it; AIBrix's routings
without its index; and LMCache's tiers beside the engines' split by source (both boards)."""

from __future__ import annotations

import json

from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.grafana.panels import DRILLDOWN, OVERVIEW, as_board_runs, runbook_link
from kvwatch.prometheus import panel_queries, queries
from paths import REPO


def board(name: str) -> dict:
    return json.loads((REPO / "grafana" / "dashboards" / name).read_text())


def row(name: str, title: str) -> list[dict]:
    """The panels of the board's row of that title."""
    found, inside = [], False
    for panel in board(name)["panels"]:
        if panel["type"] == "row":
            inside = panel["title"] == title
        elif inside:
            found.append(panel)
    return found


def reads(panel: dict) -> list[str]:
    return [target["expr"] for target in panel["targets"]]


def runs(*exprs: str) -> list[str]:
    return [as_board_runs(expr, CLUSTER_LABEL) for expr in exprs]


def test_the_session_tables_and_kv_event_index_row_reads_their_series_and_links_their_alerts():
    panels = {p["title"]: p for p in row(OVERVIEW, "Routers' session tables and KV-event index")}
    bound, dropped, index = panels.values()
    assert reads(bound) == runs(
        queries.INSTANCE_ROUTER_SESSION_BINDINGS, queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS
    )
    assert reads(dropped) == runs(queries.INSTANCE_ROUTER_SESSION_INVALIDATIONS)
    assert reads(index) == runs(
        queries.INSTANCE_ROUTER_KV_EVENT_LAG,
        queries.INSTANCE_ROUTER_KV_EVENT_GAPS,
        queries.INSTANCE_ROUTER_KV_EVENT_RESYNCS,
        queries.INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS,
    )
    alerts = (
        "KVWatchRouterSessionTableFull",
        "KVWatchRouterSessionInvalidationSurge",
        "KVWatchRouterIndexStalled",
    )
    for panel, alert in zip((bound, dropped, index), alerts, strict=True):
        assert panel["links"] == [runbook_link(alert)], panel["title"]
        assert alert in panel["description"], panel["title"]
    assert "{{reason}}" in dropped["targets"][0]["legendFormat"]


def test_aibrix_routings_without_its_index_stand_beside_the_prefix_matched_decisions():
    panels = {p["title"]: p for p in row(OVERVIEW, "Router: predicted vs delivered")}
    assert reads(panels["Routed without the index (AIBrix)"]) == runs(queries.INSTANCE_ROUTER_FALLBACKS)
    assert 'selection="prefix_match"' in panels["Prefix-matched decisions"]["description"]


def test_lmcache_tiers_stand_beside_the_engines_split_by_source_on_both_boards():
    for name in (OVERVIEW, DRILLDOWN):
        (by_source,) = (p for p in board(name)["panels"] if p["title"] == "Cached prompt tokens by source")
        assert reads(by_source) == runs(
            panel_queries.CACHED_SHARE_BY_SOURCE, panel_queries.LMCACHE_HIT_SHARE_BY_TIER
        )
        assert by_source["targets"][1]["legendFormat"].endswith("{{instance}} LMCache {{source}}")
