"""The sagemaker target's settings, config and command line, its report, the experiment and the doctor."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import EventStreamError
from sagemaker_kit import Scripted, closed, converse, opened, parts, refused, round_events, settings, streamed

from kvwatch.cli.main import main
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources
from kvwatch.collectors.probe.lifecycle import life_of
from kvwatch.collectors.probe.records import ERROR_KINDS
from kvwatch.collectors.probe.report import HINTS, format_report, session_json
from kvwatch.collectors.probe.targets import KINDS, target_problem
from kvwatch.collectors.probe.targets.sagemaker import EndpointProblem, Runtime, SageMakerEndpoint
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.doctor.sagemaker import diagnosis_of
from kvwatch.experiment.runner import run_experiment

# Settings and config.


def test_every_error_kind_has_a_hint_and_both_kinds_are_registered():
    assert set(HINTS) == set(ERROR_KINDS)
    assert list(KINDS) == ["openai", "sagemaker"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"endpoint_name": "bad_name"}, 'endpoint_name: "bad_name" is no SageMaker endpoint name'),
        ({"region": "Virginia"}, 'region: "Virginia" is no AWS region name (e.g. us-east-1)'),
        ({"endpoint_url": "ftp://x"}, 'endpoint_url: "ftp://x" is no http(s) URL'),
        ({"variant": " "}, "variant: must not be blank"),
    ],
)
def test_an_endpoint_that_cannot_work_is_refused_naming_the_key(changes, message):
    with pytest.raises(EndpointProblem) as refused_endpoint:
        SageMakerEndpoint(**{"endpoint_name": "e", "region": "us-east-1", **changes})
    assert str(refused_endpoint.value).startswith(message)


def test_settings_of_a_kind_without_its_endpoint_are_refused():
    with pytest.raises(ValueError, match='unknown target kind "bedrock"; known: openai, sagemaker'):
        settings(kind="bedrock")
    with pytest.raises(ValueError, match="a sagemaker target needs its endpoint"):
        settings(sagemaker=None)
    assert target_problem("openai", "", "m", None) == ("base_url", "required key is missing")


TARGET = "targets:\n  - name: sm\n    model: m\n"
SAGEMAKER = "    kind: sagemaker\n"
ENDPOINT_YAML = "    sagemaker: {endpoint_name: e, region: us-east-1}\n"
CONFIG_ERRORS = {
    "unknown-kind": (
        "    kind: bedrock\n    base_url: http://x\n",
        'targets[0].kind: unknown target kind "bedrock"; known: openai, sagemaker',
    ),
    "no-endpoint": (SAGEMAKER, "targets[0].sagemaker: required for kind sagemaker (endpoint_name, region)"),
    "base-url-too": (
        SAGEMAKER + "    base_url: http://x\n" + ENDPOINT_YAML,
        "targets[0].base_url: a sagemaker target's URL is its endpoint's: set sagemaker.endpoint_url",
    ),
    "endpoint-on-openai": (
        "    base_url: http://x\n" + ENDPOINT_YAML,
        "targets[0].sagemaker: only for kind sagemaker, not openai",
    ),
    "no-region": (
        SAGEMAKER + "    sagemaker: {endpoint_name: e}\n",
        "targets[0].sagemaker.region: required key is missing",
    ),
    "bad-region": (
        SAGEMAKER + "    sagemaker: {endpoint_name: e, region: moon-1}\n",
        'targets[0].sagemaker.region: "moon-1" is no AWS region name',
    ),
    "a-secret": (
        SAGEMAKER + "    sagemaker: {endpoint_name: e, region: us-east-1, secret_key: x}\n",
        "targets[0].sagemaker.secret_key: unknown key",
    ),
}


@pytest.mark.parametrize("target, message", CONFIG_ERRORS.values(), ids=CONFIG_ERRORS.keys())
def test_config_errors_of_sagemaker_targets_name_the_key(tmp_path, target, message):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(TARGET + target)
    with pytest.raises(ConfigError) as refused_config:
        load_config(path)
    assert str(refused_config.value).startswith(f"error in {path}: {message}")


def test_a_sagemaker_target_loads_with_its_endpoint(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    endpoint = "{endpoint_name: e, region: eu-west-1, variant: blue, endpoint_url: 'http://127.0.0.1:8080'}"
    path.write_text(f"{TARGET}    kind: sagemaker\n    sagemaker: {endpoint}\n")
    (target,) = load_config(path).targets
    assert (target.kind, target.base_url) == ("sagemaker", "http://127.0.0.1:8080")
    assert target.sagemaker == SageMakerEndpoint(
        "e", "eu-west-1", variant="blue", endpoint_url="http://127.0.0.1:8080"
    )


REGION = ["--region", "us-east-1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sagemaker-endpoint", "e", "--model", "m"], "--sagemaker-endpoint needs --region"),
        (["--sagemaker-endpoint", "e", *REGION], "--sagemaker-endpoint needs --model"),
        (["--sagemaker-endpoint", "e_1", *REGION, "--model", "m"], '--sagemaker-endpoint: "e_1" is no'),
        (
            ["--base-url", "http://127.0.0.1:9", "--model", "m", *REGION],
            "--region is for a --sagemaker-endpoint",
        ),
    ],
)
def test_cli_probe_refuses_an_incomplete_sagemaker_endpoint(capsys, args, message):
    assert main(["probe", *args]) == 2
    assert message in capsys.readouterr().err


def expiring_after_round_1(*later_rounds):
    """Answers of an endpoint whose session expired after round 1: refused, opened anew, then the rounds."""
    return (
        opened("s-1", "2000-01-01T00:00:00Z"),
        streamed(round_events(300, 0)),
        refused(400, "ValidationError", "session not found: s-1"),
        opened("s-2"),
        *(streamed(events) for events in later_rounds),
        closed("s-2"),
    )


def test_the_report_names_the_endpoint_the_evidence_and_the_sessions_lost_and_closed():
    scripted = Scripted(*expiring_after_round_1(round_events(600, 0), round_events(900, 512)))
    endpoint = SageMakerEndpoint(
        "chat-endpoint", "us-east-1", variant="blue", endpoint_url="http://127.0.0.1:9"
    )
    session = converse(scripted, sagemaker=endpoint, block_size=128)
    report = format_report(settings(sagemaker=endpoint), [session], BlockSize(128, "--block-size"))
    lines = report.splitlines()
    assert lines[0] == (
        "1 sessions through SageMaker endpoint chat-endpoint (region us-east-1, variant blue) at "
        "http://127.0.0.1:9, model m, stateful sessions"
    )
    assert lines[-7].split()[:5] == ["session", "stickiness", "evidence", "rounds", "ok"]
    assert lines[-6].split()[:5] == ["1", "sticky", "reuse", "3", "yes"]
    assert lines[-2:] == [
        "Sessions lost and opened anew before a round: expired x1 (those rounds count as cold).",
        "Sessions closed at the end: 1 of 1.",
    ]
    shown = session_json(session)
    assert (shown["evidence"], shown["closed"], shown["session_losses"]) == (
        "reuse",
        True,
        [{"round": 2, "kind": "expired"}],
    )


def test_an_idle_past_the_ttl_reports_the_expiry_the_cold_round_and_the_re_pin(monkeypatch):
    """Idled after round 1: the endpoint refuses the expired session, round 2 runs in a new one and pays
    a full prefill, round 3 reuses round 2's history: the article's expectation holds."""
    slept = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("kvwatch.collectors.probe.conversation.asyncio.sleep", sleep)
    scripted = Scripted(*expiring_after_round_1(round_events(600, 0), round_events(900, 512)))
    session = converse(scripted, block_size=128, idle_after_round=1, idle_seconds=7)
    life = life_of(session)
    assert slept == [7] and session.idle == (1, 7)
    assert (life.expiry, life.cold, life.new_replica, life.repinned, life.as_expected) == (
        "expired",
        True,
        None,
        True,
        True,
    )
    report = format_report(settings(), [session], BlockSize(128, "--block-size"))
    assert report.splitlines()[-1] == (
        "Session 1 idled 7 s after round 1: the route said expired; round 2 cold (a full prefill); "
        "then re-pinned: as expected."
    )
    assert session_json(session)["life"]["as_expected"] is True


def test_a_session_that_outlives_its_idle_is_warm_and_not_as_the_article_expects():
    rounds = [round_events(300, 0), round_events(600, 256), round_events(900, 512)]
    scripted = Scripted(opened("s-1"), *(streamed(r) for r in rounds), closed("s-1"))
    life = life_of(converse(scripted, block_size=128, idle_after_round=1, idle_seconds=0.01))
    assert (life.expiry, life.cold, life.repinned, life.as_expected) == (None, False, True, False)


def not_found_on_close():
    return refused(
        424,
        "ModelError",
        "Received client error (424) from primary",
        OriginalStatusCode=424,
        OriginalMessage='{"detail": "Failed to close session: session not found: s-1"}',
    )


@pytest.mark.parametrize(
    "second_close, gone",
    [(not_found_on_close(), True), (closed("s-1"), False)],
    ids=["gone", "left-alive"],
)
def test_a_checked_close_says_whether_the_session_is_gone(second_close, gone):
    scripted = Scripted(opened("s-1"), streamed(round_events(300, 0)), closed("s-1"), second_close)
    session = converse(scripted, Conversation("s", ("one",)), check_close=True)
    assert (session.closed, session.close_gone) == (True, gone)
    assert [sent for _, sent in scripted.session_ids()][-2:] == ["s-1", "s-1"]
    line = format_report(settings(), [session], BlockSize(128, "--block-size")).splitlines()[-1]
    assert line == (
        "Closed sessions gone afterwards: 1 of 1."
        if gone
        else "Closed sessions gone afterwards: 0 of 1; 1 left ALIVE by their close."
    )


class SessionFront(Scripted):
    """An endpoint whose instance keeps each session's history: a round in a session reuses all of its
    previous prompt and answer (in 128-token blocks), a round without one reuses nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, int] = {}

    def _answer(self, model, params, **_) -> tuple[AWSResponse, dict]:
        headers, body = params["headers"], json.loads(params["body"])
        session_id = headers.get("X-Amzn-SageMaker-Session-Id")
        self.requests.append((model.name, headers, params["body"]))
        if model.name == "InvokeEndpoint":
            if body == {"requestType": "NEW_SESSION"}:
                return self._respond(opened(f"s-{len(self.requests)}"))
            return self._respond(closed(session_id))
        prompt = 1000 * sum(m["role"] == "user" for m in body["messages"])
        cached = self.held.get(session_id, 0) // 128 * 128 if session_id else 0
        if session_id:
            self.held[session_id] = prompt + 2
        return self._respond(streamed(round_events(prompt, cached)))

    def _respond(self, answer) -> tuple[AWSResponse, dict]:
        status, parsed = answer()
        parsed.setdefault("ResponseMetadata", {}).setdefault("HTTPStatusCode", status)
        return AWSResponse(None, status, {}, None), parsed


def test_the_experiment_sets_an_endpoint_without_sessions_against_the_same_with_sessions(
    monkeypatch, tmp_path
):
    front = SessionFront()
    monkeypatch.setattr(Runtime, "for_settings", classmethod(lambda cls, _: cls(front.client, threads=2)))
    routes = [
        settings(target=label, route_mode=label, session_mode=mode)
        for label, mode in (("a", "none"), ("b", "client"))
    ]
    conversations = [Conversation(f"system {n}", ("one", "two", "three")) for n in range(2)]
    sources = BlockSizeSources(override=BlockSize(128, "--block-size"))
    experiment = run_experiment(*routes, conversations, block_sources=sources)
    without, with_sessions = experiment.sessions
    assert all(s.ok and s.sticky is False and s.evidence == "reuse" for s in without)
    assert all(s.ok and s.sticky is True and s.closed for s in with_sessions)
    assert [r.cached_tokens for r in with_sessions[0].rounds] == [0, 896, 1920]
    opened_ids = [
        h.get("X-Amzn-SageMaker-Session-Id") for name, h, _ in front.requests if name == "InvokeEndpoint"
    ]
    assert opened_ids.count("NEW_SESSION") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sagemaker-endpoint", "e", *REGION, "--model", "m", "--a", "http://x"], "leave out --a and --b"),
        (["--a", "http://127.0.0.1:9"], "name both routes with --a and --b, or a --sagemaker-endpoint"),
        (["--sagemaker-endpoint", "e", "--model", "m"], "--sagemaker-endpoint needs --region"),
    ],
)
def test_cli_experiment_takes_two_routes_or_one_sagemaker_endpoint(capsys, tmp_path, args, message):
    assert main(["experiment", *args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


# The doctor on an endpoint.


def doctor_of(*answers, conversations: int = 1, **changes):
    sessions = [converse(Scripted(*answers), **changes) for _ in range(conversations)]
    changes.pop("conversation", None)
    return diagnosis_of(sessions, settings(**changes))


def test_the_doctor_names_stateful_sessions_not_enabled_with_its_fix():
    refusal = refused(
        424, "ModelError", "Received client error (400)",
        OriginalStatusCode=400, OriginalMessage="Invalid payload. stateful sessions not enabled",
    )  # fmt: skip
    diagnosis = doctor_of(refusal)
    assert diagnosis.causes == ["stateful_sessions_disabled"]
    (check,) = [c for c in diagnosis.checks if c.name == "stateful sessions"]
    assert "stateful sessions not enabled" in check.evidence
    assert check.fix == "start the container with SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true"


def test_the_doctor_names_sessions_expiring_between_rounds_and_a_healthy_endpoint_passes():
    expiring = doctor_of(
        *expiring_after_round_1(round_events(600, 0)), conversation=Conversation("s", ("a", "b"))
    )
    assert expiring.causes == ["sessions_expire_between_rounds"]
    rounds = [round_events(300, 0), round_events(600, 256), round_events(900, 512)]
    healthy = doctor_of(opened("s-1"), *(streamed(r) for r in rounds), closed("s-1"), block_size=128)
    assert [(c.name, c.status) for c in healthy.checks] == [
        ("reachability", "pass"),
        ("AWS credentials", "pass"),
        ("stateful sessions", "pass"),
        ("reuse in sessions", "pass"),
        ("reuse under load", "skipped"),
    ]


def test_the_doctor_names_lost_reuse_and_a_model_stream_error():
    rounds = [round_events(300, 0), round_events(600, 0), round_events(900, 0)]
    lost = doctor_of(opened("s-1"), *(streamed(r) for r in rounds), closed("s-1"), block_size=128)
    assert lost.causes == ["session_reuse_lost"]

    def broken() -> Iterator[dict]:
        yield from parts(b"data: ")
        raise EventStreamError({"Error": {"Code": "ModelStreamError", "Message": "timed out"}}, "op")

    assert doctor_of(opened("s-1"), streamed(broken), closed("s-1")).causes == ["model_stream_error"]


def test_cli_doctor_takes_a_sagemaker_endpoint_and_refuses_an_incomplete_one(capsys):
    assert main(["doctor", "--sagemaker-endpoint", "e", "--model", "m"]) == 2
    assert "--sagemaker-endpoint needs --region" in capsys.readouterr().err
