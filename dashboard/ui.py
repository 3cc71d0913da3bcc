"""Widgets and formats the pages share: the time-range picker, error and empty states, metric tiles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from dashboard import data

TIME_FORMAT = "YYYY-MM-DD HH:mm:ss"  # for st.column_config.DatetimeColumn; times are UTC
RANGES = {"15 min": 900, "1 hour": 3600, "6 hours": 6 * 3600, "1 day": 86400, "1 week": 7 * 86400}


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
COUNT = Unit(lambda v: f"{v:.0f}", lambda d: f"{d:+.0f}")


@dataclass(frozen=True)
class Verdict:
    good: bool | None  # None: neither, e.g. a round-robin baseline that is meant to look bad
    text: str

    def show(self) -> None:
        color = {True: "green", False: "red", None: "gray"}[self.good]
        st.markdown(f":{color}[{self.text}]")


def tile(
    label: str,
    points: pd.DataFrame,
    at: float,
    unit: Unit,
    verdict: Callable[[float], Verdict],
    help: str,
) -> None:
    """A bordered metric: its value at `at`, its change over the points and the points as a sparkline,
    both coloured by the verdict in words below; "no data" when there is no point at `at`."""
    now = points[points["time"] == pd.Timestamp(at, unit="s", tz="UTC")]["value"]
    with st.container(border=True):
        if now.empty:
            st.metric(label, "no data", help=help)
            st.caption("No sample now: no traffic, or no probe result in the window yet.")
            return
        value = float(now.iloc[0])
        judged = verdict(value)
        change = value - float(points["value"].iloc[0])
        moved = unit.change(change).lstrip("+-") != unit.change(0).lstrip("+-")  # "-0 pp" did not move
        # Streamlit colours a rise green ("normal") or red ("inverse"): pick whichever gives the verdict's.
        color = "off" if judged.good is None else "normal" if (change >= 0) == judged.good else "inverse"
        st.metric(
            label,
            unit.value(value),
            delta=unit.change(change) if moved else None,
            delta_color=color,
            chart_data=points["value"].tolist(),
            help=f"{help} The change and the line are over the chosen time range.",
        )
        judged.show()
