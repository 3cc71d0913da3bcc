"""The doctor on an Amazon SageMaker endpoint: a few probe sessions through its runtime API, read for what
breaks stateful sessions there. Each check gives its evidence and fix; none needs the endpoint's metrics
(the runtime API serves none)."""

from __future__ import annotations

from collections import Counter

from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import probe_once
from kvwatch.collectors.probe.workload import synthetic
from kvwatch.doctor.findings import Check, Diagnosis

SESSIONS, ROUNDS = 2, 3
SESSIONS_DISABLED = ("stateful sessions not enabled", "SAGEMAKER_ENABLE_STATEFUL_SESSIONS")


def diagnose_sagemaker(settings: ProbeSettings) -> Diagnosis:
    """Probe the endpoint with SESSIONS sessions of ROUNDS rounds, and read them."""
    return diagnosis_of(probe_once(settings, synthetic(ROUNDS, 200, 40, seed=0, sessions=SESSIONS)))


def diagnosis_of(sessions: list[SessionResult]) -> Diagnosis:
    """What the sessions say, check by check: the later checks are skipped when the earlier leave
    nothing to judge."""
    rounds = [r for s in sessions for r in s.rounds]
    failed = [r for r in rounds if not r.ok]
    kinds = Counter(r.error_kind for r in failed)
    detail = next((r.error_detail for r in failed), "")
    checks = [_access(kinds, detail), _sessions_enabled(sessions, failed)]
    if kinds["model_stream_error"] or kinds["internal_stream_failure"]:
        checks.append(
            Check(
                "model stream",
                "fail",
                f"the event stream broke: {detail}",
                "read the container's logs; raise the endpoint's invocation timeout for long answers",
                "model_stream_error",
            )
        )
    losses = Counter(kind for s in sessions for _, kind in s.session_losses)
    if losses["expired"]:
        checks.append(
            Check(
                "session expiry",
                "fail",
                f"{losses['expired']} sessions expired between rounds",
                "raise SAGEMAKER_SESSIONS_EXPIRATION in the container above the conversations' think time",
                "sessions_expire_between_rounds",
            )
        )
    judged = [s.sticky for s in sessions if s.sticky is not None]
    if not judged:
        checks.append(Check("reuse in sessions", "skipped", "no warm round reported cached tokens"))
    elif all(judged):
        checks.append(Check("reuse in sessions", "pass", "every warm round reused its session's history"))
    else:
        checks.append(
            Check(
                "reuse in sessions",
                "fail",
                f"{judged.count(False)} of {len(judged)} sessions reused under half the ideal",
                "check that requests carry SessionId (X-Amzn-SageMaker-Session-Id; custom headers are "
                "stripped) and that the engine caches prefixes",
                "session_reuse_lost",
            )
        )
    return Diagnosis(tuple(checks))


def _access(kinds: Counter, detail: str) -> Check:
    if kinds["credentials_error"]:
        return Check(
            "AWS credentials",
            "fail",
            detail,
            "give the probe credentials through the standard chain: AWS_* variables, a profile, a role",
            "aws_credentials",
        )
    if kinds["forbidden"]:
        skew = "signature expired" in detail.lower() or "skew" in detail.lower()
        fix = (
            "set the clock right (NTP): SigV4 refuses requests over 5 minutes off"
            if skew
            else "allow sagemaker:InvokeEndpoint and sagemaker:InvokeEndpointWithResponseStream on it"
        )
        return Check("AWS credentials", "fail", detail, fix, "forbidden")
    return Check("AWS credentials", "pass", "requests were signed and accepted")


def _sessions_enabled(sessions: list[SessionResult], failed: list) -> Check:
    refused = next(
        (r for r in failed if r.error_detail and any(t in r.error_detail for t in SESSIONS_DISABLED)), None
    )
    if refused is not None:
        return Check(
            "stateful sessions",
            "fail",
            refused.error_detail,
            "start the container with SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true",
            "stateful_sessions_disabled",
        )
    opened = [s.session_id for s in sessions if s.session_id]
    if not opened:
        return Check("stateful sessions", "skipped", "no session was opened")
    return Check(
        "stateful sessions",
        "pass",
        f"{len(opened)} sessions opened, {sum(bool(s.closed) for s in sessions)} closed",
    )
