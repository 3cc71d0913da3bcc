"""kvwatch's one exception tree: every exception kvwatch raises derives from KVWatchError, so that a
caller can tell kvwatch's own failures from bugs. Where a class also derives from a builtin (ValueError,
TimeoutError, OSError), callers that catch the builtin keep catching it."""

from __future__ import annotations


class KVWatchError(Exception):
    """What kvwatch raises on purpose: its message says what went wrong in one line."""


class UpstreamError(KVWatchError):
    """A service kvwatch reads (Prometheus, an engine, the gateway) failed to answer as it should."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """No complete answer, headers and body, within the deadline."""


class Unreachable(UpstreamError):
    """No connection: the message is the operating system's or TLS's reason (core.connections)."""


class UnexpectedAnswer(UpstreamError):
    """An answer that is not what the API gives: no JSON, or JSON of another shape."""


class QueryRefused(UpstreamError):
    """Prometheus answered with an error status: the message is Prometheus' `error`, `error_type` its
    `errorType` (bad_data for PromQL that does not parse, timeout, execution, ...)."""

    def __init__(self, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
