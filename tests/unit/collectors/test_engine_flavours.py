"""Engine flavours normalised, on real captures (facts: ../shared/reference/metrics.md) and synthetic ones."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from engine_expositions import ROUTERS, read, vllm_v1

from kvwatch.collectors.engines import Snapshot, histogram_quantile, normalise
from paths import SHARED, TESTDATA

SAMPLES = SHARED / "reference" / "samples"


def sample(name: str) -> Snapshot:
    path = SAMPLES / name
    if not path.exists():
        pytest.skip(f"real capture {path} is not there (it lives in the shared reference, not the repo)")
    return read(path.read_text())


# Real captures (see ../shared/reference/samples/PROVENANCE.md).


@pytest.mark.parametrize(
    ("path", "flavour"),
    [
        (SAMPLES / "vllm-v0-aibrix-runtime-doc.prom", "vllm-legacy"),
        (SAMPLES / "vllm-v0-0.5.x-kubeai-mock-metrics.prom", "vllm-legacy"),
        (SAMPLES / "vllm-v1-0.10.0-production-stack-issue617-excerpt.prom", "vllm"),
        (SAMPLES / "sglang-0.3.x-docs-production-metrics-excerpt.prom", "sglang"),
        # Hand-written router expositions: each file's header says where its names come from.
        (ROUTERS / "smg-1.13.prom", "sglang-router"),
        (ROUTERS / "llm-d-epp-0.10.prom", "llm-d-epp"),
        (ROUTERS / "dynamo-frontend.prom", "dynamo"),
        (ROUTERS / "llm-d-epp-prefix-tokens.prom", "llm-d-epp"),
        (ROUTERS / "dynamo-router-funnel.prom", "dynamo"),
        (ROUTERS / "dynamo-1.6.1-frontend-kv-mocker.prom", "dynamo"),  # a real capture, see its header
        (ROUTERS / "aibrix-gateway-0.7.prom", "aibrix-gateway"),
    ],
    ids=lambda value: value.name if isinstance(value, Path) else value,
)
def test_flavour_is_detected(path: Path, flavour: str):
    if not path.exists():
        pytest.skip(f"{path} is not there (the real captures live in the shared reference, not the repo)")
    assert read(path.read_text()).flavour == flavour


def test_v0_hit_rate_of_minus_one_is_unknown_not_zero():
    """AIBrix's vLLM ~0.7 capture: `vllm:gpu_prefix_cache_hit_rate -1.0`, prefix caching off."""
    record = normalise(sample("vllm-v0-aibrix-runtime-doc.prom"))
    assert record.hit_ratio is None and record.hit_ratio_source == "v0-gauge"
    assert (record.window_seconds, record.prompt_tokens, record.cached_tokens) == (None, 148, None)
    assert (record.requests_running, record.requests_waiting, record.kv_cache_usage) == (0, 0, 0)
    assert record.prefix_caching_enabled is False
    # The documentation's excerpt stops before the TTFT histogram.
    assert record.missing == ("vllm:time_to_first_token_seconds",)


def test_v0_capture_without_the_hit_rate_gauge_says_it_is_missing():
    """KubeAI's vLLM ~0.5 mock predates the V0 gauge; two models' waiting requests add up."""
    record = normalise(sample("vllm-v0-0.5.x-kubeai-mock-metrics.prom"))
    assert record.hit_ratio is None and record.hit_ratio_source is None
    assert record.missing == ("vllm:gpu_prefix_cache_hit_rate",)
    assert (record.prompt_tokens, record.requests_running, record.requests_waiting) == (90, 3, 2 + 3)
    assert record.prefix_caching_enabled is False
    # 9 requests: 1 <= 0.04 s, 6 <= 0.06 s, 9 <= 0.08 s. The median (rank 4.5) is 3.5 of the 5 in
    # (0.04, 0.06]: 0.04 + 0.02 * 3.5 / 5; p90 (rank 8.1) is 2.1 of the 3 in (0.06, 0.08].
    assert record.ttft_p50_seconds == pytest.approx(0.054)
    assert record.ttft_p90_seconds == pytest.approx(0.06 + 0.02 * 2.1 / 3)


def test_v1_0_10_reads_new_and_deprecated_names_and_never_the_created_gauges():
    """vLLM 0.10.0 excerpt: new `queries_total` 32, deprecated `gpu_..._hits_total` 0 (its new name was
    cut off), and `vllm:gpu_prefix_cache_queries_created`, a timestamp of 1.75e9 that is not a count."""
    snapshot = sample("vllm-v1-0.10.0-production-stack-issue617-excerpt.prom")
    assert (snapshot.queries, snapshot.hits) == (32, 0)
    record = normalise(snapshot)
    assert (record.hit_ratio, record.hit_ratio_source, record.cached_tokens) == (0.0, "lookups", 0)
    assert record.kv_cache_usage == pytest.approx(9.75010481363281e-06)
    assert "vllm:prefix_cache_hits_total" not in record.missing  # found under its deprecated name
    assert "vllm:prompt_tokens_total" in record.missing


def test_sglang_without_token_counters_falls_back_to_the_batch_gauge_and_says_so():
    """SGLang docs (0.3.x): no `sglang:cached_tokens_total` yet, only the last batch's ratio."""
    record = normalise(sample("sglang-0.3.x-docs-production-metrics-excerpt.prom"))
    assert record.hit_ratio == pytest.approx(0.007507552643049313)
    assert record.hit_ratio_source == "sglang-batch-gauge-fallback"
    assert "sglang:cached_tokens_total" in record.missing
    assert (record.prompt_tokens, record.kv_cache_usage, record.prefix_caching_enabled) == (
        8128902,
        0.28,
        None,
    )
    # 11,008 requests, only 2,513 of them within the highest finite bucket (30 s): as in PromQL, a
    # quantile in the +Inf bucket is that bound.
    assert record.ttft_p50_seconds == 30.0


def test_vllm_rust_frontend_openmetrics_without_cache_config_info():
    """OpenMetrics only (`# TYPE vllm:prefix_cache_hits counter`, samples `..._total`, `# EOF`) and no
    vllm:cache_config_info: read as vLLM, its lookups the evidence that prefix caching is on."""
    text = (TESTDATA / "vllm-rust-frontend-openmetrics.prom").read_text()
    record = normalise(read(text))
    assert record.flavour == "vllm"
    assert (record.hit_ratio, record.hit_ratio_source, record.local_hit_ratio) == (0.64, "tokens", 0.64)
    assert (record.prefix_caching_enabled, record.missing) == (True, ())
    # Prompts without a single lookup: caching off. No prompts at all: unknown, not a guess.
    assert normalise(read(text.replace(" 1000\n", " 0\n", 1))).prefix_caching_enabled is False
    assert normalise(read(re.sub(r" \d+\n", " 0\n", text))).prefix_caching_enabled is None


# Synthetic expositions, unit by unit.


def test_windowed_hit_ratio_is_a_ratio_of_counter_increases():
    before, now = read(vllm_v1(100, 1000), 10.0), read(vllm_v1(460, 1400), 25.0)
    record = normalise(now, before)
    assert (record.window_seconds, record.hit_ratio, record.prompt_tokens) == (15.0, 360 / 400, 400)
    assert normalise(now).hit_ratio == 460 / 1400  # lifetime: since the engine started
    assert record.kv_cache_usage == pytest.approx(0.3)  # the mean of the engines' fractions, not the sum


def test_a_counter_that_went_down_was_reset_and_counts_from_zero():
    before, now = read(vllm_v1(900, 1000, 8, 10)), read(vllm_v1(30, 40, 1, 2))
    record = normalise(now, before)
    assert record.counter_reset
    assert (record.hit_ratio, record.prompt_tokens) == (30 / 40, 40)
    # The restarted histogram counts from zero too: 1 of 2 requests in (0.5, 1], 1 above.
    assert record.ttft_p50_seconds == 1.0


def test_zero_traffic_gives_no_ratio_and_no_quantiles_not_zero():
    before, now = read(vllm_v1(100, 1000, 3, 4), 0.0), read(vllm_v1(100, 1000, 3, 4), 5.0)
    record = normalise(now, before)
    assert (record.hit_ratio, record.hit_ratio_source) == (None, "tokens")
    assert (record.prompt_tokens, record.ttft_p50_seconds, record.counter_reset) == (0, None, False)
    assert normalise(read(vllm_v1(0, 0))).hit_ratio is None  # a fresh engine


def test_nan_samples_never_become_a_ratio():
    """NaN is a legal sample value; a ratio built on one is unknown."""
    assert normalise(read(vllm_v1("NaN", 1000))).hit_ratio is None
    v0 = "vllm:gpu_prefix_cache_hit_rate NaN\nvllm:num_requests_swapped 0\n"
    assert normalise(read(v0)).hit_ratio is None


@pytest.mark.parametrize("first, second", [("NaN", 500), (100, "NaN")], ids=["at-start", "at-end"])
def test_a_window_with_an_invalid_sample_at_either_end_is_unknown_not_the_lifetime(first, second):
    record = normalise(read(vllm_v1(second, 2000), 5.0), read(vllm_v1(first, 1000), 0.0))
    assert (record.hit_ratio, record.cached_tokens, record.prompt_tokens) == (None, None, 1000)
    assert record.invalid == {"vllm:prefix_cache_hits_total": "NaN"}


def test_histogram_buckets_match_le_numerically():
    """prometheus_client writes `le="1.0"`, the Rust exporters `le="1"`: one bucket either way."""
    text = vllm_v1(0, 0, 1, 1) + (
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="1",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 3\n'
    )
    assert read(text).ttft_buckets == ((0.5, 0), (1.0, 4), (math.inf, 4))


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, ((0.1, 2), (0.2, 4), (math.inf, 4)), 0.1),  # rank 2 = the first bucket's count
        (0.9, ((0.1, 2), (0.2, 4), (math.inf, 4)), 0.18),  # 1.6 of the 2 in (0.1, 0.2]
        (0.5, ((0.1, 0), (1.0, 4), (math.inf, 4)), 0.55),  # linear inside (0.1, 1.0]
        (0.5, ((1.0, 0), (math.inf, 5)), 1.0),  # in the +Inf bucket: the highest finite bound
        (0.5, ((1.0, 0), (math.inf, 0)), None),  # no observations
        (0.5, ((math.inf, 3),), None),  # no finite bucket to interpolate in
        (0.5, None, None),
    ],
)
def test_histogram_quantile_follows_promql(q, buckets, expected):
    assert histogram_quantile(q, buckets) == pytest.approx(expected)


def test_sglang_sums_streaming_modes_and_cache_sources_but_counts_a_tp_group_once():
    """SGLang 0.5.20+ labels: `is_streaming`, `cache_source`, and scheduler ranks. With
    --enable-metrics-for-all-schedulers both TP ranks of a DP rank report the same batch."""
    text = """\
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="m"} 300
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 100
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="m"} 160
sglang:cached_tokens_total{cache_source="host",engine_type="unified",model_name="m"} 80
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 3
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="1"} 3
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="2"} 2
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="3"} 2
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 0.9
"""
    record = normalise(read(text))
    assert (record.prompt_tokens, record.cached_tokens) == (400, 240)
    assert (record.hit_ratio, record.hit_ratio_source) == (240 / 400, "tokens")  # never the gauge
    assert record.requests_running == 3 + 2
    assert record.prefix_caching_enabled is None  # SGLang exports no cache_config_info
