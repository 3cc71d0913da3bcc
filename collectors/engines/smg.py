"""The SGLang router (PyPI `sglang-router`, now SMG, PyPI `smg`), both generations of its metrics.

Up to 0.2.x (`sgl_router_*`) it counts requests per worker in `sgl_router_processed_requests_total`
and, under cache_aware, how often its own radix tree predicted a cached prefix. From 0.3.0, as the
SGLang Model Gateway (`smg_*`), `smg_worker_selection_total` has no worker label; requests per worker
come from the circuit breaker's outcome counter (a retried request counts once per attempt). SMG's
manual (routing-key) policy counts its sticky outcomes by branch (`occupied_hit`: the key's worker
served it; `occupied_miss`, `vacant`, `cap_respill`: it moved or was placed anew), and where each
routing key came from (`smg_routing_key_source_total{source}`); its cache_aware policy counts its
branches (`tree_match`: sent where its radix tree matched the prompt; `spill` and fallbacks: sent by
load or health) and the share of each prompt its tree matched (`smg_cache_aware_match_ratio`, a
histogram whose mean is the prediction): guesses from the router's tree, not engine hits. With KV
events subscribed (gRPC workers), the health of its KV-event index (router_state).
Counters appear only after their first event, so their absence is not reported as missing; the
worker-health gauge names every worker from the start.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot
from kvwatch.collectors.engines.router_state import read_index_health, read_session_table

MATCH_RATIO = "smg_cache_aware_match_ratio"


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed("smg_", "sgl_router_")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    if not exposition.count_prefixed("smg_"):
        return read_sgl_router_layout(reader, "sglang-router", "sgl_router_", scraped_at)
    return Snapshot(
        flavour="sglang-router",
        scraped_at=scraped_at,
        per_worker=_requests_per_worker(reader, "smg_worker_health", "smg_worker_cb_outcomes_total"),
        requests_running=reader.total("smg_worker_requests_active", optional=True),
        policy_decisions=reader.by_label("smg_worker_selection_total", "policy", optional=True),
        router_cache_predictions=reader.by_label(
            "smg_cache_aware_policy_branch_total", "branch", optional=True
        ),
        predicted_ratio_sum=reader.total(f"{MATCH_RATIO}_sum", optional=True),
        predictions=reader.total(f"{MATCH_RATIO}_count", optional=True),
        sticky_outcomes=reader.by_label("smg_manual_policy_branch_total", "branch", optional=True),
        routing_key_sources=reader.by_label("smg_routing_key_source_total", "source", optional=True),
        session_table=read_session_table(reader),
        index_health=read_index_health(reader),
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


def read_sgl_router_layout(reader: Reader, flavour: str, prefix: str, scraped_at: float) -> Snapshot:
    """The `sgl_router_*` metrics of sglang-router <= 0.2.x, which vllm-router (a fork) kept as `prefix`."""
    predictions = {
        "hit": reader.total(f"{prefix}cache_hits_total", optional=True),
        "miss": reader.total(f"{prefix}cache_misses_total", optional=True),
    }
    return Snapshot(
        flavour=flavour,
        scraped_at=scraped_at,
        per_worker=_requests_per_worker(
            reader, f"{prefix}worker_health", f"{prefix}processed_requests_total"
        ),
        requests_running=reader.total(f"{prefix}running_requests", optional=True),
        policy_decisions=reader.by_label(f"{prefix}policy_decisions_total", "policy", optional=True),
        router_cache_predictions={outcome: n for outcome, n in predictions.items() if n is not None},
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


def _requests_per_worker(reader: Reader, health: str, requests: str) -> dict[str, float]:
    """Requests per worker URL, with 0 for every worker the health gauge knows but no request reached;
    none when the request counter is invalid, which says nothing of any worker."""
    counted = reader.by_label(requests, "worker", optional=True)
    if requests in reader.invalid:
        return {}
    return dict.fromkeys(reader.label_values(health, "worker") or (), 0.0) | counted


FLAVOUR = Flavour(name="sglang-router", kind="router", detect=detect, read=read)
