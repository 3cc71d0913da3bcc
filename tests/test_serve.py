"""`kvwatch serve` in the lab: scheduled probes through both gateways, exported, stored; the webhook
stores alerts; and the lab runs exactly the shipped example config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from collectors.store import Store
from conftest import REPO, free_port, stop, wait_http
from lab.configs import render_kvwatch_config
from lab.state import DEFAULT_DIRECTORY, LabState

pytestmark = pytest.mark.integration


def samples(url: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(found: dict, name: str, **labels) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def test_the_lab_runs_the_shipped_example_config():
    state = LabState(DEFAULT_DIRECTORY, 18000)
    rendered = yaml.safe_load(render_kvwatch_config(state))
    assert rendered == yaml.safe_load((REPO / "examples" / "kvwatch.lab.yaml").read_text())


def test_lab_probes_are_exported_and_stored(start_lab):
    lab = start_lab("--replicas", "3", "--users", "1", "--think", "0.1", "--time-scale", "0.1")
    exporter = lab.status["exporter"]
    affinity = {"target": "lab-affinity", "route_mode": "affinity"}
    round_robin = {"target": "lab-round-robin", "route_mode": "round_robin"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = samples(exporter)
        if (sample(found, "kvwatch_probe_sessions_total", outcome="success", **round_robin) or 0) >= 4:
            break
        time.sleep(1)
    assert sample(found, "kvwatch_probe_sticky_ratio", **affinity) == 1
    assert sample(found, "kvwatch_probe_sticky_ratio", **round_robin) == 0
    assert sample(found, "kvwatch_probe_sessions_total", outcome="failure", **affinity) == 0
    assert sample(found, "kvwatch_probe_session_id_echo_sessions_total", echoed="true", **affinity) >= 2
    assert sample(found, "kvwatch_probe_last_run_timestamp_seconds", **affinity) > time.time() - 60
    gateway = sum(v for (name, _), v in found.items() if name == "kvwatch_gateway_requests_total")
    assert gateway > 0

    # Prometheus scrapes the exporter like any target.
    query = {"query": 'kvwatch_probe_sticky_ratio{target="lab-affinity"}'}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = httpx.get(f"{lab.status['prometheus']}/api/v1/query", params=query).json()["data"]["result"]
        if result:
            break
        time.sleep(0.5)
    assert result and result[0]["value"][1] == "1"

    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        stored = store.sessions(target="lab-affinity")
        assert stored and all(s["sticky"] for s in stored)
        assert len(store.rounds(target="lab-affinity")) == 6 * len(stored)


def test_the_webhook_stores_alerts_and_rejects_garbage(start_lab):
    lab = start_lab("--replicas", "1", "--users", "0", "--time-scale", "0.1")
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
    answer = httpx.post(f"{lab.status['exporter']}/alerts", json=payload, timeout=5)
    assert answer.status_code == 200 and answer.json() == {"stored": 1}
    garbage = httpx.post(f"{lab.status['exporter']}/alerts", content=b"{not json", timeout=5)
    assert garbage.status_code == 400 and "bad Alertmanager webhook payload" in garbage.json()["error"]
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        assert [a["alertname"] for a in store.alerts()] == ["KVWatchSessionAffinityBroken"]


def test_serve_stops_cleanly_on_sigterm_and_names_a_bad_config(tmp_path: Path, start_replica):
    replica = start_replica("r1", "vllm", "--time-scale", "0.05", "--answer-tokens", "4")
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        yaml.safe_dump({
            "targets": [{"name": "direct", "base_url": replica.url, "model": "lab-model",
                         "interval_seconds": 1, "rounds": 2,
                         "workload": {"system_tokens": 50, "turn_tokens": 10, "max_tokens": 4}}],
            "exporter": {"listen": f"127.0.0.1:{port}"},
            "store": {"path": str(tmp_path / "kvwatch.db")},
        })
    )  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "collectors.cli", "serve", "--config", str(config)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/-/healthy", process, log)
        deadline = time.monotonic() + 20
        direct = {"target": "direct", "route_mode": "affinity", "outcome": "success"}
        while time.monotonic() < deadline:
            if sample(samples(f"http://127.0.0.1:{port}"), "kvwatch_probe_sessions_total", **direct):
                break
            time.sleep(0.3)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=15) == 0, log.read_text()
    finally:
        stop(process)
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        assert store.sessions(target="direct")

    config.write_text("targets: [{name: x, base_url: 'ftp://nope', model: m}]\n")
    bad = subprocess.run(
        [sys.executable, "-m", "collectors.cli", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 1 and "targets[0].base_url" in bad.stderr
