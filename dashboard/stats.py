"""Per-round TTFT statistics of probe history: medians and p90s with 95 % confidence intervals.

The intervals are distribution-free, from order statistics: of n samples, the number below the true
q-quantile is Binomial(n, q), so the samples ranked where that distribution leaves 2.5 % on either side
hold the quantile with 95 % confidence (exactly; the normal approximation's ranks, n*q -+ 1.96 *
sqrt(n*q*(1-q)), held a p90 of 30 samples with 92 % only). Fewer samples than a 95 % interval needs give
the widest there is, from the smallest to the largest. Unlike a bootstrap this costs one sort, so a week
of history stays cheap.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

CONFIDENCE = 0.95


def samples_below(n: int, q: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, q): how many of n samples lie below the q-quantile.
    In logarithms, so that a week of samples neither overflows nor underflows."""
    k = np.arange(n + 1)
    log_choose = np.concatenate(([0.0], np.cumsum(np.log(np.arange(n, 0, -1) / np.arange(1, n + 1)))))
    return np.cumsum(np.exp(log_choose + k * math.log(q) + (n - k) * math.log(1 - q)))


def quantile_interval(values: np.ndarray, q: float) -> tuple[float, float, float]:
    """The q-quantile of the values and its 95 % confidence interval: the samples of index `low` and
    `high` hold it when `low` < B <= `high`, with probability below[high] - below[low]."""
    ordered = np.sort(values)
    n = len(ordered)
    below = samples_below(n, q)
    tail = (1 - CONFIDENCE) / 2
    high = min(int(np.searchsorted(below, 1 - tail)), n - 1)
    low = max(int(np.searchsorted(below, min(tail, below[high] - CONFIDENCE), side="right")) - 1, 0)
    return float(np.quantile(ordered, q)), float(ordered[low]), float(ordered[high])


def ttft_by_round(rounds: pd.DataFrame, split: float | None = None) -> pd.DataFrame:
    """One row per target, period and round of the successful rounds: n, median and p90 TTFT (seconds),
    each with `_low` and `_high` bounds. The period is "all", or with `split` (unix seconds) "before" or
    "after" it by the round's own start: a fault mid-session changes the rounds that follow it."""
    ok = rounds[rounds["error_kind"].isna() & rounds["ttft_seconds"].notna()]
    if split is None:
        ok = ok.assign(period="all")
    else:
        ok = ok.assign(
            period=np.where(ok["started_at"] < pd.Timestamp(split, unit="s", tz="UTC"), "before", "after")
        )
    keys = ["target", "route_mode", "period", "round"]
    rows = []
    for key, group in ok.groupby(keys):
        values = group["ttft_seconds"].to_numpy()
        row = {**dict(zip(keys, key, strict=True)), "n": len(values)}
        for name, q in (("median", 0.5), ("p90", 0.9)):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = quantile_interval(values, q)
        rows.append(row)
    return pd.DataFrame(rows)
