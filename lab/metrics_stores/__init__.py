"""What the lab's metrics go to: `prometheus` (scrapes, evaluates the rules and alerts, one process) or
`victoriametrics` (VictoriaMetrics single-node scraping, vmalert evaluating against it).

Each kind is one module behind the `MetricsStore` interface; `METRICS_STORES.lookup` finds one by its
`--metrics-store` name.
"""

from __future__ import annotations

from kvwatch.core.registry import Registry
from kvwatch.lab.metrics_stores import prometheus, victoriametrics
from kvwatch.lab.metrics_stores.base import MetricsStore

METRICS_STORES = Registry("metrics store", (module.STORE for module in (prometheus, victoriametrics)))

__all__ = ["METRICS_STORES", "MetricsStore"]
