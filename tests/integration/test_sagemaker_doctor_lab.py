"""The doctor's SageMaker checks against `kvwatch lab up --gateway sagemaker` through the real AWS SDK
(botocore): sessions never opened, a custom session header the front strips, a clock off by minutes (the
front checks the signing time as AWS does), and PREFIX_AWARE overflowing under load. The affinity
listener routes by PREFIX_AWARE at a ConcurrencyThreshold of 2, so that the doctor's sessions at once
overflow however the machine schedules them; the round_robin listener routes by RANDOM.
Simulated replicas, no probes: the doctor's requests are the only load on the front."""

from __future__ import annotations

import datetime
import json
import re

import botocore.auth
import pytest
from sagemaker_client import MODEL, endpoint, use_lab_credentials

from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint
from kvwatch.doctor.sagemaker import LOAD_SESSIONS, diagnose_sagemaker
from kvwatch.lab.gateways.sagemaker import ENDPOINT, LAB_REGION
from labs import Lab
from processes import kvwatch

CONCURRENCY_THRESHOLD = 2


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    use_lab_credentials(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    return start_lab(
        "--gateway", "sagemaker", "--replicas", "3", "--sagemaker-routing", "PREFIX_AWARE",
        "--sagemaker-concurrency-threshold", str(CONCURRENCY_THRESHOLD), "--no-probes",
    )  # fmt: skip


def doctor(url: str, *options: str) -> dict:
    result = kvwatch("doctor", *endpoint(url), *options, "--json", timeout=300)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert result.returncode == (1 if report["causes"] else 0), report
    return report


def named(report: dict, name: str) -> dict:
    (found,) = [c for c in report["checks"] if c["name"] == name]
    return found


def test_stateful_sessions_keep_their_reuse_under_load_behind_prefix_aware(lab):
    report = doctor(lab.affinity)
    assert report["causes"] == [], report
    assert named(report, "stateful sessions")["evidence"] == "2 sessions opened, 2 closed"
    under_load = named(report, "reuse under load")
    assert under_load["status"] == "pass", under_load
    assert under_load["evidence"].startswith(f"{LOAD_SESSIONS} sessions at once: all {LOAD_SESSIONS} warm")


def test_without_sessions_prefix_aware_overflows_under_load_and_the_doctor_says_so(lab):
    report = doctor(lab.affinity, "--no-session")
    assert report["causes"] == ["sessions_not_opened", "prefix_aware_overflow"], report
    opened = named(report, "stateful sessions")
    assert opened["evidence"] == (
        "the target opens no session (session mode none): 6 rounds carried no SessionId; "
        "0 of 2 sessions reused less than their whole history on a warm round"
    )
    overflow = named(report, "reuse under load")
    said = re.match(
        rf"one at a time every warm round reused its whole history; with {LOAD_SESSIONS} sessions at once "
        r"(\d+) of (\d+) warm rounds reused less",
        overflow["evidence"],
    )
    assert said and 0 < int(said[1]) <= int(said[2]) == LOAD_SESSIONS, overflow
    assert "ConcurrencyThreshold" in overflow["fix"]


def test_a_session_sent_in_a_custom_header_is_stripped_and_named(lab):
    report = doctor(lab.round_robin, "--session-header", "X-Session-Id")
    assert report["causes"][0] == "session_header_stripped", report
    stripped = named(report, "stateful sessions")
    assert "X-Session-Id, a header SageMaker's runtime API does not define and strips" in stripped["evidence"]
    assert stripped["fix"].startswith("send the session as SessionId, not X-Session-Id")
    # That the header never reaches a container is the front's test (test_lab_sagemaker.py).


@pytest.mark.parametrize("offset_minutes, words", [(-10, "behind"), (10, "ahead of")])
def test_a_clock_minutes_off_is_refused_as_aws_refuses_it_and_named_clock_skew(
    lab, monkeypatch, offset_minutes, words
):
    """botocore signs at a clock `offset_minutes` off (its signer's clock patched in this process); the
    front refuses the date as AWS does, and the doctor reads the offset from AWS's words."""
    real = botocore.auth.get_current_datetime
    offset = datetime.timedelta(minutes=offset_minutes)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: real(*a, **k) + offset)
    target = SageMakerEndpoint(ENDPOINT, LAB_REGION, endpoint_url=lab.affinity)
    settings = ProbeSettings(target.base_url, MODEL, kind="sagemaker", sagemaker=target, timeout_seconds=30)
    diagnosis = diagnose_sagemaker(settings)
    assert diagnosis.causes == ["clock_skew"], diagnosis
    (clock,) = [c for c in diagnosis.checks if c.name == "clock"]
    expired = "Signature expired" if offset_minutes < 0 else "Signature not yet current"
    assert clock.evidence.startswith(f"AWS refused the request's signature (HTTP 403): {expired}: "), clock
    seconds = int(re.search(rf"this machine's clock is (\d+) s {words} AWS's", clock.evidence)[1])
    assert abs(seconds - abs(offset_minutes) * 60) <= 1, clock  # the dates have whole seconds
