"""The sagemaker target kind: an Amazon SageMaker endpoint through its runtime API, as botocore speaks it
(SigV4, the standard AWS credential chain, the event-stream decoding and its CRC32 checks).

A conversation opens a stateful session with `InvokeEndpoint` (`SessionId=NEW_SESSION`, body exactly
`{"requestType": "NEW_SESSION"}`; not a round, so not timed), keeps the id and its `Expires`, streams its
rounds with `InvokeEndpointWithResponseStream` and that `SessionId`, and closes with
`{"requestType": "CLOSE"}`. Each `PayloadPart` carries a piece of the container's SSE text (an SSE line
may span two parts): it is read line by line as the OpenAI path reads its stream, so the TTFT is the
first generated token's part. A session the endpoint no longer knows (a 400 naming it, or a
`ClosedSessionId` on a round) is counted by kind, and a new one is opened for the round. SageMaker names
no instance: a round names its replica only when the container says so in its custom attributes
(`replica=...`); otherwise stickiness is judged by reuse. Session mode "none" sends no `SessionId`; a
session header other than SessionId's (`X-Amzn-SageMaker-Session-Id`) sends each conversation's id in that
custom header instead, as an application configured so would, which SageMaker strips.

botocore is synchronous: each call runs on the client's own threads, and the round's clock is read there,
from just before the call to the part that completed each line.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Hashable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

from kvwatch.collectors.probe.conversation import SessionClose, session_marker
from kvwatch.collectors.probe.records import RoundResult
from kvwatch.collectors.probe.session import (
    MAX_BODY_BYTES,
    ProbeSettings,
    Reply,
    RoundFailure,
    SseLines,
    chat_body,
    read_sse_line,
    round_result,
    status_failure,
    unforeseen,
)
from kvwatch.core.connections import connect_reason, url_problem
from kvwatch.core.errors import KVWatchError
from kvwatch.core.redaction import redact

NEW_SESSION = "NEW_SESSION"
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"  # how botocore sends SessionId
# What a round opening a session says when the endpoint answered without a session id (the doctor reads it).
NO_NEW_SESSION = "the open answered no X-Amzn-SageMaker-New-Session-Id"
OPEN_BODY = json.dumps({"requestType": "NEW_SESSION"}).encode()  # exactly this: the container refuses more
CLOSE_BODY = json.dumps({"requestType": "CLOSE"}).encode()
CLOSED_SESSION_HEADER = "x-amzn-sagemaker-closed-session-id"  # botocore lowercases HTTPHeaders
# Keys of the custom attributes (`key=value`, comma- or semicolon-separated) that name the replica.
REPLICA_ATTRIBUTES = ("replica", "instance", "instance_id", "backend", "hostname")
MAX_THREADS = 16  # as many rounds in flight as `kvwatch serve` runs at most (MAX_CONCURRENT_SESSIONS)
# The service model's patterns: an endpoint name, a session id; a region as AWS names them.
_ENDPOINT_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]+")
_EXPIRES = re.compile(r"Expires\s*=\s*([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})Z", re.I)
# How a container or SageMaker words a refusal of a session it does not know.
_SESSION_GONE = re.compile(r"session\b.{0,40}\b(not found|expired|closed|unknown|does not exist)", re.I)


class EndpointProblem(KVWatchError, ValueError):
    """A SageMaker endpoint setting that cannot work, at `where` (a key of SageMakerEndpoint)."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


@dataclass(frozen=True)
class SageMakerEndpoint:
    """Which endpoint a sagemaker target probes. Credentials are not here: botocore finds them in the
    standard chain (AWS_ACCESS_KEY_ID..., the shared files, `profile`, an instance role)."""

    endpoint_name: str
    region: str
    variant: str | None = None  # TargetVariant: one production variant of the endpoint
    inference_component: str | None = None  # InferenceComponentName
    endpoint_url: str | None = None  # another runtime URL (a VPC endpoint, the lab's front)
    profile: str | None = None  # a profile of the shared AWS files; None: the default chain

    def __post_init__(self) -> None:
        if not _ENDPOINT_NAME.fullmatch(self.endpoint_name):
            raise EndpointProblem("endpoint_name", f'"{self.endpoint_name}" is no SageMaker endpoint name')
        if not _REGION.fullmatch(self.region):
            raise EndpointProblem("region", f'"{self.region}" is no AWS region name (e.g. us-east-1)')
        if self.endpoint_url is not None:
            shown = redact(self.endpoint_url)
            problem = url_problem(self.endpoint_url)
            if not self.endpoint_url.startswith(("http://", "https://")) or problem:
                raise EndpointProblem(
                    "endpoint_url", f'"{shown}" is no http(s) URL: {problem or "no scheme"}'
                )
        for name in ("variant", "inference_component", "profile"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise EndpointProblem(name, "must not be blank")

    @property
    def base_url(self) -> str:
        """Where the runtime API answers: endpoint_url, or the region's public endpoint."""
        return self.endpoint_url or f"https://runtime.sagemaker.{self.region}.amazonaws.com"


class Runtime:
    """A botocore sagemaker-runtime client and the threads its blocking calls run on."""

    def __init__(self, client: object, threads: int = MAX_THREADS) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvwatch-sagemaker")
        self._extra = threading.local()  # headers the API does not define, for the thread's next call
        client.meta.events.register("before-sign.sagemaker-runtime.*", self._add_headers)

    def _add_headers(self, request, **_) -> None:
        for name, value in (getattr(self._extra, "headers", None) or {}).items():
            request.headers[name] = value

    def invoke(self, operation, headers: dict[str, str], **params) -> dict:
        """`operation(**params)` sent with `headers` besides the API's own, in the calling thread."""
        self._extra.headers = headers
        try:
            return operation(**params)
        finally:
            self._extra.headers = None

    @classmethod
    def for_settings(cls, settings: ProbeSettings) -> Runtime:
        """botocore's client for the endpoint: no retries (a retry would hide the failure and time two
        requests as one), the round's timeout on connecting and on every read."""
        import botocore.config
        import botocore.session

        endpoint = settings.sagemaker
        config = botocore.config.Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=settings.timeout_seconds,
            read_timeout=settings.timeout_seconds,
            max_pool_connections=MAX_THREADS,
            user_agent_extra="kvwatch",
        )
        try:
            session = botocore.session.Session(profile=endpoint.profile)
            client = session.create_client(
                "sagemaker-runtime",
                region_name=endpoint.region,
                endpoint_url=endpoint.endpoint_url,
                config=config,
            )
        except Exception as error:  # noqa: BLE001 - a profile that is not there, a bad setting: the run's error
            raise RoundFailure(*failure_of(error, Reply())) from error
        return cls(client)

    async def call(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(function, *args))

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a round in flight ends at its deadline
        self.client.close()


class SageMakerKind:
    name = "sagemaker"
    serves_metrics = False  # the runtime API serves no engine metrics
    session_header = SESSION_HEADER

    def client_key(self, settings: ProbeSettings) -> Hashable:
        endpoint = settings.sagemaker
        return endpoint.region, endpoint.endpoint_url, endpoint.profile, settings.timeout_seconds

    def client(self, settings: ProbeSettings) -> Runtime:
        return Runtime.for_settings(settings)

    def exchange(self, client: Runtime, settings: ProbeSettings) -> SageMakerExchange:
        return SageMakerExchange(client, settings)


KIND = SageMakerKind()


class _Lost(KVWatchError):
    """The endpoint no longer knows the round's session: `kind` is one of records.SESSION_LOSS_KINDS."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class SageMakerExchange:
    """One conversation on a SageMaker endpoint: its stateful session opened before round 1, opened anew
    after a loss, and closed at the end."""

    def __init__(self, runtime: Runtime, settings: ProbeSettings) -> None:
        self.runtime, self.settings = runtime, settings
        self.session_id: str | None = None
        # Judged by reuse (no round names its instance): its cached tokens must be its own history alone.
        self.opening = session_marker() if settings.marked_sessions else ""
        self.expires_at: float | None = None  # unix seconds, from the open's Expires
        self.opened = 0
        # A session header other than SessionId's: the conversation's id goes in it, as an application
        # would send it, and no stateful session is opened (SageMaker strips the header: the doctor says so).
        custom = custom_session_header(settings)
        self._custom = {custom: str(uuid.uuid4())} if custom and settings.session_mode != "none" else {}
        self._sessions = settings.session_mode != "none" and not custom
        self._lost: str | None = None  # how the session was lost after the last round (closed by the route)
        self._losses: list[tuple[int, str]] = []

    async def round(
        self, number: int, messages: list[dict], previous: RoundResult | None, last: bool = False
    ) -> tuple[RoundResult, str]:
        """The round, in the session (opened first when there is none); once more in a new session when
        the endpoint no longer knows it. A round after a loss is cold: its ideal cached tokens are 0.
        `last` changes nothing: a SageMaker session ends with its own CLOSE (`close`)."""
        if self._lost is not None:
            self._losses.append((number, self._lost))
            self._lost, self.session_id, previous = None, None, None
        if self._sessions and self.session_id is None and (failed := await self._open(number)):
            return failed
        try:
            return await self.runtime.call(self._stream_round, number, messages, previous, self.session_id)
        except _Lost as lost:
            self._losses.append((number, lost.kind))
            self.session_id = None
        if failed := await self._open(number):
            return failed
        return await self.runtime.call(self._stream_round, number, messages, None, self.session_id, False)

    async def close(self) -> SessionClose:
        closed, gone = None, None
        if self.session_id is not None:
            closed = await self.runtime.call(self._close)
            if closed and self.settings.check_close:
                gone = await self.runtime.call(self._gone)
        return SessionClose(closed, tuple(self._losses), gone)

    def _params(self, body: bytes, session_id: str | None) -> dict:
        endpoint = self.settings.sagemaker
        params = {"EndpointName": endpoint.endpoint_name, "Body": body, "ContentType": "application/json"}
        if endpoint.variant:
            params["TargetVariant"] = endpoint.variant
        if endpoint.inference_component:
            params["InferenceComponentName"] = endpoint.inference_component
        if session_id:
            params["SessionId"] = session_id
        return params

    async def _open(self, number: int) -> tuple[RoundResult, str] | None:
        """Open a session (not timed as a round); None when it opened, else round `number`, failed."""
        reply, started_at = Reply(), time.time()
        try:
            self.session_id, self.expires_at = await self.runtime.call(self._open_session, reply)
            self.opened += 1
            return None
        except Exception as error:  # noqa: BLE001 - every failure becomes the round's error kind
            reply.fail(*failure_of(error, reply))
        result, _ = round_result(self.settings, number, started_at, reply, None, NEW_SESSION, None, None)
        return result, ""

    def _open_session(self, reply: Reply) -> tuple[str, float | None]:
        response = self.runtime.client.invoke_endpoint(**self._params(OPEN_BODY, NEW_SESSION))
        reply.status = response["ResponseMetadata"]["HTTPStatusCode"]
        body = _read(response).decode(errors="replace")
        new = response.get("NewSessionId")
        if not new:
            raise RoundFailure(
                "bad_response",
                f"{NO_NEW_SESSION} (are stateful sessions enabled in the container? "
                f"SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true): {body}",
            )
        return parse_new_session(new)

    def _close(self) -> bool:
        """CLOSE the session: True when the endpoint said it closed this one."""
        try:
            response = self.runtime.client.invoke_endpoint(**self._params(CLOSE_BODY, self.session_id))
            _read(response)
        except Exception:  # noqa: BLE001 - an unclosed session expires by itself; the result says so
            return False
        return response.get("ClosedSessionId") == self.session_id

    def _gone(self) -> bool | None:
        """Is the closed session gone? A second CLOSE must be refused as unknown; one that closes it
        again means the first left it alive. None when the answer says neither."""
        try:
            response = self.runtime.client.invoke_endpoint(**self._params(CLOSE_BODY, self.session_id))
            _read(response)
        except Exception as error:  # noqa: BLE001 - only a refusal naming the session says it is gone
            # The container refuses an unknown session's CLOSE with 424 ("session not found"), not 400.
            return True if _SESSION_GONE.search(_error_text(error)) else None
        return False if response.get("ClosedSessionId") == self.session_id else None

    def _stream_round(
        self,
        number: int,
        messages: list[dict],
        previous: RoundResult | None,
        session_id: str | None,
        may_be_lost: bool = True,
    ) -> tuple[RoundResult, str]:
        """One streamed round, in a thread. Raises _Lost when the endpoint refuses the session and
        `may_be_lost`; every other failure is the round's error kind."""
        settings = self.settings
        params = self._params(chat_body(settings, messages), session_id)  # encoded before the clock
        reply, backend, started_at, body = Reply(), None, time.time(), None
        deadline = time.perf_counter() + settings.timeout_seconds
        try:
            sent_at = time.perf_counter()
            response = self.runtime.invoke(
                self.runtime.client.invoke_endpoint_with_response_stream, self._custom, **params
            )
            reply.status = response["ResponseMetadata"]["HTTPStatusCode"]
            backend = replica_of(response.get("CustomAttributes"))
            headers = response["ResponseMetadata"].get("HTTPHeaders", {})
            if session_id and headers.get(CLOSED_SESSION_HEADER) == session_id:
                self._lost = "closed"
            body = response["Body"]
            read_events(body, settings, reply, sent_at, deadline)
        except Exception as error:  # noqa: BLE001 - every failure becomes the round's error kind
            if may_be_lost and session_id and _names_session(error, session_id):
                raise _Lost(self._loss_kind()) from None
            reply.fail(*failure_of(error, reply))
        finally:
            if body is not None:
                body.close()  # a stream read to its end is back in botocore's pool; one cut short is closed
        # SageMaker echoes no session id: one the endpoint answered 200 to counts as taken, as echoed.
        taken = session_id if reply.status == 200 else None
        sent = session_id or next(iter(self._custom.values()), None)
        return round_result(settings, number, started_at, reply, previous, sent, backend, taken)

    def _loss_kind(self) -> str:
        expired = self.expires_at is not None and time.time() >= self.expires_at
        return "expired" if expired else "not_found"


def _read(response: dict) -> bytes:
    """An answer's body, up to MAX_BODY_BYTES; then closed, so that a longer one's connection is closed
    at once rather than by the garbage collector (one read whole is back in botocore's pool already)."""
    try:
        return response["Body"].read(MAX_BODY_BYTES)
    finally:
        response["Body"].close()


def read_events(
    events: Iterable[dict], settings: ProbeSettings, reply: Reply, sent_at: float, deadline: float
) -> None:
    """Read botocore's parsed events (`{"PayloadPart": {"Bytes": ...}}`) as the container's SSE text into
    `reply`, each line dated by the part that completed it, from `sent_at` (perf_counter). After [DONE]
    the rest is read unseen, so that the connection serves the next round. Raises RoundFailure, or what
    botocore raises (EventStreamError for ModelStreamError / InternalStreamFailure, ChecksumMismatch)."""
    lines, parts = SseLines(), iter(events)
    for event in parts:
        arrived_at = time.perf_counter()
        if arrived_at > deadline:
            raise RoundFailure("timeout", f"no complete answer within {settings.timeout_seconds:g} s")
        data = (event.get("PayloadPart") or {}).get("Bytes")
        if not data:
            continue  # an event kvwatch does not read
        if any(read_sse_line(line, settings, reply, arrived_at - sent_at) for line in lines.feed(data)):
            _drain(parts, deadline)
            return
    rest = lines.rest()
    if rest is not None and read_sse_line(rest, settings, reply, time.perf_counter() - sent_at):
        return
    raise RoundFailure("stream_error", "the event stream ended before [DONE]")


def _drain(parts: Iterator[dict], deadline: float) -> None:
    """What follows [DONE], read unseen until the stream ends or the round's deadline."""
    try:
        for _ in parts:
            if time.perf_counter() > deadline:
                return
    except Exception:  # noqa: BLE001 - the round's answer is complete; its connection is not reused
        return


def custom_session_header(settings: ProbeSettings) -> str | None:
    """The target's session header when it is not SessionId's: a custom one, which SageMaker strips."""
    header = settings.session_header or SESSION_HEADER
    return None if header.lower() == SESSION_HEADER.lower() else header


def parse_new_session(header: str) -> tuple[str, float | None]:
    """`<id>; Expires=YYYY-MM-DDTHH:MM:SSZ` as the id and the expiry in unix seconds (None when the
    header gives none)."""
    session_id = header.split(";", 1)[0].strip()
    if not session_id:
        raise RoundFailure("bad_response", f"X-Amzn-SageMaker-New-Session-Id without an id: {header}")
    expires = _EXPIRES.search(header)
    when = calendar.timegm(time.strptime(expires.group(1), "%Y-%m-%dT%H:%M:%S")) if expires else None
    return session_id, when


def replica_of(custom_attributes: str | None) -> str | None:
    """The replica a container names in its custom attributes (`replica=r1`), or None."""
    for item in re.split(r"[,;]", custom_attributes or ""):
        key, _, value = item.partition("=")
        if key.strip().lower() in REPLICA_ATTRIBUTES and value.strip():
            return value.strip()
    return None


def _error_text(error: Exception) -> str:
    """Everything a botocore error says: its message, and the container's own for a ModelError."""
    answer = getattr(error, "response", None) or {}
    fields = answer.get("Error", {}), answer
    parts = [str(d.get(k)) for d in fields for k in ("Message", "OriginalMessage") if d.get(k)]
    return " ".join(parts) or str(error)


def _names_session(error: Exception, session_id: str) -> bool:
    """A 400 (SageMaker's, or the container's inside a ModelError) refusing the session."""
    answer = getattr(error, "response", None)
    if not isinstance(answer, dict):
        return False
    status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if 400 not in (status, answer.get("OriginalStatusCode")):
        return False
    text = _error_text(error)
    return session_id in text or bool(_SESSION_GONE.search(text))


def failure_of(error: Exception, reply: Reply) -> tuple[str, str]:
    """A round's error kind and detail for what botocore (or the answer's reading) raised."""
    from botocore import eventstream, exceptions

    if isinstance(error, RoundFailure):
        return error.kind, error.detail
    if isinstance(error, exceptions.EventStreamError):  # an error event in the stream
        code = error.response.get("Error", {}).get("Code", "")
        kinds = {"ModelStreamError": "model_stream_error", "InternalStreamFailure": "internal_stream_failure"}
        return kinds.get(code, "stream_error"), f"{code or 'error event'} in the stream: {_error_text(error)}"
    if isinstance(error, eventstream.ChecksumMismatch):
        return "checksum_error", f"event stream: {error}"
    if isinstance(error, eventstream.ParserError | exceptions.ResponseStreamingError):
        return "stream_error", f"event stream: {error}"
    if isinstance(error, exceptions.ClientError):
        return _client_error(error, reply)
    credentials = (exceptions.NoCredentialsError, exceptions.PartialCredentialsError)
    if isinstance(error, credentials + (exceptions.CredentialRetrievalError, exceptions.ProfileNotFound)):
        return "credentials_error", str(error)
    if isinstance(error, exceptions.ReadTimeoutError | exceptions.ConnectTimeoutError):
        return "timeout", str(error)
    if isinstance(error, exceptions.SSLError):
        return "tls_error", str(error)
    if isinstance(error, exceptions.EndpointConnectionError):
        return _connection_failure(error)
    if isinstance(error, exceptions.ProxyConnectionError):  # botocore masks the proxy's credentials
        reason = connect_reason(error.kwargs["error"]) if "error" in error.kwargs else str(error)
        return (
            "connection_refused",
            f"cannot connect to the proxy {error.kwargs.get('proxy_url')} (HTTP(S)_PROXY): {reason}",
        )
    if isinstance(error, exceptions.HTTPClientError):
        return "stream_error" if reply.status == 200 else "http_error", str(error)
    return "internal_error", unforeseen(error)


def _connection_failure(error: Exception) -> tuple[str, str]:
    """botocore's "Could not connect" as the OpenAI path words it: dns_error for a host name that does
    not resolve (a typo in endpoint_url, a region with no such endpoint), else connection_refused, with
    the operating system's reason under urllib3's."""
    cause = error.kwargs.get("error")
    origin = urlsplit(error.kwargs.get("endpoint_url", "")).netloc
    reason = connect_reason(cause) if isinstance(cause, BaseException) else str(error)
    if _unresolved(cause):
        return "dns_error", f"{redact(origin)}: {reason}"
    return "connection_refused", f"cannot connect to {redact(origin)}: {reason}"


def _unresolved(error: BaseException | None) -> bool:
    """Does the chain under `error` hold the resolver's refusal (urllib3 wraps socket.gaierror)?"""
    while error is not None:
        if isinstance(error, socket.gaierror):
            return True
        error = error.__cause__ or error.__context__
    return False


def _client_error(error: Exception, reply: Reply) -> tuple[str, str]:
    """An error status: SageMaker's own (ValidationError 400, 403 for SigV4...) or the container's,
    wrapped in a ModelError (424) with its original status."""
    answer = error.response
    reply.status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = answer.get("Error", {}).get("Code", "")
    text = f"{code}: {_error_text(error)}"
    if code == "ModelError":
        return "model_error", f"the container answered {answer.get('OriginalStatusCode', '?')}: {text}"
    failure = status_failure(reply.status or 0, text)
    return failure.kind, failure.detail
