"""alerts/alertmanager.yml: valid for amtool, every kvwatch alert routed to kvwatch's webhook, its
inhibitions applied by a real Alertmanager, a notification kvwatch cannot store yet sent again until it
is stored, and the lab's rendering of it (its own exporter port, timers time-scaled) valid too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.alerts.alerts import ALERTS, Alert
from kvwatch.config.settings import Config, ExporterSettings, StoreSettings, Target
from kvwatch.lab import configs
from kvwatch.lab.configs import render_alertmanager, render_kvwatch_config, rule_files, scale_durations
from kvwatch.lab.process import LabError
from kvwatch.lab.state import LabState
from kvwatch.serve import scheduler
from kvwatch.serve.scheduler import Service
from kvwatch.store.history import Store
from paths import REPO
from processes import free_port, stop, wait_http

CONFIG = REPO / "alerts" / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("amtool")
    assert binary, "amtool is missing: `make bootstrap` installs Debian's prometheus-alertmanager package"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def test_amtool_accepts_the_config():
    result = amtool("check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.name}-{a.severity}")
def test_every_alert_reaches_the_kvwatch_webhook(alert: Alert):
    labels = {"alertname": alert.name, "severity": alert.severity, **(alert.labels or {}), "target": "t"}
    result = amtool(
        "config", "routes", "test", f"--config.file={CONFIG}", "--verify.receivers=kvwatch",
        *(f"{key}={value}" for key, value in labels.items()),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_inhibitions_only_name_alerts_that_exist():
    names = {alert.name for alert in ALERTS}
    for rule in yaml.safe_load(CONFIG.read_text())["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if matcher.startswith("alertname"):
                pattern = matcher.split("=", 1)[1].strip('~"')
                assert set(pattern.split("|")) <= names, matcher


@contextlib.contextmanager
def running_alertmanager(tmp_path: Path, webhook_url: str, token_file: Path) -> Iterator[str]:
    """A real Alertmanager running alerts/alertmanager.yml, its webhook pointed at `webhook_url` with the
    token in `token_file`; its URL."""
    config = yaml.safe_load(CONFIG.read_text())
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = webhook_url
            webhook["http_config"]["authorization"]["credentials_file"] = str(token_file)
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


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager whose webhook points at a closed port."""
    with running_alertmanager(tmp_path, f"http://127.0.0.1:{free_port()}/alerts", tmp_path / "none") as url:
        yield url


def inhibited(alertmanager: str, *alerts: dict[str, str]) -> dict[str, bool]:
    """Send `alerts` to the Alertmanager with amtool; which of them (by alertname, and cluster where one
    is set: `KVWatchWarmRoundNoGain{cluster="a"}`) it inhibits."""
    for labels in alerts:
        added = amtool(
            "alert", "add", f"--alertmanager.url={alertmanager}", *(f"{k}={v}" for k, v in labels.items())
        )
        assert added.returncode == 0, added.stderr
    query = amtool(
        "alert", "query", "--inhibited", "--active", "-o", "json", f"--alertmanager.url={alertmanager}"
    )
    assert query.returncode == 0, query.stderr
    return {alert_key(a["labels"]): bool(a["status"]["inhibitedBy"]) for a in json.loads(query.stdout)}


def alert_key(labels: dict[str, str]) -> str:
    cluster = labels.get("cluster")
    return labels["alertname"] + (f'{{cluster="{cluster}"}}' if cluster else "")


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


def test_an_inhibition_holds_within_its_own_cluster(alertmanager):
    """Two clusters' alerts in one Alertmanager, with targets of the same names: cluster a's failing probe
    of chat and its prefix caching off mute a's affinity and warm-round alerts, never b's (b's warm rounds
    are on another route, which b's broken affinity of chat does not explain)."""
    route = {"target": "chat", "route_mode": "affinity"}
    in_a, in_b = {"cluster": "a"}, {"cluster": "b"}
    affinity = {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical", **route}
    no_gain = {"alertname": "KVWatchWarmRoundNoGain", "severity": "warning", **route}
    probe_failing = {"alertname": "KVWatchProbeFailing", "severity": "warning", "kind": "timeout", **route}
    caching_off = {"alertname": "KVWatchPrefixCachingDisabled", "severity": "warning", "evidence": "config",
                   "job": "llm/vllm", "instance": "10.0.0.7:8000"}  # fmt: skip
    alerts = [affinity | in_a, affinity | in_b, no_gain | in_a, no_gain | in_b | {"target": "docs"}]
    assert inhibited(alertmanager, *alerts, probe_failing | in_a, caching_off | in_a) == {
        'KVWatchSessionAffinityBroken{cluster="a"}': True,
        'KVWatchSessionAffinityBroken{cluster="b"}': False,
        'KVWatchWarmRoundNoGain{cluster="a"}': True,
        'KVWatchWarmRoundNoGain{cluster="b"}': False,
        'KVWatchProbeFailing{cluster="a"}': False,
        'KVWatchPrefixCachingDisabled{cluster="a"}': False,
    }


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` at `url`/metrics that carry `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def test_a_notification_the_store_cannot_take_is_sent_again_until_stored(tmp_path: Path, monkeypatch):
    """kvwatch serve's store is locked by another process and its write queue (store.queue_capacity: 1)
    full: the webhook answers 503, the real Alertmanager counts a failed notification and sends it again,
    and once the lock goes the alert is stored. Alertmanager counts each post in
    alertmanager_notification_requests_total and each refused one in ..._requests_failed_total."""
    # The idle target runs once, a second after the start rather than at its name's phase of the hour.
    monkeypatch.setattr(scheduler, "phase", lambda name, interval: (time.time() + 1) % interval)
    token_file, path = tmp_path / "webhook-token", tmp_path / "kvwatch.db"
    token_file.write_text("kvw-webhook-token-for-the-test\n")
    port = free_port()
    config = Config(
        targets=(Target("idle", "http://127.0.0.1:9", "m", interval_seconds=3600),),
        exporter=ExporterSettings(f"127.0.0.1:{port}", webhook_token_file=token_file),
        store=StoreSettings(path, queue_capacity=1),
    )
    service, loop, stopped = Service(config), asyncio.new_event_loop(), asyncio.Event()
    serving = threading.Thread(target=loop.run_until_complete, args=(service.run(stopped),))
    serving.start()
    exporter, locker = f"http://127.0.0.1:{port}", sqlite3.connect(path, isolation_level=None)
    try:
        with running_alertmanager(tmp_path, f"{exporter}/alerts", token_file) as alertmanager:
            with Store(path, readonly=True) as reader:  # the idle target's one run: a refused round
                wait_until(lambda: reader.sessions(), "the idle target's run stored")
            locker.execute("BEGIN IMMEDIATE")
            service.writer.submit(service.store.prune)  # the writer waits for the lock with it
            wait_until(lambda: metric_sum(exporter, "kvwatch_store_writes_queued") == 0, "the writer busy")
            service.writer.submit(service.store.prune)  # and this one fills the queue
            watchdog = [{"labels": {"alertname": "Watchdog", "severity": "none"}}]  # sent without group_wait
            httpx.post(f"{alertmanager}/api/v2/alerts", json=watchdog, timeout=5).raise_for_status()
            webhook = {"integration": "webhook"}
            failed = "alertmanager_notification_requests_failed_total"
            wait_until(lambda: metric_sum(alertmanager, failed, **webhook) >= 2, "two refused posts")
            assert metric_sum(exporter, "kvwatch_store_writes_dropped_total", reason="queue_full") >= 2
            refused = metric_sum(exporter, "kvwatch_webhook_posts_refused_total", reason="store_unavailable")
            assert refused >= 2
            locker.execute("COMMIT")
            with Store(path, readonly=True) as reader:
                wait_until(lambda: reader.alerts(), "the alert stored once the lock went")
                assert [a["alertname"] for a in reader.alerts()] == ["Watchdog"]
            sent = metric_sum(alertmanager, "alertmanager_notification_requests_total", **webhook)
            assert sent > metric_sum(alertmanager, failed, **webhook)  # the last one went through
    finally:
        locker.close()
        loop.call_soon_threadsafe(stopped.set)
        serving.join(timeout=30)
        loop.close()


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
        "kvwatch-probe-share.yml",
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


def test_missing_rule_files_are_an_error_naming_the_pattern(tmp_path, monkeypatch):
    """An installation without its rule files would start a Prometheus that alerts on nothing."""
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "kvwatch.rules.yml").write_text("groups: []\n")
    monkeypatch.setattr(configs, "REPO", tmp_path)
    with pytest.raises(LabError, match=r"no rule files match .*/prometheus/rules/\*\.yml: this kvwatch"):
        rule_files(LabState(tmp_path, 21000))
