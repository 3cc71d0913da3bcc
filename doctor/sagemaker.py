"""The doctor on an Amazon SageMaker endpoint: a few probe sessions through its runtime API, read for what
breaks stateful sessions there. Each check gives its evidence and fix; none needs the endpoint's metrics
(the runtime API serves none).

Two sets of sessions: SESSIONS one at a time, then, when those reused their whole history, LOAD_SESSIONS
at once: a loss only under load is what routing does to requests without a session when busy (PREFIX_AWARE
overflowing at its ConcurrencyThreshold), and is named only for requests that carried no SessionId.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import probe_once
from kvwatch.collectors.probe.targets.sagemaker import NO_NEW_SESSION, custom_session_header
from kvwatch.collectors.probe.workload import synthetic
from kvwatch.doctor.findings import Check, Diagnosis
from kvwatch.doctor.route import UNREACHABLE

SESSIONS, ROUNDS = 2, 3
# Sessions at once for the load check: as many as the target's threads run (sagemaker.MAX_THREADS), past
# the default ConcurrencyThreshold of the lab (8) and of SageMaker's examples.
LOAD_SESSIONS, LOAD_ROUNDS = 16, 2
# A system prompt longer than PREFIX_AWARE's smallest PrefixLength (1,024 bytes): every round of a
# conversation, and every conversation, shares the prefix the endpoint hashes.
SYSTEM_TOKENS, TURN_TOKENS = 200, 40
SESSIONS_DISABLED = "stateful sessions not enabled"
_STAMP = r"([0-9]{8}T[0-9]{6}Z)"
# AWS's refusal of a SigV4 date over 5 minutes from its clock: the date signed, then AWS's own time.
_SKEW = re.compile(
    rf"Signature (?:expired|not yet current): {_STAMP} is (?:now earlier|still later) than "
    rf"{_STAMP} \({_STAMP} [-+] 5 min\.\)"
)
SESSION_FIX = (
    'open a session per conversation (InvokeEndpoint with SessionId=NEW_SESSION and the body {"requestType": '
    '"NEW_SESSION"}) and send the id X-Amzn-SageMaker-New-Session-Id returns as SessionId '
    "(X-Amzn-SageMaker-Session-Id) in every round"
)


def diagnose_sagemaker(settings: ProbeSettings) -> Diagnosis:
    """Probe the endpoint with SESSIONS sessions of ROUNDS rounds one at a time, then under load, and read
    them."""
    one_by_one = probe_once(
        settings, synthetic(ROUNDS, SYSTEM_TOKENS, TURN_TOKENS, seed=0, sessions=SESSIONS)
    )
    under_load: list[SessionResult] = []
    if _whole_reuse(one_by_one):
        load = synthetic(LOAD_ROUNDS, SYSTEM_TOKENS, TURN_TOKENS, seed=1, sessions=LOAD_SESSIONS)
        # As an application's conversations: one system prompt, so that PREFIX_AWARE hashes them alike.
        shared = replace(settings, marked_sessions=False)
        under_load = probe_once(shared, load, concurrency=LOAD_SESSIONS)
    return diagnosis_of(one_by_one, settings, under_load)


def diagnosis_of(
    sessions: list[SessionResult], settings: ProbeSettings, under_load: Sequence[SessionResult] = ()
) -> Diagnosis:
    """What the sessions say, check by check: the later checks are skipped when the earlier leave
    nothing to judge."""
    rounds = [r for s in sessions for r in s.rounds]
    failed = [r for r in rounds if not r.ok]
    kinds = Counter(r.error_kind for r in failed)
    detail = next((r.error_detail for r in failed), "")
    reach = _reachability(rounds, failed, settings)
    if reach.status == "fail":
        return Diagnosis((reach, Check("AWS credentials", "skipped", "no request reached the endpoint")))
    checks = [reach, _access(rounds, kinds, detail), _sessions_opened(sessions, failed, settings)]
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
    checks.append(_reuse(sessions, settings))
    checks.append(_reuse_under_load(under_load, settings))
    return Diagnosis(tuple(checks))


def _reachability(rounds: list[RoundResult], failed: list[RoundResult], settings: ProbeSettings) -> Check:
    """Did a request reach the runtime API? Each way of not reaching it is its cause, as on the OpenAI
    path (a host name that does not resolve is dns_error)."""
    name = "reachability"
    unreached = next((r for r in failed if r.error_kind in UNREACHABLE), None)
    if unreached is not None:
        fix = HINTS[unreached.error_kind]
        endpoint = settings.sagemaker
        if unreached.error_kind == "dns_error" and endpoint is not None and endpoint.endpoint_url is None:
            fix = (
                f"check the region ({endpoint.region}): the runtime API of a region is "
                f"runtime.sagemaker.<region>.amazonaws.com; {fix}"
            )
        return Check(name, "fail", unreached.error_detail or unreached.error_kind, fix, unreached.error_kind)
    if any(r.status is not None for r in rounds):
        return Check(name, "pass", f"the runtime API answered at {settings.base_url}")
    return Check(name, "skipped", "no request was sent")


def _access(rounds: list[RoundResult], kinds: Counter, detail: str) -> Check:
    name = "AWS credentials"
    if kinds["credentials_error"]:
        return Check(
            name,
            "fail",
            detail,
            "give the probe credentials through the standard chain: AWS_* variables, a profile, a role",
            "aws_credentials",
        )
    if kinds["forbidden"]:
        if skew := _clock_skew(detail):
            return Check(
                "clock",
                "fail",
                f"AWS refused the request's signature (HTTP 403): {skew}",
                "set this machine's clock right (NTP: chronyd, systemd-timesyncd): SigV4 refuses a request "
                "signed over 5 minutes from AWS's time",
                "clock_skew",
            )
        fix = "allow sagemaker:InvokeEndpoint and sagemaker:InvokeEndpointWithResponseStream on it"
        return Check(name, "fail", detail, fix, "forbidden")
    if any(r.status is not None and r.status not in (401, 403) for r in rounds):
        return Check(name, "pass", "requests were signed and accepted")
    return Check(name, "skipped", "no request was answered")


def _clock_skew(detail: str) -> str | None:
    """AWS's refusal of the signing time and how far this machine's clock is from AWS's, read from it;
    None for another refusal."""
    found = _SKEW.search(detail or "")
    if found is None:
        return None
    signed, _, aws_now = (datetime.strptime(s, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC) for s in found.groups())
    offset = (signed - aws_now).total_seconds()
    side = "ahead of" if offset > 0 else "behind"
    return f"{found[0]}: this machine's clock is {abs(offset):.0f} s {side} AWS's"


def _sent_no_session(settings: ProbeSettings) -> bool:
    """Did the rounds go without a SessionId (session mode none, or a custom header)?"""
    return settings.session_mode == "none" or custom_session_header(settings) is not None


def _reuse_said(sessions: list[SessionResult]) -> str:
    judged = [s for s in sessions if _warm([s])]
    if not judged:
        return "no warm round reported cached tokens"
    short = sum(not _whole_reuse([s]) for s in judged)
    return f"{short} of {len(judged)} sessions reused less than their whole history on a warm round"


def _sessions_opened(
    sessions: list[SessionResult], failed: list[RoundResult], settings: ProbeSettings
) -> Check:
    """Did every conversation run in a stateful session: opened by the container, its id sent as
    SessionId?"""
    name = "stateful sessions"
    if header := custom_session_header(settings):
        evidence = (
            f"the target sends its session id in {header}, a header SageMaker's runtime API does not define "
            f"and strips before the container, and no SessionId: {_reuse_said(sessions)}"
        )
        fix = f"send the session as SessionId, not {header}: {SESSION_FIX}"
        return Check(name, "fail", evidence, fix, "session_header_stripped")
    if settings.session_mode == "none":
        sent = sum(len(s.rounds) for s in sessions)
        evidence = f"the target opens no session (session mode none): {sent} rounds carried no SessionId"
        return Check(name, "fail", f"{evidence}; {_reuse_said(sessions)}", SESSION_FIX, "sessions_not_opened")
    unopened = next((r for r in failed if NO_NEW_SESSION in (r.error_detail or "")), None)
    if unopened is not None:
        fix = (
            "the container must create the session and answer X-Amzn-SageMaker-New-Session-Id: run one that "
            "implements SageMaker's stateful sessions (vLLM's /invocations) with "
            "SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true"
        )
        return Check(name, "fail", unopened.error_detail, fix, "sessions_not_opened")
    refused = next((r for r in failed if SESSIONS_DISABLED in (r.error_detail or "")), None)
    if refused is not None:
        fix = "start the container with SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true"
        return Check(name, "fail", refused.error_detail, fix, "stateful_sessions_disabled")
    opened = [s.session_id for s in sessions if s.session_id]
    if not opened:
        return Check(name, "skipped", "no session was opened")
    return Check(
        name, "pass", f"{len(opened)} sessions opened, {sum(bool(s.closed) for s in sessions)} closed"
    )


def _reuse(sessions: list[SessionResult], settings: ProbeSettings) -> Check:
    name = "reuse in sessions"
    if _sent_no_session(settings):
        return Check(name, "skipped", "the rounds carried no SessionId: see stateful sessions")
    judged = [s.sticky for s in sessions if s.sticky is not None]
    if not judged:
        return Check(name, "skipped", "no warm round reported cached tokens")
    if all(judged):
        return Check(name, "pass", "every warm round reused its session's history")
    return Check(
        name,
        "fail",
        f"{judged.count(False)} of {len(judged)} sessions reused under half the ideal",
        "check that requests carry SessionId (X-Amzn-SageMaker-Session-Id; custom headers are "
        "stripped) and that the engine caches prefixes",
        "session_reuse_lost",
    )


def _warm(sessions: Sequence[SessionResult]) -> list[RoundResult]:
    """The warm rounds that say how much they reused: answered, cached tokens reported, something to reuse."""
    return [
        r
        for s in sessions
        for r in s.rounds[1:]
        if r.ok and r.cached_tokens is not None and r.ideal_cached_tokens
    ]


def _whole_reuse(sessions: Sequence[SessionResult]) -> bool:
    """Did every warm round reuse all a pinned instance would hold (and was there one)?"""
    warm = _warm(sessions)
    return bool(warm) and all(r.cached_tokens >= r.ideal_cached_tokens for r in warm)


def _reuse_under_load(under_load: Sequence[SessionResult], settings: ProbeSettings) -> Check:
    """Does reuse hold with LOAD_SESSIONS at once as it did one at a time? Without a SessionId, routing
    places every request; PREFIX_AWARE sends one whose instance is at ConcurrencyThreshold elsewhere."""
    name = "reuse under load"
    if not under_load:
        return Check(
            name, "skipped", "not run: one at a time, the warm rounds did not reuse their whole history"
        )
    warm = _warm(under_load)
    short = [r for r in warm if r.cached_tokens < r.ideal_cached_tokens]
    if not warm:
        return Check(
            name, "skipped", f"{len(under_load)} sessions at once: no warm round reported cached tokens"
        )
    if not short:
        return Check(
            name,
            "pass",
            f"{len(under_load)} sessions at once: all {len(warm)} warm rounds reused their whole history",
        )
    worst = min(short, key=lambda r: r.cached_tokens / r.ideal_cached_tokens)
    evidence = (
        f"one at a time every warm round reused its whole history; with {len(under_load)} sessions at once "
        f"{len(short)} of {len(warm)} warm rounds reused less (at worst {worst.cached_tokens} of "
        f"{worst.ideal_cached_tokens} tokens)"
    )
    if not _sent_no_session(settings):
        return Check(
            name,
            "warn",
            f"{evidence}, in stateful sessions, which stay on their instance: the engine evicted blocks",
            "give the engine more KV cache, or the endpoint more instances for this load",
        )
    return Check(
        name,
        "fail",
        f"{evidence}, without a SessionId: the endpoint's routing placed them by load (PREFIX_AWARE sends a "
        "request whose instance holds ConcurrencyThreshold requests in flight to the least loaded one)",
        "raise ConcurrencyThreshold in the production variant's RoutingConfig.PrefixAwareRoutingConfig above "
        "the requests an instance holds at peak, or use stateful sessions (SessionId), which stay on their "
        "instance under any load",
        "prefix_aware_overflow",
    )
