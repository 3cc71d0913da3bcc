"""Experiment: the source article's A/B run (`kvwatch experiment`) of two configured targets: load a
report, or run one.

Viewers pick targets of the config and a directory under its report directory, nothing else: a URL, an
API key source or a path typed here could send the server's keys anywhere or write anywhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import plotly.express as px
import streamlit as st

from kvwatch.config.settings import Target
from kvwatch.core.redaction import redact
from kvwatch.dashboard import data, ui


def route(target: Target) -> str:
    return f"{target.name} ({target.route_mode}, {redact(target.base_url)})"


def _shown(value: float, scale: float = 1000, digits: int = 0) -> str:
    """A figure of the report's CSVs, in ms by default; "-" where it is unknown (an empty cell)."""
    return "-" if math.isnan(value) else f"{value * scale:.{digits}f}"


def show_load(report: data.Report) -> None:
    """Each route's throughput and tail TTFT (load.csv) and the requests each replica served
    (replicas.csv): whether the load reached every replica, and what it did to the tail."""
    if report.load is not None:
        for column, row in zip(st.columns(len(report.load)), report.load.to_dict("records"), strict=True):
            column.metric(f"{row['route']}: requests/s", _shown(row["requests_per_second"], 1, 2))
            low, high = _shown(row["ttft_p99_low_seconds"]), _shown(row["ttft_p99_high_seconds"])
            column.metric(
                f"{row['route']}: TTFT p99 (ms)",
                _shown(row["ttft_p99_seconds"]),
                help=f"Over all its rounds, bootstrap 95 % interval {low}–{high} ms; median "
                f"{_shown(row['ttft_median_seconds'])} ms, p90 {_shown(row['ttft_p90_seconds'])} ms.",
            )
    if report.replicas is not None:
        figure = px.bar(
            report.replicas,
            x="replica",
            y="requests",
            color="route",
            barmode="group",
            labels={"replica": "", "requests": "requests served"},
            height=300,
            color_discrete_sequence=ui.SERIES_COLORS,
        )
        st.plotly_chart(figure, key="experiment_replicas")


def run_form(targets: tuple[Target, ...], out: Path) -> None:
    """Run the experiment into `out`, by default A a route meant to spread sessions and B a sticky one."""
    if len(targets) < 2:
        ui.empty(f"The experiment runs two probe targets of {data.config_path()}; it has {len(targets)}.")
        return
    a = next((i for i, t in enumerate(targets) if not t.expect_sticky), 0)
    others = [i for i in range(len(targets)) if i != a]
    b = next((i for i in others if targets[i].expect_sticky), others[0])
    with st.form("experiment_run"):
        left, right = st.columns(2)
        route_a = left.selectbox("Route A", targets, a, format_func=route, key="experiment_a")
        route_b = right.selectbox("Route B", targets, b, format_func=route, key="experiment_b")
        sessions, rounds, seed = st.columns(3)
        chosen = (
            sessions.number_input("Sessions per route", 1, 500, 20, key="experiment_sessions"),
            rounds.number_input("Rounds", 2, 50, 6, key="experiment_rounds"),
            seed.number_input("Seed", 0, None, 0, key="experiment_seed"),
        )
        concurrency, rate = st.columns(2)
        chosen += (
            concurrency.number_input(
                "Sessions in flight per route",
                1,
                500,
                None,
                placeholder="one at a time over both routes",
                key="experiment_concurrency",
                help="`--concurrency`: empty, no cap with a request rate, else one session at a time over "
                "both routes, interleaved",
            ),
            rate.number_input(
                "Sessions arriving per second per route",
                0.01,
                None,
                None,
                0.5,
                placeholder="all at the start",
                key="experiment_request_rate",
                help="`--request-rate`: seeded exponential gaps (a Poisson process); empty, all at the start",
            ),
        )
        if not st.form_submit_button("Run the experiment", type="primary"):
            return
    with st.spinner("Running the same sessions through both routes…"):
        ran = data.run_experiment(route_a, route_b, out, *chosen)
    if ran.value:  # some sessions failed: how many, and why
        st.warning("  \n".join(ran.value), icon=":material/warning:")
    elif not ui.failed(ran):
        st.success("Done: the report is below.")


st.title("A/B experiment")
st.caption(
    "The same seeded sessions through route A and route B, one at a time or under the load you set: "
    "per-round median, p90 and p99 TTFT with bootstrap 95 % intervals, cache reuse and stickiness, each "
    "route's throughput and the requests each replica served (`kvwatch experiment`). Each route is a "
    "probe target of the config, with its own URL, API key and session settings."
)
config = data.settings()
if not ui.failed(config):
    root = config.value.dashboard.report_directory
    name = st.text_input(f"Report directory, under {root}", "", key="experiment_dir")
    directory = data.report_directory(name)
    if not ui.failed(directory):
        with st.expander("Run a new experiment", expanded=False):
            run_form(config.value.targets, directory.value)
        report = data.experiment_report(directory.value)
        if not ui.failed(report):
            if report.value is None:
                ui.empty(f"No experiment report in {root / name} yet: run one above.")
            else:
                if report.value.plot:
                    st.image(report.value.plot)
                show_load(report.value)
                st.markdown(report.value.markdown)
