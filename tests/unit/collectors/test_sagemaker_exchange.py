"""The sagemaker target's exchange through botocore's real client: its event stream as SSE, its sessions."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
import types
from collections.abc import Iterator

import pytest
from botocore.eventstream import ChecksumMismatch
from botocore.exceptions import EventStreamError
from botocore.response import StreamingBody
from sagemaker_kit import (
    CONVERSATION,
    Scripted,
    answer_text,
    closed,
    converse,
    opened,
    parts,
    refused,
    round_events,
    settings,
    streamed,
)

from kvwatch.collectors.probe.blocksize import with_block_size
from kvwatch.collectors.probe.conversation import run_conversation
from kvwatch.collectors.probe.targets import sagemaker as sagemaker_module
from kvwatch.collectors.probe.targets.sagemaker import (
    Runtime,
    SageMakerEndpoint,
    SageMakerExchange,
    parse_new_session,
    replica_of,
)
from kvwatch.collectors.probe.workload import Conversation

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
