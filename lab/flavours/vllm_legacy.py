"""vLLM V0 engine metrics (0.5 to 0.7), with the engine-computed prefix-cache hit-rate gauge."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvwatch.lab.flavours import vllm
from kvwatch.lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill

TTFT_BUCKETS = tuple(bound for bound in vllm.TTFT_BUCKETS if bound <= 10.0)  # V1 added 20 s and up
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class VllmLegacyMetrics(EngineMetrics):
    name = "vllm-legacy"

    def __init__(self, model_name: str, cache: CacheConfig) -> None:
        super().__init__(model_name, cache)
        labels = ["model_name"]
        reg = self.registry
        self._query_blocks = 0
        self._hit_blocks = 0

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        self.hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.")
        self.running = gauge("vllm:num_requests_running", "Number of requests currently running on GPU.")
        self.swapped = gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "information of cache_config",
            ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["finished_reason", "model_name"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            registry=reg,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            registry=reg,
            buckets=E2E_BUCKETS,
        ).labels(model_name)
        self.set_prefix_caching(cache.prefix_caching)

    def prefill_done(self, prefill: Prefill) -> None:
        if prefill.prefix_caching:
            block = self.cache.block_size
            self._query_blocks += -(-prefill.prompt_tokens // block)
            self._hit_blocks += prefill.cached_tokens // block
        self._publish_hit_rate()
        self.prompt_tokens.inc(prefill.prompt_tokens)
        self.ttft.observe(prefill.ttft_seconds)

    def finished(self, finished: Finished) -> None:
        self.generation_tokens.inc(finished.completion_tokens)
        self.request_success.labels(
            finished_reason=finished.finished_reason, model_name=self.model_name
        ).inc()
        self.e2e.observe(finished.e2e_seconds)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.gpu_cache_usage.set(kv_usage)

    def set_prefix_caching(self, enabled: bool) -> None:
        super().set_prefix_caching(enabled)
        vllm.set_cache_config_info(self.cache_config_info, self.cache)
        self._publish_hit_rate()

    def _publish_hit_rate(self) -> None:
        """V0 reports the block hit rate since start, and -1 when it has no data or caching is off."""
        if not self.cache.prefix_caching or self._query_blocks == 0:
            self.hit_rate.set(-1)
        else:
            self.hit_rate.set(self._hit_blocks / self._query_blocks)
