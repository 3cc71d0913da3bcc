"""The plot of `kvwatch experiment`: the source article's picture, from the rows of per-round.csv.

Two panels by round, one colour per route: the median TTFT (solid), the p90 (dashed) and the p99
(dotted), each with its bootstrap 95 % interval shaded; the cached ratio (solid, cached / prompt
tokens) and cached / ideal (dashed). `panels` says what is drawn; the PNG and the interactive HTML
only draw it, so both show the same series and a test can read them off the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

COLOURS = ("#d95f02", "#1b9e77")  # A orange, B teal: ColorBrewer Dark2, safe for colour blindness
TTFT_TITLE = "Time to first token: median, p90 dashed, p99 dotted (shaded: bootstrap 95 % intervals)"
REUSE_TITLE = "Prefix-cache reuse: cached / prompt tokens, cached / ideal dashed"


class Style(NamedTuple):
    png: str  # matplotlib's line style
    html: str  # plotly's dash
    band_opacity: float  # the wider the tail's interval, the lighter its band, so the median's stays legible


STYLES = {
    "solid": Style("-", "solid", 0.2),
    "dashed": Style("--", "dash", 0.08),
    "dotted": Style(":", "dot", 0.05),
}
TTFT_STYLES = {"median": "solid", "p90": "dashed", "p99": "dotted"}


@dataclass(frozen=True)
class Line:
    """One route's figure by round; NaN where it is unknown, so the line has a gap there."""

    name: str
    colour: str
    style: str  # a key of STYLES
    rounds: list[int]
    values: list[float]
    low: list[float] | None = None  # the interval, when the figure has one
    high: list[float] | None = None


@dataclass(frozen=True)
class Panel:
    title: str
    axis: str
    ratio: bool  # a 0-1 ratio, shown in percent; else from 0 up
    lines: tuple[Line, ...]


def panels(routes: Sequence[tuple[str, str]], rows: list[dict]) -> tuple[Panel, Panel]:
    """The TTFT and the reuse panel of `routes`, (legend name, route label) pairs, from `round_rows`."""
    ttft, reuse = [], []
    for (name, label), colour in zip(routes, COLOURS, strict=True):
        mine = [r for r in rows if r["route"] == label]
        rounds = [r["round"] for r in mine]
        for quantile, style in TTFT_STYLES.items():
            value, low, high = (
                _column(mine, f"ttft_{quantile}{part}_seconds", 1000) for part in ("", "_low", "_high")
            )
            ttft.append(Line(f"{name} {quantile}", colour, style, rounds, value, low, high))
        for figure, key, style in (
            ("cached ratio", "cached_ratio", "solid"),
            ("cached / ideal", "ideal_efficiency", "dashed"),
        ):
            reuse.append(Line(f"{name} {figure}", colour, style, rounds, _column(mine, key)))
    return Panel(TTFT_TITLE, "TTFT (ms)", False, tuple(ttft)), Panel(REUSE_TITLE, "ratio", True, tuple(reuse))


def _column(rows: list[dict], key: str, scale: float = 1.0) -> list[float]:
    """One figure of every row, scaled; NaN where it is unknown (cached / ideal of round 1)."""
    return [math.nan if r[key] is None else r[key] * scale for r in rows]


def png_figure(drawn: Sequence[Panel], title: str):
    """The panels side by side as a matplotlib Figure (no pyplot: nothing global, nothing shown)."""
    # Imported here: matplotlib is slow to import, and only the experiment draws.
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(14, 5.2), layout="constrained")
    for axes, panel in zip(figure.subplots(1, len(drawn)), drawn, strict=True):
        for line in panel.lines:
            style = STYLES[line.style]
            if line.low is not None:
                axes.fill_between(
                    line.rounds, line.low, line.high, color=line.colour, alpha=style.band_opacity, linewidth=0
                )
            axes.plot(line.rounds, line.values, style.png, marker="o", color=line.colour, label=line.name)
        axes.set(title=panel.title, xlabel="round", ylabel=panel.axis)
        axes.set_xticks(sorted({n for line in panel.lines for n in line.rounds}))
        if panel.ratio:
            axes.set_ylim(0, 1.05)
            axes.yaxis.set_major_formatter(PercentFormatter(1.0))
        else:
            axes.set_ylim(bottom=0)
        axes.title.set_fontsize("medium")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title, fontsize="large", fontweight="bold")
    return figure


def html_figure(drawn: Sequence[Panel], title: str):
    """The panels side by side as a plotly Figure, one legend group per line and its band."""
    # Imported here: only the experiment draws.
    from plotly import graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=len(drawn), subplot_titles=[p.title for p in drawn])
    for column, panel in enumerate(drawn, start=1):
        hover = "round %{x}: %{y:.0%}" if panel.ratio else "round %{x}: %{y:.0f} ms"
        for line in panel.lines:
            if line.low is not None:
                band = go.Scatter(
                    x=line.rounds + line.rounds[::-1],
                    y=line.high + line.low[::-1],
                    fill="toself",
                    fillcolor=line.colour,
                    opacity=STYLES[line.style].band_opacity,
                    line_width=0,
                    legendgroup=line.name,
                    showlegend=False,
                    hoverinfo="skip",
                )
                figure.add_trace(band, row=1, col=column)
            curve = go.Scatter(
                x=line.rounds,
                y=line.values,
                name=line.name,
                legendgroup=line.name,
                line={"color": line.colour, "dash": STYLES[line.style].html},
                hovertemplate=hover,
            )
            figure.add_trace(curve, row=1, col=column)
        axis = {"range": [0, 1.05], "tickformat": ".0%"} if panel.ratio else {"rangemode": "tozero"}
        figure.update_yaxes(title_text=panel.axis, row=1, col=column, **axis)
    figure.update_xaxes(title_text="round", dtick=1)
    figure.update_layout(title_text=title, template="plotly_white")
    return figure


def draw(drawn: Sequence[Panel], title: str, png: Path, html: Path) -> None:
    """The PNG, and the HTML with plotly's JavaScript inside, so that it opens offline."""
    png_figure(drawn, title).savefig(png, dpi=110)
    html_figure(drawn, title).write_html(html, include_plotlyjs=True)
