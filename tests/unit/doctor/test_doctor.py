"""The doctor names each lab fault and each deliberate misconfiguration by its cause.

One lab (real nginx and Prometheus, three replicas, two background users) serves the module; each fault
test injects a fault and heals afterwards. Small fake servers cover answers no healthy engine gives,
and sample files written here cover the prompt-prefix check.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import random
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from loopback import answering_bytes, chat_answer, loopback_http, serving

from conftest import REPO, free_port, http_get, stop
from kvwatch.cli.main import main
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings, api_url
from kvwatch.collectors.probe.workload import system_prompt, user_turns
from kvwatch.core.promapi import PrometheusApi
from kvwatch.doctor.caching import Cluster, _caching_off_in_prometheus, caching_off_alerts
from kvwatch.doctor.checks import diagnose, examine
from kvwatch.doctor.findings import CAUSES, Check, Diagnosis
from kvwatch.doctor.prompts import prompt_prefix
from kvwatch.doctor.report import format_diagnosis
from kvwatch.doctor.route import _base_url_variants
from kvwatch.lab import stack
from kvwatch.lab.state import LabState

MODEL = "lab-model"
KEY = "kvw-doctor-key-8e2d61c4b7"  # distinctive, so a search finds any leak
ROUTE_CHECKS = ("reachability", "auth", "response shape", "session id propagation", "hash key")
integration = pytest.mark.integration


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


# --- the lab ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "3", "--users", "2", "--think", "0.1", "--time-scale", "0.1")


@pytest.fixture
def fault(lab):
    """Inject lab faults, then heal: what `kvwatch lab fault` and `heal` do, without starting a process."""
    yield lambda name, replica=None: stack.fault(LabState.load(lab.state_dir), name, replica)
    stack.heal(LabState.load(lab.state_dir))


def wait_for_every_engine_in_prometheus(lab) -> None:
    """Until Prometheus has scraped every engine's cache config."""
    deadline = time.monotonic() + 30
    while True:
        found = http_get(
            f"{lab.status['prometheus']}/api/v1/query", params={"query": "vllm:cache_config_info"}, timeout=5
        )
        if len(found.json()["data"]["result"]) == len(lab.status["replicas"]):
            return
        assert time.monotonic() < deadline, "Prometheus never scraped every engine's cache config"
        time.sleep(0.5)


@integration
def test_a_healthy_route_passes_every_check(lab, capsys):
    prometheus = lab.status["prometheus"]
    wait_for_every_engine_in_prometheus(lab)  # the block size comes from Prometheus then
    code = main(
        ["doctor", "--base-url", lab.affinity, "--model", MODEL, "--prometheus", prometheus, "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert (code, report["causes"]) == (0, [])
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        *((name, "pass") for name in ROUTE_CHECKS),
        ("prefix caching", "pass"),
        ("prompt-prefix stability", "skipped"),
    ]
    evidence = {c["name"]: c["evidence"] for c in report["checks"]}
    assert "X-Session-Id came back unchanged on all 12 rounds" in evidence["session id propagation"]
    assert "Prometheus: no engine has prefix caching off" in evidence["prefix caching"]
    assert (
        f"KV block: 16 tokens (vllm:cache_config_info in Prometheus at {prometheus})"
        in evidence["prefix caching"]
    )


@integration
@pytest.mark.parametrize(
    "name, failing, cause, evidence",
    [
        ("break-affinity", "hash key", "hash_key_not_session", "sessions changed backend within 4 rounds"),
        ("hash-request-id", "hash key", "hash_key_not_session", "sessions changed backend within 4 rounds"),
        ("drop-session-header", "session id propagation", "session_id_not_propagated",
         "12 of 12 rounds came back with another X-Session-Id"),
    ],
)  # fmt: skip
def test_each_gateway_fault_is_named(lab, fault, name, failing, cause, evidence):
    fault(name)
    diagnosis = doctor(lab.affinity)
    assert diagnosis.causes == [cause]
    assert evidence in check(diagnosis, failing).evidence


@integration
def test_the_cli_prints_each_check_with_its_fix_and_exits_1_on_a_failure(lab, fault, capsys):
    fault("break-affinity")
    code = main(["doctor", "--base-url", lab.affinity, "--model", MODEL])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL     hash key: " in out and "sessions changed backend within 4 rounds:" in out
    assert "fix: hash on the session id: nginx: `hash $http_x_session_id consistent;`" in out
    assert out.rstrip().endswith("causes: hash_key_not_session")


def prometheus_sees_caching_off(lab, replica: str) -> bool:
    answer = http_get(
        f"{lab.status['prometheus']}/api/v1/query",
        params={"query": 'vllm:cache_config_info{enable_prefix_caching="False"}'},
        timeout=5,
    ).json()
    return any(series["metric"]["instance"] == replica for series in answer["data"]["result"])


@integration
def test_prefix_caching_off_on_one_replica_is_named_through_prometheus(lab, fault):
    fault("disable-prefix-cache", "r2")
    r2 = urlsplit(lab.replica_url("r2")).netloc
    deadline = time.monotonic() + 15
    while not prometheus_sees_caching_off(lab, r2):
        assert time.monotonic() < deadline, "Prometheus never scraped r2's cache config"
        time.sleep(0.2)
    diagnosis = doctor(lab.affinity, prometheus_url=lab.status["prometheus"])
    assert diagnosis.causes == ["prefix_cache_disabled"]
    found = check(diagnosis, "prefix caching")
    assert f"Prometheus: {r2} reports enable_prefix_caching=False" in found.evidence


@integration
def test_prefix_caching_off_everywhere_shows_in_the_sessions_alone(lab, fault):
    for replica in ("r1", "r2", "r3"):
        fault("disable-prefix-cache", replica)
    diagnosis = doctor(lab.affinity)
    found = check(diagnosis, "prefix caching")
    assert diagnosis.causes == ["prefix_cache_disabled"]
    assert "reused 0 of" in found.evidence and "--no-enable-prefix-caching" in found.fix


def doctor_json(lab, capsys, *flags: str) -> tuple[int, dict[str, dict]]:
    """`kvwatch doctor --json` of the lab's route and Prometheus: its exit code and its checks by name."""
    code = main(["doctor", "--base-url", lab.affinity, "--model", MODEL,
                 "--prometheus", lab.status["prometheus"], "--json", *flags])  # fmt: skip
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


@integration
@pytest.mark.parametrize(
    "flags, selector, there",
    [
        (["--cluster", "nope"], 'cluster="nope"', "no engine series there carries the label cluster"),
        (["--cluster-label", "replica", "--cluster", "r9"], 'replica="r9"',
         "its engines' replica values are r1, r2, r3"),
    ],
)  # fmt: skip
def test_a_cluster_selector_that_matches_no_engine_fails_naming_those_that_exist(
    lab, capsys, flags, selector, there
):
    """The lab's engines carry a replica label and no cluster label: a selector that matches none of
    them judges no engine, says so with the values that exist, and fails."""
    wait_for_every_engine_in_prometheus(lab)
    code, checks = doctor_json(lab, capsys, *flags)
    found = checks["prefix caching"]
    assert (code, found["status"], found["cause"]) == (1, "fail", "cluster_not_found"), found
    assert f"no engine series has {selector}, so none is judged; {there}" in found["evidence"]
    assert "no engine has prefix caching off" not in found["evidence"]
    assert "--cluster-label" in found["fix"]


@integration
def test_a_cluster_selector_that_matches_an_engine_judges_it(lab, capsys):
    wait_for_every_engine_in_prometheus(lab)
    code, checks = doctor_json(lab, capsys, "--cluster-label", "replica", "--cluster", "r2")
    found = checks["prefix caching"]
    assert (code, found["status"]) == (0, "pass"), found
    assert "Prometheus (replica r2): no engine has prefix caching off" in found["evidence"]


@integration
def test_an_unreachable_prometheus_is_said_and_the_sessions_still_judge(lab):
    diagnosis = doctor(lab.affinity, prometheus_url=f"http://127.0.0.1:{free_port()}")
    found = check(diagnosis, "prefix caching")
    assert (found.status, diagnosis.causes) == ("pass", [])
    assert "cannot be queried" in found.evidence


@integration
def test_dynamic_prefix_is_found_in_a_sample_the_lab_traffic_wrote(lab, request, tmp_path):
    request.getfixturevalue("fault")("dynamic-prefix")
    sample = tmp_path / "requests.jsonl"
    control = lab.state_dir / "traffic.json"  # the lab's: the fault switched it on
    command = [sys.executable, "-m", "kvwatch.cli.main", "lab", "traffic", "--url", lab.affinity,
               "--users", "2", "--rounds", "2", "--think", "0", "--control", str(control),
               "--requests-sample", str(sample)]  # fmt: skip
    traffic = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sample.exists() or len(sample.read_text().splitlines()) < 8:
            assert time.monotonic() < deadline and traffic.poll() is None, "the traffic wrote no sample"
            time.sleep(0.2)
    finally:
        stop(traffic)
    found = prompt_prefix(sample)
    assert (found.status, found.cause) == ("fail", "dynamic_prompt_prefix")
    assert "a timestamp that varies from token 3 on" in found.evidence


@integration
def test_an_unknown_model_lists_what_the_server_offers(lab):
    diagnosis = doctor(lab.affinity, model="no-such-model")
    found = check(diagnosis, "response shape")
    assert diagnosis.causes == ["model_not_found"]
    assert "The model `no-such-model` does not exist" in found.evidence
    assert "model no-such-model is not served here: GET " in found.evidence
    assert found.evidence.endswith("/v1/models lists lab-model"), found.evidence


@integration
@pytest.mark.parametrize("path", ["/api", "/v1/v1"])
def test_a_base_url_with_a_wrong_path_names_the_one_that_works(lab, path):
    # The lab's nginx proxies every path; a replica, which answers 404 to unknown ones, stands for a
    # gateway that serves only its API root.
    replica = lab.replica_url("r1")
    diagnosis = doctor(replica + path)
    found = check(diagnosis, "reachability")
    assert diagnosis.causes == ["bad_base_url"]
    assert found.evidence.startswith(f"{api_url(replica + path, 'chat/completions')} answers HTTP 404;")
    assert found.fix.startswith(f"set the base URL to {replica}/v1,")
    assert statuses(diagnosis)["hash key"] == "pass"  # the later checks ran on the working base URL


@integration
def test_a_required_api_key_missing_wrong_expired_or_scoped(start_replica, monkeypatch, capsys):
    replica = start_replica("keys", "vllm", "--time-scale", "0.1")
    expired, scoped = "kvw-expired-3c9a1f", "kvw-scoped-7b2e04"
    faults = {
        "api_keys": {KEY: [MODEL], expired: [MODEL], scoped: ["other-model"]},
        "expired_keys": [expired],
    }
    replica.set_faults(**faults).raise_for_status()
    runs = {}
    for label, key in (("missing", None), ("wrong", "kvw-wrong-5d0c88"), ("expired", expired),
                       ("scoped", scoped), ("good", KEY)):  # fmt: skip
        flags = []
        if key:
            monkeypatch.setenv("KVW_DOCTOR_KEY", key)
            flags = ["--api-key-env", "KVW_DOCTOR_KEY"]
        code = main(["doctor", "--base-url", replica.url, "--model", MODEL, "--json", *flags])
        out, err = capsys.readouterr()
        report = json.loads(out)
        auth = next(c for c in report["checks"] if c["name"] == "auth")
        runs[label] = (code, report["causes"], auth["evidence"])
        assert (key or KEY) not in out + err
    assert runs["missing"][:2] == (1, ["unauthorized"]) and "sent without an API key" in runs["missing"][2]
    assert runs["wrong"][:2] == (1, ["unauthorized"]) and "Incorrect API key" in runs["wrong"][2]
    assert runs["expired"][:2] == (1, ["forbidden"]) and runs["expired"][2].startswith("token expired")
    assert runs["scoped"][:2] == (1, ["forbidden"]) and "not allowed to use the model" in runs["scoped"][2]
    assert runs["good"][:2] == (0, []) and runs["good"][2] == "a completion came back with an API key"


@integration
def test_prefix_caching_is_judged_in_the_engines_own_blocks(start_replica, capsys):
    """A replica with 128-token blocks and no backend header, as a real engine: the doctor learns the block
    from its /metrics, so its pinned sessions reuse all of their ideal; --block-size overrides it."""
    replica = start_replica(
        "cpu", "vllm", "--time-scale", "0.05", "--block-size", "128", "--no-identity-header"
    )
    diagnosis = doctor(replica.url)
    found = check(diagnosis, "prefix caching")
    assert (found.status, statuses(diagnosis)["hash key"], diagnosis.causes) == ("pass", "pass", [])
    assert "cached / ideal tokens: lowest 100%" in found.evidence
    assert f"KV block: 128 tokens (vllm:cache_config_info at {replica.url}/metrics)" in found.evidence

    assert main(["doctor", "--base-url", replica.url, "--model", MODEL, "--block-size", "16", "--json"]) == 0
    evidence = next(
        c["evidence"] for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "prefix caching"
    )
    assert "KV block: 16 tokens (--block-size)" in evidence and "lowest 100%" not in evidence


@integration
def test_doctor_and_experiment_ask_a_dynamo_frontend_for_its_worker(start_replica, capsys, tmp_path):
    """A replica that names itself only in Dynamo's `nvext`, when asked: --router dynamo asks."""
    replica = start_replica("d1", "vllm", "--time-scale", "0.05", "--no-identity-header")

    def hash_key(*flags: str) -> str:
        assert main(["doctor", "--base-url", replica.url, "--model", MODEL, "--json", *flags]) == 0
        checks = json.loads(capsys.readouterr().out)["checks"]
        return next(c["evidence"] for c in checks if c["name"] == "hash key")

    assert "sessions stayed on one backend: d1 x" in hash_key("--router", "dynamo")
    assert "d1" not in hash_key()

    out = tmp_path / "experiment"
    flags = ["--sessions", "2", "--rounds", "2", "--system-tokens", "50", "--turn-tokens", "10"]
    assert (
        main(
            [
                "experiment",
                "--a",
                replica.url,
                "--b",
                replica.url,
                "--out",
                str(out),
                "--router",
                "dynamo",
                *flags,
            ]
        )
        == 0
    )
    assert {row["backend"] for row in csv.DictReader((out / "raw-rounds.csv").read_text().splitlines())} == {
        "d1"
    }


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
