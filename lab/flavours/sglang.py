"""SGLang engine metrics as 0.5.20+ exposes them with `--enable-metrics`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvwatch.lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill

TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)


class SglangMetrics(EngineMetrics):
    name = "sglang"

    def __init__(self, model_name: str, cache: CacheConfig) -> None:
        super().__init__(model_name, cache)
        reg = self.registry
        # Tokenizer-side (request-level) and scheduler-side metrics carry different labels.
        request = {"model_name": model_name, "engine_type": "unified"}
        scheduler = {**request, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self._request = request

        def counter(name: str, doc: str, extra: list[str]) -> Counter:
            return Counter(name, doc, [*request, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(scheduler), registry=reg).labels(**scheduler)

        def streamed_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, [*request, "is_streaming"], registry=reg, buckets=buckets)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", ["is_streaming"]
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", ["is_streaming"]
        )
        self.cached_tokens = counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            ["cache_source"],
        )
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.", ["is_streaming"])
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.ttft = streamed_histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = streamed_histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )

    def _streaming(self, streaming: bool) -> dict[str, str]:
        return {**self._request, "is_streaming": str(streaming).lower()}

    def prefill_done(self, prefill: Prefill) -> None:
        # The gauge is the hit ratio of the last prefill batch; here every batch is one request.
        if prefill.prompt_tokens:
            self.cache_hit_rate.set(prefill.cached_tokens / prefill.prompt_tokens)
        self.ttft.labels(**self._streaming(prefill.streaming)).observe(prefill.ttft_seconds)

    def finished(self, finished: Finished) -> None:
        labels = self._streaming(finished.streaming)
        # SGLang counts prompt and cached tokens per finished request, cached only when > 0.
        self.prompt_tokens.labels(**labels).inc(finished.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(finished.completion_tokens)
        self.num_requests.labels(**labels).inc()
        if finished.cached_tokens > 0:
            self.cached_tokens.labels(**self._request, cache_source="device").inc(finished.cached_tokens)
        self.e2e.labels(**labels).observe(finished.e2e_seconds)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.queued.set(waiting)
        self.token_usage.set(kv_usage)
