"""Prometheus: it scrapes the lab, evaluates kvwatch's rules and alerts and sends to the lab's
Alertmanager, all in one process."""

from __future__ import annotations

from kvwatch.lab.metrics_stores.base import MetricsStore
from kvwatch.lab.process import Process, binary
from kvwatch.lab.state import LabState


def prometheus_process(state: LabState) -> Process:
    """Without --web.enable-lifecycle, which would let anyone stop it (POST /-/quit): the lab reloads it
    with SIGHUP. A cluster's of a lab of several clusters is an agent; the central one receives theirs."""
    d, port = state.directory, state.ports.prometheus
    argv = [
        binary("prometheus", "/usr/bin/prometheus"),
        f"--config.file={d}/prometheus.yml",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.external-url=http://127.0.0.1:{port}",
    ]
    if state.cluster:
        return Process(
            "prometheus",
            [*argv, "--enable-feature=agent", f"--storage.agent.path={d}/prometheus-data"],
            f"http://127.0.0.1:{port}/-/ready",
        )
    argv += [f"--storage.tsdb.path={d}/prometheus-data", "--storage.tsdb.retention.time=2d"]
    if state.clusters:
        argv.append("--web.enable-remote-write-receiver")
    if state.rule_time_scale != 1:  # Prometheus re-sends firing alerts every minute by default
        argv.append(f"--rules.alert.resend-delay={max(1, round(60 * state.rule_time_scale))}s")
    return Process("prometheus", argv, f"http://127.0.0.1:{port}/-/ready")


STORE = MetricsStore(
    "prometheus",
    "Prometheus scrapes, evaluates kvwatch's rules and alerts",
    lambda state: [prometheus_process(state)],
    scraper="prometheus",
    rule_engine="prometheus",
)
