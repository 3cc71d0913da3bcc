"""The cluster label's default name, and one bound for every label value kvwatch takes from outside (a
server's backend header, a gateway log's listener and upstream, the configured cluster), so that no input
can grow /metrics without limit.

Within one scope (a probed route, a followed log) a label shows its first `MAX_VALUES_PER_LABEL`
distinct values as they are; any further value, and any value longer than `MAX_LABEL_VALUE_LENGTH`, is
shown as `OTHER` and counted by reason (`FOLD_REASONS`), so the folding is visible on /metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

MAX_VALUES_PER_LABEL = 32
# Longer than any name a server or gateway gives: an IPv6 address with its port (47), a unix socket
# (`unix:` and up to 107 bytes of path), a Kubernetes pod name (63) with its namespace. A longer value
# is garbage, and one such value per series would make each scrape kilobytes larger.
MAX_LABEL_VALUE_LENGTH = 128
OTHER = "other"
# The label that tells clusters apart, as the Prometheus (external_labels, remote_write) or kvwatch's own
# exporter (exporter.cluster) sets it; a Prometheus of one cluster without it reads as one cluster.
CLUSTER_LABEL = "cluster"
FOLD_REASONS = ("too_many_values", "too_long")


def label_value_problem(value: str) -> str | None:
    """Why `value` cannot be shown as a label value, or None."""
    if len(value) > MAX_LABEL_VALUE_LENGTH:
        return f"must be at most {MAX_LABEL_VALUE_LENGTH} characters, got {len(value)}"
    return None


class BoundedLabel:
    """The values one label shows within one scope; `folded` counts, by reason, the values shown as
    OTHER. `always` values (a fixed label value such as "none") are shown without taking a place."""

    def __init__(self, always: Iterable[str] = (), limit: int = MAX_VALUES_PER_LABEL) -> None:
        self._always = frozenset(always)
        self._limit = limit
        self._shown: set[str] = set()
        self.folded: Counter[str] = Counter({reason: 0 for reason in FOLD_REASONS})

    def shows(self, values: Iterable[str]) -> bool:
        """Whether every one of `values` is shown as itself already: calling for each would change
        nothing and return it, so that a batch of them needs no call."""
        return (self._shown | self._always).issuperset(values)

    def __call__(self, value: str) -> str:
        """`value` as the label shows it: itself, or OTHER."""
        if value in self._always or value in self._shown:
            return value
        if label_value_problem(value):
            reason = "too_long"
        elif len(self._shown) >= self._limit:
            reason = "too_many_values"
        else:
            self._shown.add(value)
            return value
        self.folded[reason] += 1
        return OTHER
