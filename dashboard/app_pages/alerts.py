"""Alerts: what Alertmanager holds now and what kvwatch's webhook received, each with its runbook."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvwatch.dashboard import data, ui

COLUMNS = {
    "received_at": st.column_config.DatetimeColumn("received (UTC)", format=ui.TIME_FORMAT),
    "alertname": "alert",
    "severity": "severity",
    "state": "state",
    "target": "target",
    "instance": "instance",
    "starts_at": st.column_config.DatetimeColumn("since (UTC)", format=ui.TIME_FORMAT),
    "summary": "summary",
    "runbook_url": "runbook",
}


def show(alerts: pd.DataFrame, key: str) -> None:
    """The alerts, each instance named as the lab and the alert descriptions name a replica, and the
    cluster each is about where they carry the cluster label (several clusters, one Alertmanager)."""
    alerts = data.of_picked_cluster(alerts)
    shown = dict(COLUMNS)
    label = data.cluster_label()
    if label in alerts and alerts[label].notna().any():
        at = list(shown).index("target")  # what the alert is about: its cluster, then its route or instance
        shown = dict([*list(shown.items())[:at], (label, "cluster"), *list(shown.items())[at:]])
    columns = [c for c in shown if c in alerts]
    named = ui.named_replicas(alerts[columns], data.span(0))
    st.dataframe(named, hide_index=True, column_config=shown, key=key)


def show_or_why_none(alerts: data.Result, key: str, why_none: str) -> None:
    """The alerts, or what their absence means; a failed read says so itself."""
    if not ui.failed(alerts):
        if alerts.value.empty:
            ui.empty(why_none)
        else:
            show(alerts.value, key)


def runbooks(alerts: pd.DataFrame) -> None:
    """Each alert's runbook: a link that opens it, and kvwatch's own section in place."""
    for name, url in alerts[["alertname", "runbook_url"]].dropna().drop_duplicates("alertname").values:
        with st.expander(f"Runbook: {name}"):
            st.link_button("Open the runbook", url)
            section = data.runbook(url)
            if not ui.failed(section) and section.value:
                st.markdown(section.value)


st.title("Alerts")
st.subheader("Now, in Alertmanager")
held = data.alerts()
show_or_why_none(
    held,
    "alerts_now",
    "Alertmanager holds no alert: nothing is firing (not even Watchdog, so check that Prometheus sends "
    "it alerts).",
)

st.subheader("Received by kvwatch's webhook")
over = data.span(ui.time_range("alerts_range", default="1 day"))
received = data.received_alerts(over.start)
show_or_why_none(
    received,
    "alerts_received",
    "kvwatch's webhook received no alert in this range (Alertmanager sends to POST /alerts on the "
    "exporter's address).",
)

shown = [r.value for r in (held, received) if not r.error and not r.value.empty]
if shown:
    runbooks(pd.concat(shown))
