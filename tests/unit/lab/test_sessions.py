"""The simulated container's SageMaker sessions (lab/sessions.py): open, use, expire, close, refuse,
as AWS's model-hosting-container-standards session manager does in real vLLM."""

from __future__ import annotations

import json
from http import HTTPStatus

import pytest

from kvwatch.lab.sessions import SessionError, SessionTable, intercept, table_from_environment

OPEN = json.dumps({"requestType": "NEW_SESSION"}).encode()
CLOSE = json.dumps({"requestType": "CLOSE"}).encode()
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


class Clock:
    def __init__(self):
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def opened(table: SessionTable) -> str:
    answer = intercept(table, OPEN, None)
    return answer.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]


def refusal(table, body: bytes, session_id: str | None) -> tuple[int, str]:
    with pytest.raises(SessionError) as refused:
        intercept(table, body, session_id)
    return refused.value.status, refused.value.detail


def test_an_open_names_the_session_and_its_expiry():
    clock = Clock()
    answer = intercept(SessionTable(60, clock), OPEN, "ignored-on-open")
    session_id, expires = answer.headers["X-Amzn-SageMaker-New-Session-Id"].split("; ")
    assert answer.text == f"Session {session_id} created"
    assert expires == "Expires=2027-01-15T08:01:00Z"


def test_a_chat_in_an_open_session_goes_on_to_the_model_and_a_close_ends_it():
    table = SessionTable(60, Clock())
    session_id = opened(table)
    assert intercept(table, CHAT, session_id) is None
    closed = intercept(table, CLOSE, session_id)
    assert closed.headers == {"X-Amzn-SageMaker-Closed-Session-Id": session_id}
    assert refusal(table, CHAT, session_id) == (
        HTTPStatus.BAD_REQUEST,
        f"Bad request: session not found: {session_id}",
    )
    assert refusal(table, CLOSE, session_id)[1] == f"Bad request: session not found: {session_id}"


def test_an_expired_session_serves_one_more_request_without_it_then_is_unknown():
    clock = Clock()
    table = SessionTable(60, clock)
    session_id = opened(table)
    clock.now += 61
    assert intercept(table, CHAT, session_id) is None
    assert refusal(table, CHAT, session_id)[1] == f"Bad request: session not found: {session_id}"


def test_expire_all_ends_every_open_session_now():
    clock = Clock()
    table = SessionTable(1200, clock)
    sessions = [opened(table) for _ in range(3)]
    assert table.expire_all() == 3
    clock.now += 0.001
    for session_id in sessions:
        assert intercept(table, CHAT, session_id) is None
    assert not table.expiries


def test_closing_an_expired_or_unnamed_session_is_a_failed_dependency():
    clock = Clock()
    table = SessionTable(60, clock)
    session_id = opened(table)
    clock.now += 61
    assert refusal(table, CLOSE, session_id) == (
        HTTPStatus.FAILED_DEPENDENCY,
        f"Failed to close session: session not found: {session_id}",
    )
    assert refusal(table, CLOSE, None) == (
        HTTPStatus.FAILED_DEPENDENCY,
        "Failed to close session: invalid session_id: None",
    )


@pytest.mark.parametrize(
    "body, problems",
    [
        ({"requestType": "NEW_SESSION", "messages": []}, ["extra_forbidden"]),
        ({"requestType": "OPEN"}, ["enum"]),
    ],
)
def test_a_malformed_session_request_lists_its_problems(body, problems):
    status, detail = refusal(SessionTable(), json.dumps(body).encode(), None)
    assert status == HTTPStatus.BAD_REQUEST
    assert [problem["type"] for problem in json.loads(detail)] == problems


def test_a_body_that_is_not_json_is_refused():
    assert refusal(SessionTable(), b"{", None)[1].startswith("JSON decode error: ")


def test_without_the_variable_sessions_are_refused_and_other_requests_served():
    assert table_from_environment({}) is None
    assert refusal(None, OPEN, None) == (
        HTTPStatus.BAD_REQUEST,
        "Invalid payload. stateful sessions not enabled",
    )
    assert refusal(None, CHAT, "s1")[1] == (
        "Invalid payload. stateful sessions not enabled, X-Amzn-SageMaker-Session-Id header not supported"
    )
    assert intercept(None, CHAT, None) is None


def test_the_environment_turns_sessions_on_with_their_expiration():
    table = table_from_environment(
        {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_EXPIRATION": "30"}
    )
    assert table is not None and table.expiration_s == 30
