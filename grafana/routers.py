"""The overview board's reuse decomposition row (why reuse is low, per router), and `judged_by`: a
verdict's alert as a thresholds file sets it, so that a board describes the rules' own `for`."""

from __future__ import annotations

import dataclasses

from kvwatch.alerts.alerts import alerts
from kvwatch.alerts.verdicts import ENGINE_LOSS, ROUTING_LOSS, Verdict
from kvwatch.grafana.panels import FIXED_WINDOW, NO_ROUTER_DATA, Layout, target, timeseries
from kvwatch.prometheus import queries
from kvwatch.prometheus.queries import Grouping
from kvwatch.prometheus.thresholds import THRESHOLDS, Thresholds


def judged_by(verdict: Verdict, t: Thresholds) -> Verdict:
    """The verdict with its alert as `t` sets it: the `for` its panel describes is the rule's."""
    (alert,) = (
        a for a in alerts(t, Grouping()) if (a.name, a.labels) == (verdict.alert.name, verdict.alert.labels)
    )
    return dataclasses.replace(verdict, alert=alert)


def reuse_decomposition_row(layout: Layout, t: Thresholds = THRESHOLDS) -> None:
    """Why reuse is low: each router's decomposition of its prompt tokens and the losses between legs."""
    routing, engine = judged_by(ROUTING_LOSS, t).alert, judged_by(ENGINE_LOSS, t).alert
    layout.row("Reuse decomposition: why reuse is low")
    layout.add(
        timeseries(
            "Available, routed, delivered",
            "Of the prompt tokens each router routed, token-weighted: available, what the best replica "
            "held when it chose; routed, what the chosen replica held, as the router predicted; "
            "delivered, what the engines reused. llm-d's EPP exports the legs from its prefix plugin "
            "(llm_d_epp_prefix_best_available_cached_tokens, llm_d_epp_prefix_predicted_cached_tokens over "
            "llm_d_epp_prefix_prompt_tokens; delivered from llm_d_epp_request_cached_tokens), Dynamo's KV "
            "router from its cache-reuse funnel (dynamo_component_router_kv_best_eligible_cached_prefix_"
            "tokens_total, ..._kv_selected_..., ..._kv_worker_reused_tokens_total). Routers that only "
            "export a mean of per-request ratios draw no line here (Router: predicted vs delivered).\n\n"
            "Good: the three lines close together and high. Bad: a gap between two of them: Where reuse "
            "is lost names it." + FIXED_WINDOW,
            [
                target(queries.INSTANCE_ROUTER_REUSE_SHARE, "{{leg}}: {{job}} / {{instance}}"),
                target(queries.CLUSTER_ROUTER_REUSE_SHARE, "{{leg}}: all routers"),
            ],
            unit="percentunit",
            max_value=1,
            no_value=NO_ROUTER_DATA,
        ),
        12,
    )
    layout.add(
        timeseries(
            "Where reuse is lost",
            "The steps down between the legs, as shares of the router's prompt tokens: workload (nothing "
            "held anywhere: a prompt that changes at its start every turn, sessions that never return), "
            f"routing (held elsewhere than where the router sent it: {routing.name} fires above "
            f"{t.routing_loss_above:.0%} for {routing.for_}), engine / index (predicted cached, not reused: "
            f"caching off, eviction, a stale index; {engine.name} fires above {t.engine_loss_above:.0%} for "
            f"{engine.for_}), with at least {t.min_router_prompt_tokens_per_second:g} prompt tokens a "
            "second.\n\nGood: only the workload's loss, and that steady. Bad: a routing or engine loss "
            "rising." + FIXED_WINDOW,
            [target(queries.INSTANCE_ROUTER_REUSE_LOSS, "{{loss}}: {{job}} / {{instance}}")],
            unit="percentunit",
            max_value=1,
            no_value=NO_ROUTER_DATA,
            alert=routing.name,
        ),
        12,
    )
