"""The doctor's SageMaker checks on crafted probe sessions (diagnosis_of): each names its cause with
evidence and fix only when the sessions show it. The sessions come as the sagemaker target records them;
the target's own behaviour (botocore through a real client) is tested in tests/unit/collectors."""

from __future__ import annotations

import socket

import pytest

from kvwatch.cli.main import main
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import probe_once
from kvwatch.collectors.probe.targets.sagemaker import NO_NEW_SESSION, SageMakerEndpoint
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.doctor.findings import Check, Diagnosis
from kvwatch.doctor.sagemaker import diagnosis_of

ENDPOINT = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url="http://127.0.0.1:9")
SKEWED = (
    "InvalidSignatureException: Signature expired: 20261205T042000Z is now earlier than 20261205T042500Z "
    "(20261205T043000Z - 5 min.)"
)


def settings(endpoint: SageMakerEndpoint = ENDPOINT, **changes) -> ProbeSettings:
    base = {"base_url": endpoint.base_url, "model": "m", "kind": "sagemaker", "sagemaker": endpoint}
    return ProbeSettings(**{**base, **changes})


def answered(number: int, cached: int | None, ideal: int, sent: str | None = "s-1") -> RoundResult:
    return RoundResult(
        number, 1000.0 + number, 200, None, None, 0.05, 0.1, ideal + 300, cached, ideal, 8, None, sent, sent
    )


def failed(kind: str, detail: str, status: int | None = None, sent: str | None = None) -> RoundResult:
    return RoundResult(1, 1000.0, status, kind, detail, None, None, None, None, None, None, None, sent, None)


def session(*rounds: RoundResult, session_id: str | None = "s-1", **more) -> SessionResult:
    closed = True if session_id else None
    return SessionResult("sm", "sagemaker", session_id, 1000.0, 1010.0, rounds, closed=closed, **more)


def reusing(session_id: str | None = "s-1", sent: str | None = "s-1", lost: bool = False) -> SessionResult:
    """Three rounds: round 1 cold, rounds 2 and 3 caching their ideal (or nothing when `lost`)."""
    rounds = [answered(1, 0, 0, sent)]
    rounds += [answered(n, 0 if lost else ideal, ideal, sent) for n, ideal in ((2, 384), (3, 768))]
    return session(*rounds, session_id=session_id)


def check(diagnosis: Diagnosis, name: str) -> Check:
    (found,) = [c for c in diagnosis.checks if c.name == name]
    return found


def test_a_healthy_endpoint_passes_every_check_under_load_too():
    diagnosis = diagnosis_of(
        [reusing(), reusing()], settings(), [reusing(f"l-{i}", f"l-{i}") for i in range(4)]
    )
    assert not diagnosis.failed, diagnosis
    assert check(diagnosis, "reuse under load").evidence == (
        "4 sessions at once: all 8 warm rounds reused their whole history"
    )


# --- sessions never opened, or sent in a custom header ------------------------------------------------

LOST = "2 of 2 sessions reused less than their whole history on a warm round"


@pytest.mark.parametrize(
    "changes, sent, cause, evidence, fix",
    [
        (
            {"session_mode": "none"},
            None,
            "sessions_not_opened",
            f"the target opens no session (session mode none): 6 rounds carried no SessionId; {LOST}",
            "open a session per conversation (InvokeEndpoint with SessionId=NEW_SESSION",
        ),
        (
            {"session_header": "X-Session-Id"},
            "c-1",
            "session_header_stripped",
            "the target sends its session id in X-Session-Id, a header SageMaker's runtime API does not "
            f"define and strips before the container, and no SessionId: {LOST}",
            "send the session as SessionId, not X-Session-Id: open a session",
        ),
    ],
)
def test_rounds_without_a_sessionid_are_named_with_the_fix(changes, sent, cause, evidence, fix):
    sessions = [reusing(None, sent, lost=True), reusing(None, sent, lost=True)]
    diagnosis = diagnosis_of(sessions, settings(**changes))
    assert diagnosis.causes == [cause]
    found = check(diagnosis, "stateful sessions")
    assert found.evidence == evidence
    assert found.fix.startswith(fix) and "X-Amzn-SageMaker-Session-Id" in found.fix
    assert check(diagnosis, "reuse in sessions").status == "skipped"


def test_an_open_answered_without_a_new_session_id_is_sessions_not_opened_not_disabled():
    detail = f"{NO_NEW_SESSION} (are stateful sessions enabled in the container? ...): {{}}"
    diagnosis = diagnosis_of(
        [session(failed("bad_response", detail, 200, "NEW_SESSION"), session_id=None)], settings()
    )
    assert diagnosis.causes == ["sessions_not_opened"]
    found = check(diagnosis, "stateful sessions")
    assert found.evidence == detail and "X-Amzn-SageMaker-New-Session-Id" in found.fix


def test_a_custom_session_header_is_named_even_when_routing_kept_the_reuse():
    diagnosis = diagnosis_of([reusing(None, "c-1")], settings(session_header="X-Session-Id"))
    assert diagnosis.causes == ["session_header_stripped"]
    assert check(diagnosis, "stateful sessions").evidence.endswith(
        "0 of 1 sessions reused less than their whole history on a warm round"
    )


def test_sessionid_s_own_header_is_no_custom_header():
    diagnosis = diagnosis_of([reusing()], settings(session_header="x-amzn-sagemaker-session-id"))
    assert check(diagnosis, "stateful sessions").status == "pass"


# --- clock skew ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, said",
    [
        (SKEWED, "this machine's clock is 600 s behind AWS's"),
        (
            "InvalidSignatureException: Signature not yet current: 20261205T044500Z is still later than "
            "20261205T043500Z (20261205T043000Z + 5 min.)",
            "this machine's clock is 900 s ahead of AWS's",
        ),
    ],
)
def test_a_signature_refused_for_its_date_is_clock_skew_with_the_offset(message, said):
    diagnosis = diagnosis_of([session(failed("forbidden", message, 403, "NEW_SESSION"))], settings())
    assert diagnosis.causes == ["clock_skew"]
    found = check(diagnosis, "clock")
    words = message.removeprefix("InvalidSignatureException: ")
    assert found.evidence == f"AWS refused the request's signature (HTTP 403): {words}: {said}"
    assert "NTP" in found.fix


def test_another_403_is_a_permission_not_the_clock():
    refusal = "AccessDeniedException: not authorized to perform: sagemaker:InvokeEndpoint"
    diagnosis = diagnosis_of([session(failed("forbidden", refusal, 403, "NEW_SESSION"))], settings())
    assert diagnosis.causes == ["forbidden"]
    assert "sagemaker:InvokeEndpointWithResponseStream" in check(diagnosis, "AWS credentials").fix


# --- PREFIX_AWARE overflow under load ------------------------------------------------------------------


def overflowed(index: int, sent: str | None) -> SessionResult:
    """Two rounds; the warm one cached the shared system prompt only (256 of 384) on odd sessions."""
    cached = 256 if index % 2 else 384
    return session(answered(1, 0, 0, sent), answered(2, cached, 384, sent), session_id=sent)


def test_reuse_lost_only_under_load_without_a_session_is_prefix_aware_overflow():
    one_by_one = [reusing(None, None), reusing(None, None)]
    diagnosis = diagnosis_of(
        one_by_one, settings(session_mode="none"), [overflowed(i, None) for i in range(4)]
    )
    assert diagnosis.causes == ["sessions_not_opened", "prefix_aware_overflow"]
    found = check(diagnosis, "reuse under load")
    assert found.evidence.startswith(
        "one at a time every warm round reused its whole history; with 4 sessions at once 2 of 4 warm rounds "
        "reused less (at worst 256 of 384 tokens), without a SessionId"
    )
    assert "ConcurrencyThreshold" in found.fix and "SessionId" in found.fix


def test_stateful_sessions_losing_reuse_under_load_are_no_overflow_claim():
    diagnosis = diagnosis_of([reusing(), reusing()], settings(), [overflowed(i, f"l-{i}") for i in range(4)])
    found = check(diagnosis, "reuse under load")
    assert found.status == "warn" and "evicted" in found.evidence and diagnosis.causes == []


def test_without_whole_reuse_one_at_a_time_nothing_is_claimed_of_load():
    diagnosis = diagnosis_of([reusing(None, None, lost=True)], settings(session_mode="none"))
    assert check(diagnosis, "reuse under load").status == "skipped"
    assert "prefix_aware_overflow" not in diagnosis.causes


# --- reachability --------------------------------------------------------------------------------------


@pytest.fixture
def nxdomain(monkeypatch):
    """The resolver answering every name as it answers a typo (NXDOMAIN), without asking any DNS."""

    def answer(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", answer)


@pytest.fixture
def aws_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))


@pytest.mark.parametrize(
    "endpoint, host, fix",
    [
        (
            SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url="http://sagemkaer.example:8080"),
            "sagemkaer.example:8080",
            HINTS["dns_error"],
        ),
        (
            SageMakerEndpoint("chat-endpoint", "us-eats-1"),
            "runtime.sagemaker.us-eats-1.amazonaws.com",
            "check the region (us-eats-1): the runtime API of a region is "
            f"runtime.sagemaker.<region>.amazonaws.com; {HINTS['dns_error']}",
        ),
    ],
)
def test_a_host_that_does_not_resolve_is_a_dns_error_through_botocore(
    nxdomain, aws_credentials, endpoint, host, fix
):
    sessions = probe_once(settings(endpoint), [Conversation("s", ("one",))])
    (first,) = sessions[0].rounds
    assert (first.error_kind, first.error_detail) == (
        "dns_error",
        f"{host}: the host name does not resolve (Name or service not known)",
    )
    diagnosis = diagnosis_of(sessions, settings(endpoint))
    assert diagnosis.causes == ["dns_error"]
    assert check(diagnosis, "reachability").fix == fix
    assert check(diagnosis, "AWS credentials").status == "skipped"


def test_nothing_listening_stays_connection_refused(aws_credentials):
    sessions = probe_once(settings(), [Conversation("s", ("one",))])
    assert sessions[0].rounds[0].error_kind == "connection_refused"
    assert sessions[0].rounds[0].error_detail == "cannot connect to 127.0.0.1:9: Connection refused"
    assert diagnosis_of(sessions, settings()).causes == ["connection_refused"]


def test_cli_doctor_takes_no_session_only_for_a_sagemaker_endpoint(capsys):
    assert main(["doctor", "--base-url", "http://127.0.0.1:9", "--model", "m", "--no-session"]) == 2
    assert "--no-session is for a --sagemaker-endpoint" in capsys.readouterr().err
