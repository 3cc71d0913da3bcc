"""The probe's rounds and sessions against small fake servers: requests, connections, timing, backends."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from aiohttp import web
from probe_fakes import ANSWER, KEY, MODEL, SMALL, USAGE, against, answering, fake_server, sse

from kvwatch.cli.main import main
from kvwatch.collectors.probe.session import ProbeSettings


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
