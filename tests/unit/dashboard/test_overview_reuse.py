"""The Overview's reuse decomposition, from canned Prometheus answers (dashboard/data.py patched)."""

from __future__ import annotations

import pandas as pd
from fake_dashboard import NO_FRAME, open_page, texts
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan

from kvwatch.alerts.verdicts import ENGINE_LOSS, FIRING, OK, ROUTING_LOSS
from kvwatch.dashboard import reuse
from kvwatch.prometheus import panel_queries, queries

ROUTER = {"job": "epp", "instance": "10.0.0.5:9090"}


def per_router(label: str, values: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame([{**ROUTER, label: name, "value": value} for name, value in values.items()])


def test_each_router_shows_its_legs_losses_and_the_verdicts_on_the_routing_and_engine_losses(fake):
    fake.values[queries.INSTANCE_ROUTER_REUSE_SHARE] = per_router(
        "leg", {"available": 0.8, "routed": 0.6, "delivered": 0.4}
    )
    fake.values[queries.INSTANCE_ROUTER_REUSE_LOSS] = per_router(
        "loss", {"workload": 0.2, "routing": 0.2, "engine": 0.2}
    )
    fake.values[queries.CLUSTER_ROUTER_REUSE_SHARE] = pd.DataFrame(
        {"leg": ["available", "routed", "delivered"], "value": [0.9, 0.5, 0.45]}
    )
    fake.values[ROUTING_LOSS.state] = pd.DataFrame([{**ROUTER, "value": FIRING}])
    fake.values[ENGINE_LOSS.state] = pd.DataFrame([{**ROUTER, "value": OK}])
    said = texts(open_page("overview"))
    assert (
        "`epp / 10.0.0.5:9090`: prompt 100% → 80% the best replica held → 60% the chosen replica held → "
        "40% the engines reused" in said
    )
    assert "All routers: prompt 100% → 90% the best replica held → 50% the chosen replica held" in said
    assert (
        "Lost: workload (held nowhere) 20%, routing (held elsewhere) 20%, "
        "engine / index (predicted, not reused) 20%" in said
    )
    assert f":red[KVWatchReuseLostToRouting fires: {ROUTING_LOSS.alert.summary}]" in said
    assert f":green[{reuse.LOSS_OK['engine']}]" in said


def test_without_a_router_that_exports_the_legs_the_overview_says_which_do(fake):
    fake.values[queries.INSTANCE_ROUTER_REUSE_SHARE] = NO_FRAME
    said = texts(open_page("overview"))
    assert reuse.NO_LEGS in said
    assert "Lost:" not in said


def test_each_probe_route_shows_its_own_sessions_ideal_and_delivered_reuse(fake):
    fake.values[panel_queries.PROBE_REUSE_SHARES] = pd.DataFrame(
        {
            "target": "lab-affinity",
            "route_mode": "affinity",
            "leg": ["available", "delivered"],
            "value": [0.85, 0.8],
        }
    )
    said = texts(open_page("overview"))
    assert (
        "Probe sessions' reuse: prompt 100% → 85% a pinned replica would hold → 80% the engines reused "
        "(lost 5%)" in said
    )
    assert said.count("Probe sessions' reuse") == 1  # only the route it was measured on
