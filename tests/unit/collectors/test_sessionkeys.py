"""Session keys as a family: the header a target's key puts the session id in, the config refusing an
unknown key, and the pin outcome a router reports (olla's X-Olla-Sticky-Session) recorded per round and
counted beside kvwatch's own stickiness."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

import pytest
from aiohttp import web
from loopback import chat_answer, serving
from prometheus_client import CollectorRegistry
from test_store import session

from kvwatch.cli import options
from kvwatch.collectors import sessionkeys
from kvwatch.collectors.probe.session import ProbeSettings, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.doctor import session_keys as doctor_session_keys
from kvwatch.doctor.route import Route, hash_key
from kvwatch.onboarding.survey import Request
from kvwatch.serve.exporter import ProbeCollector, ProbeResults
from kvwatch.serve.scheduler import probe_settings


def config_with(tmp_path, session: str):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(
        "targets:\n  - name: gw\n    base_url: http://127.0.0.1:9\n    model: m\n"
        f"    session: {session}\n"
        f"store:\n  path: {tmp_path / 'kvwatch.db'}\n"
    )
    return path


@pytest.mark.parametrize(
    ("session", "header"),
    [
        ("{key: dynamo}", "X-Dynamo-Session-ID"),
        ("{key: litellm}", "x-litellm-session-id"),
        ("{key: smg}", "X-SMG-Routing-Key"),
        ("{key: aiperf}", "X-Correlation-ID"),
        ("{key: olla}", "X-Session-Id"),
        ("{header: x-my-session}", "x-my-session"),
        ("{}", "X-Session-Id"),
    ],
)
def test_a_targets_key_names_the_header_its_session_id_travels_in(tmp_path, session, header):
    (target,) = load_config(config_with(tmp_path, session)).targets
    assert probe_settings(target, None).session_header == header


def refused_as_unknown(path, where: str) -> None:
    """The config at `path` is refused at `where` for its session key "dynamoo", as every family refuses
    an unknown name: naming the closest and every known one."""
    with pytest.raises(ConfigError) as error:
        load_config(path)
    known = ", ".join(sorted(sessionkeys.SESSION_KEYS))
    assert str(error.value) == (
        f'error in {path}: {where}: unknown session key "dynamoo"; did you mean "dynamo"? known: {known}'
    )


def test_an_unknown_key_or_a_key_with_a_header_is_refused_naming_the_keys(tmp_path):
    refused_as_unknown(config_with(tmp_path, "{key: dynamoo}"), "targets[0].session.key")
    with pytest.raises(ConfigError, match="set key or header, not both"):
        load_config(config_with(tmp_path, "{key: smg, header: x-mine}"))
    with pytest.raises(ValueError, match='unknown session key "nope"'):
        ProbeSettings("http://127.0.0.1:9", "m", session_key="nope")


def test_the_family_lists_every_header_once_and_dynamos_parent_and_final_ones():
    lowered = [header.lower() for header in sessionkeys.KNOWN_HEADERS]
    assert len(lowered) == len(set(lowered))
    assert {"x-dynamo-session-id", "x-dynamo-parent-session-id", "x-dynamo-session-final"} <= set(lowered)
    assert {"x-amzn-sagemaker-session-id", "x-correlation-id", "x-litellm-session-id"} <= set(lowered)


def test_the_pin_outcome_a_router_reports_is_recorded_per_round_and_counted():
    """olla answers miss, then hit, then REPIN (any case), then a word of its own: other."""
    said = iter(("miss", "hit", "REPIN", "sideways"))
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Dynamo-Session-ID"))
        return await chat_answer(request, {"X-Olla-Sticky-Session": next(said)})

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with serving(app) as url, StreamClient() as client:
            settings = ProbeSettings(url, "m", target="gw", route_mode="affinity", session_key="dynamo")
            conversation = Conversation("system", ("one", "two", "three", "four"))
            return await run_session(client, settings, conversation)

    session = asyncio.run(scenario())
    assert [r.pin_outcome for r in session.rounds] == ["miss", "hit", "repin", "other"]
    assert seen[0] and set(seen) == {session.session_id}  # the id in Dynamo's header, every round
    results, registry = ProbeResults(), CollectorRegistry()
    registry.register(ProbeCollector(results, {}))
    results.add_run(("gw", "affinity"), [session], 0, 1)
    labels = {"target": "gw", "route_mode": "affinity"}
    counted = {
        outcome: registry.get_sample_value(
            "kvwatch_probe_pin_outcome_rounds_total", {**labels, "outcome": outcome}
        )
        for outcome in ("miss", "hit", "repin", "other", "disabled")
    }
    assert counted == {"miss": 1, "hit": 1, "repin": 1, "other": 1, "disabled": None}


def test_a_response_that_reports_no_pin_records_none():
    assert sessionkeys.pin_outcome({"X-Upstream": "r1"}) is None
    assert sessionkeys.pin_outcome({"X-Olla-Sticky-Session": ""}) is None


def test_the_commands_take_a_session_key_and_refuse_an_unknown_one(capsys):
    parser = argparse.ArgumentParser(prog="kvwatch probe")
    options.add_session_arguments(parser, "session id header")
    args = parser.parse_args(["--session-key", "litellm"])
    assert options.route_settings(args, base_url="http://127.0.0.1:9", model="m").session_header == (
        "x-litellm-session-id"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--session-key", "nginx"])
    assert "invalid choice: 'nginx'" in capsys.readouterr().err


def test_kvwatch_init_takes_a_routers_header_from_its_session_key():
    assert Request("http://127.0.0.1:9", gateway="smg").session_header == "X-SMG-Routing-Key"
    assert Request("http://127.0.0.1:9", gateway="nginx").session_header == "X-Session-Id"


def test_the_doctor_says_what_the_router_reported_of_its_pins_beside_where_rounds_landed(monkeypatch):
    async def nothing_more(sessions, probe):  # the header the route keeps sessions by: not asked here
        return None

    monkeypatch.setattr(doctor_session_keys, "kept_by_sent", nothing_more)
    probe = ProbeSettings("http://127.0.0.1:9", "m")
    plain = session()  # three rounds on r1, nothing reported
    pinned = replace(plain, rounds=tuple(
        replace(r, pin_outcome=o) for r, o in zip(plain.rounds, ("miss", "hit", "hit"), strict=True)
    ))  # fmt: skip
    said = asyncio.run(hash_key(Route(None, None, probe, None, sessions=[pinned, plain])))
    assert said.status == "pass"
    assert said.evidence.endswith("r1 x3; r1 x3 (the router reported its pins: hit 2, miss 1)")
    assert "reported" not in asyncio.run(hash_key(Route(None, None, probe, None, sessions=[plain]))).evidence


def test_a_dynamo_session_marks_its_last_round_final_and_names_no_parent():
    """X-Dynamo-Session-Final: true on the last round only, so that Dynamo drops the binding at once; no
    parent header (a probe conversation is no sub-agent); no final mark in a convention without one."""

    def rounds_sent(key: str, turns: int) -> list[dict[str, str]]:
        sent: list[dict[str, str]] = []

        async def chat(request: web.Request) -> web.StreamResponse:
            sent.append({name.lower(): value for name, value in request.headers.items()})
            return await chat_answer(request, {})

        async def scenario():
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            async with serving(app) as url, StreamClient() as client:
                settings = ProbeSettings(url, "m", session_key=key)
                await run_session(client, settings, Conversation("system", tuple(map(str, range(turns)))))

        asyncio.run(scenario())
        return sent

    sent = rounds_sent("dynamo", 3)
    assert [r.get("x-dynamo-session-final") for r in sent] == [None, None, "true"]
    assert all("x-dynamo-parent-session-id" not in r for r in sent)
    assert len({r["x-dynamo-session-id"] for r in sent}) == 1
    assert [r.get("x-dynamo-session-final") for r in rounds_sent("dynamo", 1)] == ["true"]
    assert not any("final" in name for r in rounds_sent("litellm", 2) for name in r)
    assert sessionkeys.final_header("x-dynamo-session-id") == "X-Dynamo-Session-Final"
    assert sessionkeys.final_header("X-Session-Id") is None
