"""Cache & replicas: each replica's prefix-cache hit ratio over time, how requests are spread over the
replicas (consistent hashing trades balance for reuse), their TTFT, and what each engine is."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from collectors import queries
from collectors.queries import THRESHOLDS
from dashboard import data, ui
from dashboard.ui import Verdict

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


def imbalance(value: float) -> Verdict:
    if value > THRESHOLDS.load_imbalance_above:
        return Verdict(
            False, f"The busiest replica serves {value:.1f}× the mean: look for a hot session key."
        )
    return Verdict(True, f"The busiest replica serves {value:.2f}× the mean.")


def engines(series: pd.DataFrame, config: pd.DataFrame) -> pd.DataFrame:
    """Per instance: its engine, judged by the cache series it exports, and whether prefix caching is on."""
    exported = series.groupby("instance")["series"].agg(set)
    caching = dict(zip(config.get("instance", []), config.get("enable_prefix_caching", []), strict=True))
    return pd.DataFrame(
        {
            "instance": instance,
            "engine": next((name for s, name in ENGINES.items() if s in names), "unknown"),
            "prefix caching": PREFIX_CACHING.get(caching.get(instance), "not exported"),
            "cache series": ", ".join(sorted(names)),
        }
        for instance, names in exported.items()
    )


@st.fragment(run_every=data.REFRESH_SECONDS)
def replicas(seconds: int) -> None:
    over = data.span(seconds)
    hit_ratios = data.series(queries.HIT_RATIO_BY_INSTANCE, over)
    if ui.failed(hit_ratios):
        return
    st.caption(f"As of {ui.as_of(over.end)}.")
    st.subheader("Prefix-cache hit ratio per instance")
    if hit_ratios.value.empty:
        ui.empty(f"No engine served prompt tokens in this range (ratios over {queries.WINDOW} windows).")
    else:
        figure = px.line(
            hit_ratios.value, x="time", y="value", color="instance", labels={"value": "hit ratio", "time": ""}
        )
        figure.update_layout(yaxis={"tickformat": ".0%", "range": [0, 1]}, margin={"t": 10}, height=320)
        st.plotly_chart(figure, key="replicas_hit_ratio")

    share, latency = st.columns(2)
    with share:
        st.subheader("Request share")
        shares = data.instant(queries.REQUEST_SHARE_BY_INSTANCE, over)
        if not ui.failed(shares) and shares.value.empty:
            ui.empty("No finished requests in the last window.")
        elif not shares.error:
            figure = px.bar(
                shares.value.sort_values("instance"),
                x="instance",
                y="value",
                labels={"value": "share of requests"},
            )
            figure.update_layout(yaxis={"tickformat": ".0%"}, margin={"t": 10}, height=280)
            st.plotly_chart(figure, key="replicas_share")
        spread = data.series(queries.CLUSTER_LOAD_IMBALANCE, over)
        if not ui.failed(spread):
            ui.tile("Load imbalance", spread.value, over.end, ui.FACTOR, imbalance, IMBALANCE_HELP)
    with latency:
        st.subheader("Engine TTFT")
        ttft = data.instant(queries.TTFT_QUANTILES_BY_INSTANCE, over)
        if not ui.failed(ttft) and ttft.value.empty:
            ui.empty("No first tokens in the last window.")
        elif not ttft.error:
            frame = ttft.value.assign(
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
            )
            figure.update_layout(margin={"t": 10}, height=280)
            st.plotly_chart(figure, key="replicas_ttft")

    st.subheader("Engines")
    series, config = (
        data.instant(q, over) for q in (queries.INSTANCE_CACHE_SERIES, queries.PREFIX_CACHING_CONFIG)
    )
    if not (ui.failed(series) or ui.failed(config)):
        if series.value.empty:
            ui.empty("No instance exports prefix-cache series yet: is Prometheus scraping the engines?")
        else:
            st.dataframe(engines(series.value, config.value), hide_index=True)


st.title("Cache & replicas")
replicas(ui.time_range("replicas_range"))
