"""The recording rules against the lab's real Prometheus: the cluster and per-instance hit ratios they
record match the replicas' ground truth over a window of background traffic, on a mixed vLLM + SGLang
fleet. The lab runs the rules with their windows at a quarter of production (two minutes become 30 s):
what is checked is the same, in a quarter of the wait."""

from __future__ import annotations

import time

import httpx
import pytest

from collectors import queries
from lab.configs import scale_durations

pytestmark = pytest.mark.integration

RULE_TIME_SCALE = 0.25
WINDOW_S = int(scale_durations(queries.WINDOW, RULE_TIME_SCALE).removesuffix("s"))  # the rules' window
TOLERANCE = 0.02


def query(prometheus: str, expr: str, at: float) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr, "time": at}, timeout=10)
    return response.json()["data"]["result"]


def counted_at(record: dict, flavour: str) -> float:
    """When the engine counted the request: vLLM at prefill (first token), SGLang when it finished."""
    seconds = record["ttft_seconds"] if flavour == "vllm" else record["e2e_seconds"]
    return record["time"] + seconds


def ground_truth_ratio(records: list[tuple[dict, str]], start: float, end: float) -> float:
    counted = [r for r, flavour in records if r.get("ttft_seconds") and start < counted_at(r, flavour) <= end]
    return sum(r["cached_tokens"] for r in counted) / sum(r["prompt_tokens"] for r in counted)


def test_recorded_hit_ratios_match_ground_truth(start_lab):
    lab = start_lab("--replicas", "4", "--flavours", "vllm,sglang", "--users", "6", "--think", "0.2",
                    "--time-scale", "0.1", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip
    prometheus = lab.status["prometheus"]
    # The window must lie wholly inside the traffic: rate() extrapolates differently near a series' start.
    time.sleep(WINDOW_S + 20)
    evaluated = query(prometheus, f"timestamp({queries.CLUSTER_HIT_RATIO})", time.time())
    at = float(evaluated[0]["value"][1])
    (cluster,) = query(prometheus, queries.CLUSTER_HIT_RATIO, at)
    per_instance = {
        sample["metric"]["instance"]: float(sample["value"][1])
        for sample in query(prometheus, queries.INSTANCE_HIT_RATIO, at)
    }

    records: list[tuple[dict, str]] = []
    for replica in lab.status["replicas"]:
        truth = httpx.get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
        instance = replica["url"].removeprefix("http://")
        own = [(record, replica["flavour"]) for record in truth]
        expected = ground_truth_ratio(own, at - WINDOW_S, at)
        assert per_instance[instance] == pytest.approx(expected, abs=TOLERANCE), (replica, expected)
        records += own
    expected = ground_truth_ratio(records, at - WINDOW_S, at)
    assert 0.3 < expected < 1.0  # real reuse happened, so the comparison means something
    assert float(cluster["value"][1]) == pytest.approx(expected, abs=TOLERANCE)
