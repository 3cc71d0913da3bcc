"""kvwatch's SageMaker target against real vLLM behind the lab's SageMaker front, through the real AWS SDK
(botocore): sessions reuse every warm round at vLLM's 128-token block, a session vLLM expired under a
running probe is reported and reopened, and the doctor names a container started without stateful
sessions. In the real-vLLM lane of `make test` (scripts/test.sh)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from sagemaker_client import (
    MODEL,
    RESTART_TIMEOUT_S,
    assert_sticky_by_reuse,
    endpoint,
    fault,
    probe_json,
    probe_through_an_expiry,
    rounds_of,
    use_lab_credentials,
)

from labs import Lab
from paths import REPO
from processes import http_get, kvwatch, wait_for


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


def _front_holds(lab: Lab, replica_id: str) -> bool:
    """Whether the front serves a config that holds the replica's requests (the fault restarting it)."""
    written = json.loads((lab.state_dir / "sagemaker" / "front.json").read_text())  # held: {id: seconds}
    serving = http_get(f"{lab.affinity}/-/lab-config", timeout=5).text.strip()
    return replica_id in written["held"] and serving == written["generation"]


def test_real_vllm_expires_a_probed_session_and_the_probe_reopens_it(vllm_sagemaker_lab: Lab):
    """The probe is paused once its session's first round is served; the fault restarts vLLM with the
    session dated in the past, the front holding requests meanwhile, and the probe resumes into the hold.
    vLLM serves the next round without the expired session and drops it, the round after gets "session
    not found": the probe counts one loss, opens a new session and runs the rest there, reusing again."""
    lab, block = vllm_sagemaker_lab, 128

    def expire(probe: subprocess.Popen) -> None:
        os.kill(probe.pid, signal.SIGSTOP)
        try:
            injected = subprocess.Popen(
                [sys.executable, "-m", "kvwatch.cli.main", "lab", "fault", "expire-sessions",
                 "--state-dir", str(lab.state_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            wait_for(lambda: _front_holds(lab, "r1"), "the front holding r1", timeout=120, every=0.1)
        finally:
            os.kill(probe.pid, signal.SIGCONT)
        said, _ = injected.communicate(timeout=RESTART_TIMEOUT_S)
        assert injected.returncode == 0 and "every open session expired" in said, said

    options = ["--prometheus", lab.status["prometheus"], "--system-tokens", "300", "--turn-tokens", "100",
               "--max-tokens", "16", "--timeout", str(RESTART_TIMEOUT_S)]  # fmt: skip
    session, opened, reopened_at = probe_through_an_expiry(lab, options, expire)
    # The front's ground truth: every round of the expired session served but the one vLLM refused.
    refused = rounds_of(lab, opened, 424)
    assert len(refused) == 1 and len(rounds_of(lab, opened, 200)) == reopened_at, rounds_of(lab, opened)
    # The container's: the expired session dropped, the new one closed at the end.
    sessions = lab.state_dir / "sagemaker-sessions" / "r1"
    assert not (sessions / opened).exists() and not (sessions / session["session_id"]).exists()
    # vLLM's cached tokens in the new session: each warm round all its ideal, block-aligned.
    warm = session["rounds"][reopened_at + 1 :]
    assert warm, session["rounds"]
    for r in warm:
        assert r["cached_tokens"] == r["ideal_cached_tokens"] > 0 and r["ideal_cached_tokens"] % block == 0, r


def test_real_vllm_without_stateful_sessions_is_named_by_the_doctor(vllm_sagemaker_lab: Lab):
    lab = vllm_sagemaker_lab
    assert "without SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in fault(lab, "disable-sessions")
    try:
        model = lab.status.get("model", MODEL)
        result = kvwatch("doctor", *endpoint(lab.affinity, model), "--json", timeout=300)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "stateful_sessions_disabled" in json.loads(result.stdout)["causes"], result.stdout
    finally:
        assert lab.cli("heal", timeout=RESTART_TIMEOUT_S).returncode == 0
