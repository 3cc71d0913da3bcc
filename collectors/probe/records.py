"""Immutable records of probe sessions: what the probe returns, the store keeps and the exporter exports.

A probe never raises: a failed round is a record with `error_kind` set, and the session stops there.
"""

from __future__ import annotations

from dataclasses import dataclass

# What went wrong in a round, each with its own fix (see the doctor).
ERROR_KINDS = (
    "unauthorized",  # 401: the key is missing, wrong, or not sent as `Authorization: Bearer <key>`
    "forbidden",  # 403: the key is expired or not allowed to use this model
    "not_found",  # 404: wrong model id or base URL
    "connection_refused",  # nothing listens at the base URL (or `localhost` inside a container)
    "dns_error",  # the base URL's host name does not resolve: a typo, or a name of another network
    "timeout",  # no complete answer within the probe's timeout
    "bad_response",  # 200 without `choices`: an error object came back instead of a completion
    "stream_error",  # the SSE stream was malformed, carried an error, or ended before [DONE]
    "http_error",  # any other HTTP status
    "tls_error",  # TLS failed (OpenSSL's reason: a certificate not trusted, a name it does not cover)
    "tls_mismatch",  # https:// to a plain-HTTP server, or http:// to a TLS port
    "protocol_error",  # the answer is not valid HTTP/1.1 (status line, header block, framing, coding)
    "internal_error",  # an exception no code path expected (a bug), recorded instead of lost
    # SageMaker's runtime API (collectors.probe.targets.sagemaker):
    "model_stream_error",  # a ModelStreamError event: the model's stream timed out or broke mid-answer
    "internal_stream_failure",  # an InternalStreamFailure event: SageMaker's stream failed
    "checksum_error",  # an event-stream frame whose CRC32 does not match (botocore's ChecksumMismatch)
    "model_error",  # the container answered an error status (SageMaker's ModelError, HTTP 424)
    "credentials_error",  # no AWS credentials in the standard chain, or the request could not be signed
)
# How a probe session lost its route's session before a round, each followed by a new session:
SESSION_LOSS_KINDS = (
    "expired",  # refused as unknown after the Expires it was opened with
    "not_found",  # refused as unknown before its Expires: closed, or its instance gone
    "closed",  # the route said it closed the session (X-Amzn-SageMaker-Closed-Session-Id) unasked
)
# What a session's stickiness is judged by: the replica each round names, or its cached tokens.
EVIDENCE = ("replica", "reuse", "none")
# Judged by reuse, a warm round that cached less than this share of its ideal landed on another replica.
REUSED_SHARE = 0.5


@dataclass(frozen=True)
class RoundResult:
    """One round of a probe session, as the client saw it."""

    round: int  # 1-based
    started_at: float  # unix seconds
    status: int | None  # HTTP status; None when no response arrived
    error_kind: str | None  # one of ERROR_KINDS, None on success
    error_detail: str | None  # short and redacted: never an API key, at most an excerpt of a body
    ttft_seconds: float | None  # to the first generated token: answer text, reasoning or a tool call
    total_seconds: float | None
    prompt_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None when not reported
    ideal_cached_tokens: int | None  # previous round's prompt + answer, block-aligned; 0 in round 1
    completion_tokens: int | None
    backend: str | None  # the replica that served the round, when a header or JSON field names it
    session_id_sent: str | None
    session_id_returned: str | None  # the X-Session-Id response header
    # To the first answer text (delta.content): later than the TTFT when a model reasons or calls a tool
    # first; None when the answer had no text.
    first_content_seconds: float | None = None
    # What became of the session's pin, as a router reported it in the response (sessionkeys.PIN_OUTCOMES:
    # olla's hit, miss, repin); None when the response does not say.
    pin_outcome: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


@dataclass(frozen=True)
class SessionResult:
    """One multi-turn probe session through one target (route)."""

    target: str
    route_mode: str  # e.g. "affinity", "round_robin"
    session_id: str | None  # the id the session used (client-made or gateway-assigned)
    started_at: float
    finished_at: float
    rounds: tuple[RoundResult, ...]
    # Cut short by `kvwatch serve` stopping: `rounds` are the ones that finished, the round in flight is
    # not among them.
    interrupted: bool = False
    closed: bool | None = None  # a route session closed at the end (SageMaker's CLOSE); None: none to close
    # (round, kind) each time the route's session was gone before a round (SESSION_LOSS_KINDS) and a new
    # one was opened for it: that round could not reuse what the lost session held.
    session_losses: tuple[tuple[int, str], ...] = ()
    # (after round, seconds) when the session idled past the route's TTL mid-conversation (lifecycle)
    idle: tuple[int, float] | None = None
    # After its close, was the session gone (a second close refused as unknown)? None: not checked
    close_gone: bool | None = None

    @property
    def ok(self) -> bool:
        return bool(self.rounds) and all(r.ok for r in self.rounds)

    @property
    def error_kind(self) -> str | None:
        return next((r.error_kind for r in self.rounds if r.error_kind), None)

    @property
    def backends(self) -> tuple[str, ...]:
        """Backends in round order, for rounds whose backend is known."""
        return tuple(r.backend for r in self.rounds if r.ok and r.backend)

    @property
    def backend_switches(self) -> int | None:
        """How often consecutive rounds changed backend; None when the backend is unknown."""
        known = self.backends
        if len(known) < 2:
            return None
        return sum(a != b for a, b in zip(known, known[1:], strict=False))

    @property
    def sticky(self) -> bool | None:
        """Did every round land on one replica? From backends when known, else from cached tokens.

        Without a backend identity, a warm round that reuses less than half of what a pinned replica
        would have cached means it landed elsewhere. None when there is no evidence either way.
        """
        switches = self.backend_switches
        if switches is not None:
            return switches == 0
        warm = self._warm
        return all(map(_reused, warm)) if warm else None

    @property
    def _warm(self) -> tuple[RoundResult, ...]:
        """The rounds reuse judges: rounds 2+ that succeeded, reported their cached tokens and had
        something a pinned replica would have cached."""
        return tuple(
            r for r in self.rounds[1:] if r.ok and r.cached_tokens is not None and r.ideal_cached_tokens
        )

    @property
    def warm_rounds(self) -> int:
        """How many rounds reuse judges (the figures below are theirs)."""
        return len(self._warm)

    @property
    def warm_rounds_reused(self) -> int:
        """Of those, how many cached at least REUSED_SHARE of their ideal: all when sticky by reuse."""
        return sum(map(_reused, self._warm))

    @property
    def warm_cached_tokens(self) -> int | None:
        """What the warm rounds cached, the reuse behind a judgment by it; None without warm rounds."""
        return sum(r.cached_tokens for r in self._warm) if self._warm else None

    @property
    def warm_ideal_cached_tokens(self) -> int | None:
        """What a pinned replica would have cached in the warm rounds; None without warm rounds."""
        return sum(r.ideal_cached_tokens for r in self._warm) if self._warm else None

    @property
    def evidence(self) -> str:
        """What `sticky` is judged by: "replica" when rounds named their replica (SageMaker only when the
        container echoes one in its custom attributes), "reuse" from the warm rounds' cached tokens
        against the ideal, "none" without either."""
        if self.backend_switches is not None:
            return "replica"
        return "none" if self.sticky is None else "reuse"

    @property
    def session_id_echoed(self) -> bool | None:
        """Did the gateway echo the session id on every round that sent one? None when none was sent."""
        sent = [r for r in self.rounds if r.status is not None and r.session_id_sent]
        if not sent:
            return None
        return all(r.session_id_returned == r.session_id_sent for r in sent)


def _reused(warm: RoundResult) -> bool:
    """A warm round reused what a pinned replica would have, or most of it: it stayed on its replica."""
    return warm.cached_tokens >= REUSED_SHARE * warm.ideal_cached_tokens
