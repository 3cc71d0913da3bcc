"""SageMaker stateful sessions as a container holds them: the simulated replica's copy of AWS's
`model-hosting-container-standards` session manager, which real vLLM runs on `/invocations`
(tests/integration/test_sagemaker_contract.py holds the two to the same answers).

With SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true a body of exactly {"requestType": "NEW_SESSION"} opens a
session for SAGEMAKER_SESSIONS_EXPIRATION seconds (1,200 by default) and {"requestType": "CLOSE"} with
the session header closes it. As there, an expired session is dropped when a request names it, and that
request is served as one without a session; the next gets "session not found".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus

from kvwatch.core.errors import KVWatchError

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_SESSION = "NEW_SESSION"
CLOSE = "CLOSE"
ENABLE_VARIABLE = "SAGEMAKER_ENABLE_STATEFUL_SESSIONS"
EXPIRATION_VARIABLE = "SAGEMAKER_SESSIONS_EXPIRATION"
DEFAULT_EXPIRATION_S = 1200
DISABLED = "Invalid payload. stateful sessions not enabled"
HEADER_NOT_SUPPORTED = f"{DISABLED}, {SESSION_HEADER} header not supported"


class SessionError(KVWatchError):
    """An answer the session manager gives instead of the model's: its status and detail."""

    def __init__(self, status: HTTPStatus, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class SessionAnswer:
    """The container's own answer to an open or a close."""

    text: str
    headers: dict[str, str]


@dataclass
class SessionTable:
    """The open sessions of one container and when each expires (wall time)."""

    expiration_s: float = DEFAULT_EXPIRATION_S
    clock: Callable[[], float] = time.time
    expiries: dict[str, float] = field(default_factory=dict)

    def create(self) -> SessionAnswer:
        now = self.clock()
        for session_id, expiry in list(self.expiries.items()):  # as the original cleans up on create
            if now > expiry:
                del self.expiries[session_id]
        session_id = str(uuid.uuid4())
        self.expiries[session_id] = now + self.expiration_s
        expires = datetime.fromtimestamp(now + self.expiration_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return SessionAnswer(
            f"Session {session_id} created", {NEW_SESSION_HEADER: f"{session_id}; Expires={expires}"}
        )

    def check(self, session_id: str | None) -> None:
        """Raise for an unknown session; drop an expired one, which the request then goes without."""
        if session_id is None or session_id == NEW_SESSION or not session_id:
            return
        if session_id not in self.expiries:
            raise SessionError(HTTPStatus.BAD_REQUEST, f"Bad request: session not found: {session_id}")
        if self.clock() > self.expiries[session_id]:
            del self.expiries[session_id]

    def close(self, session_id: str | None) -> SessionAnswer:
        if not session_id or session_id not in self.expiries:
            reason = (
                f"invalid session_id: {session_id}" if not session_id else f"session not found: {session_id}"
            )
            raise SessionError(HTTPStatus.FAILED_DEPENDENCY, f"Failed to close session: {reason}")
        del self.expiries[session_id]
        return SessionAnswer(f"Session {session_id} closed", {CLOSED_SESSION_HEADER: session_id})

    def expire_all(self) -> int:
        """The lab's fault: every open session's time is up now. Returns how many there were."""
        now = self.clock()
        for session_id in self.expiries:
            self.expiries[session_id] = min(self.expiries[session_id], now - 1)
        return len(self.expiries)


def table_from_environment(environ: Mapping[str, str]) -> SessionTable | None:
    """The container's table when SAGEMAKER_ENABLE_STATEFUL_SESSIONS is true, else None (sessions off)."""
    if environ.get(ENABLE_VARIABLE, "").strip().lower() not in ("true", "1"):
        return None
    return SessionTable(float(environ.get(EXPIRATION_VARIABLE, DEFAULT_EXPIRATION_S)))


def session_request(raw: bytes) -> str | None:
    """NEW_SESSION or CLOSE for a session request, None for any other body; raises for a malformed one."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise SessionError(HTTPStatus.BAD_REQUEST, f"JSON decode error: {error}") from error
    if not isinstance(body, dict) or "requestType" not in body:
        return None
    problems = [
        {"type": "extra_forbidden", "loc": [name], "msg": "Extra inputs are not permitted"}
        for name in body
        if name != "requestType"
    ]
    if body["requestType"] not in (NEW_SESSION, CLOSE):
        problems.insert(
            0, {"type": "enum", "loc": ["requestType"], "msg": "Input should be 'NEW_SESSION' or 'CLOSE'"}
        )
    if problems:
        raise SessionError(HTTPStatus.BAD_REQUEST, json.dumps(problems))
    return body["requestType"]


def intercept(table: SessionTable | None, raw: bytes, session_id: str | None) -> SessionAnswer | None:
    """The container's answer to a session request; None when the request goes on to the model.
    Raises SessionError where the session manager refuses the request."""
    request_type = session_request(raw)
    if request_type is None:
        if session_id is not None and table is None:
            raise SessionError(HTTPStatus.BAD_REQUEST, HEADER_NOT_SUPPORTED)
        if table is not None:
            table.check(session_id)
        return None
    if table is None:
        raise SessionError(HTTPStatus.BAD_REQUEST, DISABLED)
    if request_type == NEW_SESSION:
        return table.create()
    table.check(session_id)
    return table.close(session_id)
