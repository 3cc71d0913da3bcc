"""The Per-round TTFT page: routes compared round by round, split at a fault, and real users' TTFT."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pandas as pd
import pytest
from fake_dashboard import (
    ALERT_AT,
    BROKEN,
    FAULT,
    HEAL_AT,
    SPAN_START,
    open_page,
    rounds_frame,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan
from streamlit.testing.v1 import AppTest

from conftest import decoded
from kvwatch.dashboard import stats, ui
from kvwatch.prometheus import panel_queries


def test_per_round_compares_routes_round_by_round(fake):
    at = open_page("per_round")
    assert not at.exception
    table = at.table[0].value
    assert list(table.columns) == ["lab-affinity", "lab-round-robin", "lab-affinity / lab-round-robin"]
    assert table.loc[1, "lab-affinity"] == pytest.approx(410)  # median of 0.40 and 0.42 s
    assert table.loc[3, "lab-round-robin"] == pytest.approx(605)
    assert table.loc[4, "lab-round-robin"] == pytest.approx(720)  # session 4 failed its round 4
    assert table.loc[2, "lab-affinity / lab-round-robin"] == pytest.approx(0.055 / 0.51)
    sessions = at.table[1].value  # the whole range: no split
    assert list(sessions.columns) == ["lab-affinity", "lab-round-robin"]
    assert list(sessions["lab-affinity"]) == [2, 2, 2, 2] and list(sessions["lab-round-robin"]) == [
        2,
        2,
        2,
        1,
    ]


def test_per_round_shows_only_the_picked_targets(fake):
    at = open_page("per_round")
    at.multiselect(key="per_round_targets").set_value(["lab-round-robin"]).run()
    assert list(at.table[0].value.columns) == ["lab-round-robin"]


SPLIT_COLUMNS = [f"{t} {p}" for t in ("lab-affinity", "lab-round-robin") for p in ("before", "after")]


def medians_and_counts(rounds: pd.DataFrame, split: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Median TTFT in ms and the number of rounds per round, target and period, straight from the rows."""
    fault = pd.Timestamp(split, unit="s", tz="UTC")
    rounds = rounds.assign(
        column=rounds["target"] + np.where(rounds["started_at"] < fault, " before", " after")
    )
    grouped = rounds.groupby(["round", "column"])["ttft_seconds"]
    return (grouped.median() * 1000).unstack()[SPLIT_COLUMNS], grouped.count().unstack()[SPLIT_COLUMNS]


def test_per_round_splits_at_a_fault_and_shows_the_change_with_session_counts(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    choice = at.selectbox(key="per_round_moment")
    assert choice.options == [
        "No split: the whole range",
        f"fault break-affinity, {ui.as_of(FAULT)}",
        f"KVWatchSessionAffinityBroken firing, {ui.as_of(SPAN_START + ALERT_AT)}",
        f"heal break-affinity, {ui.as_of(SPAN_START + HEAL_AT)}",
        "A time I pick (UTC)",
    ]
    choice.set_value(choice.options[1]).run()
    assert not at.exception
    medians, sessions = at.table[0].value, at.table[1].value
    expected_medians, expected_sessions = medians_and_counts(fake.history, FAULT)
    pd.testing.assert_frame_equal(medians[SPLIT_COLUMNS], expected_medians, check_names=False)
    pd.testing.assert_frame_equal(sessions, expected_sessions, check_names=False, check_dtype=False)
    assert list(sessions["lab-affinity before"]) == [3, 3, 2, 2]  # session 13's rounds 3 and 4 came after
    assert list(sessions["lab-affinity after"]) == [2, 2, 3, 3]
    # The change: affinity's warm rounds climb after the fault, round 1 and round robin hardly move.
    change = medians["lab-affinity after / before"]
    # Round 1: 0.40, 0.42, 0.40 before, 0.41, 0.43 after; round 3: 0.05, 0.04 before, 0.52, 0.61, 0.60 after.
    assert change[1] == pytest.approx(420 / 400) and change[3] == pytest.approx(600 / 45)
    assert medians["lab-round-robin after / before"].between(1, 1.06).all()
    assert "before 20" in texts(at) and "on the left and after it on the right" in texts(at)


def per_round_chart(at: AppTest) -> dict:
    """The per-round chart's plotly spec: data and layout."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("per_round_chart")]
    return json.loads(chart.proto.spec)


def chart_lines(at: AppTest) -> dict[tuple[str, str], list[float]]:
    """(panel's x axis, line name): y of every line of the per-round chart (its bands left out)."""
    lines = [t for t in per_round_chart(at)["data"] if t.get("fill") != "toself"]
    return {(t.get("xaxis", "x"), t["name"]): decoded(t["y"]) for t in lines}


def test_per_round_draws_before_and_after_side_by_side_with_their_bands(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    at.selectbox(key="per_round_moment").set_value(f"fault break-affinity, {ui.as_of(FAULT)}").run()
    lines = chart_lines(at)
    summary = stats.ttft_by_round(fake.history, FAULT).set_index(["target", "period", "round"])
    for axis, period in (("x", "before"), ("x2", "after")):
        for target in ("lab-affinity", "lab-round-robin"):
            for quantile in ("median", "p90"):
                drawn = lines[axis, f"{target} {quantile}"]
                assert drawn == pytest.approx(list(summary.loc[(target, period), quantile] * 1000))
    spec = per_round_chart(at)
    assert [a["text"] for a in spec["layout"]["annotations"]] == [
        f"before {ui.as_of(FAULT)}",
        f"after {ui.as_of(FAULT)}",
    ]
    bands = [t for t in spec["data"] if t.get("fill") == "toself"]
    assert len(bands) == 8  # a band for every line: 2 targets, median and p90, before and after
    after = summary.loc[("lab-affinity", "after")]  # the first band of the after panel: its median's
    drawn = decoded([t for t in bands if t.get("xaxis") == "x2"][0]["y"])
    assert drawn == pytest.approx(list(after["median_high"] * 1000) + list(after["median_low"][::-1] * 1000))


def test_per_round_splits_at_a_picked_time(fake):
    fake.history = rounds_frame(BROKEN)
    at = open_page("per_round")
    at.selectbox(key="per_round_moment").set_value("A time I pick (UTC)").run()
    picked = datetime.datetime.fromtimestamp(FAULT + 150, datetime.UTC).replace(tzinfo=None)
    at.datetime_input(key="per_round_at").set_value(picked).run()
    assert not at.exception
    sessions = at.table[1].value
    # Session 14 (at the fault + 100 s) is now before; 15 after.
    assert list(sessions["lab-affinity after"]) == [1, 1, 1, 1]
    assert list(sessions["lab-affinity before"]) == [4, 4, 4, 4]


def test_per_round_shows_real_users_ttft_by_round_per_gateway_listener(fake):
    fake.values[panel_queries.GATEWAY_FIRST_BYTE_BY_ROUND] = pd.DataFrame(
        {"log": ["gw"] * 4, "listener": ["affinity", "affinity", "round_robin", "round_robin"],
         "round": ["2", "1", "1", "8+"], "value": [0.03, 0.1, 0.1, 0.4]}
    )  # fmt: skip
    at = open_page("per_round")
    assert not at.exception
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("real_users_chart")]
    bars = {t["name"]: (t["x"], decoded(t["y"])) for t in json.loads(chart.proto.spec)["data"]}
    assert bars == {
        "gw / affinity": (["1", "2"], [pytest.approx(100), pytest.approx(30)]),
        "gw / round_robin": (["1", "8+"], [pytest.approx(100), pytest.approx(400)]),
    }


def test_per_round_says_when_no_gateway_log_timed_a_first_byte(fake):
    assert "No gateway log has timed a request's first byte yet" in texts(open_page("per_round"))
