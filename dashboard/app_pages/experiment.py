"""Experiment: the source article's A/B run (`kvwatch experiment`): load a report it wrote, or run one."""

from __future__ import annotations

import streamlit as st

from collectors.config import Target
from dashboard import data, ui

DEFAULT_OUT = ".kvwatch/experiment"


def run_form(targets: tuple[Target, ...], out: str) -> None:
    """Run `kvwatch experiment` into `out`, the configured routes as defaults: A round robin, B affinity."""
    by_mode = {t.route_mode: t for t in targets}
    a, b = by_mode.get("round_robin"), by_mode.get("affinity")
    with st.form("experiment_run"):
        left, right = st.columns(2)
        a_url = left.text_input("Route A: base URL", a.base_url if a else "", key="experiment_a")
        label_a = left.text_input("Route A: label", "round_robin", key="experiment_label_a")
        b_url = right.text_input("Route B: base URL", b.base_url if b else "", key="experiment_b")
        label_b = right.text_input("Route B: label", "affinity", key="experiment_label_b")
        model = left.text_input("Model", (b or a).model if b or a else "", key="experiment_model")
        key_env = right.text_input("API key: environment variable (optional)", key="experiment_key_env")
        sessions, rounds, seed = st.columns(3)
        numbers = {
            "--sessions": sessions.number_input("Sessions per route", 1, 500, 20, key="experiment_sessions"),
            "--rounds": rounds.number_input("Rounds", 2, 50, 6, key="experiment_rounds"),
            "--seed": seed.number_input("Seed", 0, None, 0, key="experiment_seed"),
        }
        if not st.form_submit_button("Run the experiment", type="primary"):
            return
    args = ["--a", a_url, "--b", b_url, "--label-a", label_a, "--label-b", label_b, "--model", model]
    args += [str(x) for flag, value in numbers.items() for x in (flag, value)]
    args += ["--api-key-env", key_env] if key_env else []
    with st.spinner("Running the same sessions through both routes…"):
        ran = data.run_experiment(out, *args)
    if ran.value:  # some sessions failed: what kvwatch experiment said about them
        st.warning(ran.value, icon=":material/warning:")
    elif not ui.failed(ran):
        st.success(f"Done: the report is in {out}.")


st.title("A/B experiment")
st.caption(
    "The same seeded sessions through route A and route B, interleaved: per-round TTFT with bootstrap "
    "95 % intervals, cache reuse and stickiness (`kvwatch experiment`)."
)
directory = st.text_input("Report directory", DEFAULT_OUT, key="experiment_dir")
config = data.settings()
with st.expander("Run a new experiment", expanded=False):
    if not ui.failed(config):
        run_form(config.value.targets, directory)

report = data.experiment_report(directory)
if not ui.failed(report):
    if report.value is None:
        ui.empty(
            f"No experiment report in {directory} yet: run one above, or "
            f"`kvwatch experiment --a URL --b URL --out {directory}`."
        )
    else:
        if report.value.plot:
            st.image(report.value.plot)
        st.markdown(report.value.markdown)
