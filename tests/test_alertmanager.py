"""alerts/alertmanager.yml: valid for amtool, every kvwatch alert routed to kvwatch's webhook, its
inhibitions applied by a real Alertmanager, and the lab's rendering of it (its own exporter port, timers
time-scaled) valid too."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from collectors import queries
from conftest import REPO, free_port, stop, wait_http
from lab.configs import render_alertmanager, render_kvwatch_config, rule_files, scale_durations
from lab.state import LabState

CONFIG = REPO / "alerts" / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("amtool")
    assert binary, "amtool is missing: `make bootstrap` installs Debian's prometheus-alertmanager package"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def test_amtool_accepts_the_config():
    result = amtool("check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", queries.ALERTS, ids=lambda a: f"{a.name}-{a.severity}")
def test_every_alert_reaches_the_kvwatch_webhook(alert: queries.Alert):
    labels = {"alertname": alert.name, "severity": alert.severity, **(alert.labels or {}), "target": "t"}
    result = amtool(
        "config", "routes", "test", f"--config.file={CONFIG}", "--verify.receivers=kvwatch",
        *(f"{key}={value}" for key, value in labels.items()),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_inhibitions_only_name_alerts_that_exist():
    names = {alert.name for alert in queries.ALERTS}
    for rule in yaml.safe_load(CONFIG.read_text())["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if matcher.startswith("alertname"):
                pattern = matcher.split("=", 1)[1].strip('~"')
                assert set(pattern.split("|")) <= names, matcher


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager running alerts/alertmanager.yml, its webhook pointed at a closed port."""
    config = yaml.safe_load(CONFIG.read_text())
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"http://127.0.0.1:{free_port()}/alerts"
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(config))
    url, log = f"http://127.0.0.1:{free_port()}", tmp_path / "alertmanager.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [shutil.which("prometheus-alertmanager"), f"--config.file={tmp_path / 'alertmanager.yml'}",
             f"--storage.path={tmp_path / 'data'}", f"--web.listen-address={url.removeprefix('http://')}",
             "--cluster.listen-address="],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"{url}/-/ready", process, log)
        yield url
    finally:
        stop(process)


def inhibited(alertmanager: str, *alerts: dict[str, str]) -> dict[str, bool]:
    """Send `alerts` to the Alertmanager with amtool; which of them (by alertname) it inhibits."""
    for labels in alerts:
        added = amtool(
            "alert", "add", f"--alertmanager.url={alertmanager}", *(f"{k}={v}" for k, v in labels.items())
        )
        assert added.returncode == 0, added.stderr
    query = amtool(
        "alert", "query", "--inhibited", "--active", "-o", "json", f"--alertmanager.url={alertmanager}"
    )
    assert query.returncode == 0, query.stderr
    return {a["labels"]["alertname"]: bool(a["status"]["inhibitedBy"]) for a in json.loads(query.stdout)}


def test_prefix_caching_disabled_mutes_warm_rounds_without_gain(alertmanager):
    caching_off = {"alertname": "KVWatchPrefixCachingDisabled", "severity": "warning", "evidence": "lookups",
                   "job": "llm/vllm", "instance": "10.0.0.7:8000"}  # fmt: skip
    no_gain = {"alertname": "KVWatchWarmRoundNoGain", "severity": "warning", "target": "chat",
               "route_mode": "affinity"}  # fmt: skip
    affinity = {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical", "target": "other",
                "route_mode": "affinity"}  # fmt: skip
    assert inhibited(alertmanager, no_gain, affinity) == {
        "KVWatchWarmRoundNoGain": False,
        "KVWatchSessionAffinityBroken": False,
    }
    assert inhibited(alertmanager, caching_off) == {
        "KVWatchPrefixCachingDisabled": False,
        "KVWatchWarmRoundNoGain": True,
        "KVWatchSessionAffinityBroken": False,
    }


def test_the_lab_rendering_points_at_its_exporter_with_its_token_and_scales_timers(tmp_path: Path):
    state = LabState(tmp_path, 21000, rule_time_scale=0.1)
    rendered = render_alertmanager(state)
    path = tmp_path / "alertmanager.yml"
    path.write_text(rendered)
    assert amtool("check-config", str(path)).returncode == 0
    config = yaml.safe_load(rendered)
    webhook = config["receivers"][0]["webhook_configs"][0]
    assert webhook["url"] == "http://127.0.0.1:21004/alerts"
    token_file = str(tmp_path / "webhook-token")
    assert webhook["http_config"] == {"authorization": {"type": "Bearer", "credentials_file": token_file}}
    assert yaml.safe_load(render_kvwatch_config(state))["exporter"]["webhook_token_file"] == token_file
    assert config["route"]["group_interval"] == "6s"


def test_fast_rules_scale_windows_and_durations_only():
    assert scale_durations("rate(x[5m]) offset 1h > 0.5", 0.1) == "rate(x[30s]) offset 360s > 0.5"
    assert scale_durations("for: 0m\nkeep_firing_for: 2m\nrecord: a:b:rate2m", 0.1) == (
        "for: 0s\nkeep_firing_for: 12s\nrecord: a:b:rate2m"
    )
    fast = rule_files(LabState(Path("/tmp"), 21000, rule_time_scale=0.1))
    assert set(fast) == {
        "kvwatch-engines.yml",
        "kvwatch-gateway.yml",
        "kvwatch-routers.yml",
        "kvwatch.rules.yml",
    }
    assert "[12s]" in fast["kvwatch-engines.yml"] and "[2m]" not in fast["kvwatch-engines.yml"]


def test_fast_rules_are_valid_for_promtool(tmp_path: Path):
    for name, text in rule_files(LabState(tmp_path, 21000, rule_time_scale=0.1)).items():
        (tmp_path / name).write_text(text)
        result = subprocess.run(
            [shutil.which("promtool"), "check", "rules", str(tmp_path / name)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
