"""Engine metrics flavours of the simulated replica: one module per engine, behind one interface.

Each flavour exposes the exact metric names, types, labels and histogram buckets of the engine version
it imitates (see docs/lab.md, "The lab replica"), so kvwatch's collectors, rules and
dashboards are tested against what the real engines print. `SIMULATED_FLAVOURS.lookup` finds one by name.
"""

from __future__ import annotations

from kvwatch.core.registry import Registry
from kvwatch.lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill
from kvwatch.lab.flavours.sglang import SglangMetrics
from kvwatch.lab.flavours.vllm import VllmMetrics
from kvwatch.lab.flavours.vllm_legacy import VllmLegacyMetrics

SIMULATED_FLAVOURS: Registry[type[EngineMetrics]] = Registry(
    "simulated flavour", (VllmMetrics, VllmLegacyMetrics, SglangMetrics)
)

__all__ = ["SIMULATED_FLAVOURS", "CacheConfig", "EngineMetrics", "Finished", "Prefill"]
