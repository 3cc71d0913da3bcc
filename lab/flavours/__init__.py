"""Engine metrics flavours of the simulated replica: one module per engine, behind one interface.

Each flavour exposes the exact metric names, types, labels and histogram buckets of the engine version
it imitates (see the README's "The lab replica" section), so kvwatch's collectors, rules and
dashboards are tested against what the real engines print.
"""

from __future__ import annotations

from kvwatch.lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill
from kvwatch.lab.flavours.sglang import SglangMetrics
from kvwatch.lab.flavours.vllm import VllmMetrics
from kvwatch.lab.flavours.vllm_legacy import VllmLegacyMetrics

FLAVOURS: dict[str, type[EngineMetrics]] = {
    "vllm": VllmMetrics,
    "vllm-legacy": VllmLegacyMetrics,
    "sglang": SglangMetrics,
}

__all__ = ["FLAVOURS", "CacheConfig", "EngineMetrics", "Finished", "Prefill", "make_metrics"]


def make_metrics(flavour: str, model_name: str, cache: CacheConfig) -> EngineMetrics:
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}; known: {', '.join(sorted(FLAVOURS))}")
    return FLAVOURS[flavour](model_name, cache)
