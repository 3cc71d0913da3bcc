"""The source article's A/B experiment, reproduced in the lab through real nginx with `kvwatch experiment`.

Twenty sessions of six rounds with a growing history go through each listener, the same conversations
interleaved: group A round robin, group B affinity. Round robin's TTFT grows with the history; affinity's
stays near round 1's from round 2 on, and the replicas' own records show the cache reuse. Its report and
plot land in test-artifacts/lab-experiment/ (the README shows one such run's, from docs/). The same lab
then runs `kvwatch experiment` under load: several sessions in flight per route.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd
import pytest

from conftest import REPO, http_get, http_post, kvwatch
from kvwatch.collectors.experiment import (
    FILES,
    Experiment,
    Load,
    Workload,
    round_rows,
    route_rows,
    run_experiment,
    write_outputs,
)
from kvwatch.collectors.probe import ProbeSettings

pytestmark = pytest.mark.integration

# One session at a time over both routes (the default load): round robin then visits a new replica
# every round, as random balancing over many replicas would, and no queueing blurs the prefill times
# being compared.
REPLICAS, TIME_SCALE = 8, 0.5
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


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab(
        "--replicas", str(REPLICAS), "--users", "0", "--no-probes", "--time-scale", str(TIME_SCALE)
    )


def test_affinity_keeps_warm_rounds_fast_and_round_robin_does_not(lab):
    replicas = [r["url"] for r in lab.status["replicas"]]
    for replica in replicas:
        http_post(f"{replica}/lab/reset-cache", timeout=5).raise_for_status()
    rr, affinity = (
        ProbeSettings(url, "lab-model", target=label, route_mode=label, session_mode="server", max_tokens=8)
        for url, label in ((lab.round_robin, "round_robin"), (lab.affinity, "affinity"))
    )
    experiment = run_experiment(rr, affinity, WORKLOAD.conversations())
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


def test_under_load_the_report_counts_every_request_and_its_throughput(lab, tmp_path):
    out, sessions, rounds = tmp_path / "load", 12, 3
    result = kvwatch(
        "experiment", "--a", lab.round_robin, "--b", lab.affinity, "--out", str(out), "--model", "lab-model",
        "--sessions", str(sessions), "--rounds", str(rounds), "--system-tokens", "300",
        "--turn-tokens", "100", "--concurrency", "4", "--request-rate", "20", "--seed", "11",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    raw, load = pd.read_csv(out / FILES["raw"]), pd.read_csv(out / FILES["load"]).set_index("route")
    replicas = pd.read_csv(out / FILES["replicas"])
    assert len(raw) == 2 * sessions * rounds and raw["error_kind"].isna().all()
    # Every request the route sent is one a replica served, named by the address nginx passed it to.
    addresses = {r["url"].removeprefix("http://") for r in lab.status["replicas"]}
    assert set(replicas["replica"]) <= addresses
    for route, sent in raw.groupby("route"):
        assert (
            replicas[replicas["route"] == route]["requests"].sum() == len(sent) == load.loc[route, "requests"]
        )
        # Throughput: answered requests over the span from the first request to the last answer's end.
        span = (sent["started_at"] + sent["total_seconds"]).max() - sent["started_at"].min()
        assert load.loc[route, "span_seconds"] == pytest.approx(span)
        assert load.loc[route, "requests_per_second"] == pytest.approx(len(sent) / span)
        assert load.loc[route, "ttft_p99_seconds"] == pytest.approx(sent["ttft_seconds"].quantile(0.99))
    # Both routes were handed the same arrival schedule, seeded.
    arrivals = raw.drop_duplicates(["route", "conversation"]).pivot(
        index="conversation", columns="route", values="arrival_seconds"
    )
    expected = Load(4, 20.0, seed=11).arrivals(sessions)
    assert list(arrivals["round_robin"]) == list(arrivals["affinity"]) == pytest.approx(expected)
    assert "| replica | round_robin | affinity |" in result.stdout
