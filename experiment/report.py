"""The experiment's results as files: the Markdown report, the CSVs and the plot."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from kvwatch.collectors.probe.report import route_description
from kvwatch.experiment import plot
from kvwatch.experiment.design import GROUPS, Experiment
from kvwatch.experiment.tables import (
    TTFT_QUANTILES,
    load_rows,
    raw_rows,
    replica_rows,
    round_rows,
    route_rows,
)

FILES = {
    "report": "report.md",
    "per_round": "per-round.csv",
    "routes": "routes.csv",
    "raw": "raw-rounds.csv",
    "load": "load.csv",
    "replicas": "replicas.csv",
    "png": "experiment.png",
    "html": "experiment.html",
}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _fixed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(r)} |" for r in rows)]


def report(
    experiment: Experiment,
    rounds: list[dict],
    routes: list[dict],
    load: list[dict],
    replicas: list[dict],
    about: Sequence[str] = (),
) -> str:
    """The Markdown report: the setup, the per-round table (the source article's picture), stickiness,
    throughput and TTFT under the run's load, and the requests each replica served."""
    a, b = experiment.labels
    lines = [f"## A/B experiment: {a} (A) vs {b} (B)", ""]
    for group, route in zip(GROUPS, (experiment.a, experiment.b), strict=True):
        lines.append(f"- {group}, {route.target}: {route_description(route)[0]}")
    lines += [
        f"- {len(experiment.sessions[0])} sessions of {experiment.rounds} rounds through each route: the "
        f"same conversations, {experiment.load.describe()}; model "
        f"{experiment.a.model}, answers of up to {experiment.a.max_tokens} tokens, session ids: "
        f"{experiment.a.session_mode}.",
        f"- {experiment.block_size.describe()}, for the ideal cached tokens.",
        *(f"- {line}" for line in about),
        "",
        "Client-side TTFT in ms with its percentile-bootstrap 95 % interval; cached ratio: cached / "
        "prompt tokens, as the engine reported them (else the probe's estimate: the ideal on the replica "
        "of the round before, 0 on another).",
        "",
    ]
    cell = {(r["route"], r["round"]): r for r in rounds}

    def round_cells(n: int) -> tuple[str, ...]:
        ra, rb = cell[a, n], cell[b, n]
        ratios = (rb["ttft_median_ratio_to_a"], ra["cached_ratio"], rb["cached_ratio"])
        tails = (_ttft(row, name) for name in ("p90", "p99") for row in (ra, rb))
        return (str(n), _ttft(ra), _ttft(rb), *map(_fixed, ratios), *tails)

    def route_cells(r: dict) -> tuple[str, ...]:
        return (
            r["route"],
            str(r["sessions"]),
            str(r["failed"]),
            "-" if r["sticky_share"] is None else f"{r['sticky_share']:.0%}",
            _fixed(r["backend_switches_per_session"], 1),
            _fixed(r["warm_ideal_efficiency"]),
            r["errors"] or "-",
        )

    header = ["round", f"{a} median TTFT [95 % CI]", f"{b} median TTFT [95 % CI]", f"{b} / {a}"]
    header += [f"{a} cached ratio", f"{b} cached ratio"]
    header += [f"{route} {name} TTFT [95 % CI]" for name in ("p90", "p99") for route in (a, b)]
    lines += _table(header, [round_cells(n) for n in range(1, experiment.rounds + 1)])
    header = ["route", "sessions", "failed", "on one replica", "backend switches per session"]
    lines += [""] + _table(header + ["cached / ideal, rounds 2+", "errors"], [route_cells(r) for r in routes])
    lines += ["", "Throughput over each route's measured span (first request to last answer), TTFT over all "
              "its rounds:", ""]  # fmt: skip
    header = ["route", "answered", "span s", "requests/s", "prompt tokens/s", "generated tokens/s"]
    lines += _table(
        header + [f"TTFT {name} [95 % CI]" for name in TTFT_QUANTILES], list(map(_load_cells, load))
    )
    served = {(r["route"], r["replica"]): r["requests"] for r in replicas}
    names = sorted({replica for _, replica in served})
    lines += ["", "Requests each replica served, by the backend the answers named:", ""]
    lines += _table(["replica", a, b], [[n, *(str(served.get((r, n), 0)) for r in (a, b))] for n in names])
    return "\n".join(lines) + "\n"


def _load_cells(row: dict) -> list[str]:
    figures = (row["span_seconds"], row["requests_per_second"])
    tokens = (row["prompt_tokens_per_second"], row["generated_tokens_per_second"])
    ttfts = (_ttft(row, name) for name in TTFT_QUANTILES)
    return [
        row["route"],
        str(row["answered"]),
        *map(_fixed, figures),
        *(_fixed(t, 0) for t in tokens),
        *ttfts,
    ]


def _ttft(row: dict, name: str = "median") -> str:
    """A TTFT quantile and its interval in ms, e.g. "41 [39–44]"."""
    low, value, high = (_ms(row[f"ttft_{name}{part}_seconds"]) for part in ("_low", "", "_high"))
    return f"{value} [{low}–{high}]"


# The plot (experiment.plot draws it).


def _title(experiment: Experiment) -> str:
    a, b = experiment.labels
    return (
        f"{a} (A) vs {b} (B): the same {len(experiment.sessions[0])} sessions of {experiment.rounds} rounds"
    )


def plot_panels(experiment: Experiment, rows: list[dict]) -> tuple[plot.Panel, ...]:
    """What the plot shows of `round_rows`: each route under its group's name."""
    routes = [(f"{group}: {label}", label) for group, label in zip(GROUPS, experiment.labels, strict=True)]
    return plot.panels(routes, rows)


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(experiment: Experiment, out: Path, about: Sequence[str] = ()) -> str:
    """Every file of FILES into `out`; returns the Markdown report. `about`: more lines on the setup."""
    out.mkdir(parents=True, exist_ok=True)
    rounds, routes = round_rows(experiment), route_rows(experiment)
    load, replicas = load_rows(experiment), replica_rows(experiment)
    markdown = report(experiment, rounds, routes, load, replicas, about)
    (out / FILES["report"]).write_text(markdown)
    _write_csv(out / FILES["per_round"], rounds)
    _write_csv(out / FILES["routes"], routes)
    _write_csv(out / FILES["load"], load)
    _write_csv(out / FILES["replicas"], replicas)
    _write_csv(out / FILES["raw"], raw_rows(experiment))
    plot.draw(plot_panels(experiment, rounds), _title(experiment), out / FILES["png"], out / FILES["html"])
    return markdown
