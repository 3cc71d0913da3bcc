"""vLLM V1 engine metrics, as the current releases (0.16 and later) expose them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class VllmMetrics(EngineMetrics):
    def __init__(self, model_name: str, cache: CacheConfig) -> None:
        super().__init__(model_name, cache)
        labels = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": "0"}
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(**self._labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(**self._labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(**self._labels)

        self.queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "cache_dtype", "enable_prefix_caching", "engine", "num_gpu_blocks"],
            registry=reg,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.set_prefix_caching(cache.prefix_caching)

    def prefill_done(self, prefill: Prefill) -> None:
        if prefill.prefix_caching:
            self.queries.inc(prefill.prompt_tokens)
            self.hits.inc(prefill.cached_tokens)
        self.prompt_tokens.inc(prefill.prompt_tokens)
        self.prompt_tokens_cached.inc(prefill.cached_tokens)
        self.ttft.observe(prefill.ttft_seconds)
        self.queue_time.observe(prefill.queue_seconds)

    def finished(self, finished: Finished) -> None:
        self.generation_tokens.inc(finished.completion_tokens)
        self.request_success.labels(**self._labels, finished_reason=finished.finished_reason).inc()
        self.e2e.observe(finished.e2e_seconds)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def set_prefix_caching(self, enabled: bool) -> None:
        super().set_prefix_caching(enabled)
        self.cache_config_info.clear()
        self.cache_config_info.labels(
            block_size=str(self.cache.block_size),
            cache_dtype="auto",
            enable_prefix_caching=str(enabled),
            engine="0",
            num_gpu_blocks=str(self.cache.num_gpu_blocks),
        ).set(1)
