"""vllm-router (PyPI `vllm-router`, the Rust `vllm-project/router`), a fork of sglang-router 0.2.

Its metrics are the `sgl_router_*` ones renamed `vllm_router_*` (and carry no # HELP lines); its
cache_aware policy also counts `vllm_router_prefix_routing_decisions_total{outcome}`, the router's
prediction of a cached prefix, like the cache hit / miss counters. Not the production-stack router,
whose metrics reuse the engine's `vllm:` names.
"""

from __future__ import annotations

from dataclasses import replace

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot
from kvwatch.collectors.engines.smg import read_sgl_router_layout


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed("vllm_router_")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    decisions = reader.by_label("vllm_router_prefix_routing_decisions_total", "outcome", optional=True)
    # Last: the snapshot it makes names the missing and invalid series of every read before.
    snapshot = read_sgl_router_layout(reader, "vllm-router", "vllm_router_", scraped_at)
    return replace(snapshot, router_cache_predictions={**snapshot.router_cache_predictions, **decisions})


FLAVOUR = Flavour(name="vllm-router", kind="router", detect=detect, read=read)
