"""The Overview's kvwatch's own share: the probes' share of the prompt tokens and real traffic's hit ratio,
beside the cluster's, with KVWatchProbesDominate's verdict; and LMCache's tiers beside the split by source
(data layer replaced, as fake_dashboard's)."""

from __future__ import annotations

import pandas as pd
from fake_dashboard import cluster_state, fake, metrics, open_page, points, texts  # noqa: F401

from kvwatch.alerts.verdicts import FIRING, OK, PROBES_DOMINATE
from kvwatch.prometheus import panel_queries, queries


def test_the_real_traffic_ratio_and_the_probes_share_stand_beside_the_cluster_ratio(fake):  # noqa: F811
    fake.ranges[queries.CLUSTER_REAL_HIT_RATIO] = lambda over: points(over, [0.5, 0.46])
    fake.ranges[queries.CLUSTER_PROBE_SHARE] = lambda over: points(over, [0.8, 0.87])
    fake.values[PROBES_DOMINATE.state] = cluster_state(FIRING)
    at = open_page("overview")
    assert not at.exception
    shown = metrics(at)
    assert shown["Cluster hit ratio"] == ["87%"]
    assert shown["Real traffic's hit ratio"] == ["46%"]
    assert shown["Probes' share of prompt tokens"] == ["87%"]
    assert f":red[KVWatchProbesDominate fires: {PROBES_DOMINATE.alert.summary}]" in texts(at)

    fake.values[PROBES_DOMINATE.state] = cluster_state(OK)
    said = texts(open_page("overview"))
    assert ":green[The probes are a minority of the prompt tokens" in said


def test_without_probe_tokens_counted_neither_tile_is_shown(fake):  # noqa: F811
    fake.ranges[queries.CLUSTER_PROBE_SHARE] = lambda over: pd.DataFrame(columns=["time", "value"])
    shown = metrics(open_page("overview"))
    assert "Cluster hit ratio" in shown
    assert "Real traffic's hit ratio" not in shown and "Probes' share of prompt tokens" not in shown


def test_lmcache_tiers_are_said_beside_the_split_by_source(fake):  # noqa: F811
    assert "LMCache found" not in texts(open_page("overview"))  # no LMCache multi-process server
    tiers = pd.DataFrame({"source": ["l2", "l1"], "value": [0.125, 0.625]})
    fake.values[panel_queries.CLUSTER_LMCACHE_HIT_SHARE_BY_TIER] = tiers
    assert "LMCache found 62% in L1, 12% in L2 of the tokens asked of it." in texts(open_page("overview"))
