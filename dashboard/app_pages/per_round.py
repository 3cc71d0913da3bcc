"""Per-round TTFT from the probe history: the source article's chart. With affinity, rounds 2+ reuse the
history and stay near round 1's cost; with round robin they pay for the whole history, growing by round.
Split at a moment (a fault, an alert, a picked time), it shows before and after side by side: a break
in affinity is round robin's climb appearing on the right. Below, the same figure for real users, per
gateway listener, from the gateway logs."""

from __future__ import annotations

import datetime
import itertools

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from kvwatch.core.naming import plural
from kvwatch.dashboard import data, ui
from kvwatch.prometheus import panel_queries

WHOLE_RANGE, PICKED = "No split: the whole range", "A time I pick (UTC)"
PERIODS = ("before", "after")


def moment(over: data.Span) -> float | None:
    """The time to compare before and after, in unix seconds: a fault, a heal or an alert of the range,
    or a picked time; None to take the range whole."""
    marks = ui.events(over, unread="Not offered to compare before and after").sort_values("time")
    offered = {f"{e.text}, {ui.as_of(e.time.timestamp())}": e.time.timestamp() for e in marks.itertuples()}
    choice = st.selectbox("Compare before and after", [WHOLE_RANGE, *offered, PICKED], key="per_round_moment")
    if choice != PICKED:
        return offered.get(choice)
    middle = datetime.datetime.fromtimestamp((over.start + over.end) // 2, datetime.UTC)
    st.session_state.setdefault("per_round_at", middle.replace(tzinfo=None, second=0))
    picked = st.datetime_input("Moment (UTC)", key="per_round_at", step=60)
    return picked.replace(tzinfo=datetime.UTC).timestamp()


def column(target: str, period: str) -> str:
    return target if period == "all" else f"{target} {period}"


def chart(summary: pd.DataFrame, targets: list[str], periods: list[str], titles: list[str]) -> go.Figure:
    """Median (solid) and p90 (dotted) TTFT by round, each with its 95 % band, one colour per target and
    one panel per period, titled, on one TTFT axis; the hover gives each point's session count."""
    figure = make_subplots(rows=1, cols=len(periods), shared_yaxes=True, subplot_titles=titles)
    for panel, period in enumerate(periods, start=1):
        for target, color in zip(targets, itertools.cycle(ui.SERIES_COLORS)):
            rows = summary[(summary["target"] == target) & (summary["period"] == period)].sort_values("round")
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
                    row=1,
                    col=panel,
                )
                figure.add_scatter(
                    x=rows["round"],
                    y=ms[quantile],
                    customdata=[plural(n, "session") for n in rows["n"]],
                    hovertemplate=f"round %{{x}}: %{{y:.1f}} ms, %{{customdata}}<extra>{target} "
                    f"{quantile}</extra>",
                    name=f"{target} {quantile}",
                    mode="lines+markers",
                    line={"color": color, **line},
                    legendgroup=target,
                    showlegend=panel == 1,
                    row=1,
                    col=panel,
                )
    figure.update_xaxes(title_text="round", dtick=1)
    figure.update_yaxes(title_text="TTFT (ms)", rangemode="tozero", row=1, col=1)
    figure.update_layout(margin={"t": 30}, legend={"orientation": "h", "y": -0.2}, height=460)
    return figure


def table(summary: pd.DataFrame, targets: list[str], periods: list[str], value: str) -> pd.DataFrame:
    """`value` of the summary per round, one column per target and period (NaN where none ran)."""
    wide = summary.pivot_table(index="round", columns=["target", "period"], values=value, aggfunc="first")
    wide = wide.reindex(columns=pd.MultiIndex.from_product([targets, periods]))
    wide.columns = [column(target, period) for target, period in wide.columns]
    return wide


def ratios(
    medians: pd.DataFrame, summary: pd.DataFrame, targets: list[str], periods: list[str]
) -> pd.DataFrame:
    """What changed at the moment, each target's after / before; without one, affinity / round robin."""
    if len(periods) > 1:
        return pd.DataFrame(
            {
                f"{t} after / before": medians[column(t, "after")] / medians[column(t, "before")]
                for t in targets
            }
        )
    modes = dict(zip(summary["target"], summary["route_mode"], strict=False))
    affinity = [t for t in targets if modes.get(t) == "affinity"]
    baseline = [t for t in targets if modes.get(t) == "round_robin"]
    if not (affinity and baseline):
        return pd.DataFrame(index=medians.index)
    return pd.DataFrame({f"{affinity[0]} / {baseline[0]}": medians[affinity[0]] / medians[baseline[0]]})


@st.fragment(run_every=data.REFRESH_SECONDS)
def per_round(targets: list[str], seconds: int) -> None:
    over = data.span(seconds)
    split = moment(over)
    found = data.ttft_by_round(over.start, split)
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
    periods = ["all"] if split is None else list(PERIODS)
    titles = [] if split is None else [f"{period} {ui.as_of(split)}" for period in PERIODS]
    split_at = "" if split is None else f", {titles[0]} on the left and after it on the right"
    st.caption(
        f"Probe sessions since {ui.as_of(over.start)}{split_at}: median TTFT and, dotted, the p90, each "
        "with its 95 % confidence band; a round belongs to the time it started."
    )
    st.plotly_chart(chart(summary, shown, periods, titles), key="per_round_chart")
    medians = table(summary, shown, periods, "median") * 1000
    changes = ratios(medians, summary, shown, periods)
    st.caption("Median TTFT in ms per round.")
    st.table(
        medians.join(changes)
        .style.format("{:.1f}", subset=medians.columns, na_rep="-")
        .format("{:.2f}", subset=changes.columns, na_rep="-")
    )
    st.caption("Sessions per round: the successful rounds each median, p90 and band are of.")
    st.table(table(summary, shown, periods, "n").fillna(0).astype(int))


def real_users_chart(medians: pd.DataFrame) -> go.Figure:
    """Bars of the median first-byte time per round, one colour per gateway log and listener."""
    figure = go.Figure()
    shown = medians.assign(name=medians["log"] + " / " + medians["listener"]).sort_values("round")
    for (name, rows), color in zip(shown.groupby("name"), itertools.cycle(ui.SERIES_COLORS)):
        figure.add_bar(x=rows["round"], y=rows["value"] * 1000, name=name, marker_color=color)
    figure.update_xaxes(title_text="round", type="category")
    figure.update_yaxes(title_text="TTFT (ms)", rangemode="tozero")
    figure.update_layout(margin={"t": 30}, legend={"orientation": "h", "y": -0.2}, height=380)
    return figure


@st.fragment(run_every=data.REFRESH_SECONDS)
def real_users(seconds: int) -> None:
    st.subheader("Real users, by gateway listener")
    found = data.instant(panel_queries.GATEWAY_FIRST_BYTE_BY_ROUND, data.span(seconds))
    if ui.failed(found):
        return
    if found.value.empty:
        ui.empty("No gateway log has timed a request's first byte yet (docs/gateway-logs.md).")
        return
    st.caption(
        "Median time to first byte of each listener's latest requests of a round, from its access log; "
        "8+ is the 8th round and later. The first token where the gateway times the answer's body (Envoy): "
        "nginx times the headers, which vLLM and SGLang send before it."
    )
    st.plotly_chart(real_users_chart(found.value), key="real_users_chart")


st.title("Per-round TTFT")
config = data.settings()
if not ui.failed(config):
    names = [t.name for t in config.value.targets]
    picked = st.multiselect("Targets", names, default=names, key="per_round_targets")
    seconds = ui.time_range("per_round_range")
    per_round(picked, seconds)
    real_users(seconds)
