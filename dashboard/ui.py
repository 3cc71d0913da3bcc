"""Widgets and formats the pages share: the time-range picker, error and empty states, metric tiles with
the alerts' verdicts, and the faults and alerts marked on charts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvwatch.alerts import verdicts
from kvwatch.collectors.probe.records import REUSED_SHARE
from kvwatch.core.naming import plural, replica_name
from kvwatch.dashboard import data
from kvwatch.prometheus import queries

TIME_FORMAT = "YYYY-MM-DD HH:mm:ss"  # for st.column_config.DatetimeColumn; times are UTC
RANGES = {"15 min": 900, "1 hour": 3600, "6 hours": 6 * 3600, "1 day": 86400, "1 week": 7 * 86400}


def cluster_picker() -> None:
    """The cluster to show, in the sidebar of every page, where Prometheus scrapes more than one: every
    Prometheus read of the pages follows it (data.in_cluster)."""
    found = data.clusters()
    if not found.error and len(found.value) > 1:
        st.sidebar.selectbox("Cluster", [data.ALL_CLUSTERS, *found.value], key=data.PICKED_CLUSTER)


def time_range(key: str, default: str = "1 hour") -> int:
    """A time-range picker; returns its length in seconds."""
    picked = st.segmented_control("Time range", list(RANGES), default=default, key=key, required=True)
    return RANGES[picked]


def failed(result: data.Result) -> bool:
    """Show the result's error, if it has one, in place of what would have been drawn."""
    if result.error:
        st.error(result.error, icon=":material/error:")
    return result.error is not None


def empty(message: str) -> None:
    st.info(message, icon=":material/hourglass_empty:")


def as_of(at: float) -> str:
    return pd.Timestamp(at, unit="s", tz="UTC").strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class Unit:
    """How a tile writes its value and a change of it."""

    value: Callable[[float], str]
    change: Callable[[float], str]


RATIO = Unit(lambda v: f"{v:.0%}", lambda d: f"{d * 100:+.0f} pp")
FACTOR = Unit(lambda v: f"{v:.2f}×", lambda d: f"{d:+.2f}×")


@dataclass(frozen=True)
class Verdict:
    """The words under a number, in the colour of its alert's state."""

    color: str  # green, orange or red as the alert says; blue while a fixed signal's alert is held; gray
    text: str

    def show(self) -> None:
        st.markdown(f":{self.color}[{self.text}]")


def clock(at: pd.Timestamp) -> str:
    return at.strftime("%H:%M:%S UTC")


def matching(frame: pd.DataFrame, **labels: str) -> pd.DataFrame:
    """The rows of a query's answer whose labels have these values (none where a label is missing)."""
    for name, value in labels.items():
        frame = frame[frame[name] == value] if name in frame else frame.iloc[0:0]
    return frame


def now_firing(firing: pd.DataFrame, name: str, labels: dict[str, str]) -> pd.Series | None:
    """Of `firing` (data.firing_alerts), the alert of that name whose labels include `labels`: held by
    its keep_firing_for where any such one is, else firing; None where none fires now."""
    rows = matching(firing, alertname=name, **labels)
    if rows.empty:
        return None
    return rows.iloc[0] if rows["stopped_at"].isna().any() else rows.sort_values("clears_at").iloc[-1]


def resolving(name: str, held: pd.Series) -> str:
    """What a held alert's verdict says: the signal is healthy again, and when the alert clears."""
    return (
        f"Healthy again since {clock(held['stopped_at'])}: {name} still fires, held by its "
        f"keep_firing_for of {held['keep_firing_for']:g} s, and clears at {clock(held['clears_at'])}."
    )


def judge(
    verdict: verdicts.Verdict,
    states: pd.DataFrame,
    ok: str,
    firing: pd.DataFrame | None = None,
    paused: pd.DataFrame | None = None,
    **labels: str,
) -> Verdict:
    """What the alert behind `verdict` says now of the series with these labels, from `states` (its
    `verdict.state` at the page's time): red while it fires, orange while pending, `ok` in green. Where
    `firing` (data.firing_alerts, now) is given, blue once the signal is healthy again while the alert
    still fires: held by its keep_firing_for, with when it clears, or cleared since the page's time.
    Where `paused` (the verdict's pausing series, now) has a row, gray with why it does not judge."""
    alert = verdict.alert
    rows = matching(states, **labels)
    if rows.empty and verdict.paused and paused is not None and not paused.empty:
        return Verdict("gray", verdict.paused[1])
    if rows.empty:
        blind = f"{verdicts.NOT_WATCHING}: Prometheus holds no series {alert.name} judges here now."
        return Verdict("gray", blind)
    state = rows["value"].iloc[0]
    if state == verdicts.FIRING:
        now = None if firing is None else now_firing(firing, alert.name, {**(alert.labels or {}), **labels})
        if firing is not None and now is None:
            return Verdict(
                "blue", f"Healthy again: {alert.name} fired at this page's time and has cleared since."
            )
        if now is not None and pd.notna(now["stopped_at"]):
            return Verdict("blue", resolving(alert.name, now))
        return Verdict("red", f"{alert.name} fires: {alert.summary}")
    if state == verdicts.PENDING:
        lasts = f"its condition holds, and it fires once that lasts {alert.for_}"
        return Verdict("orange", f"{alert.name} is pending: {lasts}.")
    return Verdict("green", ok)


def tile(
    label: str, points: pd.DataFrame, at: float, unit: Unit, verdict: Verdict, help: str, rise: str
) -> None:
    """A bordered metric: its value at `at`, its change over the points and the points as a sparkline,
    both coloured by what a rise means (`rise`, one of RISES), whatever the verdict below says: a ratio
    that should be high is red as it falls, even while its alert finds it fine; "no data" when there
    is no point at `at`."""
    now = points[points["time"] == pd.Timestamp(at, unit="s", tz="UTC")]["value"]
    with st.container(border=True):
        if now.empty:
            st.metric(label, "no data", help=help)
            st.caption("No sample now: no traffic, or no probe result in the window yet.")
        else:
            value = float(now.iloc[0])
            change = value - float(points["value"].iloc[0])
            moved = unit.change(change).lstrip("+-") != unit.change(0).lstrip("+-")  # "-0 pp" did not move
            st.metric(
                label,
                unit.value(value),
                delta=unit.change(change) if moved else None,
                delta_color=RISES[rise],
                chart_data=points["value"].tolist(),
                help=f"{help} The change and the line are over the chosen time range.",
            )
        verdict.show()


# What a rise of a number means, as Streamlit's delta_color: green up or down, or grey for neither.
GOOD, BAD, NEUTRAL = "good", "bad", "neutral"
RISES = {GOOD: "normal", BAD: "inverse", NEUTRAL: "off"}
# Lines and bars of things with no good or bad to them (instances, targets, sources) never take the
# red, green or orange that verdicts and marks mean.
SERIES_COLORS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#aec7e8")


# What a session's stickiness was judged by (collectors.probe.records.EVIDENCE), as the pages say it.
EVIDENCE_WORDS = {
    "replica": "judged by replica identity: each round named the replica that served it",
    "reuse": "judged by reuse: no round named its replica (SageMaker names none)",
    "none": "not judged: no round named its replica, and no warm round reported cached tokens",
}


def stickiness_evidence(sessions: pd.DataFrame, target: str) -> str | None:
    """What the stickiness of `target`'s sessions (data.sessions) was judged by, and for those judged by
    reuse what their warm rounds cached against what a replica holding the conversation would have;
    None without a session of it."""
    mine = sessions[sessions["target"] == target] if len(sessions) else sessions
    if mine.empty:
        return None
    said = []
    for kind, words in EVIDENCE_WORDS.items():
        judged = mine[mine["evidence"] == kind]
        if not judged.empty:
            figures = reuse_figures(judged) if kind == "reuse" else ""
            said.append(f"{plural(len(judged), 'session')} {words}{figures}.")
    return " ".join(said)


def reuse_figures(judged: pd.DataFrame) -> str:
    """The warm rounds' cached against ideal tokens of sessions judged by reuse, the judgment's grounds."""
    cached, ideal, rounds, reused = (
        int(judged[column].sum())
        for column in ("warm_cached_tokens", "warm_ideal_cached_tokens", "warm_rounds", "warm_rounds_reused")
    )
    if not ideal:
        return ""
    return (
        f"; their warm rounds cached {cached:,} of the {ideal:,} tokens a replica holding the conversation "
        f"would have ({cached / ideal:.0%}), and {reused} of {plural(rounds, 'warm round')} at least "
        f"{REUSED_SHARE:.0%} of theirs"
    )


NO_EVENTS = pd.DataFrame({"time": pd.Series(dtype="datetime64[ns, UTC]"), "kind": [], "text": []})
EVENT_COLORS = {"fault": "#9467bd", "heal": "#2ca02c", "firing": "#d62728", "resolved": "#1f77b4"}


def replica_namer(over: data.Span) -> Callable[[object], object]:
    """What names a replica's address as the lab and the alerts do, `r2 (127.0.0.1:20812)`, where
    Prometheus' target carries a `replica` label (the lab's do); any other value as it is."""
    found = data.instant(queries.REPLICA_IDS, over)
    known = found.value[["instance", "replica"]] if not (found.error or found.value.empty) else pd.DataFrame()
    ids = dict(known.itertuples(index=False))
    return lambda address: replica_name(address, ids[address]) if address in ids else address


def named_replicas(frame: pd.DataFrame, over: data.Span) -> pd.DataFrame:
    """`frame` with each instance named by `replica_namer`, for the charts and tables that show them; led
    by its cluster, `a / r2 (...)`, while all clusters are shown and `frame` holds several, so that no
    chart or table mixes two clusters' instances."""
    if "instance" not in frame:  # no instance column while no engine serves
        return frame
    named = frame["instance"].map(replica_namer(over))
    label = data.cluster_label()
    if data.picked_cluster() is None and label in frame and frame[label].nunique() > 1:
        named = named.where(frame[label].isna(), frame[label].astype(str) + " / " + named.astype(str))
    return frame.assign(instance=named)


def fault_text(fault: pd.Series) -> str:
    """`fault kill-replica r2 (127.0.0.1:20812)`: an entry of the lab's fault log, naming its replica as
    the lab does (an entry logged before the lab logged addresses names the id alone)."""
    replica, address = (None if pd.isna(fault.get(key)) else fault[key] for key in ("replica", "address"))
    return " ".join(filter(None, (fault["action"], fault["fault"], replica_name(address, replica))))


def events(over: data.Span, unread: str = "Not marked on the charts") -> pd.DataFrame:
    """What happened in the span, to mark on charts: the lab's faults and heals, and the kvwatch alerts
    the webhook received, firing at their start and resolved at their end. Columns time, kind, text.
    A source that cannot be read is named after `unread`, and the rest is shown."""
    found = []
    faults, alerts = data.faults(over.start), data.received_alerts(over.start)
    for result in faults, alerts:
        if result.error:
            st.caption(f"{unread}: {result.error}")
    if not faults.error:
        fault = faults.value
        found.append(
            fault.assign(kind=fault["action"], text=[fault_text(row) for _, row in fault.iterrows()])
        )
    if not alerts.error and not alerts.value.empty:
        alert = alerts.value[alerts.value["alertname"].str.startswith("KVWatch")]
        found.append(
            alert.assign(
                time=alert["starts_at"].where(alert["state"] == "firing", alert["ends_at"]),
                kind=alert["state"],
                text=alert["alertname"] + " " + alert["state"],
            )
        )
    frame = pd.concat([f[["time", "kind", "text"]] for f in found if not f.empty] or [NO_EVENTS])
    # Alertmanager times alerts to the nanosecond; the charts draw microseconds and warn at the rest.
    frame["time"] = pd.to_datetime(frame["time"], utc=True).dt.floor("us")
    start, end = (pd.Timestamp(t, unit="s", tz="UTC") for t in over[:2])
    # Alertmanager repeats a firing alert to the webhook: one mark for each start and end.
    return frame[frame["time"].between(start, end)].drop_duplicates(["time", "text"], ignore_index=True)


LABEL_PX = 14  # the width of a marker's label, written upwards in 10 px type
CHART_PX = 1000  # about the width a chart's time axis gets on the page


def grouped(marks: pd.DataFrame, span_seconds: float) -> list[pd.DataFrame]:
    """The events of `marks` in groups whose labels would overlap, newest first: labels sit left of
    their group's newest event, each LABEL_PX wide on a chart about CHART_PX wide, so an older event
    joins the group while it is closer than the group's labels are wide."""
    per_label = pd.Timedelta(seconds=span_seconds * LABEL_PX / CHART_PX)
    groups: list[list[int]] = []
    marks = marks.reset_index(drop=True)
    times = marks["time"].sort_values(ascending=False, kind="stable")
    for index, at in times.items():
        if groups and times[groups[-1][0]] - at < per_label * len(groups[-1]):
            groups[-1].append(index)
        else:
            groups.append([index])
    return [marks.loc[group] for group in groups]


def shown_seconds(figure: go.Figure, marks: pd.DataFrame) -> float:
    """How many seconds the chart's time axis shows: from its first point or mark to its last."""
    drawn = [pd.to_datetime(pd.Series(trace.x), utc=True) for trace in figure.data if len(trace.x)]
    times = pd.concat([*drawn, pd.to_datetime(marks["time"], utc=True)])
    return (times.max() - times.min()).total_seconds() if len(times) else 0.0


def mark(figure: go.Figure, marks: pd.DataFrame) -> go.Figure:
    """A dotted line for each event of `events()`, and labels at the top of the chart that do not
    overlap: events too close to be told apart on the chart's time axis share one label, a line of text
    each, the newest nearest its line."""
    for event in marks.itertuples():
        color = EVENT_COLORS.get(event.kind, "gray")
        figure.add_shape(
            type="line", x0=event.time, x1=event.time, y0=0, y1=1, yref="paper",
            line={"color": color, "dash": "dot", "width": 1},
        )  # fmt: skip
    for group in grouped(marks, shown_seconds(figure, marks)):
        colors = {EVENT_COLORS.get(kind, "gray") for kind in group["kind"]}
        figure.add_annotation(
            x=group["time"].iloc[0], y=1, yref="paper", text="<br>".join(group["text"][::-1]),
            showarrow=False,
            textangle=-90, xanchor="right", yanchor="top",
            font={"size": 10, "color": colors.pop() if len(colors) == 1 else "gray"},
        )  # fmt: skip
    return figure
