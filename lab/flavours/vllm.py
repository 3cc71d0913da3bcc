"""vLLM V1 engine metrics, as vLLM 0.32 exposes them (tests/integration/test_vllm_contract.py compares
them with it)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvwatch.lab.flavours.base import CacheConfig, EngineMetrics, Finished, Prefill

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
# vLLM creates a child for every value of these labels at start-up, so each shows up from the first scrape.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
WAITING_REASONS = ("capacity", "deferred")


def request_token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


def set_cache_config_info(info: Gauge, cache: CacheConfig, **more_labels: str) -> None:
    """vLLM's cache_config_info, V0 and V1: one child whose labels are the configuration."""
    info.clear()
    info.labels(
        block_size=str(cache.block_size),
        cache_dtype="auto",
        enable_prefix_caching=str(cache.prefix_caching),
        num_gpu_blocks=str(cache.num_gpu_blocks),
        **more_labels,
    ).set(1)


class VllmMetrics(EngineMetrics):
    name = "vllm"

    def __init__(self, model_name: str, cache: CacheConfig) -> None:
        super().__init__(model_name, cache)
        self._engine = {"model_name": model_name, "engine": "0"}
        # In the order vLLM registers them, which is the order of the exposition.
        self._add_prefix_cache_counters()
        self._add_token_counters()
        self._add_load_gauges()
        self._add_latency_histograms(request_token_buckets(cache.max_model_len))
        self.set_prefix_caching(cache.prefix_caching)

    def _one(self, kind: type, name: str, doc: str, **options):
        """A family with the engine's only child."""
        return kind(name, doc, list(self._engine), registry=self.registry, **options).labels(**self._engine)

    def _each(self, kind: type, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict:
        """A family with a child per value of one more label."""
        metric = kind(name, doc, [*self._engine, label], registry=self.registry)
        return {value: metric.labels(**self._engine, **{label: value}) for value in values}

    def _add_prefix_cache_counters(self) -> None:
        self.queries = self._one(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.hits = self._one(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        # The lab has no KV connector: external lookups stay at zero, as on a vLLM without one.
        self._one(
            Counter,
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self._one(
            Counter,
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )

    def _add_token_counters(self) -> None:
        self.prompt_tokens = self._one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = self._each(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PROMPT_TOKEN_SOURCES,
        )
        self.prompt_tokens_cached = self._one(
            Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prompt_tokens_cached_by_source = self._each(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            "source",
            CACHE_HIT_SOURCES,
        )
        self.generation_tokens = self._one(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = self._each(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FINISHED_REASONS,
        )

    def _add_load_gauges(self) -> None:
        self.running = self._one(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = self._one(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.waiting_by_reason = self._each(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
            WAITING_REASONS,
        )
        self.kv_usage = self._one(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "kv_cache_size_tokens",
                "kv_offloading_backend",
                "kv_offloading_size",
                "num_gpu_blocks",
            ],
            registry=self.registry,
        )

    def _add_latency_histograms(self, token_buckets: tuple[float, ...]) -> None:
        self.ttft = self._one(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.e2e = self._one(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = self._one(
            Histogram,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = self._one(
            Histogram,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets=token_buckets,
        )
        self.prefill_kv_computed = self._one(
            Histogram,
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets=token_buckets,
        )

    def prefill_done(self, prefill: Prefill) -> None:
        # Without prefix caching vLLM looks nothing up, so queries and hits do not count at all.
        if prefill.prefix_caching:
            self.queries.inc(prefill.prompt_tokens)
            self.hits.inc(prefill.cached_tokens)
            self.prompt_tokens_cached_by_source["device"].inc(prefill.cached_tokens)
        self.prompt_tokens.inc(prefill.prompt_tokens)
        self.prompt_tokens_by_source["local_compute"].inc(prefill.prompt_tokens - prefill.cached_tokens)
        self.prompt_tokens_by_source["local_cache_hit"].inc(prefill.cached_tokens)
        self.prompt_tokens_cached.inc(prefill.cached_tokens)
        self.ttft.observe(prefill.ttft_seconds)
        self.queue_time.observe(prefill.queue_seconds)

    def finished(self, finished: Finished) -> None:
        self.generation_tokens.inc(finished.completion_tokens)
        self.request_success[finished.finished_reason].inc()
        self.e2e.observe(finished.e2e_seconds)
        self.request_prompt_tokens.observe(finished.prompt_tokens)
        self.prefill_kv_computed.observe(finished.prompt_tokens - finished.cached_tokens)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_by_reason["capacity"].set(waiting)
        self.kv_usage.set(kv_usage)

    def set_prefix_caching(self, enabled: bool) -> None:
        super().set_prefix_caching(enabled)
        set_cache_config_info(
            self.cache_config_info,
            self.cache,
            engine="0",
            kv_cache_size_tokens=str(self.cache.num_gpu_blocks * self.cache.block_size),
            kv_offloading_backend="native",
            kv_offloading_size="None",
        )
