"""NVIDIA Dynamo's frontend and KV router (`dynamo_frontend_*`, `dynamo_component_router_*`).

The frontend records each request's input and cached tokens (histograms: their sums give the reuse
the engines delivered) and its TTFT; in KV mode the router records the hit rate it predicted when it
chose a worker (`dynamo_component_router_kv_hit_rate`, a histogram whose mean is the prediction) and,
from dynamo PR #14103, its cache-reuse funnel in tokens (the reuse decomposition's legs).
Requests per worker are counted only on each worker (`dynamo_component_requests_total`), not here.
Series appear on their first request, so their absence is not reported as missing. The router exports
its worker-reuse counter (F4) at zero from the first routed request, also for backends that never report
reuse to it (Dynamo 1.6.1's mocker among them, whose answers' usage carries cached tokens all the same):
a zero F4 is read as not reported, and the delivered share falls back to the frontend's cached over
input tokens (tests/testdata/routers/dynamo-1.6.1-frontend-kv-mocker.prom, a real capture).
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot

PREDICTED = "dynamo_component_router_kv_hit_rate"
# The KV router's cache-reuse funnel (dynamo PR #14103): prompt tokens per routing attempt (F0), cached
# prefix tokens on the best eligible worker (F2) and on the selected one (F3), worker-reused tokens (F4).
ROUTER = "dynamo_component_router_"


def detect(exposition: Exposition) -> int:
    # Not `dynamo_component_*` alone: every Dynamo worker exports those next to the engine's own names.
    return exposition.count_prefixed("dynamo_frontend_", "dynamo_component_router_")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    return Snapshot(
        flavour="dynamo",
        scraped_at=scraped_at,
        prompt_tokens=reader.total("dynamo_frontend_input_sequence_tokens_sum", optional=True),
        cached_tokens=reader.total("dynamo_frontend_cached_tokens_sum", optional=True),
        ttft_buckets=reader.histogram("dynamo_frontend_time_to_first_token_seconds", optional=True),
        requests_running=reader.total("dynamo_frontend_inflight_requests", optional=True),
        predicted_ratio_sum=reader.total(f"{PREDICTED}_sum", optional=True),
        predictions=reader.total(f"{PREDICTED}_count", optional=True),
        routed_prompt_tokens=reader.total(f"{ROUTER}input_sequence_tokens_sum", optional=True),
        available_tokens=reader.total(f"{ROUTER}kv_best_eligible_cached_prefix_tokens_total", optional=True),
        routed_tokens=reader.total(f"{ROUTER}kv_selected_cached_prefix_tokens_total", optional=True),
        reused_tokens=_reported(reader.total(f"{ROUTER}kv_worker_reused_tokens_total", optional=True)),
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


def _reported(reused: float | None) -> float | None:
    """F4 as the workers reported it; None while it is still the zero Dynamo exports before any report."""
    return reused or None


FLAVOUR = Flavour(name="dynamo", kind="router", detect=detect, read=read)
