"""Every lab fault has the observable effect it stands for, returns only once it serves, and
`kvwatch lab heal` restores the baseline.

A quiet lab (real nginx, Prometheus, Alertmanager, four replicas, no background users, no scheduled
probes) serves most of the module: only the tests' own requests pass its gateways, in the tests' order,
so what round robin does with them is known exactly. Each test injects one fault, checks what a user
would see (gateway headers and access log, replica counters, ground truth), heals, and checks the
baseline is back. The dynamic-prefix fault steers background users: it gets a lab with users.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import gateway_checks as checks
from gateway_checks import LAB_CLIENT as CLIENT
from kvwatch.lab.gateways import nginx as nginx_gateway
from kvwatch.lab.process import is_ours
from kvwatch.lab.state import LabState
from paths import REPO
from processes import stop

pytestmark = pytest.mark.integration

REPLICAS = 4
SESSIONS = [f"sess-{i}" for i in range(12)]
# Coprime with the replicas: strict round robin sends each of these sessions' next round to the next
# replica (12 sessions would come back to the same replica every round).
ROUND_ROBIN_SESSIONS = [f"rr-{i}" for i in range(13)]
SYSTEM_PROMPT_TOKENS = 800  # lab traffic default
TIME_SCALE = 0.2  # of the replicas' timings, extra latency included
# How long a request is held before its prefill: the kill's SIGTERM comes well within it, its end within
# the 10 s a stop waits before SIGKILL.
HELD_S = 6.0


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab(
        "--replicas", str(REPLICAS), "--users", "0", "--no-probes", "--time-scale", str(TIME_SCALE)
    )


@pytest.fixture(scope="module")
def busy_lab(start_lab):
    """Two replicas and two background users, whose conversations the dynamic-prefix fault steers; the
    module's last test then stops its Prometheus (a lab start less). Its tests come last in the module:
    the users' traffic costs CPU for as long as the lab runs."""
    return start_lab(
        "--replicas", "2", "--users", "2", "--think", "0.05", "--time-scale", "0.2", "--no-probes"
    )


@pytest.fixture(autouse=True)
def healthy_after(lab):
    yield
    checks.heal_if_faulted(lab, SESSIONS)


def faults_log(lab) -> list[dict]:
    return [json.loads(line) for line in (lab.state_dir / "faults.log").read_text().splitlines()]


def wait_until(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.05)


def replica_counter(url: str, name: str) -> float:
    text = CLIENT.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_baseline_is_sticky(lab):
    checks.assert_baseline(lab, SESSIONS)
    assert lab.status["dashboard"] is None  # started with --no-dashboard, as every test lab is by default


def test_break_affinity_spreads_sessions_over_replicas(lab):
    checks.fault(lab, "break-affinity")
    checks.assert_round_robin(lab.affinity, ROUND_ROBIN_SESSIONS)
    logged = [e for e in lab.access_log("affinity") if e["session_id"] == ROUND_ROBIN_SESSIONS[0]]
    assert len({e["upstream_addr"] for e in logged}) == 3
    assert faults_log(lab)[-1]["fault"] == "break-affinity"
    checks.heal(lab, SESSIONS)
    assert faults_log(lab)[-1]["action"] == "heal"


def test_drop_session_header_assigns_fresh_ids_and_spreads(lab):
    checks.fault(lab, "drop-session-header")
    response = checks.chat(lab.affinity, "mine")
    assert response.headers["X-Session-Id"] not in ("", "mine")
    checks.assert_spread(lab.affinity, SESSIONS)
    # Every request after the fault carries a gateway-assigned id.
    recent = lab.access_log("affinity")[-len(SESSIONS) :]
    assert {e["session_source"] for e in recent} == {"assigned"}
    checks.heal(lab, SESSIONS)
    assert lab.access_log("affinity")[-1]["session_source"] == "client"


def test_hash_request_id_echoes_the_id_but_spreads(lab):
    checks.fault(lab, "hash-request-id")
    assert checks.chat(lab.affinity, "kept").headers["X-Session-Id"] == "kept"
    checks.assert_spread(lab.affinity, SESSIONS)
    mine = [e for e in lab.access_log("affinity") if e["session_id"] in SESSIONS]
    assert mine and {e["session_source"] for e in mine} == {"client"}
    checks.heal(lab, SESSIONS)


def test_disable_prefix_cache_keeps_lookups_flat_on_one_replica(lab):
    url = lab.replica_url("r2")
    long_prompt = " ".join(f"w{i}" for i in range(200))
    checks.chat(url, content=long_prompt)
    checks.fault(lab, "disable-prefix-cache", "--replica", "r2")
    queries = replica_counter(url, "vllm:prefix_cache_queries_total")
    prompts = replica_counter(url, "vllm:prompt_tokens_total")
    reply = checks.chat(url, content=long_prompt).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert replica_counter(url, "vllm:prompt_tokens_total") > prompts
    assert replica_counter(url, "vllm:prefix_cache_queries_total") == queries
    info = [
        s.labels["enable_prefix_caching"]
        for f in text_string_to_metric_families(CLIENT.get(f"{url}/metrics").text)
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert info == ["False"]
    checks.heal(lab, SESSIONS)
    checks.chat(url, content=long_prompt)
    assert checks.chat(url, content=long_prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def round_ones(lab, since: float, enough: Callable[[list[dict]], bool], timeout: float = 60) -> list[dict]:
    """Ground truth of background users' round-1 requests that arrived after `since` and were
    prefilled, once there are `enough` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for replica in lab.status["replicas"]:
            records = CLIENT.get(f"{replica['url']}/lab/ground-truth").json()["records"]
            # Round 1: the system prompt, one user turn and the template (a timestamp too), nothing more.
            found += [
                r
                for r in records
                if r.get("time", 0) > since and r.get("ttft_seconds") is not None
                and SYSTEM_PROMPT_TOKENS < r["prompt_tokens"] < SYSTEM_PROMPT_TOKENS + 100
            ]  # fmt: skip
        if enough(found):
            return found
        assert time.monotonic() < deadline, f"not enough new conversations in {timeout} s: {found}"
        time.sleep(0.5)


def warm(record: dict) -> bool:
    """The request found the shared system prompt cached (all of it but a last partial block)."""
    return record["cached_tokens"] >= SYSTEM_PROMPT_TOKENS - 16


def test_kill_replica_fails_over_and_restart_resets_counters(lab):
    url = lab.replica_url("r3")
    r3 = url.removeprefix("http://")
    pinned = checks.session_pinned_to(lab, r3)
    for _ in range(3):
        checks.chat(url)
    served_before = replica_counter(url, "vllm:request_success_total")
    assert served_before >= 3
    checks.fault(lab, "kill-replica", "r3")
    assert lab.cli("status", "--json").json["replicas"][2]["url"] is None
    with pytest.raises(httpx.ConnectError):
        checks.chat(url)
    # nginx fails over: r3's session is answered by the next replica, the gateway names both.
    failover = checks.chat(lab.affinity, pinned)
    assert failover.status_code == 200 and failover.headers["X-Upstream"].startswith(f"{r3}, ")
    entries = lab.access_log("affinity", until=lambda log: sum(e["session_id"] == pinned for e in log) == 2)
    logged = [e for e in entries if e["session_id"] == pinned][-1]
    assert logged["upstream_addr"].startswith(f"{r3}, ") and logged["status"] == 200
    # Every session still gets an answer, from one of the three live replicas.
    seen = checks.upstreams(lab.affinity, SESSIONS, rounds=1)
    assert r3 not in {rounds[0] for rounds in seen.values()}
    checks.fault(lab, "restart-replica", "r3")
    assert replica_counter(url, "vllm:request_success_total") < served_before
    checks.heal(lab, SESSIONS)


def first_refusal(port: int) -> float:
    """The wall time a connection to the port came back refused, polling until one does."""
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return time.time()
        assert time.monotonic() < deadline, f"127.0.0.1:{port} still accepted connections after 60 s"
        time.sleep(0.01)


def test_kill_replica_is_dated_when_the_replica_stopped_listening_not_when_it_exited(lab, tmp_path):
    """A killed replica stops listening at its SIGTERM but exits only once the requests in flight are
    answered: here one held HELD_S before its prefill (the replica's extra latency). faults.log dates
    the fault at the SIGTERM: no later than the first refused connection, before the exit, which the
    command waits for."""
    url = lab.replica_url("r2")
    status = lab.cli("status", "--json").json
    port, pid = int(url.rsplit(":", 1)[1]), status["processes"]["replica-r2"]
    CLIENT.post(f"{url}/lab/faults", json={"extra_latency_s": HELD_S / TIME_SCALE}).raise_for_status()
    try:
        with ThreadPoolExecutor(1) as pool:
            answered = pool.submit(checks.chat, url)
            wait_until(lambda: replica_counter(url, "vllm:num_requests_waiting") == 1)  # in flight
            killing = lab_command(lab, tmp_path / "kill.err", "fault", "kill-replica", "r2")
            try:
                refused_at = first_refusal(port)
                assert answered.result().status_code == 200
                wait_until(lambda: not is_ours(LabState.load(lab.state_dir), pid))
                exited_seen = time.time()
                killing.wait(timeout=60)
            finally:
                stop(killing)
    finally:
        with contextlib.suppress(httpx.HTTPError):  # a replica the test did not kill must not stay slow
            CLIENT.post(f"{url}/lab/faults", json={"extra_latency_s": 0})
    assert killing.returncode == 0, (tmp_path / "kill.err").read_text()
    entry = faults_log(lab)[-1]
    assert (entry["action"], entry["fault"], entry["replica"]) == ("fault", "kill-replica", "r2")
    assert entry["unix"] <= refused_at < exited_seen, (entry, refused_at, exited_seen)
    checks.heal(lab, SESSIONS)


def test_scale_out_remaps_about_one_in_n_sessions_to_the_new_replica(lab):
    sessions = [f"ring-{i}" for i in range(60)]
    before = {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    checks.fault(lab, "scale-out")
    status = lab.cli("status", "--json").json
    new = status["replicas"][-1]
    assert new["id"] == "r5" and new["url"]
    address = new["url"].removeprefix("http://")
    assert address in prometheus_config(lab)  # reloaded (by SIGHUP) before the fault returned
    after = {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    # Consistent hashing: only sessions that now belong to the new replica move, about 1 in 5.
    assert all(after[s] == address for s in moved)
    assert 0 < len(moved) <= len(sessions) // 2
    query = {"query": 'up{job="replicas",replica="r5"}'}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = CLIENT.get(f"{status['prometheus']}/api/v1/query", params=query).json()["data"]["result"]
        if result and result[0]["value"][1] == "1":
            break
        time.sleep(0.5)
    else:
        raise AssertionError("Prometheus never scraped the added replica")
    checks.heal(lab, SESSIONS)
    assert address not in prometheus_config(lab)
    assert {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions} == before


def prometheus_config(lab) -> str:
    """The configuration Prometheus has loaded, as it prints it."""
    return CLIENT.get(f"{lab.status['prometheus']}/api/v1/status/config").json()["data"]["yaml"]


@pytest.mark.parametrize("listener", ["affinity", "round_robin"])
def test_the_gateways_do_not_proxy_the_replicas_admin_api(lab, listener):
    checks.assert_admin_api_unproxied(lab, listener)


def test_a_gateway_reload_that_does_not_take_fails_loudly(lab, monkeypatch):
    """A stopped nginx master cannot act on the reload: its old worker goes on serving the old config."""
    monkeypatch.setattr(nginx_gateway, "RELOAD_TIMEOUT_S", 2.0)
    entries = len(faults_log(lab))
    error = checks.fault_with_gateway_stopped(lab, "nginx", "nginx did not reload within 2 s")
    assert "workers from before the reload still running: [" in error
    assert "logs/nginx-error.log ends" in error
    assert len(faults_log(lab)) == entries  # a change that does not serve is not in faults.log
    # The saved state says what the written config asks for, so heal undoes it.
    assert lab.cli("status", "--json").json["faults"] == ["break-affinity"]
    checks.heal(lab, SESSIONS)


def lab_command(lab, stderr: Path, *args: str) -> subprocess.Popen:
    """`kvwatch lab ...` on `lab`, in the background, its stderr written to `stderr`."""
    command = [
        sys.executable,
        "-m",
        "kvwatch.cli.main",
        "lab",
        *args,
        "--state-dir",
        str(lab.state_dir),
    ]
    with stderr.open("w") as err:
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)


def test_commands_changing_one_lab_run_one_at_a_time(lab, tmp_path):
    """The first command is held in its nginx reload by a stopped nginx master, so the two overlap for
    certain: the second waits for the first instead of acting on a state the first is rewriting."""
    nginx = lab.status["processes"]["nginx"]
    conf = lab.state_dir / "nginx" / "nginx.conf"
    written = conf.read_text()
    first_err, second_err = tmp_path / "first.err", tmp_path / "second.err"
    commands = []
    os.kill(nginx, signal.SIGSTOP)
    try:
        commands.append(first := lab_command(lab, first_err, "fault", "break-affinity"))
        wait_until(lambda: conf.read_text() != written)
        commands.append(second := lab_command(lab, second_err, "fault", "kill-replica", "r2"))
        wait_until(lambda: second.poll() is not None or "waiting" in second_err.read_text())
        assert second.poll() is None, "the second command ran while the first was changing the lab"
        assert f"waiting for process {first.pid}, which is changing this lab" in second_err.read_text()
    finally:
        os.kill(nginx, signal.SIGCONT)
        for command in commands:
            try:
                command.wait(timeout=60)
            finally:
                stop(command)
    assert first.returncode == 0, first_err.read_text()
    assert second.returncode == 0, second_err.read_text()
    status = lab.cli("status", "--json").json
    assert status["faults"] == ["break-affinity", "kill-replica:r2"]
    assert status["replicas"][1]["url"] is None
    checks.heal(lab, SESSIONS)


def test_prometheus_takes_no_lifecycle_requests(lab):
    prometheus = lab.status["prometheus"]
    for action in ("quit", "reload"):
        assert CLIENT.post(f"{prometheus}/-/{action}").status_code == 403
    assert CLIENT.get(f"{prometheus}/-/ready").status_code == 200


def test_dynamic_prefix_destroys_reuse_of_the_shared_system_prompt(busy_lab):
    lab = busy_lab
    replicas = {r["id"] for r in lab.status["replicas"]}
    # Every replica has served a conversation that found the system prompt cached, so any later one
    # without the fault finds it too.
    before = round_ones(lab, 0, lambda found: {r["replica"] for r in found if warm(r)} == replicas)
    (static,) = {r["prompt_tokens"] for r in before}  # the same system prompt and turn length each time
    checks.fault(lab, "dynamic-prefix")
    # The timestamp at the top lengthens round 1 by a few tokens: those conversations read the fault.
    after = round_ones(lab, 0, lambda found: sum(r["prompt_tokens"] > static for r in found) >= 3)
    assert all(r["cached_tokens"] == 0 for r in after if r["prompt_tokens"] > static), after
    healed_at = time.time()
    checks.heal(lab, SESSIONS)
    healed = round_ones(lab, healed_at, lambda found: sum(r["prompt_tokens"] == static for r in found) >= 3)
    assert all(warm(r) for r in healed if r["prompt_tokens"] == static), healed


def test_without_prometheus_scale_out_and_heal_fail_in_one_line_and_log_what_changed(busy_lab):
    lab = busy_lab
    os.kill(lab.status["processes"]["prometheus"], signal.SIGTERM)
    wait_until(lambda: lab.cli("status", "--json").json["prometheus"] is None)

    def fails_naming_prometheus(*command: str) -> dict:
        """The last faults.log entry, once the command failed with one line naming Prometheus."""
        result = lab.cli(*command)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("kvwatch lab: Prometheus (") and "not running" in result.stderr
        return faults_log(lab)[-1]

    entry = fails_naming_prometheus("fault", "scale-out")
    assert (entry["action"], entry["fault"], entry["replica"]) == ("fault", "scale-out", "r3")
    added = lab.cli("status", "--json").json["replicas"][-1]
    assert added["id"] == "r3" and checks.chat(added["url"]).status_code == 200
    entry = fails_naming_prometheus("heal")
    assert (entry["action"], entry["fault"]) == ("heal", "scale-out:r3")
    assert [r["id"] for r in lab.cli("status", "--json").json["replicas"]] == ["r1", "r2"]
