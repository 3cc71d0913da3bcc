"""The config's good files: defaults first, the user's values over them; the examples; config check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from config_cases import TESTDATA, target

from kvwatch.config.settings import (
    BackendIdentity,
    Config,
    DashboardSettings,
    ExporterSettings,
    GatewayLog,
    PrometheusService,
    Service,
    SessionSettings,
    StoreSettings,
    Target,
    Workload,
    load_config,
)
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK_URL
from paths import REPO
from processes import kvwatch_in_process

EXAMPLES = REPO / "examples"


def test_minimal_file_takes_every_default():
    config = load_config(TESTDATA / "good-minimal.yml")
    (target,) = config.targets
    assert dataclasses.asdict(target) == {
        "name": "chat",
        "base_url": "http://127.0.0.1:18000",
        "model": "lab-model",
        "route_mode": "affinity",
        "expect_sticky": True,  # affinity routes pin sessions
        "api_key_env": None,
        "api_key_file": None,
        "session": {"mode": "client", "key": None, "header": None},  # the kind's own: X-Session-Id on openai
        "backend": {
            "headers": (
                "X-Upstream",
                "X-Worker-Id",
                "x-smg-routed-worker-id",
                "target-pod",
                "x-session-token",
            ),
            "json_paths": ("nvext.worker_id",),
        },
        "router": None,  # the request carries nothing beyond the OpenAI API
        "interval_seconds": 60.0,
        "schedule": None,  # runs every interval_seconds
        "timezone": "UTC",
        "sessions_per_run": 2,
        "rounds": 6,
        "workload": {
            "system_tokens": 1000,
            "turn_tokens": 200,
            "max_tokens": 32,
            "seed": 0,
            "sharegpt": None,
        },
        "timeout_seconds": 60.0,
        "block_size": None,  # learned from the engines
        "kind": "openai",  # an OpenAI-compatible route over HTTP
        "sagemaker": None,  # only for kind sagemaker
        "lifecycle": {"idle_after_round": None, "idle_seconds": 0.0, "check_close": False},  # no idle
    }
    assert config.gateway_logs == ()
    assert config.exporter.listen == "127.0.0.1:9464"
    assert config.exporter.cluster is None  # the exporter's series carry no cluster label
    assert config.cluster_label == CLUSTER_LABEL == "cluster"
    assert (config.exporter.host, config.exporter.port) == ("127.0.0.1", 9464)
    assert config.store == StoreSettings(path=Path(".kvwatch/kvwatch.db"), retention_days=14.0)
    store = config.store
    assert (store.queue_capacity, store.retry_seconds, store.flush_seconds) == (1000, 120.0, 10.0)
    assert config.prometheus.url is None and config.alertmanager.url is None
    assert config.dashboard.runbook_url == RUNBOOK_URL  # where the generated alerts link


def test_gateway_log_defaults_match_the_follower():
    log = GatewayLog(name="chat", path=Path("access.jsonl"))
    assert (log.spread_window_seconds, log.session_ttl_seconds, log.max_sessions) == (600.0, 1800.0, 100_000)
    assert log.expect_sticky and log.format == "nginx"


@pytest.mark.parametrize(
    ("route_mode", "sticky"),
    [("affinity", True), ("consistent_hash", True), ("manual", True), ("cache_aware", False),
     ("round_robin", False), ("random", False)],
)  # fmt: skip
def test_expect_sticky_defaults_from_the_route_mode_and_can_be_set(route_mode, sticky):
    assert target(route_mode=route_mode).expect_sticky is sticky
    assert target(route_mode=route_mode, expect_sticky=not sticky).expect_sticky is not sticky


def test_full_file_overrides_every_default_and_merges_anchors():
    chat = Target(
        name="chat",
        base_url="https://llm.example.com/api",
        model="meta-llama/Llama-3.1-8B-Instruct",
        route_mode="cache_aware",
        expect_sticky=True,
        api_key_env="KVWATCH_CHAT_API_KEY",
        session=SessionSettings(mode="server", header="X-SMG-Routing-Key"),
        backend=BackendIdentity(headers=("X-Worker-Id",), json_paths=("nvext.worker_id", "metadata.pod")),
        router="dynamo",
        interval_seconds=30.5,
        sessions_per_run=3,
        rounds=8,
        workload=Workload(
            system_tokens=2000, turn_tokens=150, max_tokens=16, seed=7, sharegpt=Path("conversations.json")
        ),
        timeout_seconds=20.0,
        block_size=32,
    )
    round_robin = dataclasses.replace(
        chat,
        name="chat-rr",
        route_mode="round_robin",
        expect_sticky=False,
        api_key_env=None,
        api_key_file=Path("/run/secrets/kvwatch-key"),
    )
    assert load_config(TESTDATA / "good.yml") == Config(
        targets=(chat, round_robin),
        gateway_logs=(
            GatewayLog(
                name="chat",
                path=Path("/var/log/envoy/kvwatch.jsonl"),
                spread_window_seconds=300.0,
                session_ttl_seconds=900.0,
                max_sessions=5000,
                expect_sticky=False,
                format="envoy",
            ),
        ),
        exporter=ExporterSettings(listen="[::1]:9100", cluster="eu-west"),
        store=StoreSettings(
            path=Path("/var/lib/kvwatch/history.db"),
            retention_days=3.5,
            queue_capacity=5000,
            retry_seconds=600.0,
            flush_seconds=20.0,
        ),
        prometheus=PrometheusService(url="http://prometheus:9090", rules_url="http://vmalert:8880"),
        alertmanager=Service(url="http://alertmanager:9093"),
        dashboard=DashboardSettings(runbook_url="https://wiki.example.net/sre/kvwatch-runbook"),
        cluster_label="region",
    )
    assert ExporterSettings(listen="[::1]:9100").host == "::1"


def test_lab_example_points_at_the_lab():
    config = load_config(EXAMPLES / "kvwatch.lab.yaml")
    assert [(t.name, t.base_url, t.model, t.route_mode, t.expect_sticky) for t in config.targets] == [
        ("lab-affinity", "http://127.0.0.1:18000", "lab-model", "affinity", True),
        ("lab-round-robin", "http://127.0.0.1:18001", "lab-model", "round_robin", False),
    ]
    assert [(log.name, log.path, log.expect_sticky) for log in config.gateway_logs] == [
        ("affinity", Path(".kvwatch/lab/logs/gateway-affinity.jsonl"), True),
        ("round_robin", Path(".kvwatch/lab/logs/gateway-round_robin.jsonl"), False),
    ]
    assert config.exporter.listen == "127.0.0.1:18004"
    assert config.store.path == Path(".kvwatch/lab/kvwatch.db")
    assert config.prometheus.url == "http://127.0.0.1:18002"
    assert config.alertmanager.url == "http://127.0.0.1:18003"


def test_real_cluster_example_loads():
    config = load_config(EXAMPLES / "kvwatch.example.yaml")
    affinity, manual = config.targets
    assert affinity.api_key_env == "KVWATCH_CHAT_API_KEY" and affinity.backend.headers == ("X-Worker-Id",)
    assert manual.session.header == "X-SMG-Routing-Key" and manual.api_key_file is not None
    assert config.exporter.host == "0.0.0.0"


@pytest.fixture
def kvwatch(capsys, monkeypatch):
    """`kvwatch ARGS` in this process, from the repository as the paths below are."""
    monkeypatch.chdir(REPO)
    return lambda *args: kvwatch_in_process(capsys, *args)


@pytest.mark.parametrize(
    ("path", "summary"),
    [
        ("examples/kvwatch.lab.yaml", "2 targets, 2 gateway logs"),
        ("examples/kvwatch.example.yaml", "2 targets, 1 gateway log"),
        ("tests/testdata/config/good-minimal.yml", "1 target, 0 gateway logs"),
    ],
)
def test_config_check_file_only_accepts_a_good_file(kvwatch, path, summary):
    # The examples name secrets and directories of another machine (the lab's, a cluster's).
    result = kvwatch("config", "check", "--file-only", path)
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"{path}: OK ({summary}; the file only)\n",
        "",
    )


def test_config_check_prints_the_one_error(kvwatch):
    path = "tests/testdata/config/invalid-unknown-key.yml"
    result = kvwatch("config", "check", path)
    problem = 'targets[1].session.hedaer: unknown key; did you mean "header"? known: header, key, mode'
    expected = f"error in {path}: {problem}\n"
    assert (result.returncode, result.stdout, result.stderr) == (1, "", expected)


@pytest.mark.parametrize("port", ["19600", '"19600"'])
def test_listen_takes_a_port_alone_for_this_machine_only(tmp_path, port):
    path = tmp_path / "kvwatch.yaml"
    path.write_text((TESTDATA / "good-minimal.yml").read_text() + f"exporter:\n  listen: {port}\n")
    exporter = load_config(path).exporter
    assert (exporter.listen, exporter.host, exporter.port) == ("127.0.0.1:19600", "127.0.0.1", 19600)


def test_config_check_of_a_missing_file(kvwatch):
    result = kvwatch("config", "check", "nowhere.yaml")
    assert result.returncode == 1
    assert result.stderr == "error in nowhere.yaml: cannot read it: No such file or directory\n"


def readme_configuration_section() -> str:
    """The configuration page of the docs: the table of every key."""
    return (REPO / "docs" / "configuration.md").read_text()


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of a config section by its full path, e.g. `targets[].session.mode`."""
    keys = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.default):
            keys += leaf_keys(type(field.default), f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def test_readme_documents_every_key():
    section = readme_configuration_section()
    keys = [*leaf_keys(Config), *leaf_keys(Target, "targets[]."), *leaf_keys(GatewayLog, "gateway_logs[].")]
    assert [key for key in keys if f"`{key}`" not in section] == []
