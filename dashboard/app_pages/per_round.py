"""Per-round TTFT from the probe history: the source article's chart. With affinity, rounds 2+ reuse the
history and stay near round 1's cost; with round robin they pay for the whole history, growing by round."""

from __future__ import annotations

import itertools

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data, ui

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def chart(summary: pd.DataFrame, targets: list[str]) -> go.Figure:
    """Median (solid) and p90 (dotted) TTFT by round, each with its 95 % band, one colour per target."""
    figure = go.Figure()
    for target, color in zip(targets, itertools.cycle(PALETTE)):
        rows = summary[summary["target"] == target].sort_values("round")
        for quantile, line, band in (("median", {"width": 3}, 0.2), ("p90", {"dash": "dot"}, 0.08)):
            ms = rows[[quantile, f"{quantile}_low", f"{quantile}_high"]] * 1000
            figure.add_scatter(
                x=pd.concat([rows["round"], rows["round"][::-1]]),
                y=pd.concat([ms[f"{quantile}_high"], ms[f"{quantile}_low"][::-1]]),
                fill="toself",
                fillcolor=color,
                opacity=band,
                line={"width": 0},
                hoverinfo="skip",
                legendgroup=target,
                showlegend=False,
            )
            figure.add_scatter(
                x=rows["round"],
                y=ms[quantile],
                name=f"{target} {quantile}",
                mode="lines+markers",
                line={"color": color, **line},
                legendgroup=target,
            )
    figure.update_layout(
        xaxis={"title": "round", "dtick": 1},
        yaxis={"title": "TTFT (ms)", "rangemode": "tozero"},
        margin={"t": 10},
        legend={"orientation": "h", "y": -0.2},
        height=460,
    )
    return figure


def table(summary: pd.DataFrame, targets: list[str]) -> pd.DataFrame:
    """Median TTFT in ms per round and target, with the affinity / round-robin ratio when both are there."""
    ms = summary.assign(median=summary["median"] * 1000)
    wide = ms.pivot(index="round", columns="target", values="median")[targets]
    modes = dict(zip(summary["target"], summary["route_mode"], strict=False))
    affinity = [t for t in targets if modes.get(t) == "affinity"]
    baseline = [t for t in targets if modes.get(t) == "round_robin"]
    if affinity and baseline:
        wide[f"{affinity[0]} / {baseline[0]}"] = wide[affinity[0]] / wide[baseline[0]]
    return wide


@st.fragment(run_every=data.REFRESH_SECONDS)
def per_round(targets: list[str], seconds: int) -> None:
    over = data.span(seconds)
    found = data.ttft_by_round(over.start)
    if ui.failed(found):
        return
    summary = found.value
    shown = [t for t in targets if not summary.empty and t in set(summary["target"])]
    if not shown:
        ui.empty(
            "No successful probe rounds in this range yet: `kvwatch serve` probes every target on its "
            "interval_seconds."
        )
        return
    st.caption(
        f"Probe sessions since {ui.as_of(over.start)}: median TTFT and, dotted, the p90, each with its "
        "95 % confidence band."
    )
    st.plotly_chart(chart(summary, shown), key="per_round_chart")
    medians = table(summary, shown)
    st.caption("Median TTFT in ms per round.")
    st.table(
        medians.style.format("{:.1f}", subset=shown).format("{:.2f}", subset=medians.columns[len(shown) :])
    )


st.title("Per-round TTFT")
config = data.settings()
if not ui.failed(config):
    names = [t.name for t in config.value.targets]
    picked = st.multiselect("Targets", names, default=names, key="per_round_targets")
    seconds = ui.time_range("per_round_range")
    per_round(picked, seconds)
