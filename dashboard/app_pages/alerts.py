"""Alerts: what Alertmanager holds now and what kvwatch's webhook received, each with its runbook; and
Watchdog apart, the alert that always fires: the alerting pipeline's heartbeat, not an alert to act on."""

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


HEARTBEAT = "Watchdog"  # alerts/alerts.py: `vector(1)`, always firing while the pipeline works


def without_heartbeat(alerts: data.Result) -> data.Result:
    """The alerts to act on: all but Watchdog."""
    if alerts.error or alerts.value.empty:
        return alerts
    return data.Result(alerts.value[alerts.value["alertname"] != HEARTBEAT])


def heartbeat(held: data.Result, received: data.Result) -> None:
    """Whether Watchdog, the alert that always fires, goes through: Alertmanager holds it while
    Prometheus evaluates kvwatch's rules and sends it their alerts, and the webhook receives it while
    Alertmanager's route to kvwatch works. Its absence is the pipeline's failure, not silence."""
    if held.error:
        return  # the table below names the failure
    beats = received.value[received.value["alertname"] == HEARTBEAT] if not received.error else None
    last = None if beats is None or beats.empty else beats["received_at"].max()
    if not (held.value["alertname"] == HEARTBEAT).any():
        st.warning(
            f"No heartbeat: Alertmanager does not hold {HEARTBEAT}, the alert that always fires. Prometheus "
            "does not load kvwatch's rules, or does not send its alerts to this Alertmanager: no kvwatch "
            "alert would reach you either.",
            icon=":material/heart_broken:",
        )
        return
    webhook = (
        f"kvwatch's webhook last received it at {ui.as_of(last.timestamp())}."
        if last is not None
        else "kvwatch's webhook has not received it in this range: check Alertmanager's route to it."
    )
    st.success(
        f"Heartbeat: Alertmanager holds {HEARTBEAT}, the alert that always fires, so Prometheus evaluates "
        f"kvwatch's rules and sends their alerts; {webhook}",
        icon=":material/monitor_heart:",
    )


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
pipeline = st.container()  # the heartbeat, once the webhook's alerts of the range are read
st.subheader("Now, in Alertmanager")
held = data.alerts()
show_or_why_none(
    without_heartbeat(held),
    "alerts_now",
    "Alertmanager holds no kvwatch alert: nothing is firing.",
)

st.subheader("Received by kvwatch's webhook")
over = data.span(ui.time_range("alerts_range", default="1 day"))
received = data.received_alerts(over.start)
show_or_why_none(
    without_heartbeat(received),
    "alerts_received",
    "kvwatch's webhook received no kvwatch alert in this range (Alertmanager sends to POST /alerts on the "
    "exporter's address).",
)
with pipeline:
    heartbeat(held, received)

shown = [r.value for r in map(without_heartbeat, (held, received)) if not r.error and not r.value.empty]
if shown:
    runbooks(pd.concat(shown))
