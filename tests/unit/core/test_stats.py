"""core.stats: the plain sample median and the benchmarks' p90 (the experiment's quantiles and intervals
are tested in tests/unit/experiment, the dashboard's in tests/unit/dashboard)."""

from __future__ import annotations

import statistics

import pytest

from kvwatch.core.stats import median, median_and_p90


@pytest.mark.parametrize("values", [[3.0], [0.3, 0.1], [0.5, 0.1, 0.4], [0.4, 0.1, 0.3, 0.2]])
def test_median_is_the_middle_or_the_mean_of_the_two_middle_values(values):
    assert median(values) == statistics.median(values)


def test_the_benchmarks_p90_is_the_exclusive_method():
    """Rank q * (n + 1): of 1..9 the p90 is 9, where linear interpolation (rank q * (n - 1)) gives 8.2."""
    assert median_and_p90([float(v) for v in range(1, 10)]) == (5.0, 9.0)
