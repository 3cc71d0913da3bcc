"""Doctor: `kvwatch doctor` against one configured target, each check with its evidence and its fix."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvwatch.core.redaction import redact
from kvwatch.dashboard import data, ui

SAMPLE = "Request sample (optional): a JSONL file of real request payloads, to find dynamic prompt prefixes"
STATUS_COLORS = {"pass": "#1b7f3b", "warn": "#b36b00", "fail": "#c62828", "skipped": "#757575"}


def findings(report: dict) -> None:
    causes = report["causes"]
    if causes:
        st.error(f"Causes found: {', '.join(causes)}", icon=":material/troubleshoot:")
    else:
        st.success(
            "No cause found: the route answers, keeps sessions on their replica and reuses their cache."
        )
    checks = pd.DataFrame(report["checks"], columns=["status", "name", "evidence", "fix"])
    color = {status: f"color: {color}; font-weight: bold" for status, color in STATUS_COLORS.items()}
    st.table(checks.style.map(color.get, subset=["status"]).hide())


st.title("Doctor")
st.caption("The source article's troubleshooting checklist, walked for you: reachability, auth, the answer's "
           "shape, then the silent causes of a hit rate stuck at zero.")  # fmt: skip
config = data.settings()
if not ui.failed(config):
    targets = {t.name: t for t in config.value.targets}
    if not targets:
        ui.empty(f"No probe targets in {data.config_path()} to examine.")
    else:
        target = targets[st.selectbox("Target", list(targets), key="doctor_target")]
        url = redact(target.base_url)
        sample = st.text_input(SAMPLE, key="doctor_sample")
        if st.button("Run the doctor", type="primary", key="doctor_run"):
            with st.spinner(f"Examining {url}…"):
                report = data.run_doctor(target, sample.strip())
            if not ui.failed(report):
                findings(report.value)
        else:
            ui.empty(f"The doctor sends a few short multi-turn sessions through {url} and reads "
                     "the engines' metrics in Prometheus; it takes some seconds.")  # fmt: skip
