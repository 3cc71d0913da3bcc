"""The source article's A/B experiment (`kvwatch experiment`): the same sessions through two routes.

Route A (say, round robin) and route B (say, session affinity) get the same seeded conversations,
interleaved session by session so that whatever drifts during the run (other traffic, a noisy
neighbour, caches filling up) hits both alike. Per route and round the report gives the median and p90
client-side TTFT with bootstrap 95 % intervals, the cached ratio (cached / prompt tokens, token-weighted)
and the cached / ideal efficiency; per route, stickiness, backend switches and errors. It measures and
does not judge: a bad picture is a result, not a failure.

Both routes usually reach the same replicas, so the first user turn of every session carries a short
tag naming the run and the route ("Run 3f9c0a1e, group A."): without it, B's session would find A's copy
of the same history in the replicas' caches, and a second run the first run's. The tag has the same
length in A and B, so the prompts still match token for token in size.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import random
import statistics
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvwatch.collectors import blocksize, experiment_plot, identity
from kvwatch.collectors.blocksize import BlockSize, BlockSizeSources
from kvwatch.collectors.probe import (
    SESSION_MODES,
    ProbeSettings,
    add_api_key_arguments,
    add_identity_arguments,
    add_model_argument,
    api_url,
    chosen_model,
    failure_hints,
    resolve_api_key,
    run_session,
    with_block_size,
)
from kvwatch.collectors.progress import Progress
from kvwatch.collectors.records import SessionResult
from kvwatch.collectors.redaction import redact
from kvwatch.collectors.streaming import StreamClient
from kvwatch.collectors.workload import Conversation, load_sharegpt, synthetic

RESAMPLES = 2000
CONFIDENCE = 0.95
GROUPS = ("A", "B")
FILES = {
    "report": "report.md",
    "per_round": "per-round.csv",
    "routes": "routes.csv",
    "raw": "raw-rounds.csv",
    "png": "experiment.png",
    "html": "experiment.html",
}


@dataclass(frozen=True)
class Workload:
    """The conversations both routes get: synthetic, or from a ShareGPT-style file, seeded either way."""

    sessions: int = 20
    rounds: int = 6
    system_tokens: int = 1000
    turn_tokens: int = 300
    seed: int = 0
    sharegpt: Path | None = None

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError("sessions must be positive")
        if self.rounds < 2:
            raise ValueError("rounds must be at least 2: warm rounds are what the experiment compares")

    def conversations(self) -> list[Conversation]:
        if self.sharegpt is None:
            return synthetic(self.rounds, self.system_tokens, self.turn_tokens, self.seed, self.sessions)
        return [
            Conversation(c.system_prompt, c.user_turns[: self.rounds])
            for c in load_sharegpt(self.sharegpt, limit=self.sessions, seed=self.seed)
        ]

    def describe(self) -> str:
        if self.sharegpt is None:
            return (
                f"Synthetic conversations (seed {self.seed}): a system prompt of {self.system_tokens} "
                f"tokens, user turns of {self.turn_tokens} tokens."
            )
        return f"Conversations from {self.sharegpt} (seed {self.seed})."


@dataclass(frozen=True)
class Experiment:
    """One A/B run: each route's sessions in conversation order (they ran in `interleave` order)."""

    a: ProbeSettings
    b: ProbeSettings
    rounds: int  # planned rounds per session
    concurrency: int
    sessions: tuple[tuple[SessionResult, ...], tuple[SessionResult, ...]]  # A's, B's
    block_size: BlockSize  # one for both routes, so that their cached / ideal compare

    @property
    def labels(self) -> tuple[str, str]:
        return self.a.target, self.b.target

    @property
    def all_sessions(self) -> list[SessionResult]:
        return [*self.sessions[0], *self.sessions[1]]


def interleave(sessions: int) -> list[tuple[int, int]]:
    """The running order as (conversation, route) pairs, route 0 = A and 1 = B.

    Session by session, so drift hits both routes within minutes of each other; which route goes first
    alternates (A B, B A, A B, ...), so neither always runs right after the other has warmed things up.
    """
    return [(n, route) for n in range(sessions) for route in ((0, 1), (1, 0))[n % 2]]


def tag(conversation: Conversation, run_id: str, route: int) -> Conversation:
    """The conversation with the run's and the route's tag before its first user turn (see the docstring
    of this module: it keeps one route's cached history from serving the other)."""
    first, *rest = conversation.user_turns
    return Conversation(conversation.system_prompt, (f"Run {run_id}, group {GROUPS[route]}. {first}", *rest))


def run_experiment(
    a: ProbeSettings,
    b: ProbeSettings,
    conversations: Sequence[Conversation],
    concurrency: int = 1,
    run_id: str | None = None,
    block_sources: BlockSizeSources | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
) -> Experiment:
    """Every conversation through A and through B, interleaved, `concurrency` sessions at a time.

    Each route's `target` is its label. A session never raises (see the probe); failures are in the results.
    The KV block size is learned from `block_sources` (by default both routes' /metrics) and the sessions
    of both routes. `on_session` is told of each session as it ends (a progress line).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be positive")
    if a.target == b.target:
        raise ValueError(f"the two routes need different labels, both are {a.target!r}")
    if not conversations:
        raise ValueError("no conversations to run")
    run_id = run_id or uuid.uuid4().hex[:8]
    routes = (a, b)
    results: tuple[list, list] = ([None] * len(conversations), [None] * len(conversations))

    async def run() -> None:
        # One pool per route, so that alternating routes does not close the other's kept-alive connection.
        async with StreamClient() as client_a, StreamClient() as client_b:
            clients, plan = (client_a, client_b), iter(interleave(len(conversations)))

            async def worker() -> None:
                # Each worker takes the next session of the plan, so sessions start in exactly that order.
                for conversation, route in plan:
                    tagged = tag(conversations[conversation], run_id, route)
                    session = await run_session(clients[route], routes[route], tagged)
                    results[route][conversation] = session
                    if on_session is not None:
                        on_session(session)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, 2 * len(conversations)))))
        sources = block_sources or blocksize.sources_for([a.base_url, b.base_url])
        return await blocksize.learn(sources, [*results[0], *results[1]])

    block = asyncio.run(run())
    sessions = tuple(tuple(with_block_size(route, block.tokens)) for route in results)
    rounds = max(len(c.user_turns) for c in conversations)
    return Experiment(a, b, rounds, concurrency, sessions, block)


# Statistics.


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated (numpy's and pandas' default method)."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def bootstrap_ci(
    values: Sequence[float],
    q: float = 0.5,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """A percentile-bootstrap interval for the q-quantile of `values`: seeded, so a report is reproducible.

    TTFT is skewed and the samples are few (one per session), so no normal approximation is assumed.
    """
    if not values:
        raise ValueError("no values to resample")
    rng = random.Random(seed)
    estimates = sorted(quantile(sorted(rng.choices(values, k=len(values))), q) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return quantile(estimates, tail), quantile(estimates, 1 - tail)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is unknown or the denominator is 0."""
    return None if numerator is None or not denominator else numerator / denominator


def round_rows(experiment: Experiment) -> list[dict]:
    """One row per route and round (per-round.csv), in seconds, tokens and 0-1 ratios.

    Ratios are token-weighted over the round's sessions (sums divided), never means of ratios.
    `ttft_median_ratio_to_a` is the route's median over A's in the same round.
    """
    rows = []
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        for number in range(1, experiment.rounds + 1):
            rounds = [s.rounds[number - 1] for s in sessions if len(s.rounds) >= number]
            ok = [r for r in rounds if r.ok]
            ttfts = sorted(r.ttft_seconds for r in ok if r.ttft_seconds is not None)
            known = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens is not None]
            warm = [r for r in known if r.ideal_cached_tokens is not None]
            row = {"route": label, "round": number, "sessions": len(rounds), "errors": len(rounds) - len(ok)}
            for name, q in (("median", 0.5), ("p90", 0.9)):
                row[f"ttft_{name}_seconds"] = quantile(ttfts, q) if ttfts else None
                low, high = bootstrap_ci(ttfts, q) if ttfts else (None, None)
                row[f"ttft_{name}_low_seconds"], row[f"ttft_{name}_high_seconds"] = low, high
            row["prompt_tokens"] = sum(r.prompt_tokens for r in known)
            row["cached_tokens"] = sum(r.cached_tokens for r in known)
            row["ideal_cached_tokens"] = sum(r.ideal_cached_tokens for r in warm)
            row["cached_ratio"] = ratio(row["cached_tokens"], row["prompt_tokens"])
            row["ideal_efficiency"] = ratio(sum(r.cached_tokens for r in warm), row["ideal_cached_tokens"])
            rows.append(row)
    a_median = {r["round"]: r["ttft_median_seconds"] for r in rows if r["route"] == experiment.a.target}
    for row in rows:
        row["ttft_median_ratio_to_a"] = ratio(row["ttft_median_seconds"], a_median[row["round"]])
    return rows


def route_rows(experiment: Experiment) -> list[dict]:
    """One row per route (routes.csv): stickiness, backend switches, warm-round efficiency, errors."""
    rows = []
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        sticky = [s.sticky for s in sessions if s.sticky is not None]
        switches = [s.backend_switches for s in sessions if s.backend_switches is not None]
        warm = [
            r
            for s in sessions
            for r in s.rounds[1:]
            if r.ok and r.cached_tokens is not None and r.ideal_cached_tokens is not None
        ]
        errors = Counter(s.error_kind for s in sessions if s.error_kind)
        rows.append(
            {
                "route": label,
                "sessions": len(sessions),
                "failed": sum(not s.ok for s in sessions),
                "sticky_share": ratio(sum(sticky), len(sticky)),
                "backend_switches_per_session": statistics.mean(switches) if switches else None,
                "warm_ideal_efficiency": ratio(
                    sum(r.cached_tokens for r in warm), sum(r.ideal_cached_tokens for r in warm)
                ),
                "errors": "; ".join(f"{kind} x{count}" for kind, count in errors.items()),
            }
        )
    return rows


def raw_rows(experiment: Experiment) -> list[dict]:
    """Every round of every session, in the order the sessions ran (raw-rounds.csv)."""
    rows = []
    for order, (conversation, route) in enumerate(interleave(len(experiment.sessions[0]))):
        session = experiment.sessions[route][conversation]
        head = {"order": order, "route": session.target, "conversation": conversation}
        rows += [{**head, "session_id": session.session_id, **asdict(r)} for r in session.rounds]
    return rows


# The report.


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _fixed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(r)} |" for r in rows)]


def report(experiment: Experiment, rounds: list[dict], routes: list[dict], about: Sequence[str] = ()) -> str:
    """The Markdown report: the setup, the per-round table (the source article's picture), stickiness."""
    a, b = experiment.labels
    lines = [f"## A/B experiment: {a} (A) vs {b} (B)", ""]
    for group, route in zip(GROUPS, (experiment.a, experiment.b), strict=True):
        lines.append(f"- {group}, {route.target}: {redact(api_url(route.base_url, 'chat/completions'))}")
    lines += [
        f"- {len(experiment.sessions[0])} sessions of {experiment.rounds} rounds through each route: the "
        f"same conversations, interleaved session by session, {experiment.concurrency} at a time; model "
        f"{experiment.a.model}, answers of up to {experiment.a.max_tokens} tokens, session ids: "
        f"{experiment.a.session_mode}.",
        f"- {experiment.block_size.describe()}, for the ideal cached tokens.",
        *(f"- {line}" for line in about),
        "",
        "Median client-side TTFT in ms with its bootstrap 95 % interval; cached ratio: cached / prompt "
        "tokens, as the engine reported them.",
        "",
    ]
    cell = {(r["route"], r["round"]): r for r in rounds}

    def round_cells(n: int) -> tuple[str, ...]:
        ra, rb = cell[a, n], cell[b, n]
        ratios = (rb["ttft_median_ratio_to_a"], ra["cached_ratio"], rb["cached_ratio"])
        return (str(n), _ttft(ra), _ttft(rb), *map(_fixed, ratios))

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
    lines += _table(
        header + [f"{a} cached ratio", f"{b} cached ratio"],
        [round_cells(n) for n in range(1, experiment.rounds + 1)],
    )
    header = ["route", "sessions", "failed", "on one replica", "backend switches per session"]
    lines += [""] + _table(header + ["cached / ideal, rounds 2+", "errors"], [route_cells(r) for r in routes])
    return "\n".join(lines) + "\n"


def _ttft(row: dict) -> str:
    """The median TTFT and its interval in ms, e.g. "41 [39–44]"."""
    low, median, high = (_ms(row[f"ttft_median{part}_seconds"]) for part in ("_low", "", "_high"))
    return f"{median} [{low}–{high}]"


# The plot (collectors.experiment_plot draws it).


def _title(experiment: Experiment) -> str:
    a, b = experiment.labels
    return (
        f"{a} (A) vs {b} (B): the same {len(experiment.sessions[0])} sessions of {experiment.rounds} rounds"
    )


def plot_panels(experiment: Experiment, rows: list[dict]) -> tuple[experiment_plot.Panel, ...]:
    """What the plot shows of `round_rows`: each route under its group's name."""
    routes = [(f"{group}: {label}", label) for group, label in zip(GROUPS, experiment.labels, strict=True)]
    return experiment_plot.panels(routes, rows)


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(experiment: Experiment, out: Path, about: Sequence[str] = ()) -> str:
    """Every file of FILES into `out`; returns the Markdown report. `about`: more lines on the setup."""
    out.mkdir(parents=True, exist_ok=True)
    rounds, routes = round_rows(experiment), route_rows(experiment)
    markdown = report(experiment, rounds, routes, about)
    (out / FILES["report"]).write_text(markdown)
    _write_csv(out / FILES["per_round"], rounds)
    _write_csv(out / FILES["routes"], routes)
    _write_csv(out / FILES["raw"], raw_rows(experiment))
    experiment_plot.draw(
        plot_panels(experiment, rounds), _title(experiment), out / FILES["png"], out / FILES["html"]
    )
    return markdown


def run_into(
    a: ProbeSettings,
    b: ProbeSettings,
    workload: Workload,
    out: Path,
    concurrency: int = 1,
    block_sources: BlockSizeSources | None = None,
    progress: Progress | None = None,
) -> tuple[Experiment, str | None]:
    """The experiment and its report, written into `out` as `kvwatch experiment` and the dashboard run it.

    `out` is made first, so that a bad directory fails before anything is measured; the report is None,
    and nothing is written, when every session failed. `progress` counts the sessions as they end.
    """
    conversations = workload.conversations()
    out.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress.start(2 * len(conversations))
    on_session = progress.advance if progress else None
    experiment = run_experiment(
        a, b, conversations, concurrency, block_sources=block_sources, on_session=on_session
    )
    if not any(session.ok for session in experiment.all_sessions):
        return experiment, None
    return experiment, write_outputs(experiment, out, [workload.describe()])


def failures(experiment: Experiment) -> list[str]:
    """How many sessions failed, then one line per error kind with what to check; empty when none failed."""
    sessions = experiment.all_sessions
    failed = [s for s in sessions if not s.ok]
    return [f"{len(failed)} of {len(sessions)} sessions failed", *failure_hints(failed)] if failed else []


# The command line.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "experiment",
        help="the source article's A/B run: the same sessions through two routes, TTFT and reuse by round",
        description="Run the same seeded multi-turn sessions through route A (e.g. a round-robin gateway) "
        "and route B (e.g. session affinity), interleaved session by session. Report per round the median "
        "and p90 TTFT with bootstrap 95 % intervals and the cached ratio, and per route the stickiness: "
        "CSVs, a Markdown report and a plot (PNG and interactive HTML) in DIR, and the report on stdout.",
    )
    parser.add_argument("--a", required=True, metavar="URL", help="route A's API root, with or without /v1")
    parser.add_argument("--b", required=True, metavar="URL", help="route B's API root, with or without /v1")
    parser.add_argument(
        "--label-a", default="round_robin", metavar="LABEL", help="route A's name (default %(default)s)"
    )
    parser.add_argument(
        "--label-b", default="affinity", metavar="LABEL", help="route B's name (default %(default)s)"
    )
    add_model_argument(parser)
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the results")
    add_api_key_arguments(parser)
    workload = Workload()
    for flag, default, what in (
        ("--sessions", workload.sessions, "sessions per route"),
        ("--rounds", workload.rounds, "rounds per session"),
        ("--concurrency", 1, "sessions at once, both routes together; 1: no queueing"),
        ("--system-tokens", workload.system_tokens, "synthetic system prompt, in tokens"),
        ("--turn-tokens", workload.turn_tokens, "synthetic user turn, in tokens"),
        ("--max-tokens", 8, "answer length in tokens; TTFT is what is measured"),
        ("--seed", workload.seed, "seed of the workload"),
    ):
        parser.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    parser.add_argument(
        "--sharegpt", type=Path, metavar="FILE", help="user turns from a ShareGPT-style JSON file"
    )
    parser.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default=ProbeSettings.session_mode,
        help="client: a new id per session; server: adopt the id the gateway returns; none: send none "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--session-header", default=ProbeSettings.session_header, metavar="H", help="default %(default)s"
    )
    add_identity_arguments(parser)
    blocksize.add_arguments(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch experiment`: 0 when it ran, 1 when every session failed, 2 on bad arguments."""
    try:
        api_key = resolve_api_key(args.api_key_env, args.api_key_file)
        workload = Workload(
            args.sessions, args.rounds, args.system_tokens, args.turn_tokens, args.seed, args.sharegpt
        )
        sources = blocksize.sources_from_args(args, [args.a, args.b])
        # Both routes reach the same engines, so route A's listing speaks for both.
        model = chosen_model(args.model, args.a, api_key, ProbeSettings.timeout_seconds, "experiment")
        a, b = (
            ProbeSettings(
                base_url=url,
                model=model,
                api_key=api_key,
                target=label,
                route_mode=label,
                session_mode=args.session_mode,
                session_header=args.session_header,
                backend_headers=tuple(args.backend_headers or identity.DEFAULT_HEADERS),
                router=args.router,
                max_tokens=args.max_tokens,
            )
            for url, label in ((args.a, args.label_a), (args.b, args.label_b))
        )
        # It checks its arguments before it runs.
        with Progress.on_terminal("experiment", "sessions", json=False) as progress:
            experiment, markdown = run_into(a, b, workload, args.out, args.concurrency, sources, progress)
    except (ValueError, OSError) as error:
        print(f"kvwatch experiment: {error}", file=sys.stderr)
        return 2
    if markdown is not None:
        print(markdown)
        print(f"Written to {args.out}: {', '.join(FILES.values())}")
    summary = failures(experiment)
    if summary:
        print(f"kvwatch experiment: {summary[0]}", file=sys.stderr)
        for line in summary[1:]:
            print(f"  {line}", file=sys.stderr)
    return 1 if markdown is None else 0
