"""Sample statistics in one place: medians, quantiles of samples and their 95 % intervals.

Each figure keeps the definition it has always been shown with, so no number changes with the place
that computes it:

- `median`, the plain sample median (the middle value, or the mean of the two middle ones, exactly as
  `statistics.median`): the exporter's last-run TTFT per round and its warm / cold ratio, and the
  probe's report. One run's few sessions, shown as they are, without an interval.
- `quantile`, linear interpolation at rank q * (n - 1) of sorted values (numpy's and pandas' default
  method "linear", Hyndman and Fan's type 7), in plain Python: the experiment's median, p90 and p99.
- `bootstrap_cis`, percentile-bootstrap intervals: RESAMPLES resamples drawn with replacement by
  `random.Random(seed)`, seed 0, each one's `quantile`, and the `quantile` of those estimates at 2.5 %
  and 97.5 %: the experiment's intervals. TTFT is skewed and its tail is what load changes, so no
  normal approximation is assumed; the fixed seed makes a report reproducible.
- `quantile_interval`, the dashboard's per-round median and p90: the estimate by `np.quantile`'s
  default method "linear" (the definition of `quantile`, in numpy's arithmetic, which may differ from
  it in the last bit), and an exact, distribution-free interval from order statistics. Of n samples,
  the number below the true q-quantile is Binomial(n, q), so the samples ranked where that distribution
  leaves 2.5 % on either side hold the quantile with 95 % confidence (the normal approximation's ranks,
  n*q -+ 1.96 * sqrt(n*q*(1-q)), held a p90 of 30 samples with 92 % only). Fewer samples than a 95 %
  interval needs give the widest there is, from the smallest to the largest. Unlike a bootstrap this
  costs one sort and needs no seed, so a week of history stays cheap and a page deterministic.
- `median_and_p90`, the benchmarks' client skews: `median`, and the p90 by `statistics.quantiles`'
  default method "exclusive" (rank q * (n + 1), type 6), as their published tables were computed.

Quantiles of Prometheus histograms are not sample statistics: `collectors.engines.histogram_quantile`
interpolates inside buckets by PromQL's rule, so that a scrape reads as the boards do.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000


def median(values: Sequence[float]) -> float:
    """The middle of the values, or the mean of the two middle ones."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


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
    so that a report is reproducible. A p99 of fewer than 100 values is close to their largest, and so
    is its interval."""
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


def _samples_below(n: int, q: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, q): how many of n samples lie below the q-quantile.
    In logarithms, so that a week of samples neither overflows nor underflows."""
    import numpy as np  # here, not above: the probe and the exporter use this module without numpy

    k = np.arange(n + 1)
    log_choose = np.concatenate(([0.0], np.cumsum(np.log(np.arange(n, 0, -1) / np.arange(1, n + 1)))))
    return np.cumsum(np.exp(log_choose + k * math.log(q) + (n - k) * math.log(1 - q)))


def quantile_interval(values: np.ndarray, q: float) -> tuple[float, float, float]:
    """The q-quantile of the values and its 95 % confidence interval: the samples of index
    `low` and `high` hold it when `low` < B <= `high`, with probability below[high] - below[low]."""
    import numpy as np

    ordered = np.sort(values)
    n = len(ordered)
    below = _samples_below(n, q)
    tail = (1 - CONFIDENCE) / 2
    high = min(int(np.searchsorted(below, 1 - tail)), n - 1)
    low = max(int(np.searchsorted(below, min(tail, below[high] - CONFIDENCE), side="right")) - 1, 0)
    return float(np.quantile(ordered, q)), float(ordered[low]), float(ordered[high])


def median_and_p90(values: Sequence[float]) -> tuple[float, float]:
    """The median and the p90 ("exclusive" method) of at least two values."""
    return median(values), statistics.quantiles(values, n=10)[-1]
