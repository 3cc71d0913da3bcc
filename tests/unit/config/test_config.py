"""The config: defaults first, the user's values over them, every mistake one exact message with its path."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, free_port, kvwatch_bounded_each, kvwatch_in_process
from kvwatch.cli import main
from kvwatch.config.loading import ConfigError
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
    resolve_api_key,
    resolve_store_password,
    resolve_webhook_token,
)
from kvwatch.core.credentials import MAX_SECRET_FILE_BYTES
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK_URL

TESTDATA = REPO / "tests" / "testdata" / "config"
EXAMPLES = REPO / "examples"
# Every label a cluster label would overwrite: kvwatch's own (collectors.exporter) and Prometheus'.
TAKEN_LABELS = (
    "backend, echoed, evidence, expect_sticky, failover, gone, instance, job, kind, label, le, listener, "
    "log, missing, outcome, quantile, reason, round, route_mode, source, status_class, sticky, target, "
    "upstream"
)
KEY = "sk-live-0123456789abcdef"  # what a pasted key looks like; it must never be echoed

# (<what> of tests/testdata/config/invalid-<what>.yml, the exact message after "error in <file>: ")
INVALID = [
    (
        "alertmanager-url",
        'alertmanager.url: must be an http:// or https:// URL with a host, got "ftp://127.0.0.1:18003"',
    ),
    ("api-key-env-and-file", "targets[0]: set api_key_env or api_key_file, not both"),
    (
        "api-key-env-holds-a-key",
        "targets[0].api_key_env: "
        "must be the name of an environment variable (letters, digits and _), not the key itself",
    ),
    (
        "api-key-in-file",
        "targets[0].api_key: secrets do not belong in the config file; "
        "name an environment variable (api_key_env) or a file (api_key_file) that holds it",
    ),
    ("backend-header", 'targets[0].backend.headers[1]: must be an HTTP header name, got "X-Worker-Id:"'),
    (
        "backend-json-paths-type",
        'targets[0].backend.json_paths: expected a list, got the string "nvext.worker_id"',
    ),
    (
        "base-url",
        'targets[0].base_url: must be an http:// or https:// URL with a host, got "127.0.0.1:18000"',
    ),
    (
        "base-url-password-port",
        'targets[0].base_url: "http://kvw:[redacted]@127.0.0.1:99999/v1" is not a valid URL: '
        "port 99999 is not 1 to 65535",
    ),
    (
        "base-url-port",
        'targets[0].base_url: "http://127.0.0.1:99999" is not a valid URL: port 99999 is not 1 to 65535',
    ),
    (
        "base-url-port-name",
        "targets[0].base_url: \"http://127.0.0.1:port\" is not a valid URL: Invalid port: 'port'",
    ),
    (
        "cluster-label",
        'cluster_label: must be a Prometheus label name (letters, digits and _, not starting with "__"), '
        'got "k8s-cluster"',
    ),
    (
        "cluster-label-reserved",
        'cluster_label: must be a Prometheus label name (letters, digits and _, not starting with "__"), '
        'got "__cluster"',
    ),
    (
        "cluster-label-kvwatch",
        f'cluster_label: "target" is taken by kvwatch\'s own series or by Prometheus ({TAKEN_LABELS}): '
        "pick another",
    ),
    (
        "cluster-label-prometheus",
        f'cluster_label: "le" is taken by kvwatch\'s own series or by Prometheus ({TAKEN_LABELS}): '
        "pick another",
    ),
    ("exporter-cluster-empty", "exporter.cluster: must not be empty"),
    ("exporter-cluster-too-long", "exporter.cluster: must be at most 128 characters, got 129"),
    ("block-size", "targets[0].block_size: must be >= 1, got 0"),
    ("block-size-too-large", "targets[0].block_size: must be <= 1048576 (1 << 20), got 2097152"),
    ("block-size-float", "targets[0].block_size: expected an integer, got the number 16.5"),
    ("control-character", "invalid YAML: unacceptable character #x0007: special characters are not allowed"),
    ("date", "invalid YAML at line 6, column 13: not a valid timestamp"),
    ("duplicate-gateway-log-name", 'gateway_logs[1].name: "chat" is taken by gateway_logs[0]'),
    ("duplicate-key", 'invalid YAML at line 6, column 5: duplicate key "rounds"'),
    ("duplicate-target-name", 'targets[1].name: "chat" is taken by targets[0]'),
    ("empty-model", "targets[0].model: must not be empty"),
    ("empty", "the file is empty"),
    ("expect-sticky", 'targets[0].expect_sticky: expected true or false, got the string "yes"'),
    ("gateway-log-expect-sticky", "gateway_logs[0].expect_sticky: expected true or false, got the number 1"),
    (
        "gateway-log-format",
        'gateway_logs[0].format: unknown format "istio"; known: envoy, ingress-nginx, nginx',
    ),
    ("gateway-log-max-sessions", "gateway_logs[0].max_sessions: must be >= 1 and <= 1000000, got 0"),
    (
        "gateway-log-max-sessions-too-many",
        "gateway_logs[0].max_sessions: must be >= 1 and <= 1000000, got 1000001",
    ),
    ("gateway-log-missing-path", "gateway_logs[0].path: required for source file"),
    ("gateway-log-http-listen-not-otlp", "gateway_logs[0].http_listen: only for source otlp"),
    (
        "gateway-log-http-listen-port",
        'gateway_logs[0].http_listen: must be host:port with a port from 1 to 65535, got "127.0.0.1:70000"',
    ),
    (
        "gateway-log-name",
        'gateway_logs[0].name: must be 1-64 lowercase letters, digits, "_" or "-", got "gateway.affinity"',
    ),
    ("gateway-log-session-ttl", "gateway_logs[0].session_ttl_seconds: must be > 0 and <= 604800, got 0"),
    (
        "gateway-log-session-ttl-too-long",
        "gateway_logs[0].session_ttl_seconds: must be > 0 and <= 604800, got inf",
    ),
    ("gateway-log-spread-window", "gateway_logs[0].spread_window_seconds: must be > 0 and <= 86400, got 0"),
    (
        "gateway-log-spread-window-too-long",
        "gateway_logs[0].spread_window_seconds: must be > 0 and <= 86400, got 86401",
    ),
    ("integer-too-long", "invalid YAML at line 6, column 13: not a valid int"),
    ("interval-null", "targets[0].interval_seconds: expected a number, got null"),
    ("interval-type", 'targets[0].interval_seconds: expected a number, got the string "60s"'),
    ("interval", "targets[0].interval_seconds: must be >= 1 and <= 86400, got 0"),
    ("interval-huge-integer", "targets[0].interval_seconds: must be >= 1 and <= 86400, got inf"),
    ("interval-nan", "targets[0].interval_seconds: must be >= 1 and <= 86400, got nan"),
    ("interval-too-long", "targets[0].interval_seconds: must be >= 1 and <= 86400, got 86401"),
    ("interval-too-short", "targets[0].interval_seconds: must be >= 1 and <= 86400, got 0.5"),
    ("listen-host", 'exporter.listen: "bad_host" is not an IP address or host name'),
    ("listen-port", 'exporter.listen: must be host:port with a port from 1 to 65535, got "127.0.0.1:99999"'),
    (
        "listen-without-host",
        "exporter.listen: "
        'name the host (127.0.0.1: this machine only, 0.0.0.0: every interface), got ":9464"',
    ),
    (
        "dashboard-runbook-url",
        'dashboard.runbook_url: must be an http:// or https:// URL with a host, got "wiki.example.net/rb"',
    ),
    (
        "dashboard-runbook-url-fragment",
        "dashboard.runbook_url: must have no #fragment: each alert's is added",
    ),
    ("missing-model", "targets[0].model: required key is missing"),
    ("not-utf8", "not UTF-8 text"),
    ("nothing-to-watch", "nothing to watch: add a target or a gateway log"),
    (
        "prometheus-url",
        'prometheus.url: must be an http:// or https:// URL with a host, got "prometheus:9090"',
    ),
    (
        "prometheus-rules-url",
        'prometheus.rules_url: must be an http:// or https:// URL with a host, got "vmalert:8880"',
    ),
    (
        "prometheus-url-port",
        'prometheus.url: "http://127.0.0.1:0" is not a valid URL: port 0 is not 1 to 65535',
    ),
    ("rounds-float", "targets[0].rounds: expected an integer, got the number 6.5"),
    ("rounds-too-many", "targets[0].rounds: must be >= 2 and <= 50, got 51"),
    ("rounds", "targets[0].rounds: must be >= 2 and <= 50, got 1"),
    (
        "router",
        'targets[0].router: unknown router "smg"; known: dynamo',
    ),
    (
        "route-mode",
        "targets[0].route_mode: must be one of affinity, consistent_hash, manual, cache_aware, round_robin, "
        'random; got the string "afinity"; did you mean "affinity"?',
    ),
    (
        "schedule",
        'targets[0].schedule: "0 25 * * *" is not a cron schedule: '
        "Error validating expression '25': the last value (25) is higher than the maximum value (23)",
    ),
    ("schedule-and-interval", "targets[0]: set interval_seconds or schedule, not both"),
    (
        "schedule-fields",
        'targets[0].schedule: "0 3 * *" has 4 fields; '
        "a schedule has 5 (minute hour day month weekday) or 6 with seconds first",
    ),
    ("schedule-never", 'targets[0].schedule: "0 3 31 2 *" never fires'),
    (
        "schedule-weekday-number",
        'targets[0].schedule: "0 3 * * 1-5": '
        "name the weekdays (mon-sun), numbers differ between cron dialects",
    ),
    ("session-header", 'targets[0].session.header: must be an HTTP header name, got "X Session Id"'),
    ("session-mode", 'targets[0].session.mode: must be one of client, server, none; got the string "sticky"'),
    ("sessions-per-run-boolean", "targets[0].sessions_per_run: expected an integer, got the boolean true"),
    ("sessions-per-run", "targets[0].sessions_per_run: must be >= 1 and <= 1000, got 0"),
    ("sessions-per-run-too-many", "targets[0].sessions_per_run: must be >= 1 and <= 1000, got 1001"),
    ("store-flush-seconds", "store.flush_seconds: must be >= 0 and <= 300, got -1"),
    (
        "store-password-env-and-file",
        "store: set password_env or password_file, not both",
    ),
    (
        "store-password-env-holds-a-password",
        "store.password_env: "
        "must be the name of an environment variable (letters, digits and _), not the password itself",
    ),
    (
        "store-password-in-file",
        "store.password: secrets do not belong in the config file; "
        "name an environment variable (password_env) or a file (password_file) that holds it",
    ),
    (
        "store-password-without-url",
        "store: a password is for a PostgreSQL store: "
        "set url too, or leave out password_env and password_file",
    ),
    ("store-flush-seconds-too-long", "store.flush_seconds: must be >= 0 and <= 300, got 301"),
    ("store-queue-capacity", "store.queue_capacity: must be >= 1 and <= 10000, got 0"),
    ("store-queue-capacity-too-large", "store.queue_capacity: must be >= 1 and <= 10000, got 10001"),
    ("store-retention", "store.retention_days: must be > 0 and <= 3650, got 0"),
    ("store-retention-too-long", "store.retention_days: must be > 0 and <= 3650, got 3651"),
    ("store-retry-seconds", "store.retry_seconds: must be >= 0 and <= 3600, got -1"),
    ("store-retry-seconds-too-long", "store.retry_seconds: must be >= 0 and <= 3600, got inf"),
    (
        "store-url-password",
        "store.url: the password does not belong in the URL; "
        "name an environment variable (password_env) or a file (password_file) that holds it",
    ),
    (
        "store-url-query-password",
        "store.url: the password does not belong in the URL; "
        "name an environment variable (password_env) or a file (password_file) that holds it",
    ),
    (
        "store-url-scheme",
        'store.url: must be a URL of postgresql://, postgres://, got "mysql://kvwatch@127.0.0.1/kvwatch"; '
        "a file goes in path",
    ),
    ("target-name", 'targets[0].name: must be 1-64 lowercase letters, digits, "_" or "-", got "Chat Route"'),
    ("target-not-a-mapping", 'targets[0]: expected a mapping, got the string "chat"'),
    ("targets-not-a-list", "targets: expected a list, got a mapping"),
    ("timeout", "targets[0].timeout_seconds: must be > 0 and <= 3600, got -1"),
    ("timeout-infinite", "targets[0].timeout_seconds: must be > 0 and <= 3600, got inf"),
    ("timeout-too-long", "targets[0].timeout_seconds: must be > 0 and <= 3600, got 3601"),
    (
        "timezone",
        'targets[0].timezone: unknown time zone "Europe/Atlantis"; '
        "use an IANA name such as UTC or Europe/Paris",
    ),
    ("top-level-list", "the top level must be a mapping of keys, got a list"),
    (
        "unknown-key",
        'targets[1].session.hedaer: unknown key; did you mean "header"? known: header, key, mode',
    ),
    (
        "unknown-key-target",
        'targets[0].modle: unknown key; did you mean "model"? known: api_key_env, api_key_file, backend, '
        "base_url, block_size, expect_sticky, interval_seconds, kind, lifecycle, model, name, rounds, "
        "route_mode, router, sagemaker, schedule, session, sessions_per_run, timeout_seconds, timezone, "
        "workload",
    ),
    (
        "unknown-key-exporter",
        'exporter.webhook_token_flie: unknown key; did you mean "webhook_token_file"? known: cluster, '
        "listen, webhook_token_env, webhook_token_file",
    ),
    (
        "unknown-key-top-level-typo",
        'targest: unknown key; did you mean "targets"? known: alertmanager, cluster_label, dashboard, '
        "exporter, gateway_logs, prometheus, store, targets",
    ),
    (
        "gateway-log-format-typo",
        'gateway_logs[0].format: unknown format "ngnix"; did you mean "nginx"? '
        "known: envoy, ingress-nginx, nginx",
    ),
    ("router-typo", 'targets[0].router: unknown router "dynamoo"; did you mean "dynamo"? known: dynamo'),
    (
        "listen-without-port",
        'exporter.listen: expected host:port (e.g. 127.0.0.1:9464) or a port, got "localhost"',
    ),
    ("listen-type", "exporter.listen: expected host:port (e.g. 127.0.0.1:9464) or a port, got a list"),
    (
        "unknown-top-level-key",
        "thresholds: unknown key; known: "
        "alertmanager, cluster_label, dashboard, exporter, gateway_logs, prometheus, store, targets",
    ),
    ("webhook-token-env-and-file", "exporter: set webhook_token_env or webhook_token_file, not both"),
    (
        "webhook-token-env-holds-a-token",
        "exporter.webhook_token_env: "
        "must be the name of an environment variable (letters, digits and _), not the token itself",
    ),
    (
        "webhook-token-in-file",
        "exporter.token: secrets do not belong in the config file; "
        "name an environment variable (webhook_token_env) or a file (webhook_token_file) that holds it",
    ),
    ("workload-max-tokens", "targets[0].workload.max_tokens: must be >= 1 and <= 50000, got 0"),
    ("workload-max-tokens-too-many", "targets[0].workload.max_tokens: must be >= 1 and <= 50000, got 50001"),
    ("workload-not-a-mapping", 'targets[0].workload: expected a mapping, got the string "synthetic"'),
    ("workload-system-tokens", "targets[0].workload.system_tokens: must be >= 0 and <= 1000000, got -1"),
    (
        "workload-system-tokens-too-many",
        "targets[0].workload.system_tokens: must be >= 0 and <= 1000000, got 1000001",
    ),
    (
        "workload-too-large-for-a-run",
        "targets[0]: a run's prompts, sessions_per_run x (workload.system_tokens + rounds x "
        "workload.turn_tokens), are 20000000 tokens, more than 10000000; lower one of them",
    ),
    ("workload-turn-tokens", "targets[0].workload.turn_tokens: must be >= 1 and <= 1000000, got 0"),
    (
        "workload-turn-tokens-too-many",
        "targets[0].workload.turn_tokens: must be >= 1 and <= 1000000, got 1000001",
    ),
    (
        "yaml",
        "invalid YAML at line 5, column 4: the indentation does not match: this line is indented less than "
        "the lines before it of the same block, and more than the block around it; line it up with the keys "
        "or list items it belongs to",
    ),
    (
        "yaml-list-item",
        "invalid YAML at line 8, column 6: the indentation does not match: this line is indented less than "
        "the lines before it of the same block, and more than the block around it; line it up with the keys "
        "or list items it belongs to",
    ),
    (
        "yaml-indent-deeper",
        'invalid YAML at line 4, column 11: an unexpected ":" here: this line is indented deeper than the '
        'key it follows, or a value holds ": "; line the keys of one mapping up in one column, or quote the '
        "value",
    ),
    (
        "yaml-tab",
        "invalid YAML at line 4, column 1: a tab: YAML indents with spaces only; replace the tab with spaces",
    ),
    (
        "yaml-open-quote",
        "invalid YAML at line 5, column 1: the file ends inside a quoted value: close the quote (opened at "
        "line 2, column 11)",
    ),
    (
        "yaml-open-list",
        'invalid YAML at line 2, column 1: the file ends inside a [ ] or { } list: close it with "]" or "}"',
    ),
]


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


def test_every_invalid_file_has_its_expected_message():
    assert sorted(path.name for path in TESTDATA.glob("invalid-*.yml")) == sorted(
        f"invalid-{what}.yml" for what, _ in INVALID
    )


@pytest.mark.parametrize(("what", "message"), INVALID, ids=[what for what, _ in INVALID])
def test_invalid_config_is_one_exact_message(what, message):
    path = TESTDATA / f"invalid-{what}.yml"
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"error in {path}: {message}"
    assert KEY not in str(error.value)


def test_missing_file():
    path = TESTDATA / "no-such-file.yml"
    with pytest.raises(
        ConfigError, match=re.escape(f"error in {path}: cannot read it: No such file or directory")
    ):
        load_config(path)


def test_a_config_over_1_mib_is_refused_unread(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_bytes((TESTDATA / "good-minimal.yml").read_bytes().ljust((1 << 20) + 1, b"#"))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"error in {path}: larger than 1 MiB; a kvwatch config is a few kilobytes"


# 10,000 deep: Python's recursion limit is 1,000. The first node 33 levels deep is the 32nd list, or the
# key of the 32nd mapping.
@pytest.mark.parametrize(("opening", "closing", "column"), [("[", "]", 41), ("{a: ", "}", 131)])
def test_deep_nesting_is_one_line(tmp_path, opening, closing, column):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(f"targets: {opening * 10_000}{closing * 10_000}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"error in {path}: invalid YAML at line 1, column {column}: nested more than 32 levels deep"
    )


def with_store_path(tmp_path: Path, store: Path) -> Path:
    path = tmp_path / "kvwatch.yaml"
    minimal = (TESTDATA / "good-minimal.yml").read_text()
    path.write_text(f"{minimal}store:\n  path: {store}\n")
    return path


@pytest.mark.parametrize(
    ("store", "problem"),
    [
        ("", '"{tmp}" is a directory; name the database file in it, e.g. "{tmp}/kvwatch.db"'),
        ("file/history/kvwatch.db", 'cannot be created: "{tmp}/file" is not a directory'),
    ],
    ids=["directory", "under-a-file"],
)
def test_a_store_path_no_one_can_create_is_one_line(tmp_path, store, problem):
    (tmp_path / "file").touch()
    path = with_store_path(tmp_path, tmp_path / store)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"error in {path}: store.path: " + problem.format(tmp=tmp_path)


def test_serve_says_in_one_line_that_it_cannot_open_the_store(tmp_path, capsys):
    # /proc takes no new files, even from root; the config cannot know, only opening the store does.
    path = with_store_path(tmp_path, Path("/proc/kvwatch.db"))
    assert main.main(["serve", "--config", str(path)]) == 1
    assert capsys.readouterr().err == (
        "kvwatch serve: cannot open the kvwatch store /proc/kvwatch.db: "
        "cannot create /proc/kvwatch.db-writer.lock: No such file or directory\n"
    )


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match=r"^rounds: must be >= 2 and <= 50, got 60$"):
        Target(name="chat", base_url="http://127.0.0.1:18000", model="m", rounds=60)


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


def target(**key_source) -> Target:
    return Target(name="chat", base_url="http://127.0.0.1:18000", model="lab-model", **key_source)


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVWATCH_TEST_KEY", f" {KEY}\n")
    assert resolve_api_key(target(api_key_env="KVWATCH_TEST_KEY")) == KEY


def test_api_key_from_file(tmp_path):
    (tmp_path / "key").write_text(f"{KEY}\n")
    assert resolve_api_key(target(api_key_file=tmp_path / "key")) == KEY


def test_no_api_key_configured():
    assert resolve_api_key(target()) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (None, "target chat: environment variable KVWATCH_TEST_KEY is not set"),
        ("  \n", "target chat: environment variable KVWATCH_TEST_KEY is empty"),
        (
            f"{KEY} {KEY}",
            "target chat: "
            "environment variable KVWATCH_TEST_KEY must hold one API key, without spaces or line breaks",
        ),
    ],
)
def test_api_key_environment_errors(monkeypatch, env, message):
    monkeypatch.delenv("KVWATCH_TEST_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("KVWATCH_TEST_KEY", env)
    with pytest.raises(ConfigError) as error:
        resolve_api_key(target(api_key_env="KVWATCH_TEST_KEY"))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read API key file {path}: No such file or directory"),
        ("directory", "cannot read API key file {path}: Is a directory"),
        (b"", "API key file {path} is empty"),
        (
            f"{KEY}\n{KEY}\n".encode(),
            "API key file {path} must hold one API key, without spaces or line breaks",
        ),
        (KEY.encode() + b"\xff", "API key file {path} is not UTF-8 text"),
    ],
)
def test_api_key_file_errors(tmp_path, content, problem):
    path = tmp_path / "key"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        resolve_api_key(target(api_key_file=path))
    assert str(error.value) == "target chat: " + problem.format(path=path)
    assert KEY not in str(error.value)


def test_store_password_from_environment_or_file_and_where_the_store_is(monkeypatch, tmp_path):
    url = "postgresql://kvwatch@127.0.0.1:5432/kvwatch"
    monkeypatch.setenv("KVWATCH_TEST_STORE_PASSWORD", f"{KEY}\n")
    from_env = StoreSettings(url=url, password_env="KVWATCH_TEST_STORE_PASSWORD")
    assert (resolve_store_password(from_env), from_env.location) == (KEY, url)
    (tmp_path / "password").write_text(f"{KEY}\n")
    assert resolve_store_password(StoreSettings(url=url, password_file=tmp_path / "password")) == KEY
    assert (resolve_store_password(StoreSettings()), StoreSettings().location) == (None, StoreSettings().path)
    monkeypatch.delenv("KVWATCH_TEST_STORE_PASSWORD")
    with pytest.raises(
        ConfigError, match="^store: environment variable KVWATCH_TEST_STORE_PASSWORD is not set$"
    ):
        resolve_store_password(from_env)


def test_webhook_token_from_environment_or_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVWATCH_TEST_TOKEN", f"{KEY}\n")
    assert resolve_webhook_token(ExporterSettings(webhook_token_env="KVWATCH_TEST_TOKEN")) == KEY
    (tmp_path / "token").write_text(f"{KEY}\n")
    assert resolve_webhook_token(ExporterSettings(webhook_token_file=tmp_path / "token")) == KEY
    assert resolve_webhook_token(ExporterSettings()) is None


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"webhook_token_env": "KVWATCH_UNSET_TOKEN"}, "environment variable KVWATCH_UNSET_TOKEN is not set"),
        ({"webhook_token_file": "token"}, "webhook token file {path} is empty"),
        (
            {"webhook_token_file": "missing"},
            "cannot read webhook token file {path}: No such file or directory",
        ),
    ],
)
def test_webhook_token_errors(tmp_path, source, message):
    (tmp_path / "token").write_text("\n")
    if "webhook_token_file" in source:
        source = {"webhook_token_file": tmp_path / source["webhook_token_file"]}
    with pytest.raises(ConfigError) as error:
        resolve_webhook_token(ExporterSettings(**source))
    assert str(error.value) == "exporter: " + message.format(path=source.get("webhook_token_file"))


SECRET_FILE_KEYS = [  # key, the section that names it, the secret it holds
    ("api_key_file", "target chat", "API key"),
    ("webhook_token_file", "exporter", "webhook token"),
    ("password_file", "store", "password"),
]


def test_serve_refuses_a_secret_file_that_holds_no_secret_at_once_in_one_line(tmp_path, not_a_secret_file):
    path, problem = not_a_secret_file
    commands, said = [], []
    for key, owner, secret in SECRET_FILE_KEYS:
        target = {"name": "chat", "base_url": "http://127.0.0.1:9", "model": "lab-model"}
        exporter = {"listen": f"127.0.0.1:{free_port()}"}
        # The password is read before the store is opened: nothing need listen on port 9.
        store = {"url": "postgresql://kvwatch@127.0.0.1:9/kvwatch"} if key == "password_file" else {}
        {"api_key_file": target, "webhook_token_file": exporter, "password_file": store}[key][key] = str(path)
        config = tmp_path / f"{key}.yaml"
        store.setdefault("path", str(tmp_path / "kvwatch.db"))
        config.write_text(yaml.safe_dump({"targets": [target], "exporter": exporter, "store": store}))
        commands.append(["serve", "--config", str(config)])
        said.append(f"kvwatch serve: {owner}: {secret} file {path} {problem.format(secret=secret)}\n")

    served = kvwatch_bounded_each(commands, tmp_path)
    assert [(s.returncode, s.stderr) for s in served] == [(1, line) for line in said]


def test_a_secret_file_at_the_size_limit_is_read(tmp_path):
    (tmp_path / "key").write_text("k" * MAX_SECRET_FILE_BYTES)
    assert resolve_api_key(target(api_key_file=tmp_path / "key")) == "k" * MAX_SECRET_FILE_BYTES


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


@pytest.mark.parametrize(
    "lifecycle, message",
    [
        (
            "{idle_after_round: 6}",
            "targets[0].lifecycle.idle_seconds: must be positive when idle_after_round is set",
        ),
        (
            "{idle_after_round: 6, idle_seconds: 30}",
            "targets[0].lifecycle: idle_after_round must be below rounds",
        ),
    ],
)
def test_a_lifecycle_that_cannot_run_is_refused_naming_the_key(tmp_path, lifecycle, message):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(
        "targets:\n  - name: chat\n    base_url: http://127.0.0.1:8000\n    model: m\n    rounds: 6\n"
        f"    lifecycle: {lifecycle}\n"
    )
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert message in str(error.value)
