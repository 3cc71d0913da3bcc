"""Router flavours normalised, on synthetic and hand-written expositions; unknown or mixed ones refused."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from engine_expositions import ROUTERS, read, vllm_v1

from kvwatch.collectors.engines import Exposition, Snapshot, UnknownFlavour, detect_flavour, normalise


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
