"""The source article's A/B experiment, reproduced in the lab through real nginx with `kvwatch experiment`.

Twenty sessions of six rounds with a growing history go through each listener, the same conversations
interleaved: group A round robin, group B affinity. Round robin's TTFT grows with the history; affinity's
stays near round 1's from round 2 on, and the replicas' own records show the cache reuse. Its report and
plot land in test-artifacts/lab-experiment/ (the README shows one such run's, from docs/).
"""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import REPO, http_get, http_post
from kvwatch.collectors.experiment import (
    Experiment,
    Workload,
    round_rows,
    route_rows,
    run_experiment,
    write_outputs,
)
from kvwatch.collectors.probe import ProbeSettings

pytestmark = pytest.mark.integration

# One session at a time: round robin then visits a new replica every round, as random balancing over
# many replicas would, and no queueing blurs the prefill times being compared.
REPLICAS, CONCURRENCY, TIME_SCALE = 8, 1, 0.5
WORKLOAD = Workload(sessions=20, rounds=6, system_tokens=1000, turn_tokens=300, seed=7)
ARTIFACTS = REPO / "test-artifacts" / "lab-experiment"


def replica_hit_ratios(replica_urls: list[str], experiment: Experiment) -> dict[str, tuple[int, int, float]]:
    """Per route: cached and prompt tokens and their ratio, from the replicas' own per-request records.

    The routes ran interleaved, so the replicas' counters hold both; each record names the session id
    the replica saw, and each session id belongs to one route.
    """
    route_of = {s.session_id: s.target for s in experiment.all_sessions}
    cached, prompt = Counter(), Counter()
    for url in replica_urls:
        for record in http_get(f"{url}/lab/ground-truth", timeout=5).json()["records"]:
            if route := route_of.get(record["session_id"]):
                cached[route] += record["cached_tokens"]
                prompt[route] += record["prompt_tokens"]
    return {route: (cached[route], prompt[route], cached[route] / prompt[route]) for route in prompt}


def test_affinity_keeps_warm_rounds_fast_and_round_robin_does_not(start_lab):
    lab = start_lab(
        "--replicas", str(REPLICAS), "--users", "0", "--no-probes", "--time-scale", str(TIME_SCALE)
    )
    replicas = [r["url"] for r in lab.status["replicas"]]
    for replica in replicas:
        http_post(f"{replica}/lab/reset-cache", timeout=5).raise_for_status()
    rr, affinity = (
        ProbeSettings(url, "lab-model", target=label, route_mode=label, session_mode="server", max_tokens=8)
        for url, label in ((lab.round_robin, "round_robin"), (lab.affinity, "affinity"))
    )
    experiment = run_experiment(rr, affinity, WORKLOAD.conversations(), CONCURRENCY)
    about = [
        WORKLOAD.describe(),
        f"The lab: {REPLICAS} replicas behind nginx, replica time scale {TIME_SCALE} "
        "(`tests/test_lab_experiment.py`).",
    ]
    write_outputs(experiment, ARTIFACTS, about)

    assert all(s.ok and len(s.rounds) == WORKLOAD.rounds for s in experiment.all_sessions), [
        s.error_kind for s in experiment.all_sessions if not s.ok
    ]
    medians = {label: [] for label in experiment.labels}
    for row in round_rows(experiment):
        medians[row["route"]].append(row["ttft_median_seconds"])
    rr_ttft, aff_ttft = medians["round_robin"], medians["affinity"]
    # Round robin: every round recomputes the history the previous replica held, so TTFT climbs.
    assert all(later > earlier for earlier, later in zip(rr_ttft, rr_ttft[1:], strict=False)), rr_ttft
    # Affinity: warm rounds beat round robin from round 2 and stay flat while round robin climbs (each
    # TTFT also holds the client's and nginx's fixed cost, which grows with the machine's load, so the
    # climb is compared, not a ratio of TTFTs).
    assert all(a < r for a, r in zip(aff_ttft[1:], rr_ttft[1:], strict=True)), (aff_ttft, rr_ttft)
    assert max(aff_ttft[1:]) - min(aff_ttft[1:]) < 0.25 * (rr_ttft[-1] - rr_ttft[1]), (aff_ttft, rr_ttft)
    # The replicas' records agree with what the probe was told, token for token, and show the reuse.
    truth = replica_hit_ratios(replicas, experiment)
    for label, sessions in zip(experiment.labels, experiment.sessions, strict=True):
        told = [(r.cached_tokens, r.prompt_tokens) for s in sessions for r in s.rounds]
        assert truth[label][:2] == tuple(map(sum, zip(*told, strict=True))), label
    assert truth["affinity"][2] >= 0.7, truth
    assert truth["affinity"][2] >= truth["round_robin"][2] + 0.2, truth
    sticky = {row["route"]: row["sticky_share"] for row in route_rows(experiment)}
    assert sticky["affinity"] == 1.0 and sticky["round_robin"] < 0.2, sticky
    # The README shows such a run's report and plot, copied from test-artifacts/ into docs/ by hand:
    # a test never rewrites tracked files.
