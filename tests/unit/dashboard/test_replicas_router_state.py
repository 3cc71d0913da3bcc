"""The Cache & replicas page: each router's session table and KV-event index with the verdicts of the
alerts that judge them, and LMCache's tiers beside the engines' split by source (data layer replaced,
as fake_dashboard's)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pandas as pd
from fake_dashboard import fake, fires, open_page, texts  # noqa: F401

from kvwatch.alerts.verdicts import FIRING, INDEX_STALLED, OK, SESSION_INVALIDATIONS, SESSION_TABLE_FULL
from kvwatch.dashboard.app_pages.replicas import NO_ROUTER_STATE
from kvwatch.prometheus import panel_queries, queries

EPP = {"job": "epp", "instance": "10.0.0.5:9090"}  # llm-d's EPP: a session table
SMG = {"job": "smg", "instance": "10.0.0.9:29000"}  # SMG: a KV-event index


def frame(*rows: dict) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def test_each_routers_session_table_and_index_with_their_alerts_verdicts(fake):  # noqa: F811
    at = open_page("replicas")
    assert NO_ROUTER_STATE in texts(at)  # none exported: said, and no table for it

    fake.values |= {
        queries.INSTANCE_ROUTER_SESSION_BINDINGS: frame({**EPP, "value": 2.0}),
        queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS: frame({**EPP, "value": 0.5}),
        queries.INSTANCE_ROUTER_SESSION_INVALIDATIONS: frame(
            {**EPP, "reason": "idle", "value": 0.25}, {**EPP, "reason": "pod_delete", "value": 0.1}
        ),
        queries.INSTANCE_ROUTER_KV_EVENT_LAG: frame({**SMG, "value": 7.5}),
        queries.INSTANCE_ROUTER_KV_EVENT_GAPS: frame({**SMG, "value": 0.2}),
        queries.INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS: frame({**SMG, "value": 2.0}),
        SESSION_TABLE_FULL.state: frame({**EPP, "value": FIRING}),
        SESSION_INVALIDATIONS.state: frame({**EPP, "value": OK}),
        INDEX_STALLED.state: frame({**SMG, "value": FIRING}),
    }
    at = open_page("replicas")
    assert not at.exception
    said = texts(at)
    assert NO_ROUTER_STATE not in said
    figures = at.dataframe[-1].value.set_index("job")
    assert figures.loc["epp", "sessions bound"] == 2
    assert figures.loc["epp", "new sessions refused per second"] == 0.5
    assert figures.loc["epp", "dropped per second: idle"] == 0.25
    assert figures.loc["epp", "dropped per second: pod_delete"] == 0.1
    assert (figures.loc["smg", "index lag (s)"], figures.loc["smg", "degraded ranks"]) == (7.5, 2)
    assert figures.loc["smg", "index gaps per second"] == 0.2
    assert pd.isna(figures.loc["smg", "sessions bound"]) and pd.isna(figures.loc["epp", "index lag (s)"])
    assert f"`epp / 10.0.0.5:9090`: {fires(SESSION_TABLE_FULL)}" in said
    assert "`epp / 10.0.0.5:9090`: :green[Its sessions end by idling or a close, not early.]" in said
    assert f"`smg / 10.0.0.9:29000`: {fires(INDEX_STALLED)}" in said
    assert "smg / 10.0.0.9:29000`: :gray" not in said  # no verdict where its alert judges nothing


def values(encoded: dict | list) -> list[float]:
    """A chart's values as plotly sends them: a list, or its typed array in base64."""
    if isinstance(encoded, list):
        return encoded
    return np.frombuffer(base64.b64decode(encoded["bdata"]), dtype=encoded["dtype"]).tolist()


def test_lmcache_tiers_stand_beside_the_split_by_source_where_lmcache_says(fake):  # noqa: F811
    def charts(at) -> dict:
        return {
            c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")
        }

    assert "replicas_lmcache_tiers" not in charts(open_page("replicas"))  # no LMCache: nothing said
    fake.values[panel_queries.LMCACHE_HIT_SHARE_BY_TIER] = frame(
        {"job": "lmcache", "instance": "127.0.0.1:6555", "source": "l1", "value": 0.5},
        {"job": "lmcache", "instance": "127.0.0.1:6555", "source": "l2", "value": 0.25},
    )
    at = open_page("replicas")
    tiers = charts(at)["replicas_lmcache_tiers"]
    assert [(bar["name"], values(bar["y"])) for bar in tiers] == [("l1", [0.5]), ("l2", [0.25])]
    assert "found in L1 (its CPU memory) and L2" in texts(at)
