"""The Alerts page, and several clusters in one Prometheus: the picker and each cluster apart."""

from __future__ import annotations

import json

import pandas as pd
from fake_dashboard import (
    APP,
    REPLICA_IDS,
    Fake,
    alerts_frame,
    cluster_state,
    fires,
    metrics,
    open_page,
    points,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan
from streamlit.testing.v1 import AppTest

from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    FIRING,
    INSTANCE_HIT_RATIO_DROP,
    OK,
)
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.dashboard import data
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import panel_queries, promql, queries


def test_alerts_from_alertmanager_and_the_webhook_with_runbooks(fake):
    at = open_page("alerts")
    assert not at.exception
    now, received = at.dataframe[0].value, at.dataframe[1].value
    assert list(now["alertname"]) == ["KVWatchSessionAffinityBroken"]
    assert list(received["state"]) == ["firing"]
    assert at.expander[0].label == "Runbook: KVWatchSessionAffinityBroken"
    assert "## KVWatchSessionAffinityBroken" in at.expander[0].markdown[0].value
    (link,) = at.expander[0].get("link_button")
    assert link.proto.url == f"{RUNBOOK_URL}#kvwatchsessionaffinitybroken"


def test_alerts_name_an_instance_with_a_replica_label_by_its_id_and_address(fake, monkeypatch):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS
    monkeypatch.setattr(data, "alerts", lambda: Result(alerts_frame(instance="127.0.0.1:18011")))
    assert list(open_page("alerts").dataframe[0].value["instance"]) == ["r2 (127.0.0.1:18011)"]


# --- several clusters in one Prometheus ------------------------------------------------------------------

CLUSTERS = panel_queries.clusters(CLUSTER_LABEL)


def in_cluster(query: str, cluster: str) -> str:
    return promql.with_matcher(query, panel_queries.one_cluster(CLUSTER_LABEL, cluster))


def two_clusters(fake: Fake) -> None:
    """Prometheus scrapes clusters a and b, whose hit ratios and hit-ratio alerts differ."""
    fake.values[CLUSTERS] = pd.DataFrame({"cluster": ["b", "a"], "value": [1, 1]})
    for cluster, ratios, state in (("a", [0.8, 0.9], OK), ("b", [0.3, 0.05], FIRING)):
        fake.ranges[in_cluster(queries.CLUSTER_HIT_RATIO, cluster)] = lambda over, r=ratios: points(over, r)
        fake.values[in_cluster(CLUSTER_HIT_RATIO_DROP.state, cluster)] = cluster_state(state)


def test_the_cluster_picker_shows_only_with_several_clusters(fake):
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.exception and not at.sidebar.selectbox
    two_clusters(fake)
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    (picker,) = at.sidebar.selectbox
    assert (picker.label, picker.options, picker.value) == ("Cluster", ["all", "a", "b"], "all")


def test_the_overview_shows_each_clusters_hit_ratio_apart_while_all_are_shown(fake):
    two_clusters(fake)
    at = open_page("overview")
    assert not at.exception
    assert metrics(at)["Cluster hit ratio"] == ["90%", "5%"]  # a's, then b's: never the two summed
    assert [h.value for h in at.subheader if h.value.startswith("Cluster")] == ["Cluster a", "Cluster b"]
    said = texts(at)
    assert ":green[Reuse holds" in said and fires(CLUSTER_HIT_RATIO_DROP) in said


def test_a_picked_cluster_narrows_every_prometheus_read_and_its_alerts(fake):
    two_clusters(fake)
    fake.values[in_cluster(panel_queries.FIRING_ALERTS_NOW, "b")] = pd.DataFrame(
        [{"alertname": "KVWatchPrefixCacheHitRateDrop", "severity": "warning", "cluster": "b", "value": 1}]
    )
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    fake.asked.clear()
    at.sidebar.selectbox[0].select("b").run()
    assert not at.exception
    assert metrics(at)["Cluster hit ratio"] == ["5%"]
    said = texts(at)
    assert fires(CLUSTER_HIT_RATIO_DROP) in said and ":green[Reuse holds" not in said
    assert "**KVWatchPrefixCacheHitRateDrop** (warning)" in said
    read = [query for query in fake.asked if query != CLUSTERS]
    assert read and all('cluster="b"' in query for query in read)


def test_the_alerts_name_each_alerts_cluster_and_a_picked_cluster_shows_only_its_own(fake, monkeypatch):
    two_clusters(fake)
    held = pd.concat([alerts_frame(cluster="a"), alerts_frame(cluster="b", target="lab-round-robin")])
    monkeypatch.setattr(data, "alerts", lambda: Result(held))
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("app_pages/alerts.py").run()
    shown = at.dataframe[0].value  # each alert's cluster beside what it is about
    assert list(shown.columns[:4]) == ["alertname", "severity", "state", "cluster"]
    assert list(zip(shown["cluster"], shown["target"], strict=True)) == [
        ("a", "lab-affinity"),
        ("b", "lab-round-robin"),
    ]
    at.sidebar.selectbox[0].select("b").run()
    assert not at.exception
    assert list(at.dataframe[0].value["target"]) == ["lab-round-robin"]


def test_with_all_clusters_shown_the_replicas_page_keeps_each_clusters_instances_apart(fake):
    """Issue 18: two clusters whose replicas have the same address read as two lines, two verdicts and
    two engines, each led by its cluster; a picked cluster reads its own, as before."""
    two_clusters(fake)
    same = "127.0.0.1:18010"
    fake.ranges[panel_queries.HIT_RATIO_BY_INSTANCE] = lambda over: pd.concat(
        [
            points(over, [0.8, 0.9], cluster="a", instance=same),
            points(over, [0.3, 0.1], cluster="b", instance=same),
        ]
    )
    fake.values[INSTANCE_HIT_RATIO_DROP.state] = pd.DataFrame(
        {"cluster": ["a", "b"], "instance": [same, same], "value": [OK, FIRING]}
    )
    fake.values[queries.INSTANCE_CACHE_SERIES] = pd.DataFrame(
        {"cluster": ["a", "b"], "instance": [same, same],
         "series": ["vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total"], "value": [1, 1]}
    )  # fmt: skip
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("app_pages/replicas.py").run()
    assert not at.exception
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == [f"a / {same}", f"b / {same}"]
    said = texts(at)
    assert f"`a / {same}`: :green[Its hit ratio holds against its own past.]" in said
    assert f"`b / {same}`: {fires(INSTANCE_HIT_RATIO_DROP)}" in said
    engines = at.dataframe[0].value
    assert list(zip(engines["cluster"], engines["engine"], strict=True)) == [
        ("a", "vLLM V1"),
        ("b", "SGLang"),
    ]
    fake.ranges[in_cluster(panel_queries.HIT_RATIO_BY_INSTANCE, "b")] = lambda over: points(
        over, [0.3, 0.1], cluster="b", instance=same
    )
    at.sidebar.selectbox[0].select("b").run()
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == [same]


def test_the_alerts_tables_show_no_cluster_column_without_the_label(fake, monkeypatch):
    monkeypatch.setattr(data, "alerts", lambda: Result(alerts_frame()))  # one cluster, without the label
    assert "cluster" not in open_page("alerts").dataframe[0].value
