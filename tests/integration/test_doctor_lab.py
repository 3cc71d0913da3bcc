"""The doctor names each lab fault and each deliberate misconfiguration by its cause.

One lab (real nginx and Prometheus, three replicas, two background users) serves the module; each fault
test injects a fault and heals afterwards. Real replicas alone cover API keys, the engines' own blocks and
a Dynamo frontend.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
from test_doctor import KEY, MODEL, ROUTE_CHECKS, check, doctor, statuses

from kvwatch.cli.main import main
from kvwatch.collectors.probe.session import api_url
from kvwatch.doctor.prompts import prompt_prefix
from kvwatch.lab import stack
from kvwatch.lab.state import LabState
from paths import REPO
from processes import free_port, http_get, stop

integration = pytest.mark.integration


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
