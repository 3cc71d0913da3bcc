"""Engine and router flavours, normalised: on real captures, live lab replicas and the real routers.

The figures must agree with what really happened: for lab replicas, with the replica's own ground
truth (every request's prompt and cached tokens and TTFT); for the real captures in
../shared/reference/samples, with the facts in ../shared/reference/metrics.md.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from conftest import REPO, SHARED, TESTDATA, Replica, free_port, http_get, stop
from kvwatch.collectors.engines import (
    Exposition,
    Snapshot,
    UnknownFlavour,
    detect_flavour,
    histogram_quantile,
    normalise,
)

SAMPLES = SHARED / "reference" / "samples"
TESTDATA = TESTDATA
ROUTERS = TESTDATA / "routers"
BLOCK = 16  # the lab's default prefix-cache block size
LAB_ARGS = ("--time-scale", "0.05", "--answer-tokens", "8")
SYSTEM_PROMPT = (
    "You are the kvwatch lab assistant. Answer briefly and precisely, keep the conversation's "
    "context in mind, and never invent facts you were not told earlier in this conversation."
)


def read(text: str, scraped_at: float = 0.0) -> Snapshot:
    exposition = Exposition(text)
    return detect_flavour(exposition).read(exposition, scraped_at)


def sample(name: str) -> Snapshot:
    path = SAMPLES / name
    if not path.exists():
        pytest.skip(f"real capture {path} is not there (it lives in the shared reference, not the repo)")
    return read(path.read_text())


def scrape_live(metrics_url: str) -> Snapshot:
    return read(http_get(metrics_url, timeout=5).text, time.monotonic())


def eventually(probe: Callable[[], object], timeout: float = 10.0) -> object:
    """Poll `probe` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while not (result := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{probe} did not come true within {timeout} s")
        time.sleep(0.05)
    return result


def converse(url: str, sessions: int, rounds: int, first_session: int = 0) -> int:
    """Multi-turn sessions: each round resends the session's questions so far plus a new one, so rounds
    share a growing prefix. Every other session streams. Returns the number of requests sent."""
    with httpx.Client(base_url=url, timeout=10) as client:
        for session in range(first_session, first_session + sessions):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            for round_number in range(1, rounds + 1):
                question = f"In session {session}, question {round_number}: what did we cover so far?"
                messages.append({"role": "user", "content": question})
                body = {"model": "lab-model", "messages": messages, "stream": session % 2 == 1}
                client.post("/v1/chat/completions", json=body).raise_for_status()
    return sessions * rounds


def records_since(replica: Replica, already: int, expected: int) -> list[dict]:
    """The ground-truth records after the first `already`, once `expected` of them exist.

    A streamed request's record lands just after its last chunk, so wait for it.
    """

    def arrived() -> list[dict] | None:
        records = replica.ground_truth()[already:]
        return records if len(records) >= expected else None

    return eventually(arrived)


def assert_quantiles_in_true_buckets(record, snapshot: Snapshot, ttfts: list[float]) -> None:
    """Each TTFT quantile lies in the bucket that holds the true quantile of the requests.

    Inside a bucket the histogram only knows counts, so interpolation can place it anywhere there.
    """
    bounds = [bound for bound, _ in snapshot.ttft_buckets]
    ordered = sorted(ttfts)
    quantiles = {0.5: record.ttft_p50_seconds, 0.9: record.ttft_p90_seconds, 0.99: record.ttft_p99_seconds}
    for q, estimate in quantiles.items():
        truth = ordered[math.ceil(q * len(ordered)) - 1]
        assert bisect_left(bounds, estimate) == bisect_left(bounds, truth), (q, estimate, truth)


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


def sgl_router_0_2(per_worker: dict[str, int], hits: int, misses: int) -> str:
    """sglang-router <= 0.2.x (`sgl_router_*`, sgl-router/src/metrics.rs; names in metrics.md §3a)."""
    lines = [
        "# HELP sgl_router_processed_requests_total Total requests processed by each worker",
        "# TYPE sgl_router_processed_requests_total counter",
        *(f'sgl_router_processed_requests_total{{worker="{w}"}} {n}' for w, n in per_worker.items() if n),
        "# TYPE sgl_router_policy_decisions_total counter",
        *(
            f'sgl_router_policy_decisions_total{{policy="cache_aware",worker="{w}"}} {n}'
            for w, n in per_worker.items()
            if n
        ),
        "# TYPE sgl_router_cache_hits_total counter",
        f"sgl_router_cache_hits_total {hits}",
        "# TYPE sgl_router_cache_misses_total counter",
        f"sgl_router_cache_misses_total {misses}",
        "# TYPE sgl_router_worker_health gauge",
        *(f'sgl_router_worker_health{{worker="{w}"}} 1' for w in per_worker),
        "# TYPE sgl_router_running_requests gauge",
        *(f'sgl_router_running_requests{{worker="{w}"}} 1' for w in per_worker),
    ]
    return "\n".join(lines) + "\n"


def vllm_router_0_1_17(per_worker: dict[str, int], prefix_hits: int, prefix_misses: int) -> str:
    """vllm-router 0.1.17 (`vllm_router_*`, names in metrics.md §4b and gateways.md §3): no # HELP
    lines, a blank line after each family, series created by their first event."""
    decisions = "vllm_router_prefix_routing_decisions_total"
    families = [
        ["# TYPE vllm_router_processed_requests_total counter"]
        + [f'vllm_router_processed_requests_total{{worker="{w}"}} {n}' for w, n in per_worker.items() if n],
        [f"# TYPE {decisions} counter"]
        + [
            f'{decisions}{{policy="cache_aware",stage="regular",outcome="{outcome}"}} {n}'
            for outcome, n in (("prefix_hit", prefix_hits), ("prefix_miss", prefix_misses))
        ],
        ["# TYPE vllm_router_policy_decisions_total counter"]
        + [
            f'vllm_router_policy_decisions_total{{policy="cache_aware",worker="{w}"}} {n}'
            for w, n in per_worker.items()
            if n
        ],
        ["# TYPE vllm_router_worker_health gauge"]
        + [f'vllm_router_worker_health{{worker="{w}"}} 1' for w in per_worker],
        ["# TYPE vllm_router_active_workers gauge", f"vllm_router_active_workers {len(per_worker)}"],
    ]
    return "\n\n".join("\n".join(family) for family in families) + "\n"


WORKERS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")


def test_sglang_router_0_2_requests_per_worker_and_cache_predictions():
    before = read(sgl_router_0_2(dict(zip(WORKERS, (10, 5, 0), strict=True)), hits=6, misses=9), 0.0)
    now = read(sgl_router_0_2(dict(zip(WORKERS, (14, 5, 2), strict=True)), hits=10, misses=11), 10.0)
    assert now.flavour == "sglang-router"
    record = normalise(now, before)
    # The third worker's counter appeared within the window: it counts from zero.
    assert record.per_worker == {WORKERS[0]: 4, WORKERS[1]: 0, WORKERS[2]: 2}
    assert record.policy_decisions == {"cache_aware": 6}
    assert record.router_cache_predictions == {"hit": 4, "miss": 2}  # the router's guesses, not engine hits
    assert (record.requests_running, record.hit_ratio, record.missing) == (3, None, ())
    # Idle workers are known from the health gauge before any request reached them.
    assert normalise(read(sgl_router_0_2(dict.fromkeys(WORKERS, 0), 0, 0))).per_worker == dict.fromkeys(
        WORKERS, 0
    )


def test_vllm_router_without_help_lines_gives_requests_per_worker():
    before = read(vllm_router_0_1_17(dict(zip(WORKERS, (3, 0, 1), strict=True)), 2, 2), 0.0)
    now = read(vllm_router_0_1_17(dict(zip(WORKERS, (9, 0, 1), strict=True)), 7, 3), 3.0)
    assert now.flavour == "vllm-router"
    record = normalise(now, before)
    assert record.per_worker == {WORKERS[0]: 6, WORKERS[1]: 0, WORKERS[2]: 0}
    assert record.policy_decisions == {"cache_aware": 6}
    assert record.router_cache_predictions == {"prefix_hit": 5, "prefix_miss": 1}


def test_a_router_worker_series_recreated_lower_counts_from_zero_alone():
    """Rust routers drop series idle for 5 min; back, the series restarts while the others go on."""
    before = read(vllm_router_0_1_17(dict(zip(WORKERS, (50, 40, 30), strict=True)), 0, 0))
    now = read(vllm_router_0_1_17(dict(zip(WORKERS, (55, 40, 2), strict=True)), 0, 0))
    assert normalise(now, before).per_worker == {WORKERS[0]: 5, WORKERS[1]: 0, WORKERS[2]: 2}


@pytest.mark.parametrize(
    "text, invalid, figure",
    [
        (
            sgl_router_0_2({WORKERS[0]: "NaN", WORKERS[1]: 5}, 0, 0),
            "sgl_router_processed_requests_total",
            "per_worker",  # not the health gauge's 0 for every worker
        ),
        (
            vllm_router_0_1_17({WORKERS[0]: 3}, -1, 0),
            "vllm_router_prefix_routing_decisions_total",
            "router_cache_predictions",
        ),
    ],
    ids=["sglang-router", "vllm-router"],
)
def test_a_router_counter_with_an_invalid_sample_counts_nothing_and_is_named(text, invalid, figure):
    record = normalise(read(text))
    assert invalid in record.invalid and invalid not in record.missing
    assert getattr(record, figure) == {}


# Routers' own metrics, from hand-written expositions.


def router(name: str, keep: Callable[[str], bool] = lambda line: True) -> Snapshot:
    lines = (ROUTERS / name).read_text().splitlines(keepends=True)
    return read("".join(filter(keep, lines)))


def test_smg_counts_its_sticky_outcomes_and_where_routing_keys_came_from():
    record = normalise(router("smg-1.13.prom"))
    # The third worker has served nothing yet: the health gauge names it.
    assert record.per_worker == dict(zip(WORKERS, (5, 4, 0), strict=True))
    assert record.sticky_outcomes == {"occupied_hit": 6, "occupied_miss": 1, "vacant": 2}
    assert record.routing_key_sources == {"header": 8, "rid": 1}
    assert (record.policy_decisions, record.requests_running) == ({"manual": 9}, 1)
    assert (record.predicted_hit_ratio, record.hit_ratio, record.missing) == (None, None, ())


def test_smg_cache_aware_counts_its_tree_matches_and_predicts_their_share():
    """Captured from the real SMG: three conversations, each sent where the radix tree matched it once
    the tree held its first round."""
    record = normalise(router("smg-1.13-cache-aware.prom"))
    assert record.flavour == "sglang-router"
    assert record.router_cache_predictions == {"tree_match": 15, "expected_wait_fallback": 3}
    assert record.predicted_hit_ratio == pytest.approx(15.012345679012352 / 18)
    assert record.policy_decisions == {"cache_aware": 18} and record.sticky_outcomes == {}
    assert sum(record.per_worker.values()) == 18 and len(record.per_worker) == 3


@pytest.mark.parametrize(
    "keep",
    [lambda line: True, lambda line: "llm_d_epp_" not in line],
    ids=["canonical-names", "deprecated-names-only"],
)
def test_llm_d_epp_predicted_and_delivered_ratios_and_requests_per_endpoint(keep):
    """The prediction is the mean of the indexer's per-lookup ratios (8 over 10 lookups); the delivered
    ratio is the engines' cached over input tokens of its requests (7,000 of 10,000)."""
    record = normalise(router("llm-d-epp-0.10.prom", keep))
    assert record.flavour == "llm-d-epp"
    assert record.predicted_hit_ratio == pytest.approx(0.8)
    assert (record.hit_ratio, record.prompt_tokens, record.cached_tokens) == (0.7, 10000, 7000)
    assert record.per_worker == {"vllm-0": 6, "vllm-1": 3, "vllm-2": 1}  # failures name no endpoint
    assert (record.missing, record.invalid) == ((), {})


def test_dynamo_frontend_delivered_ratio_ttft_and_the_kv_routers_prediction():
    record = normalise(router("dynamo-frontend.prom"))
    assert (record.hit_ratio, record.prompt_tokens, record.cached_tokens) == (0.6, 20000, 12000)
    assert record.predicted_hit_ratio == 0.75
    # 8 requests: 3 within 0.1 s, 6 within 0.5 s; the median (rank 4) is 1 of the 3 in (0.1, 0.5].
    assert record.ttft_p50_seconds == pytest.approx(0.1 + 0.4 / 3)
    assert (record.requests_running, record.per_worker) == (2, {})  # only workers count their requests


def test_llm_d_epp_token_weighted_reuse_legs():
    """Of 10,000 prompt tokens the best candidate held 8,000 and the chosen endpoint 6,000; the engines
    reused 4,000 of the 10,000 its requests carried. A window sees only what changed in it."""
    record = normalise(router("llm-d-epp-prefix-tokens.prom"))
    assert record.flavour == "llm-d-epp"
    shares = (record.available_share, record.routed_share, record.delivered_share)
    assert shares == (0.8, 0.6, 0.4)
    text = (ROUTERS / "llm-d-epp-prefix-tokens.prom").read_text()
    tripled = re.sub(
        r"^(\S+_(?:sum|count|total)\S*) (\S+)$", lambda m: f"{m[1]} {float(m[2]) * 3}", text, flags=re.M
    )
    before, later = read(text), read(tripled, scraped_at=1)
    windowed = normalise(later, before)
    assert (windowed.available_share, windowed.routed_share, windowed.delivered_share) == (0.8, 0.6, 0.4)


def test_dynamo_kv_router_reuse_funnel():
    """F0 20,000 prompt tokens, F2 16,000 on the best eligible worker, F3 12,000 on the selected one, F4
    4,000 reused by the workers; the mean-of-ratio prediction stays beside it."""
    record = normalise(router("dynamo-router-funnel.prom"))
    assert (record.available_share, record.routed_share, record.delivered_share) == (0.8, 0.6, 0.2)
    assert record.predicted_hit_ratio == 0.75


def test_a_real_dynamo_1_6_1_frontend_with_its_kv_router():
    """A capture of Dynamo 1.6.1's frontend (KV router, two mock engines): the answers' usage summed to
    12,378 prompt tokens, 9,088 cached (the ground truth in the file's header). Its router exports F4 at
    zero for engines that report no reuse to it: the delivered share is the frontend's, not 0."""
    record = normalise(router("dynamo-1.6.1-frontend-kv-mocker.prom"))
    assert (record.flavour, record.missing, record.invalid) == ("dynamo", (), {})
    assert (record.prompt_tokens, record.cached_tokens) == (12378, 9088)
    assert record.hit_ratio == pytest.approx(9088 / 12378)
    assert record.predicted_hit_ratio == pytest.approx(22.305109922756984 / 32)
    shares = (record.available_share, record.routed_share, record.delivered_share)
    assert shares == pytest.approx((9088 / 12378,) * 3)
    assert (record.requests_running, record.per_worker, record.session_table) == (0, {}, None)


def test_a_dynamo_worker_reuse_counter_that_grew_is_the_delivered_leg():
    """Once a backend reports reuse to the router, F4 is the delivered leg, whatever the frontend saw."""
    text = (ROUTERS / "dynamo-1.6.1-frontend-kv-mocker.prom").read_text()
    reported = re.sub(
        r"^(dynamo_component_router_kv_worker_reused_tokens_total\S*) 0$", r"\1 6189", text, flags=re.M
    )
    assert normalise(read(reported)).delivered_share == 0.5


def test_routers_without_the_legs_have_no_decomposition():
    for name in ("llm-d-epp-0.10.prom", "dynamo-frontend.prom", "smg-1.13-cache-aware.prom"):
        record = normalise(router(name))
        assert (record.available_share, record.routed_share, record.delivered_share) == (None,) * 3, name


def test_a_dynamo_worker_is_its_engine_not_the_router():
    """Workers export `dynamo_component_*` beside the engine's names; only the frontend and the KV router
    export `dynamo_frontend_*` / `dynamo_component_router_*`."""
    worker = vllm_v1(10, 20) + "dynamo_component_requests_total 4\ndynamo_component_uptime_seconds 9\n"
    assert read(worker).flavour == "vllm"


def test_aibrix_decisions_by_the_share_of_the_prompt_its_index_matched():
    record = normalise(router("aibrix-gateway-0.7.prom"))
    assert record.router_cache_predictions == {"0": 3, "51-75": 2, "76-100": 5}
    assert record.policy_decisions == {"prefix_match": 7, "least_request": 3}
    assert (record.per_worker, record.predicted_hit_ratio) == ({}, None)


def test_detection_refuses_unknown_and_ambiguous_expositions():
    with pytest.raises(UnknownFlavour, match="no series of a known engine or router"):
        detect_flavour(Exposition("# TYPE node_load1 gauge\nnode_load1 0.5\n"))
    # One telltale series of vLLM V1 and one of V0: as much one as the other.
    with pytest.raises(UnknownFlavour, match="name the flavour explicitly"):
        detect_flavour(Exposition("vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_swapped 0\n"))


def test_windowing_snapshots_of_different_flavours_is_refused():
    with pytest.raises(ValueError, match="cannot window"):
        normalise(read(vllm_v1(1, 2)), read(sgl_router_0_2({WORKERS[0]: 1}, 0, 0)))


# Live lab replicas: the figures against the replica's ground truth.


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_windowed_hit_ratio_equals_the_replicas_ground_truth(start_replica, flavour):
    """Token counters give the exact ratio of cached to prompt tokens of the requests in the window."""
    replica = start_replica("r1", flavour, *LAB_ARGS)
    already = converse(replica.url, sessions=1, rounds=2)  # history from before the window
    records_since(replica, 0, already)
    before = scrape_live(f"{replica.url}/metrics")
    assert before.flavour == flavour
    records = records_since(replica, already, converse(replica.url, sessions=3, rounds=3, first_session=1))
    now = scrape_live(f"{replica.url}/metrics")
    record = normalise(now, before)

    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    assert 0 < cached < prompt
    assert (record.hit_ratio, record.hit_ratio_source) == (cached / prompt, "tokens")
    assert (record.prompt_tokens, record.cached_tokens) == (prompt, cached)
    assert_quantiles_in_true_buckets(record, now, [r["ttft_seconds"] for r in records])
    assert (record.requests_running, record.requests_waiting, record.missing) == (0, 0, ())
    assert record.prefix_caching_enabled is {"vllm": True, "sglang": None}[flavour]


@pytest.mark.integration
def test_v0_gauge_is_a_block_ratio_close_below_the_token_ratio(start_replica):
    """V0 counts blocks: hits are whole blocks (as cached tokens are), but every request's partial
    last block is a lookup. So the gauge equals the block ratio of the ground truth and sits below
    the token ratio by at most one block per request. It is the engine's lifetime ratio; the replica
    is fresh, so here lifetime and window are the same requests."""
    replica = start_replica("r1", "vllm-legacy", *LAB_ARGS)
    before = scrape_live(f"{replica.url}/metrics")
    assert normalise(before).hit_ratio is None  # -1 until the first request: unknown, not 0
    records = records_since(replica, 0, converse(replica.url, sessions=3, rounds=3))
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)

    hit_blocks = sum(r["cached_tokens"] // BLOCK for r in records)
    lookup_blocks = sum(math.ceil(r["prompt_tokens"] / BLOCK) for r in records)
    assert record.hit_ratio_source == "v0-gauge"
    assert record.hit_ratio == pytest.approx(hit_blocks / lookup_blocks)
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    assert cached / prompt * prompt / (prompt + BLOCK * len(records)) <= record.hit_ratio <= cached / prompt
    assert record.prompt_tokens == prompt and record.prefix_caching_enabled is True


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_a_window_without_traffic_has_no_hit_ratio(start_replica, flavour):
    replica = start_replica("r1", flavour, *LAB_ARGS)
    records_since(replica, 0, converse(replica.url, sessions=1, rounds=2))
    before = scrape_live(f"{replica.url}/metrics")
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)
    assert (record.hit_ratio, record.prompt_tokens, record.ttft_p50_seconds) == (None, 0, None)
    assert normalise(before).hit_ratio > 0  # the lifetime figure still has the earlier requests


@pytest.mark.integration
@pytest.mark.parametrize(("flavour", "hit_ratio"), [("vllm", 0.0), ("vllm-legacy", None)])
def test_prefix_caching_switched_off_is_reported(start_replica, flavour, hit_ratio):
    """V1 counts the prompt tokens it computed, none cached: 0 %, though it looks nothing up. V0 only
    has its own gauge, which has no data without lookups: unknown, not 0 %."""
    replica = start_replica("r1", flavour, *LAB_ARGS)
    replica.set_faults(prefix_caching=False).raise_for_status()
    before = scrape_live(f"{replica.url}/metrics")
    records_since(replica, 0, converse(replica.url, sessions=1, rounds=2))
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)
    assert record.prefix_caching_enabled is False
    assert record.hit_ratio == hit_ratio and record.prompt_tokens > 0
    assert record.local_hit_ratio is None


@pytest.mark.integration
def test_a_restarted_replica_counts_from_zero(start_replica):
    """A restart puts a new process with fresh counters behind the same URL: here the second scrape
    reads another, fresh replica, and the window holds exactly that replica's requests."""
    old, new = start_replica("r1", "vllm", *LAB_ARGS), start_replica("r2", "vllm", *LAB_ARGS)
    records_since(old, 0, converse(old.url, sessions=3, rounds=3))
    records = records_since(new, 0, converse(new.url, sessions=1, rounds=2))
    record = normalise(scrape_live(f"{new.url}/metrics"), scrape_live(f"{old.url}/metrics"))
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    assert record.counter_reset
    assert (record.hit_ratio, record.prompt_tokens, record.cached_tokens) == (cached / prompt, prompt, cached)


# The real routers in front of lab replicas.

ROUTER_PROGRAMS = {
    "sglang-router": [sys.executable, "-m", "sglang_router.launch_router"],
    "vllm-router": [str(Path(sys.executable).with_name("vllm-router"))],
}


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[Callable[[str, list[Replica]], tuple[str, str]]]:
    """Start a real router (round robin) in front of `replicas`; returns its URL and metrics URL."""
    started: list[subprocess.Popen] = []

    def start(flavour: str, replicas: list[Replica]) -> tuple[str, str]:
        if not Path(ROUTER_PROGRAMS[flavour][0]).exists():
            pytest.fail(f"{flavour} is not installed (`make test` installs it with the dev dependencies)")
        port, metrics_port = free_port(), free_port()
        command = [
            *ROUTER_PROGRAMS[flavour],
            *("--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
            *("--worker-urls", *(replica.url for replica in replicas)),
        ]
        # A router must never reach out for a tokenizer: point Hugging Face at a dead loopback port.
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
        log = tmp_path / f"{flavour}.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        started.append(process)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{flavour} exited with {process.returncode}:\n{log.read_text()}")
            try:
                state = http_get(f"{url}/readiness", timeout=1).json()
            except (httpx.HTTPError, ValueError):
                return False
            return state.get("healthy_workers") == len(replicas)

        eventually(ready, timeout=30)
        return url, f"http://127.0.0.1:{metrics_port}/metrics"

    yield start
    for process in started:
        stop(process)


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["sglang-router", "vllm-router"])
def test_router_requests_per_worker_match_the_replicas_ground_truth(start_replica, start_router, flavour):
    """sglang-router 0.3.2 (`smg_*`: per worker from the circuit breaker's outcomes) and vllm-router
    0.1.17 (`vllm_router_processed_requests_total`) against what each replica really received."""
    replicas = [start_replica(f"r{n}", "vllm", *LAB_ARGS) for n in (1, 2, 3)]
    url, metrics_url = start_router(flavour, replicas)
    before = scrape_live(metrics_url)
    assert before.flavour == flavour
    assert normalise(before).per_worker == {replica.url: 0 for replica in replicas}

    requests = converse(url, sessions=7, rounds=1)
    eventually(lambda: sum(len(replica.ground_truth()) for replica in replicas) == requests)
    received = {replica.url: len(replica.ground_truth()) for replica in replicas}
    record = normalise(scrape_live(metrics_url), before)
    assert record.per_worker == received
    assert sorted(received.values()) == [2, 2, 3]  # round robin: 7 requests over 3 workers
    assert record.policy_decisions == {"round_robin": requests}


def test_llm_d_epp_session_table_bindings_invalidations_by_reason_and_rejections():
    record = normalise(router("llm-d-epp-0.10-sessions.prom"))
    assert record.flavour == "llm-d-epp"
    table = record.session_table
    assert (table.bindings, table.bind_rejections) == (40, 3)
    assert table.invalidations == {"idle": 12, "close": 6, "pod_delete": 5, "error": 2}


def test_a_windowed_session_table_keeps_bindings_and_counts_increases():
    before = router("llm-d-epp-0.10-sessions.prom")
    later = (ROUTERS / "llm-d-epp-0.10-sessions.prom").read_text()
    later = later.replace('{reason="error"} 2', '{reason="error"} 9').replace("bindings 40", "bindings 31")
    table = normalise(read(later, scraped_at=30.0), before).session_table
    assert (table.bindings, table.bind_rejections) == (31, 0)
    assert table.invalidations == {"idle": 0, "close": 0, "pod_delete": 0, "error": 7}


def test_routers_without_a_session_table_or_an_index_report_none():
    for name in ("llm-d-epp-0.10.prom", "smg-1.13.prom", "dynamo-frontend.prom"):
        record = normalise(router(name))
        assert (record.session_table, record.index_health) == (None, None), name


def test_smg_kv_event_index_health_is_its_worst_lag_with_gaps_resyncs_and_degraded_ranks():
    record = normalise(router("smg-1.13-kv-events.prom"))
    health = record.index_health
    assert record.flavour == "sglang-router"
    assert (health.lag_seconds, health.gaps, health.resyncs, health.degraded_ranks) == (2.5, 3, 1, 1)


def test_a_windowed_index_keeps_its_lag_and_degraded_ranks_and_counts_gaps_and_resyncs():
    before = router("smg-1.13-kv-events.prom")
    later = (ROUTERS / "smg-1.13-kv-events.prom").read_text()
    later = later.replace('outcome="recovered"} 2', 'outcome="recovered"} 7')
    health = normalise(read(later, scraped_at=30.0), before).index_health
    assert (health.lag_seconds, health.gaps, health.resyncs, health.degraded_ranks) == (2.5, 5, 0, 1)
