"""Cache & replicas: each replica's hit ratio over time (the share of its prompt tokens served from
cached KV, and beside it its local prefix cache's lookups), where its cached KV came from, how requests
are spread over the replicas (consistent hashing trades balance for reuse), their TTFT, what each
engine is, what the routers predicted they would reuse against what the engines delivered, and the state
of the routers' session tables and KV-event index."""

from __future__ import annotations

import itertools

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from kvwatch.alerts.verdicts import (
    INDEX_STALLED,
    INSTANCE_HIT_RATIO_DROP,
    LOAD_IMBALANCE,
    ROUTER_PREDICTION_MISS,
    SESSION_INVALIDATIONS,
    SESSION_TABLE_FULL,
)
from kvwatch.dashboard import data, ui
from kvwatch.prometheus import panel_queries, queries

# The first cache series an instance exports names its engine (the order of collectors.queries).
ENGINES = {
    "vllm:prefix_cache_queries_total": "vLLM V1",
    "vllm:gpu_prefix_cache_queries_total": "vLLM V1 (deprecated names)",
    "vllm:gpu_prefix_cache_hit_rate": "vLLM V0",
    "sglang:prompt_tokens_total": "SGLang",
    "sglang:cache_hit_rate": "SGLang (gauge only)",
}
PREFIX_CACHING = {"True": "on", "False": "off"}
IMBALANCE_HELP = "Finished requests of the busiest instance over the mean of all instances."
IMBALANCE_OK = "Requests are spread evenly enough over the replicas."
HIT_RATIO_OK = "Its hit ratio holds against its own past."
PREDICTION_OK = "The engines deliver the reuse it predicts."
NO_ROUTER = (
    "No router in this Prometheus exports what it predicted: llm-d's EPP, Dynamo's KV router and SMG's "
    "cache_aware policy export their predicted hit ratio, SMG's manual policy its sticky decisions, "
    "cache-aware routers (SMG, vllm-router, sglang-router 0.2, AIBrix) their prefix-matched decisions."
)
# What a router exports of its own routing, each figure a ratio per router (job, instance).
ROUTER_FIGURES = {
    "predicted hit ratio": queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    "delivered per predicted": queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    "sticky decisions kept": queries.INSTANCE_ROUTER_PIN_KEPT,
    "prefix-matched decisions": queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
}

# A router's session table (llm-d's EPP) and KV-event index (SMG), each figure per router, now; and the
# alerts that judge them, with what each says while it does not fire.
ROUTER_STATE_FIGURES = {
    "sessions bound": queries.INSTANCE_ROUTER_SESSION_BINDINGS,
    "new sessions refused per second": queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS,
    "index lag (s)": queries.INSTANCE_ROUTER_KV_EVENT_LAG,
    "index gaps per second": queries.INSTANCE_ROUTER_KV_EVENT_GAPS,
    "index resyncs per second": queries.INSTANCE_ROUTER_KV_EVENT_RESYNCS,
    "degraded ranks": queries.INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS,
}
ROUTER_STATE_VERDICTS = (
    (SESSION_TABLE_FULL, "Its session table takes every new session."),
    (SESSION_INVALIDATIONS, "Its sessions end by idling or a close, not early."),
    (INDEX_STALLED, "Its KV-event index follows the engines' events."),
)
NO_ROUTER_STATE = (
    "No router in this Prometheus exports a session table (llm-d's EPP: llm_d_epp_session_control_*) or "
    "its KV-event index (SMG: smg_kv_event_*)."
)


def instance_verdicts(over: data.Span) -> None:
    """Each instance's verdict, from the instance-scope hit-ratio alert's own state."""
    state = data.instant(INSTANCE_HIT_RATIO_DROP.state, over)
    if ui.failed(state):
        return
    if state.value.empty:  # no instance's hit ratio in Prometheus: say so, not nothing
        ui.judge(INSTANCE_HIT_RATIO_DROP, state.value, HIT_RATIO_OK).show()
        return
    for name, rows in ui.named_replicas(state.value, over).groupby("instance"):
        verdict = ui.judge(INSTANCE_HIT_RATIO_DROP, rows, HIT_RATIO_OK)
        st.markdown(f"`{name}`: :{verdict.color}[{verdict.text}]")


def ratio_chart(
    frame: pd.DataFrame,
    marks: pd.DataFrame,
    over: data.Span,
    label: str,
    height: int,
    color: str = "instance",
) -> go.Figure:
    """Ratios per instance (or per `color`) over time, in colours that say nothing good or bad, with the
    faults and alerts marked. One trace per line built directly: plotly express takes half a second to
    group a fleet of 64 instances."""
    figure = go.Figure(
        [
            go.Scatter(
                x=points["time"],
                y=points["value"],
                name=name,
                mode="lines",
                legendgroup=name,
                line={"color": line_color},
            )
            for (name, points), line_color in zip(
                frame.groupby(color, sort=False), itertools.cycle(ui.SERIES_COLORS)
            )
        ]
    )
    figure.update_layout(
        yaxis={"tickformat": ".0%", "range": [0, 1.05], "title": label},
        legend={"title": color},
        margin={"t": 10},
        height=height,
    )
    return ui.mark(figure, marks)


def shares(query: str, over: data.Span, empty: str, key: str, **bars) -> None:
    """Shares per instance now, as bars (stacked by `color`, when given); or why there are none."""
    found = data.instant(query, over)
    if ui.failed(found):
        return
    if found.value.empty:
        ui.empty(empty)
        return
    order = ["instance", bars["color"]] if "color" in bars else ["instance"]
    named = ui.named_replicas(found.value, over).sort_values(order)
    figure = px.bar(named, x="instance", y="value", color_discrete_sequence=ui.SERIES_COLORS, **bars)
    figure.update_layout(yaxis={"tickformat": ".0%"}, margin={"t": 10}, height=280)
    st.plotly_chart(figure, key=key)


def engines(series: pd.DataFrame, config: pd.DataFrame, cluster_label: str | None) -> pd.DataFrame:
    """Per instance (of each cluster, where the series carry the label): its engine, judged by the cache
    series it exports, and whether prefix caching is on."""
    keys = [key for key in (cluster_label, "instance") if key in series]
    exported = series.groupby(keys)["series"].agg(set).reset_index()
    caching = dict(zip(config.get("instance", []), config.get("enable_prefix_caching", []), strict=True))
    return exported[keys].assign(**{
        "engine": [next((name for s, name in ENGINES.items() if s in names), "unknown")
                   for names in exported["series"]],
        "prefix caching": [PREFIX_CACHING.get(caching.get(i), "not exported") for i in exported["instance"]],
        "cache series": [", ".join(sorted(names)) for names in exported["series"]],
    })  # fmt: skip


def router_figures(found: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per router (job, instance), a column per figure it exports, from instant answers."""
    columns = [frame.set_index(["job", "instance"])["value"].rename(name) for name, frame in found.items()]
    return pd.concat(columns, axis=1).reset_index()


def routers(over: data.Span, hit_ratios: pd.DataFrame, marks: pd.DataFrame) -> None:
    """Each router's predicted hit ratio against the engines' delivered one, as the overview board's
    router row shows them, with the prediction-miss alert's verdict on each router that predicts."""
    st.subheader("Router: predicted vs delivered")
    st.caption(
        "What a cache-aware router predicted it would find cached when it chose a replica, against what "
        "the engines delivered: a router whose index says hit while the engines prefill everything "
        "routes on a stale index. Delivered per predicted is the cluster's delivered hit ratio over the "
        "router's prediction, what KVWatchRouterPredictionMiss judges; sticky decisions kept is the share "
        "of SMG's pinned routing keys that reached their worker."
    )
    predicted, cluster = (
        data.series(q, over) for q in (queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO, queries.CLUSTER_HIT_RATIO)
    )
    latest = {name: data.instant(q, over) for name, q in ROUTER_FIGURES.items()}
    state = data.instant(ROUTER_PREDICTION_MISS.state, over)
    if any(ui.failed(result) for result in (predicted, cluster, state, *latest.values())):
        return
    exported = {name: result.value for name, result in latest.items() if not result.value.empty}
    if not exported:
        ui.empty(NO_ROUTER)
        return
    if not predicted.value.empty:
        router = predicted.value
        lines = pd.concat(
            [
                router.assign(line="predicted by " + router["job"] + " / " + router["instance"]),
                # no instance column while no engine serves
                hit_ratios.assign(line="delivered by " + hit_ratios.get("instance", "")),
                cluster.value.assign(line="delivered by the cluster"),
            ]
        )
        st.plotly_chart(
            ratio_chart(lines, marks, over, "hit ratio", 300, color="line"), key="replicas_routers"
        )
    figures = router_figures(exported)
    percent = {name: st.column_config.NumberColumn(name, format="percent") for name in exported}
    st.dataframe(figures, hide_index=True, column_config=percent)
    for job, instance in figures[["job", "instance"]].itertuples(index=False):
        verdict = ui.judge(ROUTER_PREDICTION_MISS, state.value, PREDICTION_OK, job=job, instance=instance)
        st.markdown(f"`{job} / {instance}`: :{verdict.color}[{verdict.text}]")


def lmcache_tiers(over: data.Span) -> None:
    """LMCache's hits per tier, per instance, where an LMCache multi-process server says (nothing else)."""
    tiers = data.instant(panel_queries.LMCACHE_HIT_SHARE_BY_TIER, over)
    if tiers.error or tiers.value.empty:
        return
    st.caption(
        "LMCache: of the tokens asked of it, the share found in L1 (its CPU memory) and L2 (disk or a "
        "remote store), now."
    )
    shares(panel_queries.LMCACHE_HIT_SHARE_BY_TIER, over, "", "replicas_lmcache_tiers", color="source",
           labels={"value": "share of tokens asked of LMCache"})  # fmt: skip


def router_state(over: data.Span) -> None:
    """Each router's session table and KV-event index now, with the verdicts of the alerts that judge
    them: a full table, sessions dropped early, a stalled index."""
    st.subheader("Routers' session tables and KV-event index")
    st.caption(
        "A session table pins each session to an endpoint until it idles past the TTL or closes; a full "
        "one refuses new sessions, and bindings dropped for a pod deletion or an error start their "
        "sessions again cold. A KV-event index that lags, misses events or has degraded ranks predicts "
        f"reuse from blocks the engines no longer hold. Rates over {queries.WINDOW}."
    )
    latest = {name: data.instant(q, over) for name, q in ROUTER_STATE_FIGURES.items()}
    dropped = data.instant(queries.INSTANCE_ROUTER_SESSION_INVALIDATIONS, over)
    states = {verdict: data.instant(verdict.state, over) for verdict, _ in ROUTER_STATE_VERDICTS}
    if any(ui.failed(result) for result in (*latest.values(), dropped, *states.values())):
        return
    exported = {name: result.value for name, result in latest.items() if not result.value.empty}
    if not dropped.value.empty:
        for reason, rows in dropped.value.groupby("reason"):
            exported[f"dropped per second: {reason}"] = rows
    if not exported:
        ui.empty(NO_ROUTER_STATE)
        return
    figures = router_figures(exported)
    st.dataframe(figures, hide_index=True, key="replicas_router_state")
    for job, instance in figures[["job", "instance"]].itertuples(index=False):
        for verdict, ok in ROUTER_STATE_VERDICTS:
            if not ui.matching(states[verdict].value, job=job, instance=instance).empty:
                said = ui.judge(verdict, states[verdict].value, ok, job=job, instance=instance)
                st.markdown(f"`{job} / {instance}`: :{said.color}[{said.text}]")


@st.fragment(run_every=data.REFRESH_SECONDS)
def replicas(seconds: int) -> None:
    over = data.span(seconds)
    hit_ratios, local = (
        data.series(q, over)
        for q in (panel_queries.HIT_RATIO_BY_INSTANCE, panel_queries.LOCAL_HIT_RATIO_BY_INSTANCE)
    )
    if ui.failed(hit_ratios) or ui.failed(local):
        return
    hit_ratios, local = (ui.named_replicas(found.value, over) for found in (hit_ratios, local))
    st.caption(f"As of {ui.as_of(over.end)}.")
    st.subheader("Hit ratio per instance")
    st.caption(
        "Prompt tokens served from cached KV (its prefix cache, host memory, disk or another instance) over "
        f"all its prompt tokens, over {queries.WINDOW}: a replica with caching off is at 0 %. The alert "
        "KVWatchPrefixCacheHitRateDrop judges this ratio."
    )
    marks = ui.events(over)
    if hit_ratios.empty:
        ui.empty(f"No engine served prompt tokens in this range (ratios over {queries.WINDOW} windows).")
    else:
        st.plotly_chart(ratio_chart(hit_ratios, marks, over, "hit ratio", 320), key="replicas_hit_ratio")
        instance_verdicts(over)

    lookups, sources = st.columns(2)
    with lookups:
        st.subheader("Local lookup ratio")
        st.caption(
            "Tokens found over tokens looked up in each engine's own prefix cache. vLLM stops looking up "
            "when caching is off, so such a replica drops out here instead of counting as 0 %."
        )
        if local.empty:
            ui.empty("No engine looked up its prefix cache in this range.")
        else:
            st.plotly_chart(ratio_chart(local, marks, over, "lookup ratio", 280), key="replicas_local")
    with sources:
        st.subheader("Cached KV by source")
        st.caption("Each source's share of the instance's prompt tokens, now: the hit ratio, split.")
        shares(panel_queries.CACHED_SHARE_BY_SOURCE, over,
               "No engine exports where its cached tokens came from.",
               "replicas_sources", color="source", labels={"value": "share of prompt tokens"})  # fmt: skip
        lmcache_tiers(over)

    share, latency = st.columns(2)
    with share:
        st.subheader("Request share")
        shares(panel_queries.REQUEST_SHARE_BY_INSTANCE, over, "No finished requests in the last window.",
               "replicas_share", labels={"value": "share of requests"})  # fmt: skip
        spread = data.series(LOAD_IMBALANCE.signal, over)
        state = data.instant(LOAD_IMBALANCE.state, over)
        if not (ui.failed(spread) or ui.failed(state)):
            verdict = ui.judge(LOAD_IMBALANCE, state.value, IMBALANCE_OK)
            ui.tile("Load imbalance", spread.value, over.end, ui.FACTOR, verdict, IMBALANCE_HELP, ui.BAD)
    with latency:
        st.subheader("Engine TTFT")
        ttft = data.instant(panel_queries.TTFT_QUANTILES_BY_INSTANCE, over)
        if not ui.failed(ttft) and ttft.value.empty:
            ui.empty("No first tokens in the last window.")
        elif not ttft.error:
            frame = ui.named_replicas(ttft.value, over).assign(
                ms=ttft.value["value"] * 1000,
                quantile=ttft.value["quantile"].map(lambda q: f"p{float(q) * 100:g}"),
            )
            figure = px.bar(
                frame.sort_values(["instance", "quantile"]),
                x="instance",
                y="ms",
                color="quantile",
                barmode="group",
                labels={"ms": "time to first token (ms)"},
                color_discrete_sequence=ui.SERIES_COLORS,
            )
            figure.update_layout(margin={"t": 10}, height=280)
            st.plotly_chart(figure, key="replicas_ttft")

    st.subheader("Engines")
    series, config = (
        data.instant(q, over) for q in (queries.INSTANCE_CACHE_SERIES, panel_queries.PREFIX_CACHING_CONFIG)
    )
    if not (ui.failed(series) or ui.failed(config)):
        if series.value.empty:
            ui.empty("No instance exports prefix-cache series yet: is Prometheus scraping the engines?")
        else:
            found = engines(series.value, config.value, data.cluster_label())
            st.dataframe(ui.named_replicas(found, over), hide_index=True)

    routers(over, hit_ratios, marks)
    router_state(over)


st.title("Cache & replicas")
replicas(ui.time_range("replicas_range"))
