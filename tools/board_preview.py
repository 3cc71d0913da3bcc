"""A picture of Grafana's kvwatch overview board for docs/grafana.md, drawn with matplotlib from a live
Prometheus, panel by panel where Grafana lays it out (Grafana itself is not needed; not a generator).

    .venv/bin/python tools/board_preview.py --prometheus http://127.0.0.1:18002 --minutes 12
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from kvwatch.core.promapi import PrometheusApi
from kvwatch.grafana.boards import overview
from kvwatch.grafana.panels import (
    GRID_WIDTH,
    JSON,
)
from kvwatch.prometheus import panel_queries

PROMETHEUS_TIMEOUT_S = 30.0  # per query of the picture, the whole answer included


def evaluate(
    prometheus: str, query: JSON, *, start: float, end: float, window: str
) -> list[tuple[dict, list]]:
    """A panel target's series from Prometheus, as (labels, [(seconds before `end`, value)])."""
    expr = panel_queries.fill_variables(query["expr"], window=window, time_range=f"{round(end - start)}s")
    prometheus_api = PrometheusApi(prometheus, PROMETHEUS_TIMEOUT_S)
    if query["instant"]:
        series = prometheus_api.query(expr, at=end)
    else:
        series = prometheus_api.query_range(expr, start, end, step=max(1.0, (end - start) / 240))
    return [
        (s["metric"], [(float(t) - end, float(v)) for t, v in s.get("values", [s.get("value")])])
        for s in series
    ]


def _legend(template: str, labels: dict) -> str:
    """The legend as Grafana renders it: a label the series lacks reads as its name."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda match: labels.get(match[1]) or match[1], template)


def _format(unit: str, value: float) -> str:
    if unit == "percentunit":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
    return f"{value:.3g}/s" if unit == "reqps" else f"{value:.3g}"


def _draw_timeseries(axes, panel: JSON, results: list) -> None:
    for query, series in results:
        for labels, points in series:
            minutes, values = zip(*((t / 60, v) for t, v in points), strict=True)
            axes.plot(minutes, values, label=_legend(query["legendFormat"], labels), linewidth=1.2)
    defaults = panel["fieldConfig"]["defaults"]
    axes.set_ylim(bottom=0, top=defaults.get("max"))
    axes.legend(fontsize=7, loc="lower left", ncol=2)


def _draw_stat(axes, panel: JSON, results: list) -> None:
    """Each series' latest value, as the word the panel maps it to if it does; a lone one with its trend."""
    defaults = panel["fieldConfig"]["defaults"]
    words = {
        float(value): (shown["text"], shown["color"])
        for mapping in defaults.get("mappings", [])
        for value, shown in mapping["options"].items()
    }
    color = defaults["thresholds"]["steps"][0]["color"]
    shown = [(_legend(q["legendFormat"], labels), points) for q, found in results for labels, points in found]
    if len(shown) == 1:
        minutes, values = zip(*((t / 60, v) for t, v in shown[0][1]), strict=True)
        axes.fill_between(minutes, values, alpha=0.15, color=color)
        axes.set_ylim(0, max(values) * 1.5 or 1)
    for row, (name, points) in enumerate(shown):
        value = points[-1][1]
        text, tint = words.get(value, (_format(defaults["unit"], value), color))
        y = 1 - (row + 1) / (len(shown) + 1)
        label, size = (text, 36) if len(shown) == 1 else (f"{name}: {text}", 11)
        axes.text(0.5, y, label, transform=axes.transAxes, ha="center", va="center", size=size, color=tint)
    axes.set_yticks([])


def _draw_barchart(axes, panel: JSON, results: list) -> None:
    [(_, series)] = results
    modes = sorted({labels["route_mode"] for labels, _ in series})
    rounds = sorted({int(labels["round"]) for labels, _ in series})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        by_round = {
            int(labels["round"]): points[0][1] for labels, points in series if labels["route_mode"] == mode
        }
        values = [by_round.get(r, math.nan) for r in rounds]
        axes.bar([r + (i - (len(modes) - 1) / 2) * width for r in rounds], values, width, label=mode)
    axes.set_xticks(rounds)
    axes.set_xlabel("round")
    axes.legend(fontsize=8)


def _draw_heatmap(axes, panel: JSON, results: list) -> None:
    [(_, series)] = results
    buckets = sorted(series, key=lambda s: float(s[0]["le"]))
    times = sorted({t for _, points in buckets for t, _ in points})
    cumulative = [[dict(points).get(t, math.nan) for t in times] for _, points in buckets]
    per_bucket = [cumulative[0]] + [
        [upper - lower for upper, lower in zip(above, below, strict=True)]
        for above, below in zip(cumulative[1:], cumulative, strict=False)
    ]
    axes.pcolormesh([t / 60 for t in times], range(len(buckets)), per_bucket, cmap="Blues", shading="nearest")
    labels = [s[0]["le"] for s in buckets]
    step = max(1, len(labels) // 8)
    axes.set_yticks(range(0, len(labels), step), [f"≤ {le}" for le in labels[::step]], fontsize=7)


def _draw_state_timeline(axes, panel: JSON, results: list) -> None:
    [(query, series)] = results
    for row, (labels, points) in enumerate(series):
        minutes = [t / 60 for t, _ in points]
        step = min((b - a for a, b in zip(minutes, minutes[1:], strict=False)), default=0.1)
        axes.broken_barh([(m, step) for m in minutes], (row, 0.8), color="tab:red")
        axes.text(
            0.01, row + 0.4, _legend(query["legendFormat"], labels), transform=axes.get_yaxis_transform()
        )
    axes.set_ylim(0, len(series))
    axes.set_yticks([])


DRAW = {
    "timeseries": _draw_timeseries,
    "stat": _draw_stat,
    "barchart": _draw_barchart,
    "heatmap": _draw_heatmap,
    "state-timeline": _draw_state_timeline,
}


def _panel_axes(figure, pos: JSON, height: int):
    """Axes in a panel's cell of the grid (`height` rows), leaving room for its title and ticks."""
    width_in, height_in = figure.get_size_inches()
    left = pos["x"] / GRID_WIDTH + 0.6 / width_in
    right = (pos["x"] + pos["w"]) / GRID_WIDTH - 0.15 / width_in
    top = 1 - pos["y"] / height - 0.35 / height_in
    bottom = 1 - (pos["y"] + pos["h"]) / height + 0.5 / height_in
    return figure.add_axes((left, bottom, right - left, top - bottom))


def render(prometheus: str, out: Path, *, minutes: int, window: str) -> None:
    """Draw the overview's panels where Grafana places them, each from its own queries. `window` stands
    in for $__rate_interval, except on panels with a minimum interval, which use that."""
    import matplotlib  # only this picture needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import FuncFormatter

    board = overview()
    end = time.time()
    start = end - minutes * 60
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    figure = pyplot.figure(figsize=(24, height * 0.5))
    for panel in board["panels"]:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            figure.text(0.005, 1 - (pos["y"] + 0.6) / height, panel["title"], fontsize=14, weight="bold")
            continue
        axes = _panel_axes(figure, pos, height)
        axes.set_title(panel["title"], loc="left", fontsize=11)
        panel_window = panel.get("interval", window)
        results = [
            (q, evaluate(prometheus, q, start=start, end=end, window=panel_window)) for q in panel["targets"]
        ]
        if not any(series for _, series in results):
            axes.text(
                0.5, 0.5, panel["fieldConfig"]["defaults"]["noValue"], ha="center", transform=axes.transAxes
            )
            axes.set_xticks([])
            axes.set_yticks([])
            continue
        DRAW[panel["type"]](axes, panel, results)
        if panel["type"] in ("timeseries", "barchart"):
            unit = panel["fieldConfig"]["defaults"]["unit"]
            axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _, unit=unit: _format(unit, value)))
        if panel["type"] != "barchart":
            axes.set_xlim(-minutes, 0)
            axes.set_xlabel("minutes ago", fontsize=8)
    figure.suptitle(f"{board['title']}: the last {minutes} minutes", fontsize=16, y=1.02)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=60, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/board_preview.py",
        description="Draw the Grafana overview board from a live Prometheus, with matplotlib.",
    )
    parser.add_argument("--prometheus", required=True, help="e.g. the lab's http://127.0.0.1:18002")
    parser.add_argument("--out", type=Path, default=Path("docs/grafana-overview.png"))
    parser.add_argument("--minutes", type=int, default=15, help="time range (default %(default)s)")
    parser.add_argument(
        "--window", default="1m", help="what $__rate_interval stands for (default %(default)s)"
    )
    args = parser.parse_args(argv)
    render(args.prometheus.rstrip("/"), args.out, minutes=args.minutes, window=args.window)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
