"""vLLM V0 engine (0.5 to 0.7): the engine computes the hit ratio itself, as a gauge.

`vllm:gpu_prefix_cache_hit_rate` is a block hit rate since the engine started, and -1 when it has no
data or prefix caching is off; V0 has no prefix-cache token counters to window.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, RatioGauge, Reader, Snapshot, prefix_caching

# Series only the V0 engine exposes (V1 dropped the ratio gauges, swapping and the CPU cache).
V0_ONLY = (
    "vllm:gpu_prefix_cache_hit_rate",
    "vllm:cpu_prefix_cache_hit_rate",
    "vllm:num_requests_swapped",
    "vllm:cpu_cache_usage_perc",
    "vllm:avg_prompt_throughput_toks_per_s",
)
HIT_RATIO_SOURCE = "v0-gauge"


def detect(exposition: Exposition) -> int:
    return exposition.count(V0_ONLY)


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    hit_rate = reader.fraction("vllm:gpu_prefix_cache_hit_rate", no_data=-1.0)
    return Snapshot(
        flavour="vllm-legacy",
        scraped_at=scraped_at,
        hit_ratio_gauge=None if hit_rate is None else RatioGauge(HIT_RATIO_SOURCE, hit_rate),
        prompt_tokens=reader.total("vllm:prompt_tokens_total"),
        ttft_buckets=reader.histogram("vllm:time_to_first_token_seconds"),
        requests_running=reader.total("vllm:num_requests_running"),
        requests_waiting=reader.total("vllm:num_requests_waiting"),
        kv_cache_usage=reader.fraction("vllm:gpu_cache_usage_perc"),
        prefix_caching_enabled=prefix_caching(reader, "vllm:cache_config_info"),
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


FLAVOUR = Flavour(name="vllm-legacy", kind="engine", detect=detect, read=read)
