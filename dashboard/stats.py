"""Per-round TTFT statistics of probe history: medians and p90s with 95 % confidence intervals.

The intervals are distribution-free, from order statistics: the q-quantile of n samples lies, with 95 %
confidence, between the samples ranked n*q -+ 1.96*sqrt(n*q*(1-q)). Unlike a bootstrap this costs one
sort, so a week of history stays cheap.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

Z_95 = 1.96


def quantile_interval(values: np.ndarray, q: float) -> tuple[float, float, float]:
    """The q-quantile of the values and its 95 % confidence interval."""
    ordered = np.sort(values)
    n = len(ordered)
    spread = Z_95 * math.sqrt(n * q * (1 - q))
    low = min(max(math.floor(n * q - spread), 0), n - 1)
    high = min(max(math.ceil(n * q + spread), 0), n - 1)
    return float(np.quantile(ordered, q)), float(ordered[low]), float(ordered[high])


def ttft_by_round(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per target and round of the successful rounds: n, median and p90 TTFT (seconds), each
    with `_low` and `_high` bounds."""
    ok = rounds[rounds["error_kind"].isna() & rounds["ttft_seconds"].notna()]
    rows = []
    for (target, route_mode, round_), group in ok.groupby(["target", "route_mode", "round"]):
        values = group["ttft_seconds"].to_numpy()
        row = {"target": target, "route_mode": route_mode, "round": round_, "n": len(values)}
        for name, q in (("median", 0.5), ("p90", 0.9)):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = quantile_interval(values, q)
        rows.append(row)
    return pd.DataFrame(rows)
