"""The sagemaker target kind through botocore's real client: its requests validated, serialized and
(over a loopback server) signed and parsed by botocore itself. botocore has no event-stream encoder, so
a round's stream is given as the parsed events botocore yields, and its faults as the exceptions
botocore raises (ChecksumMismatch for a bad CRC, EventStreamError for a ModelStreamError event)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import io
import json
import re
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator

import botocore.session
import pytest
from botocore.awsrequest import AWSResponse
from botocore.eventstream import ChecksumMismatch
from botocore.exceptions import EventStreamError
from botocore.response import StreamingBody
from loopback import QuietHandler, loopback_http

from kvwatch.cli.main import main
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources, with_block_size
from kvwatch.collectors.probe.conversation import run_conversation
from kvwatch.collectors.probe.lifecycle import life_of
from kvwatch.collectors.probe.records import ERROR_KINDS
from kvwatch.collectors.probe.report import HINTS, format_report, session_json
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import KINDS, ProbeClients, probe_once, target_problem
from kvwatch.collectors.probe.targets import sagemaker as sagemaker_module
from kvwatch.collectors.probe.targets.sagemaker import (
    EndpointProblem,
    Runtime,
    SageMakerEndpoint,
    SageMakerExchange,
    parse_new_session,
    replica_of,
)
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import Config, StoreSettings, Target, Workload, load_config
from kvwatch.doctor.sagemaker import diagnosis_of
from kvwatch.experiment.runner import run_experiment
from kvwatch.lab.gateways.sagemaker.eventstream import encode_exception, payload_part
from kvwatch.serve.scheduler import Service

ENDPOINT = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url="http://127.0.0.1:9")
SECRET_KEY = "kvw-aws-secret-7d3b5f1c0e9a"  # distinctive, so that a leak is found
CONVERSATION = Conversation("You are brief.", ("one", "two", "three"))


def settings(**changes) -> ProbeSettings:
    base = {"base_url": ENDPOINT.base_url, "model": "m", "kind": "sagemaker", "sagemaker": ENDPOINT}
    return ProbeSettings(**{**base, **changes})


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def answer_text(content: str, prompt: int, cached: int | None) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": content}}]},
        {"choices": [], "usage": usage},
    )


def parts(text: bytes, *cuts: int) -> list[dict]:
    """`text` as PayloadPart events, cut at `cuts`."""
    edges = [0, *cuts, len(text)]
    return [{"PayloadPart": {"Bytes": text[a:b]}} for a, b in zip(edges, edges[1:], strict=False)]


class Scripted:
    """botocore's real sagemaker-runtime client whose calls are answered in turn by `answers`, from its
    before-call event as botocore's Stubber answers (Stubber refuses a stream's events); each request,
    as botocore serialized it, is kept in `requests`."""

    def __init__(self, *answers: Callable[[], tuple[int, dict]]) -> None:
        self.answers, self.requests = list(answers), []
        session = botocore.session.get_session()
        self.client = session.create_client(
            "sagemaker-runtime",
            region_name="us-east-1",
            endpoint_url="http://127.0.0.1:9",
            aws_access_key_id="AKIDEXAMPLE",
            aws_secret_access_key=SECRET_KEY,
        )
        self.client.meta.events.register("before-call.sagemaker-runtime", self._answer)

    def _answer(self, model, params, **_) -> tuple[AWSResponse, dict]:
        self.requests.append((model.name, params["headers"], params["body"]))
        status, parsed = self.answers.pop(0)()
        parsed.setdefault("ResponseMetadata", {}).setdefault("HTTPStatusCode", status)
        return AWSResponse(None, status, {}, None), parsed

    def session_ids(self) -> list[tuple[str, str | None]]:
        return [(name, headers.get("X-Amzn-SageMaker-Session-Id")) for name, headers, _ in self.requests]


def opened(session_id: str, expires: str = "2099-01-01T00:00:00Z"):
    text = f"Session {session_id} created".encode()
    body = {
        "Body": StreamingBody(io.BytesIO(text), len(text)),
        "NewSessionId": f"{session_id}; Expires={expires}",
    }
    return lambda: (200, body)


def closed(session_id: str):
    return lambda: (200, {"Body": StreamingBody(io.BytesIO(b""), 0), "ClosedSessionId": session_id})


class EventBody:
    """botocore's EventStream as the exchange reads it: parsed events, and a close()."""

    def __init__(self, events) -> None:
        self.events = events

    def __iter__(self):
        return iter(self.events)

    def close(self) -> None:
        pass


def streamed(events, custom: str | None = None, headers: dict | None = None):
    def answer():
        parsed = {
            "Body": EventBody(events() if callable(events) else events),
            "ResponseMetadata": {"HTTPHeaders": headers or {}},
        }
        if custom:
            parsed["CustomAttributes"] = custom
        return 200, parsed

    return answer


def refused(status: int, code: str, message: str, **modeled):
    return lambda: (status, {"Error": {"Code": code, "Message": message}, **modeled})


def converse(scripted: Scripted, conversation: Conversation = CONVERSATION, **changes):
    exchange = SageMakerExchange(Runtime(scripted.client, threads=2), settings(**changes))

    async def run():
        try:
            return await run_conversation(exchange, exchange.settings, conversation)
        finally:
            await exchange.runtime.aclose()

    return asyncio.run(run())


def round_events(prompt: int, cached: int | None) -> list[dict]:
    text = answer_text("hi", prompt, cached)
    return parts(text, 10, len(text) // 2)


# The event stream as SSE.


def one_round(events, **changes):
    scripted = Scripted(streamed(events), closed("unused"))
    return converse(scripted, Conversation("s", ("one",)), session_mode="none", **changes).rounds[0]


def test_an_sse_line_over_two_parts_is_read_whole_and_dated_by_the_part_that_ends_it(monkeypatch):
    text = answer_text("Hello", 300, 256)
    content_line = text.index(b'"content"')  # the line with the first token, cut inside its JSON
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(
        sagemaker_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, time=time.time)
    )

    def events() -> Iterator[dict]:
        for moment, event in zip(
            (1.0, 2.5, 4.0), parts(text, content_line - 3, content_line + 5), strict=True
        ):
            clock.now = moment
            yield event

    result = one_round(events)
    assert result.ok, result.error_detail
    assert (result.ttft_seconds, result.first_content_seconds, result.total_seconds) == (4.0, 4.0, 4.0)
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (300, 256, 2)


def test_the_ttft_is_the_part_carrying_the_first_generated_token_not_the_first_part(monkeypatch):
    text = answer_text("Hello", 300, 0)
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(
        sagemaker_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, time=time.time)
    )
    cuts = [text.index(b"data:", 1), text.index(b"data:", text.index(b'"content"'))]

    def events() -> Iterator[dict]:
        for moment, event in zip((0.5, 2.0, 3.0), parts(text, *cuts), strict=True):
            clock.now = moment
            yield event

    result = one_round(events)
    assert (result.ttft_seconds, result.total_seconds) == (2.0, 3.0)


@pytest.mark.parametrize(
    "fault, kind, detail",
    [
        (ChecksumMismatch(0x1234, 0x5678), "checksum_error", "Checksum mismatch: expected 0x00001234"),
        (
            EventStreamError(
                {"Error": {"Code": "ModelStreamError", "Message": "model stream timed out"}},
                "InvokeEndpointWithResponseStream",
            ),
            "model_stream_error",
            "ModelStreamError in the stream: model stream timed out",
        ),
        (
            EventStreamError(
                {"Error": {"Code": "InternalStreamFailure", "Message": "stream failed"}},
                "InvokeEndpointWithResponseStream",
            ),
            "internal_stream_failure",
            "InternalStreamFailure in the stream: stream failed",
        ),
    ],
    ids=["bad-crc", "model-stream-error", "internal-stream-failure"],
)
def test_a_fault_mid_stream_fails_the_round_by_kind_after_the_parts_before_it(fault, kind, detail):
    text = answer_text("Hello", 300, 0)

    def events() -> Iterator[dict]:
        yield from parts(text[:60])
        raise fault

    result = one_round(events)
    assert (result.error_kind, result.status) == (kind, 200)
    assert detail in result.error_detail
    assert result.ttft_seconds is None or result.ttft_seconds >= 0


def test_a_stream_ending_before_done_is_a_stream_error():
    text = answer_text("Hello", 300, 0)
    result = one_round(parts(text[: text.index(b"data: [DONE]")]))
    assert (result.error_kind, result.error_detail) == (
        "stream_error",
        "the event stream ended before [DONE]",
    )


def test_an_error_object_in_the_sse_text_is_a_stream_error():
    result = one_round(parts(b'data: {"error": {"message": "out of memory"}}\n\n'))
    assert result.error_kind == "stream_error" and "out of memory" in result.error_detail


# Sessions.


def test_a_session_is_opened_untimed_used_by_every_round_and_closed():
    rounds = [round_events(300, 0), round_events(600, 256), round_events(900, 512)]
    scripted = Scripted(opened("s-1"), *(streamed(r) for r in rounds), closed("s-1"))
    session = converse(scripted, block_size=128)
    assert scripted.session_ids() == [
        ("InvokeEndpoint", "NEW_SESSION"),
        *[("InvokeEndpointWithResponseStream", "s-1")] * 3,
        ("InvokeEndpoint", "s-1"),
    ]
    bodies = [body for _, _, body in scripted.requests]
    assert bodies[0] == b'{"requestType": "NEW_SESSION"}' and bodies[-1] == b'{"requestType": "CLOSE"}'
    assert json.loads(bodies[1])["stream_options"] == {"include_usage": True}
    assert (session.ok, session.session_id, session.closed, session.session_losses) == (True, "s-1", True, ())
    assert [r.ideal_cached_tokens for r in session.rounds] == [0, 256, 512]
    assert (session.sticky, session.evidence, session.session_id_echoed) == (True, "reuse", True)
    assert (session.warm_rounds, session.warm_rounds_reused) == (2, 2)  # the reuse behind the judgment
    assert (session.warm_cached_tokens, session.warm_ideal_cached_tokens) == (256 + 512, 256 + 512)


def test_warm_rounds_that_stop_reusing_make_the_session_not_sticky_by_reuse():
    rounds = [round_events(300, 0), round_events(600, 0), round_events(900, 256)]
    scripted = Scripted(opened("s-1"), *(streamed(r) for r in rounds), closed("s-1"))
    session = converse(scripted, block_size=128)
    assert (session.sticky, session.evidence) == (False, "reuse")
    assert (session.warm_rounds, session.warm_rounds_reused) == (2, 1)  # 256 of 512: half is reuse
    assert (session.warm_cached_tokens, session.warm_ideal_cached_tokens) == (256, 256 + 512)


def system_prompts(scripted: Scripted) -> list[str]:
    """The system prompt each round sent, as botocore serialized it."""
    sent = [
        json.loads(body) for name, _, body in scripted.requests if name == "InvokeEndpointWithResponseStream"
    ]
    return [body["messages"][0]["content"] for body in sent]


@pytest.mark.parametrize("session_mode", ["client", "none"])
def test_every_round_starts_with_a_marker_of_its_own_session_before_the_shared_system_prompt(session_mode):
    """Judged by reuse, a session's cached tokens must be its own history: a marker no other session
    shares comes first, so that no other session's cached system prompt can serve its rounds."""
    sent = []
    for session_id in ("s-1", "s-2"):
        rounds = [streamed(round_events(300 * n, 0)) for n in (1, 2, 3)]
        opening = [opened(session_id)] if session_mode == "client" else []
        scripted = Scripted(*opening, *rounds, closed(session_id))
        assert converse(scripted, session_mode=session_mode).ok
        sent.append(system_prompts(scripted))
    for prompts in sent:
        assert len(set(prompts)) == 1, prompts  # one marker for every round of a session
        marker, system = prompts[0].split(". ", 1)
        assert system == CONVERSATION.system_prompt, prompts
        assert re.fullmatch(r"Session( [a-z]+){5}", marker), marker
    assert sent[0][0] != sent[1][0], sent


def test_unmarked_sessions_send_the_shared_system_prompt_as_is():
    """As an application's conversations (the doctor's load check: PREFIX_AWARE hashes them alike)."""
    scripted = Scripted(opened("s-1"), *(streamed(round_events(300 * n, 0)) for n in (1, 2)), closed("s-1"))
    assert converse(scripted, Conversation("Be brief.", ("one", "two")), marked_sessions=False).ok
    assert system_prompts(scripted) == ["Be brief.", "Be brief."]


def test_the_marker_comes_before_a_system_prompt_rendered_anew_each_round():
    scripted = Scripted(opened("s-1"), *(streamed(round_events(300 * n, 0)) for n in (1, 2)), closed("s-1"))
    renders = iter(("At 10:00. ", "At 10:01. "))
    exchange = SageMakerExchange(Runtime(scripted.client, threads=2), settings())

    async def run():
        try:
            render = lambda system: next(renders) + system  # noqa: E731
            conversation = Conversation("Be brief.", ("one", "two"))
            return await run_conversation(
                exchange, exchange.settings, conversation, render_system_prompt=render
            )
        finally:
            await exchange.runtime.aclose()

    assert asyncio.run(run()).ok
    assert system_prompts(scripted) == [
        exchange.opening + "At 10:00. Be brief.",
        exchange.opening + "At 10:01. Be brief.",
    ]


def test_a_replica_named_in_the_custom_attributes_is_the_rounds_backend():
    rounds = [round_events(300, 0), round_events(600, 384)]
    custom = ["trace=abc, replica=vllm-0", "replica=vllm-1"]
    scripted = Scripted(
        opened("s-1"), *(streamed(r, c) for r, c in zip(rounds, custom, strict=True)), closed("s-1")
    )
    session = converse(scripted, Conversation("s", ("one", "two")))
    assert [r.backend for r in session.rounds] == ["vllm-0", "vllm-1"]
    assert (session.sticky, session.evidence) == (False, "replica")
    assert replica_of("trace=abc") is None and replica_of(None) is None


@pytest.mark.parametrize(
    "expires, refusal, kind",
    [
        ("2000-01-01T00:00:00Z", refused(400, "ValidationError", "session not found: s-1"), "expired"),
        (
            "2099-01-01T00:00:00Z",
            refused(
                424,
                "ModelError",
                "Received client error (400) from primary",
                OriginalStatusCode=400,
                OriginalMessage='{"error": {"message": "Bad request: session not found: s-1"}}',
            ),
            "not_found",
        ),
    ],
    ids=["expired-by-sagemaker", "unknown-to-the-container"],
)
def test_a_refused_session_is_counted_by_kind_and_the_round_runs_in_a_new_one(expires, refusal, kind):
    scripted = Scripted(
        opened("s-1", expires),
        streamed(round_events(300, 0)),
        refusal,
        opened("s-2"),
        streamed(round_events(600, 0)),
        closed("s-2"),
    )
    session = converse(scripted, Conversation("s", ("one", "two")), block_size=128)
    assert session.ok and session.session_losses == ((2, kind),)
    assert [sent for _, sent in scripted.session_ids()] == [
        "NEW_SESSION",
        "s-1",
        "s-1",
        "NEW_SESSION",
        "s-2",
        "s-2",
    ]
    assert [r.session_id_sent for r in session.rounds] == ["s-1", "s-2"]
    assert session.rounds[1].ideal_cached_tokens == 0  # a new session holds nothing: not judged on reuse
    assert (session.session_id, session.closed) == ("s-2", True)
    (realigned,) = with_block_size([session], 16)  # a block learned after the run keeps it cold
    assert [r.ideal_cached_tokens for r in realigned.rounds] == [0, 0]


def test_a_session_the_endpoint_says_it_closed_is_reopened_for_the_next_round():
    closing = {"x-amzn-sagemaker-closed-session-id": "s-1"}
    scripted = Scripted(
        opened("s-1"),
        streamed(round_events(300, 0), headers=closing),
        opened("s-2"),
        streamed(round_events(600, 0)),
        closed("s-2"),
    )
    session = converse(scripted, Conversation("s", ("one", "two")))
    assert session.ok and session.session_losses == ((2, "closed"),)


def test_a_session_refused_again_in_its_new_session_fails_the_round():
    gone = refused(400, "ValidationError", "session not found")
    scripted = Scripted(opened("s-1"), gone, opened("s-2"), gone, closed("s-2"))
    session = converse(scripted, Conversation("s", ("one",)))
    assert session.rounds[0].error_kind == "http_error" and session.session_losses == ((1, "not_found"),)


def test_a_container_without_stateful_sessions_fails_round_1_at_the_open():
    refusal = refused(
        424,
        "ModelError",
        "Received client error (400)",
        OriginalStatusCode=400,
        OriginalMessage="Invalid payload. stateful sessions not enabled",
    )
    scripted = Scripted(refusal)
    session = converse(scripted)
    (failed,) = session.rounds
    assert (failed.error_kind, failed.session_id_sent, failed.ttft_seconds) == (
        "model_error",
        "NEW_SESSION",
        None,
    )
    assert "stateful sessions not enabled" in failed.error_detail and session.closed is None
    assert [name for name, _, _ in scripted.requests] == ["InvokeEndpoint"]


def test_an_open_answered_without_a_session_id_says_what_to_enable():
    scripted = Scripted(lambda: (200, {"Body": StreamingBody(io.BytesIO(b"{}"), 2)}))
    (failed,) = converse(scripted).rounds
    assert failed.error_kind == "bad_response" and "SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in failed.error_detail


def test_without_sessions_no_session_is_opened_sent_or_closed():
    scripted = Scripted(*(streamed(round_events(300 * n, 0)) for n in (1, 2, 3)))
    session = converse(scripted, session_mode="none")
    assert session.ok and session.closed is None and session.session_id is None
    assert scripted.session_ids() == [("InvokeEndpointWithResponseStream", None)] * 3


def test_the_variant_and_inference_component_go_with_every_request():
    endpoint = SageMakerEndpoint("chat-endpoint", "us-east-1", variant="blue", inference_component="ic-1")
    scripted = Scripted(opened("s-1"), streamed(round_events(300, 0)), closed("s-1"))
    converse(scripted, Conversation("s", ("one",)), sagemaker=endpoint, base_url=endpoint.base_url)
    for _, headers, _ in scripted.requests:
        assert headers["X-Amzn-SageMaker-Target-Variant"] == "blue"
        assert headers["X-Amzn-SageMaker-Inference-Component"] == "ic-1"


def test_the_new_session_header_gives_the_id_and_its_expiry():
    assert parse_new_session("abc-1; Expires=2026-12-05T05:00:00Z") == ("abc-1", 1796446800)
    assert parse_new_session("abc-1") == ("abc-1", None)


# Over the wire: botocore signs, sends and parses for real, against a loopback server.


class RuntimeFront(QuietHandler):
    """Opens sessions, and refuses every streamed round's session as SageMaker refuses an unknown one."""

    seen: list[dict] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append({"path": self.path, **dict(self.headers.items())})
        if self.path.endswith("/invocations"):
            self.send_response(200)
            self.send_header(
                "X-Amzn-SageMaker-New-Session-Id", f"s-{len(self.seen)}; Expires=2099-01-01T00:00:00Z"
            )
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"message": f"session not found: s-{len(self.seen) - 1}"}).encode()
        self.send_response(400)
        self.send_header("x-amzn-ErrorType", "ValidationError")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class StreamCutShort(QuietHandler):
    """Streams a part of an answer and a ModelStreamError event, then holds the connection open (the
    chunked body never ends) until the client closes it, which `closed` tells."""

    protocol_version = "HTTP/1.1"
    closed = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.amazon.eventstream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = payload_part(b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n') + encode_exception(
            "ModelStreamError", "model stream timed out", "ModelStreamError"
        )
        self.wfile.write(b"%x\r\n%s\r\n" % (len(events), events))
        self.wfile.flush()
        self.connection.settimeout(30)
        with contextlib.suppress(OSError):
            while self.connection.recv(1024):
                pass
        type(self).closed.set()
        self.close_connection = True


def over_the_wire(monkeypatch, front: type[QuietHandler] = RuntimeFront, **changes):
    """One round of one conversation through botocore, to `front`."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    RuntimeFront.seen = []
    with loopback_http(front) as url:
        endpoint = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url=url)
        over = settings(sagemaker=endpoint, base_url=url, **changes)
        (session,) = probe_once(over, [Conversation("s", ("one",))])
    return session


def test_a_stream_cut_short_has_its_connection_closed_at_once_not_left_to_the_garbage_collector(monkeypatch):
    StreamCutShort.closed.clear()
    gc.disable()  # what the garbage collector would close late is not closed by it here
    try:
        session = over_the_wire(monkeypatch, StreamCutShort, session_mode="none")
        assert session.rounds[0].error_kind == "model_stream_error", session.rounds[0]
        assert StreamCutShort.closed.wait(10), "the connection of the stream cut short is still open"
    finally:
        gc.enable()


def test_over_http_botocore_signs_sends_the_session_header_and_a_refusal_reopens(monkeypatch):
    session = over_the_wire(monkeypatch)
    paths = [(seen["path"], seen.get("X-Amzn-SageMaker-Session-Id")) for seen in RuntimeFront.seen]
    assert paths == [
        ("/endpoints/chat-endpoint/invocations", "NEW_SESSION"),
        ("/endpoints/chat-endpoint/invocations-response-stream", "s-1"),
        ("/endpoints/chat-endpoint/invocations", "NEW_SESSION"),
        ("/endpoints/chat-endpoint/invocations-response-stream", "s-3"),
        ("/endpoints/chat-endpoint/invocations", "s-3"),
    ]
    assert all(
        seen["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
        for seen in RuntimeFront.seen
    )
    (failed,) = session.rounds
    assert (failed.error_kind, failed.status) == ("http_error", 400)
    assert session.session_losses == ((1, "not_found"),) and session.closed is False
    assert SECRET_KEY not in repr(session)


def test_a_custom_session_header_is_sent_as_configured_and_no_session_is_opened(monkeypatch):
    session = over_the_wire(monkeypatch, session_header="X-Session-Id")
    (seen,) = RuntimeFront.seen
    assert seen["path"] == "/endpoints/chat-endpoint/invocations-response-stream"
    assert (
        "X-Amzn-SageMaker-Session-Id" not in seen
        and seen["X-Session-Id"] == session.rounds[0].session_id_sent
    )
    assert "x-session-id" in seen["Authorization"]  # signed with the request, as an SDK hook would add it
    assert session.session_id is None and session.closed is None


def test_no_aws_credentials_is_a_credentials_error_named_so(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (session,) = probe_once(settings(), [Conversation("s", ("one",))])
    assert session.rounds[0].error_kind == "credentials_error"
    assert "Unable to locate credentials" in session.rounds[0].error_detail


@pytest.mark.parametrize("where", ["config", "environment"])
def test_an_aws_profile_that_is_not_there_fails_the_run_as_a_credentials_error_naming_it(
    monkeypatch, tmp_path, where
):
    """botocore refuses to make a client for a profile its shared files do not have: the run fails as the
    credentials error it is, in the command and in serve alike, not as a crash or an internal error."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    endpoint = ENDPOINT
    if where == "config":
        endpoint = dataclasses.replace(ENDPOINT, profile="gone")
    else:
        monkeypatch.setenv("AWS_PROFILE", "gone")
    (session,) = probe_once(settings(sagemaker=endpoint), [Conversation("s", ("one", "two"))])
    (failed,) = session.rounds
    assert (failed.round, failed.error_kind) == (1, "credentials_error")
    assert failed.error_detail == "The config profile (gone) could not be found"


def test_a_proxy_that_refuses_is_named_with_its_credentials_masked(monkeypatch):
    """botocore reaches AWS through HTTP(S)_PROXY as the AWS SDK does: a proxy that is down is the
    round's connection failure, naming the proxy, not an internal error; its password is not shown."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with socket.socket() as closed:  # a port that was free: nothing listens on it
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://someone:{SECRET_KEY}@127.0.0.1:{port}")
    (session,) = probe_once(settings(), [Conversation("s", ("one",))])
    (failed,) = session.rounds
    assert failed.error_kind == "connection_refused"
    detail = failed.error_detail
    assert detail.startswith("cannot connect to the proxy http://"), detail
    assert detail.endswith(f"@127.0.0.1:{port} (HTTP(S)_PROXY): Connection refused"), detail
    assert "someone" not in detail and SECRET_KEY not in detail


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


def test_kvwatch_serve_probes_a_sagemaker_target_and_exports_its_session_losses(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    RuntimeFront.seen = []
    workload = Workload(system_tokens=20, turn_tokens=5, max_tokens=1)
    with loopback_http(RuntimeFront) as url:
        endpoint = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url=url)
        target = Target(
            "sm", model="m", kind="sagemaker", sagemaker=endpoint, sessions_per_run=1, workload=workload
        )
        service = Service(Config(targets=(target,), store=StoreSettings(tmp_path / "kvwatch.db")))

        async def one_run() -> None:
            service._gate, service._stop = asyncio.Semaphore(1), asyncio.Event()
            async with ProbeClients() as service._clients:
                await service.probe(target)

        asyncio.run(asyncio.wait_for(one_run(), timeout=60))  # a guard against a hang, not a timing
    service.writer.close(5)
    route = {"target": "sm", "route_mode": "affinity"}
    sample = service.registry.get_sample_value
    assert sample("kvwatch_probe_session_losses_total", {**route, "kind": "not_found"}) == 1
    assert sample("kvwatch_probe_errors_total", {**route, "kind": "http_error"}) == 1
    assert [seen["path"].rsplit("/", 1)[1] for seen in RuntimeFront.seen] == [
        "invocations",
        "invocations-response-stream",
        "invocations",
        "invocations-response-stream",
        "invocations",
    ]
    (stored,) = service.store.sessions()
    assert stored["error_kind"] == "http_error"
    service.store.close()


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
