"""The overview board's router rows: predicted against delivered, the reuse decomposition (why reuse is
low, per router), and the routers' session tables and KV-event index; and `judged_by`: a verdict's alert
as a thresholds file sets it, so that a board describes the rules' own `for`."""

from __future__ import annotations

import dataclasses

from kvwatch.alerts.alerts import alerts
from kvwatch.alerts.verdicts import (
    ENGINE_LOSS,
    INDEX_STALLED,
    ROUTER_PREDICTION_MISS,
    ROUTING_LOSS,
    SESSION_INVALIDATIONS,
    SESSION_TABLE_FULL,
    Verdict,
)
from kvwatch.grafana.panels import (
    NO_ROUTER_DATA,
    ROUTER_LEGEND,
    Layout,
    router_share_timeseries,
    router_shares_timeseries,
    target,
    timeseries,
)
from kvwatch.prometheus import panel_queries, queries
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
        router_shares_timeseries(
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
            "is lost names it.",
            [
                target(queries.INSTANCE_ROUTER_REUSE_SHARE, "{{leg}}: {{job}} / {{instance}}"),
                target(queries.CLUSTER_ROUTER_REUSE_SHARE, "{{leg}}: all routers"),
            ],
        ),
        12,
    )
    layout.add(
        router_shares_timeseries(
            "Where reuse is lost",
            "The steps down between the legs, as shares of the router's prompt tokens: workload (nothing "
            "held anywhere: a prompt that changes at its start every turn, sessions that never return), "
            f"routing (held elsewhere than where the router sent it: {routing.name} fires above "
            f"{t.routing_loss_above:.0%} for {routing.for_}), engine / index (predicted cached, not reused: "
            f"caching off, eviction, a stale index; {engine.name} fires above {t.engine_loss_above:.0%} for "
            f"{engine.for_}), with at least {t.min_router_prompt_tokens_per_second:g} prompt tokens a "
            "second.\n\nGood: only the workload's loss, and that steady. Bad: a routing or engine loss "
            "rising.",
            [target(queries.INSTANCE_ROUTER_REUSE_LOSS, "{{loss}}: {{job}} / {{instance}}")],
            alert=routing.name,
        ),
        12,
    )


def router_row(layout: Layout, t: Thresholds = THRESHOLDS) -> None:
    """What the routers predicted they would reuse, against what the engines delivered."""
    miss, held = ROUTER_PREDICTION_MISS.alert.name, judged_by(ROUTER_PREDICTION_MISS, t).alert.for_
    layout.row("Router: predicted vs delivered")
    layout.add(
        router_shares_timeseries(
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
            "replica).",
            [
                target(queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO, "predicted by {{job}} / {{instance}}"),
                target(panel_queries.HIT_RATIO_BY_INSTANCE, "delivered by {{instance}}"),
                target(queries.CLUSTER_HIT_RATIO, "delivered by all instances"),
            ],
            alert=miss,
        ),
        10,
    )
    layout.add(
        router_share_timeseries(
            "Delivered per predicted",
            "The cluster's delivered hit ratio over each router's predicted one: what "
            f"{miss} judges (it fires below {t.delivered_per_predicted_below:.0%} while the router "
            f"predicts above {t.router_predicted_above:.0%}, for "
            f"{held}). Only llm-d's EPP, Dynamo's KV router and SMG's "
            "cache_aware policy predict a hit ratio to compare.\n\n"
            "Good: near 100 %: the prediction holds; above it, the engines reuse more than the router "
            "expected (KV from host memory, disk or another instance). Bad: near 0 %: the router's index "
            "says hit while the engines prefill everything.",
            queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
            no_value=NO_ROUTER_DATA,
            alert=miss,
        ),
        7,
    )
    layout.add(
        router_share_timeseries(
            "Sticky decisions kept (SMG)",
            "SMG's manual (routing-key) policy: of the requests whose routing key was already pinned to a "
            'worker, the share that reached it (smg_manual_policy_branch_total{branch="occupied_hit"}) '
            "rather than another (occupied_miss: the pinned worker was gone or overloaded). The router's "
            "own stickiness, beside the probes' (Sticky probe sessions); kvwatch reads it from SMG "
            "only.\n\n"
            "Good: near 100 %. Bad: falling: routing keys respill to other workers, and their sessions' "
            "history is prefilled again.",
            queries.INSTANCE_ROUTER_PIN_KEPT,
            max_value=1,
            no_value="No SMG router with the manual policy",
        ),
        7,
    )
    layout.add(
        router_share_timeseries(
            "Prefix-matched decisions",
            "Cache-aware routers: the share of their routing decisions that went where their own index "
            "matched a cached prefix, as each counts them: SMG's cache_aware policy "
            '(smg_cache_aware_policy_branch_total{branch="tree_match"}, not spill or a fallback), '
            'vllm-router (vllm_router_prefix_routing_decisions_total{outcome="prefix_hit"}, else its '
            "cache_hits_total / cache_misses_total, as sglang-router 0.2's sgl_router_ ones), AIBrix "
            '(aibrix_prefix_cache_routing_selection_total{selection="prefix_match"}, else, before it '
            "counted its selections, "
            'aibrix_prefix_cache_routing_decisions_total{match_percent_bucket!="0"}). The router\'s '
            "guess from its index, not an engine hit: compare it with the engines' delivered hit ratio "
            "(Predicted by the router, delivered by the engines).\n\n"
            "Good: steady and high on multi-turn traffic. Bad: falling while the traffic is unchanged "
            "(the index lost its prefixes: a router restart, workers replaced), or high while the engines "
            "deliver little (the index drifted from the engines' caches).",
            queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
            max_value=1,
            no_value="No cache-aware router counting its prefix matches",
        ),
        16,
    )
    layout.add(
        timeseries(
            "Routed without the index (AIBrix)",
            "AIBrix's prefix-cache router: per decision it routed, the requests its load-imbalance gate "
            "narrowed to the least loaded pods, prefix or not (aibrix_prefix_cache_load_imbalance_total, "
            "aibrix_load_imbalance_total in later gateways), and the routings that failed, by reason "
            "(aibrix_prefix_cache_routing_errors_total{reason}: tokenize_failed, no_target_pod, ...).\n\n"
            "Good: near 0. Bad: the load imbalance rising (the pods' running requests too far apart: "
            "sessions leave the pod holding their prefix), or errors (requests not routed at all).",
            [target(queries.INSTANCE_ROUTER_FALLBACKS, "{{reason}}: " + ROUTER_LEGEND)],
            unit="percentunit",
            no_value="No AIBrix router counting its load imbalances or errors",
        ),
        8,
    )


def router_state_row(layout: Layout, t: Thresholds = THRESHOLDS) -> None:
    """Routers' session tables (llm-d's session binding tracker) and KV-event index (SMG), with the
    alerts that judge them."""
    full, surge, stalled = (
        judged_by(verdict, t).alert for verdict in (SESSION_TABLE_FULL, SESSION_INVALIDATIONS, INDEX_STALLED)
    )
    layout.row("Routers' session tables and KV-event index")
    layout.add(
        timeseries(
            "Sessions bound and refused",
            "The sessions each router's session table binds to an endpoint now "
            "(llm_d_epp_session_control_bindings), and the new sessions it refuses per second "
            f"(..._bind_rejections_total): {full.name} fires while it refuses any for {full.for_}. "
            "Dynamo's affinity table exports no series (a full one answers 503).\n\n"
            "Good: bindings following the traffic, no refusals. Bad: refusals: the table is full and new "
            "conversations go unpinned.",
            [
                target(queries.INSTANCE_ROUTER_SESSION_BINDINGS, "bound: " + ROUTER_LEGEND),
                target(
                    queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS, "refused per second: " + ROUTER_LEGEND
                ),
            ],
            unit="short",
            no_value="No router exports a session table",
            alert=full.name,
        ),
        8,
    )
    layout.add(
        timeseries(
            "Session bindings dropped, by reason",
            "Bindings each router dropped per second, by reason (llm_d_epp_session_control_invalidations_"
            "total{reason}): idle (past the table's TTL) and close are the table working; pod_delete and "
            f"error lose sessions before they end, and {surge.name} fires when those are over "
            f"{t.session_invalidated_share_above:.0%} of the bound sessions a minute for {surge.for_}.\n\n"
            "Good: idle and close only. Bad: pod_delete or error rising: those sessions start again cold "
            "on another replica.",
            [target(queries.INSTANCE_ROUTER_SESSION_INVALIDATIONS, "{{reason}}: " + ROUTER_LEGEND)],
            unit="ops",
            no_value="No router exports a session table",
            alert=surge.name,
        ),
        8,
    )
    layout.add(
        timeseries(
            "KV-event index: lag, gaps, resyncs, degraded ranks",
            "How far each router's KV-event index trails the engines' events (smg_kv_event_lag_seconds, "
            "its worst worker, in seconds), the event gaps and resyncs per second "
            "(smg_kv_event_gaps_total, smg_kv_event_resyncs_total) and the ranks it cannot trust "
            f"(smg_kv_event_degraded_ranks). {stalled.name} fires on a lag over "
            f"{t.kv_event_lag_above:g} s, any gap or degraded rank, for {stalled.for_}.\n\n"
            "Good: lag near 0, no gaps, no degraded ranks. Bad: any of them: the router predicts reuse "
            "from blocks the engines no longer hold (or misses blocks they do).",
            [
                target(queries.INSTANCE_ROUTER_KV_EVENT_LAG, "lag (s): " + ROUTER_LEGEND),
                target(queries.INSTANCE_ROUTER_KV_EVENT_GAPS, "gaps per second: " + ROUTER_LEGEND),
                target(queries.INSTANCE_ROUTER_KV_EVENT_RESYNCS, "resyncs per second: " + ROUTER_LEGEND),
                target(queries.INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS, "degraded ranks: " + ROUTER_LEGEND),
            ],
            unit="short",
            no_value="No router exports its KV-event index",
            alert=stalled.name,
        ),
        8,
    )
