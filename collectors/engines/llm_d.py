"""llm-d's endpoint picker (EPP, llm-d-router >= 0.10): `llm_d_epp_*`, and the `inference_*` names
it still emits, deprecated, read when the canonical ones are absent.

Per endpoint it counts scheduling attempts (`scheduler_attempts_total{endpoint_name}`, formerly
`inference_extension_scheduler_attempts_total{pod_name}`); its prefix indexer predicts, per lookup,
the share of the prompt's prefix it believes cached (`prefix_indexer_hit_ratio`, a histogram whose
mean is the prediction); and from the engines' usage it records each request's input and cached
tokens, the reuse its clients were delivered. Its prefix plugin also records, per request, the prompt
tokens, the most any candidate endpoint held and what the chosen one held (the reuse decomposition's
available and routed legs, token-weighted). Series appear on their first event, so their absence
is not reported as missing.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot

PREFIXES = ("llm_d_epp_", "inference_objective_", "inference_pool_", "inference_extension_")
ATTEMPTS = "llm_d_epp_scheduler_attempts_total"
DEPRECATED_ATTEMPTS = "inference_extension_scheduler_attempts_total"
HIT_RATIO = ("llm_d_epp_prefix_indexer_hit_ratio", "inference_extension_prefix_indexer_hit_ratio")
# The prefix plugin's token-weighted histograms (llm-d-router PR #2897): per request, the prompt tokens,
# the best candidate's and the chosen endpoint's predicted cached tokens.
PREFIX = "llm_d_epp_prefix_"


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed(*PREFIXES)


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    if exposition.has(ATTEMPTS):
        attempts = reader.by_label(ATTEMPTS, "endpoint_name")
    else:
        attempts = reader.by_label(DEPRECATED_ATTEMPTS, "pod_name", optional=True)
    return Snapshot(
        flavour="llm-d-epp",
        scraped_at=scraped_at,
        prompt_tokens=reader.total(
            "llm_d_epp_request_input_tokens_sum", "inference_objective_input_tokens_sum", optional=True
        ),
        cached_tokens=reader.total(
            "llm_d_epp_request_cached_tokens_sum",
            "inference_objective_prompt_cached_tokens_sum",
            optional=True,
        ),
        ttft_buckets=reader.histogram("llm_d_epp_request_ttft_seconds", optional=True),
        predicted_ratio_sum=reader.total(*(f"{name}_sum" for name in HIT_RATIO), optional=True),
        predictions=reader.total(*(f"{name}_count" for name in HIT_RATIO), optional=True),
        routed_prompt_tokens=reader.total(f"{PREFIX}prompt_tokens_sum", optional=True),
        available_tokens=reader.total(f"{PREFIX}best_available_cached_tokens_sum", optional=True),
        routed_tokens=reader.total(f"{PREFIX}predicted_cached_tokens_sum", optional=True),
        per_worker={endpoint: n for endpoint, n in attempts.items() if endpoint},  # failures name none
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


FLAVOUR = Flavour(name="llm-d-epp", kind="router", detect=detect, read=read)
