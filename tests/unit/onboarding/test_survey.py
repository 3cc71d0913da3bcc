"""What `kvwatch init` learns from a gateway, against fake gateways on loopback: the session mode and the
identity convention come from what the answers carry, and every guess is said."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from loopback import chat_answer, serving

from kvwatch.onboarding import survey
from kvwatch.onboarding.survey import Request, Survey, SurveyError, Target, _survey
from kvwatch.prometheus.queries import ENGINE_TARGETS

MODEL = "m1"


def gateway(
    headers_for, seen: list | None = None, models: object = None, streams: bool = True
) -> web.Application:
    """A streaming chat route whose answers carry `headers_for(request headers)`; `seen` collects the
    request headers; `models` replaces the model list's answer (JSON, or its handler); without `streams`, a
    whole completion answers a request for a stream too."""

    async def chat(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(dict(request.headers))
        return await chat_answer(request, headers_for(request.headers), streams)

    listed = {"data": [{"id": MODEL}]} if models is None else models
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", listed if callable(listed) else lambda _: web.json_response(listed))
    return app


def survey_of(app: web.Application, **request) -> Survey:
    async def scenario() -> Survey:
        async with serving(app) as url:
            return await _survey(Request(base_url=url, **request))

    return asyncio.run(scenario())


def test_a_gateway_that_sets_its_own_session_id_gets_server_mode_and_smgs_worker_header():
    found = survey_of(
        gateway(lambda _: {"X-Session-Id": "gw-1", "x-smg-routed-worker-id": "http://10.0.0.1:8000"})
    )
    assert (found.model, found.session_mode, found.session_assigned) == (MODEL, "server", True)
    assert (found.identity_header, found.identity_convention) == ("x-smg-routed-worker-id", "smg")
    assert any("sets its own X-Session-Id" in line for line in found.assumed)


def test_a_gateway_that_echoes_nothing_and_names_no_replica_is_said_so():
    found = survey_of(gateway(lambda _: {}))
    assert (found.session_mode, found.session_echoed, found.identity_header) == ("client", False, None)
    said = "\n".join(found.assumed)
    assert "X-Session-Id is not echoed" in said and "no response header names the replica" in said
    assert "no --prometheus" in said


def test_an_echoing_gateway_keeps_client_mode_and_smg_is_probed_with_its_routing_key():
    seen: list[dict] = []
    echo = gateway(lambda sent: {"X-SMG-Routing-Key": sent.get("X-SMG-Routing-Key", "")}, seen)
    found = survey_of(echo, gateway="smg")
    assert (found.session_mode, found.session_echoed) == ("client", True)
    assert any("X-SMG-Routing-Key" in headers for headers in seen)


async def silent(_: web.Request) -> web.Response:
    await asyncio.sleep(30)
    raise AssertionError("the survey waited for a silent model list")


@pytest.mark.parametrize(
    "models, message",
    [
        (
            {"status": "success", "data": {"resultType": "vector"}},
            "/v1/models answered no model list: no `data` of objects with an `id`, where an "
            "OpenAI-compatible API lists its models",
        ),
        (
            lambda _: web.Response(text="<html><title>Grafana</title></html>", content_type="text/html"),
            "/v1/models answered no JSON, where an OpenAI-compatible API lists its models",
        ),
        (lambda _: web.json_response({}, status=503), "/v1/models answered HTTP 503"),
        (silent, "/v1/models failed: no complete answer within 0.5 s"),
        ({"data": []}, "the route lists no model"),
    ],
    ids=["json-without-a-list", "no-json", "error-status", "timeout", "empty-list"],
)
def test_a_route_without_a_model_list_is_refused_before_anything_is_written(monkeypatch, models, message):
    monkeypatch.setattr(survey, "TIMEOUT_S", 0.5)
    with pytest.raises(SurveyError) as raised:
        survey_of(gateway(lambda _: {}, models=models))
    assert message in str(raised.value)


def test_sessions_that_move_between_replicas_say_how_to_name_a_route_that_does_not_pin():
    served = iter(range(100))
    found = survey_of(
        gateway(
            lambda sent: {
                "X-Upstream": f"10.0.0.{next(served) % 2}:8000",
                "X-Session-Id": sent.get("X-Session-Id", ""),
            }
        )
    )
    assert found.sticky is False
    assert any("--route-mode round_robin" in line for line in found.assumed)


def test_a_route_that_does_not_stream_fails_the_survey_with_the_probes_hint():
    with pytest.raises(
        SurveyError,
        match=r"failed in round 1: stream_error \(a whole completion came back .*\); the event stream broke",
    ):
        survey_of(gateway(lambda _: {}, streams=False))


def test_smg_routes_are_manual_by_default():
    assert (Request("http://x", gateway="smg").route_mode, Request("http://x").route_mode) == (
        "manual",
        "affinity",
    )


def test_engines_whose_names_a_pipeline_rewrote_and_an_unknown_block_size_are_said():
    async def prometheus(request: web.Request) -> web.Response:
        engine = {"__name__": "vllm_num_requests_running", "instance": "10.0.0.7:8000", "job": "vllm"}
        series = [{"metric": engine, "value": [0, "1"]}] if request.query["query"] == ENGINE_TARGETS else []
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": series}})

    app = gateway(lambda sent: {"X-Session-Id": sent.get("X-Session-Id", "")})
    app.router.add_get("/api/v1/query", prometheus)

    async def scenario() -> Survey:
        async with serving(app) as url:
            return await _survey(Request(base_url=url, prometheus_url=url))

    found = asyncio.run(scenario())
    assert found.engines == [Target("10.0.0.7:8000", "vllm", None, "vllm")]
    said = "\n".join(found.assumed)
    assert "metric names arrive with ':' rewritten (vllm_num_requests_running)" in said
    assert "the KV block size: no engine told it, so 16 tokens" in said
