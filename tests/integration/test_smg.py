"""The probe through the real SMG (PyPI `smg`, the SGLang router since 1.x) in front of lab replicas.

The replicas name no replica themselves (`--no-identity-header`, as real engines), so every backend
the probe reports comes from SMG's own `x-smg-routed-worker-id`: the worker's URL.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from conftest import Replica
from kvwatch.collectors.engines import Exposition, detect_flavour
from processes import http_get, kvwatch

pytestmark = pytest.mark.integration

REPLICA_ARGS = ("--time-scale", "0.05", "--no-identity-header")
PROBE = ("--model", "lab-model", "--rounds", "4", "--sessions", "4", "--system-tokens", "300",
         "--turn-tokens", "20", "--max-tokens", "8", "--block-size", "16", "--json")  # fmt: skip


@pytest.fixture
def replicas(start_replica: Callable[..., Replica]) -> list[Replica]:
    return [start_replica(f"r{n}", "vllm", *REPLICA_ARGS) for n in (1, 2, 3)]


def probe(url: str, *flags: str, seed: int) -> list[dict]:
    result = kvwatch("probe", "--base-url", url, *PROBE, "--seed", str(seed), *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["sessions"]


@pytest.mark.parametrize(
    "smg_flags, probe_flags",
    [
        pytest.param((), ("--session-header", "x-smg-routing-key"), id="default-key-header"),
        # The key header is configurable: SMG then routes on the session id clients already send.
        pytest.param(("--routing-key-headers", "x-session-id"), (), id="x-session-id"),
    ],
)
def test_manual_policy_keeps_every_session_on_the_worker_smg_names(
    start_smg, replicas, smg_flags, probe_flags
):
    router = start_smg("manual", replicas, *smg_flags)
    sessions = probe(router.url, *probe_flags, seed=1)

    workers = {replica.url for replica in replicas}
    for session in sessions:
        assert session["ok"] and session["sticky"] is True, session
        rounds = session["rounds"]
        assert len(rounds) == 4 and {r["backend"] for r in rounds} <= workers, rounds
        assert len(set(session["backends"])) == 1 and len(session["backends"]) == 4
        assert all(r["cached_tokens"] >= r["ideal_cached_tokens"] for r in rounds), rounds


def test_round_robin_moves_sessions_between_the_workers_smg_names(start_smg, replicas):
    router = start_smg("round_robin", replicas)
    sessions = probe(router.url, "--session-header", "x-smg-routing-key", seed=2)

    workers = {replica.url for replica in replicas}
    for session in sessions:
        assert session["ok"] and session["sticky"] is False, session
        assert set(session["backends"]) <= workers and len(session["backends"]) == 4
    assert {backend for s in sessions for backend in s["backends"]} == workers


def test_the_real_smg_in_front_of_http_workers_exports_no_kv_event_index(start_smg, replicas):
    """SMG 1.13 exports `smg_kv_event_*` only once it subscribes to its workers' KV events (gRPC workers):
    in front of HTTP workers, after cache-aware traffic, its exposition has none of them, and kvwatch
    reads no index health from it rather than a lag of 0. (The series themselves: a hand-written
    exposition, tests/testdata/routers/smg-1.13-kv-events.prom.)"""
    router = start_smg("cache_aware", replicas)
    probe(router.url, seed=3)
    text = http_get(router.metrics_url, timeout=10).text
    exposition = Exposition(text)
    assert exposition.count_prefixed("smg_") > 0 and exposition.count_prefixed("smg_kv_event_") == 0
    snapshot = detect_flavour(exposition).read(exposition, 0.0)
    assert (snapshot.flavour, snapshot.index_health, snapshot.session_table) == ("sglang-router", None, None)
