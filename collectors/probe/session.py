"""Synthetic multi-turn probe sessions (`kvwatch probe`): per round TTFT, cached tokens and the backend.

A session behaves like a chat client: every round resends the static system prompt, the whole history
(with the answers it actually received) and a new user turn, streamed. A replica that still holds the
conversation's KV cache only prefills the new turn; any other prefills it all, which the round's cached
tokens and TTFT show. A session never raises: a failed round is a RoundResult with an error kind, and
the session stops there. The API key goes into the Authorization header and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import httpx

from kvwatch.collectors import identity, sessionkeys
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.conversation import SessionClose, run_conversation
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.streaming import (
    SPEAKS_TLS,
    ConnectFailed,
    DnsFailed,
    ProtocolError,
    Response,
    StreamBroken,
    StreamClient,
    TlsFailed,
    TlsMismatch,
)
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.core.connections import endpoint_problem, url_problem
from kvwatch.core.credentials import read_secret_file
from kvwatch.core.errors import KVWatchError
from kvwatch.core.redaction import redact, redacted_name

if TYPE_CHECKING:  # the kind's module imports this one
    from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint

SESSION_MODES = ("client", "server", "none")
# What a streamed delta may begin an answer with: its text, a reasoning model's thinking (vLLM and
# SGLang's reasoning parsers; `reasoning` is the newer name), or a tool call.
GENERATED_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")

# What one round may receive; beyond it the round fails as stream_error, before memory runs out.
MAX_LINE_BYTES = 1 << 20  # a streamed chunk is a few hundred bytes; more is a body that is no stream
MAX_STREAM_LINES = 100_000  # two per token: answers of up to 50,000 tokens
MAX_ANSWER_BYTES = 1 << 20  # of content: a probe's answer is a few dozen tokens
MAX_BODY_BYTES = 64 << 10  # of a non-streamed answer: enough for any error object
# How long the end of a response may follow its [DONE]: read, it lets the connection serve the next round.
END_GRACE_SECONDS = 1.0
# Usage counts are exact integers below this: a float (Prometheus) holds them exactly, SQLite stores them.
MAX_TOKEN_COUNT = 1 << 53
USAGE_FIELDS = {
    "prompt_tokens": "usage.prompt_tokens",
    "completion_tokens": "usage.completion_tokens",
    "cached_tokens": "usage.prompt_tokens_details.cached_tokens",
}
EXCERPT_CHARS = 200
STREAM_CUT = "the stream ended before [DONE]"
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_VISIBLE_ASCII = re.compile(r"[!-~]+")  # what may go into a header unquoted

# What servers answer plain HTTP sent to their TLS port with: nginx's 400 page, Go's net/http.
TLS_PORT_ANSWERS = ("plain HTTP request was sent to HTTPS port", "HTTP request to an HTTPS server")


def api_url(base_url: str, path: str) -> str:
    """`path` under an OpenAI-compatible base URL: one ending in /v1 is used as is, any other gets /v1.

    So both https://example.net/api and https://example.net/api/v1 reach https://example.net/api/v1/...
    A query (`?token=...`, for a gateway that takes one) stays at the end, after the path.
    """
    parts = urlsplit(base_url)
    base = parts.path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if path.strip("/"):
        base += f"/{path.lstrip('/')}"
    return urlunsplit(parts._replace(path=base))


def resolve_api_key(env: str | None = None, file: str | Path | None = None) -> str | None:
    """The API key from an environment variable or a file, never from argv; None when neither is named.

    Errors name the variable or the file, never the key: a variable name that does not look like one
    (it may be the key itself, passed by mistake) is not repeated either.
    """
    if env and file:
        raise ValueError("take the API key from an environment variable or from a file, not both")
    if env:
        key = os.environ.get(env, "").strip()
        if not key:
            named = env if _ENV_NAME.fullmatch(env) else "named for the API key (name not shown)"
            raise ValueError(f"environment variable {named} is not set or empty")
        return key
    return read_secret_file(file, "API key") if file else None


@dataclass(frozen=True)
class ProbeSettings:
    """How to probe one route: the three settings every client needs, and how to read the answers."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)  # resolved by the caller; never shown
    target: str = "probe"
    route_mode: str = "unknown"
    # client: a UUID per session; server: adopt the gateway's; none. On sagemaker, client and server both
    # open a stateful session per conversation (the container makes its id), none sends none.
    session_mode: str = "client"
    # e.g. x-smg-routing-key for SMG's manual policy; None: the kind's own (TargetKind.session_header).
    # On sagemaker any other header than SageMaker's carries the session as the application would send
    # it, a custom header SageMaker strips (what the doctor names), instead of a SessionId.
    session_header: str | None = None
    # A router's or client's convention (collectors.sessionkeys.SESSION_KEYS) whose header carries the id
    # unless session_header names one; None: the kind's own.
    session_key: str | None = None
    backend_headers: tuple[str, ...] = identity.DEFAULT_HEADERS
    backend_json_paths: tuple[str, ...] = identity.DEFAULT_JSON_PATHS
    router: str | None = None  # one of identity.ROUTERS: a router that names the replica only when asked
    max_tokens: int = 32  # answer length
    # The KV block the rounds' ideal cached tokens are aligned to as they run; callers that learn the
    # engine's (collectors.blocksize) align them again with `with_block_size`.
    block_size: int = blocksize.DEFAULT_TOKENS
    timeout_seconds: float = 60.0  # per round, over the whole stream
    kind: str = "openai"  # how the rounds reach the route: one of collectors.probe.targets.KINDS
    sagemaker: SageMakerEndpoint | None = None  # the endpoint of a sagemaker target; base_url is its URL
    # sagemaker: each conversation opens with a marker of its own (conversation.session_marker), so that
    # its reuse is its own history; False sends the system prompt all conversations share, as is.
    marked_sessions: bool = True
    # The session's whole life (collectors.probe.lifecycle): idle `idle_seconds` after round
    # `idle_after_round`, past the route's session TTL; and, where the route has a close, check that the
    # closed session is gone.
    idle_after_round: int | None = None
    idle_seconds: float = 0.0
    check_close: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        if problem := url_problem(self.base_url):
            raise ValueError(f"base_url {redact(self.base_url)} is not a valid URL: {problem}")
        if problem := endpoint_problem(self.base_url):
            raise ValueError(f"base_url {redact(self.base_url)} {problem}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.session_mode not in SESSION_MODES:
            raise ValueError(f"session_mode must be one of {', '.join(SESSION_MODES)}")
        identity.request_extras(self.router)  # ValueError for an unknown router
        from kvwatch.collectors.probe.targets import KINDS  # its kinds import this module

        kind = KINDS.lookup(self.kind)  # ValueError naming the kinds
        if self.session_key is not None:
            key = sessionkeys.SESSION_KEYS.lookup(self.session_key)  # ValueError naming the keys
            if self.session_header is None:
                object.__setattr__(self, "session_header", key.header)
        if self.session_header is None:
            object.__setattr__(self, "session_header", kind.session_header)
        if (self.kind == "sagemaker") != (self.sagemaker is not None):
            raise ValueError("a sagemaker target needs its endpoint, and only a sagemaker target has one")
        for name in ("max_tokens", "block_size", "timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.idle_after_round is not None and (self.idle_after_round < 1 or self.idle_seconds <= 0):
            raise ValueError("idle_after_round must be 1 or more, with a positive idle_seconds")
        # Checked here, not left to the HTTP client, whose error message would quote the key.
        for name in ("api_key", "session_header"):
            value = getattr(self, name)
            if value is not None and not _VISIBLE_ASCII.fullmatch(value):
                raise ValueError(f"{name} must be printable ASCII without spaces")


class RoundFailure(KVWatchError):
    """A round that went wrong, with its error kind and a short detail."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


@dataclass
class Reply:
    """What a round received so far; kept when it fails halfway, as status and headers still tell."""

    status: int | None = None
    headers: httpx.Headers = field(default_factory=httpx.Headers)
    answer: list[str] = field(default_factory=list)
    answer_bytes: int = 0
    ttft_seconds: float | None = None
    first_content_seconds: float | None = None
    total_seconds: float | None = None
    usage: dict = field(default_factory=dict)
    json_backend: str | None = None
    error_kind: str | None = None
    error_detail: str | None = None

    def fail(self, kind: str, detail: str) -> None:
        self.error_kind, self.error_detail = kind, detail


class HttpExchange:
    """The OpenAI-compatible path: a session id the client makes (or adopts from the gateway) in a
    header of every round; nothing to open or close."""

    def __init__(self, client: StreamClient, settings: ProbeSettings) -> None:
        self.client, self.settings = client, settings
        # Client mode: the application names the conversation. Server mode: the gateway does, in round 1.
        self.session_id = str(uuid.uuid4()) if settings.session_mode == "client" else None
        # The system prompt as the application sends it: an OpenAI route is judged by the replica its rounds
        # name where the gateway names one, and its A/B counts the system prompt's reuse across sessions.
        self.opening = ""
        # The convention's mark of a session's last round (Dynamo's X-Dynamo-Session-Final), if it has one.
        self._final_header = sessionkeys.final_header(settings.session_header)

    async def round(
        self, number: int, messages: list[dict], previous: RoundResult | None, last: bool = False
    ) -> tuple[RoundResult, str]:
        final = {self._final_header: "true"} if last and self._final_header and self.session_id else {}
        result, answer = await _round(
            self.client, self.settings, number, messages, self.session_id, previous, final
        )
        if result.ok and self.settings.session_mode == "server" and result.session_id_returned:
            self.session_id = result.session_id_returned
        return result, answer

    async def close(self) -> SessionClose:
        return SessionClose()


async def run_session(
    client: StreamClient, settings: ProbeSettings, conversation: Conversation, *options, **named
) -> SessionResult:
    """One conversation through an OpenAI-compatible route: conversation.run_conversation over HTTP, with
    its options (think_seconds, render_system_prompt, on_request, stop, on_round)."""
    return await run_conversation(HttpExchange(client, settings), settings, conversation, *options, **named)


async def _round(
    client: StreamClient,
    settings: ProbeSettings,
    number: int,
    messages: list[dict],
    session_id: str | None,
    previous: RoundResult | None,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[RoundResult, str]:
    """One streamed request, with `extra_headers` beside the session's; its result and the answer text."""
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    if session_id:
        headers[settings.session_header] = session_id
    content = chat_body(settings, messages)  # encoded before the clock starts
    reply, kind, detail = Reply(), None, None
    started_at = time.time()
    try:
        async with asyncio.timeout(settings.timeout_seconds):
            await _stream(client, settings, content, headers, reply)
    except RoundFailure as failure:
        kind, detail = failure.kind, failure.detail
    except TimeoutError:
        kind, detail = "timeout", f"no complete answer within {settings.timeout_seconds:g} s"
    except DnsFailed as error:
        kind, detail = "dns_error", f"{_origin(settings.base_url)}: {error}"
    except TlsMismatch as error:
        kind, detail = "tls_mismatch", f"{_origin(settings.base_url)}: {error}"
    except TlsFailed as error:
        kind, detail = "tls_error", f"{_origin(settings.base_url)}: {error}"
    except ConnectFailed as error:
        kind, detail = "connection_refused", f"cannot connect to {_origin(settings.base_url)}: {error}"
    except ProtocolError as error:
        kind, detail = "protocol_error", str(error)
    except StreamBroken as error:
        kind, detail = "stream_error" if reply.status == 200 else "http_error", str(error)
    except Exception as error:  # a bug: the round still ends as a result, counted and stored
        kind, detail = "internal_error", unforeseen(error)
    if kind is not None:
        reply.fail(kind, detail)
    backend = identity.from_headers(settings.backend_headers, reply.headers) or reply.json_backend
    returned = reply.headers.get(settings.session_header)
    result, answer = round_result(
        settings, number, started_at, reply, previous, session_id, backend, returned
    )
    return replace(result, pin_outcome=sessionkeys.pin_outcome(reply.headers)), answer


def chat_body(settings: ProbeSettings, messages: list[dict]) -> bytes:
    """A streamed chat completion's request body, asking for usage in the stream."""
    body = {
        "model": settings.model,
        "messages": messages,
        "max_tokens": settings.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Nothing else unless the route is declared: strict OpenAI-compatible APIs reject unknown fields.
        **identity.request_extras(settings.router),
    }
    return json.dumps(body).encode()


def round_result(
    settings: ProbeSettings,
    number: int,
    started_at: float,
    reply: Reply,
    previous: RoundResult | None,
    session_id: str | None,
    backend: str | None,
    session_id_returned: str | None,
) -> tuple[RoundResult, str]:
    """What a round received, as its record (names redacted) and its answer text."""
    usage = reply.usage
    return (
        RoundResult(
            round=number,
            started_at=started_at,
            status=reply.status,
            error_kind=reply.error_kind,
            error_detail=None
            if reply.error_detail is None
            else excerpt(reply.error_detail, settings.api_key),
            ttft_seconds=reply.ttft_seconds,
            first_content_seconds=reply.first_content_seconds,
            total_seconds=reply.total_seconds,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=usage.get("cached_tokens"),
            ideal_cached_tokens=blocksize.ideal_cached(
                previous, usage.get("prompt_tokens"), settings.block_size
            ),
            completion_tokens=usage.get("completion_tokens"),
            backend=redacted_name(backend, settings.api_key),
            session_id_sent=session_id,
            session_id_returned=redacted_name(session_id_returned, settings.api_key),
        ),
        "".join(reply.answer),
    )


async def _stream(
    client: StreamClient, settings: ProbeSettings, content: bytes, headers: dict, reply: Reply
) -> None:
    """Stream one answer into `reply`, timing its first generated token and its first answer text by
    when their bytes arrived, from when the request was written."""
    url = api_url(settings.base_url, "chat/completions")
    async with client.stream(url, content, headers) as response:
        reply.status, reply.headers = response.status, response.headers
        if response.status != 200:
            raise status_failure(response.status, await _body(response))
        if "text/event-stream" not in response.headers.get("Content-Type", ""):
            raise _answer_failure(await _body(response))
        async for line, arrived_at in _lines(response):
            if read_sse_line(line, settings, reply, arrived_at - response.sent_at):
                with contextlib.suppress(TimeoutError):  # a connection that cannot be reused is closed
                    async with asyncio.timeout(END_GRACE_SECONDS):
                        await response.finish()
                return
        raise RoundFailure("stream_error", STREAM_CUT)


def read_sse_line(line: str, settings: ProbeSettings, reply: Reply, elapsed: float) -> bool:
    """Take one line of a chat completion's event stream, which ended `elapsed` seconds into the round,
    into `reply`; True at its [DONE]. Raises RoundFailure for a malformed chunk or an error object."""
    if not line.startswith("data:"):
        return False  # blank separators, comments (keep-alives), event: and id: fields
    data = line.removeprefix("data:").strip()
    if data == "[DONE]":
        reply.total_seconds = elapsed
        return True
    try:
        chunk = json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise RoundFailure("stream_error", f"error in the stream: {data}")
        _read_chunk(chunk, settings, reply, elapsed)
    except (ValueError, TypeError, AttributeError) as error:
        raise RoundFailure("stream_error", f"malformed chunk: {data}") from error
    return False


def _read_chunk(chunk: dict, settings: ProbeSettings, reply: Reply, elapsed: float) -> None:
    """Take the content, usage and backend from one streamed chunk, which arrived `elapsed` seconds into
    the round; TypeError etc. when malformed.

    The first generated token of any kind ends the TTFT: a reasoning model thinks, or calls a tool,
    before it answers, and the engine's prefill is over by then. The first answer text is kept apart.
    """
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        generated = [delta.get(name) for name in GENERATED_FIELDS]
        if not all(value is None or isinstance(value, str | list) for value in generated):
            raise TypeError("a delta field is neither text nor a list of tool calls")
        if reply.ttft_seconds is None and any(generated):
            reply.ttft_seconds = elapsed
        content = delta.get("content")
        if content:
            if not isinstance(content, str):
                raise TypeError("content is not a string")
            if reply.first_content_seconds is None:
                reply.first_content_seconds = elapsed
            reply.answer.append(content)
            reply.answer_bytes += len(content.encode())
            if reply.answer_bytes > MAX_ANSWER_BYTES:
                raise RoundFailure("stream_error", f"answer over {MAX_ANSWER_BYTES} bytes")
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        reply.usage = _token_counts(
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            # None when the engine does not report it (vLLM without --enable-prompt-tokens-details).
            cached_tokens=details.get("cached_tokens"),
        )
    if backend := identity.from_chunk(settings.backend_json_paths, chunk):
        reply.json_backend = backend


def _token_counts(**counts: object) -> dict[str, int | None]:
    """The usage counts, each a token count or None: one absurd number would break the store and the
    exporter for every target, and a negative one would make counters go down."""
    for name, value in counts.items():
        if value is not None and not (type(value) is int and 0 <= value < MAX_TOKEN_COUNT):
            raise RoundFailure("stream_error", f"{USAGE_FIELDS[name]} is {_shown(value)}, not a token count")
    prompt, cached = counts["prompt_tokens"], counts["cached_tokens"]
    if prompt is not None and cached is not None and cached > prompt:
        cached_field, prompt_field = USAGE_FIELDS["cached_tokens"], USAGE_FIELDS["prompt_tokens"]
        raise RoundFailure("stream_error", f"{cached_field} is {cached}, more than {prompt_field} ({prompt})")
    return counts


def _shown(value: object) -> str:
    """A value as the server sent it, shortened: a number of 400 digits as 1.00e+400."""
    text = json.dumps(value)
    if len(text) <= 20:
        return text
    return f"{Decimal(value):.3g}" if type(value) is int else text[:20] + "…"


class SseLines:
    """An event stream's bytes as lines, at most MAX_STREAM_LINES of at most MAX_LINE_BYTES each: an
    endless line would be endless memory, an endless stream endless work. Raises RoundFailure beyond."""

    def __init__(self) -> None:
        self.buffer, self.count = b"", 0

    def feed(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes; a line may span any number of chunks."""
        *lines, self.buffer = (self.buffer + chunk).split(b"\n")
        self.count += len(lines)
        if self.count > MAX_STREAM_LINES:
            raise RoundFailure(
                "stream_error", f"more than {MAX_STREAM_LINES} lines: a stream that does not end"
            )
        if len(self.buffer) > MAX_LINE_BYTES:
            raise RoundFailure(
                "stream_error", f"a line of more than {MAX_LINE_BYTES} bytes: not an event stream"
            )
        return [line.rstrip(b"\r").decode(errors="replace") for line in lines]

    def rest(self) -> str | None:
        """The unfinished last line at the stream's end, if any."""
        return self.buffer.decode(errors="replace") if self.buffer else None


async def _lines(response: Response) -> AsyncIterator[tuple[str, float]]:
    """The body's lines, each with the time its end arrived (SseLines' caps)."""
    lines = SseLines()
    async for chunk, arrived_at in response.chunks():
        for line in lines.feed(chunk):
            yield line, arrived_at
    if (rest := lines.rest()) is not None:
        yield rest, time.perf_counter()


async def _body(response: Response) -> str:
    """The start of a non-streamed body, at most MAX_BODY_BYTES of it."""
    body = b""
    async for chunk, _ in response.chunks():
        body += chunk
        if len(body) >= MAX_BODY_BYTES:
            break
    return body[:MAX_BODY_BYTES].decode(errors="replace")


def status_failure(status: int, body: str) -> RoundFailure:
    if status == 400 and any(answer in body for answer in TLS_PORT_ANSWERS):
        return RoundFailure("tls_mismatch", f"{SPEAKS_TLS} (HTTP 400: {body})")
    if status == 401:
        return RoundFailure("unauthorized", f"HTTP 401: {body}")
    if status == 403:
        expired = "token expired: " if "expired" in body.lower() else ""
        return RoundFailure("forbidden", f"{expired}HTTP 403: {body}")
    if status == 404:
        return RoundFailure("not_found", f"HTTP 404 (wrong model or base URL): {body}")
    return RoundFailure("http_error", f"HTTP {status}: {body}")


def _answer_failure(body: str) -> RoundFailure:
    """A 200 that is no event stream: a whole completion (stream mixed up), or an error object."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and "choices" in answer:
        return RoundFailure("stream_error", "a whole completion came back instead of an event stream")
    return RoundFailure("bad_response", f"no `choices` in the answer: {body}")


def excerpt(text: str, api_key: str | None) -> str:
    """One short line of `text`, redacted before it is cut, so that no piece of a key survives the cut."""
    text = " ".join(redact(text, api_key).split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


def unforeseen(error: Exception) -> str:
    """An exception no code path expected, by its type and where it was raised: what a bug report needs.
    Its message goes through the round's redaction like every detail."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}{where}: {error}"


def failed_run(settings: ProbeSettings, error: Exception, started_at: float) -> SessionResult:
    """The record of a run that broke outside its rounds (its client could not be made, its workload
    failed): one session whose round 1 failed, with the RoundFailure's kind or else as internal_error, so
    that the run is counted, stored and dated like any other."""
    kind, detail = (
        (error.kind, error.detail)
        if isinstance(error, RoundFailure)
        else ("internal_error", unforeseen(error))
    )
    failure = RoundResult(
        round=1,
        started_at=started_at,
        status=None,
        error_kind=kind,
        error_detail=excerpt(detail, settings.api_key),
        ttft_seconds=None,
        total_seconds=None,
        prompt_tokens=None,
        cached_tokens=None,
        ideal_cached_tokens=None,
        completion_tokens=None,
        backend=None,
        session_id_sent=None,
        session_id_returned=None,
    )
    return SessionResult(settings.target, settings.route_mode, None, started_at, time.time(), (failure,))


def _origin(base_url: str) -> str:
    url = httpx.URL(base_url)
    return f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
