"""What the engine and router flavour tests share: reading an exposition, a vLLM V1 one, routers' files."""

from __future__ import annotations

from kvwatch.collectors.engines import Exposition, Snapshot, detect_flavour
from paths import TESTDATA

ROUTERS = TESTDATA / "routers"


def read(text: str, scraped_at: float = 0.0) -> Snapshot:
    exposition = Exposition(text)
    return detect_flavour(exposition).read(exposition, scraped_at)


def vllm_v1(hits: float, queries: float, ttft_le_1: float = 0, ttft_count: float = 0) -> str:
    """A vLLM V1 (0.16+) exposition with two data-parallel engines."""
    return f"""\
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
vllm:prefix_cache_hits_total{{engine="1",model_name="m"}} 0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
vllm:prefix_cache_queries_total{{engine="1",model_name="m"}} 0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {queries}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.5",model_name="m"}} 0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="m"}} {ttft_le_1}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {ttft_count}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.2
vllm:kv_cache_usage_perc{{engine="1",model_name="m"}} 0.4
"""
