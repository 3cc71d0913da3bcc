"""The probe's rounds against small fake servers that fail or misbehave: broken, absurd, endless answers."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import time
from contextlib import suppress

import pytest
from aiohttp import web
from loopback import answering_bytes, loopback_http
from probe_fakes import (
    ANSWER,
    ERROR_OBJECT,
    KEY,
    MODEL,
    USAGE,
    against,
    answering,
    conversations,
    probe,
    replying,
    sse,
)
from prometheus_client import CollectorRegistry, generate_latest

from kvwatch.cli.main import main
from kvwatch.collectors.probe import session as probe_module
from kvwatch.collectors.probe.records import RoundResult
from kvwatch.collectors.probe.session import MAX_ANSWER_BYTES, MAX_STREAM_LINES, MAX_TOKEN_COUNT
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.serve.exporter import ProbeCollector, ProbeResults
from kvwatch.store.history import Store
from processes import free_port

# Error kinds, from replica faults and wrong settings.


def test_nothing_listening_is_connection_refused():
    (session,) = probe(f"http://127.0.0.1:{free_port()}", conversations(seed=9, sessions=1))
    (failed,) = session.rounds
    assert (failed.status, failed.error_kind) == (None, "connection_refused")
    assert failed.error_detail.startswith("cannot connect to 127.0.0.1:")


def answering_rounds(*rounds: list[str]):
    """Each request answered with the next of `rounds`, the last one from there on."""
    requests = []

    async def handler(request: web.Request) -> web.StreamResponse:
        requests.append(request)
        return await sse(request, rounds[min(len(requests), len(rounds)) - 1])

    return handler


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


# A misbehaving server: absurd usage, endless answers (the key echoed back in every form: test_probe_cli.py).


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
