"""The demo `make up` starts: in the default lab, round robin's warm rounds pay the prefill and affinity's
do not, from kvwatch's first probe runs on, as the Overview and the Per-round page show them."""

from __future__ import annotations

import math
import statistics
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.cli.lab import DEFAULT_REPLICAS
from kvwatch.config.settings import load_config
from kvwatch.store.history import Store
from paths import REPO
from processes import http_get

WAIT_S = 30.0
SESSIONS_PER_TARGET = 4  # two probe runs of each target


def test_the_default_replica_count_keeps_round_robin_off_a_sessions_history():
    """Strict round robin brings a probe session back to a replica after R / gcd(R, sessions a run)
    rounds: only the last round may find its own first round there."""
    for target in load_config(REPO / "examples" / "kvwatch.lab.yaml").targets:
        replicas = DEFAULT_REPLICAS["sim"]
        assert replicas // math.gcd(replicas, target.sessions_per_run) >= target.rounds - 1, target.name


def finished_sessions(lab) -> dict[str, list[dict]]:
    """Each probe target's complete sessions in the lab's store, once each has SESSIONS_PER_TARGET."""
    deadline = time.monotonic() + WAIT_S
    while True:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            done = [s for s in store.sessions() if s["ok"] and not s["in_flight"]]
        by_target = {t: [s for s in done if s["target"] == t] for t in ("lab-affinity", "lab-round-robin")}
        if all(len(sessions) >= SESSIONS_PER_TARGET for sessions in by_target.values()):
            return by_target
        assert time.monotonic() < deadline, {t: len(s) for t, s in by_target.items()}
        time.sleep(1)


def ground_truth_by_session(lab) -> dict[str, list[dict]]:
    """Every replica's per-request records, per session id, in the order the replicas served them."""
    records: dict[str, list[dict]] = {}
    for replica in lab.status["replicas"]:
        for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=5).json()["records"]:
            records.setdefault(record["session_id"], []).append(record)
    return {session: sorted(rounds, key=lambda r: r["time"]) for session, rounds in records.items()}


def warm_rounds(sessions: list[dict], truth: dict[str, list[dict]]) -> tuple[float, float]:
    """The replicas' own account of rounds 2+: their share of cached prompt tokens, and their median TTFT
    over round 1's."""
    served = [truth[s["session_id"]] for s in sessions]
    warm = [record for rounds in served for record in rounds[1:]]
    cached = sum(r["cached_tokens"] for r in warm) / sum(r["prompt_tokens"] for r in warm)
    cold_ttft = statistics.median(rounds[0]["ttft_seconds"] for rounds in served)
    return cached, statistics.median(r["ttft_seconds"] for r in warm) / cold_ttft


def exported_warm_cold_ratios(lab) -> dict[str, float]:
    """The Overview's warm / cold TTFT per probe target, as kvwatch serve exports it."""
    text = http_get(f"{lab.status['exporter']}/metrics", timeout=5).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "kvwatch_probe_warm_cold_ttft_ratio"
    ]
    return {sample.labels["target"]: sample.value for sample in family.samples}


@pytest.mark.integration
def test_the_default_lab_shows_round_robin_cold_and_affinity_warm(start_lab):
    lab = start_lab()  # `make up`'s defaults, with the fixture's --fast and --no-dashboard
    sessions = finished_sessions(lab)
    truth = ground_truth_by_session(lab)
    rr_cached, rr_ratio = warm_rounds(sessions["lab-round-robin"], truth)
    affinity_cached, affinity_ratio = warm_rounds(sessions["lab-affinity"], truth)
    # Round robin's warm rounds still find the shared system prompt, and now and then a session's own
    # first round (see above): a share of affinity's at most, and no faster than round 1.
    assert affinity_cached > 0.8 and affinity_ratio < 0.5, (affinity_cached, affinity_ratio)
    assert rr_cached < affinity_cached / 2 and rr_ratio > 0.8, (rr_cached, rr_ratio)
    exported = exported_warm_cold_ratios(lab)
    assert exported["lab-round-robin"] > 0.8 and exported["lab-affinity"] < 0.5, exported
