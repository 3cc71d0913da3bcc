"""Overview: is the prefix cache reused, and do sessions stay on their replica? Each number with its
trend over the chosen range and a verdict in words, red where the alert thresholds say so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import streamlit as st

from collectors import queries
from collectors.queries import THRESHOLDS
from dashboard import data, ui
from dashboard.ui import Verdict

EFFICIENCY_GOOD = 0.8  # no alert watches it; below this an affinity route loses a fifth of its reuse


def hit_ratio(value: float) -> Verdict:
    if value < THRESHOLDS.hit_ratio_floor:
        return Verdict(
            False, "Almost nothing comes from the prefix cache: every request pays a full prefill."
        )
    return Verdict(True, f"{value:.0%} of prompt tokens come from the prefix cache.")


def firing(value: float) -> Verdict:
    if value:
        return Verdict(False, f"{value:.0f} kvwatch alert{'s' * (value != 1)} firing: see the Alerts page.")
    return Verdict(True, "No kvwatch alert is firing.")


# Per probe route. A route that is not an affinity route is the baseline: it is meant to look bad.
def sticky(value: float, affinity: bool) -> Verdict:
    if not affinity:
        return Verdict(None, "Not an affinity route: its sessions are expected to move.")
    if value < THRESHOLDS.sticky_ratio_below:
        return Verdict(False, "Sessions change replica between rounds: the gateway does not pin them.")
    return Verdict(True, "Sessions stay on their replica.")


def warm_cold(value: float, affinity: bool) -> Verdict:
    if not affinity:
        return Verdict(None, f"Warm rounds take {value:.0%} of round 1's time: the baseline to compare with.")
    if value > THRESHOLDS.warm_cold_ratio_above:
        return Verdict(False, "Warm rounds are as slow as round 1: their history is not reused.")
    return Verdict(True, f"Warm rounds take {value:.0%} of round 1's time: the history is reused.")


def efficiency(value: float, affinity: bool) -> Verdict:
    if not affinity:
        return Verdict(None, f"{value:.0%} of the history is reused where a round happens to land.")
    if value < EFFICIENCY_GOOD:
        return Verdict(False, f"Only {value:.0%} of what a pinned replica would hold is reused.")
    return Verdict(True, f"{value:.0%} of what a pinned replica holds is reused.")


@dataclass(frozen=True)
class RouteTile:
    label: str
    query: str
    unit: ui.Unit
    judge: Callable[[float, bool], Verdict]
    help: str


WINDOW = f"a window of {data.MIN_RATE_WINDOW_SECONDS // 60} minutes or more"
ROUTE_TILES = (
    RouteTile("Sessions on one replica", queries.PROBE_STICKY_SHARE, ui.RATIO, sticky,
              f"Share of the probe sessions whose rounds all landed on one replica, over {WINDOW}."),
    RouteTile("Warm / cold TTFT", queries.WARM_COLD_TTFT_RATIO, ui.FACTOR, warm_cold,
              "Median time to first token of rounds 2+ over round 1's, in the last probe run."),
    RouteTile("Affinity efficiency", queries.AFFINITY_EFFICIENCY, ui.RATIO, efficiency,
              "Cached tokens the engine reported in rounds 2+ over what a perfectly pinned replica would "
              f"have cached, over {WINDOW}."),
)  # fmt: skip
CLUSTER_HELP = f"Prompt tokens served from the prefix cache over all prompt tokens, over {queries.WINDOW}."
ALERTS_HELP = "kvwatch alerts firing in Prometheus now (not counting Watchdog, always on)."


@st.fragment(run_every=data.REFRESH_SECONDS)
def overview(seconds: int) -> None:
    over = data.span(seconds)
    config = data.settings()
    if ui.failed(config):
        return
    cluster = data.series(queries.CLUSTER_HIT_RATIO, over)
    if ui.failed(cluster):
        return
    st.caption(f"As of {ui.as_of(over.end)}, from Prometheus at {config.value.prometheus.url}.")
    left, middle, _ = st.columns(3)
    with left:
        ui.tile("Cluster hit ratio", cluster.value, over.end, ui.RATIO, hit_ratio, CLUSTER_HELP)
    with middle:
        alerts = data.series(queries.FIRING_ALERTS, over)
        if not ui.failed(alerts):
            ui.tile("Firing alerts", alerts.value, over.end, ui.COUNT, firing, ALERTS_HELP)

    results = [data.series(tile.query, over) for tile in ROUTE_TILES]
    if any(ui.failed(result) for result in results):
        return
    if not config.value.targets:
        ui.empty(f"No probe targets in {data.config_path()}: add one to see stickiness and warm rounds.")
    for target in config.value.targets:
        affinity = target.route_mode == "affinity"
        st.subheader(target.name)
        st.caption(f"{target.route_mode} route · {target.base_url}")
        for column, tile, result in zip(st.columns(3), ROUTE_TILES, results, strict=True):
            frame = result.value
            points = frame[frame["target"] == target.name] if "target" in frame else frame
            judge = partial(tile.judge, affinity=affinity)
            with column:
                ui.tile(tile.label, points, over.end, tile.unit, judge, tile.help)


st.title("Overview")
overview(ui.time_range("overview_range"))
