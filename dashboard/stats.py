"""Per-round TTFT statistics of probe history: medians and p90s with 95 % confidence intervals
(`core.stats.quantile_interval` says how)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvwatch.core.stats import quantile_interval


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
