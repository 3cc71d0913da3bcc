"""The probe against small fake servers, for what no healthy engine does, and its settings and command line
(tests/integration/test_probe_lab.py runs it through the lab's real nginx and the real sglang-router)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import suppress
from urllib.parse import quote

import pytest
from aiohttp import web
from loopback import QuietHandler, answering_bytes, loopback_http, serving
from prometheus_client import CollectorRegistry, generate_latest

from conftest import REPO, free_port, kvwatch_bounded
from kvwatch.cli.main import main
from kvwatch.collectors.probe import session as probe_module
from kvwatch.collectors.probe.models import chosen_model
from kvwatch.collectors.probe.records import ERROR_KINDS, RoundResult, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import (
    MAX_ANSWER_BYTES,
    MAX_STREAM_LINES,
    MAX_TOKEN_COUNT,
    ProbeSettings,
    api_url,
    resolve_api_key,
    run_session,
)
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.targets import probe_once, run_sessions
from kvwatch.collectors.probe.workload import Conversation, synthetic
from kvwatch.serve.exporter import ProbeCollector, ProbeResults
from kvwatch.store.history import Store

MODEL = "lab-model"
KEY = "kvw-secret-5f1c0e9a7d3b"  # distinctive, so a grep finds any leak
SMALL = f"--model {MODEL} --system-tokens 50 --turn-tokens 10 --max-tokens 8".split()  # a quick CLI run


def conversations(
    seed: int, sessions: int = 3, rounds: int = 4, system_tokens: int = 2000
) -> list[Conversation]:
    """Conversations with a system prompt each, so that round 1 is a cold prefill wherever it lands.

    Every test takes its own seed: the lab's caches outlive a test.
    """
    return [synthetic(rounds, system_tokens, 20, seed * 100 + n, sessions=1)[0] for n in range(sessions)]


def probe(url: str, workload: list[Conversation], **settings) -> list[SessionResult]:
    settings = {"base_url": url, "model": MODEL, "max_tokens": 16, **settings}
    return probe_once(ProbeSettings(**settings), workload)


# Settings.


@pytest.mark.parametrize(
    "base", ["https://example.net/api", "https://example.net/api/", "https://example.net/api/v1"]
)
def test_base_url_gets_v1_unless_it_ends_in_it(base):
    assert api_url(base, "chat/completions") == "https://example.net/api/v1/chat/completions"
    assert api_url(base, "/models") == "https://example.net/api/v1/models"


def test_a_base_urls_query_stays_after_the_path():
    assert api_url("https://h/api?token=x", "chat/completions") == "https://h/api/v1/chat/completions?token=x"
    assert api_url("https://h/api/?token=x", "") == "https://h/api/v1?token=x"
    assert api_url("https://h/api/v1/?token=x&a=b", "/models") == "https://h/api/v1/models?token=x&a=b"


def test_api_key_comes_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVW_TEST_KEY", f"  {KEY}\n")
    (tmp_path / "key").write_text(f"{KEY}\n")
    assert resolve_api_key("KVW_TEST_KEY", None) == KEY
    assert resolve_api_key(None, tmp_path / "key") == KEY
    assert resolve_api_key(None, None) is None


@pytest.mark.parametrize(
    "env, file, message",
    [
        ("KVW_TEST_UNSET", None, "environment variable KVW_TEST_UNSET is not set or empty"),
        (KEY, None, "environment variable named for the API key (name not shown) is not set or empty"),
        (None, "missing", "cannot read API key file {tmp}/missing: No such file or directory"),
        (None, "empty", "API key file {tmp}/empty is empty"),
        ("KVW_TEST_UNSET", "empty", "take the API key from an environment variable or from a file, not both"),
    ],
    ids=["unset", "key-as-name", "missing-file", "empty-file", "both"],
)
def test_api_key_errors_name_the_source_never_the_key(tmp_path, monkeypatch, env, file, message):
    monkeypatch.delenv("KVW_TEST_UNSET", raising=False)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError) as raised:
        resolve_api_key(env, file and tmp_path / file)
    assert str(raised.value) == message.format(tmp=tmp_path)


def test_settings_never_show_the_key_and_reject_bad_values():
    assert KEY not in repr(ProbeSettings(base_url="http://gw", model=MODEL, api_key=KEY))
    for bad, message in [
        ({"base_url": "gw:8000"}, "base_url must start with http:// or https://"),
        ({"model": ""}, "model must not be empty"),
        ({"session_mode": "sticky"}, "session_mode must be one of client, server, none"),
        ({"timeout_seconds": 0}, "timeout_seconds must be positive"),
        ({"api_key": f"{KEY} x"}, "^api_key must be printable ASCII without spaces$"),
    ]:
        with pytest.raises(ValueError, match=message):
            ProbeSettings(**{"base_url": "http://gw", "model": MODEL, **bad})


# Error kinds, from replica faults and wrong settings.


def test_nothing_listening_is_connection_refused():
    (session,) = probe(f"http://127.0.0.1:{free_port()}", conversations(seed=9, sessions=1))
    (failed,) = session.rounds
    assert (failed.status, failed.error_kind) == (None, "connection_refused")
    assert failed.error_detail.startswith("cannot connect to 127.0.0.1:")


# Small fake servers, for what no healthy engine does.


def fake_server(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return serving(app)


async def sse(request: web.Request, events: list[str], headers: dict | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {event}\n\n".encode())
    return response


USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
ANSWER = [
    '{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
    '{"choices": [{"delta": {"content": "hello"}}]}',
    '{"choices": [{"delta": {"content": " world"}}]}',
    json.dumps({"choices": [], "usage": USAGE}),
    "[DONE]",
]
WORKLOAD = Conversation("Be brief.", ("first question", "second question", "third question"))


def against(handler, scheme: str = "http", **settings) -> SessionResult:
    async def scenario():
        async with fake_server(handler) as url, StreamClient() as client:
            base_url = url.replace("http", scheme, 1)
            return await run_session(
                client, ProbeSettings(base_url=base_url, model=MODEL, **settings), WORKLOAD
            )

    return asyncio.run(scenario())


def answering(events: list[str], headers: dict | None = None):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events, headers)

    return handler


def answering_rounds(*rounds: list[str]):
    """Each request answered with the next of `rounds`, the last one from there on."""
    requests = []

    async def handler(request: web.Request) -> web.StreamResponse:
        requests.append(request)
        return await sse(request, rounds[min(len(requests), len(rounds)) - 1])

    return handler


def replying(body: dict, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler


ERROR_OBJECT = {"error": {"message": f"Incorrect API key provided: {KEY}", "code": "invalid_api_key"}}
COMPLETION = {"choices": [{"message": {"content": "hi"}}], "usage": USAGE}
STREAM_ERROR = "stream_error"


@pytest.mark.parametrize(
    "handler, status, kind, detail",
    [
        pytest.param(
            replying(ERROR_OBJECT), 200, "bad_response", "no `choices` in the answer: {", id="error"
        ),
        pytest.param(
            replying(ERROR_OBJECT, 401), 401, "unauthorized", "provided: [redacted]", id="key-echoed"
        ),
        pytest.param(
            replying({"e": f"Bearer {KEY}"}, 502), 502, "http_error", "Bearer [redacted]", id="bearer"
        ),
        pytest.param(
            answering([ANSWER[1], "{no json"]), 200, STREAM_ERROR, "malformed chunk: {no", id="garbled"
        ),
        pytest.param(answering(['{"usage": 5}', "[DONE]"]), 200, STREAM_ERROR, "malformed chunk", id="usage"),
        pytest.param(
            answering(['{"error": {}}']), 200, STREAM_ERROR, "error in the stream", id="error-chunk"
        ),
        pytest.param(answering(ANSWER[:3]), 200, STREAM_ERROR, "ended before [DONE]", id="cut-short"),
        pytest.param(replying(COMPLETION), 200, STREAM_ERROR, "a whole completion came back", id="no-stream"),
    ],
)
def test_broken_answers_are_classified_and_redacted(handler, status, kind, detail):
    session = against(handler, api_key=KEY)

    (failed,) = session.rounds
    assert (failed.status, failed.error_kind) == (status, kind)
    assert detail in failed.error_detail, failed.error_detail
    assert KEY not in failed.error_detail and len(failed.error_detail) <= 200


def test_a_round_failing_later_keeps_the_rounds_before_it():
    session = against(answering_rounds(ANSWER, ANSWER[:2]))
    assert [(r.round, r.error_kind) for r in session.rounds] == [(1, None), (2, "stream_error")]
    assert session.error_kind == "stream_error" and not session.ok


def test_a_hanging_server_times_out_within_the_round_cap():
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    started = time.monotonic()
    session = against(hang, timeout_seconds=0.3)
    assert time.monotonic() - started < 3
    assert [r.error_kind for r in session.rounds] == ["timeout"]


def test_tls_to_a_plain_http_port_is_a_tls_mismatch_quoting_its_answer():
    (failed,) = against(answering(ANSWER), scheme="https").rounds
    assert failed.error_kind == "tls_mismatch"
    assert failed.error_detail.endswith(
        ": the server answered the TLS handshake with no TLS, as a plain-HTTP server does: use http:// "
        "(it sent 'HTTP/1.0 400 Bad Request')"  # aiohttp's answer
    ), failed.error_detail


NGINX_TLS_PORT = (
    b"<html><head><title>400 The plain HTTP request was sent to HTTPS port</title></head><body>"
    b"<center><h1>400 Bad Request</h1></center></body></html>"
)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
STREAM_BODY = b"".join(b"data: %s\n\n" % event.encode() for event in ANSWER)


def raw_round(answer: bytes, **settings) -> RoundResult:
    """The one round of a session through a server that answers `answer`, byte for byte."""
    with loopback_http(answering_bytes(answer)) as url:
        (session,) = probe(url, [Conversation("Be brief.", ("a question",))], **settings)
    return session.rounds[0]


@pytest.mark.parametrize(
    "answer, status, kind, detail",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n", None, "protocol_error",
                     "a header block over 65536 bytes", id="200-KB-head"),
        pytest.param(b"HTTP/1.1 abc OK\r\n\r\n", None, "protocol_error",
                     "invalid status line 'HTTP/1.1 abc OK'", id="status-abc"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", None, "protocol_error",
                     "invalid Content-Length '-1'", id="content-length-minus-1"),
        pytest.param(STREAM_HEAD + b"Content-Encoding: gzip\r\n\r\n" + gzip.compress(STREAM_BODY), 200,
                     "protocol_error", "a body in Content-Encoding 'gzip', which was not asked", id="gzip"),
        pytest.param(b"\x15\x03\x01\x00\x02\x02\x46", None, "tls_mismatch", ": the port speaks TLS: use https://",
                     id="tls-alert"),
        pytest.param(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s"
            % (len(NGINX_TLS_PORT), NGINX_TLS_PORT),
            400,
            "tls_mismatch",
            "the port speaks TLS: use https:// (HTTP 400: <html><head><title>400 The plain HTTP request",
            id="nginx-400",
        ),
    ],
)  # fmt: skip
def test_an_answer_that_is_no_http_or_comes_from_a_tls_port_is_named_so(answer, status, kind, detail):
    failed = raw_round(answer)
    assert (failed.status, failed.error_kind) == (status, kind)
    assert detail in failed.error_detail, failed.error_detail


def test_a_gateway_sending_non_ascii_headers_is_probed_and_its_backend_named(capsys):
    head = STREAM_HEAD + b"Server: caf\xc3\xa9-gateway\r\nX-Upstream: r\xff1\r\n\r\n"
    with loopback_http(answering_bytes(head + STREAM_BODY)) as url:
        code = main(
            ["probe", "--base-url", url, "--model", MODEL, "--sessions", "1", "--rounds", "2", "--json"]
        )
    (session,) = json.loads(capsys.readouterr().out)["sessions"]
    assert code == 0 and session["ok"] and session["backends"] == ["r\xff1", "r\xff1"]


def test_a_secret_in_a_header_with_odd_bytes_is_still_redacted():
    head = STREAM_HEAD + f"X-Upstream: {KEY}".encode() + b"\xff\r\nX-Session-Id: \xe9" + KEY.encode()
    round_ = raw_round(head + b"\r\n\r\n" + STREAM_BODY, api_key=KEY)
    assert round_.ok and (round_.backend, round_.session_id_returned) == ("[redacted]", "[redacted]")


def test_an_unforeseen_exception_in_a_round_is_an_internal_error_saying_where(monkeypatch):
    def broken(*args) -> None:
        raise RuntimeError(f"a bug, near {KEY}")

    monkeypatch.setattr(probe_module, "_read_chunk", broken)
    failed = raw_round(STREAM_HEAD + b"\r\n" + STREAM_BODY, api_key=KEY)
    assert (failed.error_kind, failed.status) == ("internal_error", 200)
    assert re.fullmatch(r"RuntimeError at test_probe\.py:\d+: a bug, near \[redacted\]", failed.error_detail)


def test_each_round_sends_the_system_prompt_the_history_and_the_answers_received():
    seen = []

    async def gateway(request: web.Request) -> web.StreamResponse:
        seen.append((dict(request.headers), await request.json()))
        session = request.headers.get("X-Session-Id") or "gw-1"
        return await sse(request, ANSWER, {"X-Session-Id": session})

    session = against(gateway, session_mode="server", api_key=KEY)

    assert [(r.session_id_sent, r.session_id_returned) for r in session.rounds] == [
        (None, "gw-1"),
        ("gw-1", "gw-1"),
        ("gw-1", "gw-1"),
    ]
    headers, body = seen[2]
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert (body["model"], body["stream"], body["stream_options"]) == (MODEL, True, {"include_usage": True})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "third question"},
    ]
    # The fake's prompts do not grow, so the ideal is capped below each round's 40 prompt tokens.
    assert [(r.prompt_tokens, r.cached_tokens, r.ideal_cached_tokens) for r in session.rounds] == [
        (40, 32, 0),
        (40, 32, 32),
        (40, 32, 32),
    ]
    assert all(0 < r.ttft_seconds <= r.total_seconds for r in session.rounds)


def test_a_sessions_rounds_share_one_kept_alive_connection():
    """The end of the stream (its last chunk, after [DONE]) is read, so that the connection goes back
    to the pool instead of each round connecting anew."""
    clients = []

    async def gateway(request: web.Request) -> web.StreamResponse:
        clients.append(request.transport.get_extra_info("peername"))
        return await sse(request, ANSWER)

    session = against(gateway)
    assert session.ok and len(clients) == 3
    assert len(set(clients)) == 1, clients


def test_a_stream_held_open_after_done_still_answers_its_round(monkeypatch):
    """[DONE] ends the round; a server that then keeps the response open costs the connection only."""
    monkeypatch.setattr("kvwatch.collectors.probe.session.END_GRACE_SECONDS", 0.05)
    clients = []

    async def gateway(request: web.Request) -> web.StreamResponse:
        clients.append(request.transport.get_extra_info("peername"))
        response = await sse(request, ANSWER)
        await asyncio.sleep(30)  # cancelled when the client goes
        return response

    session = against(gateway, timeout_seconds=20)
    assert [r.error_kind for r in session.rounds] == [None, None, None]
    assert len(set(clients)) == 3


def test_server_mode_sends_no_session_header_when_no_gateway_assigns_one():
    seen = []

    async def engine(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Session-Id"))
        return await sse(request, ANSWER)

    session = against(engine, session_mode="server")
    assert seen == [None, None, None] and session.session_id is None and session.ok


def test_server_mode_sends_a_non_ascii_session_id_back_as_the_gateway_sent_it():
    seen = []

    async def gateway(request: web.Request) -> web.StreamResponse:
        seen.append(request.raw_headers)
        return await sse(request, ANSWER, headers={"X-Session-Id": "sé-1"})  # aiohttp writes it in UTF-8

    session = against(gateway, session_mode="server")
    sent = [{name.lower(): value for name, value in raw}.get(b"x-session-id") for raw in seen]
    assert sent == [None, "sé-1".encode(), "sé-1".encode()]
    assert session.ok and session.session_id == "sé-1" and session.session_id_echoed


# Dynamo's worker id object: the decode worker holds the KV cache after a disaggregated prefill.
DYNAMO_WORKER = {
    "prefill_worker_id": 7587889719553542,
    "prefill_dp_rank": 0,
    "decode_worker_id": 7587889719553617,
    "decode_dp_rank": 1,
}
AGGREGATED_WORKER = {
    "prefill_worker_id": 5,
    "prefill_dp_rank": 0,
    "decode_worker_id": None,
    "decode_dp_rank": None,
}


def dynamo_stream(asked: bool) -> list[str]:
    """A stream as NVIDIA Dynamo's frontend sends it: `nvext.worker_id` in every chunk and
    `nvext.timing` in the last, only when the request asked for them with `nvext.extra_fields`."""
    head = {"id": "chatcmpl-5b2d", "object": "chat.completion.chunk", "created": 1796122205, "model": MODEL}
    worker = {"nvext": {"worker_id": DYNAMO_WORKER}} if asked else {}
    timing = {"ttft_ms": 41.7, "prefill_time_ms": 38.2, "kv_hit_rate": 0.8} if asked else None
    deltas = [{"role": "assistant", "content": ""}, {"content": "hello"}, {"content": " world"}]
    chunks = [
        {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}], **worker} for d in deltas
    ]
    last = {**head, "choices": [], "usage": USAGE, **worker}
    if timing:
        last["nvext"] = {**last["nvext"], "timing": timing}
    return [*map(json.dumps, [*chunks, last]), "[DONE]"]


@pytest.mark.parametrize("router", [None, "dynamo"])
def test_a_dynamo_streams_decode_worker_id_is_the_backend_only_when_asked_for(router):
    bodies = []

    async def dynamo(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        asked = "worker_id" in body.get("nvext", {}).get("extra_fields", [])
        return await sse(request, dynamo_stream(asked))

    session = against(dynamo, router=router)

    assert session.ok and len(bodies) == 3
    if router == "dynamo":
        assert all(b["nvext"] == {"extra_fields": ["worker_id", "timing"]} for b in bodies)
        assert [r.backend for r in session.rounds] == ["7587889719553617"] * 3
    else:  # a strict OpenAI-compatible API would reject an unknown field
        assert all("nvext" not in b for b in bodies)
        assert [r.backend for r in session.rounds] == [None] * 3


def test_an_unknown_router_is_refused():
    with pytest.raises(ValueError, match='unknown router "envoy"; known: dynamo'):
        ProbeSettings(base_url="http://gw", model=MODEL, router="envoy")


def stream_of(*deltas: dict, pause: float = 0.0):
    """A handler streaming one chunk per delta, `pause` seconds apart, then the usage and [DONE]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delta in deltas:
            await response.write(f"data: {json.dumps({'choices': [{'delta': delta}]})}\n\n".encode())
            await asyncio.sleep(pause)
        await response.write(
            f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\ndata: [DONE]\n\n".encode()
        )
        return response

    return handler


@pytest.mark.parametrize("thinking", ["reasoning_content", "reasoning"])
def test_ttft_is_the_first_thinking_token_and_the_answer_text_comes_second(thinking):
    pause = 0.2
    session = against(
        stream_of({"role": "assistant", "content": ""}, {thinking: "Let me"}, {"content": "hi"}, pause=pause)
    )

    assert session.ok
    for r in session.rounds:
        assert r.first_content_seconds - r.ttft_seconds >= pause * 0.8, r
        assert r.ttft_seconds >= pause * 0.8, r  # the empty opening delta, sent at once, is no token


def test_a_tool_call_is_a_first_token_with_no_answer_text():
    call = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    session = against(stream_of({"role": "assistant"}, {"tool_calls": [call]}))

    assert session.ok
    assert all(r.ttft_seconds is not None and r.first_content_seconds is None for r in session.rounds)


def test_no_identity_is_said_so_and_stickiness_comes_from_the_cached_tokens(capsys):
    """llm-d's session_id strategy routes on X-Session-Id and names no replica in the answer."""

    async def scenario():
        async with fake_server(answering(ANSWER)) as url:
            return await asyncio.to_thread(
                main, ["probe", "--base-url", url, *SMALL, "--rounds", "3", "--sessions", "1"]
            )

    assert asyncio.run(scenario()) == 0
    out = capsys.readouterr().out
    assert "No response named its replica (X-Upstream, " in out
    assert "stickiness is inferred from the cached tokens" in out and " sticky " in out


def session_token(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "headers, extra_chunk, settings, backend",
    [
        pytest.param({"X-Upstream": "10.0.0.1:80, 10.0.0.2:80"}, None, {}, "10.0.0.2:80", id="failover"),
        pytest.param({"target-pod": "pod-a", "X-Worker-Id": "w7"}, None, {}, "w7", id="first-wins"),
        pytest.param({"target-pod": "pod-a"}, None, {}, "pod-a", id="aibrix"),
        pytest.param({"x-session-token": session_token("llm-d/decode-0")}, None, {}, "decode-0", id="llm-d"),
        pytest.param({"x-session-token": "not base64!"}, None, {}, "not base64!", id="llm-d-raw"),
        pytest.param(
            {"x-smg-routed-worker-id": "http://10.0.0.7:8000"}, None, {}, "http://10.0.0.7:8000", id="smg"
        ),
        pytest.param({}, {"choices": [], "nvext": {"worker_id": 42}}, {}, "42", id="dynamo-bare-id"),
        pytest.param(
            {}, {"choices": [], "nvext": {"worker_id": DYNAMO_WORKER}}, {}, "7587889719553617", id="dynamo"
        ),
        pytest.param(
            {}, {"choices": [], "nvext": {"worker_id": AGGREGATED_WORKER}}, {}, "5", id="dynamo-aggregated"
        ),
        pytest.param(
            {"X-Pod": "gpu-3", "X-Worker-Id": "w"}, None, {"backend_headers": ("X-Pod",)}, "gpu-3", id="set"
        ),
        pytest.param({}, None, {}, None, id="unknown"),
    ],
)
def test_backend_identity_conventions(headers, extra_chunk, settings, backend):
    events = ANSWER[:-1] + ([json.dumps(extra_chunk)] if extra_chunk else []) + ["[DONE]"]
    session = against(answering(events, headers=headers), **settings)

    assert [r.backend for r in session.rounds] == [backend] * 3
    # Without a backend name, cached tokens tell: each warm round reused all a pinned replica would.
    assert session.sticky is True


# A misbehaving server: absurd usage, endless answers, the key echoed back in every form.


def with_usage(**usage) -> list[str]:
    """ANSWER with `usage` over its usage."""
    return [*ANSWER[:3], json.dumps({"choices": [], "usage": {**USAGE, **usage}}), "[DONE]"]


@pytest.mark.parametrize(
    "usage, detail",
    [
        pytest.param({"prompt_tokens": 1e20}, "usage.prompt_tokens is 1e+20, not a token count", id="1e20"),
        pytest.param(
            {"prompt_tokens": 10**400}, "usage.prompt_tokens is 1.00e+400, not a token count", id="huge"
        ),
        pytest.param(
            {"prompt_tokens": 2**53}, "usage.prompt_tokens is 9007199254740992, not a token count", id="2^53"
        ),
        pytest.param(
            {"completion_tokens": -2}, "usage.completion_tokens is -2, not a token count", id="negative"
        ),
        pytest.param({"prompt_tokens": "40"}, 'usage.prompt_tokens is "40", not a token count', id="string"),
        pytest.param(
            {"completion_tokens": True}, "usage.completion_tokens is true, not a token count", id="bool"
        ),
        pytest.param(
            {"prompt_tokens_details": {"cached_tokens": -1}},
            "usage.prompt_tokens_details.cached_tokens is -1, not a token count",
            id="negative-cached",
        ),
        pytest.param(
            {"prompt_tokens_details": {"cached_tokens": 41}},
            "usage.prompt_tokens_details.cached_tokens is 41, more than usage.prompt_tokens (40)",
            id="cached-over-prompt",
        ),
    ],
)
def test_usage_that_is_no_token_count_fails_its_round_and_keeps_the_rounds_before(usage, detail):
    session = against(answering_rounds(ANSWER, with_usage(**usage)))

    assert [(r.round, r.error_kind) for r in session.rounds] == [(1, None), (2, "stream_error")]
    failed = session.rounds[1]
    assert failed.error_detail == detail
    assert (failed.prompt_tokens, failed.cached_tokens, failed.completion_tokens) == (None, None, None)


def test_the_largest_token_count_is_stored_and_exported_and_a_larger_one_breaks_neither(tmp_path):
    largest = MAX_TOKEN_COUNT - 1
    at_most = {
        "prompt_tokens": largest,
        "completion_tokens": largest,
        "prompt_tokens_details": {"cached_tokens": largest},
    }
    session = against(answering_rounds(with_usage(**at_most), with_usage(prompt_tokens=10**400)))

    with Store(tmp_path / "kvwatch.db") as store:
        assert store.session(store.add_session(session)) == session
    results, registry = ProbeResults(), CollectorRegistry()
    registry.register(ProbeCollector(results, {}))
    results.add_run(("probe", "unknown"), [session], session.started_at, session.finished_at)
    assert b"kvwatch_probe_prompt_tokens_total" in generate_latest(registry)  # what /metrics answers
    labels = {"target": "probe", "route_mode": "unknown", "round": "1"}
    assert registry.get_sample_value("kvwatch_probe_cached_tokens_total", labels) == largest
    assert [r.error_kind for r in session.rounds] == [None, "stream_error"]


def endless(piece: bytes):
    """A server streaming `piece` over and over; for 30 s at most, so that even a probe that never stops
    ends, if only by its timeout."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        deadline = time.monotonic() + 30
        with suppress(ConnectionResetError):  # the probe hung up, as it must
            while time.monotonic() < deadline:
                await response.write(piece)
        return response

    return handler


BIG_CHUNK = json.dumps({"choices": [{"delta": {"content": "x" * 4096}}]})
TINY_CHUNK = json.dumps({"choices": [{"delta": {"content": "x"}}]})


@pytest.mark.parametrize(
    "piece, detail",
    [
        pytest.param(
            f"data: {BIG_CHUNK}\n\n".encode(), f"answer over {MAX_ANSWER_BYTES} bytes", id="content"
        ),
        pytest.param(
            f"data: {TINY_CHUNK}\n\n".encode() * 100, f"more than {MAX_STREAM_LINES} lines", id="chunks"
        ),
        pytest.param(b": keep-alive\n" * 1000, f"more than {MAX_STREAM_LINES} lines", id="keep-alives"),
    ],
)
def test_an_endless_answer_stops_at_its_cap_long_before_the_timeout(piece, detail):
    """The cap ends the round, not the timeout: a round the timeout ended would be `timeout`. How soon the
    cap comes is a speed claim (benchmarks/), not asserted here: a loaded machine only makes it later."""
    session = against(endless(piece), timeout_seconds=120)

    (failed,) = session.rounds
    assert failed.error_kind == "stream_error" and detail in failed.error_detail, failed.error_detail


# Characters that JSON, URLs and both base64 alphabets each encode, and letters for the case to change.
ECHOED_KEY = 'kvw/Se+cr"et\\Key=5f1c0e?9a>c'


def echoed_forms(key: str) -> list[str]:
    """The key as a server may echo it, made here independently of the redaction under test."""
    standard, urlsafe = (
        base64.b64encode(key.encode()).decode(),
        base64.urlsafe_b64encode(key.encode()).decode(),
    )
    assert "+" in standard and "/" in standard and standard.endswith("=") and standard != urlsafe
    forms = [key, json.dumps(key)[1:-1], quote(key, safe=""), key.upper(), key.lower(), standard, urlsafe]
    basic_auth = base64.b64encode(f"user:{key}".encode()).decode()  # the key's base64 inside another's
    return [*forms, standard.rstrip("="), urlsafe.rstrip("="), basic_auth]


def leaks(text: str, forms: Iterable[str], size: int = 10) -> set[str]:
    """The pieces of `size` characters of any form of the key that `text` shows, in any case."""
    pieces = {form[i : i + size] for form in forms for i in range(len(form) - size + 1)}
    return {piece for piece in pieces if piece.lower() in text.lower()}


def echoing(forms: list[str]):
    """Session n gets form n of the key echoed: as its backend header and its session id (round 1; a form
    that is no ASCII, which no header carries, as in round 2), as the JSON field naming the backend
    (round 2), and in the error that ends it (round 3)."""
    requests: dict[str, int] = {}  # by session id, in the order the sessions came

    async def handler(request: web.Request) -> web.StreamResponse:
        session = request.headers["X-Session-Id"]
        requests[session] = requests.get(session, 0) + 1
        form = forms[list(requests).index(session) % len(forms)]
        if requests[session] == 1 and form.isascii():
            return await sse(request, ANSWER, {"X-Worker-Id": f"worker-{form}", "X-Session-Id": form})
        if requests[session] <= 2:
            named = json.dumps({"choices": [], "nvext": {"worker_id": f"worker-{form}"}})
            return await sse(request, [*ANSWER[:-1], named, "[DONE]"], {"X-Session-Id": session})
        return await sse(request, ['{"error": {"message": "Incorrect API key provided: ' + form + '"}}'])

    return handler


async def run_kvwatch(*args: str, env: dict | None = None) -> tuple[int | None, str, str]:
    """`kvwatch ARGS` in a process of its own: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvwatch.cli.main", *args, cwd=REPO, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, out.decode(), err.decode()


# A key with a well-known prefix: a server may echo the rest of it alone, or escape it character by character.
PREFIXED_KEY = "sk-proj-Kv7wQ2mZ9xR4tB8nL3pD"


def prefixed_forms(key: str) -> list[str]:
    """The key's core (its prefix cut), and the key escaped, encoded or split as a server may echo it."""
    core = key.removeprefix("sk-proj-")
    escaped = "".join(f"\\u{ord(c):04x}" for c in key)
    half_escaped = "".join(f"\\u{ord(c):04X}" if i % 3 else c for i, c in enumerate(key))
    entities = "".join(f"&#{ord(c)};" if i % 2 else f"&#x{ord(c):x};" for i, c in enumerate(key))
    return [
        core,
        f"sk-{core}",  # another prefix
        escaped,
        half_escaped,
        "".join(f"\\u{ord(c):04x}" for c in core),
        key.encode().hex(),
        entities,
        base64.b32encode(key.encode()).decode(),
        base64.b32encode(f"user:{key}".encode()).decode().rstrip("="),
        "\u200b".join(key),
    ]


def strings(value: object) -> Iterator[str]:
    """Every string in a parsed JSON document: `--json` escapes what the grep must see unescaped."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from strings(item)


@pytest.mark.parametrize(
    "key, forms",
    [(ECHOED_KEY, echoed_forms(ECHOED_KEY)), (PREFIXED_KEY, prefixed_forms(PREFIXED_KEY))],
    ids=["encoded", "core-and-escaped"],
)
def test_a_key_echoed_in_any_form_reaches_no_output_label_or_store(key, forms, tmp_path):
    sessions = ["--sessions", str(len(forms)), "--rounds", "3"]

    async def scenario() -> tuple[list[tuple], list[SessionResult]]:
        async with fake_server(echoing(forms)) as url:
            flags = ["probe", "--base-url", url, *SMALL, *sessions, "--api-key-env", "KVW_TEST_KEY"]
            env = {"KVW_TEST_KEY": key}
            runs = [await run_kvwatch(*flags, *json_flag, env=env) for json_flag in ([], ["--json"])]
            settings = ProbeSettings(base_url=url, model=MODEL, api_key=key, max_tokens=8)
            return runs, await run_sessions(settings, synthetic(3, 50, 10, 0, len(forms)))

    runs, results = asyncio.run(scenario())
    assert [code for code, _, _ in runs] == [1, 1], runs  # every session fails in round 3
    report = json.loads(runs[1][1])
    assert [s["backends"] for s in report["sessions"]] == [["[redacted]", "[redacted]"]] * len(forms)
    assert all("[redacted]" in s["rounds"][2]["error_detail"] for s in report["sessions"])
    with Store(tmp_path / "kvwatch.db") as store:
        for session in results:
            store.add_session(session)
        rows = store.sessions() + store.rounds()
    exporter, registry = ProbeResults(), CollectorRegistry()
    registry.register(ProbeCollector(exporter, {}))
    exporter.add_run(("probe", "unknown"), results, 0, 1)

    stored = "\n".join(str(value) for row in rows for value in row.values())
    printed = [out + err for _, out, err in runs] + ["\n".join(strings(report))]
    for output in (*printed, stored, generate_latest(registry).decode()):
        assert not leaks(output, forms), output


# The command line.


def test_cli_failure_exits_1_with_a_hint_per_error_kind(capsys):
    nowhere = f"http://127.0.0.1:{free_port()}"
    code = main(["probe", "--base-url", nowhere, "--model", MODEL, "--sessions", "2"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.splitlines()[1] == "KV block: 16 tokens (default; no engine evidence)"
    assert captured.out.splitlines()[4].split() == "1 - 0 / 0 unknown connection_refused x2".split()
    assert captured.err.splitlines()[0] == "kvwatch probe: 2 of 2 sessions failed"
    assert captured.err.splitlines()[1].startswith("  connection_refused (cannot connect to 127.0.0.1:")
    assert captured.err.splitlines()[1].endswith(HINTS["connection_refused"])
    assert set(HINTS) == set(ERROR_KINDS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rounds", "0", "--timeout", "-1"], "--rounds must be positive; --timeout must be positive"),
        (["--api-key-env", "KVW_TEST_UNSET"], "environment variable KVW_TEST_UNSET is not set or empty"),
        (["--base-url", "127.0.0.1:8000"], "base_url must start with http:// or https://"),
        (
            ["--base-url", "http://kvw:pw@127.0.0.1:99999"],
            "base_url http://kvw:[redacted]@127.0.0.1:99999 is not a valid URL: port 99999 is not 1 to 65535",
        ),
        (["--sharegpt", "/nonexistent.json"], "/nonexistent.json: no such file"),
    ],
)
def test_cli_rejects_bad_arguments_with_exit_2(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("KVW_TEST_UNSET", raising=False)
    assert main(["probe", "--base-url", "http://127.0.0.1:1", "--model", MODEL, *flags]) == 2
    assert capsys.readouterr().err == f"kvwatch probe: {message}\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-key", KEY], "the API key is never taken from the command line"),
        ([f"--api-key={KEY}"], "the API key is never taken from the command line"),
        (["--api-key-env", "X", "--api-key-file", "y"], "argument --api-key-file: not allowed with argument"),
        (["--session-mode", "sticky"], "argument --session-mode: invalid choice: 'sticky'"),
    ],
    ids=["api-key", "api-key=", "env-and-file", "bad-mode"],
)
def test_argparse_errors_exit_2_and_a_key_on_argv_is_refused_unrepeated(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["probe", "--base-url", "http://127.0.0.1:1", "--model", MODEL, *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and KEY not in err


# The model, when --model is not given.

LISTINGS = {
    "/one/v1/models": (200, {"object": "list", "data": [{"id": "m1"}]}),
    "/two/v1/models": (200, {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}),
    "/none/v1/models": (200, {"object": "list", "data": []}),
    "/broken/v1/models": (500, {"error": "boom"}),
    "/other/v1/models": (200, {"models": ["m1"]}),
}


@pytest.fixture(scope="module")
def listings() -> Iterator[str]:
    """A loopback server with a model listing under each path of LISTINGS, and one that never answers."""
    release = threading.Event()

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if self.path == "/silent/v1/models":
                release.wait(timeout=30)
                return
            status, answer = LISTINGS.get(self.path, (404, {}))
            self.answer(status, json.dumps(answer).encode())

    with loopback_http(Handler) as url:
        yield url
        release.set()


def test_the_one_model_served_is_chosen_and_said(listings, capsys):
    assert chosen_model(None, f"{listings}/one", None, 5, "probe") == "m1"
    assert capsys.readouterr().err == f"kvwatch probe: model m1, the one {listings}/one/v1/models lists\n"
    assert chosen_model("given", "http://127.0.0.1:1", None, 5, "probe") == "given"  # asks nothing


@pytest.mark.parametrize(
    "path, message",
    [
        ("two", "/two/v1/models lists 2 models (m1, m2): name the one to use with --model"),
        ("none", "/none/v1/models lists no model: name the one to use with --model"),
        ("broken", "/broken/v1/models answered HTTP 500: name the model with --model"),
        # A server that lists no models and answers no chat request is said to be no API.
        ("other", "/other/v1/models answers no model list: no `data` of objects with an `id`; the server"),
        ("silent", "/silent/v1/models failed: no complete answer within 0.5 s: name the model with --model"),
    ],
)
def test_no_model_chosen_when_the_route_serves_several_or_none_or_its_listing_fails(listings, path, message):
    started = time.monotonic()
    with pytest.raises(ValueError) as raised:
        chosen_model(None, f"{listings}/{path}", None, 0.5, "probe")
    assert message in str(raised.value) and time.monotonic() - started < 5


def test_a_refused_listing_says_so():
    with pytest.raises(ValueError) as raised:
        chosen_model(None, f"http://127.0.0.1:{free_port()}", None, 5, "probe")
    assert str(raised.value).endswith("/v1/models failed: Connection refused: name the model with --model")


@pytest.mark.parametrize(
    "command",
    [
        ["probe", "--base-url"],
        ["doctor", "--base-url"],
        ["experiment", "--out", "{tmp}", "--b", "{url}", "--a"],
    ],
    ids=lambda command: command[0],
)
def test_every_command_without_a_model_asks_for_one_among_those_served(listings, command, tmp_path, capsys):
    args = [arg.format(tmp=tmp_path, url=f"{listings}/two") for arg in command]
    assert main([*args, f"{listings}/two"]) == 2
    listed = f"{listings}/two/v1/models lists 2 models (m1, m2)"
    assert capsys.readouterr().err == f"kvwatch {command[0]}: {listed}: name the one to use with --model\n"


def test_a_password_in_the_base_url_is_never_printed(tmp_path):
    password = "pw-9d1e5c7a3f0b"

    async def scenario() -> list[tuple[int | None, str, str]]:
        async with fake_server(answering(ANSWER)) as url:
            base = url.replace("://", f"://kvw:{password}@")
            experiment = ["experiment", "--a", base, "--b", base, "--out", str(tmp_path), *SMALL]
            return await asyncio.gather(
                *(run_kvwatch(command, "--base-url", base, "--model", MODEL, *flags)
                  for command in ("probe", "doctor") for flags in ([], ["--json"])),
                run_kvwatch(*experiment, "--sessions", "2", "--rounds", "2"),
            )  # fmt: skip

    runs = asyncio.run(scenario())
    assert [code for code, _, _ in runs[:2] + runs[4:]] == [0, 0, 0], runs  # the doctor may find causes
    assert not [err for _, _, err in runs if "Traceback" in err]
    assert "kvw:[redacted]@127.0.0.1:" in runs[0][1].splitlines()[0]
    written = [path.read_bytes().decode(errors="replace") for path in tmp_path.iterdir()]
    assert not [text for _, out, err in runs for text in (out, err, *written) if password in text]


def test_a_token_in_the_base_urls_query_is_sent_after_the_path_and_never_printed():
    token = "tk-3e8a1c5f9b7d"
    received: list[str] = []  # each request's path and query, as the server got them

    async def handler(request: web.Request) -> web.StreamResponse:
        received.append(request.path_qs)
        return await sse(request, ANSWER)

    async def scenario() -> list[tuple[int | None, str, str]]:
        async with fake_server(handler) as url:
            base = f"{url}/?token={token}"
            probe = ["probe", "--base-url", base, *SMALL, "--sessions", "1", "--rounds", "2"]
            return [await run_kvwatch(*probe, *flags) for flags in ([], ["--json"])]

    runs = asyncio.run(scenario())
    assert [code for code, _, _ in runs] == [0, 0], runs
    assert set(received) == {f"/v1/chat/completions?token={token}"}
    assert "/v1/chat/completions?token=[redacted]" in runs[0][1].splitlines()[0]
    assert not [text for _, out, err in runs for text in (out, err) if token in text]


def test_a_key_file_that_is_not_text_is_named_without_quoting_the_key(tmp_path):
    (tmp_path / "binary").write_bytes(b"sk-\xff\xfe-secret")
    with pytest.raises(ValueError) as raised:
        resolve_api_key(None, tmp_path / "binary")
    assert str(raised.value) == f"API key file {tmp_path}/binary is not UTF-8 text"


def test_an_api_key_file_that_holds_no_key_is_refused_at_once_in_one_line(not_a_secret_file):
    path, problem = not_a_secret_file
    probed = kvwatch_bounded("probe", "--base-url", "http://127.0.0.1:9", *SMALL, "--api-key-file", str(path))
    said = f"kvwatch probe: API key file {path} {problem.format(secret='API key')}\n"
    assert (probed.returncode, probed.stderr) == (2, said)  # a bad argument
