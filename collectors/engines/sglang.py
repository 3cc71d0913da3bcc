"""SGLang engine (`--enable-metrics`): cached and prompt token counters, the batch gauge as a fallback.

`sglang:cached_tokens_total` (since 0.4.6, split by `cache_source` since ~0.5.12) and
`sglang:prompt_tokens_total` are counted per finished request and give a token-weighted ratio over any
window. `sglang:cache_hit_rate` only describes the last prefill batch (and read 0 between prefills up
to 0.5.16), so it is used only when the counters are absent, and marked as such. SGLang exports no
cache_config_info, so whether prefix caching is on is unknown.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, RatioGauge, Reader, Snapshot

# Every tensor / pipeline / expert-parallel rank of one scheduler reports the same batch when
# --enable-metrics-for-all-schedulers is set; data-parallel ranks (dp_rank) report their own.
SAME_BATCH_RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")
HIT_RATIO_FALLBACK = "sglang-batch-gauge-fallback"


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed("sglang:")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    prompt = reader.total("sglang:prompt_tokens_total")
    cached = reader.total("sglang:cached_tokens_total")
    gauge = None
    if cached is None or prompt is None:
        hit_rate = reader.fraction("sglang:cache_hit_rate", duplicated_by=SAME_BATCH_RANKS)
        gauge = None if hit_rate is None else RatioGauge(HIT_RATIO_FALLBACK, hit_rate)
    return Snapshot(
        flavour="sglang",
        scraped_at=scraped_at,
        hits=cached,
        queries=prompt,
        hit_ratio_gauge=gauge,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_buckets=reader.histogram("sglang:time_to_first_token_seconds"),
        requests_running=reader.total("sglang:num_running_reqs", duplicated_by=SAME_BATCH_RANKS),
        requests_waiting=reader.total("sglang:num_queue_reqs", duplicated_by=SAME_BATCH_RANKS),
        kv_cache_usage=reader.fraction("sglang:token_usage", duplicated_by=SAME_BATCH_RANKS),
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


FLAVOUR = Flavour(name="sglang", kind="engine", detect=detect, read=read)
