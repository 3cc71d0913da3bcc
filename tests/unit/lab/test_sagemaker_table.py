"""The SageMaker front's session table: idle TTL, size limit, invalidations by reason, as llm-d counts."""

from __future__ import annotations

from kvwatch.collectors.engines import ENGINE_FLAVOURS, Exposition
from kvwatch.lab.gateways.sagemaker.index import STALL_INDEX, IndexHealth
from kvwatch.lab.gateways.sagemaker.table import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def read(table: SessionTable):
    exposition = Exposition(table.exposition())
    return ENGINE_FLAVOURS["llm-d-epp"].read(exposition, 0.0).session_table


def test_a_binding_used_within_its_ttl_lives_and_an_idle_one_is_dropped_and_refused_as_expired():
    clock = Clock()
    table = SessionTable(ttl_s=10, clock=clock)
    table.bind("a", "r1")
    table.bind("b", "r2")
    clock.now = 8
    assert table.instance_of("a") == "r1"  # used: its idle time starts again
    clock.now = 15
    assert table.pins() == {"a": "r1"} and table.idled == {"b"}
    assert table.instance_of("b") is None
    figures = read(table)
    assert (figures.bindings, figures.invalidations["idle"]) == (1, 1)


def test_a_binding_idles_from_the_end_of_its_last_answer_not_from_its_start():
    clock = Clock()
    table = SessionTable(ttl_s=10, clock=clock)
    table.bind("a", "r1")
    clock.now = 5
    assert table.instance_of("a") == "r1"  # a request starts
    clock.now = 12
    table.touch("a")  # and its answer ends
    table.touch("gone")  # a session not bound: nothing to refresh
    clock.now = 21
    assert table.pins() == {"a": "r1"}
    clock.now = 23
    assert table.pins() == {} and table.idled == {"a"}


def test_a_full_table_refuses_and_counts_each_refusal_and_a_close_or_pod_loss_frees_a_place():
    table = SessionTable(capacity=2, clock=Clock())
    table.bind("a", "r1")
    table.bind("b", "r2")
    assert not table.admits() and not table.admits()
    table.drop("a", "close")
    table.drop("b", "pod_delete")
    table.drop("b", "error")  # gone already: counted once
    assert table.admits()
    figures = read(table)
    assert figures.bind_rejections == 2
    assert figures.invalidations == {"idle": 0, "close": 1, "pod_delete": 1, "error": 0}


def test_the_fronts_index_lags_and_gaps_only_while_stalled_and_resyncs_at_the_heal():
    clock = Clock()
    index = IndexHealth(clock=clock)
    index.routed()
    index.follow(["ignore-session-ids"])
    assert index.gaps == 0 and index.stalled_since is None
    index.follow([STALL_INDEX])
    clock.now = 7
    index.routed()
    exposition = Exposition(index.exposition(["r1", "r2"]))
    health = ENGINE_FLAVOURS["sglang-router"].read(exposition, 0.0).index_health
    assert (health.lag_seconds, health.gaps, health.degraded_ranks, health.resyncs) == (7, 1, 2, 0)
    index.follow([])
    health = ENGINE_FLAVOURS["sglang-router"].read(Exposition(index.exposition(["r1"])), 0.0).index_health
    assert (health.lag_seconds, health.gaps, health.degraded_ranks, health.resyncs) == (0, 1, 0, 1)
