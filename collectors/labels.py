"""The labels of kvwatch's own series, which a cluster label must not take."""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs import metrics as gateway_log_metrics
from kvwatch.collectors.probe.metrics import COUNTERS, ROUTE_LABELS


def label_names() -> frozenset[str]:
    """Every label of kvwatch's own series (probes, gateway logs, the store's writer): a cluster label of
    the same name would overwrite it on every sample (config/settings.py refuses one)."""
    probes = {
        *ROUTE_LABELS,
        "expect_sticky",
        *(label for _, _, extra in COUNTERS.values() for label in extra),
    }
    return frozenset(
        probes | gateway_log_metrics.LABEL_NAMES | {"reason"}
    )  # the store's kvwatch_store_writes_dropped
