"""vLLM V1 engine (0.8.5 and later): token counters of the local prefix cache.

The counters were renamed in 0.9 (`vllm:gpu_prefix_cache_*` -> `vllm:prefix_cache_*`); the old names
stayed until 0.11 and are read when the new ones are absent. `vllm:prompt_tokens_cached_total`
(local + external KV hits) only exists since 0.16. The opt-in Rust frontend (OpenMetrics only) registers
no `vllm:cache_config_info`; there the lookup counter is the evidence: vLLM looks up every prompt with
prefix caching on and none with it off, and without prompts there is none.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot, prefix_caching

# Series only the V1 engine exposes: they tell it from V0, which shares the generic vllm: names.
V1_ONLY = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_cached_total",
)


def detect(exposition: Exposition) -> int:
    return exposition.count(V1_ONLY)


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    hits = reader.total("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    cached = reader.total("vllm:prompt_tokens_cached_total", optional=True)
    queries = reader.total("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
    prompt = reader.total("vllm:prompt_tokens_total")
    caching = prefix_caching(reader, "vllm:cache_config_info", optional=True)
    if caching is None and queries is not None and prompt:
        caching = queries > 0
    return Snapshot(
        flavour="vllm",
        scraped_at=scraped_at,
        hits=hits,
        queries=queries,
        prompt_tokens=prompt,
        # Before 0.16 the local prefix-cache hits are the only cached-token count there is.
        cached_tokens=hits if cached is None else cached,
        ttft_buckets=reader.histogram("vllm:time_to_first_token_seconds"),
        requests_running=reader.total("vllm:num_requests_running"),
        requests_waiting=reader.total("vllm:num_requests_waiting"),
        kv_cache_usage=reader.fraction("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_caching_enabled=caching,
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


FLAVOUR = Flavour(name="vllm", kind="engine", detect=detect, read=read)
