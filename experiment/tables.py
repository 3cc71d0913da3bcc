"""The experiment's figures, one list of rows per CSV: per route and round, per route, per replica, and
every round; TTFT quantiles with percentile-bootstrap intervals (`core.stats` says how)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict

from kvwatch.collectors.probe.records import RoundResult
from kvwatch.core.stats import bootstrap_cis, quantile
from kvwatch.experiment.design import Experiment, interleave

TTFT_QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}


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
