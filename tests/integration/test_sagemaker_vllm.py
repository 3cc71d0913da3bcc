"""kvwatch's SageMaker target against real vLLM behind the lab's SageMaker front, through the real AWS SDK
(botocore): sessions reuse every warm round at vLLM's 128-token block, and the doctor names a container
started without stateful sessions. In the real-vLLM lane of `make test` (scripts/test.sh)."""

from __future__ import annotations

import json

import pytest
from sagemaker_client import MODEL, assert_sticky_by_reuse, endpoint, fault, probe_json, use_lab_credentials

from conftest import Lab, kvwatch


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    use_lab_credentials(monkeypatch, tmp_path)


def test_real_vllm_reuses_every_warm_round_at_its_128_token_block(vllm_sagemaker_lab: Lab):
    report, result = probe_json(
        vllm_sagemaker_lab, "--sessions", "2", "--rounds", "3", "--system-tokens", "600",
        "--turn-tokens", "150", "--max-tokens", "16", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_sticky_by_reuse(report, block=128)


def test_real_vllm_without_stateful_sessions_is_named_by_the_doctor(vllm_sagemaker_lab: Lab):
    lab = vllm_sagemaker_lab
    assert "without SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in fault(lab, "disable-sessions")
    try:
        model = lab.status.get("model", MODEL)
        result = kvwatch("doctor", *endpoint(lab.affinity, model), "--json", timeout=300)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "stateful_sessions_disabled" in json.loads(result.stdout)["causes"], result.stdout
    finally:
        assert lab.cli("heal").returncode == 0
