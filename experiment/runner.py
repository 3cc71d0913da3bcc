"""The source article's A/B experiment (`kvwatch experiment`): the same sessions through two routes.

Route A (say, round robin) and route B (say, session affinity) get the same seeded conversations on
the same arrival schedule, so that whatever drifts during the run (other traffic, a noisy neighbour,
caches filling up) hits both alike: conversation n arrives for both routes at once (all at the start, or
at a seeded Poisson rate), and each route runs at most `concurrency` sessions at a time. Per route and
round the report gives the median, p90 and p99 client-side TTFT with bootstrap 95 % intervals, the cached
ratio (cached / prompt tokens, token-weighted) and the cached / ideal efficiency; per route, throughput
over the measured span, stickiness, backend switches, errors and the requests each replica served. It
measures and does not judge: a bad picture is a result, not a failure.

Both routes usually reach the same replicas, so the first user turn of every session carries a short
tag naming the run and the route ("Run 3f9c0a1e, group A."): without it, B's session would find A's copy
of the same history in the replicas' caches, and a second run the first run's. The tag has the same
length in A and B, so the prompts still match token for token in size.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import math
import random
import statistics
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvwatch.cli.options import (
    add_api_key_arguments,
    add_block_size_arguments,
    add_identity_arguments,
    add_model_argument,
    block_size_sources,
)
from kvwatch.collectors import identity
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources
from kvwatch.collectors.probe.models import chosen_model
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.report import failure_hints
from kvwatch.collectors.probe.session import (
    SESSION_MODES,
    ProbeSettings,
    api_url,
    resolve_api_key,
    run_session,
    with_block_size,
)
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation, load_sharegpt, synthetic
from kvwatch.core.progress import Progress
from kvwatch.core.redaction import redact
from kvwatch.experiment import plot

RESAMPLES = 2000
CONFIDENCE = 0.95
GROUPS = ("A", "B")
TTFT_QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}
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
class Load:
    """How the sessions arrive, the same for both routes.

    With neither setting, one session at a time over both routes, in `interleave` order: no request
    ever waits behind the other route's, as the source article's comparison of prefill times needs.
    With `concurrency` alone, every session arrives at the start and each route runs that many at a
    time (a closed loop). With `request_rate`, sessions arrive at that rate per route with exponential
    gaps (a Poisson process, as vLLM's benchmark_serving sends requests), seeded, at most `concurrency`
    in flight per route when it is given.
    """

    concurrency: int | None = None
    request_rate: float | None = None  # sessions per second per route
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be positive")
        if self.request_rate is not None and not 0 < self.request_rate < math.inf:
            raise ValueError("request rate must be a positive number of sessions per second")

    @property
    def one_at_a_time(self) -> bool:
        """One session in flight over both routes together (neither setting given)."""
        return self.concurrency is None and self.request_rate is None

    def in_flight(self, sessions: int) -> int:
        """The most sessions one route runs at a time."""
        if self.concurrency is not None:
            return min(self.concurrency, sessions)
        return sessions if self.request_rate is not None else 1

    def arrivals(self, sessions: int) -> tuple[float, ...]:
        """When each conversation arrives, in seconds from the start: the first at 0."""
        if self.request_rate is None:
            return (0.0,) * sessions
        rng = random.Random(f"arrivals-{self.seed}")
        gaps = [0.0, *(rng.expovariate(self.request_rate) for _ in range(sessions - 1))]
        return tuple(itertools.accumulate(gaps))

    def describe(self) -> str:
        cap = "no cap" if self.concurrency is None else f"at most {self.concurrency} in flight per route"
        if self.one_at_a_time:
            return "interleaved session by session, one at a time over both routes"
        if self.request_rate is None:
            return f"all arriving at the start, {self.concurrency} at a time per route"
        return f"arriving at {self.request_rate:g} per second per route (Poisson, seed {self.seed}), {cap}"


@dataclass(frozen=True)
class Experiment:
    """One A/B run: each route's sessions in conversation order (they arrived in `interleave` order)."""

    a: ProbeSettings
    b: ProbeSettings
    rounds: int  # planned rounds per session
    load: Load
    arrivals: tuple[float, ...]  # each conversation's arrival, seconds from the start, for both routes
    sessions: tuple[tuple[SessionResult, ...], tuple[SessionResult, ...]]  # A's, B's
    block_size: BlockSize  # one for both routes, so that their cached / ideal compare

    @property
    def labels(self) -> tuple[str, str]:
        return self.a.target, self.b.target

    @property
    def all_sessions(self) -> list[SessionResult]:
        return [*self.sessions[0], *self.sessions[1]]


def interleave(sessions: int) -> list[tuple[int, int]]:
    """The arrival order as (conversation, route) pairs, route 0 = A and 1 = B.

    Conversation by conversation, both routes at the same moment; which route is handed its session
    first alternates (A B, B A, A B, ...), so neither is always the one that starts first.
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
    load: Load = Load(),
    run_id: str | None = None,
    block_sources: BlockSizeSources | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
) -> Experiment:
    """Every conversation through A and through B, arriving for both as `load` says.

    Each route has its own `load.in_flight` workers taking its sessions in arrival order, so a slow
    route never holds the other back and its throughput is its own; one worker serves both when
    `load.one_at_a_time`. Each route's `target` is its label.
    A session never raises (see the probe); failures are in the results. The KV block size is learned
    from `block_sources` (by default both routes' /metrics) and the sessions of both routes.
    `on_session` is told of each session as it ends (a progress line).
    """
    if a.target == b.target:
        raise ValueError(f"the two routes need different labels, both are {a.target!r}")
    if not conversations:
        raise ValueError("no conversations to run")
    run_id = run_id or uuid.uuid4().hex[:8]
    routes, arrivals = (a, b), load.arrivals(len(conversations))
    workers = load.in_flight(len(conversations))
    results: tuple[list, list] = ([None] * len(conversations), [None] * len(conversations))

    async def run() -> None:
        # One pool per route, so that one route's sessions do not close the other's kept-alive connections.
        async with StreamClient() as client_a, StreamClient() as client_b:
            clients = (client_a, client_b)
            queues = [asyncio.Queue() for _ in range(1 if load.one_at_a_time else 2)]
            loop = asyncio.get_running_loop()
            start = loop.time()

            async def arrive() -> None:
                for conversation, route in interleave(len(conversations)):
                    await asyncio.sleep(start + arrivals[conversation] - loop.time())
                    queues[route % len(queues)].put_nowait((conversation, route))
                for queue in queues:
                    for _ in range(workers):
                        queue.put_nowait(None)

            async def worker(queue: asyncio.Queue) -> None:
                while (arrived := await queue.get()) is not None:
                    conversation, route = arrived
                    tagged = tag(conversations[conversation], run_id, route)
                    session = await run_session(clients[route], routes[route], tagged)
                    results[route][conversation] = session
                    if on_session is not None:
                        on_session(session)

            await asyncio.gather(arrive(), *(worker(queue) for queue in queues for _ in range(workers)))
        sources = block_sources or blocksize.sources_for([a.base_url, b.base_url])
        return await blocksize.learn(sources, [*results[0], *results[1]])

    block = asyncio.run(run())
    sessions = tuple(tuple(with_block_size(route, block.tokens)) for route in results)
    rounds = max(len(c.user_turns) for c in conversations)
    return Experiment(a, b, rounds, load, arrivals, sessions, block)


# Statistics.


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated (numpy's and pandas' default method)."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def bootstrap_cis(
    values: Sequence[float],
    quantiles: Sequence[float] = (0.5,),
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> dict[float, tuple[float, float]]:
    """Percentile-bootstrap intervals for each q-quantile of `values`, from one set of resamples; seeded,
    so that a report is reproducible.

    TTFT is skewed and its tail is what load changes, so no normal approximation is assumed. A p99 of
    fewer than 100 values is close to their largest, and so is its interval.
    """
    if not values:
        raise ValueError("no values to resample")
    rng = random.Random(seed)
    drawn = [sorted(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1 - confidence) / 2
    intervals = {}
    for q in quantiles:
        estimates = sorted(quantile(sample, q) for sample in drawn)
        intervals[q] = quantile(estimates, tail), quantile(estimates, 1 - tail)
    return intervals


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is unknown or the denominator is 0."""
    return None if numerator is None or not denominator else numerator / denominator


def ttft_columns(ttfts: list[float]) -> dict[str, float | None]:
    """Each of TTFT_QUANTILES of sorted TTFTs with its bootstrap interval, in seconds; None without any."""
    intervals = bootstrap_cis(ttfts, TTFT_QUANTILES.values()) if ttfts else {}
    columns = {}
    for name, q in TTFT_QUANTILES.items():
        columns[f"ttft_{name}_seconds"] = quantile(ttfts, q) if ttfts else None
        low, high = intervals.get(q, (None, None))
        columns[f"ttft_{name}_low_seconds"], columns[f"ttft_{name}_high_seconds"] = low, high
    return columns


def cached_tokens(round_: RoundResult, previous: RoundResult | None) -> tuple[int | None, str | None]:
    """The round's cached tokens and where they come from: the engine's (usage), else the probe's own
    estimate, which is the ideal on the replica that served the round before and 0 on another one; None
    when neither is known."""
    if round_.cached_tokens is not None:
        return round_.cached_tokens, "engine"
    backends = (round_.backend, previous.backend if previous else "")
    if round_.ideal_cached_tokens is None or None in backends:
        return None, None
    return (round_.ideal_cached_tokens if backends[0] == backends[1] else 0), "estimate"


def round_rows(experiment: Experiment) -> list[dict]:
    """One row per route and round (per-round.csv), in seconds, tokens and 0-1 ratios.

    Ratios are token-weighted over the round's sessions (sums divided), never means of ratios. The
    cached ratio counts the probe's estimate for rounds whose engine reported no cached tokens
    (`cached_source` says which); cached / ideal, the engine's only. `ttft_median_ratio_to_a` is the
    route's median over A's in the same round.
    """
    rows = []
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        for number in range(1, experiment.rounds + 1):
            pairs = [
                (s.rounds[number - 1], s.rounds[number - 2] if number > 1 else None)
                for s in sessions
                if len(s.rounds) >= number
            ]
            ok = [(r, previous) for r, previous in pairs if r.ok]
            ttfts = sorted(r.ttft_seconds for r, _ in ok if r.ttft_seconds is not None)
            counted = [(r, *cached_tokens(r, previous)) for r, previous in ok if r.prompt_tokens is not None]
            counted = [(r, cached, source) for r, cached, source in counted if source]
            warm = [r for r, _, source in counted if source == "engine" and r.ideal_cached_tokens is not None]
            row = {"route": label, "round": number, "sessions": len(pairs), "errors": len(pairs) - len(ok)}
            row.update(ttft_columns(ttfts))
            row["prompt_tokens"] = sum(r.prompt_tokens for r, _, _ in counted)
            row["cached_tokens"] = sum(cached for _, cached, _ in counted)
            row["cached_source"] = "+".join(sorted({source for _, _, source in counted})) or None
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


def load_rows(experiment: Experiment) -> list[dict]:
    """One row per route (load.csv): throughput over the measured span and TTFT over all its rounds.

    The span runs from the route's first request to its last answer's end; throughput counts answered
    requests, and their prompt and generated tokens, over it.
    """
    rows = []
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        rounds = [r for s in sessions for r in s.rounds]
        ok = [r for r in rounds if r.ok and r.total_seconds is not None]
        span = (
            max(r.started_at + r.total_seconds for r in ok) - min(r.started_at for r in rounds) if ok else 0
        )
        ttfts = sorted(r.ttft_seconds for r in ok if r.ttft_seconds is not None)
        row = {"route": label, "requests": len(rounds), "answered": len(ok), "span_seconds": span}
        row["requests_per_second"] = ratio(len(ok), span)
        for name, tokens in (("prompt", "prompt_tokens"), ("generated", "completion_tokens")):
            row[f"{name}_tokens_per_second"] = ratio(sum(getattr(r, tokens) or 0 for r in ok), span)
        row.update(ttft_columns(ttfts))
        rows.append(row)
    return rows


def replica_rows(experiment: Experiment) -> list[dict]:
    """The requests each replica served per route (replicas.csv), from the backend each answer named;
    "unknown" for requests that named none. They add up to the requests the route sent."""
    rows = []
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        served = Counter(r.backend or "unknown" for s in sessions for r in s.rounds)
        rows += [{"route": label, "replica": b, "requests": n} for b, n in sorted(served.items())]
    return rows


def raw_rows(experiment: Experiment) -> list[dict]:
    """Every round of every session, in the order the sessions arrived (raw-rounds.csv)."""
    rows = []
    for order, (conversation, route) in enumerate(interleave(len(experiment.sessions[0]))):
        session = experiment.sessions[route][conversation]
        head = {"order": order, "route": session.target, "conversation": conversation}
        head["arrival_seconds"] = experiment.arrivals[conversation]
        rows += [{**head, "session_id": session.session_id, **asdict(r)} for r in session.rounds]
    return rows


# The report.


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
        lines.append(f"- {group}, {route.target}: {redact(api_url(route.base_url, 'chat/completions'))}")
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


# The plot (collectors.experiment_plot draws it).


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


def run_into(
    a: ProbeSettings,
    b: ProbeSettings,
    workload: Workload,
    out: Path,
    load: Load = Load(),
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
    experiment = run_experiment(a, b, conversations, load, block_sources=block_sources, on_session=on_session)
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
        "and route B (e.g. session affinity), each conversation arriving for both at the same moment. Report "
        "per round the median, p90 and p99 TTFT with bootstrap 95 % intervals and the cached ratio, and per "
        "route the stickiness, the throughput and the requests each replica served: CSVs, a Markdown report "
        "and a plot (PNG and interactive HTML) in DIR, and the report on stdout.",
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
        ("--system-tokens", workload.system_tokens, "synthetic system prompt, in tokens"),
        ("--turn-tokens", workload.turn_tokens, "synthetic user turn, in tokens"),
        ("--max-tokens", 8, "answer length in tokens; TTFT is what is measured"),
        ("--seed", workload.seed, "seed of the workload"),
    ):
        parser.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    parser.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="sessions in flight per route; default: no cap with --request-rate, else one session at a "
        "time over both routes, interleaved",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        metavar="R",
        help="sessions arriving per second per route, with seeded exponential gaps (a Poisson process); "
        "default: all at the start",
    )
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
    add_block_size_arguments(parser)
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch experiment`: 0 when it ran, 1 when every session failed, 2 on bad arguments."""
    try:
        api_key = resolve_api_key(args.api_key_env, args.api_key_file)
        workload = Workload(
            args.sessions, args.rounds, args.system_tokens, args.turn_tokens, args.seed, args.sharegpt
        )
        load = Load(args.concurrency, args.request_rate, args.seed)
        sources = block_size_sources(args, [args.a, args.b])
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
            experiment, markdown = run_into(a, b, workload, args.out, load, sources, progress)
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
