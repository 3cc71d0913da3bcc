"""The config's mistakes: every one is one exact message with its path, the first the user must fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from config_cases import KEY, TESTDATA

from kvwatch.cli import main
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import Target, load_config

# Every label a cluster label would overwrite: kvwatch's own (collectors.exporter) and Prometheus'.
TAKEN_LABELS = (
    "backend, echoed, evidence, expect_sticky, failover, gone, instance, job, kind, label, le, listener, "
    "log, missing, outcome, quantile, reason, round, route_mode, source, status_class, sticky, target, "
    "upstream"
)

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
