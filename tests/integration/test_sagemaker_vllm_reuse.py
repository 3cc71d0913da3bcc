"""kvwatch's reuse judgment on two real vLLM instances behind the lab's SageMaker front, through the real
AWS SDK (botocore): with the front ignoring session ids, every warm round caches exactly what the instance
the front chose holds of that session's own history (each session's marker keeps the others' cached
prompts out), as vLLM counts it, so the reuse drops and every session is judged not sticky; healed, every
session is sticky again. In the real-vLLM lane of `make test` (scripts/test.sh)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from sagemaker_client import assert_sticky_by_reuse, fault, probe_json, rounds_of, use_lab_credentials

from conftest import Lab, http_get, start_vllm_sagemaker_lab, wait_for

BLOCK = 128  # the lab's vLLM KV block
WORKLOAD = ("--system-tokens", "300", "--turn-tokens", "100", "--max-tokens", "16")
HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    use_lab_credentials(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory) -> Iterator[Lab]:
    """Two real vLLM instances with stateful sessions behind the front, no serve probing: the only
    traffic is the test's."""
    lab = start_vllm_sagemaker_lab(tmp_path_factory.mktemp("vllm-sagemaker-two") / "state", replicas=2)
    yield lab
    lab.stop()


def cache_hits(lab: Lab) -> float:
    """The tokens all instances served from their prefix caches so far, by vLLM's own counter."""
    found = [HITS.search(http_get(f"{r['url']}/metrics", timeout=10).text) for r in lab.status["replicas"]]
    assert all(found), "vllm:prefix_cache_hits_total missing"
    return sum(float(match.group(1)) for match in found)


def expected_cached(lab: Lab, session: dict) -> list[int]:
    """Each round's cached tokens as the front's routing and the session's own history make them: what
    the instance the front sent the round to kept of the session's earlier rounds there (prompt and
    answer, in whole blocks), at most the round's prompt less its last token."""
    served = [e["upstream_addr"] for e in rounds_of(lab, session["session_id"], 200)]
    assert len(served) == len(session["rounds"]), (served, session)
    held: dict[str, int] = {}
    expected = []
    for instance, r in zip(served, session["rounds"], strict=True):
        expected.append(min(held.get(instance, 0), (r["prompt_tokens"] - 1) // BLOCK * BLOCK))
        kept = (r["prompt_tokens"] + r["completion_tokens"]) // BLOCK * BLOCK
        held[instance] = max(held.get(instance, 0), kept)
    return expected


def test_with_session_ids_ignored_each_round_reuses_only_what_its_instance_kept(two_instances: Lab):
    lab = two_instances
    fault(lab, "ignore-session-ids")
    try:
        before = cache_hits(lab)
        report, result = probe_json(lab, "--sessions", "6", "--rounds", "4", *WORKLOAD, timeout=600)
        sessions = report["sessions"]
        assert all(s["rounds"] and all(r["error"] is None for r in s["rounds"]) for s in sessions), report
        cached = [[r["cached_tokens"] for r in s["rounds"]] for s in sessions]
        total = sum(map(sum, cached))  # vLLM's counter moves with its engine loop, just after the answers
        (counted,) = wait_for(
            lambda: (hits := cache_hits(lab) - before) >= total and (hits,), "vLLM's counted hits", 30
        )
        assert counted == total, (counted, cached)
        assert cached == [expected_cached(lab, s) for s in sessions], sessions
        warm = [r for s in sessions for r in s["rounds"][1:]]
        reuse = sum(r["cached_tokens"] for r in warm) / sum(r["ideal_cached_tokens"] for r in warm)
        assert reuse < 1, warm
        # Sticky only when all its rounds stayed on one instance: a chance of 1 in 8 each, 1 in 8^6 for all.
        for session in sessions:
            instances = {e["upstream_addr"] for e in rounds_of(lab, session["session_id"], 200)}
            assert (session["evidence"], session["sticky"]) == ("reuse", len(instances) == 1), session
        assert not all(s["sticky"] for s in sessions), sessions
    finally:
        assert lab.cli("heal").returncode == 0
    report, result = probe_json(lab, "--sessions", "2", "--rounds", "3", *WORKLOAD, timeout=600)
    assert result.returncode == 0, result.stderr
    assert_sticky_by_reuse(report, block=BLOCK)
