"""kvwatch's own share of the engines' tokens: each probe round's tokens as the engine counted them, failed
rounds included, counted the moment the round ends (serve/exporter.py ProbeResults.add_round)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from loopback import serving
from prometheus_client import CollectorRegistry
from test_store import round_result

from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.serve.exporter import ProbeCollector, ProbeResults

ROUTE = ("lab-affinity", "affinity")
LABELS = {"target": "lab-affinity", "route_mode": "affinity"}


def exported() -> tuple[ProbeResults, CollectorRegistry]:
    results, registry = ProbeResults(), CollectorRegistry()
    registry.register(ProbeCollector(results, {}))
    return results, registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_a_declared_route_exports_its_engine_tokens_and_unmetered_rounds_at_zero():
    results, registry = exported()
    results.declare(ROUTE, 2)
    assert value(registry, "kvwatch_probe_engine_prompt_tokens_total") == 0
    assert value(registry, "kvwatch_probe_engine_cached_tokens_total") == 0
    for missing in ("usage", "cached_tokens"):
        assert value(registry, "kvwatch_probe_unmetered_rounds_total", missing=missing) == 0


def test_every_round_with_a_usage_counts_its_tokens_failed_or_not_and_the_run_adds_none_twice():
    results, registry = exported()
    ok, cut = round_result(1), round_result(2, error_kind="stream_error", error_detail="cut")
    refused = round_result(3, status=401, error_kind="unauthorized", prompt_tokens=None, cached_tokens=None)
    no_usage = round_result(3, error_kind="stream_error", prompt_tokens=None, cached_tokens=None)
    no_cached = round_result(2, cached_tokens=None)
    for result in (ok, cut, refused, no_usage, no_cached):
        results.add_round(ROUTE, result)
    assert value(registry, "kvwatch_probe_engine_prompt_tokens_total") == 1200 + 2400 + 2400
    assert value(registry, "kvwatch_probe_engine_cached_tokens_total") == 0 + 1184
    assert value(registry, "kvwatch_probe_unmetered_rounds_total", missing="usage") == 1  # not the 401
    assert value(registry, "kvwatch_probe_unmetered_rounds_total", missing="cached_tokens") == 1
    # The per-round counters of successful rounds are the run's, at its end; the engine tokens stay.
    results.add_run(ROUTE, [SessionResult(*ROUTE, "s", 1000.0, 1010.0, (ok, cut))], 1000, 1010)
    assert value(registry, "kvwatch_probe_engine_prompt_tokens_total") == 6000
    assert value(registry, "kvwatch_probe_prompt_tokens_total", round="1") == 1200
    assert value(registry, "kvwatch_probe_prompt_tokens_total", round="2") is None  # the cut round failed


def test_a_conversation_hands_over_every_round_as_it_ends_a_cut_one_with_its_usage():
    """The engine counted round 2's prompt although its stream broke after the usage: so does kvwatch."""
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for chunk in (
            {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {"choices": [], "usage": usage},
        ):
            await answer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if len(body["messages"]) < 4:  # round 1 ends; round 2's stream is cut before its [DONE]
            await answer.write(b"data: [DONE]\n\n")
        return answer

    async def scenario() -> list:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        ended = []
        async with serving(app) as url, StreamClient() as client:
            settings = ProbeSettings(url, "m", target=ROUTE[0], route_mode=ROUTE[1])
            conversation = Conversation("system", ("one", "two", "three"))
            session = await run_session(client, settings, conversation, on_result=ended.append)
        return session, ended

    session, ended = asyncio.run(scenario())
    assert [r.error_kind for r in session.rounds] == [None, "stream_error"]
    assert ended == list(session.rounds)
    results, registry = exported()
    for result in ended:
        results.add_round(ROUTE, result)
    assert value(registry, "kvwatch_probe_engine_prompt_tokens_total") == 80
    assert value(registry, "kvwatch_probe_engine_cached_tokens_total") == 64
