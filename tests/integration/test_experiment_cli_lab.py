"""`kvwatch experiment` end to end in a small lab: every file written, the same conversations through both
routes interleaved, affinity faster from round 2, and the API key never written."""

from __future__ import annotations

import os
import re

import pandas as pd
import pytest
from test_experiment import KEY, ROUNDS, SESSIONS

from kvwatch.experiment.design import interleave
from kvwatch.experiment.report import FILES
from processes import kvwatch


@pytest.fixture(scope="module")
def run(start_lab, tmp_path_factory):
    """`kvwatch experiment` once through a small lab, with an API key from the environment."""
    lab = start_lab("--replicas", "4", "--users", "0", "--time-scale", "0.2")
    out = tmp_path_factory.mktemp("experiment")
    result = kvwatch(
        "experiment", "--a", lab.round_robin, "--b", lab.affinity, "--out", str(out),
        "--sessions", str(SESSIONS), "--rounds", str(ROUNDS), "--system-tokens", "500",
        "--turn-tokens", "1000", "--seed", "3", "--api-key-env", "KVW_EXPERIMENT_KEY",
        env={**os.environ, "KVW_EXPERIMENT_KEY": KEY},
    )  # fmt: skip
    return result, out


@pytest.mark.integration
def test_cli_writes_every_file(run):
    result, out = run
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES.values())
    per_round = pd.read_csv(out / FILES["per_round"])
    assert len(per_round) == 2 * ROUNDS and per_round["errors"].sum() == 0
    assert (per_round["ttft_median_low_seconds"] <= per_round["ttft_median_seconds"]).all()
    assert (per_round["ttft_median_seconds"] <= per_round["ttft_median_high_seconds"]).all()
    assert len(pd.read_csv(out / FILES["raw"])) == 2 * SESSIONS * ROUNDS
    assert list(pd.read_csv(out / FILES["routes"])["route"]) == ["round_robin", "affinity"]
    png = (out / FILES["png"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and 20_000 < len(png) < 2_000_000
    html = (out / FILES["html"]).read_text()
    assert 'class="plotly-graph-div"' in html and "<script src=" not in html  # the JS is inside
    assert result.stdout.startswith((out / FILES["report"]).read_text())
    # Route A's gateway passes /metrics on to one of the lab's vLLM replicas.
    block = r"\n- KV block: 16 tokens \(vllm:cache_config_info at http://127\.0\.0\.1:\d+/metrics\), for"
    assert re.search(block, result.stdout)


@pytest.mark.integration
def test_cli_runs_the_same_conversations_through_both_routes_interleaved(run):
    raw = pd.read_csv(run[1] / FILES["raw"])
    starts = raw[raw["round"] == 1].sort_values("started_at")
    plan = [("round_robin", "affinity")[route] for _, route in interleave(SESSIONS)]
    assert list(starts["route"]) == plan and list(starts["order"]) == list(range(2 * SESSIONS))
    # Same conversations: every round's prompt is as long through A as through B.
    lengths = raw.pivot(index=["conversation", "round"], columns="route", values="prompt_tokens")
    assert (lengths["round_robin"] == lengths["affinity"]).all()


@pytest.mark.integration
def test_cli_shows_affinity_faster_from_round_2(run):
    result, out = run
    per_round = pd.read_csv(out / FILES["per_round"])
    affinity = per_round[per_round["route"] == "affinity"].set_index("round")
    assert (affinity.loc[2:, "ttft_median_ratio_to_a"] < 1).all(), per_round
    routes = pd.read_csv(out / FILES["routes"]).set_index("route")
    assert routes.loc["affinity", "sticky_share"] == 1.0 and routes.loc["round_robin", "sticky_share"] < 0.5
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| round | round_robin median TTFT [95 % CI] | affinity median TTFT")
    rows = [line.split(" | ") for line in table[1 : ROUNDS + 1]]
    assert [row[0] for row in rows] == [f"| {n}" for n in range(1, ROUNDS + 1)]
    assert [float(row[3]) for row in rows] == pytest.approx(
        list(affinity["ttft_median_ratio_to_a"]), abs=0.006
    )


@pytest.mark.integration
def test_cli_never_writes_the_api_key(run):
    result, out = run
    assert result.returncode == 0
    assert KEY not in result.stdout + result.stderr
    for path in out.iterdir():
        assert KEY.encode() not in path.read_bytes(), path.name
