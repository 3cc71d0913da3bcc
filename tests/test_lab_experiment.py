"""The source article's A/B experiment, reproduced in the lab through real nginx.

Twenty sessions of six rounds with a growing history go through each listener, with the same data and
seed: group A round robin, group B affinity. Round robin's TTFT grows with the history; affinity's
stays near round 1's from round 2 on, and the replicas' own counters show the cache reuse.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO
from lab.traffic import run_conversation, system_prompt, user_turns

pytestmark = pytest.mark.integration

# One session at a time: round robin then visits a new replica every round, as random balancing over
# many replicas would, and no queueing blurs the prefill times being compared.
SESSIONS, ROUNDS, REPLICAS, CONCURRENCY = 20, 6, 8, 1
SYSTEM_TOKENS, TURN_TOKENS, ANSWER_TOKENS = 1000, 300, 8
ARTIFACT = REPO / "test-artifacts" / "lab-experiment.md"


def cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    """Cluster totals of vllm:prefix_cache_hits_total and _queries_total, read from every replica."""
    hits = queries = 0.0
    for url in replica_urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


async def run_group(url: str) -> list[list]:
    """Every session's rounds through one listener, a few sessions at a time, seeded like the other group."""
    rng = random.Random(7)
    system = system_prompt(SYSTEM_TOKENS, seed=7)
    conversations = [user_turns(ROUNDS, TURN_TOKENS, rng) for _ in range(SESSIONS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient() as client:

        async def one(turns: list[str]) -> list:
            async with gate:
                return await run_conversation(
                    client, url, system, turns, max_tokens=ANSWER_TOKENS, session_mode="server"
                )

        return await asyncio.gather(*(one(turns) for turns in conversations))


def measure(url: str, replica_urls: list[str]) -> dict:
    for replica in replica_urls:
        httpx.post(f"{replica}/lab/reset-cache", timeout=5).raise_for_status()
    hits_before, queries_before = cache_counters(replica_urls)
    sessions = asyncio.run(run_group(url))
    hits_after, queries_after = cache_counters(replica_urls)
    records = [record for session in sessions for record in session]
    assert len(records) == SESSIONS * ROUNDS and all(r.status == 200 for r in records), [
        r.error for r in records if r.error
    ]
    medians = [
        statistics.median(r.ttft_seconds for r in records if r.round == round_)
        for round_ in range(1, ROUNDS + 1)
    ]
    return {
        "median_ttft": medians,
        "hit_ratio": (hits_after - hits_before) / (queries_after - queries_before),
        "sticky_share": sum(len({r.upstream for r in s}) == 1 for s in sessions) / SESSIONS,
    }


def report(rr: dict, affinity: dict) -> str:
    lines = [
        f"{SESSIONS} sessions x {ROUNDS} rounds per listener ({CONCURRENCY} at a time), {REPLICAS} replicas, "
        f"system prompt {SYSTEM_TOKENS} "
        f"tokens, {TURN_TOKENS} tokens per user turn; median client-side TTFT in ms "
        "(replica time scale 0.5).",
        "",
        "| round | round robin | affinity | affinity / round robin |",
        "|---|---|---|---|",
    ]
    for index, (a, b) in enumerate(zip(rr["median_ttft"], affinity["median_ttft"], strict=True)):
        lines.append(f"| {index + 1} | {a * 1000:.0f} | {b * 1000:.0f} | {b / a:.2f} |")
    lines += [
        f"| prefix-cache hit ratio (replica counters) | {rr['hit_ratio']:.2f} "
        f"| {affinity['hit_ratio']:.2f} | |",
        f"| sessions on one replica | {rr['sticky_share']:.0%} | {affinity['sticky_share']:.0%} | |",
    ]
    return "\n".join(lines) + "\n"


def test_affinity_keeps_warm_rounds_fast_and_round_robin_does_not(start_lab):
    lab = start_lab("--replicas", str(REPLICAS), "--users", "0", "--time-scale", "0.5")
    replicas = [r["url"] for r in lab.status["replicas"]]
    rr = measure(lab.round_robin, replicas)
    affinity = measure(lab.affinity, replicas)
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(report(rr, affinity))

    rr_ttft, aff_ttft = rr["median_ttft"], affinity["median_ttft"]
    # Round robin: every round recomputes the history the previous replica held, so TTFT climbs.
    assert all(later > earlier for earlier, later in zip(rr_ttft, rr_ttft[1:], strict=False)), rr_ttft
    # Affinity: warm rounds beat round robin from round 2, and cost at most half of it from round 3.
    assert all(a < r for a, r in zip(aff_ttft[1:], rr_ttft[1:], strict=True)), (aff_ttft, rr_ttft)
    assert all(a <= 0.5 * r for a, r in zip(aff_ttft[2:], rr_ttft[2:], strict=True)), (aff_ttft, rr_ttft)
    assert affinity["hit_ratio"] >= 0.7, affinity
    assert affinity["hit_ratio"] >= rr["hit_ratio"] + 0.2, (affinity, rr)
    assert affinity["sticky_share"] == 1.0 and rr["sticky_share"] < 0.2
