"""The Cache & replicas page: share, imbalance and engines, each instance's verdict, and the routers'."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from fake_dashboard import (
    REPLICA_IDS,
    Fake,
    cluster_state,
    fires,
    metrics,
    open_page,
    pending,
    points,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan

from kvwatch.alerts.verdicts import (
    FIRING,
    INSTANCE_HIT_RATIO_DROP,
    LOAD_IMBALANCE,
    OK,
    PENDING,
    ROUTER_PREDICTION_MISS,
)
from kvwatch.prometheus import queries


def test_replicas_show_share_imbalance_and_engines(fake):
    at = open_page("replicas")
    assert not at.exception
    assert metrics(at)["Load imbalance"] == ["2.60×"]
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == ["127.0.0.1:18010", "127.0.0.1:18011"]
    assert [line["name"] for line in charts["replicas_local"]] == ["127.0.0.1:18010"]
    assert [bar["name"] for bar in charts["replicas_sources"]] == ["device", "host"]
    assert pending(LOAD_IMBALANCE) in texts(at)  # above 2, for less than the alert's 15 minutes
    fake.values[LOAD_IMBALANCE.state] = cluster_state(FIRING)
    assert fires(LOAD_IMBALANCE) in texts(at.run())
    engines = at.dataframe[0].value.set_index("instance")
    assert engines.loc["127.0.0.1:18010", "engine"] == "vLLM V1"
    assert engines.loc["127.0.0.1:18010", "prefix caching"] == "off"
    assert engines.loc["127.0.0.1:18011", "engine"] == "SGLang"
    assert engines.loc["127.0.0.1:18011", "prefix caching"] == "not exported"


def test_replicas_judge_each_instance_as_its_hit_ratio_alert_does(fake):
    said = texts(open_page("replicas"))
    assert "`127.0.0.1:18010`: :green[Its hit ratio holds against its own past.]" in said
    fake.values[INSTANCE_HIT_RATIO_DROP.state] = pd.DataFrame(
        {"instance": ["127.0.0.1:18010", "127.0.0.1:18011"], "value": [OK, FIRING]}
    )
    said = texts(open_page("replicas"))
    assert "`127.0.0.1:18010`: :green[Its hit ratio holds against its own past.]" in said
    assert f"`127.0.0.1:18011`: {fires(INSTANCE_HIT_RATIO_DROP)}" in said


def test_replicas_name_an_instance_with_a_replica_label_by_its_id_and_address(fake):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS  # r2's target carries the label, r1's does not
    at = open_page("replicas")
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    names = ["127.0.0.1:18010", "r2 (127.0.0.1:18011)"]
    assert [line["name"] for line in charts["replicas_hit_ratio"]] == names
    assert list(at.dataframe[0].value["instance"]) == names
    assert "`r2 (127.0.0.1:18011)`: :green[Its hit ratio holds against its own past.]" in texts(at)


NO_ROUTER = "No router in this Prometheus exports what it predicted: llm-d's EPP, Dynamo's KV router"
EPP = {"job": "epp", "instance": "10.0.0.5:9090"}  # predicts a hit ratio
SMG = {"job": "smg", "instance": "10.0.0.6:29000"}  # counts its sticky decisions
VLLM_ROUTER = {"job": "vllm-router", "instance": "10.0.0.7:29001"}  # counts its prefix-matched decisions


def routers(fake: Fake, miss: int) -> None:
    """llm-d's EPP predicting 80 % while the engines deliver 8 % of that, SMG keeping 6 of 7 pins and
    vllm-router sending 3 of 4 requests where its tree matched."""
    fake.ranges[queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO] = lambda over: points(over, [0.8, 0.8], **EPP)
    fake.values |= {
        queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO: pd.DataFrame([{**EPP, "value": 0.8}]),
        queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED: pd.DataFrame([{**EPP, "value": 0.08}]),
        queries.INSTANCE_ROUTER_PIN_KEPT: pd.DataFrame([{**SMG, "value": 6 / 7}]),
        queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS: pd.DataFrame([{**VLLM_ROUTER, "value": 0.75}]),
        ROUTER_PREDICTION_MISS.state: pd.DataFrame([{**EPP, "value": miss}]),
    }


def test_replicas_show_what_routers_predicted_against_what_the_engines_delivered(fake):
    routers(fake, FIRING)
    at = open_page("replicas")
    assert not at.exception
    charts = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")}
    assert [line["name"] for line in charts["replicas_routers"]] == [
        "predicted by epp / 10.0.0.5:9090",
        "delivered by 127.0.0.1:18010",
        "delivered by 127.0.0.1:18011",
        "delivered by the cluster",
    ]
    figures = at.dataframe[1].value.set_index("job")
    assert figures.loc["epp", "predicted hit ratio"] == 0.8
    assert figures.loc["epp", "delivered per predicted"] == 0.08
    assert figures.loc["smg", "sticky decisions kept"] == pytest.approx(6 / 7)
    assert figures.loc["smg"].isna().sum() == 3  # SMG's manual policy predicts no hit ratio
    assert figures.loc["vllm-router", "prefix-matched decisions"] == 0.75
    said = texts(at)
    assert f"`epp / 10.0.0.5:9090`: {fires(ROUTER_PREDICTION_MISS)}" in said
    assert (
        "`smg / 10.0.0.6:29000`: :gray[Not watching: Prometheus holds no series KVWatchRouterPredictionMiss"
        in said
    )
    assert NO_ROUTER not in said


@pytest.mark.parametrize("miss", [OK, PENDING])
def test_replicas_judge_each_router_as_the_prediction_miss_alert_does(fake, miss):
    routers(fake, miss)
    said = texts(open_page("replicas"))
    ok = ":green[The engines deliver the reuse it predicts.]"
    expected = ok if miss == OK else pending(ROUTER_PREDICTION_MISS)
    assert f"`epp / 10.0.0.5:9090`: {expected}" in said
    assert fires(ROUTER_PREDICTION_MISS) not in said


def test_replicas_say_when_no_router_exports_predictions(fake):
    at = open_page("replicas")
    assert NO_ROUTER in texts(at)
    assert "replicas_routers" not in {c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")}
    assert len(at.dataframe) == 1  # the engines only
