"""The doctor names each deliberate misconfiguration by its cause: small fake servers cover answers no
healthy engine gives, and sample files written here cover the prompt-prefix check
(tests/integration/test_doctor_lab.py names each lab fault).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from loopback import answering_bytes, chat_answer, loopback_http, serving

from kvwatch.cli.main import main
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.workload import system_prompt, user_turns
from kvwatch.core.promapi import PrometheusApi
from kvwatch.doctor.caching import Cluster, _caching_off_in_prometheus, caching_off_alerts
from kvwatch.doctor.checks import diagnose, examine
from kvwatch.doctor.findings import CAUSES, Check, Diagnosis
from kvwatch.doctor.prompts import prompt_prefix
from kvwatch.doctor.report import format_diagnosis
from kvwatch.doctor.route import _base_url_variants
from paths import REPO
from processes import free_port

MODEL = "lab-model"
KEY = "kvw-doctor-key-8e2d61c4b7"  # distinctive, so a search finds any leak
ROUTE_CHECKS = ("reachability", "auth", "response shape", "session id propagation", "hash key")


def doctor(url: str, model: str = MODEL, **options) -> Diagnosis:
    return diagnose(ProbeSettings(base_url=url, model=model, timeout_seconds=10), **options)


def check(diagnosis: Diagnosis, name: str) -> Check:
    (found,) = [c for c in diagnosis.checks if c.name == name]
    return found


def statuses(diagnosis: Diagnosis) -> dict[str, str]:
    return {c.name: c.status for c in diagnosis.checks}


# --- records and small pieces -------------------------------------------------------------------


def test_a_check_takes_only_known_statuses_and_causes():
    with pytest.raises(ValueError, match="status"):
        Check("auth", "ok", "")
    with pytest.raises(ValueError, match="cause"):
        Check("auth", "fail", "", cause="broken")


def test_causes_come_from_failed_checks_in_order_once():
    diagnosis = Diagnosis(
        (
            Check("a", "fail", "x", cause="bad_base_url"),
            Check("b", "warn", "y"),
            Check("c", "fail", "z", cause="model_not_found"),
            Check("d", "fail", "w", cause="bad_base_url"),
        )
    )
    assert diagnosis.causes == ["bad_base_url", "model_not_found"] and diagnosis.failed
    report = diagnosis.as_json()
    assert report["causes"] == diagnosis.causes
    assert set(report["checks"][0]) == {"name", "status", "evidence", "fix", "cause"}
    assert not Diagnosis((Check("a", "warn", "y"),)).failed


@pytest.mark.parametrize(
    "base, variants",
    [
        ("http://h:1/api", ["http://h:1"]),
        ("http://h:1/api/", ["http://h:1"]),
        ("http://h:1/v1/v1", ["http://h:1/v1"]),
        ("http://h:1/v1/chat/completions", ["http://h:1/v1/chat", "http://h:1/v1"]),
        ("http://h:1/api/v1", ["http://h:1"]),  # /api gives the same API root as /api/v1
        ("http://h:1", []),
    ],
)
def test_base_url_variants_are_the_shorter_paths_with_another_api_root(base, variants):
    assert _base_url_variants(base) == variants


# --- prompt-prefix stability, from sample files -------------------------------------------------

STATIC = system_prompt(300, 7)
START = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def write_sample(path: Path, systems: list[str], rounds: int = 3) -> Path:
    """A JSONL sample of chat payloads: each system prompt opens one conversation of `rounds` requests,
    each request resending the history, as a chat client does."""
    lines = []
    for number, system in enumerate(systems):
        turns = user_turns(rounds, 12, random.Random(number))
        for count in range(1, rounds + 1):
            messages = [{"role": "system", "content": system}]
            for turn in turns[:count]:
                messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "ok."}]
            lines.append(json.dumps({"messages": messages[:-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def stamped(conversations: int) -> list[str]:
    times = (START + timedelta(seconds=7.3 * n) for n in range(conversations))
    return [f"Current time: {t.strftime('%Y-%m-%dT%H:%M:%S.%fZ')}\n{STATIC}" for t in times]


def test_a_timestamp_at_the_top_of_the_system_prompt_is_dynamic_prompt_prefix(tmp_path):
    found = prompt_prefix(write_sample(tmp_path / "sample.jsonl", stamped(10)))
    assert (found.status, found.cause) == ("fail", "dynamic_prompt_prefix")
    assert "30 requests, 10 distinct system prompts; the most common is shared by 3 (10%)" in found.evidence
    assert "a timestamp that varies from token 3 on" in found.evidence
    assert "'Current time: 2026-05-01T12:00:00.000000Z'" in found.evidence
    assert "a real tokenizer's index differs" in found.evidence
    assert found.fix.startswith("put static content first and dynamic content last")


@pytest.mark.parametrize(
    "top, kind",
    [
        (lambda n: f"Request {uuid.uuid4()}.", "UUID"),
        (lambda n: f"Trace id: {uuid.uuid4().hex}", "request id"),
        (lambda n: f"Today is {(START + timedelta(days=n)).date()}.", "date"),
        (lambda n: f"Conversation number {n + 1000}.", "counter"),
    ],
    ids=["uuid", "hex-id", "date", "counter"],
)
def test_ids_dates_and_counters_at_the_top_are_named(tmp_path, top, kind):
    found = prompt_prefix(write_sample(tmp_path / "sample.jsonl", [f"{top(n)} {STATIC}" for n in range(4)]))
    assert (found.status, found.cause) == ("fail", "dynamic_prompt_prefix")
    assert f"one prompt with a {kind} that varies" in found.evidence


@pytest.mark.parametrize(
    "systems, evidence",
    [
        ([STATIC] * 5, "all 15 requests share one system prompt of 300 tokens"),
        ([system_prompt(300, n) for n in range(3)], "no two differ only in a piece before static content"),
        ([f"{STATIC} Today is 2026-05-0{n + 1}." for n in range(3)], "no two differ only in a piece"),
        ([""] * 3, "none of 9 requests starts with a system prompt"),
    ],
    ids=["one-prompt", "different-prompts", "dynamic-last", "no-system-prompt"],
)
def test_static_first_prompts_pass(tmp_path, systems, evidence):
    found = prompt_prefix(write_sample(tmp_path / "sample.jsonl", systems))
    assert found.status == "pass" and found.cause is None
    assert evidence in found.evidence


def test_a_varying_piece_that_looks_like_nothing_known_is_a_warning(tmp_path):
    systems = [f"The customer is {name}. {STATIC}" for name in ("Alice", "Bob", "Carol")]
    found = prompt_prefix(write_sample(tmp_path / "sample.jsonl", systems))
    assert (found.status, found.cause) == ("warn", None)
    assert "one prompt with a piece that varies from token 3 on" in found.evidence


def test_unreadable_or_too_small_samples_are_skipped_with_the_reason(tmp_path):
    assert prompt_prefix(None).status == "skipped"
    missing = prompt_prefix(tmp_path / "missing.jsonl")
    assert missing.status == "skipped" and "cannot read" in missing.evidence
    junk = tmp_path / "junk.jsonl"
    one = json.dumps({"messages": [{"role": "system", "content": "x"}]})
    junk.write_text(f'not json\n{{"messages": "no list"}}\n[1]\n\n{one}\n')
    found = prompt_prefix(junk)
    assert found.status == "skipped"
    assert found.evidence.endswith("1 requests in " + str(junk) + ": too few to compare; 3 lines were no "
                                   "request payload with `messages`")  # fmt: skip


# --- answers no healthy engine gives, from fake servers ------------------------------------------


def fake_server(chat, prometheus_query=None):
    """A route answering with `chat`; with `prometheus_query`, a Prometheus at /prometheus too."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    if prometheus_query is not None:
        app.router.add_get("/prometheus/api/v1/query", prometheus_query)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": MODEL}]}))
    return serving(app)


def against(chat, gateway: str | None = None, **settings) -> Diagnosis:
    async def scenario() -> Diagnosis:
        async with fake_server(chat) as url:
            return await examine(ProbeSettings(base_url=url, model=MODEL, **settings), gateway=gateway)

    return asyncio.run(scenario())


def replying(body: dict, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler


async def hang(request: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response()


ECHOING = {"error": {"message": f"Incorrect API key provided: {KEY}"}}


@pytest.mark.parametrize(
    "chat, failing, cause, evidence",
    [
        (replying(ECHOING), "response shape", "bad_response", "no `choices` in the answer: {"),
        (replying({"choices": [{"message": {"content": "hi"}}]}), "response shape", "bad_response",
         "a whole completion came back instead of an event stream"),
        (replying({"error": "overloaded"}, 503), "response shape", "bad_response", "HTTP 503"),
        (replying(ECHOING, 401), "auth", "unauthorized", "provided: [redacted]"),
        (hang, "reachability", "timeout", "no complete answer within 0.5 s"),
    ],
    ids=["error-object", "no-stream", "http-503", "key-echoed", "hang"],
)  # fmt: skip
def test_broken_answers_are_named_and_the_key_never_shown(chat, failing, cause, evidence):
    diagnosis = against(chat, api_key=KEY, timeout_seconds=0.5)
    found = check(diagnosis, failing)
    assert (found.status, found.cause, diagnosis.causes) == ("fail", cause, [cause])
    assert evidence in found.evidence, found.evidence
    later = list(ROUTE_CHECKS[ROUTE_CHECKS.index(failing) + 1 :])
    assert [statuses(diagnosis)[name] for name in later] == ["skipped"] * len(later)
    assert KEY not in json.dumps(diagnosis.as_json()) + format_diagnosis(diagnosis)


def test_nothing_listening_is_connection_refused_with_the_container_hint():
    diagnosis = doctor(f"http://127.0.0.1:{free_port()}")
    found = check(diagnosis, "reachability")
    assert diagnosis.causes == ["connection_refused"] and found.evidence.startswith("cannot connect to")
    assert "inside a container, localhost is the container itself" in found.fix
    assert statuses(diagnosis)["prefix caching"] == "skipped"


@pytest.mark.parametrize(
    "answer, kind, evidence",
    [
        (b"HTTP/1.1 abc OK\r\n\r\n", "protocol_error", "invalid status line 'HTTP/1.1 abc OK'"),
        (b"\x15\x03\x01\x00\x02\x02\x46", "tls_mismatch", "the port speaks TLS: use https://"),
    ],
    ids=["status-abc", "tls-port"],
)
def test_an_answer_that_is_no_http_fails_reachability_with_its_kinds_hint(answer, kind, evidence):
    with loopback_http(answering_bytes(answer)) as url:
        diagnosis = doctor(url)
    found = check(diagnosis, "reachability")
    assert (found.status, evidence in found.evidence, diagnosis.causes) == ("fail", True, [kind]), found
    assert found.fix.startswith(HINTS[kind]) and statuses(diagnosis)["auth"] == "skipped"


def test_an_api_key_on_the_command_line_is_refused_unrepeated(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--base-url", "http://127.0.0.1:1", "--model", MODEL, "--api-key", KEY])
    assert exited.value.code == 2 and KEY not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "required: --base-url or --sagemaker-endpoint (or --setup --config FILE)"),
        (["--setup"], "--setup checks the pipeline --config FILE sets up: give --config, not --base-url or"),
        (["--setup", "--config", "k.yaml", "--base-url", "http://127.0.0.1:1"], "not --base-url"),
        (["--setup", "--config", "k.yaml", "--sagemaker-endpoint", "e"], "or --sagemaker-endpoint"),
        (["--setup", "--config", "/nonexistent/kvwatch.yaml"], "error in /nonexistent/kvwatch.yaml"),
    ],
)
def test_the_route_or_the_setup_is_asked_for_and_nothing_else(args, message, capsys):
    assert main(["doctor", *args]) == 2
    assert message in capsys.readouterr().err


# --- fixes in the words of the gateway or router in front -------------------------------------------

NGINX_HASH = "nginx: `hash $http_x_session_id consistent;`"
ENVOY_HASH = (
    "Envoy / Istio: the Istio DestinationRule's "
    "`trafficPolicy.loadBalancer.consistentHash.httpHeaderName: X-Session-Id`"
)
SMG_HASH = (
    "SMG: `--policy manual` (or `--routing-key-override` to make any policy sticky) with "
    "`--routing-key-headers x-session-id`"
)
VLLM_ROUTER_HASH = "vllm-router: `--policy consistent_hash` (or `sticky_least_loaded`), keyed by X-Session-ID"


def route(marks: dict[str, str], session_id=lambda sent: sent, spread: bool = True):
    """A route whose every answer carries a gateway's `marks` and the session id `session_id` makes of
    the one sent (None: not echoed); with `spread`, each answer comes from the next of three replicas."""
    served = itertools.count()

    async def chat(request: web.Request) -> web.StreamResponse:
        headers = {**marks, "X-Upstream": f"r{next(served) % 3 + 1}" if spread else "r1"}
        if echoed := session_id(request.headers.get("X-Session-Id")):
            headers["X-Session-Id"] = echoed
        return await chat_answer(request, headers)

    return chat


@pytest.mark.parametrize(
    "marks, gateway, named, unnamed",
    [
        ({"Server": "nginx/1.22.1"}, None, [NGINX_HASH], [ENVOY_HASH, SMG_HASH]),
        ({"Server": "envoy", "x-envoy-upstream-service-time": "2"}, None, [ENVOY_HASH, "MAGLEV"], []),
        ({"Server": "istio-envoy"}, None, [ENVOY_HASH], [NGINX_HASH, SMG_HASH]),
        ({"x-smg-routed-worker-id": "http://10.0.0.1:8000"}, None, [SMG_HASH], [NGINX_HASH, ENVOY_HASH]),
        ({}, "vllm-router", [VLLM_ROUTER_HASH], [NGINX_HASH, ENVOY_HASH, SMG_HASH]),
        ({"Server": "nginx"}, "envoy", [ENVOY_HASH], [NGINX_HASH]),  # the user knows better
        ({}, None, [NGINX_HASH, ENVOY_HASH, SMG_HASH, VLLM_ROUTER_HASH], []),  # no marks: every system
    ],
    ids=["nginx", "envoy", "istio", "smg", "named-vllm-router", "named-over-marks", "unknown"],
)  # fmt: skip
def test_the_hash_key_fix_names_the_setting_of_the_system_in_front(marks, gateway, named, unnamed):
    diagnosis = against(route(marks), gateway=gateway, timeout_seconds=5)
    found = check(diagnosis, "hash key")
    assert (found.status, diagnosis.causes) == ("fail", ["hash_key_not_session"]), found
    assert found.fix.startswith("hash on the session id: ")
    assert all(text in found.fix for text in named), found.fix
    assert not any(text in found.fix for text in unnamed), found.fix


@pytest.mark.parametrize("spread", [True, False], ids=["affinity-off", "affinity-on"])
def test_dynamos_session_header_without_its_affinity_ttl_is_named_with_the_flag(spread):
    """Dynamo echoes no session header; sessions carrying X-Dynamo-Session-ID that still change worker
    mean its frontend runs without --router-session-affinity-ttl-secs. Kept on one worker: no finding."""
    settings = {"session_header": "X-Dynamo-Session-ID", "timeout_seconds": 5}
    diagnosis = against(route({}, session_id=lambda sent: None, spread=spread), **settings)
    propagation, found = check(diagnosis, "session id propagation"), check(diagnosis, "hash key")
    if not spread:  # sticky without an echo: the id probably arrives
        assert (propagation.status, found.status) == ("warn", "pass"), found
        assert "dynamo_session_affinity_off" not in diagnosis.causes
        return
    assert propagation.status == "skipped" and "Dynamo returns no X-Dynamo-Session-ID" in propagation.evidence
    assert (found.status, diagnosis.causes) == ("fail", ["dynamo_session_affinity_off"]), found
    assert "3 of 3 sessions changed backend" in found.evidence and "session affinity is off" in found.evidence
    assert found.fix.startswith("start the frontend with `--router-session-affinity-ttl-secs N`")


def test_a_replaced_session_id_is_fixed_where_envoy_drops_headers():
    diagnosis = against(route({"Server": "envoy"}, session_id=lambda sent: "made-by-the-gateway"))
    found = check(diagnosis, "session id propagation")
    assert (found.status, found.cause) == ("fail", "session_id_not_propagated")
    assert found.fix == (
        "make every hop forward X-Session-Id unchanged: Envoy / Istio: it passes X-Session-Id on unless a "
        "route's `request_headers_to_remove` drops it (Istio: a VirtualService's `headers.request.remove`)"
    )


def test_an_unechoed_id_on_a_sticky_smg_route_says_smg_names_the_worker_instead():
    marks = {"x-smg-routed-worker-id": "http://10.0.0.1:8000"}
    diagnosis = against(route(marks, session_id=lambda sent: None, spread=False))
    found = check(diagnosis, "session id propagation")
    assert found.status == "warn" and check(diagnosis, "hash key").status == "pass"
    assert found.fix == (
        "echo it so that clients can check: SMG: it returns no routing key but names the worker in "
        "x-smg-routed-worker-id, which kvwatch reads"
    )


def test_every_cause_has_a_readme_entry():
    section = (REPO / "docs" / "troubleshooting.md").read_text()
    assert [cause for cause in CAUSES if f"`{cause}`" not in section] == []


def test_caching_off_names_the_cluster_of_each_instance_prometheus_holds(monkeypatch):
    """Two clusters' instances of the same address: each is named with its cluster; one without the
    label by its address alone."""

    def prometheus(api: PrometheusApi, query: str) -> list[dict]:
        return [] if "cache_config_info" not in query else [
            {"metric": {"cluster": "a", "instance": "10.0.0.7:8000"}, "value": [0, "1"]},
            {"metric": {"cluster": "b", "instance": "10.0.0.7:8000"}, "value": [0, "1"]},
            {"metric": {"instance": "10.0.0.9:8000"}, "value": [0, "1"]},
        ]  # fmt: skip

    monkeypatch.setattr(PrometheusApi, "query", prometheus)

    assert asyncio.run(_caching_off_in_prometheus("http://prometheus:9090")) == [
        "10.0.0.7:8000 in cluster a reports enable_prefix_caching=False",
        "10.0.0.7:8000 in cluster b reports enable_prefix_caching=False",
        "10.0.0.9:8000 reports enable_prefix_caching=False",
    ]


def test_the_doctor_of_one_cluster_asks_prometheus_of_that_cluster_only(monkeypatch):
    """Every series selector of both caching-off queries narrowed to the cluster, by its label."""
    asked = []

    def prometheus(api: PrometheusApi, query: str) -> list[dict]:
        asked.append(query)
        return [{"metric": {"region": "eu", "instance": "10.0.0.7:8000"}, "value": [0, "1"]}]

    monkeypatch.setattr(PrometheusApi, "query", prometheus)

    asyncio.run(_caching_off_in_prometheus("http://prometheus:9090", Cluster("eu", "region")))
    engines, *caching_off = asked  # first whether the cluster holds engines at all, over every cluster
    assert engines.startswith('group by (region) ({__name__=~"vllm:prompt_tokens_total|')
    assert len(caching_off) == len(caching_off_alerts())
    for query in caching_off:
        selectors = re.findall(r"(vllm:\w+)(\{[^}]*\})?", query)
        assert selectors and all('region="eu"' in matchers for _, matchers in selectors), query


# Two clusters told apart by a label of the operator's own, with an engine of the same address each.
REGIONS = [
    {"region": "eu", "job": "replicas", "instance": "10.0.0.7:8000", "block_size": "32"},
    {"region": "us", "job": "replicas", "instance": "10.0.0.7:8000", "block_size": "128"},
]


async def prometheus_of_regions(request: web.Request) -> web.Response:
    """Each series as Prometheus answers it: the regions the query matches, with the labels its
    aggregations keep (`by (...)`) alone."""
    query = request.query["query"]
    kept = {label.strip() for group in re.findall(r"by \(([^)]*)\)", query) for label in group.split(",")}
    matching = [s for s in REGIONS if "region=" not in query or f'region="{s["region"]}"' in query]
    result = [{"metric": {k: v for k, v in s.items() if k in kept}, "value": [0, "1"]} for s in matching]
    return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


def prefix_caching_of_regions(cluster: Cluster) -> tuple[str, str]:
    """The prefix-caching evidence of a doctor reading `prometheus_of_regions`, and that Prometheus' URL."""

    async def scenario() -> tuple[str, Diagnosis]:
        async with fake_server(route({}, spread=False), prometheus_of_regions) as url:
            prometheus = f"{url}/prometheus"
            probe = ProbeSettings(base_url=url, model=MODEL, timeout_seconds=5)
            return prometheus, await examine(probe, prometheus, cluster=cluster)

    prometheus, diagnosis = asyncio.run(scenario())
    return check(diagnosis, "prefix caching").evidence, prometheus


CACHING_OFF_WORDS = (
    "serves prompt tokens while its prefix-cache lookups stay flat",
    "reports enable_prefix_caching=False",
)


def test_the_doctor_of_one_cluster_by_a_custom_label_names_it_for_each_instance_and_the_block():
    """With --cluster-label region, as with the default label: each instance Prometheus flags is named
    with its region, and the block size's source says which region's engines it read."""
    evidence, prometheus = prefix_caching_of_regions(Cluster("eu", "region"))
    for what in CACHING_OFF_WORDS:
        assert f"Prometheus (region eu): 10.0.0.7:8000 in region eu {what}" in evidence, evidence
    assert "in region us" not in evidence
    assert (
        f"KV block: 32 tokens (vllm:cache_config_info of region eu in Prometheus at {prometheus})" in evidence
    )


def test_the_doctor_of_every_cluster_by_a_custom_label_names_each_instances():
    """--cluster-label region without --cluster: every region read, each instance named with its own."""
    evidence, prometheus = prefix_caching_of_regions(Cluster(None, "region"))
    for region, what in itertools.product(("eu", "us"), CACHING_OFF_WORDS):
        assert f"Prometheus: 10.0.0.7:8000 in region {region} {what}" in evidence, evidence
    assert (
        f"KV block: 32 tokens (smallest of 32, 128 in vllm:cache_config_info in Prometheus at {prometheus})"
        in evidence
    )


def test_a_prometheus_without_engine_series_says_so_rather_than_that_none_has_caching_off():
    async def no_series(request: web.Request) -> web.Response:
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})

    async def scenario() -> Diagnosis:
        async with fake_server(route({}, spread=False), no_series) as url:
            probe = ProbeSettings(base_url=url, model=MODEL, timeout_seconds=5)
            return await examine(probe, f"{url}/prometheus")

    evidence = check(asyncio.run(scenario()), "prefix caching").evidence
    assert "Prometheus: holds no engine series (vllm:prompt_tokens_total, " in evidence, evidence
    assert "no engine has prefix caching off" not in evidence
