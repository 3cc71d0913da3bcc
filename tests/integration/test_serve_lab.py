"""`kvwatch serve` in the lab: scheduled probes through both gateways, exported, stored; the webhook
stores alerts; and the lab runs exactly the shipped example config. A real `kvwatch serve` stops
cleanly on SIGTERM, names a bad config, and exports no label that the cluster's overwrites."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from serve_runs import StallingEngine, sample, samples, stalling_target, start_serve, terminate

from kvwatch.collectors.labels import label_names
from kvwatch.config.settings import LAB_DIRECTORY, PROMETHEUS_LABELS
from kvwatch.lab.configs import render_kvwatch_config
from kvwatch.lab.state import LabState
from kvwatch.store.history import Store
from paths import REPO
from processes import http_get, http_post, stop

pytestmark = pytest.mark.integration


def test_the_lab_runs_the_shipped_example_config():
    state = LabState(LAB_DIRECTORY, 18000)
    rendered = yaml.safe_load(render_kvwatch_config(state))
    assert rendered == yaml.safe_load((REPO / "examples" / "kvwatch.lab.yaml").read_text())


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "3", "--users", "1", "--think", "0.1", "--time-scale", "0.1")


def test_lab_probes_are_exported_and_stored(lab):
    exporter = lab.status["exporter"]
    affinity = {"target": "lab-affinity", "route_mode": "affinity"}
    round_robin = {"target": "lab-round-robin", "route_mode": "round_robin"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = samples(exporter)
        if (sample(found, "kvwatch_probe_sessions_total", outcome="success", **round_robin) or 0) >= 4:
            break
        time.sleep(1)
    assert sample(found, "kvwatch_probe_sticky_ratio", evidence="replica", **affinity) == 1
    assert sample(found, "kvwatch_probe_sticky_ratio", evidence="replica", **round_robin) == 0
    assert sample(found, "kvwatch_probe_sessions_total", outcome="failure", **affinity) == 0
    assert sample(found, "kvwatch_probe_session_id_echo_sessions_total", echoed="true", **affinity) >= 2
    assert sample(found, "kvwatch_probe_last_run_timestamp_seconds", **affinity) > time.time() - 60
    gateway = sum(v for (name, _), v in found.items() if name == "kvwatch_gateway_requests_total")
    assert gateway > 0

    # Prometheus scrapes the exporter like any target.
    query = {"query": 'kvwatch_probe_sticky_ratio{target="lab-affinity"}'}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = http_get(f"{lab.status['prometheus']}/api/v1/query", params=query).json()["data"]["result"]
        if result:
            break
        time.sleep(0.5)
    assert result and result[0]["value"][1] == "1"

    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        stored = store.sessions(target="lab-affinity")
        assert stored and all(s["sticky"] for s in stored)
        ended = {s["id"] for s in stored if not s["in_flight"]}  # the others have their rounds so far
        rounds = [r for r in store.rounds(target="lab-affinity") if r["session"] in ended]
        assert ended and len(rounds) == 6 * len(ended)


def test_the_webhook_takes_alerts_with_the_labs_token_and_rejects_garbage(lab):
    token_file = lab.state_dir / "webhook-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    authorized = {"Authorization": f"Bearer {token}"}
    payload = {
        "version": "4", "status": "firing", "receiver": "kvwatch", "groupKey": "{}:{}",
        "alerts": [{
            "status": "firing",
            "labels": {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical",
                       "target": "lab-affinity"},
            "annotations": {"summary": "Sessions change replica."}, "startsAt": "2026-11-29T18:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "abc123",
        }],
    }  # fmt: skip
    url = f"{lab.status['exporter']}/alerts"
    assert http_post(url, json=payload, timeout=5).status_code == 401
    answer = http_post(url, json=payload, headers=authorized, timeout=5)
    assert answer.status_code == 200 and answer.json() == {"stored": 1, "rejected": 0}
    garbage = http_post(url, content=b"{not json", headers=authorized, timeout=5)
    assert garbage.status_code == 400 and "bad Alertmanager webhook payload" in garbage.json()["error"]
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        posted = [a["alertname"] for a in store.alerts() if a["alertname"] != "Watchdog"]  # the lab's own
    assert posted == ["KVWatchSessionAffinityBroken"]
    assert token not in (lab.state_dir / "logs" / "serve.log").read_text()


def test_serve_stops_cleanly_on_sigterm_and_names_a_bad_config(tmp_path: Path, start_replica):
    replica = start_replica("r1", "vllm", "--time-scale", "0.05", "--answer-tokens", "4")
    target = {"name": "direct", "base_url": replica.url, "model": "lab-model", "interval_seconds": 1,
              "rounds": 2, "workload": {"system_tokens": 50, "turn_tokens": 10, "max_tokens": 4}}  # fmt: skip
    process, url, log = start_serve(tmp_path, target)
    config = tmp_path / "kvwatch.yaml"
    try:
        deadline = time.monotonic() + 20
        direct = {"target": "direct", "route_mode": "affinity", "outcome": "success"}
        while time.monotonic() < deadline:
            if sample(samples(url), "kvwatch_probe_sessions_total", **direct):
                break
            time.sleep(0.3)
        terminate(process, log)
    finally:
        stop(process)
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        assert store.sessions(target="direct")

    config.write_text("targets: [{name: x, base_url: 'ftp://nope', model: m}]\n")
    bad = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 1 and "targets[0].base_url" in bad.stderr


def test_the_cluster_label_overwrites_none_of_kvwatchs_own(tmp_path: Path):
    """Every label a real `kvwatch serve` exports, for probes and a gateway log alike, is one the config
    refuses as cluster_label, and the cluster's is on every sample besides them."""
    engine = StallingEngine()
    access_log = tmp_path / "access.log"
    line = {"time": "2027-01-15T08:00:00+00:00", "msec": time.time(), "listener": "affinity",
            "request": "POST /v1/chat/completions", "status": 200, "upstream_addr": "127.0.0.1:18001",
            "upstream_status": "200", "session_id": "s1", "session_source": "client", "request_time": 0.01,
            "upstream_response_time": "0.01"}  # fmt: skip
    access_log.write_text(json.dumps(line) + "\nnot json\n")
    gateway_log = {"name": "lab", "path": str(access_log)}
    try:
        process, url, log = start_serve(
            tmp_path, stalling_target(engine), gateway_logs=[gateway_log], exporter={"cluster": "c1"}
        )
        try:
            deadline = time.monotonic() + 30
            found = samples(url)
            while time.monotonic() < deadline and not (
                total(found, "kvwatch_probe_sessions_total") and total(found, "kvwatch_gateway_lines_total")
            ):
                time.sleep(0.3)
                found = samples(url)
            terminate(process, log)
        finally:
            stop(process)
    finally:
        engine.close()
    labels = [dict(pairs) for _, pairs in found]
    exported = {name for pairs in labels for name in pairs} - {"cluster"}
    own = {"target", "route_mode", "outcome", "log", "listener", "reason"}
    assert own <= exported <= label_names() | PROMETHEUS_LABELS
    assert all(pairs.get("cluster") == "c1" for pairs in labels)


def total(found: dict[tuple, float], name: str) -> float:
    """The sum of a metric's samples, whatever their labels."""
    return sum(value for (sample_name, _), value in found.items() if sample_name == name)
