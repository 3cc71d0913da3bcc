"""Sessions: the recent probe sessions of one target, what their stickiness was judged by (the replica
each round named, or the warm rounds' reuse), the backend each round landed on (a switch is where a
session lost its cache), their lives (an idle past the route's TTL and what followed, their close), and
one session's rounds in detail."""

from __future__ import annotations

import itertools

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvwatch.core.naming import plural
from kvwatch.dashboard import data, ui

TIMELINE_SESSIONS = 30
SESSION_COLUMNS = {
    "id": "#",
    "started_at": st.column_config.DatetimeColumn("started (UTC)", format=ui.TIME_FORMAT),
    "ok": "succeeded",
    "sticky": "on one replica",
    "evidence": "judged by",  # replica (each round named it), reuse (the warm rounds' cached tokens), none
    "warm_rounds": "warm rounds",  # those reuse judges: rounds 2+ with cached tokens and an ideal above 0
    "warm_cached_tokens": "warm cached tokens",
    "warm_ideal_cached_tokens": "warm ideal cached tokens",
    "backend_switches": "backend switches",
    "session_id_echoed": "session id echoed",
    "error_kind": "error",
    "interrupted": "cut short",  # kvwatch serve stopped or died mid-session: its finished rounds are stored
    "in_flight": "running",  # stored round by round, not ended yet
    "session_id": "session id",
}
SWITCH_COLOR = "#d62728"
# An idled session's life (collectors.probe.lifecycle), as the store keeps it.
LIFE_COLUMNS = {
    "id": "#",
    "started_at": st.column_config.DatetimeColumn("started (UTC)", format=ui.TIME_FORMAT),
    "idle_after_round": "idled after round",
    "idle_seconds": st.column_config.NumberColumn("idle (s)", format="%.1f"),
    "idle_expiry": "the route said",  # expired, not_found, closed; empty: nothing (a router forgets silently)
    "idle_cold": "next round cold",  # cached under half of the history the session held: a full prefill
    "idle_new_replica": "on another replica",
    "idle_repinned": "stuck again after",
    "idle_as_expected": "as expected",  # cold, then stuck again: the source article's expectation
    "close_gone": "gone after its close",
}


def labels(sessions: pd.DataFrame) -> dict[int, str]:
    """Each session's name in the timeline and the picker, `18:00:00 #12`; at once for a day of them."""
    return dict(
        zip(
            sessions["id"],
            sessions["started_at"].dt.strftime("%H:%M:%S") + " #" + sessions["id"].astype(str),
            strict=True,
        )
    )


def timeline(sessions: pd.DataFrame, rounds: pd.DataFrame) -> go.Figure:
    """One row per session, one square per round coloured by backend, a red bar where the backend changed."""
    named = labels(sessions)
    shown = rounds[rounds["session"].isin(named)].assign(
        row=lambda r: r["session"].map(named),
        backend=lambda r: r["backend"].astype(object).fillna("unknown"),  # all NaN where none is named
    )
    served = shown[shown["error_kind"].isna()]
    previous = served.groupby("session")["backend"].shift()
    switches = served[previous.notna() & (served["backend"] != previous)]
    figure = go.Figure()
    # Backends in colours that mean nothing good or bad: red is the switch's.
    for (backend, cells), color in zip(served.groupby("backend"), itertools.cycle(ui.SERIES_COLORS)):
        figure.add_scatter(
            x=cells["round"],
            y=cells["row"],
            mode="markers",
            name=backend,
            marker={"symbol": "square", "size": 18, "color": color},
        )
    failed = shown[shown["error_kind"].notna()]
    if len(failed):
        figure.add_scatter(
            x=failed["round"],
            y=failed["row"],
            mode="markers",
            name="failed",
            marker={"symbol": "x", "size": 14, "color": "black"},
            text=failed["error_kind"],
        )
    figure.add_scatter(
        x=switches["round"] - 0.5,
        y=switches["row"],
        mode="markers",
        name="backend switch",
        marker={"symbol": "line-ns", "size": 22, "line": {"width": 4, "color": SWITCH_COLOR}},
    )
    figure.update_layout(
        xaxis={"title": "round", "dtick": 1},
        yaxis={"title": "", "categoryorder": "array", "categoryarray": list(named.values())[::-1]},
        height=max(220, 24 * len(named) + 120),
        margin={"t": 10},
        legend={"orientation": "h", "y": -0.15},
    )
    return figure


def detail(rounds: pd.DataFrame) -> pd.DataFrame:
    """One session's rounds as the probe saw them, TTFT in ms and cached tokens next to the ideal."""
    return pd.DataFrame(
        {
            "round": rounds["round"],
            "TTFT (ms)": rounds["ttft_seconds"] * 1000,
            "prompt tokens": rounds["prompt_tokens"].astype("Int64"),
            "cached tokens": rounds["cached_tokens"].astype("Int64"),
            "ideal cached tokens": rounds["ideal_cached_tokens"].astype("Int64"),
            "backend": rounds["backend"],
            "router's pin": rounds["pin_outcome"],
            "status": rounds["status"].astype("Int64"),
            "error": rounds["error_kind"],
            "error detail": rounds["error_detail"],
        }
    )


def pins_said(rounds: pd.DataFrame) -> str | None:
    """What the router itself said of the sessions' pins, beside kvwatch's verdict above; None where no
    round's response reported one (only routers such as olla do)."""
    outcomes = rounds["pin_outcome"].dropna().value_counts() if "pin_outcome" in rounds else pd.Series()
    if outcomes.empty:
        return None
    counted = ", ".join(f"{outcome} {count}" for outcome, count in sorted(outcomes.items()))
    return f"The router reported its pin in {plural(int(outcomes.sum()), 'round')}: {counted}."


def _count(column: pd.Series, value: object = True) -> int:
    return int((column == value).sum())


def life_summary(sessions: pd.DataFrame) -> list[str]:
    """What the sessions' lives showed, a line each: route sessions lost and opened anew, the idles past
    the TTL and what followed, and the closes (those checked: gone or left alive)."""
    lines = []
    losses = sessions["session_losses"].dropna().explode().dropna()
    if len(losses):
        kinds = losses.map(lambda loss: loss[1]).value_counts().sort_index()
        counted = ", ".join(f"{kind} {count}" for kind, count in kinds.items())
        lines.append(
            f"Route sessions lost and opened anew before a round: {counted} (those rounds count as cold)."
        )
    idled = sessions[sessions["idle_after_round"].notna()]
    if len(idled):
        said, cold = _count(idled["idle_expiry"].notna()), _count(idled["idle_cold"])
        moved, stuck = _count(idled["idle_new_replica"]), _count(idled["idle_repinned"])
        expected, judged = _count(idled["idle_as_expected"]), int(idled["idle_as_expected"].notna().sum())
        lines.append(
            f"{plural(len(idled), 'session')} idled past the route's session TTL: the route said the session "
            f"was gone in {said}, the next round was cold in {cold} and on another replica in {moved}, the "
            f"session stuck again after it in {stuck}; as expected (cold, then stuck again) in {expected} of "
            f"the {judged} judged."
        )
    closable = sessions["closed"].dropna()
    if len(closable):
        checked = sessions["close_gone"].dropna()
        gone = f"; {_count(checked)} of {len(checked)} checked were gone after it" if len(checked) else ""
        alive = _count(checked, False)
        lines.append(
            f"Sessions closed at the end: {_count(closable)} of {len(closable)}{gone}"
            + (f", {alive} left ALIVE by their close." if alive else ".")
        )
    return lines


def lives(sessions: pd.DataFrame) -> None:
    """The sessions' lives, where any session idled, lost or closed its route session."""
    lines = life_summary(sessions)
    if not lines:
        return
    st.subheader("Session life")
    for line in lines:
        st.caption(line)
    idled = sessions[sessions["idle_after_round"].notna()]
    if len(idled):
        st.dataframe(idled[list(LIFE_COLUMNS)], hide_index=True, column_config=LIFE_COLUMNS, key="lives")


def named_rounds(
    over: data.Span, since: float, target: str, session: int | None = None
) -> pd.DataFrame | None:
    """The rounds of `target`'s sessions since `since` (or of the one session), each backend named as
    the lab names its replica; None when the store failed, as the page then says."""
    found = data.rounds(since, target, session)
    if ui.failed(found):
        return None
    return found.value.assign(backend=found.value["backend"].map(ui.replica_namer(over)))


@st.fragment(run_every=data.REFRESH_SECONDS)
def recent(target: str, seconds: int) -> None:
    over = data.span(seconds)
    found = data.sessions(over.start)
    if ui.failed(found):
        return
    sessions = found.value
    sessions = sessions[sessions["target"] == target] if not sessions.empty else sessions
    if sessions.empty:
        ui.empty(f"No probe sessions through {target} in this range yet.")
        return
    shown = sessions.head(TIMELINE_SESSIONS)
    rounds = named_rounds(over, shown["started_at"].min().timestamp(), target)  # not the whole range's
    if rounds is None:
        return
    judged = sessions["sticky"].dropna()
    switches = plural(int(sessions["backend_switches"].fillna(0).sum()), "backend switch", "backend switches")
    st.caption(
        f"{plural(len(sessions), 'session')} since {ui.as_of(over.start)}; "
        + (f"{judged.mean():.0%} stayed on one replica; " if len(judged) else "")
        + f"{switches}; {int((~sessions['ok']).sum())} failed."
    )
    st.caption(ui.stickiness_evidence(sessions, target))
    if said := pins_said(rounds):
        st.caption(said)
    st.subheader("Backend per round")
    st.plotly_chart(timeline(shown, rounds), key="sessions_timeline")

    st.subheader("Recent sessions")
    st.dataframe(sessions[list(SESSION_COLUMNS)], hide_index=True, column_config=SESSION_COLUMNS)
    lives(sessions)

    st.subheader("One session")
    named = labels(sessions)
    picked = st.selectbox("Session", list(named), format_func=named.get, key="sessions_pick")
    rounds = named_rounds(over, over.start, target, picked)
    if rounds is None:
        return
    rows = detail(rounds)
    st.table(rows.style.format({"TTFT (ms)": "{:.1f}"}, na_rep="–").hide())


st.title("Sessions")
config = data.settings()
if not ui.failed(config):
    names = [t.name for t in config.value.targets]
    if not names:
        ui.empty(f"No probe targets in {data.config_path()}.")
    else:
        target = st.selectbox("Target", names, key="sessions_target")
        recent(target, ui.time_range("sessions_range"))
