"""Each replica flavour exposes exactly the engine's metric names, types, labels and buckets.

The expected names come from the engines' sources (see ../shared/reference/metrics.md); where a real
/metrics capture of that engine exists in ../shared/reference/samples/, the shared families are also
compared with it.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.lab.flavours import SIMULATED_FLAVOURS, CacheConfig, Finished, Prefill
from kvwatch.lab.flavours.vllm import request_token_buckets
from paths import SHARED

EXPECTED = {
    "vllm": {
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:external_prefix_cache_queries": "counter",
        "vllm:external_prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:prompt_tokens_cached_by_source": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_prefill_kv_computed_tokens": "histogram",
    },
    "vllm-legacy": {
        "vllm:gpu_prefix_cache_hit_rate": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_swapped": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    },
    "sglang": {
        "sglang:prompt_tokens": "counter",
        "sglang:generation_tokens": "counter",
        "sglang:cached_tokens": "counter",
        "sglang:num_requests": "counter",
        "sglang:cache_hit_rate": "gauge",
        "sglang:num_running_reqs": "gauge",
        "sglang:num_queue_reqs": "gauge",
        "sglang:token_usage": "gauge",
        "sglang:time_to_first_token_seconds": "histogram",
        "sglang:e2e_request_latency_seconds": "histogram",
    },
}

TTFT_BUCKETS = {
    "vllm": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm-legacy": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0],
    "sglang": [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400],
}  # fmt: skip

SAMPLES = {
    "vllm": "vllm-v1-0.10.0-production-stack-issue617-excerpt.prom",
    "vllm-legacy": "vllm-v0-aibrix-runtime-doc.prom",
}


def exercised(flavour: str, prefix_caching: bool = True):
    """A flavour's metrics after one request (64 of 100 prompt tokens cached), parsed back from text."""
    metrics = SIMULATED_FLAVOURS.lookup(flavour)(
        "lab-model", CacheConfig(16, 5000, prefix_caching, max_model_len=8192)
    )
    cached = 64 if prefix_caching else 0
    metrics.set_load(running=1, waiting=2, kv_usage=0.25)
    metrics.prefill_done(Prefill(100, cached, prefix_caching, 0.01, 0.2, streaming=True))
    metrics.finished(Finished(100, cached, 10, 0.5, streaming=True, finished_reason="stop"))
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    return metrics, families


def value(families, name: str, sample: str | None = None) -> float:
    family = families[name]
    (found,) = [s.value for s in family.samples if s.name == (sample or name)]
    return found


@pytest.mark.parametrize("flavour", sorted(SIMULATED_FLAVOURS))
def test_exposes_exactly_the_engine_families(flavour):
    _, families = exercised(flavour)
    assert {name: f.type for name, f in families.items()} == EXPECTED[flavour]


@pytest.mark.parametrize("flavour", sorted(SIMULATED_FLAVOURS))
def test_ttft_histogram_uses_the_engine_buckets(flavour):
    _, families = exercised(flavour)
    name = f"{flavour.split('-')[0]}:time_to_first_token_seconds"
    bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
    assert bounds == [*map(float, TTFT_BUCKETS[flavour]), float("inf")]


def by_label(families, name: str, label: str) -> dict[str, float]:
    """A family's current values keyed by one label (its `_created` samples left out)."""
    return {s.labels[label]: s.value for s in families[name].samples if not s.name.endswith("_created")}


def test_vllm_counts_queries_hits_and_prompt_tokens_by_source():
    _, families = exercised("vllm")
    assert value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 100
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 64
    assert value(families, "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total") == 64
    assert by_label(families, "vllm:prompt_tokens_by_source", "source") == {
        "local_compute": 36,
        "local_cache_hit": 64,
        "external_kv_transfer": 0,
    }
    assert by_label(families, "vllm:prompt_tokens_cached_by_source", "source") == {
        "device": 64,
        "host": 0,
        "p2p": 0,
        "disk": 0,
        "external_unspecified": 0,
    }
    external = "vllm:external_prefix_cache_queries"
    assert value(families, external, f"{external}_total") == 0
    assert value(families, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 100
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert value(families, computed, f"{computed}_sum") == 36
    assert by_label(families, "vllm:request_success", "finished_reason") == {
        "stop": 1,
        "length": 0,
        "abort": 0,
        "error": 0,
        "repetition": 0,
    }
    assert by_label(families, "vllm:num_requests_waiting_by_reason", "reason") == {
        "capacity": 2,
        "deferred": 0,
    }
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["enable_prefix_caching"] == "True" and info["engine"] == "0"
    assert info["kv_cache_size_tokens"] == str(5000 * 16)


def test_vllm_lookups_stay_flat_and_info_says_off_without_prefix_caching():
    metrics, families = exercised("vllm", prefix_caching=False)
    assert value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 0
    assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 100
    assert by_label(families, "vllm:prompt_tokens_by_source", "source")["local_compute"] == 100
    assert families["vllm:cache_config_info"].samples[0].labels["enable_prefix_caching"] == "False"


def test_vllm_token_histograms_are_bucketed_up_to_the_context_length():
    assert request_token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert request_token_buckets(8192)[-3:] == (1000, 2000, 5000)
    _, families = exercised("vllm")
    for name in ("vllm:request_prompt_tokens", "vllm:request_prefill_kv_computed_tokens"):
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*request_token_buckets(8192), float("inf")]


def test_vllm_legacy_hit_rate_is_minus_one_without_data_or_caching():
    metrics = SIMULATED_FLAVOURS.lookup("vllm-legacy")("m", CacheConfig(16, 100, True, max_model_len=8192))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert value(families, "vllm:gpu_prefix_cache_hit_rate") == -1
    _, families = exercised("vllm-legacy")
    # 100 prompt tokens = 7 queried blocks, 64 cached tokens = 4 hit blocks.
    assert value(families, "vllm:gpu_prefix_cache_hit_rate") == pytest.approx(4 / 7)
    _, families = exercised("vllm-legacy", prefix_caching=False)
    assert value(families, "vllm:gpu_prefix_cache_hit_rate") == -1


def test_sglang_counts_cached_tokens_per_finished_request():
    _, families = exercised("sglang")
    cached = families["sglang:cached_tokens"].samples[0]
    assert cached.name == "sglang:cached_tokens_total" and cached.value == 64
    assert cached.labels["cache_source"] == "device"
    assert value(families, "sglang:cache_hit_rate") == pytest.approx(0.64)
    assert families["sglang:num_running_reqs"].samples[0].labels["tp_rank"] == "0"


@pytest.mark.parametrize("flavour", sorted(SAMPLES))
def test_families_shared_with_a_real_capture_have_its_type_and_labels(flavour):
    sample = SHARED / "reference" / "samples" / SAMPLES[flavour]
    if not sample.exists():
        pytest.skip(f"reference capture {sample} is not beside this checkout")
    real = {f.name: f for f in text_string_to_metric_families(sample.read_text())}
    _, ours = exercised(flavour)
    shared = sorted(set(real) & set(ours))
    assert len(shared) >= 2, shared
    for name in shared:
        assert ours[name].type == real[name].type, name
        real_labels = {k for s in real[name].samples for k in s.labels} - {"le"}
        our_labels = {k for s in ours[name].samples for k in s.labels} - {"le"}
        if name == "vllm:cache_config_info":
            assert our_labels <= real_labels, name  # we expose a subset of the static config
        else:
            assert our_labels == real_labels, name
