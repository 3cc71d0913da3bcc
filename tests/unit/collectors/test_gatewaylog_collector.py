"""The gateway access log Collector: its series, bounded labels, and a real `kvwatch serve` following logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from gatewaylog_lines import R1, R2, T0, Clock, append, entry
from gatewaylog_lines import follow as follow  # the fixture
from gatewaylog_lines import log as log  # the fixture
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.metrics import GatewayLogCollector
from kvwatch.core.labels import MAX_LABEL_VALUE_LENGTH, MAX_VALUES_PER_LABEL, OTHER
from paths import REPO
from processes import free_port, http_get, stop, wait_http


def test_the_collector_exposes_counts_and_never_session_ids(tmp_path):
    affinity_log, rr_log = tmp_path / "affinity.jsonl", tmp_path / "rr.jsonl"
    append(
        affinity_log,
        entry("secret-session-1", R1),
        entry("secret-session-1", R1),
        entry("secret-assigned-2", f"{R1}, {R2}", source="assigned"),
        "garbage\n",
    )
    append(
        rr_log,
        entry("secret-session-3", R1, listener="round_robin"),
        entry("secret-session-3", R2, listener="round_robin"),
    )
    clock = Clock(T0 + 1)
    with (
        GatewayLogFollower(affinity_log, "affinity", clock=clock) as affinity,
        GatewayLogFollower(rr_log, "round_robin", expect_sticky=False, clock=clock) as round_robin,
        GatewayLogFollower(tmp_path / "absent.jsonl", "absent", clock=clock) as absent,
    ):
        for follower in (affinity, round_robin, absent):
            follower.poll()
        registry = CollectorRegistry()
        registry.register(GatewayLogCollector([affinity, round_robin, absent]))

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(f"kvwatch_gateway_{name}", labels)

        aff = {"log": "affinity", "listener": "affinity"}
        rr = {"log": "round_robin", "listener": "round_robin"}
        assert value("requests_total", **aff, upstream=R1) == 2
        assert value("requests_total", **aff, upstream=R2) == 1
        assert value("responses_total", **aff, status_class="2xx") == 3
        assert value("requests_without_session_key_total", **aff) == 1
        assert value("assigned_session_ids_total", **aff) == 1
        assert value("failovers_total", **aff) == 1
        assert value("session_spread_sessions", **aff, failover="false") == 0
        assert value("session_spread_sessions", **aff, failover="true") == 0
        assert value("session_spread_sessions", **rr, failover="false") == 1
        assert value("returning_sessions", **aff) == 1
        assert value("returning_sessions", **rr) == 1
        assert value("active_sessions", **aff) == 2
        assert value("returning_requests_total", **aff) == 1
        assert value("moved_requests_total", **aff, failover="false") == 0
        # R2 served its first request after the session's previous one: a replica that joined
        assert value("moved_requests_total", **rr, failover="true") == 1
        assert value("malformed_lines_total", log="affinity", reason="invalid_json") == 1
        assert value("malformed_lines_total", log="round_robin", reason="too_long") == 0
        assert value("lines_total", log="affinity") == 4
        assert value("lines_total", log="absent") == 0
        assert value("evicted_sessions_total", log="affinity") == 0
        assert value("log_readable", log="affinity") == 1
        assert value("log_readable", log="absent") == 0
        assert value("log_unreadable_polls_total", log="absent", reason="not_found") == 1
        assert value("log_unreadable_polls_total", log="affinity", reason="not_found") == 0
        assert value("log_unread_bytes", log="affinity") == 0
        assert value("log_last_poll_timestamp_seconds", log="absent") == T0 + 1
        assert value("log_info", log="round_robin", expect_sticky="false", source="file") == 1
        assert value("log_info", log="affinity", expect_sticky="true", source="file") == 1

        exposition = generate_latest(registry).decode()
        assert "secret" not in exposition
        families = {family.name: family for family in text_string_to_metric_families(exposition)}
        assert families["kvwatch_gateway_requests"].type == "counter"
        assert families["kvwatch_gateway_active_sessions"].type == "gauge"
        assert all(name.startswith("kvwatch_gateway_") for name in families)


def test_listener_and_upstream_labels_stay_bounded_per_log_and_say_what_they_folded(log, follow):
    """10,000 upstreams or a 60 KB name must not become 10,000 series or a 60 KB label value."""
    many = MAX_VALUES_PER_LABEL + 100
    append(
        log,
        *(entry(f"s{i}", f"10.1.{i // 256}.{i % 256}:8000", listener=f"listener-{i}") for i in range(many)),
        entry("long-upstream", "10.9.9.9:" + "9" * 60_000),
        entry("long-listener", listener="l" * 60_000),
        entry("no-upstream", ""),  # "none" is always itself, whatever came first
        # Both upstreams are shown as "other", yet the session moved: it is spread.
        entry("mover", "10.2.0.1:8000", msec=T0),
        entry("mover", "10.2.0.2:8000", msec=T0 + 1),
    )
    follower = follow(clock=Clock(T0 + 2))
    snapshot = follower.poll()
    assert snapshot.lines == many + 5 and sum(snapshot.malformed.values()) == 0
    assert snapshot.folded_labels == {
        ("listener", "too_many_values"): many - MAX_VALUES_PER_LABEL + 4,
        ("listener", "too_long"): 1,
        ("upstream", "too_many_values"): many - MAX_VALUES_PER_LABEL + 3,
        ("upstream", "too_long"): 1,
    }
    assert snapshot.spread_sessions[OTHER, "false"] == 1
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([follower]))
    requests = next(
        family
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "kvwatch_gateway_requests"
    )
    listeners = {sample.labels["listener"] for sample in requests.samples}
    upstreams = {sample.labels["upstream"] for sample in requests.samples}
    assert len(listeners) == MAX_VALUES_PER_LABEL + 1 and len(upstreams) == MAX_VALUES_PER_LABEL + 2
    assert OTHER in listeners and {OTHER, "none"} <= upstreams
    assert max(map(len, listeners | upstreams)) <= MAX_LABEL_VALUE_LENGTH
    folded = {"log": "lab", "label": "upstream", "reason": "too_long"}
    assert registry.get_sample_value("kvwatch_gateway_label_values_folded_total", folded) == 1


def test_the_collector_shows_the_latest_poll_only(log, follow):
    follower = follow()
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([follower]))
    append(log, entry())
    assert registry.get_sample_value("kvwatch_gateway_lines_total", {"log": "lab"}) == 0
    follower.poll()
    assert registry.get_sample_value("kvwatch_gateway_lines_total", {"log": "lab"}) == 1


def test_log_names_are_short_unique_names(log, follow):
    with pytest.raises(ValueError, match="must be 1-64 letters"):
        GatewayLogFollower(log, "/var/log/nginx/access.log")
    with pytest.raises(ValueError, match="must be unique"):
        GatewayLogCollector([follow("lab"), follow("lab")])


def test_a_snapshot_cannot_be_changed(log, follow):
    append(log, entry())
    snapshot = follow().poll()
    with pytest.raises(AttributeError):
        snapshot.lines = 0
    with pytest.raises(TypeError):
        snapshot.requests["affinity", R1] = 0


# --- a real `kvwatch serve` -----------------------------------------------------------------------


@pytest.mark.integration
def test_serve_counts_a_normal_log_beside_a_fifo_and_stops_on_sigterm(tmp_path):
    fifo, normal = tmp_path / "fifo.jsonl", tmp_path / "normal.jsonl"
    os.mkfifo(fifo)
    append(normal, entry("a"), entry("b"))
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        yaml.safe_dump({
            "gateway_logs": [{"name": "fifo", "path": str(fifo)}, {"name": "normal", "path": str(normal)}],
            "exporter": {"listen": f"127.0.0.1:{port}"},
            "store": {"path": str(tmp_path / "kvwatch.db")},
        })
    )  # fmt: skip
    output = tmp_path / "serve.log"
    with output.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/-/healthy", process, output)
        found = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            exposition = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            found = {
                (s.name, s.labels.get("log")): s.value
                for family in text_string_to_metric_families(exposition)
                for s in family.samples
            }
            if found.get(("kvwatch_gateway_lines_total", "normal")):
                break
            time.sleep(0.1)
        assert found.get(("kvwatch_gateway_lines_total", "normal")) == 2, output.read_text()
        assert found[("kvwatch_gateway_log_readable", "fifo")] == 0
        os.kill(process.pid, signal.SIGTERM)  # before: the poll waited for a FIFO writer, and shutdown for it
        assert process.wait(timeout=5) == 0, output.read_text()
    finally:
        stop(process)
    assert output.read_text().count("gateway log fifo: cannot read") == 1
