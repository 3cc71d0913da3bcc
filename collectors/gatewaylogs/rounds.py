"""Real users' time to first byte by round: each request's place in its session (the n-th request of
the session the gateway logged) and the upstream's time to the first byte of its answer, per listener.

The source article's figure for real traffic: with affinity, later rounds reuse the session's cached
history and stay near round 1's cost; spread over replicas, they pay for the whole history. Rounds past
MAX_ROUND share one label ("8+"), so that a log's series stay bounded whatever its sessions' length.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Mapping

from kvwatch.core.stats import median

MAX_ROUND = 8
ROUNDS = (*(str(n) for n in range(1, MAX_ROUND)), f"{MAX_ROUND}+")
# Seconds: 5 ms steps where warm rounds of a small model answer, coarser up to a long cold prefill.
BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2,
           0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)  # fmt: skip
# The exact median is of each listener and round's latest requests: recent, and in bounded memory.
RECENT = 256


def round_label(round_: int) -> str:
    """The `round` label of a session's `round_`-th request (1-based)."""
    return ROUNDS[min(round_, MAX_ROUND) - 1]


class _Histogram:
    __slots__ = ("counts", "total", "recent")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one: over the largest bucket
        self.total = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.recent.append(seconds)

    def cumulative(self) -> tuple[tuple[tuple[str, float], ...], float]:
        """Prometheus's buckets (le, cumulative count) up to +Inf, and the sum."""
        running, buckets = 0, []
        for bound, count in zip((*map(repr, BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return tuple(buckets), self.total


class RoundTimes:
    """First-byte times of one log's requests by (listener, round label); not thread-safe: the tally's
    lock guards it."""

    def __init__(self) -> None:
        self._by_round: defaultdict[tuple[str, str], _Histogram] = defaultdict(_Histogram)

    def observe(self, listener: str, round_: int, seconds: float) -> None:
        self._by_round[listener, round_label(round_)].observe(seconds)

    def histograms(self) -> Mapping[tuple[str, str], tuple[tuple[tuple[str, float], ...], float]]:
        return {key: histogram.cumulative() for key, histogram in sorted(self._by_round.items())}

    def medians(self) -> Mapping[tuple[str, str], float]:
        return {key: median(list(h.recent)) for key, h in sorted(self._by_round.items())}
